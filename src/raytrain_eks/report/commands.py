"""``raytrain-eks report``: the HTML report of one run or several (overlaid)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command()(report)


def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run folders; two or more are overlaid.", show_default=False)],
    out: Annotated[
        Path | None,
        typer.Option(help="Folder for report.html and plots/ (default: the run folder; ./report for several)."),
    ] = None,
) -> None:
    """Write report.html: curves, evaluation, samples, checkpoints, cost, fabric verdict and configuration."""
    from rich.console import Console

    from raytrain_eks.report.html import write_report

    target = out or (run_dirs[0] if len(run_dirs) == 1 else Path("report"))
    path = write_report(run_dirs, target)
    Console(highlight=False, soft_wrap=True).print(f"report: {path.resolve()}")
