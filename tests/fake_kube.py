"""A stateful in-memory :class:`~raytrain_eks.k8s.cluster.KubeApi`: a small cluster the deploy steps run against.

It keeps nodes, pods, events, DaemonSets and applied objects, and :meth:`FakeKube.tick` plays the controllers
that matter to raytrain-eks: a DaemonSet controller (one pod per matching node; a device plugin's pod, once
ready, makes its node advertise the plugin's resource), the KubeRay operator (a RayCluster gets a head pod and
its worker pods from its own templates; a RayJob gets its RayCluster), and a scheduler that binds a pod only to
a node whose labels match its ``nodeSelector`` and whose free allocatable resources cover its requests, and
otherwise records the ``FailedScheduling`` event a real scheduler would. Time is simulated: :meth:`sleep`
advances the clock and ticks, so waits in the steps finish instantly.

Objects can also come as whole manifests (:meth:`FakeKube.put`, what the fake helm and eksctl use: they are not
the steps' own ``applied``): a DaemonSet then runs a pod on each Ready node its pod template admits (its
``nodeSelector``, its required node affinity, and the node's ``NoSchedule``/``NoExecute`` taints against its
tolerations, as the DaemonSet controller and the scheduler decide), a Deployment gets its replicas scheduled the
same way, and a Ready device-plugin pod (known by its container, see ``DEVICE_PLUGINS``) makes its node advertise
the devices the node has (``INSTANCE_DEVICES``, by the node's instance type). A bare ``v1`` Pod applied is scheduled
and started the same way, and deleting it removes it. Example::

    kube = FakeKube()
    kube.add_node("gpu-1", labels={"role": "gpu-worker"}, allocatable={"cpu": "47", "memory": "180Gi"})
    kube.add_daemon_set("kube-system", "nvidia-device-plugin", node_selector={"role": "gpu-worker"},
                        advertises={"nvidia.com/gpu": "4"})
    kube.sleep(5)
    kube.nodes()[0].allocatable["nvidia.com/gpu"]  # "4"
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raytrain_eks.k8s.cluster import DaemonSet, Event, ExecResult, Node, Pod, matches


def copied(obj: Any) -> Any:
    """A deep copy of plain data (what the API server stores and returns: mappings, lists, scalars), made through
    pickle: the same as ``copy.deepcopy`` for such data and several times faster on KubeRay's 3 MB of CRDs."""
    return pickle.loads(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))


_BUILTIN_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
# Kinds that live in no namespace (`kubectl api-resources --namespaced=false`), among those the charts render.
CLUSTER_SCOPED = frozenset(
    {"Namespace", "Node", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass"}
)

# A node's hardware, by its instance type (the label node.kubernetes.io/instance-type): what a device plugin on it
# can advertise. g6.12xlarge: 4 NVIDIA L4 GPUs (AWS's G6 instance table) and 1 EFA interface; p5.48xlarge: 8 H100
# and 32 EFA interfaces (docs/reference/infra-facts.md §2 and §5: EfaInfo.MaximumEfaInterfaces).
INSTANCE_DEVICES: dict[str, dict[str, str]] = {
    "g6.12xlarge": {"nvidia.com/gpu": "4", "vpc.amazonaws.com/efa": "1"},
    "p5.48xlarge": {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"},
}

# Device plugins, by the name of their container's image: the command that is the plugin (None: any, the image's
# own entrypoint included) and the resource it registers with the kubelet. NVIDIA's image runs the plugin by
# default (NVIDIA/k8s-device-plugin v0.20.0 deployments/container/Dockerfile: ENTRYPOINT ["nvidia-device-plugin"]),
# and the same image's `mps-control-daemon` (the chart's MPS DaemonSet) advertises nothing; it registers
# nvidia.com/gpu. AWS's EFA plugin registers vpc.amazonaws.com/efa (docs/reference/infra-facts.md §2).
DEVICE_PLUGINS: dict[str, tuple[str | None, str]] = {
    "k8s-device-plugin": ("nvidia-device-plugin", "nvidia.com/gpu"),
    "aws-efa-k8s-device-plugin": (None, "vpc.amazonaws.com/efa"),
}

ExecHandler = Callable[[str, str, list[str], "str | None"], "ExecResult | None"]

# KubeRay's RayJob controller looks at an unfinished RayJob again every RayJobDefaultRequeueDuration (3 s:
# fixtures/kuberay/ray-operator/controllers/ray/rayjob_controller.go, KubeRay v1.7.0).
KUBERAY_REQUEUE_S = 3.0
RAY_JOB_ENDED = ("SUCCEEDED", "FAILED", "STOPPED")  # rayv1.IsJobTerminal

_UNITS = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "m": 1e-3,
}


def parse_quantity(value: str | int | float) -> float:
    """A Kubernetes quantity as a number: ``"500m"`` -> 0.5, ``"160Gi"`` -> 171798691840.0, ``"4"`` -> 4.0."""
    text = str(value).strip()
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    if not match or (match.group(2) and match.group(2) not in _UNITS):
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(match.group(1)) * _UNITS.get(match.group(2), 1)


def _expression_holds(labels: Mapping[str, str], expr: Mapping[str, Any]) -> bool:
    """One ``matchExpressions`` entry of a node selector term against a node's labels (operators as in
    k8s.io/api/core/v1 NodeSelectorOperator: In, NotIn, Exists, DoesNotExist, Gt, Lt)."""
    key, op, values = expr["key"], expr["operator"], [str(v) for v in expr.get("values") or []]
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        if key not in labels or not labels[key].isdigit():
            return False
        return int(labels[key]) > int(values[0]) if op == "Gt" else int(labels[key]) < int(values[0])
    raise ValueError(f"unknown node selector operator {op!r}")


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Kubernetes' Toleration.ToleratesTaint: the effect (when given) and the key (when given) must match; then
    ``Exists`` tolerates any value and ``Equal`` (the default) only the taint's."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator") == "Exists":
        return True
    return bool(toleration.get("key")) and str(toleration.get("value", "")) == str(taint.get("value", ""))


@dataclass(frozen=True)
class Placement:
    """Where a pod template may run: its ``nodeSelector``, its required node affinity (``terms``: the
    ``nodeSelectorTerms``, any one of which must hold; ``None`` when it has none) and its tolerations."""

    node_selector: dict[str, str] = field(default_factory=dict)
    terms: tuple[tuple[dict[str, Any], ...], ...] | None = None
    tolerations: tuple[dict[str, Any], ...] = ()

    @classmethod
    def of(cls, pod_spec: Mapping[str, Any]) -> Placement:
        required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        ) or {}
        terms = required.get("nodeSelectorTerms")
        return cls(
            dict(pod_spec.get("nodeSelector") or {}),
            tuple(tuple(t.get("matchExpressions") or []) for t in terms) if terms is not None else None,
            tuple(pod_spec.get("tolerations") or []),
        )

    def refusal(self, labels: Mapping[str, str], taints: Sequence[Mapping[str, Any]]) -> str | None:
        """Why a node with these labels and taints cannot take the pod, in the scheduler's words; ``None``: it can."""
        if not matches(labels, self.node_selector) or (
            self.terms is not None and not any(all(_expression_holds(labels, e) for e in t) for t in self.terms)
        ):
            return "node(s) didn't match Pod's node affinity/selector"
        for taint in taints:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(
                _tolerates(t, taint) for t in self.tolerations
            ):
                return f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
        return None


_ANYWHERE = Placement(tolerations=({"operator": "Exists"},))


ZONE_LABEL = "topology.kubernetes.io/zone"


@dataclass(frozen=True)
class NodePool:
    """GPU nodes an autoscaler adds on demand, as Karpenter does (https://karpenter.sh/docs/: it watches for pods
    the scheduler has marked unschedulable, evaluates their requests, node selectors, affinities and tolerations,
    and provisions a node that meets them): here one node of this shape per unschedulable pod that fits it,
    joining ``launch_s`` after the pod was found unschedulable. The node advertises its GPUs and EFA interfaces
    itself (a node image whose device plugins come with it). ``zones``: the zones the pool may launch in (a
    NodePool's ``topology.kubernetes.io/zone`` requirement); a node goes to the zone its pod's node selector names,
    else to the pool's zones in turn, as nothing then keeps a job's nodes together."""

    name: str
    labels: dict[str, str]
    allocatable: dict[str, str]
    taints: tuple[dict[str, Any], ...] = ()
    launch_s: float = 90.0
    zones: tuple[str, ...] = ()

    def labels_for(self, placement: Placement, launched: int) -> dict[str, str]:
        """The labels of the node launched for a pod of ``placement``, the pool's ``launched``-th."""
        if not self.zones:
            return dict(self.labels)
        wanted = placement.node_selector.get(ZONE_LABEL)
        zone = wanted if wanted in self.zones else self.zones[launched % len(self.zones)]
        return {**self.labels, ZONE_LABEL: zone}


@dataclass
class _FakeNode:
    labels: dict[str, str]
    allocatable: dict[str, str]
    ready: bool = True
    advertised: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, Any]] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)  # hardware a device plugin can advertise
    unschedulable: bool = False  # spec.unschedulable: cordoned, the scheduler places no new pod on it
    provider_id: str | None = None  # spec.providerID, as the cloud provider sets it (aws:///<zone>/<instance id>)


@dataclass
class _FakeDaemonSet:
    labels: dict[str, str]
    pod_selector: dict[str, str]
    node_selector: dict[str, str]
    advertises: dict[str, str]
    crash: bool = False
    pod_labels: dict[str, str] = field(default_factory=dict)
    placement: Placement = _ANYWHERE
    plugin: str | None = None  # the resource its pods register: the node's devices of it are advertised
    template: str = ""  # the pod template as JSON: a new one replaces the pods

    def advertised_on(self, node: _FakeNode) -> dict[str, str]:
        found = dict(self.advertises)
        if self.plugin and self.plugin in node.devices:
            found[self.plugin] = node.devices[self.plugin]
        return found


@dataclass
class _FakePod:
    labels: dict[str, str]
    requests: dict[str, str]
    node_selector: dict[str, str]
    owner: tuple[str, str] | None = None  # ("DaemonSet"|"RayCluster"|"Deployment"|"Pod", name)
    node: str | None = None
    phase: str = "Pending"
    ready: bool = False
    waiting_reason: str | None = None
    bound_at: float | None = None
    placement: Placement | None = None  # None: only node_selector counts, every taint tolerated
    ended: str | None = None  # its container's state.terminated, as the real API's Pod carries it
    ip: str | None = None  # status.podIP (set_pod_ip): the fake's network gives pods no address of its own


def device_plugin_resource(pod_spec: Mapping[str, Any]) -> str | None:
    """The resource a pod template's first container registers when it is a device plugin (``DEVICE_PLUGINS``)."""
    containers = pod_spec.get("containers") or [{}]
    image = str(containers[0].get("image", ""))
    name = image.rsplit("/", 1)[-1].split(":", 1)[0]
    if name not in DEVICE_PLUGINS:
        return None
    command, resource = DEVICE_PLUGINS[name]
    given = containers[0].get("command")
    return resource if command is None or not given or given[0] == command else None


def _pod_requests(pod_spec: Mapping[str, Any]) -> dict[str, str]:
    """The first container's requests; limits stand for requests that are not given (Kubernetes' defaulting)."""
    resources = (pod_spec.get("containers") or [{}])[0].get("resources") or {}
    return {**(resources.get("limits") or {}), **(resources.get("requests") or {})}


#: kubelet's event for an image the registry does not have, as recorded on EKS (containerd) in
#: https://github.com/aquasecurity/starboard/issues/1161 (the ``Failed`` event of ``kubectl describe pod``).
PULL_NOT_FOUND = (
    'Failed to pull image "public.ecr.aws/aquasecurity/starboard-operator:0.15.4": rpc error: code = NotFound '
    'desc = failed to pull and unpack image "public.ecr.aws/aquasecurity/starboard-operator:0.15.4": failed to '
    'resolve reference "public.ecr.aws/aquasecurity/starboard-operator:0.15.4": '
    "public.ecr.aws/aquasecurity/starboard-operator:0.15.4: not found"
)
#: kubelet's event for a pull from ECR that failed for want of credentials, and passed later (a kubelet restart),
#: as recorded on EKS in https://github.com/kubernetes/kubernetes/issues/83348 (account and region masked there).
PULL_NO_CREDENTIALS = (
    'Failed to pull image "XXXXXXXX.dkr.ecr.ap-XXXXXX.amazonaws.com/isam:9.0.7.0": rpc error: code = Unknown '
    "desc = Error response from daemon: Get https://XXXXXXX.dkr.ecr.ap-XXXXX.amazonaws.com/v2/ndi-spcp-isam/"
    "manifests/9.0.7.0: no basic auth credentials"
)


def merged(target: Any, patch: Any) -> Any:
    """RFC 7386's MergePatch: what the API server does with an ``application/merge-patch+json`` body."""
    if not isinstance(patch, Mapping):
        return copied(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merged(out.get(k), v)
    return out


class FakeKube:
    """The in-memory cluster. Tests reach into it through the helpers below; the steps only use :class:`KubeApi`.

    ``start_delay_s``: how long a bound pod takes to become Running. ``image_pull_error``: when set, bound
    Ray pods and bare pods (both run the Ray image) never start: their container waits with ``ImagePullBackOff``
    and the pod has this message in a ``Warning Failed`` event, as kubelet's image manager records a failed pull
    (``Failed to pull image "IMAGE": ERROR``; :data:`PULL_NOT_FOUND` and :data:`PULL_NO_CREDENTIALS` are
    recorded ones). ``exec_handler``:
    answers :meth:`exec` calls (``None`` from it means "exit 0, no output"); every call is kept in
    ``exec_calls``. ``ray_job_status``: what the dashboard of a RayJob's cluster says of a Ray job id (``None``:
    not known there), read by the RayJob controller as KubeRay reads it (``GetJobInfo``).
    """

    def __init__(self) -> None:
        self.time = 0.0
        self.start_delay_s = 5.0
        self.image_pull_error: str | None = None
        self.exec_handler: ExecHandler | None = None
        self.ray_job_status: Callable[[str], str | None] | None = None
        self._rayjob_ended: dict[tuple[str, str], float] = {}  # a RayJob's status.endTime, in this clock
        self._random = random.Random(0)  # the RayJob controller's generated names, the same in every run
        self.exec_calls: list[tuple[str, str, list[str], str | None]] = []
        self.applied: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str, str, str | None]] = []
        # KubeApi.delete deletes in the foreground: the API server sets the object's metadata.deletionTimestamp and
        # the foregroundDeletion finalizer, and the object stays, still readable, until the garbage collector has
        # deleted its dependents (https://kubernetes.io/docs/concepts/architecture/garbage-collection/, "Foreground
        # cascading deletion"). ``foreground_delete_s``: how long a DaemonSet's or Deployment's pods take to go
        # here (0: the object is gone at once); ``_deleting``: (api_version, kind, name, namespace) -> when.
        self.foreground_delete_s = 0.0
        self._deleting: dict[tuple[str, str, str, str | None], float] = {}
        self.patched: list[tuple[str, str, str, str | None, dict[str, Any]]] = []
        self.crashing: set[tuple[str, str]] = set()  # (namespace, DaemonSet): its pods never become ready
        # (namespace, bare pod): its container exits at once with status 1 (restartPolicy Never: the pod is Failed,
        # its container's state terminated with exitCode 1, reason Error, as the kubelet reports it; no event)
        self.exiting: set[tuple[str, str]] = set()
        self._nodes: dict[str, _FakeNode] = {}
        self.node_pool: NodePool | None = None
        # pod -> (when its node joins, node name, its labels)
        self._launching: dict[tuple[str, str], tuple[float, str, dict[str, str]]] = {}
        self._daemon_sets: dict[tuple[str, str], _FakeDaemonSet] = {}
        self._pods: dict[tuple[str, str], _FakePod] = {}
        self._events: dict[tuple[str, str], list[Event]] = {}
        self._objects: dict[tuple[str, str, str | None, str], dict[str, Any]] = {}

    # -- building the world (tests and fake tools) -----------------------------------------------------------------

    def add_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str],
        allocatable: Mapping[str, str],
        ready: bool = True,
        taints: Sequence[Mapping[str, Any]] = (),
        devices: Mapping[str, str] | None = None,
        provider_id: str | None = None,
    ) -> None:
        """A node; ``devices`` (default: ``INSTANCE_DEVICES`` of its instance-type label) is its hardware, which
        only a device plugin's Ready pod makes it advertise."""
        if devices is None:
            devices = INSTANCE_DEVICES.get(labels.get("node.kubernetes.io/instance-type", ""), {})
        node = _FakeNode(dict(labels), dict(allocatable), ready, taints=[dict(t) for t in taints])
        node.devices = dict(devices)
        node.provider_id = provider_id
        self._nodes[name] = node

    def remove_nodes(self, selector: Mapping[str, str]) -> list[str]:
        gone = [n for n, node in self._nodes.items() if matches(node.labels, selector)]
        for name in gone:
            del self._nodes[name]
        for key, pod in list(self._pods.items()):
            if pod.node in gone:
                del self._pods[key]
        return gone

    def set_allocatable(self, node: str, resource: str, value: str | None) -> None:
        """Change what a node advertises (``None`` removes the resource), as a broken plugin would."""
        n = self._nodes[node]
        for store in (n.allocatable, n.advertised):
            store.pop(resource, None)
        if value is not None:
            n.allocatable[resource] = value

    def add_daemon_set(
        self,
        namespace: str,
        name: str,
        *,
        node_selector: Mapping[str, str],
        advertises: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        crash: bool = False,
    ) -> None:
        """A DaemonSet whose pods run on every node matching ``node_selector`` (whatever its taints); a ready pod
        makes its node advertise ``advertises`` (a device plugin). ``crash``: its pods never become ready."""
        self._objects[("apps/v1", "DaemonSet", namespace, name)] = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
            "spec": {"selector": {"matchLabels": {"name": name}}},
        }
        self._daemon_sets[(namespace, name)] = _FakeDaemonSet(
            dict(labels or {}), {"name": name}, dict(node_selector), dict(advertises or {}), crash, {"name": name}
        )

    def remove_daemon_set(self, namespace: str, name: str) -> bool:
        self._objects.pop(("apps/v1", "DaemonSet", namespace, name), None)
        if self._daemon_sets.pop((namespace, name), None) is None:
            return False
        self._drop_owned(namespace, ("DaemonSet", name))
        return True

    def put(self, obj: Mapping[str, Any]) -> None:
        """Create or replace an object as a tool other than the steps does (helm, eksctl): stored and run by the
        controllers, but not recorded in ``applied``. A namespaced object needs ``metadata.namespace``."""
        self._store(obj)

    def remove(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete an object as a tool other than the steps does (not recorded in ``deleted``)."""
        return self._remove(api_version, kind, name, namespace)

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        labels: Mapping[str, str],
        phase: str = "Running",
        node: str | None = None,
        ready: bool = True,
    ) -> None:
        self._pods[(namespace, name)] = _FakePod(dict(labels), {}, {}, None, node, phase, ready)

    def add_event(self, namespace: str, pod: str, event: Event) -> None:
        self._events.setdefault((namespace, pod), []).append(event)

    def objects(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Copies of the stored objects (of one kind)."""
        return [copied(o) for (_, k, _, _), o in self._objects.items() if kind in (None, k)]

    def set_status(self, api_version: str, kind: str, name: str, namespace: str | None, status: dict[str, Any]) -> None:
        obj = self._objects[(api_version, kind, namespace, name)]
        obj["status"] = {**obj.get("status", {}), **status}

    # -- simulated time --------------------------------------------------------------------------------------------

    def monotonic(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        end = self.time + max(seconds, 0.001)
        # While a RayJob is unfinished its controller looks at it every KUBERAY_REQUEUE_S: time passes at that pace.
        while self._rayjob_in_progress() and self.time + KUBERAY_REQUEUE_S < end:
            self.time += KUBERAY_REQUEUE_S
            self.tick()
        self.time = end
        self.tick()

    def tick(self) -> None:
        """One round of every controller: DaemonSets, RayJobs, RayClusters, then the scheduler and kubelets."""
        for key, gone_at in list(self._deleting.items()):  # the garbage collector: dependents gone, then the owner
            if self.time >= gone_at:
                del self._deleting[key]
                self._remove(*key)
        self._run_daemon_sets()
        self._run_deployments()
        self._run_rayjobs()
        self._run_rayclusters()
        self._schedule()

    # -- KubeApi ---------------------------------------------------------------------------------------------------

    def nodes(self, selector: Mapping[str, str] | None = None) -> list[Node]:
        return [
            Node(name, dict(n.labels), {**n.allocatable, **n.advertised}, n.ready)
            for name, n in self._nodes.items()
            if matches(n.labels, selector)
        ]

    def pods(self, namespace: str, selector: Mapping[str, str] | None = None) -> list[Pod]:
        return [
            Pod(name, ns, p.phase, dict(p.labels), p.node, p.ready, p.waiting_reason, p.ended, p.ip)
            for (ns, name), p in self._pods.items()
            if ns == namespace and matches(p.labels, selector)
        ]

    def set_pod_ip(self, namespace: str, name: str, ip: str) -> None:
        """Give a pod its ``status.podIP``, as the CNI does once the pod has a node."""
        self._pods[(namespace, name)].ip = ip

    def pod_events(self, namespace: str, name: str) -> list[Event]:
        return list(self._events.get((namespace, name), []))

    def daemon_sets(self, namespace: str | None, selector: Mapping[str, str] | None = None) -> list[DaemonSet]:
        out = []
        for (ns, name), ds in self._daemon_sets.items():
            if (namespace is not None and ns != namespace) or not matches(ds.labels, selector):
                continue
            pods = [p for (pns, _), p in self._pods.items() if pns == ns and p.owner == ("DaemonSet", name)]
            desired = sum(1 for n in self._nodes.values() if self._runs_on(ds, n))
            out.append(DaemonSet(name, ns, desired, sum(p.ready for p in pods), dict(ds.pod_selector), dict(ds.labels)))
        return out

    def apply(self, obj: Mapping[str, Any]) -> None:
        self._store(obj)
        self.applied.append(copied(dict(obj)))

    def merge_patch(
        self, api_version: str, kind: str, name: str, namespace: str | None, patch: Mapping[str, Any]
    ) -> bool:
        """A JSON merge patch (RFC 7386) of a stored object: ``None`` removes a key, a mapping merges into a
        mapping, anything else replaces."""
        if (api_version, kind) == ("v1", "Node"):  # cordon and uncordon: `kubectl cordon` patches spec.unschedulable
            node = self._nodes.get(name)
            if node is None:
                return False
            node.unschedulable = bool(patch.get("spec", {}).get("unschedulable"))
            self.patched.append((api_version, kind, name, namespace, copied(dict(patch))))
            return True
        ns = namespace if kind not in CLUSTER_SCOPED else None
        key = (api_version, kind, ns, name)
        if key not in self._objects:
            return False
        self._objects[key] = merged(self._objects[key], patch)
        self.patched.append((api_version, kind, name, namespace, copied(dict(patch))))
        return True

    def _store(self, obj: Mapping[str, Any]) -> None:
        doc = copied(dict(obj))
        meta = doc.get("metadata", {})
        if not meta.get("name"):
            raise ValueError("apply: metadata.name is required")
        ns = meta.get("namespace") if doc["kind"] not in CLUSTER_SCOPED else None
        if ns is not None and not self._has_namespace(ns):
            raise ValueError(f"apply: namespace {ns!r} does not exist")
        key = (doc["apiVersion"], doc["kind"], ns, meta["name"])
        old = self._objects.get(key)
        if old is not None and "status" in old:
            doc["status"] = old["status"]
        self._objects[key] = doc
        if doc["kind"] == "DaemonSet" and ns is not None:
            self._daemon_set_from(ns, doc)
        if doc["kind"] == "Pod" and ns is not None and (ns, meta["name"]) not in self._pods:
            # A bare pod: scheduled and started as the controllers' pods are. Its spec cannot change once made
            # (the API server refuses most updates to a pod), so applying it again changes nothing here.
            spec = doc.get("spec") or {}
            placement = Placement.of(spec)
            self._pods[(ns, meta["name"])] = _FakePod(
                dict(meta.get("labels") or {}), _pod_requests(spec), dict(placement.node_selector),
                ("Pod", meta["name"]), placement=placement,
            )  # fmt: skip

    def has(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """Whether the object is stored (``get`` without the copy)."""
        return (api_version, kind, namespace, name) in self._objects

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        if (api_version, kind) == ("v1", "Node"):
            return self._node_object(name)
        obj = self._objects.get((api_version, kind, namespace, name))
        return copied(obj) if obj is not None else None

    def _node_object(self, name: str) -> dict[str, Any] | None:
        node = self._nodes.get(name)
        if node is None:
            return None
        spec: dict[str, Any] = {"taints": copied(node.taints)}
        if node.unschedulable:
            spec["unschedulable"] = True
        if node.provider_id:
            spec["providerID"] = node.provider_id
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": dict(node.labels)},
            "spec": spec,
        }

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        self.deleted.append((api_version, kind, name, namespace))
        obj = self._objects.get((api_version, kind, namespace, name))
        if obj is None or not self.foreground_delete_s or kind not in ("DaemonSet", "Deployment"):
            return self._remove(api_version, kind, name, namespace)
        meta = obj["metadata"]
        if "deletionTimestamp" not in meta:  # a second delete changes nothing
            meta["deletionTimestamp"] = f"2026-12-02T10:{int(self.time) // 60 % 60:02d}:{int(self.time) % 60:02d}Z"
            meta["finalizers"] = [*meta.get("finalizers", []), "foregroundDeletion"]
            self._deleting[(api_version, kind, name, namespace)] = self.time + self.foreground_delete_s
        return True

    def _remove(self, api_version: str, kind: str, name: str, namespace: str | None) -> bool:
        if kind == "DaemonSet" and namespace is not None:
            return self.remove_daemon_set(namespace, name)
        if (
            kind == "Pod"
            and (namespace, name) in self._pods
            and (api_version, kind, namespace, name) not in self._objects
        ):
            del self._pods[(namespace, name)]  # a controller's pod (KubeRay's worker): the controller makes it again
            self._run_rayclusters()
            return True
        obj = self._objects.pop((api_version, kind, namespace, name), None)
        if obj is None:
            return False
        if kind == "Deployment" and namespace is not None:
            self._drop_owned(namespace, ("Deployment", name))
        if kind == "Pod" and namespace is not None:
            self._pods.pop((namespace, name), None)
        if kind == "Namespace":
            for key in [k for k in self._objects if k[2] == name]:
                del self._objects[key]
            for key in [k for k in self._pods if k[0] == name]:
                del self._pods[key]
        if kind == "RayJob":
            cluster = obj.get("status", {}).get("rayClusterName")
            self._objects.pop(("ray.io/v1", "RayCluster", namespace, cluster), None)
        self._run_rayclusters()
        return True

    def exec(
        self,
        namespace: str,
        pod: str,
        argv: Sequence[str],
        *,
        timeout: float,
        stdin: str | None = None,
        container: str | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> ExecResult:
        p = self._pods.get((namespace, pod))
        if p is None or p.phase != "Running":
            raise ValueError(f"exec: pod {namespace}/{pod} is not running")
        args = list(argv)
        self.exec_calls.append((namespace, pod, args, stdin))
        result = self.exec_handler(namespace, pod, args, stdin) if self.exec_handler else None
        result = result or ExecResult(0, "")
        if on_output is not None:
            for line in result.stdout.splitlines():
                on_output(line)
        return result

    # -- controllers -----------------------------------------------------------------------------------------------

    def _has_namespace(self, ns: str) -> bool:
        return ns in _BUILTIN_NAMESPACES or ("v1", "Namespace", None, ns) in self._objects

    def _drop_owned(self, namespace: str, owner: tuple[str, str]) -> None:
        for key in [k for k, p in self._pods.items() if k[0] == namespace and p.owner == owner]:
            del self._pods[key]

    def _daemon_set_from(self, ns: str, doc: Mapping[str, Any]) -> None:
        """The DaemonSet controller's view of a DaemonSet manifest; a changed pod template replaces its pods."""
        name = doc["metadata"]["name"]
        template = doc["spec"]["template"]
        spec = template.get("spec") or {}
        placement = Placement.of(spec)
        ds = _FakeDaemonSet(
            dict(doc["metadata"].get("labels") or {}),
            dict(doc["spec"]["selector"].get("matchLabels") or {}),
            dict(placement.node_selector),
            {},
            pod_labels=dict((template.get("metadata") or {}).get("labels") or {}),
            placement=placement,
            plugin=device_plugin_resource(spec),
            template=json.dumps(template, sort_keys=True),
        )
        old = self._daemon_sets.get((ns, name))
        if old is not None and old.template != ds.template:
            self._drop_owned(ns, ("DaemonSet", name))
        self._daemon_sets[(ns, name)] = ds

    def _runs_on(self, ds: _FakeDaemonSet, node: _FakeNode) -> bool:
        return (
            node.ready
            and ds.placement.refusal(node.labels, node.taints) is None
            and (ds.placement is not _ANYWHERE or matches(node.labels, ds.node_selector))
        )

    def _run_daemon_sets(self) -> None:
        for node in self._nodes.values():
            node.advertised.clear()
        for (ns, name), ds in self._daemon_sets.items():
            crash = ds.crash or (ns, name) in self.crashing
            for key, pod in list(self._pods.items()):  # pods on nodes gone or no longer admitted
                if key[0] == ns and pod.owner == ("DaemonSet", name):
                    node = self._nodes.get(pod.node or "")
                    if node is None or not self._runs_on(ds, node):
                        del self._pods[key]
            for node_name, node in self._nodes.items():
                if not self._runs_on(ds, node):
                    continue
                key = (ns, f"{name}-{node_name}")
                if key not in self._pods:
                    labels = ds.pod_labels or dict(ds.pod_selector)
                    self._pods[key] = _FakePod(
                        dict(labels), {}, {}, ("DaemonSet", name), node_name, "Running", not crash
                    )
                    if crash:
                        self._pods[key].waiting_reason = "CrashLoopBackOff"
                if self._pods[key].ready:
                    node.advertised.update(ds.advertised_on(node))

    def _run_deployments(self) -> None:
        """One ReplicaSet's worth of pods per Deployment, named after its pod template's hash."""
        for (_, kind, ns, name), dep in self._objects.items():
            if kind != "Deployment" or ns is None:
                continue
            template = dep["spec"]["template"]
            digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
            labels = {**((template.get("metadata") or {}).get("labels") or {}), "pod-template-hash": digest}
            owned = [k for k, p in self._pods.items() if k[0] == ns and p.owner == ("Deployment", name)]
            for key in owned:
                if self._pods[key].labels.get("pod-template-hash") != digest:
                    del self._pods[key]
            spec = template.get("spec") or {}
            for i in range(int(dep["spec"].get("replicas", 1))):
                key = (ns, f"{name}-{digest}-{i}")
                if key not in self._pods:
                    placement = Placement.of(spec)
                    self._pods[key] = _FakePod(
                        dict(labels), _pod_requests(spec), dict(placement.node_selector), ("Deployment", name),
                        placement=placement,
                    )  # fmt: skip

    def _rayjob_in_progress(self) -> bool:
        return any(
            k[1] == "RayJob" and o.get("status", {}).get("jobDeploymentStatus") in ("Initializing", "Running")
            for k, o in self._objects.items()
        )

    def _run_rayjobs(self) -> None:
        """KubeRay's RayJob controller, as fixtures/kuberay/ray-operator/controllers/ray/rayjob_controller.go
        (v1.7.0) has it, where raytrain-eks meets it. A new RayJob gets its RayCluster and a job id. While the job
        is unfinished, its status comes from the dashboard (``ray_job_status``); once it is terminal (the submitter,
        which follows the job's logs, ends with it), jobDeploymentStatus turns Complete (Failed for FAILED) and
        status.endTime is that moment (updateRayJobStatus). Then, with shutdownAfterJobFinishes, the RayCluster is
        deleted once ttlSecondsAfterFinished have passed since endTime (handleShutdownAfterJobFinishes and
        deleteClusterResources), its pods with it."""
        for (api, kind, ns, name), job in list(self._objects.items()):
            if kind != "RayJob":
                continue
            status = job.get("status", {})
            if not status.get("rayClusterName"):
                # utils.GenerateRayClusterName and GenerateRayJobId (fixtures/kuberay/.../utils/util.go): the name
                # and "-" and five characters of apimachinery's rand.String, whose alphabet this is.
                cluster, job_id = (f"{name}-{self._rand5()}" for _ in range(2))
                job["status"] = {"rayClusterName": cluster, "jobDeploymentStatus": "Initializing", "jobId": job_id}
                self._rayjob_ended.pop((ns, name), None)
                self._objects[(api, "RayCluster", ns, cluster)] = {
                    "apiVersion": api,
                    "kind": "RayCluster",
                    "metadata": {"name": cluster, "namespace": ns, "labels": dict(job["metadata"].get("labels", {}))},
                    "spec": copied(job["spec"]["rayClusterSpec"]),
                }
                continue
            if status.get("jobDeploymentStatus") in ("Initializing", "Running"):
                ray_status = self.ray_job_status(status["jobId"]) if self.ray_job_status else None
                if ray_status is None:
                    continue
                status["jobStatus"] = ray_status
                status["jobDeploymentStatus"] = "Running"
                if ray_status in RAY_JOB_ENDED:
                    status["jobDeploymentStatus"] = "Failed" if ray_status == "FAILED" else "Complete"
                    self._rayjob_ended[(ns, name)] = self.time
            elif job["spec"].get("shutdownAfterJobFinishes") and (ns, name) in self._rayjob_ended:
                ttl = job["spec"].get("ttlSecondsAfterFinished", 0)
                if self.time >= self._rayjob_ended[(ns, name)] + ttl:
                    self._objects.pop((api, "RayCluster", ns, status["rayClusterName"]), None)

    def _rand5(self) -> str:
        return "".join(self._random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))

    def _run_rayclusters(self) -> None:
        wanted: dict[tuple[str, str], _FakePod] = {}
        for (_, kind, ns, name), rc in self._objects.items():
            if kind != "RayCluster" or ns is None:
                continue
            spec = rc["spec"]
            groups = [("head", "headgroup", 1, spec["headGroupSpec"]["template"])]
            groups += [
                (f"{g['groupName']}-worker", g["groupName"], g["replicas"], g["template"])
                for g in spec["workerGroupSpecs"]
            ]
            for prefix, group, replicas, template in groups:
                for i in range(replicas):
                    pod_name = f"{name}-{prefix}-{i}" if prefix != "head" else f"{name}-head-0"
                    labels = {
                        **template.get("metadata", {}).get("labels", {}),
                        "ray.io/cluster": name,
                        "ray.io/node-type": "head" if prefix == "head" else "worker",
                        "ray.io/group": group,
                    }
                    container = template["spec"]["containers"][0]
                    requests = container.get("resources", {}).get("requests", {})
                    selector = template["spec"].get("nodeSelector", {})
                    wanted[(ns, pod_name)] = _FakePod(
                        labels, dict(requests), dict(selector), ("RayCluster", name),
                        placement=Placement.of(template["spec"]),
                    )  # fmt: skip
        for key, pod in list(self._pods.items()):
            if pod.owner and pod.owner[0] == "RayCluster" and key not in wanted:
                del self._pods[key]
        for key, pod in wanted.items():
            self._pods.setdefault(key, pod)

    def _free(self, node_name: str) -> dict[str, float]:
        node = self._nodes[node_name]
        free = {k: parse_quantity(v) for k, v in {**node.allocatable, **node.advertised}.items()}
        for pod in self._pods.values():
            if pod.node == node_name:
                for res, qty in pod.requests.items():
                    free[res] = free.get(res, 0.0) - parse_quantity(qty)
        return free

    def _schedule(self) -> None:
        pool = self.node_pool
        for key, (joins, node_name, labels) in list(self._launching.items()):
            if pool is not None and joins <= self.time:
                self.add_node(node_name, labels=labels, allocatable=pool.allocatable, taints=pool.taints, devices={})
                del self._launching[key]
        for (ns, name), pod in self._pods.items():
            if pod.owner is None or pod.owner[0] not in ("RayCluster", "Deployment", "Pod"):
                continue
            if pod.node is None:
                self._bind(ns, name, pod)
            elif pod.phase == "Pending" and pod.bound_at is not None and self.time - pod.bound_at >= self.start_delay_s:
                if self.image_pull_error and pod.owner[0] in ("RayCluster", "Pod"):
                    pod.waiting_reason = "ImagePullBackOff"
                    self._event(ns, name, Event("Warning", "Failed", self.image_pull_error))
                elif pod.owner[0] == "Pod" and (ns, name) in self.exiting:
                    pod.phase, pod.ready, pod.ended = "Failed", False, "exited with status 1 (Error)"
                else:
                    pod.phase, pod.ready, pod.waiting_reason = "Running", True, None

    def _bind(self, ns: str, name: str, pod: _FakePod) -> None:
        reasons: dict[str, int] = {}
        for node_name, node in self._nodes.items():
            if node.unschedulable:  # kube-scheduler's NodeUnschedulable plugin filters a cordoned node out
                reasons["node(s) were unschedulable"] = reasons.get("node(s) were unschedulable", 0) + 1
                continue
            if not node.ready:
                reasons["node(s) were not ready"] = reasons.get("node(s) were not ready", 0) + 1
                continue
            placement = pod.placement or Placement(pod.node_selector, tolerations=_ANYWHERE.tolerations)
            why = placement.refusal(node.labels, node.taints)
            if why is not None:
                reasons[why] = reasons.get(why, 0) + 1
                continue
            free = self._free(node_name)
            short = [res for res, qty in pod.requests.items() if free.get(res, 0.0) < parse_quantity(qty)]
            if short:
                for res in short:
                    reasons[f"Insufficient {res}"] = reasons.get(f"Insufficient {res}", 0) + 1
                continue
            pod.node, pod.bound_at = node_name, self.time
            self._event(ns, name, Event("Normal", "Scheduled", f"Successfully assigned {ns}/{name} to {node_name}"))
            return
        detail = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
        message = f"0/{len(self._nodes)} nodes are available: {detail}." if detail else "0/0 nodes are available."
        self._event(ns, name, Event("Warning", "FailedScheduling", message))
        pool = self.node_pool
        if pool is None or (ns, name) in self._launching:
            return
        placement = pod.placement or Placement(pod.node_selector, tolerations=_ANYWHERE.tolerations)
        room = {k: parse_quantity(v) for k, v in pool.allocatable.items()}
        fits = all(room.get(res, 0.0) >= parse_quantity(qty) for res, qty in pod.requests.items())
        launched = len(self._launching) + sum(1 for n in self._nodes if n.startswith(f"{pool.name}-"))
        labels = pool.labels_for(placement, launched)
        if fits and placement.refusal(labels, list(pool.taints)) is None:
            self._launching[(ns, name)] = (self.time + pool.launch_s, f"{pool.name}-{launched}", labels)

    def _event(self, ns: str, pod: str, event: Event) -> None:
        events = self._events.setdefault((ns, pod), [])
        for i, old in enumerate(events):
            if (old.type, old.reason, old.message) == (event.type, event.reason, event.message):
                events[i] = Event(old.type, old.reason, old.message, old.count + 1)
                return
        events.append(event)
