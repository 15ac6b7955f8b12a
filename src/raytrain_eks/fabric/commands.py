"""The fabric commands: thin layers over :mod:`raytrain_eks.fabric.nccl_log` and :mod:`raytrain_eks.fabric.probe`.

raytrain-eks verify-transport /tmp/ray/session_latest/logs     # fails (exit 1) unless EFA carries inter-node traffic
kubectl logs -l ray.io/node-type=worker | raytrain-eks verify-transport --json
raytrain-eks verify-transport worker.log --require any          # report only; exit 2 when undecided
raytrain-eks verify-transport logs/ --instance-type p5.48xlarge --require-full-efa  # exit 1 on EFA used short
raytrain-eks probe --address auto                               # collective busbw vs the line rate; exit 1 if degraded
raytrain-eks probe --max-bytes 4M --iters 5 --json              # a quick local run (CPU, gloo)
raytrain-eks probe --pairs --address auto --json                # each pair of nodes on its own (`check` runs it)

Call :func:`register` once on the top-level Typer app to add the commands.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Console

from raytrain_eks import presets
from raytrain_eks.config import load_config
from raytrain_eks.errors import UserError
from raytrain_eks.fabric.deployment import read_deployment
from raytrain_eks.fabric.nccl_lines import LogInputError
from raytrain_eks.fabric.nccl_log import analyze_paths
from raytrain_eks.fabric.probe import (
    DEFAULT_ITERS,
    DEFAULT_MAX_BYTES,
    DEFAULT_MIN_BYTES,
    DEFAULT_WARMUP,
    HEALTHY_RATIO,
    OPS,
    ProbeSpec,
    format_size,
    parse_size,
    run_pair_probes,
    run_probe,
)
from raytrain_eks.instances import instance_type as known_instance_type
from raytrain_eks.options import AddressOpt, ConfigOpt, JsonOpt, PresetOpt, VerboseOpt
from raytrain_eks.ray_session import joined_address


class Require(StrEnum):
    """What ``--require`` accepts; ``any`` passes on every conclusive verdict."""

    efa = "efa"
    ib = "ib"
    any = "any"


def register(app: typer.Typer) -> None:
    """Add ``verify-transport`` and ``probe`` to ``app``. Example: ``register(cli.app)``."""
    app.command("verify-transport")(verify_transport)
    app.command("probe")(probe)


def verify_transport(
    paths: Annotated[
        list[str] | None,
        typer.Argument(
            help="NCCL log files or folders (searched recursively, .gz too), e.g. a copy of Ray's "
            "/tmp/ray/session_*/logs. '-' or nothing reads stdin.",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOpt = False,
    require: Annotated[
        Require,
        typer.Option(help="Fabric the inter-node traffic must use: efa, ib, or any (report only)."),
    ] = Require.efa,
    instance_type: Annotated[
        str | None,
        typer.Option(
            help="The GPU nodes' EC2 type (e.g. p5.48xlarge), to compare EFA devices and GPUDirect RDMA with what it "
            "offers. Default: the type aws-ofi-nccl logs ('Running on <type> platform'), if any.",
            show_default=False,
        ),
    ] = None,
    require_full_efa: Annotated[
        bool, typer.Option(help="Exit 1 when EFA is used short of what the instance type offers (default: report it).")
    ] = False,
) -> None:
    """Check from NCCL's NCCL_DEBUG=INFO log which network carried traffic between nodes, and how fully.

    Verdicts: efa, ib, socket (a fallback to TCP anywhere between nodes), single-node, inconclusive. On EFA, the
    fabric's use is compared with the instance type: EFA interfaces found and NET devices used, GPUDirect RDMA,
    channels; each shortfall is named with the lines that show it.

    Exit status: 0 when the verdict meets --require (and, with --require-full-efa, EFA is used in full), 1 when it
    does not, 2 when the log cannot decide.
    """
    if instance_type is not None:
        known_instance_type(instance_type)  # an unknown type stops here, naming the known ones
    paths = paths or []
    if not paths and sys.stdin.isatty():
        raise LogInputError(
            "no NCCL log given",
            hint="Pass log files or folders (for example a copy of /tmp/ray/session_latest/logs), "
            "or pipe a log into the command: kubectl logs POD | raytrain-eks verify-transport",
        )
    with _progress() as progress:
        report = analyze_paths(paths, progress=progress, instance_type=instance_type)
    typer.echo(report.to_json(require.value) if json_output else report.render(require.value))
    code = report.exit_code(require.value)
    if require_full_efa and code == 0 and report.usage.findings:
        code = 1
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


def probe(
    address: AddressOpt = None,
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    num_workers: Annotated[
        int | None, typer.Option(help="Ranks; 0 = one per GPU (2 on CPU). Default: training.num_workers.")
    ] = None,
    ops: Annotated[str, typer.Option(help=f"Comma-separated collectives, from: {', '.join(OPS)}.")] = ",".join(OPS),
    min_bytes: Annotated[
        str, typer.Option(help="Smallest message (bytes, or with K/M/G); sizes double up to --max-bytes.")
    ] = format_size(DEFAULT_MIN_BYTES).replace(" ", ""),
    max_bytes: Annotated[str, typer.Option(help="Largest message.")] = format_size(DEFAULT_MAX_BYTES).replace(" ", ""),
    iters: Annotated[int, typer.Option(help="Timed calls per size.")] = DEFAULT_ITERS,
    warmup: Annotated[int, typer.Option(help="Untimed calls per size before timing.")] = DEFAULT_WARMUP,
    expected_gbps: Annotated[
        float | None,
        typer.Option(
            help="Line rate in Gbit/s to compare with (default: fabric.expected_gbps, else the network rate of "
            "the GPU nodes' instance type on a cluster this tool deployed)."
        ),
    ] = None,
    healthy_ratio: Annotated[
        float, typer.Option(help="busbw / line rate at or above which the fabric is healthy.")
    ] = HEALTHY_RATIO,
    pairs: Annotated[
        bool, typer.Option("--pairs", help="Each pair of nodes on its own, every GPU of both (--num-workers unused).")
    ] = False,
    json_output: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Measure all_reduce, all_gather and reduce_scatter bandwidth across the Ray Train workers.

    Bandwidth as nccl-tests computes it (algbw = bytes / time; busbw = algbw x 2(n-1)/n for all_reduce, (n-1)/n
    for all_gather and reduce_scatter). The best large-message busbw is compared with the expected line rate.

    Exit status: 0 healthy, 1 degraded, 2 undecided (all ranks on one node, or no line rate known).
    """
    if not 0 < healthy_ratio <= 1:
        raise UserError(f"--healthy-ratio {healthy_ratio} must be in (0, 1]")
    spec = ProbeSpec(
        ops=tuple(op.strip() for op in ops.split(",") if op.strip()),
        min_bytes=parse_size(min_bytes),
        max_bytes=parse_size(max_bytes),
        iters=iters,
        warmup=warmup,
    )
    err = Console(stderr=True, highlight=False)
    address = joined_address(address, err.print)  # inside a Ray cluster's pod, that cluster (as `train` does)
    cfg = load_config(preset=presets.choose(preset, address=address), path=config)
    if pairs:
        deployed = read_deployment(config) if address is not None else None
        found = run_pair_probes(
            cfg,
            spec,
            address=address,
            expected_gbps=expected_gbps,
            healthy_ratio=healthy_ratio,
            say=err.print,
            verbose=verbose,
            deployed=deployed,
        )
        typer.echo(found.to_json() if json_output else found.render())
        if found.exit_code:
            raise typer.Exit(found.exit_code)
        return
    report = run_probe(
        cfg,
        spec,
        address=address,
        num_workers=num_workers,
        expected_gbps=expected_gbps,
        healthy_ratio=healthy_ratio,
        say=err.print,
        verbose=verbose,
        deployed=read_deployment(config) if address is not None else None,
    )
    typer.echo(report.to_json() if json_output else report.render())
    if report.exit_code:
        raise typer.Exit(report.exit_code)
