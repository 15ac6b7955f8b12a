"""What every target shares of pricing a run: its cost at an hourly price, and the price the user configured.

``train --address`` prices its run through its target (``ClusterTarget.price``): on any target at the price the user
configured (:func:`configured_price`: ``cluster.usd_per_hour`` for the whole cluster, or ``cluster.usd_per_node_hour``
times the GPU nodes the run's workers ran on); the EKS target also from the deployment record of a cluster its ``up``
made (:func:`raytrain_eks.eks.pricing.job_price`). Without either, :func:`unpriced_reason` says why. Example::

    price = configured_price(None, 5.5)
    price({"wall_s": 1800.0, "trained_tokens": 2_000_000, "nodes": 4})["usd"]   # 11.0: 4 nodes x 5.5 $/h x 0.5 h
    unpriced_reason(None)    # "no deployment record (no --config was given): ...; set cluster.usd_per_hour ..."
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Required, TypedDict


class RunCost(TypedDict, total=False):
    """What a run cost (``summary.json``'s ``cost``): in dollars, per million tokens trained, the hourly price it
    was priced at and how; by whom it was priced (``source``), for which ``cluster``, and at a price per node the
    ``nodes`` it ran on."""

    usd: Required[float]
    usd_per_million_tokens: Required[float | None]
    usd_per_hour: Required[float]
    basis: Required[str]
    cluster: str | None
    source: str
    nodes: int
    usd_per_node_hour: float


# A run's cost from its summary (summary.json's fields, as JSON values).
Price = Callable[[Mapping[str, Any]], RunCost]


def priced_run(usd_per_hour: float, price_region: str, summary: Mapping[str, Any]) -> RunCost:
    """A run's cost from its ``summary.json`` fields: ``usd_per_hour`` times this attempt's ``wall_s``, and per
    million tokens this attempt trained (``trained_tokens``; a summary without it, from before that field, gives
    ``tokens_per_s`` x (``train_s`` - ``eval_s``); ``tokens`` would also count the steps before a resume)."""
    usd = usd_per_hour * summary["wall_s"] / 3600
    tokens = summary.get("trained_tokens")
    if tokens is None:  # an older summary: the training rate over the time spent training (evaluation left out)
        tokens = round(summary["tokens_per_s"] * (summary["train_s"] - summary.get("eval_s", 0.0)))
    return {
        "usd": round(usd, 4),
        "usd_per_million_tokens": round(usd / tokens * 1e6, 4) if tokens else None,
        "usd_per_hour": usd_per_hour,
        "basis": f"{price_region} on-demand prices x the run's wall time; excludes EBS, data and IPv4",
    }


def configured_price(
    usd_per_hour: float | None, usd_per_node_hour: float | None, cluster: str | None = None
) -> Price | None:
    """The run's price at what the user configured (they know their discounts, and an autoscaled cluster has no
    fixed size): ``usd_per_node_hour`` times the GPU nodes the run's workers ran on (the summary's ``nodes``), else
    ``usd_per_hour`` for the whole cluster; ``None`` when neither is set. ``cluster``: the name its costs carry."""
    if usd_per_node_hour is not None:
        rate = float(usd_per_node_hour)

        def per_node(summary: Mapping[str, Any]) -> RunCost:
            nodes = int(summary.get("nodes") or 1)
            cost = priced_run(rate * nodes, "configured", summary)
            basis = f"cluster.usd_per_node_hour as configured x {nodes} GPU node(s) x the run's wall time"
            return {
                **cost,
                "basis": basis,
                "cluster": cluster,
                "source": "configured",
                "nodes": nodes,
                "usd_per_node_hour": rate,
            }

        return per_node
    if usd_per_hour is not None:
        hourly = float(usd_per_hour)

        def configured(summary: Mapping[str, Any]) -> RunCost:
            cost = priced_run(hourly, "configured", summary)
            basis = "cluster.usd_per_hour as configured x the run's wall time"
            return {**cost, "basis": basis, "cluster": cluster, "source": "configured"}

        return configured
    return None


def unpriced_reason(config: str | os.PathLike[str] | None) -> str:
    """Why a run is not priced, in words for the report: no price is configured, and no deployment record is beside
    its configuration file ``config`` (the Ray cluster is not one this tool deployed and submitted to)."""
    where = f"beside {config}" if config is not None else "(no --config was given)"
    return (
        f"no deployment record {where}: the Ray cluster was not deployed and submitted to by this tool's `up` and "
        "`submit`, so its nodes and their price are not known; set cluster.usd_per_hour (or "
        "cluster.usd_per_node_hour) to price runs on it"
    )
