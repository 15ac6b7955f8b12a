"""The ``raytrain-eks capacity`` command: a thin layer over :mod:`raytrain_eks.aws.capacity`.

raytrain-eks capacity                               # the configured region: every zone, ranked
raytrain-eks capacity --regions us-east-1,us-west-2 # compare regions
raytrain-eks capacity --all-regions --json          # every enabled region, as JSON
raytrain-eks capacity --probe                       # also reserve the capacity for a moment, then cancel it

Exit status: 0 when the configured region (and GPU_AZ) can take the GPU node group, 1 when it cannot (quota short,
no capacity), 2 for bad input. Call :func:`register` once on the top-level Typer app::

    app = typer.Typer()
    register(app)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated

import typer
from rich.console import Console

from raytrain_eks import presets
from raytrain_eks.aws.services import Services
from raytrain_eks.aws.session import Aws
from raytrain_eks.config import load_config
from raytrain_eks.options import ClusterPresetOpt, ConfigOpt, JsonOpt


def register(app: typer.Typer, *, services: Callable[[Aws], Services] | None = None) -> None:
    """Add ``capacity`` to ``app``. ``services`` makes the quota, spot-score and reservation interfaces from the
    session; the default is the boto3 ones (tests pass the fakes of tests/fake_aws.py)."""

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
    ) -> None:
        """Check where the GPU node group can get capacity: offerings, EFA, vCPU quota, spot score, subnets.

        For the configured GPU type and count, in each region and zone: offered or not, EFA interfaces, vCPUs
        needed against the family's on-demand quota minus running instances, the spot placement score, and the
        existing cluster's private subnet there. Prints a ranked table and, where quota is short, the exact
        quota-increase command. Exit status: 0 when the configured region (and GPU_AZ) can take the node group,
        1 when it cannot, 2 for bad input.
        """
        from raytrain_eks.aws.capacity import RegionError, check_capacity, table_lines
        from raytrain_eks.aws.services import boto3_services
        from raytrain_eks.aws.session import connect

        cfg = load_config(preset=presets.choose(preset), path=config)
        names = [r.strip() for r in (regions or "").split(",") if r.strip()]
        if regions is not None and not names:
            raise RegionError("--regions is empty; give names such as us-east-1,us-west-2")
        if names and all_regions:
            raise RegionError("give --regions or --all-regions, not both")
        aws = connect(cfg.cluster.region)
        out = Console(highlight=False, soft_wrap=True)
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
        if json_output:
            out.print(json.dumps(report.to_dict(), indent=2), markup=False)
        else:
            for line in table_lines(report):
                out.print(line, markup=False)
        problem = report.problem()
        if problem is not None:
            raise problem
        chosen = next(c for c in report.targets if c.viable)
        if not json_output:
            out.print(f"ok: {chosen.zone} ({chosen.region}) can take the GPU node group", markup=False)

    app.command("capacity")(capacity)
