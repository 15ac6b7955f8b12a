"""Zones, the EKS cluster and its node groups, through eksctl.

The placement search picks the GPU zone (capacity, quotas, reservations); the cluster gets private subnets in every
candidate zone behind one NAT gateway, never in a zone EKS cannot take a cluster in (the zone IDs eksctl itself
avoids); a stack a failed create left under the cluster's name is removed first; the system node group comes first,
then the EFA GPU node group in one zone, moving to the next candidate zone when EC2 cannot launch the instances there
or they are not up within eksctl's wait (after removing the failed group). Every eksctl command that waits gets its
``--timeout``, below the runner's own limit, so eksctl's own message says why it stopped.
"""

from __future__ import annotations

import json
import re
import shlex
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from raytrain_eks.aws import eksctl, stacks
from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import GpuNodeSpec, helm_releases, owned_by
from raytrain_eks.k8s.manifests import to_yaml
from raytrain_eks.k8s.runner import QUICK_TIMEOUT_S, CommandError, Completed
from raytrain_eks.k8s.state import Deployment, StateStore, UnreadableAnswer, cluster_item, nodegroup_item

if TYPE_CHECKING:
    from raytrain_eks.aws.market import Block
    from raytrain_eks.aws.services import Services

# Seconds. eksctl's CloudFormation stacks take 15-20 minutes for a cluster and 5-15 for a node group. The runner lets
# eksctl run for its own wait (--timeout, eksctl.CLUSTER_WAIT_MIN / NODEGROUP_WAIT_MIN) and then some, for what it
# does after the wait (add-ons, the kubeconfig, device plugins): eksctl stops first and says why.
CLUSTER_TIMEOUT_S = (eksctl.CLUSTER_WAIT_MIN + 10) * 60
NODEGROUP_TIMEOUT_S = (eksctl.NODEGROUP_WAIT_MIN + 5) * 60
GPU_NODE_SELECTOR = {"role": m.GPU_NODE_LABELS["role"]}
EKSCTL_PLUGIN_DAEMONSETS = (eksctl.EKSCTL_NVIDIA_PLUGIN_DAEMONSET, eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET)
# The state file's record of which of those an existing cluster had before this folder's GPU node group was made.
PLUGINS_BEFORE_KEY = "eksctl_plugins_before"
# The tolerations of the EFA DaemonSet eksctl applies (create or replace) whenever it creates an EFA node group
# (pkg/addons/assets/efa-device-plugin.yaml, v0.230.0; its SetTolerations adds none): not the GPU nodes' taint.
EKSCTL_EFA_PLUGIN_TOLERATIONS = (
    {"key": "CriticalAddonsOnly", "operator": "Exists"},
    {"key": "aws.amazon.com/efa", "operator": "Exists", "effect": "NoSchedule"},
)


def as_after_gpu_nodegroup(d: Deployment, namespace: str, name: str, pod_spec: dict[str, object]) -> dict[str, object]:
    """A cluster's DaemonSet's pod spec as it will be once eksctl has created the GPU node group from this folder:
    eksctl replaces a kube-system DaemonSet of its EFA name with its own manifest, whose tolerations are
    :data:`EKSCTL_EFA_PLUGIN_TOLERATIONS`; any other is left as it is, as is every one once the group was made."""
    made = d.state.get(PLUGINS_BEFORE_KEY) is not None
    if made or (namespace, name) != ("kube-system", eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET):
        return pod_spec
    return {**pod_spec, "tolerations": [dict(t) for t in EKSCTL_EFA_PLUGIN_TOLERATIONS]}


def gpu_node_spec(cfg: Config, zone: str | None) -> GpuNodeSpec:
    """What the worker pods need of the GPU node group's nodes (both device plugins are this tool's own there)."""
    c = cfg.cluster
    return GpuNodeSpec(
        selector=dict(c.gpu_node_selector) if c.gpu_node_selector is not None else dict(GPU_NODE_SELECTOR),
        count=c.gpu_node_count,
        gpus=cfg.derived.ray_gpus_per_worker_pod,
        efa=m.efa_per_pod(cfg),
        zone=zone,
        missing_hint=f"check node group {c.gpu_nodegroup_name} with `eksctl get nodegroup --cluster {c.name} "
        f"--region {c.region}`",
    )


def created_gpu_node_labels(cfg: Config) -> dict[str, str]:
    """The labels every node of the GPU node group carries: the group's own (eksctl's config) and those EKS and
    eksctl give a managed node group's nodes (its name twice, its instance type, its OS). Labels that a controller
    adds later (node feature discovery, the GPU operator) are not among them."""
    c = cfg.cluster
    return {
        **m.GPU_NODE_LABELS,
        "eks.amazonaws.com/nodegroup": c.gpu_nodegroup_name,
        "alpha.eksctl.io/nodegroup-name": c.gpu_nodegroup_name,
        "node.kubernetes.io/instance-type": c.gpu_node_type,
        "kubernetes.io/os": "linux",
    }


def gpu_node_taints(cfg: Config) -> list[dict[str, object]]:
    """The taints of the GPU node group's nodes, as eksctl's config gives them."""
    return [dict(m.GPU_TAINT)]


BUSY_POLL_S = 30.0  # a CloudFormation stack changes state in minutes
# The capacity sources that launch on-demand instances, which the on-demand vCPU quota limits.
ON_DEMAND_SOURCES = ("on-demand", "reservation")
MAX_ZONES = 3  # zones given subnets (and so GPU zones to try) when the config names none

# What eksctl prints when EC2 cannot start the instances in a zone: no capacity, or no offering of the type there;
# or its own wait (--timeout) ending before the node group's stack is complete. eksctl waits for a node group's
# stack with the CloudFormation StackCreateComplete waiter of the AWS SDK for Go (pkg/cfn/manager/waiters.go, eksctl
# v0.230.0), whose error when the wait ends is "exceeded max wait time for StackCreateComplete waiter" (eksctl
# itself matches "exceeded max wait time", pkg/actions/addon/addon.go); it logs that error as it is
# (pkg/eks/nodegroup_service.go: DoAllNodegroupStackTasks).
_WAIT_ENDED = "exceeded max wait time"
_LAUNCH_FAILURE = re.compile(
    r"InsufficientInstanceCapacity|InsufficientCapacity|Unsupported|not supported in (your requested )?"
    r"Availability Zone|AsgInstanceLaunchFailures|NodeCreationFailure|Could not launch (On-Demand|Spot) Instances|"
    r"UnfulfillableCapacity|" + _WAIT_ENDED,
    re.IGNORECASE,
)
# Only what eksctl says when the EKS API answered that the thing is not there: the API's error code, or eksctl's own
# "No cluster found for name: X" / "No nodegroups found". Any other failure (credentials, network, a profile or
# file "not found") says nothing about the cluster, so it is an error and never taken to mean "gone".
_CLUSTER_NOT_FOUND = re.compile(r"ResourceNotFoundException|No cluster found for name")
_NODEGROUPS_NOT_FOUND = re.compile(r"ResourceNotFoundException|No nodegroups? found")
_FAILED_NODEGROUP = {"CREATE_FAILED", "DEGRADED", "DELETE_FAILED"}
_BUSY = {"CREATING", "UPDATING", "DELETING", "CREATE_IN_PROGRESS", "DELETE_IN_PROGRESS"}


@dataclass(frozen=True)
class ZonePlan:
    """``candidates``: GPU zones to try, in order. ``cluster_azs``: the zones given subnets (every candidate).
    ``reservations``: zone -> the existing capacity reservation the GPU node group targets there. ``notes``: what
    was left out of the configured zones, and why, said before the cluster is created."""

    candidates: tuple[str, ...]
    cluster_azs: tuple[str, ...]
    reservations: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Placement:
    """What the placement search found: the zones that can take the GPU node group now, best first, and for each
    zone an existing capacity reservation holding every GPU node, when there is one. ``avoided``: zone -> zone ID
    of the region's zones EKS cannot take a cluster in (:data:`raytrain_eks.aws.eksctl.AVOIDED_ZONE_IDS`); they are
    in neither list."""

    zones: list[str]
    reservations: dict[str, str] = field(default_factory=dict)
    offered: list[str] = field(default_factory=list)  # every zone of the region offering the type, best first
    avoided: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# Zones
# ----------------------------------------------------------------------------------------------------------------


def placement_zones(cfg: Config, services: Services | None = None) -> Placement:
    """The placement search of ``up``: the configured placement's zones that can take the GPU node group, best first.

    The ``capacity`` check through boto3 (offered, EFA, vCPU quotas net of running instances and reservations, the
    system node's quota, existing capacity reservations, subnets, spot score). Raises its one-message error,
    before anything is created, when no zone fits (quota short, not offered, no EFA, a reservation that cannot hold
    the nodes). ``services`` replaces the quota, spot-score and reservation interfaces (tests pass fakes).
    """
    from raytrain_eks.aws.capacity import check_capacity
    from raytrain_eks.aws.services import boto3_services
    from raytrain_eks.aws.session import connect

    aws = connect(cfg.cluster.region)
    report = check_capacity(cfg, aws, services or boto3_services(aws), regions=[cfg.cluster.region])
    problem = report.problem()
    # A Capacity Block or spot first: the on-demand vCPU quota the check weighs is not what they draw on, so a
    # zone counts when it offers the type with EFA (the block's own zone is pinned by choose_zones).
    on_demand = cfg.cluster.capacity_order[0] in ON_DEMAND_SOURCES
    if problem is not None and on_demand:
        raise problem
    avoid = eksctl.AVOIDED_ZONE_IDS.get(cfg.cluster.region, ())
    home = [c for c in report.candidates if c.zone and c.region == cfg.cluster.region]
    avoided = {c.zone: c.zone_id for c in home if c.zone and c.zone_id in avoid}
    fits = (lambda c: c.viable) if on_demand else (lambda c: c.offered and bool(c.efa_interfaces))
    usable = [c for c in report.targets if fits(c) and c.zone and c.zone not in avoided]
    return Placement(
        zones=[c.zone for c in usable if c.zone],
        reservations={c.zone: c.reservation.id for c in usable if c.zone and c.covered and c.reservation},
        offered=[c.zone for c in home if c.offered and c.zone and c.zone not in avoided],
        avoided={z: i for z, i in avoided.items() if z and i},
    )


def _without_avoided(cfg: Config, found: Placement | None) -> tuple[list[str], list[str]]:
    """The configured ``availability_zones`` EKS can take a cluster in, and a note for each one it cannot;
    ``UserError`` for a configured ``gpu_az`` it cannot, or fewer than the two zones eksctl needs left."""
    c = cfg.cluster
    avoided = found.avoided if found is not None else {}
    if c.gpu_az in avoided:
        raise UserError(
            f"cluster.gpu_az = {c.gpu_az!r} (GPU_AZ): it is zone {avoided[c.gpu_az]}, where EKS cannot create a "
            f"cluster (eksctl never picks it either)",
            hint=f"Choose another zone of {c.region} (`raytrain-eks capacity` lists them), or leave GPU_AZ empty.",
        )
    kept = [z for z in c.availability_zones if z not in avoided]
    notes = [
        f"Left out {z} of cluster.availability_zones: it is zone {avoided[z]}, where EKS cannot create a cluster"
        for z in c.availability_zones
        if z in avoided
    ]
    if c.availability_zones and len(kept) < 2:
        raise UserError(
            f"cluster.availability_zones: {', '.join(c.availability_zones)} leave {len(kept)} zone(s) EKS can create "
            f"a cluster in ({', '.join(f'{z} is {avoided[z]}' for z in c.availability_zones if z in avoided)}); "
            "eksctl needs two",
            hint=f"Add another zone of {c.region} to availability_zones, or leave it empty.",
        )
    return kept, notes


def _with_second_zone(
    cfg: Config, gpu_az: str, found: Placement | None, configured: list[str] | None = None
) -> tuple[str, ...]:
    """``gpu_az`` and the cluster's other zones (eksctl needs two; the others only hold subnets): the configured
    ``availability_zones`` (``configured``: those EKS can take a cluster in) when there are some, else the best
    other zone that offers the GPU type when the placement search ran, else the planned default."""
    other = next((z for z in (found.offered if found is not None else []) if z != gpu_az), None)
    if other is not None and not cfg.cluster.availability_zones:
        return (gpu_az, other)
    zones = list(cfg.cluster.availability_zones if configured is None else configured)
    if not zones and found is not None and found.avoided:  # the planned default, past zones EKS cannot take
        region = cfg.cluster.region
        skip = {gpu_az, *found.avoided}
        return (gpu_az, next(f"{region}{ch}" for ch in string.ascii_lowercase if f"{region}{ch}" not in skip))
    return eksctl.planned_zones(
        cfg.model_copy(
            update={"cluster": cfg.cluster.model_copy(update={"gpu_az": gpu_az, "availability_zones": zones})}
        )
    ).cluster_azs


def choose_zones(cfg: Config, store: StateStore, offered: Callable[[], Placement] | None = None) -> ZonePlan:
    """The GPU zones to try and the cluster's zones: remembered ones first, then the config's, else the zones the
    placement search (``offered``) ranks best. Zones that failed before are tried last.

    ``offered`` runs whenever the GPU node group is not yet recorded as created, so a short quota, a type not
    offered in the configured zone or a reservation that cannot hold the nodes stops ``up`` before anything is made;
    the configured or remembered zones are then kept only where the search says the group can go.
    Example: ``choose_zones(cfg, store).candidates``.
    """
    block_zone = _block_zone(cfg, store)
    if block_zone is not None and not cfg.cluster.gpu_az:  # as a configured reservation pins its zone
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"gpu_az": block_zone})})
    c = cfg.cluster
    found: Placement | None = None
    if offered is not None and not store.has(nodegroup_item(c.gpu_nodegroup_name)):
        found = offered()
    remembered = tuple(store.get("cluster_azs") or ())
    configured, notes = _without_avoided(cfg, found) if not remembered else (list(c.availability_zones), [])
    if remembered:
        cluster_azs = remembered
        pool = [c.gpu_az] if c.gpu_az else list(remembered)
        outside = [z for z in pool if z not in remembered]
        if outside:
            raise UserError(
                f"cluster.gpu_az = {outside[0]!r}: the cluster has subnets only in {', '.join(remembered)}",
                hint="Choose one of those zones (GPU_AZ), or run `raytrain-eks down` and `up` again for another.",
            )
    elif c.gpu_az:
        pool, cluster_azs = [c.gpu_az], _with_second_zone(cfg, c.gpu_az, found, configured)
    elif configured:
        pool, cluster_azs = list(configured), tuple(configured)
    else:
        zones = list(found.zones) if found is not None else []
        if not zones:
            raise UserError(
                f"no availability zone of {c.region} is known to offer {c.gpu_node_type}",
                hint="Set cluster.gpu_az (GPU_AZ=...) or cluster.availability_zones in the configuration, or see "
                "`raytrain-eks capacity --all-regions` for where the type can go.",
            )
        pool = list(zones)[:MAX_ZONES]  # in the capacity check's order: best first
        cluster_azs = tuple(pool)
        if len(cluster_azs) < 2:
            cluster_azs = _with_second_zone(cfg, pool[0], found)
    if found is not None:
        rank = {z: i for i, z in enumerate(found.zones)}
        fits = sorted((z for z in pool if z in rank), key=rank.__getitem__)
        if not fits:
            raise UserError(
                f"{c.gpu_node_type} cannot go to {', '.join(pool)} now; the capacity check finds room only in "
                f"{', '.join(found.zones) or 'no zone'} of {c.region}",
                hint="`raytrain-eks capacity` shows why, zone by zone. Change GPU_AZ / availability_zones, or run "
                "`raytrain-eks down` and `up` again to build the cluster in other zones.",
            )
        pool = fits
    failed = store.get("zone_failures") or {}
    last = store.get("gpu_az")
    ordered = sorted(pool, key=lambda z: (z != last, z in failed))
    reservations = dict(found.reservations) if found is not None else dict(store.get("reservations") or {})
    return ZonePlan(
        tuple(ordered), tuple(cluster_azs), {z: r for z, r in reservations.items() if z in ordered}, tuple(notes)
    )


def recorded_block(cfg: Config, store: StateStore) -> Block | None:
    """The configured Capacity Block as the state folder records it (``capacity`` or a previous ``up`` read it);
    None when the config names none, or the record is of another block."""
    from raytrain_eks.aws.market import BLOCK_KEY, Block

    known = store.get(BLOCK_KEY)
    bid = cfg.cluster.capacity_block_id
    if bid is None or "capacity-block" not in cfg.cluster.capacity_order:
        return None
    return Block.from_state(known) if known and known.get("id") == bid else None


def _block_zone(cfg: Config, store: StateStore) -> str | None:
    """The zone of the configured Capacity Block (read from EC2 and recorded in the state when not yet recorded),
    which becomes the GPU zone; None without one."""
    if cfg.cluster.capacity_block_id is None:
        return None
    block = recorded_block(cfg, store)
    if block is None:
        from raytrain_eks.aws.market import BLOCK_KEY, Ec2CapacityBlocks, configured_block
        from raytrain_eks.aws.session import connect

        block = configured_block(cfg, Ec2CapacityBlocks(connect(cfg.cluster.region)), store.get(BLOCK_KEY))
        store.update(**{BLOCK_KEY: block.to_state()})
    return block.zone


# ----------------------------------------------------------------------------------------------------------------
# eksctl
# ----------------------------------------------------------------------------------------------------------------


def _zones(
    cfg: Config, plan: ZonePlan, gpu_az: str, capacity: str | None = None, store: StateStore | None = None
) -> eksctl.Zones:
    """The zones to render for a GPU group in ``gpu_az`` from ``capacity`` (default: the first of
    ``cluster.gpu_capacity``); its reservation: the configured one (or the block), else for on-demand the one the
    placement search found holding every GPU node there. A block that has not started gives a group of size 0."""
    source = capacity or cfg.cluster.capacity_order[0]
    reservation = eksctl.source_reservation(cfg, source)
    if source == "on-demand":
        reservation = plan.reservations.get(gpu_az)
    block = recorded_block(cfg, store) if store is not None and source == "capacity-block" else None
    at_zero = block is not None and not block.started(datetime.now(UTC))
    return eksctl.Zones(
        gpu_az=gpu_az,
        cluster_azs=plan.cluster_azs,
        assumed=False,
        reservation=reservation,
        capacity=source,
        at_zero=at_zero,
    )


def write_eksctl_config(
    d: Deployment, plan: ZonePlan, gpu_az: str, nodegroup: str | None, capacity: str | None = None
) -> Path:
    """The ClusterConfig for one eksctl call: the cluster alone (``nodegroup=None``) or one node group of it, the
    GPU group's nodes from ``capacity`` (default: the first of ``cluster.gpu_capacity``)."""
    zones = _zones(d.cfg, plan, gpu_az, capacity, d.state)
    doc = eksctl.cluster_config(d.cfg, zones, bucket=d.state.get("bucket"), kms_key=d.state.get("bucket_kms_key"))
    groups = [g for g in doc["managedNodeGroups"] if g["name"] == nodegroup]
    doc = {**doc, "managedNodeGroups": groups}
    name = "eksctl-cluster.yaml" if nodegroup is None else f"eksctl-nodegroup-{nodegroup}.yaml"
    return d.state.write_file(name, to_yaml([doc]))


def cluster_status(d: Deployment) -> str | None:
    """The EKS cluster's status (``ACTIVE``, ``CREATING``, ...) or ``None`` when it does not exist."""
    c = d.cfg.cluster
    argv = ["eksctl", "get", "cluster", "--name", c.name, "--region", c.region, "--output", "json"]
    done = d.run(argv, timeout=QUICK_TIMEOUT_S, check=False)
    if not done.ok:
        if _CLUSTER_NOT_FOUND.search(done.stderr + done.stdout):
            return None
        raise CommandError(
            done.argv,
            done.returncode,
            done.stderr,
            hint="Check your AWS credentials (`aws sts get-caller-identity`) and the region.",
        )
    # eksctl prints the EKS API's Cluster objects with Go's field names (``Name``, ``Status``), in a list.
    entries = _eksctl_json(done, f"cluster {c.name}")
    for entry in entries:
        name = entry.get("Name", entry.get("name"))
        if name is None or name == c.name:  # asked by name: an entry without one is taken as that cluster
            return _status_of(entry, done, f"cluster {c.name}")
    return None


def _eksctl_json(done: Completed, what: str) -> list[dict[str, object]]:
    try:
        data = json.loads(done.stdout or "[]")
    except json.JSONDecodeError:
        data = None
    entries = data if isinstance(data, list) else [data] if isinstance(data, dict) else None
    if entries is None or not all(isinstance(e, dict) for e in entries):
        raise UnreadableAnswer(
            f"cannot tell the state of {what}: `{shlex.join(done.argv)}` printed no JSON list "
            f"({(done.stdout or '').strip()[:200]!r}); nothing was changed and nothing recorded was forgotten",
            hint="Run that command yourself to see what eksctl says (an eksctl release that prints another format?), "
            "then run the same raytrain-eks command again.",
        )
    return entries


def _status_of(entry: dict[str, object], done: Completed, what: str) -> str:
    status = entry.get("Status") or entry.get("status")
    if not isinstance(status, str) or not status:
        raise UnreadableAnswer(
            f"cannot tell the state of {what}: `{shlex.join(done.argv)}` gave no Status for it; it is not taken "
            "as ACTIVE (nor as gone), so nothing was changed and nothing recorded was forgotten",
            hint="Run that command yourself to see what eksctl says, then run the same raytrain-eks command again.",
        )
    return status.upper()


def nodegroup_statuses(d: Deployment) -> dict[str, str]:
    """Node group name -> status (``ACTIVE``, ``CREATING``, ``CREATE_FAILED``, ...)."""
    c = d.cfg.cluster
    argv = ["eksctl", "get", "nodegroup", "--cluster", c.name, "--region", c.region, "--output", "json"]
    done = d.run(argv, timeout=QUICK_TIMEOUT_S, check=False)
    if not done.ok:
        if _NODEGROUPS_NOT_FOUND.search(done.stderr + done.stdout):
            return {}
        raise CommandError(done.argv, done.returncode, done.stderr)
    # A list of eksctl's nodegroup summaries; for managed groups ``Status`` is the EKS API's (ACTIVE, CREATING, ...).
    entries = _eksctl_json(done, f"the node groups of cluster {c.name}")
    statuses = {}
    for e in entries:
        if not e.get("Name"):
            raise UnreadableAnswer(
                f"cannot tell which node groups cluster {c.name} has: `{shlex.join(done.argv)}` listed one without "
                "a Name; nothing was changed and nothing recorded was forgotten",
                hint="Run that command yourself to see what eksctl says, then run the same raytrain-eks command again.",
            )
        statuses[str(e["Name"])] = _status_of(e, done, f"node group {e['Name']}")
    return statuses


def _wait_while_busy(
    d: Deployment,
    what: str,
    status: Callable[[], str | None],
    timeout: float,
    busy: Callable[[str | None], bool] = _BUSY.__contains__,
) -> str | None:
    """``status()`` once it is no longer one of the busy states (creating, updating, deleting); None: not there."""

    def probe() -> tuple[tuple[str | None] | None, str]:
        current = status()
        return (None, str(current)) if busy(current) else ((current,), str(current))

    return d.wait(
        probe,
        what=what,
        timeout=timeout,
        interval=BUSY_POLL_S,
        on_timeout=lambda last, waited: UserError(
            f"{what} is still {last} after {timeout:.0f} s", hint="Run `raytrain-eks up` again later."
        ),
    )[0]


def _cluster_stack(d: Deployment) -> Callable[[], str | None]:
    """The status of the cluster's CloudFormation stack (None: none), read through boto3 each time it is called."""
    from raytrain_eks.aws.session import connect

    c = d.cfg.cluster
    aws = connect(c.region)
    return lambda: stacks.stack_status(aws, c.region, stacks.cluster_stack_name(c.name))


def leftover_cluster_stack(d: Deployment) -> str | None:
    """When EKS has no cluster of this name: the status of the stack a create left under its name, or None."""
    c = d.cfg.cluster
    return _wait_while_busy(
        d, f"CloudFormation stack {stacks.cluster_stack_name(c.name)}", _cluster_stack(d), CLUSTER_TIMEOUT_S,
        busy=stacks.busy_stack,
    )  # fmt: skip


def delete_cluster_stack(d: Deployment, why: str) -> bool:
    """EKS has no cluster of this name, and no stack of its name is in progress (:func:`leftover_cluster_stack` has
    waited): delete the stack eksctl left under the name, its termination protection turned off first as eksctl
    does, and wait until it is gone; ``False`` when there is none. ``why`` is said before the delete: "left by a
    create that failed".

    A stack whose tags do not name the cluster is never touched (:class:`~raytrain_eks.aws.stacks.NotEksctlStack`);
    one that CloudFormation could not delete (``DELETE_FAILED``) is a ``UserError`` naming what to do."""
    from raytrain_eks.aws.session import connect

    c = d.cfg.cluster
    aws = connect(c.region)
    stack = stacks.describe_stack(aws, c.region, stacks.cluster_stack_name(c.name))
    if stack is None:
        return False
    if not stack.made_for(c.name):
        raise stacks.not_made_for(stack, c.name, c.region)
    d.say(f"CloudFormation stack {stack.name} is {stack.status}, {why}: deleting it")
    stacks.delete_eksctl_stack(aws, c.region, stack, c.name)
    after = leftover_cluster_stack(d)
    if after is not None:
        raise UserError(
            f"the CloudFormation stack {stack.name} could not be deleted: it is {after}",
            hint="Its Events in the CloudFormation console name the resource that could not be deleted; remove that, "
            "then run the same raytrain-eks command again.",
        )
    return True


def remove_stale_cluster_stack(d: Deployment) -> None:
    """Before creating the cluster (EKS has none): delete, through CloudFormation, a stack of the cluster's name that
    a failed create left (``ROLLBACK_COMPLETE``, ``CREATE_FAILED``, ``ROLLBACK_FAILED``, ``DELETE_FAILED``), which
    would make eksctl fail on the name; wait out one in progress; stop on one in use, or one eksctl did not make
    for this cluster."""
    c = d.cfg.cluster
    name = stacks.cluster_stack_name(c.name)
    status = leftover_cluster_stack(d)
    if status is None:
        return
    if not stacks.stale_stack(status):
        raise UserError(
            f"the CloudFormation stack {name} exists ({status}) in {c.region}, but EKS has no cluster {c.name}",
            hint=f"It is not what a failed create leaves. If nothing uses it, {stacks.delete_hint(name, c.region)}; "
            "then run `raytrain-eks up` again.",
        )
    delete_cluster_stack(d, "left by a create that failed (EKS has no cluster of its name)")


def no_existing_cluster(cfg: Config) -> UserError:
    c = cfg.cluster
    return UserError(
        f"EKS has no cluster {c.name} in {c.region}, and cluster.existing is true: up does not create one; nothing "
        "was created",
        hint="Name your cluster in cluster.name (and its region in cluster.region), or set cluster.existing to "
        "false to have up create it.",
    )


def ensure_cluster(d: Deployment, plan: ZonePlan) -> None:
    """Create the EKS cluster (no node groups) unless it exists; write this folder's kubeconfig for it."""
    c = d.cfg.cluster
    item = cluster_item(d.cfg)
    status = _wait_while_busy(d, f"cluster {c.name}", lambda: cluster_status(d), CLUSTER_TIMEOUT_S)
    if status is None and c.existing:
        raise no_existing_cluster(d.cfg)
    if status is None:
        remove_stale_cluster_stack(d)
        for note in plan.notes:
            d.say(note)
        path = write_eksctl_config(d, plan, plan.candidates[0], None)
        d.state.record(item)
        d.say(f"Creating EKS cluster {c.name} in {c.region} (zones {', '.join(plan.cluster_azs)}); about 15-20 minutes")
        d.run(
            eksctl.create_cluster_argv(str(path), kubeconfig=d.kubeconfig),
            timeout=CLUSTER_TIMEOUT_S,
            on_output=d.say,
            hint="Run `raytrain-eks up` again to resume, or `raytrain-eks down` to delete what was created.",
        )
    elif status != "ACTIVE":
        raise UserError(
            f"cluster {c.name} in {c.region} is {status}",
            hint="Run `raytrain-eks down` to delete it, then `raytrain-eks up`.",
        )
    elif d.state.has(item):
        d.say(f"Cluster {c.name} exists")
    else:
        d.say(
            f"Cluster {c.name} already exists in {c.region} and was not created from this folder: using it as it is "
            "(`down` will not delete it)"
        )
    d.run(kubeconfig_argv(d.cfg, d.kubeconfig), timeout=QUICK_TIMEOUT_S)


def kubeconfig_argv(cfg: Config, path: str) -> list[str]:
    c = cfg.cluster
    return ["eksctl", "utils", "write-kubeconfig", "--cluster", c.name, "--region", c.region, "--kubeconfig", path]


def create_nodegroup_argv(path: Path) -> list[str]:
    # The NVIDIA flag stops eksctl's own static plugin; the pinned chart replaces it (docs/reference/infra-facts.md §1).
    argv = ["eksctl", "create", "nodegroup", "-f", str(path), "--install-nvidia-plugin=false"]
    return argv + eksctl.wait_flag(eksctl.NODEGROUP_WAIT_MIN)


def delete_nodegroup_argv(cfg: Config, name: str) -> list[str]:
    c = cfg.cluster
    wait = eksctl.wait_flag(eksctl.NODEGROUP_WAIT_MIN)
    return ["eksctl", "delete", "nodegroup", "--cluster", c.name, "--region", c.region, *wait, "--name", name, "--wait"]


def delete_cluster_argv(cfg: Config) -> list[str]:
    """``eksctl delete cluster``, its stacks included, for a cluster EKS has. Never for one it has not: eksctl
    v0.230.0 then stops at describing the missing cluster, and with ``--force`` dies on a nil pointer before it
    looks for the stack (pkg/ctl/delete/cluster.go, pkg/actions/cluster/cluster.go ``New``);
    :func:`delete_cluster_stack` deletes what such a create left. eksctl does not apply ``--timeout`` to this wait
    (pkg/ctl/delete/cluster.go says so); it is given all the same, for the day it does."""
    c = cfg.cluster
    argv = ["eksctl", "delete", "cluster", "--name", c.name, "--region", c.region, "--wait"]
    return argv + eksctl.wait_flag(eksctl.CLUSTER_WAIT_MIN)


def ensure_system_nodegroup(d: Deployment, plan: ZonePlan) -> None:
    name = eksctl.SYSTEM_NODEGROUP
    status = _wait_while_busy(d, f"node group {name}", lambda: nodegroup_statuses(d).get(name), NODEGROUP_TIMEOUT_S)
    if status == "ACTIVE":
        d.say(f"Node group {name} exists")
        return
    if status in _FAILED_NODEGROUP:
        d.say(f"Node group {name} is {status}: removing it before creating it again")
        d.run(delete_nodegroup_argv(d.cfg, name), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)
    path = write_eksctl_config(d, plan, plan.candidates[0], name)
    d.state.record(nodegroup_item(name))
    c = d.cfg.cluster
    d.say(
        f"Creating node group {name} ({c.system_node_count} x {c.system_node_type}, "
        f"{eksctl.SYSTEM_VOLUME_GIB} GiB gp3 root volume each)"
    )
    d.run(create_nodegroup_argv(path), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)


def launch_failure(text: str) -> str | None:
    """The line of eksctl's output that says EC2 could not launch the instances (or that eksctl's wait for them
    ended), or ``None`` for another error."""
    for line in text.splitlines():
        if _LAUNCH_FAILURE.search(line):
            if _WAIT_ENDED in line.lower():
                return f"no Ready instances within eksctl's {eksctl.NODEGROUP_WAIT_MIN}-minute wait ({line.strip()})"
            return line.strip()[:400]
    return None


def _stack_failures(d: Deployment, nodegroup: str) -> list[str]:
    """The failure reasons in the node group's CloudFormation stack; [] when AWS cannot be asked (eksctl's own
    error is then the one reported)."""
    from raytrain_eks.aws.session import connect

    c = d.cfg.cluster
    try:
        return stacks.failure_reasons(connect(c.region), c.region, stacks.nodegroup_stack_name(c.name, nodegroup))
    except UserError as exc:
        d.say(f"Could not read why the node group's stack failed: {exc.message}")
        return []


class BlockNotStarted(UserError):
    """The GPU node group waits at size 0 for its Capacity Block to start: ``up`` goes on once it has."""


def _block_wait(d: Deployment) -> BlockNotStarted | None:
    """Why the GPU nodes cannot come yet: the group uses the configured block, which has not started."""
    block = recorded_block(d.cfg, d.state)
    if block is None or d.state.get("gpu_capacity_used") != "capacity-block" or block.started(datetime.now(UTC)):
        return None
    return BlockNotStarted(
        f"node group {d.cfg.cluster.gpu_nodegroup_name} is in {block.zone} at size 0: Capacity Block {block.id} "
        f"starts at {block.start:%Y-%m-%d %H:%M} UTC (it ends {block.end:%Y-%m-%d %H:%M} UTC)",
        hint="Run `raytrain-eks up` again once the block has started: it scales the group to "
        f"{d.cfg.cluster.gpu_node_count} nodes and goes on. Until then the block's instances cannot launch.",
    )


def _attempts(cfg: Config, plan: ZonePlan, store: StateStore) -> list[tuple[str, str]]:
    """(capacity source, zone) in the order ``up`` tries them: each source of ``cluster.gpu_capacity`` in every
    candidate zone, a Capacity Block in its own zone only."""
    out = []
    for source in cfg.cluster.capacity_order:
        block = recorded_block(cfg, store) if source == "capacity-block" else None
        zones = [block.zone] if block is not None else list(plan.candidates)
        out += [(source, az) for az in zones if az in plan.cluster_azs]
    return out


def _launch(d: Deployment, plan: ZonePlan, az: str, source: str) -> str | None:
    """Create the GPU node group in ``az`` from ``source``; None when it came up, else why EC2 could not launch
    it there (any other failure is raised)."""
    c, name = d.cfg.cluster, d.cfg.cluster.gpu_nodegroup_name
    path = write_eksctl_config(d, plan, az, name, source)
    d.state.record(nodegroup_item(name))
    d.state.update(gpu_az=az, gpu_capacity_used=source)
    zones = _zones(d.cfg, plan, az, source, d.state)
    into = f", into capacity reservation {zones.reservation}" if zones.reservation else ""
    kind = "" if source in ON_DEMAND_SOURCES else f", {source}"
    size = "0 (until the block starts)" if zones.at_zero else str(c.gpu_node_count)
    d.say(f"Creating node group {name} ({size} x {c.gpu_node_type}{kind}, EFA) in {az}{into}")
    try:
        done = d.run(create_nodegroup_argv(path), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say, check=False)
        # eksctl logs its errors on stdout and its final one on stderr: read both. For a node group's stack it
        # says only that the waiter failed; the stack's events say why (EKS's health issues).
        reason = None if done.ok else launch_failure(f"{done.stderr}\n{done.stdout}")
        if not done.ok and reason is None:
            reason = launch_failure("\n".join(_stack_failures(d, name)))
        if not done.ok and reason is None:
            raise CommandError(done.argv, done.returncode, done.stderr or done.stdout)
    except CommandError as exc:
        if not exc.timed_out:
            raise
        reason = f"no Ready instances after {NODEGROUP_TIMEOUT_S // 60} minutes"
    if reason is None and zones.at_zero:
        d.state.update(gpu_scaled_to=0)
    return reason


def ensure_gpu_nodegroup(d: Deployment, plan: ZonePlan) -> str:
    """Create the EFA GPU node group from the first capacity source and zone that can launch it; return the zone.

    Sources are tried in ``cluster.gpu_capacity``'s order, each in every candidate zone (a Capacity Block in its
    own). A zone that cannot launch the instances (no capacity, no offering) is reported with eksctl's reason, the
    failed node group is removed, and the next is tried. Any other failure stops here (re-running resumes). A group
    made for a Capacity Block that has not started stops ``up`` with :class:`BlockNotStarted`.
    """
    c = d.cfg.cluster
    name = c.gpu_nodegroup_name
    status = _wait_while_busy(d, f"node group {name}", lambda: nodegroup_statuses(d).get(name), NODEGROUP_TIMEOUT_S)
    if status == "ACTIVE":
        seen = sorted({n.zone for n in d.kube.nodes(GPU_NODE_SELECTOR) if n.zone})
        az = d.state.get("gpu_az") or (seen[0] if seen else plan.candidates[0])
        d.say(f"Node group {name} exists (zone {az})")
        d.state.update(gpu_az=az)
        if (waiting := _block_wait(d)) is not None:
            raise waiting
        if d.state.get("gpu_scaled_to") == 0:
            d.say(f"It was scaled to 0: scaling it back to {c.gpu_node_count} nodes")
            scale_gpu_nodes(d, c.gpu_node_count)
        return az
    if status in _FAILED_NODEGROUP:
        d.say(f"Node group {name} is {status} from an earlier run: removing it first")
        d.run(delete_nodegroup_argv(d.cfg, name), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)
    failures: dict[str, str] = dict(d.state.get("zone_failures") or {})
    if c.existing and d.state.get(PLUGINS_BEFORE_KEY) is None:
        # Before eksctl first creates the group here: what it applies afterwards under these names is its copy.
        present = [n for n in EKSCTL_PLUGIN_DAEMONSETS if d.kube.get("apps/v1", "DaemonSet", n, "kube-system")]
        d.state.update(**{PLUGINS_BEFORE_KEY: present})
    attempts = _attempts(d.cfg, plan, d.state)
    several = len(c.capacity_order) > 1
    for i, (source, az) in enumerate(attempts):
        reason = _launch(d, plan, az, source)
        if reason is not None:
            failures[az] = f"{source}: {reason}" if several else reason
            d.state.update(zone_failures=failures, gpu_az=None, gpu_capacity_used=None)
            following = attempts[i + 1] if i + 1 < len(attempts) else None
            then = "" if following is None or not several else f" ({following[0]})"
            next_step = f"trying {following[1]}{then} next" if following else "no zone left to try"
            d.say(f"{c.gpu_node_type}{f' ({source})' if several else ''} could not launch in {az}: {reason}")
            d.say(f"Removing the failed node group {name}; {next_step}")
            d.run(delete_nodegroup_argv(d.cfg, name), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)
            continue
        failures.pop(az, None)
        d.state.update(zone_failures=failures or None, gpu_az=az)
        if (waiting := _block_wait(d)) is not None:
            raise waiting
        return az
    d.state.forget(nodegroup_item(name))
    tried = "; ".join(f"{az}: {why}" for az, why in failures.items())
    raise UserError(
        f"{c.gpu_node_type} could not launch"
        + (f" from {' or '.join(c.capacity_order)}" if several else "")
        + f" in any zone tried ({tried})",
        hint="Ask AWS for capacity (an On-Demand Capacity Reservation or a Capacity Block: `raytrain-eks capacity "
        "--blocks`), add another source to cluster.gpu_capacity, try later, or choose another region or instance "
        "type; the cluster itself is kept (`raytrain-eks down` deletes it).",
    )


def scale_gpu_nodes(d: Deployment, nodes: int) -> None:
    """Set the GPU node group's size; 0 stops the instances' billing while the group, its zone and the cluster
    stay (``up`` or a RayJob ``submit`` scales it back)."""
    d.run(eksctl.scale_gpu_nodegroup_argv(d.cfg, nodes), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)
    d.state.update(gpu_scaled_to=nodes)


def eksctl_copies(d: Deployment) -> list[str]:
    """The plugin DaemonSets in kube-system that are eksctl's copies applied for this folder's GPU node group.

    On a cluster this folder created, every DaemonSet of eksctl's names is. On an existing cluster only one eksctl
    applied when it created the GPU node group from this folder: the names present in kube-system right before the
    first ``eksctl create nodegroup`` of that group are recorded in the state file (``eksctl_plugins_before``),
    and a DaemonSet of another of eksctl's names found later is eksctl's. With nothing recorded (the group was not
    created from this folder) none is. The cluster's own DaemonSets of those names stay whatever eksctl did to them:
    eksctl replaces one of its EFA name when it creates any EFA node group, and it is the cluster's plugin still.
    """
    if not d.cfg.cluster.existing:
        return list(EKSCTL_PLUGIN_DAEMONSETS)
    before = d.state.get(PLUGINS_BEFORE_KEY)
    if before is None:
        return []
    return [n for n in EKSCTL_PLUGIN_DAEMONSETS if n not in before]


def remove_eksctl_device_plugins(d: Deployment) -> None:
    """Delete the plugin DaemonSets eksctl applies by itself for the GPU node group (:func:`eksctl_copies`): only
    the pinned charts, or the plugins an existing cluster already ran, may advertise GPUs and EFA.

    eksctl's EFA DaemonSet has the name of the EFA chart's own, so a DaemonSet of that name is deleted only while
    it lacks the release's Helm ownership metadata: that is eksctl's copy (just applied, or applied over the
    chart's when a node group was created again), and Helm would refuse to install the chart over it.
    """
    owners = {rel.workload: rel for rel in helm_releases(d.cfg) if rel.namespace == "kube-system"}
    for name in eksctl_copies(d):
        found = d.kube.get("apps/v1", "DaemonSet", name, "kube-system")
        if found is None:
            continue
        owner = owners.get(("DaemonSet", name))
        if owner is not None and owned_by(found, owner):
            continue
        if d.kube.delete("apps/v1", "DaemonSet", name, "kube-system"):
            d.say(f"Removed eksctl's own DaemonSet kube-system/{name} (the pinned chart replaces it)")
