"""A stateful in-memory :class:`~raytrain_eks.k8s.cluster.KubeApi`: a small cluster the deploy steps run against.

It keeps nodes, pods, events, DaemonSets and applied objects, and :meth:`FakeKube.tick` plays the controllers
that matter to raytrain-eks: a DaemonSet controller (one pod per matching node; a device plugin's pod, once
ready, makes its node advertise the plugin's resource), the KubeRay operator (a RayCluster gets a head pod and
its worker pods from its own templates; a RayJob gets its RayCluster), and a scheduler that binds a pod only to
a node whose labels match its ``nodeSelector`` and whose free allocatable resources cover its requests, and
otherwise records the ``FailedScheduling`` event a real scheduler would. Time is simulated: :meth:`sleep`
advances the clock and ticks, so waits in the steps finish instantly. Example::

    kube = FakeKube()
    kube.add_node("gpu-1", labels={"role": "gpu-worker"}, allocatable={"cpu": "47", "memory": "180Gi"})
    kube.add_daemon_set("kube-system", "nvidia-device-plugin", node_selector={"role": "gpu-worker"},
                        advertises={"nvidia.com/gpu": "4"})
    kube.sleep(5)
    kube.nodes()[0].allocatable["nvidia.com/gpu"]  # "4"
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from raytrain_eks.k8s.cluster import DaemonSet, Event, ExecResult, Node, Pod, matches

_BUILTIN_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})

ExecHandler = Callable[[str, str, list[str], "str | None"], "ExecResult | None"]

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


@dataclass
class _FakeNode:
    labels: dict[str, str]
    allocatable: dict[str, str]
    ready: bool = True
    advertised: dict[str, str] = field(default_factory=dict)


@dataclass
class _FakeDaemonSet:
    labels: dict[str, str]
    pod_selector: dict[str, str]
    node_selector: dict[str, str]
    advertises: dict[str, str]
    crash: bool = False


@dataclass
class _FakePod:
    labels: dict[str, str]
    requests: dict[str, str]
    node_selector: dict[str, str]
    owner: tuple[str, str] | None = None  # ("DaemonSet"|"RayCluster", name)
    node: str | None = None
    phase: str = "Pending"
    ready: bool = False
    waiting_reason: str | None = None
    bound_at: float | None = None


class FakeKube:
    """The in-memory cluster. Tests reach into it through the helpers below; the steps only use :class:`KubeApi`.

    ``start_delay_s``: how long a bound pod takes to become Running. ``image_pull_error``: when set, bound
    Ray pods never start and carry this message in a ``Failed`` event (``ImagePullBackOff``). ``exec_handler``:
    answers :meth:`exec` calls (``None`` from it means "exit 0, no output"); every call is kept in
    ``exec_calls``.
    """

    def __init__(self) -> None:
        self.time = 0.0
        self.start_delay_s = 5.0
        self.image_pull_error: str | None = None
        self.exec_handler: ExecHandler | None = None
        self.exec_calls: list[tuple[str, str, list[str], str | None]] = []
        self.applied: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str, str, str | None]] = []
        self._nodes: dict[str, _FakeNode] = {}
        self._daemon_sets: dict[tuple[str, str], _FakeDaemonSet] = {}
        self._pods: dict[tuple[str, str], _FakePod] = {}
        self._events: dict[tuple[str, str], list[Event]] = {}
        self._objects: dict[tuple[str, str, str | None, str], dict[str, Any]] = {}

    # -- building the world (tests and fake tools) -----------------------------------------------------------------

    def add_node(
        self, name: str, *, labels: Mapping[str, str], allocatable: Mapping[str, str], ready: bool = True
    ) -> None:
        self._nodes[name] = _FakeNode(dict(labels), dict(allocatable), ready)

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
        """A DaemonSet whose pods run on every node matching ``node_selector``; a ready pod makes its node
        advertise ``advertises`` (a device plugin). ``crash``: its pods never become ready."""
        self._daemon_sets[(namespace, name)] = _FakeDaemonSet(
            dict(labels or {}), {"name": name}, dict(node_selector), dict(advertises or {}), crash
        )

    def remove_daemon_set(self, namespace: str, name: str) -> bool:
        if self._daemon_sets.pop((namespace, name), None) is None:
            return False
        self._drop_owned(namespace, ("DaemonSet", name))
        return True

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
        return [copy.deepcopy(o) for (_, k, _, _), o in self._objects.items() if kind in (None, k)]

    def set_status(self, api_version: str, kind: str, name: str, namespace: str | None, status: dict[str, Any]) -> None:
        obj = self._objects[(api_version, kind, namespace, name)]
        obj["status"] = {**obj.get("status", {}), **status}

    # -- simulated time --------------------------------------------------------------------------------------------

    def monotonic(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time += max(seconds, 0.001)
        self.tick()

    def tick(self) -> None:
        """One round of every controller: DaemonSets, RayJobs, RayClusters, then the scheduler and kubelets."""
        self._run_daemon_sets()
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
            Pod(name, ns, p.phase, dict(p.labels), p.node, p.ready, p.waiting_reason)
            for (ns, name), p in self._pods.items()
            if ns == namespace and matches(p.labels, selector)
        ]

    def pod_events(self, namespace: str, name: str) -> list[Event]:
        return list(self._events.get((namespace, name), []))

    def daemon_sets(self, namespace: str, selector: Mapping[str, str] | None = None) -> list[DaemonSet]:
        out = []
        for (ns, name), ds in self._daemon_sets.items():
            if ns != namespace or not matches(ds.labels, selector):
                continue
            pods = [p for p in self._pods.values() if p.owner == ("DaemonSet", name)]
            desired = sum(1 for n in self._nodes.values() if n.ready and matches(n.labels, ds.node_selector))
            out.append(DaemonSet(name, ns, desired, sum(p.ready for p in pods), dict(ds.pod_selector), dict(ds.labels)))
        return out

    def apply(self, obj: Mapping[str, Any]) -> None:
        doc = copy.deepcopy(dict(obj))
        meta = doc.get("metadata", {})
        if not meta.get("name"):
            raise ValueError("apply: metadata.name is required")
        ns = meta.get("namespace") if doc["kind"] not in ("Namespace", "Node") else None
        if ns is not None and not self._has_namespace(ns):
            raise ValueError(f"apply: namespace {ns!r} does not exist")
        key = (doc["apiVersion"], doc["kind"], ns, meta["name"])
        old = self._objects.get(key)
        if old is not None and "status" in old:
            doc["status"] = old["status"]
        self._objects[key] = doc
        self.applied.append(copy.deepcopy(dict(obj)))

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        obj = self._objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        self.deleted.append((api_version, kind, name, namespace))
        if kind == "DaemonSet" and namespace is not None:
            return self.remove_daemon_set(namespace, name)
        obj = self._objects.pop((api_version, kind, namespace, name), None)
        if obj is None:
            return False
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

    def _run_daemon_sets(self) -> None:
        for node in self._nodes.values():
            node.advertised.clear()
        for (ns, name), ds in self._daemon_sets.items():
            for node_name, node in self._nodes.items():
                if not (node.ready and matches(node.labels, ds.node_selector)):
                    continue
                key = (ns, f"{name}-{node_name}")
                if key not in self._pods:
                    self._pods[key] = _FakePod(
                        dict(ds.pod_selector), {}, {}, ("DaemonSet", name), node_name, "Running", not ds.crash
                    )
                    if ds.crash:
                        self._pods[key].waiting_reason = "CrashLoopBackOff"
                if self._pods[key].ready:
                    node.advertised.update(ds.advertises)

    def _run_rayjobs(self) -> None:
        for (api, kind, ns, name), job in list(self._objects.items()):
            if kind != "RayJob" or job.get("status", {}).get("rayClusterName"):
                continue
            cluster = f"{name}-raycluster"
            job["status"] = {"rayClusterName": cluster, "jobDeploymentStatus": "Initializing", "jobId": f"{name}-job"}
            self._objects[(api, "RayCluster", ns, cluster)] = {
                "apiVersion": api,
                "kind": "RayCluster",
                "metadata": {"name": cluster, "namespace": ns, "labels": dict(job["metadata"].get("labels", {}))},
                "spec": copy.deepcopy(job["spec"]["rayClusterSpec"]),
            }

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
                    wanted[(ns, pod_name)] = _FakePod(labels, dict(requests), dict(selector), ("RayCluster", name))
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
        for (ns, name), pod in self._pods.items():
            if pod.owner is None or pod.owner[0] != "RayCluster":
                continue
            if pod.node is None:
                self._bind(ns, name, pod)
            elif pod.phase == "Pending" and pod.bound_at is not None and self.time - pod.bound_at >= self.start_delay_s:
                if self.image_pull_error:
                    pod.waiting_reason = "ImagePullBackOff"
                    self._event(ns, name, Event("Warning", "Failed", self.image_pull_error))
                else:
                    pod.phase, pod.ready, pod.waiting_reason = "Running", True, None

    def _bind(self, ns: str, name: str, pod: _FakePod) -> None:
        reasons: dict[str, int] = {}
        for node_name, node in self._nodes.items():
            if not node.ready:
                reasons["node(s) were not ready"] = reasons.get("node(s) were not ready", 0) + 1
                continue
            if not matches(node.labels, pod.node_selector):
                why = "node(s) didn't match Pod's node affinity/selector"
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

    def _event(self, ns: str, pod: str, event: Event) -> None:
        events = self._events.setdefault((ns, pod), [])
        for i, old in enumerate(events):
            if (old.type, old.reason, old.message) == (event.type, event.reason, event.message):
                events[i] = Event(old.type, old.reason, old.message, old.count + 1)
                return
        events.append(event)
