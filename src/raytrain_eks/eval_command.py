"""``raytrain-eks eval MODEL_OR_RUN --tasks a,b``: a trained model scored on lm-evaluation-harness tasks.

raytrain-eks eval runs/my-run --tasks raytrain_sample_mc               # the run's export, in this process
raytrain-eks eval runs/my-run --tasks raytrain_sample_mc --workers 2   # two Ray workers, a share of the examples each
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from raytrain_eks.errors import UserError
from raytrain_eks.evaluation import harness
from raytrain_eks.evaluation import run as evaluation
from raytrain_eks.folders import EVAL_RESULTS
from raytrain_eks.options import AddressOpt, VerboseOpt


def eval_command(
    model_or_run: Annotated[
        Path,
        typer.Argument(help="A run folder (its exported model/) or a Hugging Face model folder.", show_default=False),
    ],
    tasks: Annotated[
        str,
        typer.Option(
            help="lm-eval tasks, comma-separated: shipped (raytrain_sample_mc), lm-eval's own, or in --include-path.",
            show_default=False,
        ),
    ],
    workers: Annotated[
        int, typer.Option(min=1, help="Ray workers, each scoring a share of every task's examples (a GPU each).")
    ] = 1,
    limit: Annotated[int | None, typer.Option(min=1, help="Score only the first K examples of each task.")] = None,
    include_path: Annotated[
        list[Path] | None, typer.Option(help="A folder of lm-eval task YAML files of your own (repeatable).")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Examples scored together on a device.")] = harness.BATCH_SIZE,
    output: Annotated[
        Path | None, typer.Option(help="Where to write eval.json (default: in the run folder, or the model folder).")
    ] = None,
    address: AddressOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Score a trained model on lm-evaluation-harness tasks; write eval.json and print a table of the results."""
    out = Console(highlight=False, soft_wrap=True)
    names = [name.strip() for name in tasks.split(",") if name.strip()]
    target = evaluation.resolve_target(model_or_run)
    paths = list(include_path or [])
    found = harness.load_tasks(names, paths)  # an unknown task stops here, before the model loads
    on_ray = workers > 1 or address is not None
    start = time.perf_counter()
    with _ray(on_ray, address, workers, verbose):
        results = evaluation.evaluate(
            target.model_dir,
            found,
            workers=workers,
            limit=limit,
            include_paths=[p.resolve() for p in paths],
            batch_size=batch_size,
            on_ray=on_ray,
            ship_model=address is not None,  # a cluster's workers do not see this machine's folders
        )
    path = evaluation.write_results(
        output or target.results_file,
        target.model_dir,
        results,
        workers=workers,
        limit=limit,
        wall_s=time.perf_counter() - start,
    )
    out.print(_table(evaluation.read_results(path) or {}))
    out.print(f"results: {path.resolve()}")
    if target.run_dir is not None and output is None:
        _into_bundle(target.run_dir, out)


@contextlib.contextmanager
def _ray(wanted: bool, address: str | None, workers: int, verbose: bool) -> Iterator[None]:
    """Ray for the workers, when there are Ray workers: joined or started here, and left (shut down) at the end."""
    if not wanted:
        yield
        return
    import ray

    from raytrain_eks.ray_session import init_ray

    init_ray(address, workers, verbose)
    try:
        yield
    finally:
        ray.shutdown()


def _table(doc: dict[str, Any]) -> Table:
    table = Table(title=f"{doc.get('model', '')}", title_justify="left")
    for column, justify in (("task", "left"), ("metric", "left"), ("value", "right"), ("stderr", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    table.add_column("n", justify="right")
    for row in evaluation.table_rows(doc):
        table.add_row(*row)
    return table


def _into_bundle(run_dir: Path, out: Console) -> None:
    """A run kept in storage (training.storage_path) gets the new eval.json in its bundle too."""
    import yaml

    from raytrain_eks.train.bundle import put_run_file

    config = run_dir / "config.yaml"
    try:
        settings = yaml.safe_load(config.read_text()) if config.is_file() else None
    except yaml.YAMLError as exc:
        raise UserError(f"{config} is not valid YAML: {exc}", hint="It is the run's own; restore it.") from None
    storage = ((settings or {}).get("training") or {}).get("storage_path")
    if storage:
        out.print(f"run bundle: {put_run_file(run_dir, storage, EVAL_RESULTS)}")
