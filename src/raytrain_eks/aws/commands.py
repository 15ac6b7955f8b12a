"""The ``raytrain-eks capacity`` command: a thin layer over :mod:`raytrain_eks.aws.capacity`.

raytrain-eks capacity                               # the configured region: every zone, ranked
raytrain-eks capacity --regions us-east-1,us-west-2 # compare regions
raytrain-eks capacity --all-regions --json          # every enabled region, as JSON
raytrain-eks capacity --probe                       # also reserve the capacity for a moment, then cancel it
raytrain-eks capacity --blocks --block-hours 48     # Capacity Block offerings for the GPU type and count
raytrain-eks capacity --blocks --buy-block cb-0123  # buy one (asks first; --yes does not ask)

Exit status: 0 when the configured region (and GPU_AZ) can take the GPU node group, 1 when it cannot (quota short,
no capacity), 2 for bad input. Call :func:`register` once on the top-level Typer app::

    app = typer.Typer()
    register(app)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from raytrain_eks import presets
from raytrain_eks.aws.market import Market
from raytrain_eks.aws.services import Services
from raytrain_eks.aws.session import Aws
from raytrain_eks.config import Config, load_config
from raytrain_eks.options import ClusterPresetOpt, ConfigOpt, JsonOpt, StateDirOpt, YesOpt

if TYPE_CHECKING:
    from raytrain_eks.aws.capacity import CapacityReport
    from raytrain_eks.aws.market import Window
    from raytrain_eks.k8s.state import StateStore

BlocksOpt = Annotated[
    bool,
    typer.Option(
        "--blocks", help="List the Capacity Block for ML offerings for the GPU type and node count, cheapest first."
    ),
]
BlockHoursOpt = Annotated[int, typer.Option("--block-hours", help="How long the Capacity Block runs, in hours.")]
BlockDaysOpt = Annotated[
    int, typer.Option("--block-days", help="The block starts and ends within this many days from now.")
]
BuyBlockOpt = Annotated[
    str | None,
    typer.Option(
        "--buy-block",
        help="Buy this offering (an id --blocks lists, same window options): its fee is charged at once. Asks "
        "first unless --yes.",
    ),
]
SpotDaysOpt = Annotated[int, typer.Option("--spot-days", help="Days of spot price history to read for spot.")]


def register(
    app: typer.Typer,
    *,
    services: Callable[[Aws], Services] | None = None,
    market: Callable[[Aws], Market] | None = None,
) -> None:
    """Add ``capacity`` to ``app``. ``services`` makes the quota, spot-score and reservation interfaces from the
    session, ``market`` the Capacity Block and spot price ones; the default is the boto3 ones (tests pass the
    fakes of tests/fake_aws.py)."""

    def capacity(
        config: ConfigOpt = None,
        preset: ClusterPresetOpt = "reference",
        regions: Annotated[
            str | None,
            typer.Option(
                help="Comma-separated regions to check instead of the configured one, e.g. us-east-1,us-west-2."
            ),
        ] = None,
        all_regions: Annotated[
            bool, typer.Option("--all-regions", help="Check every region enabled for the account.")
        ] = False,
        probe: Annotated[
            bool,
            typer.Option(
                "--probe",
                help="Also create an on-demand capacity reservation in the best zones (configured ones first) and "
                "cancel it at once, until one succeeds: proof EC2 has the instances now, billed for those seconds.",
            ),
        ] = False,
        json_output: JsonOpt = False,
        blocks: BlocksOpt = False,
        block_hours: BlockHoursOpt = 24,
        block_days: BlockDaysOpt = 14,
        buy_block: BuyBlockOpt = None,
        yes: YesOpt = False,
        spot_days: SpotDaysOpt = 7,
        state_dir: StateDirOpt = Path(".raytrain-eks"),
    ) -> None:
        """Check where the GPU node group can get capacity: offerings, EFA, vCPU quota, spot score, subnets.

        For the configured GPU type and count, in each region and zone: offered or not, EFA interfaces, vCPUs
        needed against the family's on-demand quota minus running instances, the spot placement score, and the
        existing cluster's private subnet there. Prints a ranked table and, where quota is short, the exact
        quota-increase command. With spot in cluster.gpu_capacity, the spot price range of the same-shape types;
        with capacity-block, the configured block (its window is recorded in --state-dir). --blocks lists the
        Capacity Block offerings instead, and --buy-block buys one. Exit status: 0 when the configured region
        (and GPU_AZ) can take the node group, 1 when it cannot, 2 for bad input.
        """
        from raytrain_eks.aws.capacity import RegionError, check_capacity
        from raytrain_eks.aws.market import Window, boto3_market
        from raytrain_eks.aws.services import boto3_services
        from raytrain_eks.aws.session import connect
        from raytrain_eks.k8s.state import StateStore

        cfg = load_config(preset=presets.choose(preset), path=config)
        names = [r.strip() for r in (regions or "").split(",") if r.strip()]
        if regions is not None and not names:
            raise RegionError("--regions is empty; give names such as us-east-1,us-west-2")
        if names and all_regions:
            raise RegionError("give --regions or --all-regions, not both")
        aws = connect(cfg.cluster.region)
        out = Console(highlight=False, soft_wrap=True)
        sources, store = (market or boto3_market)(aws), StateStore(state_dir)
        if blocks or buy_block:
            window = Window.from_now(hours=block_hours, days=block_days)
            _blocks(cfg, sources, store, window, buy_block, _confirm(yes), out, json_output)
            return
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        report = check_capacity(
            cfg,
            aws,
            (services or boto3_services)(aws),
            regions=names or None,
            all_regions=all_regions,
            probe=probe,
            say=lambda line: err.print(line, markup=False),
        )
        _show(report, *_sources(cfg, sources, store, spot_days), json_output=json_output, out=out)

    app.command("capacity")(capacity)


def _show(
    report: CapacityReport, extra: dict[str, object], lines: list[str], *, json_output: bool, out: Console
) -> None:
    """The ranked table of zones and what the capacity sources add (or all of it as one JSON document); raises the
    configured placement's problem, else says it is ok."""
    from raytrain_eks.aws.capacity import table_lines

    if json_output:
        out.print(json.dumps({**report.to_dict(), **extra}, indent=2), markup=False)
    else:
        for line in [*table_lines(report), *lines]:
            out.print(line, markup=False)
    problem = report.problem()
    if problem is not None:
        raise problem
    chosen = next(c for c in report.targets if c.viable)
    if not json_output:
        out.print(f"ok: {chosen.zone} ({chosen.region}) can take the GPU node group", markup=False)


def _confirm(yes: bool) -> Callable[[str], bool]:
    return lambda question: yes or typer.confirm(question, default=False, err=True)


def _blocks(
    cfg: Config,
    market: Market,
    store: StateStore,
    window: Window,
    buy: str | None,
    confirm: Callable[[str], bool],
    out: Console,
    json_output: bool,
) -> None:
    """``--blocks`` and ``--buy-block``: the offerings, and the one bought (recorded in the state folder)."""
    from raytrain_eks.aws import market as mk
    from raytrain_eks.k8s.state import Cancelled

    offers = mk.block_offerings(cfg, market.blocks, window)
    if json_output and not buy:
        out.print(json.dumps({"capacity_block_offerings": [o.to_dict() for o in offers]}, indent=2), markup=False)
        return
    for line in mk.offering_lines(offers):
        out.print(line, markup=False)
    if not buy:
        return
    block = mk.buy_block(cfg, market.blocks, buy, offers, confirm)
    if block is None:
        raise Cancelled("Nothing was bought.")
    store.update(**{mk.BLOCK_KEY: block.to_state()})
    out.print(
        f"bought Capacity Block {block.id} ({block.state}): {block.count} x {block.instance_type} in {block.zone}, "
        f"{block.start:%Y-%m-%d %H:%M} to {block.end:%Y-%m-%d %H:%M} UTC; recorded in {store.path}",
        markup=False,
    )
    out.print(
        f"use it: set cluster.gpu_capacity to [capacity-block] (add fallbacks after it) and cluster.capacity_block_id "
        f"to {block.id}; up creates the GPU node group in {block.zone} at size 0 until the block starts",
        markup=False,
    )


def _sources(cfg: Config, market: Market, store: StateStore, spot_days: int) -> tuple[dict[str, object], list[str]]:
    """What the configured capacity sources beyond on-demand add to the report: the block's window (recorded in the
    state folder for up and the job) and the spot price range (recorded for plan)."""
    from raytrain_eks.aws import market as mk

    order = cfg.cluster.capacity_order
    extra: dict[str, object] = {"gpu_capacity": list(order)}
    lines = [] if order == ("on-demand",) else [f"gpu_capacity: {' then '.join(order)}"]
    if "capacity-block" in order:
        block = mk.configured_block(cfg, market.blocks, store.get(mk.BLOCK_KEY))
        store.update(**{mk.BLOCK_KEY: block.to_state()})
        extra["capacity_block"] = block.to_state()
        fee = "fee unknown here" if block.upfront_usd is None else f"fee {block.upfront_usd:,.2f} USD"
        lines.append(
            f"capacity block {block.id} ({block.state}): {block.count} x {block.instance_type} in {block.zone}, "
            f"{block.start:%Y-%m-%d %H:%M} to {block.end:%Y-%m-%d %H:%M} UTC ({fee}); the job should stop by "
            f"{block.drain_by:%Y-%m-%d %H:%M} UTC"
        )
    if "spot" in order:
        ranges = mk.spot_prices(cfg, market.spot_prices, days=spot_days)
        record = mk.spot_record(cfg, ranges, spot_days)
        store.update(**{mk.SPOT_KEY: record})
        extra["spot_prices"] = record
        lines += mk.spot_lines(cfg, ranges, spot_days)
    return extra, lines
