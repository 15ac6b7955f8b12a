"""The ``raytrain-eks verify-transport`` command: a thin layer over :mod:`raytrain_eks.fabric.nccl_log`.

raytrain-eks verify-transport /tmp/ray/session_latest/logs     # fails (exit 1) unless EFA carries inter-node traffic
kubectl logs -l ray.io/node-type=worker | raytrain-eks verify-transport --json
raytrain-eks verify-transport worker.log --require any          # report only; exit 2 when undecided

Call :func:`register` once on the top-level Typer app to add the command.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Console

from raytrain_eks.fabric.nccl_log import LogInputError, analyze_paths


class Require(StrEnum):
    """What ``--require`` accepts; ``any`` passes on every conclusive verdict."""

    efa = "efa"
    ib = "ib"
    any = "any"


def register(app: typer.Typer) -> None:
    """Add ``verify-transport`` to ``app``. Example: ``register(cli.app)``."""
    app.command("verify-transport")(verify_transport)


def verify_transport(
    paths: Annotated[
        list[str] | None,
        typer.Argument(
            help="NCCL log files or folders (searched recursively, .gz too), e.g. a copy of Ray's "
            "/tmp/ray/session_*/logs. '-' or nothing reads stdin.",
            show_default=False,
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    require: Annotated[
        Require,
        typer.Option(help="Fabric the inter-node traffic must use: efa, ib, or any (report only)."),
    ] = Require.efa,
) -> None:
    """Check from NCCL's NCCL_DEBUG=INFO log which network carried traffic between nodes.

    Verdicts: efa, ib, socket (a fallback to TCP anywhere between nodes), single-node, inconclusive.

    Exit status: 0 when the verdict meets --require, 1 when it does not, 2 when the log cannot decide.
    """
    paths = paths or []
    if not paths and sys.stdin.isatty():
        raise LogInputError(
            "no NCCL log given",
            hint="Pass log files or folders (for example a copy of /tmp/ray/session_latest/logs), "
            "or pipe a log into the command: kubectl logs POD | raytrain-eks verify-transport",
        )
    with _progress() as progress:
        report = analyze_paths(paths, progress=progress)
    typer.echo(report.to_json(require.value) if json_output else report.render(require.value))
    code = report.exit_code(require.value)
    if code:
        raise typer.Exit(code)


@contextlib.contextmanager
def _progress() -> Iterator[Callable[[int], None] | None]:
    # Multi-GB logs take a while; show how much was read, on stderr and only on a terminal, so that --json
    # output and pipes stay clean.
    err = Console(stderr=True, highlight=False)
    if not err.is_terminal:
        yield None
        return
    with err.status("reading NCCL logs ...") as status:

        def update(nbytes: int) -> None:
            status.update(f"reading NCCL logs: {nbytes / 1e6:,.0f} MB")

        yield update
