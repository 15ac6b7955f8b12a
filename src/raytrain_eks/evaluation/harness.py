"""EleutherAI's lm-evaluation-harness (``lm-eval``) behind three calls: which tasks a list of names means, one
worker's scores on its share of each task's examples, and the merge of every worker's scores into each task's
metrics.

A worker returns each example's own metric values (lm-eval's logged samples), never a mean; the merge applies the
task's own aggregation (``Task.aggregation()``: ``mean`` for accuracy) and standard error
(``lm_eval.api.metrics.stderr_for_metric``) to the values of all examples, as lm-eval does in one process
(``evaluator_utils._compute_task_aggregations``): N workers give the figures one process gives. Example::

    tasks = load_tasks(["raytrain_sample_mc"], [])            # {name: TaskInfo}; UserError for an unknown name
    shares = split_examples(tasks, workers=2, limit=None)     # [{name: [0, 2, ...]}, {name: [1, 3, ...]}]
    scored = [score_share(model_dir, share, []) for share in shares]
    merge(tasks, scored)                                      # {name: TaskResult(n=32, metrics={"acc": ...})}
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from raytrain_eks.errors import UserError

# The task files shipped with the package (a task YAML and its jsonl data each): found without the Hub.
SHIPPED_TASKS = Path(str(resources.files("raytrain_eks.resources") / "eval_tasks"))
INSTALL_HINT = "Install it: pip install 'raytrain-eks[eval]' (lm-eval==0.4.13)."
# Draws of the bootstrap for metrics without a closed-form standard error (lm-eval's own default).
BOOTSTRAP_ITERS = 100_000
# lm-eval's filter of a task without filters: the part after the comma of its result keys ("acc,none").
NO_FILTER = "none"
# Examples scored together on one device (lm-eval's batch_size): what a small GPU holds for short multiple-choice
# contexts; --batch-size changes it.
BATCH_SIZE = 8
# Doc ids one worker scores, per task name.
Share = dict[str, list[int]]
# One worker's scores: per task name, (doc id, {metric: value}) for every example it scored.
Scored = dict[str, list[tuple[int, dict[str, Any]]]]


@dataclass(frozen=True)
class TaskInfo:
    """A leaf task of the request: its example count, version, few-shot count and how its metrics aggregate."""

    name: str
    examples: int
    version: Any
    num_fewshot: int
    higher_is_better: dict[str, bool]
    aggregation: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class TaskResult:
    """One task's figures: ``n`` examples scored, and per metric its value and standard error (``None``: none)."""

    n: int
    metrics: dict[str, tuple[float, float | None]]
    version: Any = None
    num_fewshot: int = 0
    higher_is_better: dict[str, bool] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The task's entry of ``eval.json``."""
        return {
            "n": self.n,
            "version": self.version,
            "num_fewshot": self.num_fewshot,
            "metrics": {
                name: {"value": value, "stderr": stderr, "higher_is_better": self.higher_is_better.get(name)}
                for name, (value, stderr) in self.metrics.items()
            },
        }


def _lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise UserError("lm-eval (EleutherAI's lm-evaluation-harness) is not installed", hint=INSTALL_HINT) from None
    # lm-eval logs each step of every task at INFO; the command prints its own lines.
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    task_log = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _CustomDatasetNote) for f in task_log.filters):
        task_log.addFilter(_CustomDatasetNote())
    return lm_eval


class _CustomDatasetNote(logging.Filter):
    """Leaves out the warning lm-eval gives for every task whose data a function reads (``custom_dataset``, as the
    shipped tasks' does: ``api/task.py``'s ``download``): it offers ``--metadata``, which those tasks do not read."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def task_manager(names: list[str], include_paths: list[Path]) -> Any:
    """lm-eval's ``TaskManager`` over the shipped tasks and the folders of ``include_paths``; over lm-eval's own
    tasks too when ``names`` are not all among those (indexing its thousands of task files takes seconds)."""
    _lm_eval()
    from lm_eval.tasks import TaskManager

    for path in include_paths:
        if not path.is_dir():
            raise UserError(f"task folder {path} does not exist", hint="Give a folder holding lm-eval task YAML files.")
    paths = [str(SHIPPED_TASKS), *map(str, include_paths)]
    local = TaskManager(include_path=paths, include_defaults=False)
    if all(name in set(local.all_tasks) for name in names):
        return local
    return TaskManager(include_path=paths)


def check_task_names(names: list[str], manager: Any) -> None:
    """A :class:`UserError` naming every task of ``names`` that ``manager`` does not know (before a model loads)."""
    if not names:
        raise UserError("no task given", hint="Name one or more lm-eval tasks: --tasks raytrain_sample_mc,hellaswag")
    known = set(manager.all_tasks)
    unknown = [name for name in names if name not in known]
    if unknown:
        shipped = sorted(p.stem for p in SHIPPED_TASKS.glob("*.yaml"))
        raise UserError(
            f"unknown lm-eval task(s): {', '.join(unknown)}",
            hint=f"Shipped here: {', '.join(shipped)}; lm-eval's own are listed by `lm-eval ls tasks`; a task YAML "
            "of your own goes in a folder given with --include-path.",
        )


def load_tasks(names: list[str], include_paths: list[Path]) -> dict[str, TaskInfo]:
    """The leaf tasks ``names`` stand for (a group stands for its tasks), with their datasets' example counts."""
    manager = task_manager(names, include_paths)
    check_task_names(names, manager)
    loaded = manager.load(names)["tasks"]
    out = {}
    for name, task in sorted(loaded.items()):
        config = task.config
        out[name] = TaskInfo(
            name=name,
            examples=len(task.eval_docs),
            version=(config.metadata or {}).get("version"),
            num_fewshot=int(config.num_fewshot or 0),
            higher_is_better=dict(task.higher_is_better()),
            aggregation=dict(task.aggregation()),
        )
    return out


def split_examples(tasks: dict[str, TaskInfo], workers: int, limit: int | None) -> list[Share]:
    """Each worker's doc ids of each task: the first ``limit`` examples (all without one), dealt round-robin, so
    every example is scored once and the shares differ by at most one example.

    >>> info = TaskInfo("t", 5, 1, 0, {}, {})
    >>> split_examples({"t": info}, 2, None)
    [{'t': [0, 2, 4]}, {'t': [1, 3]}]
    """
    shares: list[Share] = [{} for _ in range(workers)]
    for name, task in tasks.items():
        count = task.examples if limit is None else min(limit, task.examples)
        for rank in range(workers):
            ids = list(range(rank, count, workers))
            if ids:
                shares[rank][name] = ids
    return [share for share in shares if share]


def score_share(
    model_dir: str, share: Share, include_paths: list[str], *, batch_size: int = BATCH_SIZE, device: str | None = None
) -> Scored:
    """Score the examples of ``share`` with the model folder ``model_dir`` (lm-eval's ``HFLM``): each example's
    metric values, by task. ``device``: ``cuda`` where there is a GPU, else ``cpu``."""
    _lm_eval()
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = HFLM(pretrained=model_dir, device=device, batch_size=batch_size)
    manager = task_manager(sorted(share), [Path(p) for p in include_paths])
    found = simple_evaluate(
        model,
        tasks=sorted(share),
        samples=share,
        task_manager=manager,
        bootstrap_iters=0,  # the merge computes the standard errors, over every worker's examples
        log_samples=True,
        verbosity="WARNING",
    )
    if found is None:  # lm-eval returns nothing on the ranks other than its own rank 0; this is one process
        raise RuntimeError("lm-eval returned no results")
    scored: Scored = {}
    for name, samples in found["samples"].items():
        rows = [s for s in samples if s.get("filter", NO_FILTER) == NO_FILTER]
        scored[name] = [(int(s["doc_id"]), {m: s[m] for m in s.get("metrics", [])}) for s in rows]
    return scored


def merge(tasks: dict[str, TaskInfo], scored: list[Scored]) -> dict[str, TaskResult]:
    """Each task's metrics over the examples of every share in ``scored``: the task's aggregation of all the
    examples' values (in doc order) and its standard error, as lm-eval computes them in one process."""
    _lm_eval()
    from lm_eval.api.metrics import mean, stderr_for_metric

    out = {}
    for name, task in tasks.items():
        rows = sorted((row for part in scored for row in part.get(name, [])), key=lambda row: row[0])
        metrics: dict[str, tuple[float, float | None]] = {}
        for metric in dict.fromkeys(m for _, values in rows for m in values):
            items = [values[metric] for _, values in rows if metric in values]
            aggregate = task.aggregation.get(metric, mean)
            stderr_fn = stderr_for_metric(metric=aggregate, bootstrap_iters=BOOTSTRAP_ITERS)
            stderr = stderr_fn(items) if stderr_fn is not None and len(items) > 1 else None
            metrics[metric] = (float(aggregate(items)), None if stderr is None or math.isnan(stderr) else stderr)
        out[name] = TaskResult(
            n=len(rows),
            metrics=metrics,
            version=task.version,
            num_fewshot=task.num_fewshot,
            higher_is_better=task.higher_is_better,
        )
    return out
