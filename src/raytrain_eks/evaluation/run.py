"""``raytrain-eks eval``'s steps: which model a folder holds, the tasks checked before it loads, the examples scored
in this process or by Ray workers (one GPU each where the Ray cluster has GPUs), and ``eval.json``.

A run folder's model is its export, ``RUN/model`` (what ``train`` writes at the end, or ``raytrain-eks export RUN
RUN/model``); its results go to ``RUN/eval.json``, where the report and the run bundle find them. Example::

    target = resolve_target(Path("runs/my-run"))          # EvalTarget(model_dir=runs/my-run/model, ...)
    tasks = harness.load_tasks(["raytrain_sample_mc"], [])
    results = evaluate(target.model_dir, tasks, workers=2)  # Ray tasks when workers > 1 (Ray must be up)
    write_results(target.results_file, target.model_dir, results, workers=2, limit=None)
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from raytrain_eks.errors import UserError
from raytrain_eks.evaluation import harness
from raytrain_eks.evaluation.harness import TaskInfo, TaskResult
from raytrain_eks.folders import EVAL_RESULTS

RUN_MODEL = "model"  # a run's export folder (train.launch writes RUN_DIR/model)
# Files that make a folder a run folder: what every run writes first.
RUN_MARKS = ("config.yaml", "metrics.jsonl", "run.json")
MODEL_CONFIG = "config.json"  # a Hugging Face model folder's architecture file
ADAPTER_CONFIG = "adapter_config.json"  # a peft adapter folder's (train.lora.ADAPTER_CONFIG)


@dataclass(frozen=True)
class EvalTarget:
    """The model folder to score, and where its ``eval.json`` goes (a run's own folder, else the model folder)."""

    model_dir: Path
    results_file: Path
    run_dir: Path | None = None


def resolve_target(path: Path) -> EvalTarget:
    """The model a folder holds: a Hugging Face model folder, or a run folder's export. A :class:`UserError`, before
    any model loads, for a missing folder, a run without an export, an adapters-only folder or no model at all."""
    if not path.is_dir():
        raise UserError(
            f"{path} is not a folder", hint="Give a run folder (runs/...) or a Hugging Face model folder to evaluate."
        )
    if (path / MODEL_CONFIG).is_file():
        return EvalTarget(model_dir=path, results_file=path / EVAL_RESULTS)
    if (path / RUN_MODEL / MODEL_CONFIG).is_file():
        return EvalTarget(model_dir=path / RUN_MODEL, results_file=path / EVAL_RESULTS, run_dir=path)
    if (path / ADAPTER_CONFIG).is_file():
        raise UserError(
            f"{path} holds LoRA adapters alone, not a model",
            hint="Export the run merged into its base (raytrain-eks export RUN OUT, without --adapter-only) and "
            "evaluate that folder.",
        )
    if any((path / mark).exists() for mark in RUN_MARKS):
        raise UserError(
            f"the run {path} has no exported model ({path / RUN_MODEL} is missing)",
            hint=f"Export it first: raytrain-eks export {path} {path / RUN_MODEL}",
        )
    raise UserError(
        f"{path} holds no model: neither {MODEL_CONFIG} nor a run's {RUN_MODEL}/ folder",
        hint="Give a run folder whose training exported its model, or a Hugging Face model folder.",
    )


def evaluate(
    model_dir: Path,
    tasks: dict[str, TaskInfo],
    *,
    workers: int = 1,
    limit: int | None = None,
    include_paths: list[Path] | None = None,
    batch_size: int = harness.BATCH_SIZE,
    on_ray: bool | None = None,
    ship_model: bool = False,
) -> dict[str, TaskResult]:
    """Score ``tasks`` with the model in ``model_dir``: in this process with one worker, else (or with ``on_ray``)
    as ``workers`` Ray tasks (Ray must be up; one GPU each where the cluster has GPUs), each on a disjoint share of
    every task's examples; the shares' scores merged into each task's metrics (:func:`harness.merge`). With
    ``ship_model`` the Ray workers get the model's files through Ray (their nodes need not see ``model_dir``)."""
    shares = harness.split_examples(tasks, workers, limit)
    paths = [str(p) for p in include_paths or []]
    if not (workers > 1 if on_ray is None else on_ray):
        scored = [harness.score_share(str(model_dir), share, paths, batch_size=batch_size) for share in shares]
    else:
        scored = _score_on_ray(str(model_dir), shares, paths, batch_size, ship_model)
    return harness.merge(tasks, scored)


def _score_on_ray(
    model_dir: str, shares: list[harness.Share], paths: list[str], batch_size: int, ship_model: bool
) -> list[Any]:
    import ray

    if not ray.is_initialized():
        raise RuntimeError("evaluation on several workers needs Ray up (ray_session.init_ray)")
    gpus = ray.cluster_resources().get("GPU", 0)
    # A GPU per worker where there are GPUs, so two shares never share a device; else a CPU each.
    resources: dict[str, Any] = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    if ship_model:  # the workers' nodes may not see this folder: its files go through Ray's object store, once
        model = ray.put(model_files(Path(model_dir)))
        task = ray.remote(_score_shipped).options(**resources)
        refs = [task.remote(model, share, paths, batch_size) for share in shares]
    else:
        task = ray.remote(harness.score_share).options(**resources)
        refs = [task.remote(model_dir, share, paths, batch_size=batch_size) for share in shares]
    return list(ray.get(refs))


def model_files(model_dir: Path) -> dict[str, bytes]:
    """The model folder's files (relative path -> bytes), to be written out where a worker runs."""
    return {p.relative_to(model_dir).as_posix(): p.read_bytes() for p in sorted(model_dir.rglob("*")) if p.is_file()}


def _score_shipped(files: dict[str, bytes], share: harness.Share, paths: list[str], batch_size: int) -> harness.Scored:
    """:func:`harness.score_share` on a model sent as its files: written to a folder of this worker's own first."""
    with tempfile.TemporaryDirectory(prefix="raytrain-eks-eval-") as tmp:
        for rel, data in files.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_bytes(data)
        return harness.score_share(tmp, share, paths, batch_size=batch_size)


def write_results(
    path: Path,
    model_dir: Path,
    results: dict[str, TaskResult],
    *,
    workers: int,
    limit: int | None,
    wall_s: float | None = None,
) -> Path:
    """Write ``eval.json``: the model, how it was scored, and each task's ``n``, metrics and standard errors."""
    from importlib.metadata import version

    doc = {
        "model": str(model_dir),
        "evaluated": f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}",
        "lm_eval": version("lm-eval"),
        "workers": workers,
        "limit": limit,
        "wall_s": wall_s,
        "tasks": {name: result.as_dict() for name, result in results.items()},
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def read_results(path: Path) -> dict[str, Any] | None:
    """``eval.json``'s content, or ``None`` where the folder has none."""
    return json.loads(path.read_text()) if path.is_file() else None


def table_rows(doc: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """``eval.json``'s figures as rows of text: task, metric, value, standard error, examples.

    >>> table_rows({"tasks": {"t": {"n": 4, "metrics": {"acc": {"value": 0.25, "stderr": 0.25}}}}})
    [('t', 'acc', '0.2500', '± 0.2500', '4')]
    """
    rows = []
    for name, task in doc.get("tasks", {}).items():
        for metric, figures in task.get("metrics", {}).items():
            stderr = figures.get("stderr")
            rows.append(
                (name, metric, f"{figures['value']:.4f}", "" if stderr is None else f"± {stderr:.4f}", str(task["n"]))
            )
    return rows


def evaluate_run(run_dir: Path, task_names: list[str], *, workers: int, say: Any = print) -> dict[str, Any]:
    """``train --eval-tasks``: evaluate the run's export on ``task_names``, write ``RUN/eval.json`` and say each
    figure; returns ``eval.json``'s content. A cluster job's driver (no GPU of its own, in a Ray cluster that has
    GPUs) scores on ``workers`` Ray workers, a GPU each, sending them the model; elsewhere this process scores."""
    target = resolve_target(run_dir)
    tasks = harness.load_tasks(task_names, [])
    on_ray = _gpu_workers()
    start = time.perf_counter()
    results = evaluate(target.model_dir, tasks, workers=workers if on_ray else 1, on_ray=on_ray, ship_model=on_ray)
    path = write_results(
        target.results_file,
        target.model_dir,
        results,
        workers=workers if on_ray else 1,
        limit=None,
        wall_s=time.perf_counter() - start,
    )
    doc = read_results(path) or {}
    for task, metric, value, stderr, n in table_rows(doc):
        say(f"eval: {task} {metric} {value} {stderr} (n={n})".replace("  ", " "))
    return doc


def _gpu_workers() -> bool:
    """Whether this process is without a GPU in a Ray cluster that has some: a cluster job's driver, in the head
    pod. A local run's Ray may be stopping by now (its training is over): scored in this process."""
    import torch

    if torch.cuda.is_available():
        return False
    import ray

    try:
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    except Exception:  # a Ray going down as it is asked
        return False
