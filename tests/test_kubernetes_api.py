"""KubernetesApi, the real KubeApi, driven through the official client against a small loopback API server.

No kube-apiserver can run here, so :class:`FakeApiServer` speaks just enough of the Kubernetes HTTP API for what
``KubernetesApi`` sends: the discovery documents the dynamic client reads (``/version``, ``/apis``, ``/api/v1``,
``/apis/apps/v1``, ``/apis/ray.io/v1``), lists with label and field selectors, server-side apply, get and delete
of single objects, and ``Status`` bodies for errors. It keeps a small store (apply then get returns the object)
and records every request, so the tests check both what reaches the server and what the caller gets back:
selectors as query parameters, parsed nodes, pods, events and DaemonSets, the apply PATCH and its path, the
KubeRay hint for a missing CRD, ``None``/``False`` on 404, and errors that name the call and the server's
message without a Secret's value. ``exec`` speaks a websocket this server does not: its tests replace the
client's stream object with :class:`ScriptedExecStream`, so what ``exec`` makes of the stream is covered (lines
split across frames, stderr, the exit status, a connection that breaks), not the wire.

The server binds 127.0.0.1 on a free port, serves one test and stops; the dynamic client's discovery cache
(a file in the temp folder, named after the server URL) goes to the test's own folder, so no earlier run's
cache can answer for the server.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import re
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from fake_kube import merged
from websocket import WebSocketConnectionClosedException

from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.cluster import DaemonSet, Event, KubeApiError, KubernetesApi, Node, Pod, image_never_pulls

TOKEN = "dummy-bearer-token"
CREATED = "2025-06-01T12:00:00Z"
MAX_BODY = 1 << 20

# (group/version, plural, kind, namespaced): what discovery lists and the resource routes serve.
CORE = [
    ("v1", "namespaces", "Namespace", False),
    ("v1", "nodes", "Node", False),
    ("v1", "pods", "Pod", True),
    ("v1", "events", "Event", True),
    ("v1", "configmaps", "ConfigMap", True),
    ("v1", "secrets", "Secret", True),
    ("v1", "services", "Service", True),
]
APPS = [("apps/v1", "daemonsets", "DaemonSet", True), ("apps/v1", "deployments", "Deployment", True)]
KUBERAY = [
    ("ray.io/v1", "rayclusters", "RayCluster", True),
    ("ray.io/v1", "rayjobs", "RayJob", True),
    ("ray.io/v1", "rayservices", "RayService", True),
]
VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class Request:
    """One request as the server saw it."""

    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str | None
    authorization: str | None
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def status(code: int, reason: str, message: str, **details: str) -> dict[str, Any]:
    """A ``v1.Status`` failure body, as the API server sends with every error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }


def match_labels(labels: dict[str, str], selector: str | None) -> bool:
    pairs = [term.split("=", 1) for term in (selector or "").split(",") if term]
    return all(labels.get(k) == v for k, v in pairs)


def match_fields(obj: dict[str, Any], selector: str | None) -> bool:
    for term in (selector or "").split(","):
        if not term:
            continue
        path, want = term.split("=", 1)
        value: Any = obj
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value != want:
            return False
    return True


class FakeApiServer:
    """The Kubernetes API subset KubernetesApi uses, over HTTP on 127.0.0.1. ``kuberay`` says whether the
    ``ray.io`` CRDs are installed; :meth:`fail` makes matching requests answer an error ``Status``."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.kuberay = True
        self.store: dict[tuple[str, str | None, str, str], dict[str, Any]] = {}
        self._failures: list[tuple[str, str, int, str, str]] = []
        self._version = 100
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"api": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-kube-apiserver", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def fail(self, method: str, path_prefix: str, code: int, reason: str, message: str) -> None:
        """Answer ``method`` (or ``*``) on paths starting with ``path_prefix`` with an error Status."""
        self._failures.append((method, path_prefix, code, reason, message))

    def seed(self, gv: str, plural: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.store[(gv, meta.get("namespace"), plural, meta["name"])] = obj

    def paths(self, method: str | None = None) -> list[str]:
        return [r.path for r in self.requests if method is None or r.method == method]

    # -- request handling ------------------------------------------------------------------------------------------

    def resources(self) -> list[tuple[str, str, str, bool]]:
        return CORE + APPS + (KUBERAY if self.kuberay else [])

    def handle(self, req: Request) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests.append(req)
            for method, prefix, code, reason, message in self._failures:
                if method in ("*", req.method) and req.path.startswith(prefix):
                    return code, status(code, reason, message)
            if req.method == "GET":
                discovery = self._discovery(req.path)
                if discovery is not None:
                    return 200, discovery
            return self._resource(req)

    def _discovery(self, path: str) -> dict[str, Any] | None:
        if path == "/version":
            return {
                "major": "1",
                "minor": "33",
                "gitVersion": "v1.33.1-eks-7308294",
                "gitCommit": "8e1b6ed8e2ce1c4c3bd36e3b6e4bc0b0b0f9c7a1",
                "gitTreeState": "clean",
                "buildDate": "2025-05-21T19:31:48Z",
                "goVersion": "go1.24.2",
                "compiler": "gc",
                "platform": "linux/amd64",
            }
        if path == "/api":
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "10.0.12.34:443"}],
            }
        if path == "/apis":
            groups = sorted({gv for gv, *_ in self.resources() if "/" in gv})
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": gv.split("/")[0],
                        "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                        "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]},
                    }
                    for gv in groups
                ],
            }
        gv = "v1" if path == "/api/v1" else path.removeprefix("/apis/")
        served = [r for r in self.resources() if r[0] == gv]
        if not served or path not in ("/api/v1", f"/apis/{gv}"):
            return None
        listed = []
        for _, plural, kind, namespaced in served:
            listed.append(
                {"name": plural, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind, "verbs": VERBS}
            )
            if kind in ("Pod", "DaemonSet", "RayCluster"):
                listed.append(
                    {
                        "name": f"{plural}/status",
                        "singularName": "",
                        "namespaced": namespaced,
                        "kind": kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": listed}

    def _resource(self, req: Request) -> tuple[int, dict[str, Any]]:
        route = re.fullmatch(
            r"/(?P<gv>api/v1|apis/[^/]+/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?",
            req.path,
        )
        found = None
        if route:
            gv = route["gv"].removeprefix("api/").removeprefix("apis/")
            found = next((r for r in self.resources() if r[0] == gv and r[1] == route["plural"]), None)
        if route is None or found is None or (found[3] and route["ns"] is None and route["name"] is not None):
            return 404, status(404, "NotFound", "the server could not find the requested resource")
        gv, plural, kind, _ = found
        ns, name = route["ns"], route["name"]
        key = (gv, ns, plural, name or "")
        group = gv.rpartition("/")[0]
        missing = status(
            404, "NotFound", f'{plural}{"." + group if group else ""} "{name}" not found', name=name or "", kind=plural
        )
        if name is None and req.method == "GET":
            return 200, self._list(gv, plural, kind, ns, req.query)
        if req.method == "GET":
            return (200, self.store[key]) if key in self.store else (404, missing)
        if req.method == "DELETE":
            if key not in self.store:
                return 404, missing
            gone = self.store.pop(key)
            gone["metadata"]["deletionTimestamp"] = CREATED
            return 200, gone
        if req.method == "PATCH" and req.content_type == "application/merge-patch+json":
            if key not in self.store:
                return 404, missing
            self._version += 1
            self.store[key] = merged(self.store[key], req.json())
            self.store[key]["metadata"]["resourceVersion"] = str(self._version)
            return 200, self.store[key]
        if req.method == "PATCH":
            return self._apply(req, key, kind)
        return 405, status(405, "MethodNotAllowed", f"the server does not allow this method on {plural}")

    def _list(self, gv: str, plural: str, kind: str, ns: str | None, query: dict[str, list[str]]) -> dict[str, Any]:
        labels = query.get("labelSelector", [None])[0]
        fields = query.get("fieldSelector", [None])[0]
        items = [
            obj
            for (g, n, p, _), obj in sorted(self.store.items(), key=lambda kv: kv[0][3])
            if g == gv
            and p == plural
            and (ns is None or n == ns)
            and match_labels(obj["metadata"].get("labels") or {}, labels)
            and match_fields(obj, fields)
        ]
        return {
            "kind": f"{kind}List",
            "apiVersion": gv,
            "metadata": {"resourceVersion": str(self._version)},
            "items": items,
        }

    def _apply(self, req: Request, key: tuple[str, str | None, str, str], kind: str) -> tuple[int, dict[str, Any]]:
        if req.content_type != "application/apply-patch+yaml":
            return 415, status(
                415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {req.content_type}"
            )
        if not req.query.get("fieldManager"):
            return 422, status(
                422,
                "Invalid",
                'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is required for apply patch',
            )
        obj = req.json()  # JSON is YAML; the client sends JSON
        if obj.get("kind") != kind or obj["metadata"].get("name") != key[3]:
            return 400, status(400, "BadRequest", "the name or kind of the object does not match the request")
        self._version += 1
        stored = copy.deepcopy(obj)
        stored["metadata"].update(
            namespace=key[1], uid=f"uid-{self._version}", resourceVersion=str(self._version), creationTimestamp=CREATED
        )
        if kind == "Secret" and "stringData" in stored:  # the API server folds stringData into data
            data = {k: base64.b64encode(v.encode()).decode() for k, v in stored.pop("stringData").items()}
            stored["data"] = {**stored.get("data", {}), **data}
        created = key not in self.store
        self.store[key] = stored
        return (201 if created else 200), stored


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    timeout = 5  # a stuck client cannot hold a server thread

    def _serve(self) -> None:
        url = urlsplit(self.path)
        length = min(int(self.headers.get("Content-Length") or 0), MAX_BODY)
        req = Request(
            method=self.command,
            path=url.path,
            query=parse_qs(url.query, keep_blank_values=True),
            content_type=self.headers.get("Content-Type"),
            authorization=self.headers.get("Authorization"),
            body=self.rfile.read(length) if length else b"",
        )
        code, body = self.api.handle(req)
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_DELETE = do_POST = do_PUT = _serve

    def log_message(self, *args: Any) -> None:
        pass  # quiet: the tests read FakeApiServer.requests instead


# -- cluster contents ------------------------------------------------------------------------------------------------


def node(name: str, role: str, *, gpus: str | None = None, ready: bool = True) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name, "topology.kubernetes.io/zone": "us-west-2b", "role": role}
    allocatable = {"cpu": "47810m", "memory": "190450Mi", "pods": "250", "ephemeral-storage": "95551679124"}
    if gpus:
        labels |= m.GPU_NODE_LABELS | {"node.kubernetes.io/instance-type": "g6.12xlarge"}
        allocatable |= {"nvidia.com/gpu": gpus, "vpc.amazonaws.com/efa": "1"}
    conditions = [
        {
            "type": "MemoryPressure",
            "status": "False",
            "reason": "KubeletHasSufficientMemory",
            "lastHeartbeatTime": CREATED,
            "lastTransitionTime": CREATED,
        },
        {
            "type": "Ready",
            "status": "True" if ready else "Unknown",
            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
            "message": "kubelet is posting ready status" if ready else "Kubelet stopped posting node status.",
            "lastHeartbeatTime": CREATED,
            "lastTransitionTime": CREATED,
        },
    ]
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "7",
            "creationTimestamp": CREATED,
            "labels": labels,
        },
        "spec": {"providerID": f"aws:///us-west-2b/i-{name.split('.')[0]}"},
        "status": {"capacity": dict(allocatable), "allocatable": allocatable, "conditions": conditions},
    }


def pod(name: str, ns: str, labels: dict[str, str], *, node_name: str | None, waiting: str | None) -> dict[str, Any]:
    state = (
        {"waiting": {"reason": waiting, "message": "Back-off pulling image"}}
        if waiting
        else {"running": {"startedAt": CREATED}}
    )
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": f"uid-{name}",
            "resourceVersion": "9",
            "creationTimestamp": CREATED,
            "labels": labels,
        },
        "spec": {
            "containers": [{"name": "ray-worker", "image": "rayproject/ray:2.49.0-py311-gpu"}],
            "nodeName": node_name,
        },
        "status": {
            "phase": "Pending" if waiting else "Running",
            "conditions": [{"type": "Ready", "status": "False" if waiting else "True", "lastTransitionTime": CREATED}],
            "containerStatuses": [
                {
                    "name": "ray-worker",
                    "image": "rayproject/ray:2.49.0-py311-gpu",
                    "imageID": "",
                    "ready": not waiting,
                    "restartCount": 0,
                    "started": not waiting,
                    "state": state,
                }
            ],
        },
    }


def event(pod_name: str, ns: str, reason: str, message: str, count: int) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{pod_name}.{reason.lower()}",
            "namespace": ns,
            "uid": f"uid-ev-{pod_name}-{reason}",
            "creationTimestamp": CREATED,
        },
        "involvedObject": {"kind": "Pod", "namespace": ns, "name": pod_name, "apiVersion": "v1"},
        "reason": reason,
        "message": message,
        "type": "Warning",
        "count": count,
        "source": {"component": "default-scheduler"},
        "firstTimestamp": CREATED,
        "lastTimestamp": CREATED,
    }


def daemon_set(name: str, labels: dict[str, str], desired: int, ready: int) -> dict[str, Any]:
    pod_labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/instance": labels["app.kubernetes.io/instance"]}
    return {
        "metadata": {
            "name": name,
            "namespace": "kube-system",
            "uid": f"uid-{name}",
            "generation": 1,
            "creationTimestamp": CREATED,
            "labels": labels,
        },
        "spec": {
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {"containers": [{"name": name, "image": f"example/{name}:1"}]},
            },
        },
        "status": {
            "currentNumberScheduled": desired,
            "desiredNumberScheduled": desired,
            "numberMisscheduled": 0,
            "numberReady": ready,
            "observedGeneration": 1,
        },
    }


WORKER = "ray-train-gpu-workers-worker-x7k2p"
HEAD = "ray-train-head-4jq8z"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    api = FakeApiServer()
    api.seed("v1", "nodes", node("ip-10-0-1-10.us-west-2.compute.internal", "system"))
    api.seed("v1", "nodes", node("ip-10-0-2-21.us-west-2.compute.internal", "gpu-worker", gpus="4"))
    api.seed("v1", "nodes", node("ip-10-0-2-22.us-west-2.compute.internal", "gpu-worker", gpus="4", ready=False))
    ray = {"ray.io/cluster": "ray-train"}
    api.seed(
        "v1",
        "pods",
        pod(
            HEAD,
            "default",
            ray | {"ray.io/node-type": "head"},
            node_name="ip-10-0-1-10.us-west-2.compute.internal",
            waiting=None,
        ),
    )
    api.seed(
        "v1",
        "pods",
        pod(WORKER, "default", ray | {"ray.io/node-type": "worker"}, node_name=None, waiting="ImagePullBackOff"),
    )
    api.seed("v1", "pods", pod("other-0", "default", {"app": "other"}, node_name=None, waiting=None))
    api.seed("v1", "pods", pod("ray-train-head-elsewhere", "team-b", ray, node_name=None, waiting=None))
    api.seed(
        "v1",
        "events",
        event(WORKER, "default", "FailedScheduling", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.", 4),
    )
    api.seed("v1", "events", event(HEAD, "default", "BackOff", "Back-off restarting failed container", 1))
    api.seed("apps/v1", "daemonsets", daemon_set("nvidia-device-plugin", {"app.kubernetes.io/instance": "nvdp"}, 2, 1))
    api.seed(
        "apps/v1", "daemonsets", daemon_set("aws-efa-k8s-device-plugin", {"app.kubernetes.io/instance": "efa"}, 2, 2)
    )
    api.start()
    yield api
    api.stop()


@pytest.fixture
def kubeconfig(server: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A kubeconfig for the server (plain http, a dummy token); proxies off; discovery cache in ``tmp_path``."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
                "users": [{"name": "fake", "user": {"token": TOKEN}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    return path


@pytest.fixture
def kube(kubeconfig: Path) -> KubernetesApi:
    return KubernetesApi(kubeconfig)


def only(server: FakeApiServer, method: str, path: str) -> Request:
    """The one request of ``method`` on ``path`` (fails on none or several)."""
    (req,) = [r for r in server.requests if r.method == method and r.path == path]
    return req


# -- reads -----------------------------------------------------------------------------------------------------------


def test_nodes_send_the_label_selector_and_read_gpus_efa_zone_and_readiness(
    kube: KubernetesApi, server: FakeApiServer
) -> None:
    gpu = kube.nodes({"role": "gpu-worker", "nvidia.com/gpu.present": "true"})

    req = only(server, "GET", "/api/v1/nodes")
    assert req.query == {"labelSelector": ["role=gpu-worker,nvidia.com/gpu.present=true"]}
    assert req.authorization == f"Bearer {TOKEN}"
    assert [(n.name, n.ready, n.zone) for n in gpu] == [
        ("ip-10-0-2-21.us-west-2.compute.internal", True, "us-west-2b"),
        ("ip-10-0-2-22.us-west-2.compute.internal", False, "us-west-2b"),
    ]
    assert isinstance(gpu[0], Node)
    assert gpu[0].allocatable["nvidia.com/gpu"] == "4"
    assert gpu[0].allocatable["vpc.amazonaws.com/efa"] == "1"
    assert gpu[0].labels["node.kubernetes.io/instance-type"] == "g6.12xlarge"

    everything = kube.nodes()
    assert len(everything) == 3
    assert server.requests[-1].query == {"labelSelector": [""]}  # an empty selector: every node


def test_pods_send_the_label_selector_and_read_phase_node_and_waiting_reason(
    kube: KubernetesApi, server: FakeApiServer
) -> None:
    pods = kube.pods("default", {"ray.io/cluster": "ray-train"})

    req = only(server, "GET", "/api/v1/namespaces/default/pods")
    assert req.query == {"labelSelector": ["ray.io/cluster=ray-train"]}
    assert pods == [
        Pod(WORKER, "default", "Pending", {"ray.io/cluster": "ray-train", "ray.io/node-type": "worker"},
            node_name=None, ready=False, waiting_reason="ImagePullBackOff"),
        Pod(HEAD, "default", "Running", {"ray.io/cluster": "ray-train", "ray.io/node-type": "head"},
            node_name="ip-10-0-1-10.us-west-2.compute.internal", ready=True, waiting_reason=None),
    ]  # fmt: skip


def test_pods_read_how_an_ended_container_ended(kube: KubernetesApi, server: FakeApiServer) -> None:
    ended = pod("probe-0", "probe", {"app": "probe"}, node_name="ip-10-0-2-21.us-west-2.compute.internal", waiting=None)
    ended["status"]["phase"] = "Failed"
    ended["status"]["conditions"][0]["status"] = "False"
    ended["status"]["containerStatuses"][0]["ready"] = False
    ended["status"]["containerStatuses"][0]["state"] = {
        "terminated": {"exitCode": 127, "reason": "Error", "startedAt": CREATED, "finishedAt": CREATED}
    }
    server.seed("v1", "pods", ended)
    (found,) = kube.pods("probe")
    assert (found.phase, found.ready, found.waiting_reason) == ("Failed", False, None)
    assert found.ended == "exited with status 127 (Error)"
    assert all(p.ended is None for p in kube.pods("default"))  # running or waiting: not ended


def test_pod_events_send_the_involved_object_field_selector(kube: KubernetesApi, server: FakeApiServer) -> None:
    events = kube.pod_events("default", WORKER)

    req = only(server, "GET", "/api/v1/namespaces/default/events")
    assert req.query == {"fieldSelector": [f"involvedObject.kind=Pod,involvedObject.name={WORKER}"]}
    assert events == [
        Event("Warning", "FailedScheduling", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.", 4)
    ]
    assert str(events[0]) == "Warning FailedScheduling: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu. (x4)"


def test_only_an_image_the_registry_lacks_or_a_name_kubelet_cannot_parse_is_told_never_to_pull() -> None:
    from fake_kube import PULL_NO_CREDENTIALS, PULL_NOT_FOUND

    backing_off = Pod(WORKER, "default", "Pending", waiting_reason="ImagePullBackOff")
    not_found = Event("Warning", "Failed", PULL_NOT_FOUND, 3)
    why = image_never_pulls(backing_off, [Event("Normal", "Pulling", "Pulling image"), not_found])
    assert why and "no such image" in why and "starboard-operator:0.15.4: not found" in why
    assert image_never_pulls(dataclasses.replace(backing_off, waiting_reason="ErrImagePull"), [not_found])
    # kubelet tries again, and these may pass: no credentials yet, no answer, still pulling, another reason
    assert image_never_pulls(backing_off, [Event("Warning", "Failed", PULL_NO_CREDENTIALS)]) is None
    assert image_never_pulls(backing_off, [Event("Normal", "BackOff", 'Back-off pulling image "x"')]) is None
    assert image_never_pulls(backing_off, []) is None
    assert image_never_pulls(dataclasses.replace(backing_off, waiting_reason="ContainerCreating"), [not_found]) is None
    unparsable = dataclasses.replace(backing_off, waiting_reason="InvalidImageName")
    assert image_never_pulls(unparsable, []) == "its image name cannot be parsed (InvalidImageName)"


def test_daemon_sets_send_the_label_selector_and_read_readiness_and_pod_selector(
    kube: KubernetesApi, server: FakeApiServer
) -> None:
    sets = kube.daemon_sets("kube-system", {"app.kubernetes.io/instance": "nvdp"})

    req = only(server, "GET", "/apis/apps/v1/namespaces/kube-system/daemonsets")
    assert req.query == {"labelSelector": ["app.kubernetes.io/instance=nvdp"]}
    assert sets == [
        DaemonSet(
            "nvidia-device-plugin",
            "kube-system",
            desired=2,
            ready=1,
            pod_selector={"app.kubernetes.io/name": "nvidia-device-plugin", "app.kubernetes.io/instance": "nvdp"},
            labels={"app.kubernetes.io/instance": "nvdp"},
        )
    ]


def test_daemon_sets_of_every_namespace_are_one_cluster_wide_list(kube: KubernetesApi, server: FakeApiServer) -> None:
    operator = daemon_set("nvidia-device-plugin-daemonset", {"app.kubernetes.io/instance": "gpu-operator"}, 1, 1)
    operator["metadata"]["namespace"] = "nvidia-gpu-operator"
    server.seed("apps/v1", "daemonsets", operator)

    sets = kube.daemon_sets(None)

    req = only(server, "GET", "/apis/apps/v1/daemonsets")
    assert req.query == {"labelSelector": [""]}  # no selector: all of them
    assert sorted((ds.namespace, ds.name) for ds in sets) == [
        ("kube-system", "aws-efa-k8s-device-plugin"),
        ("kube-system", "nvidia-device-plugin"),
        ("nvidia-gpu-operator", "nvidia-device-plugin-daemonset"),
    ]


# -- apply, get, delete ----------------------------------------------------------------------------------------------


def assert_server_side_apply(req: Request, doc: dict[str, Any]) -> None:
    assert req.content_type == "application/apply-patch+yaml"
    assert req.query == {"fieldManager": ["raytrain-eks"], "force": ["true"]}
    assert req.json() == doc  # the whole manifest, as JSON (which is YAML)


def test_apply_of_a_config_map_is_a_server_side_apply_and_get_returns_it(
    kube: KubernetesApi, server: FakeApiServer, cfg_for
) -> None:
    doc = m.job_config_map(cfg_for())
    path = "/api/v1/namespaces/default/configmaps/ray-train-config"

    kube.apply(doc)
    kube.apply(doc)  # the same dict again: one more apply PATCH, nothing else

    patches = [r for r in server.requests if r.method == "PATCH"]
    assert [r.path for r in patches] == [path, path]
    assert_server_side_apply(patches[0], doc)
    assert not [r for r in server.requests if r.method in ("POST", "PUT", "DELETE")]
    got = kube.get("v1", "ConfigMap", "ray-train-config", "default")
    assert got is not None
    assert got["data"] == doc["data"]
    assert got["metadata"]["labels"] == doc["metadata"]["labels"]
    assert only(server, "GET", path).query == {}


def test_apply_of_a_raycluster_patches_its_ray_io_path(kube: KubernetesApi, server: FakeApiServer, cfg_for) -> None:
    doc = m.raycluster(cfg_for(), hf_token=True)

    kube.apply(doc)

    assert_server_side_apply(only(server, "PATCH", "/apis/ray.io/v1/namespaces/default/rayclusters/ray-train"), doc)
    got = kube.get("ray.io/v1", "RayCluster", "ray-train", "default")
    assert got is not None
    assert got["spec"] == doc["spec"]


def test_apply_without_the_kuberay_crds_asks_for_the_operator_then_works_once_installed(
    kube: KubernetesApi, server: FakeApiServer, kubeconfig: Path, cfg_for
) -> None:
    doc = m.rayjob(cfg_for())
    server.kuberay = False

    with pytest.raises(KubeApiError) as caught:
        kube.apply(doc)

    assert "does not know RayJob (ray.io/v1)" in caught.value.message
    assert caught.value.hint is not None
    assert "install the KubeRay operator" in caught.value.hint
    assert server.paths("PATCH") == []
    # The dynamic client cached discovery (without ray.io) in the temp folder, which is this test's own.
    assert list(kubeconfig.parent.glob("osrcp-*.json"))

    server.kuberay = True  # `up` installs the operator; the next process meets the stale cache
    KubernetesApi(kubeconfig).apply(doc)
    kube.apply(doc)  # and the first client, with its own stale view, looks again too

    assert server.paths("PATCH") == ["/apis/ray.io/v1/namespaces/default/rayjobs/ray-train"] * 2


def test_merge_patch_sends_a_merge_patch_whose_nulls_remove_what_another_manager_set(
    kube: KubernetesApi, server: FakeApiServer, cfg_for
) -> None:
    doc = m.job_config_map(cfg_for())
    doc["metadata"]["labels"] = {**doc["metadata"]["labels"], "app.kubernetes.io/managed-by": "eksctl"}
    kube.apply(doc)
    path = "/api/v1/namespaces/default/configmaps/ray-train-config"

    patch = {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}, "annotations": {"team": "ml"}}}
    assert kube.merge_patch("v1", "ConfigMap", "ray-train-config", "default", patch) is True
    assert kube.merge_patch("v1", "ConfigMap", "not-there", "default", patch) is False

    sent = [r for r in server.requests if r.method == "PATCH" and r.content_type == "application/merge-patch+json"]
    assert [r.path for r in sent] == [path, "/api/v1/namespaces/default/configmaps/not-there"]
    assert sent[0].json() == patch  # the None goes over the wire as null
    got = kube.get("v1", "ConfigMap", "ray-train-config", "default")
    assert got is not None
    assert "app.kubernetes.io/managed-by" not in got["metadata"]["labels"]
    assert got["metadata"]["annotations"] == {"team": "ml"} and got["data"] == doc["data"]


def test_get_of_a_missing_object_or_kind_is_none(kube: KubernetesApi, server: FakeApiServer) -> None:
    assert kube.get("v1", "ConfigMap", "nothing-here", "default") is None
    only(server, "GET", "/api/v1/namespaces/default/configmaps/nothing-here")
    server.kuberay = False
    assert kube.get("ray.io/v1", "RayCluster", "ray-train", "default") is None


def test_delete_is_foreground_and_false_when_nothing_was_there(
    kube: KubernetesApi, server: FakeApiServer, cfg_for
) -> None:
    kube.apply(m.raycluster(cfg_for()))
    path = "/apis/ray.io/v1/namespaces/default/rayclusters/ray-train"

    assert kube.delete("ray.io/v1", "RayCluster", "ray-train", "default") is True
    assert kube.delete("ray.io/v1", "RayCluster", "ray-train", "default") is False

    deletes = [r for r in server.requests if r.method == "DELETE"]
    assert [r.path for r in deletes] == [path, path]
    assert deletes[0].json() == {"propagationPolicy": "Foreground"}
    assert deletes[0].content_type == "application/json"
    assert kube.get("ray.io/v1", "RayCluster", "ray-train", "default") is None


# -- errors ----------------------------------------------------------------------------------------------------------

CALLS = {
    "list nodes": (lambda k: k.nodes(), "GET", "/api/v1/nodes"),
    "list pods in default": (lambda k: k.pods("default"), "GET", "/api/v1/namespaces/default/pods"),
    f"list events of pod default/{WORKER}": (
        lambda k: k.pod_events("default", WORKER), "GET", "/api/v1/namespaces/default/events"),
    "list DaemonSets in kube-system": (
        lambda k: k.daemon_sets("kube-system"), "GET", "/apis/apps/v1/namespaces/kube-system/daemonsets"),
    "apply ConfigMap settings": (
        lambda k: k.apply({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": "settings", "namespace": "default"}, "data": {"a": "1"}}),
        "PATCH", "/api/v1/namespaces/default/configmaps/settings"),
    "get RayCluster ray-train": (
        lambda k: k.get("ray.io/v1", "RayCluster", "ray-train", "default"),
        "GET", "/apis/ray.io/v1/namespaces/default/rayclusters/ray-train"),
    "delete RayCluster ray-train": (
        lambda k: k.delete("ray.io/v1", "RayCluster", "ray-train", "default"),
        "DELETE", "/apis/ray.io/v1/namespaces/default/rayclusters/ray-train"),
}  # fmt: skip
FAILURES = {
    403: ("Forbidden", 'is forbidden: User "arn:aws:iam::111122223333:user/dev" cannot do this'),
    500: ("Internal Server Error", "etcdserver: request timed out"),
}


@pytest.mark.parametrize("code", sorted(FAILURES))
@pytest.mark.parametrize("what", list(CALLS))
def test_a_refused_call_is_one_kube_api_error_naming_the_call_and_the_server_message(
    kube: KubernetesApi, server: FakeApiServer, what: str, code: int
) -> None:
    call, method, path = CALLS[what]
    reason, message = FAILURES[code]
    server.fail(method, path, code, reason.replace(" ", ""), message)

    with pytest.raises(KubeApiError) as caught:
        call(kube)

    assert str(caught.value) == f"Kubernetes API: {what} failed: {code} {reason}: {message}"
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__  # no chained client traceback under the message
    assert server.requests[-1].path == path


@pytest.mark.parametrize("what", list(CALLS))
def test_a_token_the_server_rejects_is_a_kube_api_error_even_during_discovery(
    kube: KubernetesApi, server: FakeApiServer, what: str
) -> None:
    server.fail("*", "/", 401, "Unauthorized", "Unauthorized")

    with pytest.raises(KubeApiError, match=rf"^Kubernetes API: {re.escape(what)} failed: 401 Unauthorized"):
        CALLS[what][0](kube)


def test_an_unreachable_server_is_a_kube_api_error(kube: KubernetesApi, server: FakeApiServer) -> None:
    server.stop()  # the kubeconfig now points at a closed loopback port

    for what, (call, _, _) in CALLS.items():
        with pytest.raises(KubeApiError, match=rf"^Kubernetes API: {re.escape(what)} failed: cannot reach"):
            call(kube)


@pytest.mark.parametrize(
    ("code", "reason", "message"),
    [
        (403, "Forbidden", 'secrets "hf-token" is forbidden: User "dev" cannot patch resource "secrets"'),
        # An admission webhook's denial may quote the object it refused.
        (400, "BadRequest", 'admission webhook "policy.example.com" denied the request: stringData.token: "{token}"'),
    ],
)
def test_a_failed_secret_apply_never_shows_the_token(
    kube: KubernetesApi, server: FakeApiServer, cfg_for, code: int, reason: str, message: str
) -> None:
    token = "hf_FAKEtoken0123456789abcdefSECRET"
    server.fail("PATCH", "/api/v1/namespaces/default/secrets/hf-token", code, reason, message.format(token=token))

    with pytest.raises(KubeApiError) as caught:
        kube.apply(m.hf_token_secret(cfg_for(), token))

    assert only(server, "PATCH", "/api/v1/namespaces/default/secrets/hf-token").json()["stringData"] == {
        "token": token
    }  # the token did reach the server
    assert "apply Secret hf-token failed" in str(caught.value)
    if "{token}" in message:
        assert 'stringData.token: "<redacted>"' in str(caught.value)
    assert token not in str(caught.value)
    assert token not in (caught.value.hint or "")


# -- exec --------------------------------------------------------------------------------------------------------------


class ScriptedExecStream:
    """Stands in for the client's exec websocket (``kubernetes.stream.ws_client.WSClient``): each :meth:`update`
    delivers the next scripted step, ``("stdout" | "stderr", text)`` or an exception to raise; the exit status
    (a ``v1.Status``) is read from channel 3 once the steps run out."""

    def __init__(self, steps: list[tuple[str, str] | BaseException], status: str = '{"status": "Success"}') -> None:
        self.steps = list(steps)
        self.status = status
        self.buffers = {"stdout": "", "stderr": ""}
        self.closed = False

    def is_open(self) -> bool:
        return bool(self.steps)

    def update(self, timeout: float = 0) -> None:
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        channel, text = step
        self.buffers[channel] += text

    def _read(self, channel: str) -> str:
        text, self.buffers[channel] = self.buffers[channel], ""
        return text

    def peek_stdout(self) -> bool:
        return bool(self.buffers["stdout"])

    def read_stdout(self) -> str:
        return self._read("stdout")

    def peek_stderr(self) -> bool:
        return bool(self.buffers["stderr"])

    def read_stderr(self) -> str:
        return self._read("stderr")

    def read_channel(self, channel: int) -> str:
        assert channel == 3
        return self.status

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def exec_stream(monkeypatch: pytest.MonkeyPatch) -> list[ScriptedExecStream]:
    """Replace the client's exec stream; append the stream the next ``exec`` gets to the returned list."""
    import kubernetes.stream

    streams: list[ScriptedExecStream] = []

    def stream(_fn: Any, pod: str, namespace: str, **kwargs: Any) -> ScriptedExecStream:
        assert kwargs["command"] == ["ray", "job", "logs"] and kwargs["tty"] is False
        return streams[-1]

    monkeypatch.setattr(kubernetes.stream, "stream", stream)
    return streams


def test_exec_hands_on_whole_lines_and_returns_output_and_exit_status(
    kube: KubernetesApi, exec_stream: list[ScriptedExecStream]
) -> None:
    failure = {"status": "Failure", "details": {"causes": [{"reason": "ExitCode", "message": "3"}]}}
    exec_stream.append(
        ScriptedExecStream(
            [
                ("stdout", "step 10 lo"),
                ("stdout", "ss 2.31\nstep 20"),
                ("stderr", "warning\n"),
                ("stdout", " loss 1.87"),
            ],
            status=json.dumps(failure),
        )
    )
    lines: list[str] = []

    done = kube.exec("default", HEAD, ["ray", "job", "logs"], timeout=60, on_output=lines.append)

    assert lines == ["step 10 loss 2.31", "step 20 loss 1.87"]
    assert (done.returncode, done.stdout, done.stderr) == (3, "step 10 loss 2.31\nstep 20 loss 1.87", "warning\n")
    assert exec_stream[-1].closed


@pytest.mark.parametrize(
    "broken",
    [WebSocketConnectionClosedException("Connection to remote host was lost."), ConnectionResetError(104, "reset")],
)
def test_an_exec_stream_that_breaks_is_one_kube_api_error(
    kube: KubernetesApi, exec_stream: list[ScriptedExecStream], broken: BaseException
) -> None:
    exec_stream.append(ScriptedExecStream([("stdout", "step 10 loss 2.31\n"), broken]))

    with pytest.raises(KubeApiError) as caught:
        kube.exec("default", HEAD, ["ray", "job", "logs"], timeout=60)

    assert caught.value.message.startswith(f"Kubernetes API: exec in default/{HEAD} failed: the connection broke (")
    assert type(broken).__name__ in caught.value.message
    assert "raytrain-eks submit" in (caught.value.hint or "")
    assert caught.value.__suppress_context__  # no chained websocket traceback under the message
    assert exec_stream[-1].closed
