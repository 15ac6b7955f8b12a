"""The cluster's instance types, checked against what deploying needs, and what the cluster costs.

A run is priced only on a cluster this tool deployed, or at the price the user configured: ``submit`` gives the job
a deployment record (:mod:`raytrain_eks.fabric.deployment`) when the state says ``up`` made the cluster, and
:func:`job_price` (the EKS target's ``price``) prices a run from ``cluster.usd_per_hour`` when it is set, else from
that record alone (the configured price, :mod:`raytrain_eks.k8s.prices`, is every target's). Example::

    gpu, system = check_deployable(cfg)              # ConfigError listing every problem at once
    cost_per_hour(cfg, gpu, system)["total_usd"]     # 9.5498 for the reference cluster (us-east-1 prices)
    run_cost(cfg, summary)                           # a finished run's cost, from its summary.json
    price, why_not = job_price("/etc/raytrain-eks/raytrain-eks.yaml")   # (None, reason) without a record
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from datetime import date, datetime
from typing import Any

from raytrain_eks.aws import eksctl
from raytrain_eks.config import Config
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.fabric.deployment import RECORD_KIND, read_deployment
from raytrain_eks.instances import (
    EFA_GPU_TYPES,
    EKS_CONTROL_PLANE_USD_PER_HOUR,
    EKS_EXTENDED_SUPPORT_USD_PER_HOUR,
    INSTANCE_TYPES,
    KNOWN_REGIONS,
    NAT_GATEWAY_USD_PER_HOUR,
    PRICE_REGION,
    InstanceType,
    eks_support,
)
from raytrain_eks.k8s.prices import Price, RunCost, configured_price, priced_run, unpriced_reason
from raytrain_eks.k8s.state import StateStore


def check_deployable(cfg: Config) -> tuple[InstanceType, InstanceType]:
    """The GPU and system instance types, after checking what only deploying needs; every problem at once.

    Raises :class:`ConfigError` for a region outside the known list, an instance type that is unknown, has no GPU
    or no EFA, ``gpus_per_node`` that differs from the instance's GPUs, a worker pod larger than its node, or more
    training workers than GPUs. Example: ``check_deployable(cfg)[0].efa_interfaces``.
    """
    c, problems = cfg.cluster, []
    if c.region not in KNOWN_REGIONS:
        close = difflib.get_close_matches(c.region, KNOWN_REGIONS, n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else f"known: {', '.join(KNOWN_REGIONS)}"
        problems.append(f"cluster.region = {c.region!r}: not a region where raytrain-eks knows EKS runs; {hint}")
    gpu = INSTANCE_TYPES.get(c.gpu_node_type)
    if gpu is None:
        problems.append(
            f"cluster.gpu_node_type = {c.gpu_node_type!r}: unknown instance type; EFA GPU types: "
            f"{', '.join(EFA_GPU_TYPES)}"
        )
    elif not gpu.gpus:
        problems.append(
            f"cluster.gpu_node_type = {c.gpu_node_type!r}: has no GPU; use one of {', '.join(EFA_GPU_TYPES)}"
        )
    elif not gpu.efa_supported:
        problems.append(
            f"cluster.gpu_node_type = {c.gpu_node_type!r}: does not support EFA, so NCCL would fall back to TCP "
            f"sockets between nodes; use an EFA type such as {', '.join(EFA_GPU_TYPES[:4])}"
        )
    if gpu is not None and gpu.gpus and c.gpus_per_node != gpu.gpus:
        problems.append(
            f"cluster.gpus_per_node = {c.gpus_per_node} (GPUS_PER_NODE): {gpu.name} has {gpu.gpus} GPUs and each "
            f"worker pod takes a whole node; set GPUS_PER_NODE={gpu.gpus}"
        )
    if gpu is not None:
        cpu, mem = cfg.ray.worker_cpu, cfg.ray.worker_memory_gib
        if cpu is not None and cpu >= gpu.vcpu:
            problems.append(
                f"ray.worker_cpu = {cpu}: must be below the {gpu.vcpu} vCPUs of {gpu.name} (the kubelet and "
                "DaemonSets need some); leave it empty for 5/6 of the node"
            )
        if mem is not None and mem >= gpu.memory_gib:
            problems.append(
                f"ray.worker_memory_gib = {mem}: must be below the {gpu.memory_gib} GiB of {gpu.name}; "
                "leave it empty for 5/6 of the node"
            )
    system = INSTANCE_TYPES.get(c.system_node_type)
    if system is None:
        known = ", ".join(name for name, it in INSTANCE_TYPES.items() if not it.gpus)
        problems.append(f"cluster.system_node_type = {c.system_node_type!r}: unknown instance type; known: {known}")
    if c.gpu_nodegroup_name == eksctl.SYSTEM_NODEGROUP:
        problems.append(f"cluster.gpu_nodegroup_name = {c.gpu_nodegroup_name!r}: taken by the system node group")
    d = cfg.derived
    if d.world_size > d.cluster_gpus:
        problems.append(
            f"training.num_workers = {cfg.training.num_workers}: more than the {d.cluster_gpus} GPUs of the cluster "
            "(one worker per GPU); use 0 for one per GPU"
        )
    if problems or gpu is None or system is None:  # each None case has added a problem
        raise ConfigError(problems)
    return gpu, system


def _item(name: str, what: str, count: int, unit: float | None) -> dict[str, Any]:
    usd = None if unit is None else round(count * unit, 6)
    return {"name": name, "what": what, "count": count, "unit_usd_per_hour": unit, "usd_per_hour": usd}


def gpu_price(cfg: Config, gpu: InstanceType, market: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """The GPU instances' cost item for the first of ``cluster.gpu_capacity``, and a note on how it was priced.

    ``market``: the state folder's record of what ``capacity`` read (:data:`~raytrain_eks.aws.market.SPOT_KEY`,
    :data:`~raytrain_eks.aws.market.BLOCK_KEY`). Spot: the highest price of the spot range read (``range_usd``
    holds low and high for the nodes), else the on-demand price, which a spot price never exceeds (EC2's default
    maximum price). A Capacity Block: its upfront fee spread over its hours (``fee_usd`` is the whole fee). Else
    on-demand. Example: ``gpu_price(cfg, gpu)[0]["usd_per_hour"] == 9.2032`` for the reference."""
    from raytrain_eks.aws.market import BLOCK_KEY, SPOT_KEY

    c, known = cfg.cluster, market or {}
    source = c.capacity_order[0]
    on_demand = _item("GPU instances", gpu.name, c.gpu_node_count, gpu.usd_per_hour)
    if source == "spot":
        spot = known.get(SPOT_KEY) or {}
        seen = (spot.get("types") or {}).get(gpu.name) if spot.get("region") == c.region else None
        if not seen:
            what = f"{gpu.name}, spot (range not read: at most the on-demand price shown)"
            note = f"Spot price range not read yet: `raytrain-eks capacity` reads {c.region}'s and records it here."
            return {**on_demand, "what": what}, note
        low, high = float(seen["low"]), float(seen["high"])
        what = f"{gpu.name}, spot ${low:.4f}-{high:.4f} each (the {spot['days']} days to {spot['read_at'][:10]})"
        item = _item("GPU instances", what, c.gpu_node_count, high)
        item["range_usd"] = [round(low * c.gpu_node_count, 6), round(high * c.gpu_node_count, 6)]
        note = f"Spot: ${item['range_usd'][0]:.2f}-{item['range_usd'][1]:.2f} per hour for the GPU nodes; the total"
        return item, f"{note} uses the high end. Spot nodes can be taken back with two minutes' notice."
    if source == "capacity-block":
        block = known.get(BLOCK_KEY) or {}
        fee = block.get("upfront_usd") if block.get("id") == c.capacity_block_id else None
        if fee is None:
            what = f"{gpu.name} in Capacity Block {c.capacity_block_id} (fee not known here)"
            note = "The Capacity Block's fee is known where `raytrain-eks capacity --buy-block` bought it."
            return _item("GPU instances", what, c.gpu_node_count, None), note
        span = datetime.fromisoformat(block["end"]) - datetime.fromisoformat(block["start"])
        hours = max(span.total_seconds() / 3600, 1.0)
        what = f"{gpu.name} in Capacity Block {block['id']}, {hours:g} h for ${float(fee):,.2f} paid upfront"
        item = _item("GPU instances", what, c.gpu_node_count, round(float(fee) / hours / c.gpu_node_count, 6))
        item["fee_usd"] = float(fee)
        return item, f"Capacity Block {block['id']}: ${float(fee):,.2f} in all, paid when bought, used or not."
    return on_demand, ""


def cost_per_hour(
    cfg: Config,
    gpu: InstanceType,
    system: InstanceType,
    *,
    on: date | None = None,
    market: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Hourly cost, one item per billable thing (us-east-1 prices, docs/reference/infra-facts.md §7), on day ``on``
    (default today): the control plane costs more while its Kubernetes version is in EKS extended support. The GPU nodes
    are priced for the first of ``cluster.gpu_capacity`` (:func:`gpu_price`, from ``market``); the rest on-demand.

    Example (reference, Kubernetes 1.36 in standard support): 2 x 4.6016 + 0.2016 + 0.10 + 0.045 = 9.5498.
    """
    c = cfg.cluster
    support = eks_support(c.k8s_version, on or date.today())
    item = _item
    gpu_item, gpu_note = gpu_price(cfg, gpu, market)

    items = [
        gpu_item,
        item("system node", system.name, c.system_node_count, system.usd_per_hour),
        item(
            "EKS control plane",
            f"cluster on Kubernetes {c.k8s_version}, {support.period} support",
            1,
            support.control_plane_usd_per_hour,
        ),
        item("NAT gateway", "vpc.nat.gateway: Single", 1, NAT_GATEWAY_USD_PER_HOUR),
    ]
    known = [i["usd_per_hour"] for i in items if i["usd_per_hour"] is not None]
    notes = [
        "Excludes EBS volumes, NAT data processing ($0.045/GB), public IPv4 addresses ($0.005/h each) and data "
        "transfer.",
    ]
    ends = f" until {support.ends.isoformat()}" if support.ends else ""
    if support.period == "standard":
        notes.append(
            f"Kubernetes {c.k8s_version} is in EKS standard support{ends} (${EKS_CONTROL_PLANE_USD_PER_HOUR:.2f}/h); "
            f"after that, extended support costs ${EKS_EXTENDED_SUPPORT_USD_PER_HOUR:.2f}/h."
        )
    elif support.period == "extended":
        notes.append(
            f"Kubernetes {c.k8s_version} is in EKS extended support{ends}: the control plane costs "
            f"${EKS_EXTENDED_SUPPORT_USD_PER_HOUR:.2f}/h instead of ${EKS_CONTROL_PLANE_USD_PER_HOUR:.2f}/h; a "
            "newer version (K8S_VERSION) costs less."
        )
    else:
        since = f" (its extended support ended {support.ends.isoformat()})" if support.ends else ""
        notes.append(
            f"Kubernetes {c.k8s_version} is no longer supported by EKS{since}: a new cluster cannot be created with "
            "it; choose a newer K8S_VERSION."
        )
    if gpu_note:
        notes.append(gpu_note)
    if c.region != PRICE_REGION:
        notes.append(f"Prices are {PRICE_REGION}'s; {c.region} differs.")
    missing = [i["what"] for i in items if i["usd_per_hour"] is None]
    if missing:
        notes.append(f"No price known for {', '.join(missing)}: the total leaves it out.")
    spread = gpu_item.get("range_usd")
    return {
        "total_usd": round(sum(known), 4),
        "total_usd_range": None
        if spread is None
        else [round(sum(known) - spread[1] + spread[0], 4), round(sum(known), 4)],
        "priced_as": f"{PRICE_REGION} on-demand"
        if c.capacity_order[0] in ("on-demand", "reservation")
        else f"GPU nodes {c.capacity_order[0]}, the rest {PRICE_REGION} on-demand",
        "complete": not missing,
        "currency": "USD",
        "price_region": PRICE_REGION,
        "items": items,
        "notes": notes,
    }


def run_cost(cfg: Config, summary: Mapping[str, Any]) -> RunCost | None:
    """What a run would have cost on the configured cluster at its on-demand prices (see :func:`priced_run`); ``None``
    when the cluster is not one this tool can price. A finished run is priced by :func:`job_price` instead, only on a
    cluster this tool deployed.

    Example: 9.5498 $/h for 600 s and 30 M tokens -> ``{"usd": 1.5916, "usd_per_million_tokens": 0.0531, ...}``.
    """
    try:
        gpu, system = check_deployable(cfg)
    except UserError:
        return None
    hourly = cost_per_hour(cfg, gpu, system)
    return priced_run(hourly["total_usd"], hourly["price_region"], summary)


def deployment_record(cfg: Config, state: StateStore) -> dict[str, object] | None:
    """What ``submit`` tells the job about its cluster (:mod:`raytrain_eks.fabric.deployment`), or None when the
    state does not say that ``up`` made the cluster ``cfg`` names. Its price is the cluster's hourly cost on that day.
    Example: ``deployment_record(cfg, d.state)["usd_per_hour"] == 9.5498`` for the reference cluster."""
    c = cfg.cluster
    if state.get("cluster") != c.name:
        return None
    gpu, system = check_deployable(cfg)
    hourly = cost_per_hour(cfg, gpu, system)
    return {
        "kind": RECORD_KIND,
        "cluster": c.name,
        "region": state.get("region") or c.region,
        "gpu_node_type": gpu.name,
        "gpu_node_count": c.gpu_node_count,
        "system_node_type": system.name,
        "system_node_count": c.system_node_count,
        "usd_per_hour": hourly["total_usd"],
        "price_region": hourly["price_region"],
        # The source up launched the GPU nodes from (spot, a Capacity Block...): each segment of a run records it.
        "gpu_capacity": state.get("gpu_capacity_used"),
    }


def job_price(
    config: str | os.PathLike[str] | None,
    configured_usd_per_hour: float | None = None,
    usd_per_node_hour: float | None = None,
) -> tuple[Price | None, str | None]:
    """How ``train --address`` prices its run on the EKS target (``EksTarget.price``): at the price the user
    configured (``cluster.usd_per_hour`` for the whole cluster, or ``cluster.usd_per_node_hour`` times the GPU nodes
    the run's workers ran on, the summary's ``nodes``: they know their discounts, and an autoscaled cluster has no
    fixed size; :func:`~raytrain_eks.k8s.prices.configured_price`), else from the deployment record beside its
    configuration ``config`` (the one ``submit`` mounts in the head pod). Returns ``(price, None)``,
    ``price(summary)`` being the run's cost; or ``(None, why)`` on a Ray cluster with neither (one this tool did not
    deploy): nothing is assumed from the configuration's instance types."""
    record = read_deployment(config)
    cluster = None if record is None else record["cluster"]
    configured = configured_price(configured_usd_per_hour, usd_per_node_hour, cluster)
    if configured is not None:
        return configured, None
    if record is None:
        return None, unpriced_reason(config)

    def price(summary: Mapping[str, Any]) -> RunCost:
        cost = priced_run(float(record["usd_per_hour"]), str(record["price_region"]), summary)
        return {**cost, "cluster": cluster, "source": "deployment record"}

    return price, None
