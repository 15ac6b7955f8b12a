"""Deploy commands of the ``raytrain-eks`` CLI; :func:`register` adds them to the app.

raytrain-eks plan                              # the steps and the hourly cost, nothing written
raytrain-eks plan --output-dir plan-out        # plus every file deploy would apply, and plan.json
raytrain-eks plan --mode rayjob -o plan-out    # a RayJob (cluster deleted when the job ends) instead

``plan`` is pure: no AWS credentials, and none of eksctl, helm or kubectl, are needed. Example::

    app = typer.Typer()
    register(app)
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated, cast

import typer
from rich.console import Console

from raytrain_eks import presets
from raytrain_eks.config import DEFAULT_CONFIG_FILE, load_config
from raytrain_eks.errors import UserError


class PlanMode(StrEnum):
    raycluster = "raycluster"
    rayjob = "rayjob"


def register(app: typer.Typer) -> None:
    """Add ``plan`` to ``app``."""
    app.command()(plan)


def plan(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help=f"YAML configuration (default: ./{DEFAULT_CONFIG_FILE} if present)."),
    ] = None,
    preset: Annotated[
        str, typer.Option(help=f"Starting point under the file: {', '.join(presets.PRESETS)}.")
    ] = "reference",
    output_dir: Annotated[
        Path | None,
        typer.Option("--output-dir", "-o", help="Write every file deploy would apply, and plan.json, here."),
    ] = None,
    mode: Annotated[
        PlanMode, typer.Option(help="raycluster: a long-lived cluster the job is submitted to; rayjob: one job.")
    ] = PlanMode.raycluster,
) -> None:
    """Show what deploy would create, apply and submit, and its cost per hour. Needs no credentials."""
    from raytrain_eks.plan import Mode, build_plan, write_plan

    if preset not in presets.PRESETS:
        raise UserError(f"--preset {preset!r} is not known; choose one of: {', '.join(presets.PRESETS)}")
    cfg = load_config(preset=presets.PRESETS[preset](), path=config)
    # Only whether a token is there: its value stays in this process's environment until deploy sends it.
    hf_token = bool(os.environ.get("HF_TOKEN"))
    chosen = cast("Mode", mode.value)
    written: list[Path] = []
    if output_dir is None:
        result = build_plan(cfg, mode=chosen, hf_token=hf_token)
    else:
        result, written = write_plan(cfg, output_dir, mode=chosen, hf_token=hf_token)

    out = Console(highlight=False, soft_wrap=True)
    out.print(f"[bold]Plan[/] ({result.mode}) for cluster {cfg.cluster.name} in {cfg.cluster.region}:")
    for i, step in enumerate(result.steps, 1):
        out.print(f"{i:>2}. [bold]{step.name}[/]: {step.action}")
    for note in result.assumptions:
        out.print(f"[yellow]assumption:[/] {note}")
    cost = result.cost
    out.print(f"[bold]Cost per hour[/] ({cost['price_region']} on-demand): ${cost['total_usd']:.2f}")
    for item in cost["items"]:
        usd = "price unknown" if item["usd_per_hour"] is None else f"${item['usd_per_hour']:.4f}"
        out.print(f"  {item['name']}: {item['count']} x {item['what']} = {usd}")
    if output_dir is not None:
        names = ", ".join(str(p.relative_to(output_dir)) for p in written)
        out.print(f"Wrote {len(written)} files to {output_dir}: {names}")
    else:
        out.print("Nothing written; add --output-dir DIR for the files.")
