"""The deploy steps of ``up``, ``status`` and ``down``, as functions over one :class:`Deployment`.

A :class:`Deployment` bundles the configuration, the Kubernetes interface (:class:`~raytrain_eks.k8s.cluster.KubeApi`),
the runner for eksctl and helm (:class:`~raytrain_eks.eks.runner.Runner`) and the :class:`StateStore` that remembers,
in ``.raytrain-eks/state.json`` of the working folder, the region and zones chosen and everything created. Every
step looks before it acts, and records what it is about to create *before* creating it, so re-running after a
failure resumes and ``down`` finds even what a crash left half made. Example::

    d = Deployment(cfg, kube=KubernetesApi(store.kubeconfig), run=runner.run, state=StateStore(".raytrain-eks"))
    up(d, confirm=lambda question: True)        # cluster -> node groups -> device plugins -> KubeRay
    down(d, confirm=lambda question: True)      # everything up and submit created, in reverse order

``up``: the cluster (eksctl, private subnets behind one NAT gateway), the system node group, the EFA GPU node group
in one zone (the next zone when one cannot launch the instances, after removing the failed group), the pinned
device-plugin and KubeRay charts (helm), and then the proof: the plugins' DaemonSets Ready on every GPU node and
every GPU node advertising ``nvidia.com/gpu`` and ``vpc.amazonaws.com/efa``, not merely helm's exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_eks.aws import eksctl
from raytrain_eks.config import Config
from raytrain_eks.eks.plan import HelmRelease, check_deployable, cost_per_hour, helm_releases, to_yaml
from raytrain_eks.eks.runner import CommandError, Completed, Interrupted, Runner, require_tool
from raytrain_eks.errors import UserError
from raytrain_eks.instances import InstanceType
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.cluster import KubeApi, Node

STATE_DIR = ".raytrain-eks"
STATE_FILE = "state.json"
KUBECONFIG_FILE = "kubeconfig"

# Seconds. eksctl's CloudFormation stacks take 15-20 minutes for a cluster and 5-15 for a node group.
CLUSTER_TIMEOUT_S = 45 * 60
NODEGROUP_TIMEOUT_S = 40 * 60
HELM_TIMEOUT_S = 15 * 60
QUICK_TIMEOUT_S = 120
GPU_READY_TIMEOUT_S = 15 * 60
POLL_S = 10.0
MAX_ZONES = 3  # zones given subnets (and so GPU zones to try) when the config names none

GPU_NODE_SELECTOR = {"role": m.GPU_NODE_LABELS["role"]}
DEVICE_PLUGIN_RELEASES = ("nvidia-device-plugin", "aws-efa-k8s-device-plugin")
KUBERAY_RELEASE = "kuberay-operator"
RAYCLUSTER_CRD = "rayclusters.ray.io"

# What eksctl prints when EC2 cannot start the instances in a zone: no capacity, or no offering of the type there.
_LAUNCH_FAILURE = re.compile(
    r"InsufficientInstanceCapacity|InsufficientCapacity|Unsupported|not supported in (your requested )?"
    r"Availability Zone|AsgInstanceLaunchFailures|NodeCreationFailure|Could not launch On-Demand Instances",
    re.IGNORECASE,
)
# Only what eksctl says when the EKS API answered that the thing is not there: the API's error code, or eksctl's own
# "No cluster found for name: X" / "No nodegroups found". Any other failure (credentials, network, a profile or
# file "not found") says nothing about the cluster, so it is an error and never taken to mean "gone".
_CLUSTER_NOT_FOUND = re.compile(r"ResourceNotFoundException|No cluster found for name")
_NODEGROUPS_NOT_FOUND = re.compile(r"ResourceNotFoundException|No nodegroups? found")
_FAILED_NODEGROUP = {"CREATE_FAILED", "DEGRADED", "DELETE_FAILED"}
_BUSY = {"CREATING", "UPDATING", "DELETING", "CREATE_IN_PROGRESS", "DELETE_IN_PROGRESS"}


class UnreadableAnswer(UserError):
    """eksctl answered, but not in a form that says what exists: nothing is assumed, nothing is changed."""


class Cancelled(UserError):
    """The user answered no to the confirmation: nothing was changed."""


class NodesNotReady(UserError):
    """The GPU nodes do not advertise what the worker pods request; each problem names its fix."""

    def __init__(self, problems: Sequence[str], *, waited_s: float | None = None) -> None:
        self.problems = list(problems)
        head = "The GPU nodes are not ready for the Ray workers"
        if waited_s is not None:
            head += f" after {waited_s:.0f} s"
        lines = [head + ":"] + [f"  - {p}" for p in self.problems]
        super().__init__(
            "\n".join(lines),
            hint="Run `raytrain-eks up` again: it reinstalls the device plugins and waits until every GPU node "
            "advertises nvidia.com/gpu and vpc.amazonaws.com/efa. `raytrain-eks status` shows the nodes.",
        )


# ----------------------------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------------------------


class StateStore:
    """What this working folder deployed: ``state.json`` (plus the kubeconfig and generated files) under ``root``.

    ``created`` is the ordered list of things raytrain-eks created, each recorded before it is created; ``down``
    deletes them in reverse. Example: ``StateStore(".raytrain-eks").get("gpu_az")``.
    """

    def __init__(self, root: str | Path = STATE_DIR) -> None:
        self.root = Path(root)
        self.path = self.root / STATE_FILE
        self.data: dict[str, Any] = {}
        if self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
            except ValueError:
                raise UserError(
                    f"{self.path} is not valid JSON",
                    hint="Restore it, or move it away if nothing is deployed from this folder.",
                ) from None

    @property
    def kubeconfig(self) -> Path:
        return self.root / KUBECONFIG_FILE

    @property
    def created(self) -> list[dict[str, Any]]:
        return list(self.data.get("created", []))

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def update(self, **values: Any) -> None:
        for key, value in values.items():
            if value is None:
                self.data.pop(key, None)
            else:
                self.data[key] = value
        self.save()

    def has(self, item: dict[str, Any]) -> bool:
        return item in self.data.get("created", [])

    def record(self, item: dict[str, Any]) -> None:
        """Remember ``item`` as created by raytrain-eks (idempotent)."""
        if not self.has(item):
            self.data.setdefault("created", []).append(item)
            self.save()

    def forget(self, item: dict[str, Any]) -> None:
        if self.has(item):
            self.data["created"].remove(item)
            self.save()

    def write_file(self, name: str, text: str) -> Path:
        """Write a generated file (eksctl config, Helm values) under ``root``; :meth:`clear` removes it again."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        files = self.data.setdefault("files", [])
        if name not in files:
            files.append(name)
            self.save()
        return path

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path)  # never a half-written state file

    def clear(self) -> None:
        """Forget the deployment (after ``down``): remove the state, the kubeconfig and the files written here, and
        nothing else (``--state-dir`` may point at a folder that holds other files too)."""
        names = [*self.data.get("files", []), KUBECONFIG_FILE, STATE_FILE]
        self.data = {}
        for name in names:
            path = self.root / name
            path.unlink(missing_ok=True)
            for parent in path.relative_to(self.root).parents:
                folder = self.root / parent
                if folder != self.root and folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        if self.root.is_dir() and not any(self.root.iterdir()):
            self.root.rmdir()


def cluster_item(cfg: Config) -> dict[str, Any]:
    return {"type": "cluster", "name": cfg.cluster.name, "region": cfg.cluster.region}


def nodegroup_item(name: str) -> dict[str, Any]:
    return {"type": "nodegroup", "name": name}


def helm_item(rel: HelmRelease) -> dict[str, Any]:
    return {"type": "helm", "name": rel.name, "namespace": rel.namespace}


def object_item(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "type": "object",
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": meta["name"],
        "namespace": meta.get("namespace") if obj["kind"] != "Namespace" else None,
    }


def describe(item: dict[str, Any]) -> str:
    """A created item as words: ``EKS cluster ray-train-eks (us-east-1)``."""
    kind = item["type"]
    if kind == "cluster":
        return f"EKS cluster {item['name']} ({item['region']}) with its VPC and NAT gateway"
    if kind == "nodegroup":
        return f"node group {item['name']}"
    if kind == "helm":
        return f"Helm release {item['namespace']}/{item['name']}"
    where = f"{item['namespace']}/" if item.get("namespace") else ""
    return f"{item['kind']} {where}{item['name']}"


def apply_state(cfg: Config, store: StateStore) -> Config:
    """``cfg`` with the cluster name, region and GPU zone remembered by ``up``, so later commands (``submit``,
    ``status``, ``down``) act on the cluster that was created even when the shell's REGION or GPU_AZ changed."""
    remembered = {k: store.get(s) for k, s in (("name", "cluster"), ("region", "region"), ("gpu_az", "gpu_az"))}
    remembered = {k: v for k, v in remembered.items() if v}
    if not remembered:
        return cfg
    cluster = cfg.cluster.model_copy(update=remembered)
    if cluster.gpu_az and cluster.availability_zones and cluster.gpu_az not in cluster.availability_zones:
        cluster = cluster.model_copy(update={"availability_zones": []})
    return cfg.model_copy(update={"cluster": cluster})


# ----------------------------------------------------------------------------------------------------------------
# The deployment
# ----------------------------------------------------------------------------------------------------------------


def _quiet(_: str) -> None:
    pass


@dataclass
class Deployment:
    """Everything a step needs. ``say`` prints one progress line; ``sleep`` and ``clock`` are injectable so the
    tests' fake cluster can run the waits in simulated time; ``require_tool`` checks that a program is installed."""

    cfg: Config
    kube: KubeApi
    run: Runner
    state: StateStore
    say: Callable[[str], None] = _quiet
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    require_tool: Callable[[str], object] = require_tool

    @property
    def kubeconfig(self) -> str:
        return str(self.state.kubeconfig)


@dataclass(frozen=True)
class Action:
    """One thing ``up`` does, for ``up --plan``: a name, what it does, and the command when it is one."""

    name: str
    what: str
    argv: list[str] | None = None


@dataclass(frozen=True)
class ZonePlan:
    """``candidates``: GPU zones to try, in order. ``cluster_azs``: the zones given subnets (every candidate).
    ``reservations``: zone -> the existing capacity reservation the GPU node group targets there."""

    candidates: tuple[str, ...]
    cluster_azs: tuple[str, ...]
    reservations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """What the placement search found: the zones that can take the GPU node group now, best first, and for each
    zone an existing capacity reservation holding every GPU node, when there is one."""

    zones: list[str]
    reservations: dict[str, str] = field(default_factory=dict)
    offered: list[str] = field(default_factory=list)  # every zone of the region offering the type, best first


@dataclass
class UpResult:
    gpu_az: str
    gpu_nodes: list[str]
    created: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------
# Zones
# ----------------------------------------------------------------------------------------------------------------


def placement_zones(cfg: Config, services: Any | None = None) -> Placement:
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
    if problem is not None:
        raise problem
    usable = [c for c in report.targets if c.viable and c.zone]
    return Placement(
        zones=[c.zone for c in usable if c.zone],
        reservations={c.zone: c.reservation.id for c in usable if c.zone and c.covered and c.reservation},
        offered=[c.zone for c in report.candidates if c.offered and c.zone and c.region == cfg.cluster.region],
    )


def _with_second_zone(cfg: Config, gpu_az: str, found: Placement | None) -> tuple[str, ...]:
    """``gpu_az`` and the cluster's other zones (eksctl needs two; the others only hold subnets): the configured
    ``availability_zones`` when there are some, else the best other zone that offers the GPU type when the
    placement search ran, else the planned default."""
    other = next((z for z in (found.offered if found is not None else []) if z != gpu_az), None)
    if other is not None and not cfg.cluster.availability_zones:
        return (gpu_az, other)
    return eksctl.planned_zones(
        cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"gpu_az": gpu_az})})
    ).cluster_azs


def choose_zones(cfg: Config, store: StateStore, offered: Callable[[], Placement] | None = None) -> ZonePlan:
    """The GPU zones to try and the cluster's zones: remembered ones first, then the config's, else the zones the
    placement search (``offered``) ranks best. Zones that failed before are tried last.

    ``offered`` runs whenever the GPU node group is not yet recorded as created, so a short quota, a type not
    offered in the configured zone or a reservation that cannot hold the nodes stops ``up`` before anything is made;
    the configured or remembered zones are then kept only where the search says the group can go.
    Example: ``choose_zones(cfg, store).candidates``.
    """
    c = cfg.cluster
    found: Placement | None = None
    if offered is not None and not store.has(nodegroup_item(c.gpu_nodegroup_name)):
        found = offered()
    remembered = tuple(store.get("cluster_azs") or ())
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
        pool, cluster_azs = [c.gpu_az], _with_second_zone(cfg, c.gpu_az, found)
    elif c.availability_zones:
        pool, cluster_azs = list(c.availability_zones), tuple(c.availability_zones)
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
    return ZonePlan(tuple(ordered), tuple(cluster_azs), {z: r for z, r in reservations.items() if z in ordered})


# ----------------------------------------------------------------------------------------------------------------
# eksctl
# ----------------------------------------------------------------------------------------------------------------


def _zones(cfg: Config, plan: ZonePlan, gpu_az: str) -> eksctl.Zones:
    """The zones to render for a GPU group in ``gpu_az``; its reservation: the configured one, else the one the
    placement search found holding every GPU node there."""
    reservation = cfg.cluster.capacity_reservation_id or plan.reservations.get(gpu_az)
    return eksctl.Zones(gpu_az=gpu_az, cluster_azs=plan.cluster_azs, assumed=False, reservation=reservation)


def write_eksctl_config(d: Deployment, plan: ZonePlan, gpu_az: str, nodegroup: str | None) -> Path:
    """The ClusterConfig for one eksctl call: the cluster alone (``nodegroup=None``) or one node group of it."""
    doc = eksctl.cluster_config(d.cfg, _zones(d.cfg, plan, gpu_az))
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


def _eksctl_json(done: Completed, what: str) -> list[dict[str, Any]]:
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


def _status_of(entry: dict[str, Any], done: Completed, what: str) -> str:
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


def _wait_while_busy(d: Deployment, what: str, status: Callable[[], str | None], timeout: float) -> str | None:
    deadline = d.clock() + timeout
    current = status()
    while current in _BUSY:
        if d.clock() > deadline:
            raise UserError(
                f"{what} is still {current} after {timeout:.0f} s", hint="Run `raytrain-eks up` again later."
            )
        d.say(f"{what} is {current}; waiting")
        d.sleep(30)
        current = status()
    return current


def ensure_cluster(d: Deployment, plan: ZonePlan) -> None:
    """Create the EKS cluster (no node groups) unless it exists; write this folder's kubeconfig for it."""
    c = d.cfg.cluster
    item = cluster_item(d.cfg)
    status = _wait_while_busy(d, f"cluster {c.name}", lambda: cluster_status(d), CLUSTER_TIMEOUT_S)
    if status is None:
        path = write_eksctl_config(d, plan, plan.candidates[0], None)
        d.state.record(item)
        d.say(f"Creating EKS cluster {c.name} in {c.region} (zones {', '.join(plan.cluster_azs)}); about 15-20 minutes")
        d.run(
            eksctl.create_cluster_argv(str(path)),
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
    d.run(_kubeconfig_argv(d.cfg, d.kubeconfig), timeout=QUICK_TIMEOUT_S)


def _kubeconfig_argv(cfg: Config, path: str) -> list[str]:
    c = cfg.cluster
    return ["eksctl", "utils", "write-kubeconfig", "--cluster", c.name, "--region", c.region, "--kubeconfig", path]


def _create_nodegroup_argv(path: Path) -> list[str]:
    # The NVIDIA flag stops eksctl's own static plugin; the pinned chart replaces it (infra-facts §1).
    return ["eksctl", "create", "nodegroup", "-f", str(path), "--install-nvidia-plugin=false"]


def delete_nodegroup_argv(cfg: Config, name: str) -> list[str]:
    c = cfg.cluster
    return ["eksctl", "delete", "nodegroup", "--cluster", c.name, "--region", c.region, "--name", name, "--wait"]


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
    d.say(f"Creating node group {name} ({d.cfg.cluster.system_node_count} x {d.cfg.cluster.system_node_type})")
    d.run(_create_nodegroup_argv(path), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)


def launch_failure(text: str) -> str | None:
    """The line of eksctl's output that says EC2 could not launch the instances, or ``None`` for another error."""
    for line in text.splitlines():
        if _LAUNCH_FAILURE.search(line):
            return line.strip()[:400]
    return None


def ensure_gpu_nodegroup(d: Deployment, plan: ZonePlan) -> str:
    """Create the EFA GPU node group in the first zone that can launch it; return that zone.

    A zone that cannot launch the instances (no capacity, no offering) is reported with eksctl's reason, the failed
    node group is removed, and the next zone is tried. Any other failure stops here (re-running resumes).
    """
    c = d.cfg.cluster
    name = c.gpu_nodegroup_name
    status = _wait_while_busy(d, f"node group {name}", lambda: nodegroup_statuses(d).get(name), NODEGROUP_TIMEOUT_S)
    if status == "ACTIVE":
        seen = sorted({n.zone for n in d.kube.nodes(GPU_NODE_SELECTOR) if n.zone})
        az = d.state.get("gpu_az") or (seen[0] if seen else plan.candidates[0])
        d.say(f"Node group {name} exists (zone {az})")
        d.state.update(gpu_az=az)
        if d.state.get("gpu_scaled_to") == 0:
            d.say(f"It was scaled to 0 after a RayJob: scaling it back to {c.gpu_node_count} nodes")
            scale_gpu_nodes(d, c.gpu_node_count)
        return az
    if status in _FAILED_NODEGROUP:
        d.say(f"Node group {name} is {status} from an earlier run: removing it first")
        d.run(delete_nodegroup_argv(d.cfg, name), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)
    failures: dict[str, str] = dict(d.state.get("zone_failures") or {})
    for i, az in enumerate(plan.candidates):
        path = write_eksctl_config(d, plan, az, name)
        d.state.record(nodegroup_item(name))
        d.state.update(gpu_az=az)
        held = _zones(d.cfg, plan, az).reservation
        into = f", into capacity reservation {held}" if held else ""
        d.say(f"Creating node group {name} ({c.gpu_node_count} x {c.gpu_node_type}, EFA) in {az}{into}")
        try:
            done = d.run(_create_nodegroup_argv(path), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say, check=False)
            # eksctl logs the stack's failure reasons on stdout and its final error on stderr: read both.
            reason = None if done.ok else launch_failure(f"{done.stderr}\n{done.stdout}")
            if not done.ok and reason is None:
                raise CommandError(done.argv, done.returncode, done.stderr or done.stdout)
        except CommandError as exc:
            if not exc.timed_out:
                raise
            reason = f"no Ready instances after {NODEGROUP_TIMEOUT_S // 60} minutes"
        if reason is not None:
            failures[az] = reason
            d.state.update(zone_failures=failures, gpu_az=None)
            following = plan.candidates[i + 1] if i + 1 < len(plan.candidates) else None
            next_step = f"trying {following} next" if following else "no zone left to try"
            d.say(f"{c.gpu_node_type} could not launch in {az}: {reason}")
            d.say(f"Removing the failed node group {name}; {next_step}")
            d.run(delete_nodegroup_argv(d.cfg, name), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)
            continue
        failures.pop(az, None)
        d.state.update(zone_failures=failures or None, gpu_az=az)
        return az
    d.state.forget(nodegroup_item(name))
    tried = "; ".join(f"{az}: {why}" for az, why in failures.items())
    raise UserError(
        f"{c.gpu_node_type} could not launch in any zone tried ({tried})",
        hint="Ask AWS for capacity (an On-Demand Capacity Reservation), try later, or choose another region or "
        "instance type; the cluster itself is kept (`raytrain-eks down` deletes it).",
    )


# ----------------------------------------------------------------------------------------------------------------
# Add-ons (helm) and the proof that they work
# ----------------------------------------------------------------------------------------------------------------


def scale_gpu_nodes(d: Deployment, nodes: int) -> None:
    """Set the GPU node group's size; 0 stops the instances' billing while the group, its zone and the cluster
    stay (``up`` or a RayJob ``submit`` scales it back)."""
    d.run(eksctl.scale_gpu_nodegroup_argv(d.cfg, nodes), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)
    d.state.update(gpu_scaled_to=nodes)


def _helm(d: Deployment, argv: list[str], **kwargs: Any) -> Completed:
    return d.run([*argv, "--kubeconfig", d.kubeconfig], **kwargs)


def release_info(d: Deployment, name: str, namespace: str) -> dict[str, Any] | None:
    """``helm list`` entry of a release (``status``, ``chart`` = ``<chart>-<version>``), or ``None``."""
    done = _helm(
        d,
        ["helm", "list", "--all", "--namespace", namespace, "--filter", f"^{name}$", "--output", "json"],
        timeout=QUICK_TIMEOUT_S,
    )
    for entry in json.loads(done.stdout or "[]") or []:
        if entry.get("name") == name:
            return dict(entry)
    return None


def _install_argv(rel: HelmRelease, values: str, kubeconfig: str) -> list[str]:
    """``helm upgrade --install`` of ``rel`` with its values file at ``values``: what ``up`` runs and ``up --plan``
    shows. helm's own wait stops before the runner's ``HELM_TIMEOUT_S``, so its message is the one seen."""
    argv = [values if a == rel.values_file else a for a in rel.argv()]
    return [*argv, "--timeout", "10m", "--kubeconfig", kubeconfig]


def ensure_release(d: Deployment, rel: HelmRelease) -> None:
    """Install or upgrade one pinned chart, unless that exact chart version is already deployed."""
    info = release_info(d, rel.name, rel.namespace)
    if info and info.get("status") == "deployed" and info.get("chart") == f"{rel.chart}-{rel.version}":
        d.say(f"Helm release {rel.name} ({rel.chart} {rel.version}) is installed")
        return
    values = d.state.write_file(rel.values_file, to_yaml([rel.values]))
    d.state.record(helm_item(rel))
    d.say(f"Installing {rel.repo_name}/{rel.chart} {rel.version} ({rel.purpose})")
    d.run(
        _install_argv(rel, str(values), d.kubeconfig),
        timeout=HELM_TIMEOUT_S,
        hint=f"Run `raytrain-eks up` again; `helm status {rel.name} -n {rel.namespace}` shows the release.",
    )


def remove_eksctl_device_plugins(d: Deployment) -> None:
    """Delete the plugin DaemonSets eksctl applies by itself: only the pinned charts may advertise GPUs and EFA."""
    for name in (eksctl.EKSCTL_NVIDIA_PLUGIN_DAEMONSET, eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET):
        if d.kube.delete("apps/v1", "DaemonSet", name, "kube-system"):
            d.say(f"Removed eksctl's own DaemonSet kube-system/{name} (the pinned chart replaces it)")


def _quantity(value: str | None) -> int:
    try:
        return int(value or "0")
    except ValueError:
        return 0


def gpu_node_problems(d: Deployment, gpu: InstanceType, zone: str | None) -> tuple[list[Node], list[str]]:
    """The GPU nodes, and everything that keeps a worker pod from running on them, each with its fix.

    Checked: the number of nodes, Ready, the ``nvidia.com/gpu.present`` label, one zone, allocatable
    ``nvidia.com/gpu`` and ``vpc.amazonaws.com/efa`` at least what a worker pod requests, and a Ready pod of each
    device-plugin DaemonSet on every GPU node. Empty problems: the nodes are ready for the workers.
    """
    cfg = d.cfg
    want_gpu, want_efa = cfg.derived.ray_gpus_per_worker_pod, gpu.efa_interfaces
    nodes = d.kube.nodes(GPU_NODE_SELECTOR)
    problems: list[str] = []
    if len(nodes) < cfg.cluster.gpu_node_count:
        problems.append(
            f"{len(nodes)} of {cfg.cluster.gpu_node_count} GPU nodes (label role=gpu-worker) have joined the cluster; "
            f"check node group {cfg.cluster.gpu_nodegroup_name} with `eksctl get nodegroup --cluster "
            f"{cfg.cluster.name} --region {cfg.cluster.region}`"
        )
    for node in nodes:
        if not node.ready:
            problems.append(f"node {node.name} is not Ready; `kubectl describe node {node.name}` says why")
        if node.labels.get("nvidia.com/gpu.present") != "true":
            problems.append(
                f"node {node.name} lacks the label nvidia.com/gpu.present=true, so the NVIDIA device plugin does not "
                f"run there; fix: `kubectl label node {node.name} nvidia.com/gpu.present=true`"
            )
        if zone and node.zone and node.zone != zone:
            problems.append(f"node {node.name} is in {node.zone}, not {zone}: EFA traffic cannot cross zones")
        have_gpu = _quantity(node.allocatable.get(m.GPU_RESOURCE))
        if have_gpu < want_gpu:
            problems.append(
                f"node {node.name} advertises {m.GPU_RESOURCE}={have_gpu}, a worker pod needs {want_gpu}: the NVIDIA "
                "device plugin is not running there (fix: `raytrain-eks up` reinstalls it)"
            )
        have_efa = _quantity(node.allocatable.get(m.EFA_RESOURCE))
        if have_efa < want_efa:
            problems.append(
                f"node {node.name} advertises {m.EFA_RESOURCE}={have_efa}, a worker pod needs {want_efa}: the EFA "
                "device plugin is not running there or the node group is not EFA-enabled (fix: `raytrain-eks up` "
                "reinstalls the plugin; the node group needs efaEnabled: true)"
            )
    problems += _plugin_problems(d, nodes)
    return nodes, problems


def _plugin_problems(d: Deployment, nodes: list[Node]) -> list[str]:
    problems = []
    for release in DEVICE_PLUGIN_RELEASES:
        sets = d.kube.daemon_sets("kube-system", {"app.kubernetes.io/instance": release})
        if not sets:
            problems.append(f"no DaemonSet of Helm release {release} in kube-system (fix: `raytrain-eks up`)")
            continue
        for ds in sets:
            pods = d.kube.pods("kube-system", ds.pod_selector)
            for node in nodes:
                on_node = [p for p in pods if p.node_name == node.name]
                if not any(p.ready for p in on_node):
                    state = ", ".join(f"{p.name} {p.waiting_reason or p.phase}" for p in on_node) or "no pod"
                    problems.append(
                        f"DaemonSet kube-system/{ds.name} has no Ready pod on node {node.name} ({state}); "
                        f"`kubectl -n kube-system describe daemonset {ds.name}` says why"
                    )
    return problems


def wait_gpu_nodes(
    d: Deployment, gpu: InstanceType, zone: str | None, timeout: float = GPU_READY_TIMEOUT_S
) -> list[Node]:
    """Wait until :func:`gpu_node_problems` finds nothing; raise :class:`NodesNotReady` with every problem."""
    start = d.clock()
    last: list[str] | None = None
    while True:
        nodes, problems = gpu_node_problems(d, gpu, zone)
        if not problems:
            d.say(
                f"{len(nodes)} GPU nodes ready: each advertises {m.GPU_RESOURCE} and {m.EFA_RESOURCE}, device "
                "plugins Ready on every one"
            )
            return nodes
        if d.clock() - start >= timeout:
            raise NodesNotReady(problems, waited_s=d.clock() - start)
        if problems != last:
            d.say(
                f"Waiting for the GPU nodes: {problems[0]}"
                + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
            )
            last = problems
        d.sleep(POLL_S)


def wait_kuberay(d: Deployment, timeout: float = GPU_READY_TIMEOUT_S) -> None:
    """Wait for the RayCluster CRD and a Ready KubeRay operator pod."""
    start = d.clock()
    while True:
        crd = d.kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", RAYCLUSTER_CRD)
        pods = d.kube.pods("kuberay-system", {"app.kubernetes.io/instance": KUBERAY_RELEASE})
        if crd is not None and any(p.ready for p in pods):
            d.say("KubeRay operator is Ready")
            return
        if d.clock() - start >= timeout:
            state = ", ".join(f"{p.name} {p.waiting_reason or p.phase}" for p in pods) or "no operator pod"
            crd_state = "present" if crd else "missing"
            raise UserError(
                f"the KubeRay operator is not Ready after {timeout:.0f} s (CRD {crd_state}; {state})",
                hint="`kubectl -n kuberay-system describe pods` says why; then run `raytrain-eks up` again.",
            )
        d.sleep(POLL_S)


# ----------------------------------------------------------------------------------------------------------------
# up
# ----------------------------------------------------------------------------------------------------------------


def _check_state_matches(d: Deployment) -> None:
    c, s = d.cfg.cluster, d.state
    if s.created and (s.get("cluster"), s.get("region")) != (c.name, c.region):
        raise UserError(
            f"this folder's {s.path} belongs to cluster {s.get('cluster')} in {s.get('region')}, not {c.name} in "
            f"{c.region}",
            hint="Run `raytrain-eks down` for that cluster first, or work in another folder.",
        )


def planned_actions(cfg: Config) -> list[Action]:
    """What ``up`` does when nothing exists yet, in order, for ``up --plan``. Needs no credentials, creates nothing."""
    gpu, _ = check_deployable(cfg)
    c = cfg.cluster
    if c.gpu_az:
        zones = f"zone {c.gpu_az}"
    elif c.availability_zones:
        zones = f"the first of {', '.join(c.availability_zones)} that can launch it"
    else:
        zones = f"the first zone of {c.region} offering {gpu.name} that can launch it (EC2 is asked at deploy)"
    state = f"{STATE_DIR}/"
    actions = [
        Action("preflight", f"Check the configuration, that eksctl and helm are installed, and the zones ({zones})."),
        Action(
            "create-cluster",
            f"Create EKS cluster {c.name} (Kubernetes {c.k8s_version}, private subnets behind one NAT gateway) "
            "without node groups.",
            eksctl.create_cluster_argv(f"{state}eksctl-cluster.yaml"),
        ),
        Action(
            "kubeconfig",
            "Write the cluster's kubeconfig into this folder; helm and the Kubernetes client use only that file.",
            _kubeconfig_argv(cfg, f"{state}{KUBECONFIG_FILE}"),
        ),
        Action(
            "nodegroup-system",
            f"Create node group {eksctl.SYSTEM_NODEGROUP} ({c.system_node_count} x {c.system_node_type}).",
            _create_nodegroup_argv(Path(f"{state}eksctl-nodegroup-{eksctl.SYSTEM_NODEGROUP}.yaml")),
        ),
        Action(
            "nodegroup-gpu",
            f"Create EFA node group {c.gpu_nodegroup_name} ({c.gpu_node_count} x {gpu.name}) in {zones}; when a "
            "zone cannot launch the instances, say why, remove the failed group and try the next zone.",
            _create_nodegroup_argv(Path(f"{state}eksctl-nodegroup-{c.gpu_nodegroup_name}.yaml")),
        ),
        Action(
            "remove-eksctl-device-plugins",
            "Delete the device-plugin DaemonSets eksctl installs by itself, so only the pinned charts run.",
        ),
    ]
    for rel in helm_releases(cfg):
        argv = _install_argv(rel, f"{state}{rel.values_file}", f"{state}{KUBECONFIG_FILE}")
        actions.append(Action(f"helm-{rel.name}", f"Install {rel.chart} {rel.version}: {rel.purpose}.", argv))
    actions += [
        Action(
            "check-gpu-nodes",
            f"Wait until both device-plugin DaemonSets are Ready on every GPU node and each node advertises "
            f"{m.GPU_RESOURCE}={cfg.derived.ray_gpus_per_worker_pod} and {m.EFA_RESOURCE}={gpu.efa_interfaces}.",
        ),
        Action("check-kuberay", "Wait for the RayCluster CRD and a Ready KubeRay operator pod."),
    ]
    return actions


@contextlib.contextmanager
def _say_state_when_interrupted(d: Deployment) -> Iterator[None]:
    """An :class:`~raytrain_eks.eks.runner.Interrupted` (Ctrl-C or SIGTERM during eksctl or helm) leaves with what the
    state file records, so the user knows what exists before running the command again."""
    try:
        yield
    except Interrupted as exc:
        recorded = [describe(i) for i in d.state.created]
        if recorded:
            state = f"{d.state.path} records (some may be half made): " + "; ".join(recorded) + "."
        else:
            state = f"{d.state.path} records nothing created yet."
        raise exc.with_state(state) from None


def up(
    d: Deployment,
    *,
    confirm: Callable[[str], bool],
    offered_zones: Callable[[], Placement] | None = None,
) -> UpResult:
    """Create or resume the whole infrastructure; returns the GPU zone and nodes. Asks ``confirm`` once.

    Order: preflight -> cluster -> system node group -> GPU node group (zone by zone) -> eksctl's own plugins
    removed -> pinned charts -> GPU nodes proven ready -> KubeRay Ready. Each step skips what exists. Ctrl-C or
    SIGTERM stops the running eksctl or helm and raises :class:`~raytrain_eks.eks.runner.Interrupted` naming what the
    state file records.
    """
    with _say_state_when_interrupted(d):
        return _up(d, confirm=confirm, offered_zones=offered_zones)


def _up(d: Deployment, *, confirm: Callable[[str], bool], offered_zones: Callable[[], Placement] | None) -> UpResult:
    cfg = d.cfg
    c = cfg.cluster
    gpu, system = check_deployable(cfg)
    for tool in ("eksctl", "helm"):
        d.require_tool(tool)
    _check_state_matches(d)
    plan = choose_zones(cfg, d.state, offered_zones)
    cost = cost_per_hour(cfg, gpu, system)["total_usd"]
    question = (
        f"Create (or resume) cluster {c.name} in {c.region}: {c.gpu_node_count} x {gpu.name} in "
        f"{' or '.join(plan.candidates)}, {c.system_node_count} x {system.name}, a NAT gateway; about "
        f"${cost:.2f} per hour until `raytrain-eks down`. Continue?"
    )
    if not confirm(question):
        raise Cancelled("cancelled: nothing was created")
    d.state.update(
        cluster=c.name, region=c.region, cluster_azs=list(plan.cluster_azs), reservations=plan.reservations or None
    )
    ensure_cluster(d, plan)
    ensure_system_nodegroup(d, plan)
    az = ensure_gpu_nodegroup(d, plan)
    remove_eksctl_device_plugins(d)
    for rel in helm_releases(cfg):
        ensure_release(d, rel)
    nodes = wait_gpu_nodes(d, gpu, az)
    wait_kuberay(d)
    d.state.update(phase="up")
    d.say(f"Ready: cluster {c.name} in {c.region}, GPU nodes in {az}. Next: `raytrain-eks submit`.")
    return UpResult(gpu_az=az, gpu_nodes=[n.name for n in nodes], created=[describe(i) for i in d.state.created])


# ----------------------------------------------------------------------------------------------------------------
# down
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class DownResult:
    deleted: list[str]
    leftovers: list[str] | None  # None: AWS could not be asked


def _delete(d: Deployment, item: dict[str, Any], cluster_exists: bool) -> bool:
    """Delete one created item if it still exists; ``True`` when something was deleted."""
    kind = item["type"]
    if kind == "object":
        return cluster_exists and d.kube.delete(item["apiVersion"], item["kind"], item["name"], item.get("namespace"))
    if kind == "helm":
        if not cluster_exists:
            return False
        if release_info(d, item["name"], item["namespace"]) is None:
            return False
        _helm(
            d, ["helm", "uninstall", item["name"], "--namespace", item["namespace"], "--wait"], timeout=HELM_TIMEOUT_S
        )
        return True
    if kind == "nodegroup":
        if not cluster_exists or item["name"] not in nodegroup_statuses(d):
            return False
        d.run(delete_nodegroup_argv(d.cfg, item["name"]), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)
        return True
    if kind == "cluster":
        if not cluster_exists:
            return False
        c = d.cfg.cluster
        d.run(
            ["eksctl", "delete", "cluster", "--name", c.name, "--region", c.region, "--wait"],
            timeout=CLUSTER_TIMEOUT_S,
            on_output=d.say,
            hint="Run `raytrain-eks down` again; if it keeps failing, the CloudFormation console shows which "
            f"resource of the stacks eksctl-{c.name}-* could not be deleted.",
        )
        return True
    raise ValueError(f"unknown item in the state file: {item}")


def billable_leftovers(d: Deployment) -> list[str] | None:
    """Things that still cost money after ``down`` (NAT gateways, Elastic IPs, instances tagged with the cluster's
    name), each with the command that deletes it, looked up through boto3 in the cluster's region (see
    :func:`raytrain_eks.aws.services.billable_leftovers`); ``None`` when AWS could not be asked (the reason is said).
    """
    from raytrain_eks.aws.services import billable_leftovers as lookup
    from raytrain_eks.aws.session import connect

    c = d.cfg.cluster
    try:
        found = lookup(connect(c.region), c.region, c.name)
    except UserError as exc:
        d.say(f"Could not check for leftover NAT gateways, Elastic IPs or instances: {exc.message}")
        return None
    return [x.describe() for x in found]


def down(d: Deployment, *, confirm: Callable[[str], bool]) -> DownResult:
    """Delete everything ``up`` and ``submit`` created from this folder, newest first, after one confirmation;
    then check that nothing billable is left. A second ``down`` finds nothing recorded and does nothing. Ctrl-C or
    SIGTERM stops the running eksctl or helm; what is not deleted yet stays recorded."""
    with _say_state_when_interrupted(d):
        return _down(d, confirm=confirm)


def _down(d: Deployment, *, confirm: Callable[[str], bool]) -> DownResult:
    created = d.state.created
    if not created and d.state.get("leftovers"):
        # The last down deleted everything it had made but found things still billed: look again.
        return DownResult(deleted=[], leftovers=_check_leftovers(d))
    if not created:
        d.say(f"Nothing to delete: no deployment is recorded in {d.state.path}.")
        return DownResult(deleted=[], leftovers=[])
    listing = "\n".join(f"  - {describe(i)}" for i in reversed(created))
    if not confirm(f"Delete, in this order:\n{listing}\nContinue?"):
        raise Cancelled("cancelled: nothing was deleted")
    for tool in ("eksctl", "helm"):
        d.require_tool(tool)
    exists = cluster_status(d) is not None
    deleted = []
    for item in reversed(created):
        if _delete(d, item, exists):
            d.say(f"Deleted {describe(item)}")
            deleted.append(describe(item))
        d.state.forget(item)
    return DownResult(deleted=deleted, leftovers=_check_leftovers(d))


def _check_leftovers(d: Deployment) -> list[str] | None:
    """After the deletes: raise, keeping the state, while something billable is left, or while AWS cannot be asked
    about what the last ``down`` found left; else clear the state."""
    leftovers = billable_leftovers(d)
    recorded = d.state.get("leftovers")
    if leftovers is None and recorded:
        raise UserError(
            "these still cost money at the last `raytrain-eks down`, and AWS could not be asked now whether they "
            "are gone:\n" + "\n".join(f"  - {x}" for x in recorded),
            hint="Fix the AWS access named above, then run `raytrain-eks down` again to check.",
        )
    if leftovers:
        d.state.update(leftovers=leftovers)
        raise UserError(
            "these still cost money after the cluster was deleted:\n" + "\n".join(f"  - {x}" for x in leftovers),
            hint="Delete them with the commands shown, then run `raytrain-eks down` again to check.",
        )
    d.state.clear()
    if leftovers is not None:
        d.say("Nothing billable is left from this deployment.")
    return leftovers


# ----------------------------------------------------------------------------------------------------------------
# status
# ----------------------------------------------------------------------------------------------------------------


def status(d: Deployment) -> list[str]:
    """Readable lines: what this folder deployed, the cluster, the GPU nodes and the Ray pods and job."""
    s, c = d.state, d.cfg.cluster
    if not s.created and not s.get("cluster"):
        return [f"Nothing deployed from this folder ({s.path} does not exist). Start with `raytrain-eks up`."]
    lines = [f"Cluster {c.name} in {c.region}, GPU zone {s.get('gpu_az') or 'not chosen yet'}"]
    lines += [f"  created: {describe(i)}" for i in s.created]
    cluster = cluster_status(d)
    lines.append(f"EKS cluster: {cluster or 'does not exist'}")
    if cluster != "ACTIVE":
        return lines
    for name, st in sorted(nodegroup_statuses(d).items()):
        lines.append(f"Node group {name}: {st}")
    gpu, _ = check_deployable(d.cfg)
    nodes, problems = gpu_node_problems(d, gpu, s.get("gpu_az"))
    for node in nodes:
        lines.append(
            f"GPU node {node.name} ({node.zone or '?'}): {m.GPU_RESOURCE}={node.allocatable.get(m.GPU_RESOURCE, 0)} "
            f"{m.EFA_RESOURCE}={node.allocatable.get(m.EFA_RESOURCE, 0)} {'Ready' if node.ready else 'NotReady'}"
        )
    lines += [f"  problem: {p}" for p in problems]
    job = s.get("job") or {}
    ns = job.get("namespace", d.cfg.ray.namespace)
    cluster_name = job.get("raycluster", d.cfg.ray.cluster_name)
    pods = d.kube.pods(ns, {"ray.io/cluster": cluster_name})
    for pod in pods:
        lines.append(f"Ray pod {pod.name}: {pod.waiting_reason or pod.phase}{' Ready' if pod.ready else ''}")
    if job.get("id"):
        lines.append(f"Last job {job['id']} ({job.get('mode')}): {job.get('status', 'unknown')}")
    return lines
