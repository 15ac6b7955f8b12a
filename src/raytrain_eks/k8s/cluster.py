"""The small interface the deploy steps use to talk to Kubernetes, and its real implementation.

:class:`KubeApi` is everything ``up``, ``submit``, ``status``, ``logs`` and ``down`` need from a cluster: nodes
with their labels and allocatable resources, pods with their phase and events, DaemonSets with their readiness,
apply/get/delete of plain dicts (the manifests of :mod:`raytrain_eks.k8s.manifests`), and exec into a pod.
:class:`KubernetesApi` implements it over the official ``kubernetes`` client (imported on first use);
``FakeKube`` in the tests (tests/fake_kube.py) is the stateful in-memory fake the tests drive. Example::

    kube = KubernetesApi(kubeconfig=".raytrain-eks/kubeconfig")
    [n.name for n in kube.nodes({"role": "gpu-worker"})]
    kube.exec("default", "ray-train-head-x7k2p", ["ray", "status"], timeout=60).stdout
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from raytrain_eks.errors import UserError

if TYPE_CHECKING:
    from kubernetes.client import ApiClient
    from kubernetes.client.exceptions import ApiException
    from kubernetes.dynamic import DynamicClient


KUBERNETES_INSTALL_HINT = "Install the Kubernetes client: pip install 'kubernetes==37.0.1' (a raytrain-eks dependency)."


@dataclass(frozen=True)
class Node:
    """A node: its labels, allocatable resources (Kubernetes quantities as strings) and whether it is Ready."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    allocatable: dict[str, str] = field(default_factory=dict)
    ready: bool = True

    @property
    def zone(self) -> str | None:
        return self.labels.get("topology.kubernetes.io/zone")


@dataclass(frozen=True)
class Pod:
    """A pod: phase (``Pending``, ``Running``, ``Succeeded``, ``Failed``, ``Unknown``), node, readiness, the
    reason a container is waiting when there is one (``ImagePullBackOff``, ``CrashLoopBackOff``, ...), and how a
    container that has ended ended (``exited with status 1 (Error)``, its ``state.terminated``)."""

    name: str
    namespace: str
    phase: str
    labels: dict[str, str] = field(default_factory=dict)
    node_name: str | None = None
    ready: bool = False
    waiting_reason: str | None = None
    ended: str | None = None
    ip: str | None = None  # status.podIP: a Ray node in the pod goes by it (the pod's one interface)


@dataclass(frozen=True)
class Event:
    """One event of an object, as ``kubectl describe`` shows it: ``Warning FailedScheduling 0/3 nodes ...``."""

    type: str
    reason: str
    message: str
    count: int = 1

    def __str__(self) -> str:
        times = f" (x{self.count})" if self.count > 1 else ""
        return f"{self.type} {self.reason}: {self.message}{times}"


#: The reasons kubelet gives a container whose image it failed to pull and will try again
#: (``ErrImagePull``, then ``ImagePullBackOff`` between tries; kubernetes pkg/kubelet/images/types.go).
PULL_RETRYING = frozenset({"ErrImagePull", "ImagePullBackOff"})


def image_never_pulls(pod: Pod, events: Sequence[Event]) -> str | None:
    """Why waiting cannot start ``pod``'s image, or ``None`` while it may still come.

    kubelet tries a failed pull again for as long as the pod lives, backing off up to 5 minutes, which is right for
    a registry that is slow, throttled or briefly unreachable; but a name the registry does not know never pulls. Its
    ``Warning Failed`` event says which: ``Failed to pull image "IMAGE": ERROR`` (kubelet's image manager), where
    containerd's ERROR for a reference the registry does not have is ``rpc error: code = NotFound desc = failed to
    pull and unpack image ...: not found`` (the gRPC status of its not-found error). ``InvalidImageName`` (a
    reference kubelet cannot parse) never pulls either.
    """
    if pod.waiting_reason == "InvalidImageName":
        return "its image name cannot be parsed (InvalidImageName)"
    if pod.waiting_reason not in PULL_RETRYING:
        return None
    for e in events:
        if e.type == "Warning" and e.message.startswith("Failed to pull image") and "code = NotFound" in e.message:
            return f"the registry has no such image ({e.message})"
    return None


@dataclass(frozen=True)
class DaemonSet:
    """A DaemonSet: how many pods it should run, how many are Ready, and the labels that select its pods."""

    name: str
    namespace: str
    desired: int
    ready: int
    pod_selector: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecResult:
    """What a command run inside a container returned: exit status and output."""

    returncode: int
    stdout: str
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class KubeApi(Protocol):
    """Every Kubernetes call of the deploy steps. Selectors are equality label selectors as dicts."""

    def nodes(self, selector: Mapping[str, str] | None = None) -> list[Node]: ...

    def pods(self, namespace: str, selector: Mapping[str, str] | None = None) -> list[Pod]: ...

    def pod_events(self, namespace: str, name: str) -> list[Event]: ...

    def daemon_sets(self, namespace: str | None, selector: Mapping[str, str] | None = None) -> list[DaemonSet]:
        """The DaemonSets of ``namespace`` (``None``: of every namespace) that ``selector`` selects."""
        ...

    def apply(self, obj: Mapping[str, object]) -> None:
        """Create or update ``obj`` (server-side apply): applying the same dict twice changes nothing."""
        ...

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object as a dict, or ``None`` when it does not exist."""
        ...

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete the object in the foreground; ``False`` when there was nothing to delete. It returns once the
        deletion is accepted: the object stays, readable with ``metadata.deletionTimestamp`` set, until its
        dependents (a DaemonSet's pods) are gone; a caller that must see it gone waits for that
        (:func:`raytrain_eks.k8s.addons.settled_workload`)."""
        ...

    def merge_patch(
        self, api_version: str, kind: str, name: str, namespace: str | None, patch: Mapping[str, object]
    ) -> bool:
        """Change the object by a JSON merge patch (RFC 7386: a ``None`` value removes that key, whoever set it);
        ``False`` when there was no such object."""
        ...

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
        """Run ``argv`` (a list, never a shell string) in the pod's container; ``on_output`` gets stdout lines as
        they arrive. A non-zero exit is returned, not raised."""
        ...


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}


def quantity(value: str | None) -> float:
    """A Kubernetes quantity as a number (CPU in cores, memory in bytes, devices as counts): ``"47"`` -> 47.0,
    ``"3920m"`` -> 3.92, ``"185Gi"`` -> 198642237440.0; absent or unreadable -> 0."""
    text = (value or "").strip()
    suffix = next((s for s in sorted(_UNITS, key=len, reverse=True) if text.endswith(s)), "")
    try:
        return float(text[: len(text) - len(suffix)]) * _UNITS.get(suffix, 1) if text else 0.0
    except ValueError:
        return 0.0


def selector_string(selector: Mapping[str, str] | None) -> str | None:
    """``{"a": "1", "b": "2"}`` -> ``"a=1,b=2"`` (``None`` for no selector)."""
    return ",".join(f"{k}={v}" for k, v in selector.items()) if selector else None


def matches(labels: Mapping[str, str], selector: Mapping[str, str] | None) -> bool:
    """Whether ``labels`` satisfy an equality selector."""
    return all(labels.get(k) == v for k, v in (selector or {}).items())


class KubeApiError(UserError):
    """The Kubernetes API refused a call or could not be reached."""


class KubernetesApi:
    """:class:`KubeApi` over the official ``kubernetes`` client; the kubeconfig is read on the first call, so
    building one before the cluster exists is fine. ``kubeconfig=None`` uses ``~/.kube/config``."""

    def __init__(self, kubeconfig: str | Path | None = None, *, context: str | None = None) -> None:
        self._kubeconfig = str(kubeconfig) if kubeconfig is not None else None
        self._context = context
        self._client: ApiClient | None = None
        self._dynamic: DynamicClient | None = None

    # -- connection ------------------------------------------------------------------------------------------------

    def _api(self) -> ApiClient:
        if self._client is None:
            try:
                from kubernetes import client, config
            except ImportError:
                raise UserError(
                    "the `kubernetes` Python package is not installed", hint=KUBERNETES_INSTALL_HINT
                ) from None
            try:
                api_client = config.new_client_from_config(config_file=self._kubeconfig, context=self._context)
            except Exception as exc:  # ConfigException, missing file, bad YAML: all mean "no usable kubeconfig"
                where = self._kubeconfig or "~/.kube/config"
                raise KubeApiError(
                    f"cannot load the kubeconfig {where}: {exc}",
                    hint="Run `raytrain-eks up` (it writes the kubeconfig), or `raytrain-eks status` to see the state.",
                ) from None
            self._client = api_client
            self._core = client.CoreV1Api(api_client)
            self._apps = client.AppsV1Api(api_client)
        return self._client

    def _dyn(self) -> DynamicClient:
        if self._dynamic is None:
            from kubernetes.dynamic import DynamicClient

            self._dynamic = DynamicClient(self._api())
        return self._dynamic

    def _call(self, what: str, fn: Callable[[], Any], *, redact: Sequence[str] = ()) -> Any:
        """``fn()``; a refusal (with the server's message, each of ``redact`` blanked out) or an unreachable
        server becomes one :class:`KubeApiError` naming ``what``."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn()
        except ApiException as exc:
            message = _api_message(exc)
            for value in redact:
                message = message.replace(value, "<redacted>")
            raise KubeApiError(f"Kubernetes API: {what} failed: {exc.status} {exc.reason}: {message}") from None
        except HTTPError as exc:  # refused, DNS, TLS, timeout: urllib3 has given up
            host = self._client.configuration.host if self._client is not None else "the cluster"
            raise KubeApiError(
                f"Kubernetes API: {what} failed: cannot reach {host}: {getattr(exc, 'reason', None) or exc}",
                hint="Is the cluster up? `raytrain-eks up` creates it and writes the kubeconfig; check that this "
                "machine can reach its endpoint (VPN, proxy).",
            ) from None

    # -- reads -----------------------------------------------------------------------------------------------------

    def nodes(self, selector: Mapping[str, str] | None = None) -> list[Node]:
        self._api()
        items = self._call(
            "list nodes", lambda: self._core.list_node(label_selector=selector_string(selector) or "").items
        )
        out = []
        for n in items:
            conditions = n.status.conditions or []
            ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
            out.append(
                Node(
                    name=n.metadata.name,
                    labels=dict(n.metadata.labels or {}),
                    allocatable=dict(n.status.allocatable or {}),
                    ready=ready,
                )
            )
        return out

    def pods(self, namespace: str, selector: Mapping[str, str] | None = None) -> list[Pod]:
        self._api()
        items = self._call(
            f"list pods in {namespace}",
            lambda: self._core.list_namespaced_pod(namespace, label_selector=selector_string(selector) or "").items,
        )
        out = []
        for p in items:
            statuses = p.status.container_statuses or []
            waiting = next((s.state.waiting.reason for s in statuses if s.state and s.state.waiting), None)
            done = next((s.state.terminated for s in statuses if s.state and s.state.terminated), None)
            ended = None if done is None else f"exited with status {done.exit_code} ({done.reason or 'no reason'})"
            conditions = p.status.conditions or []
            out.append(
                Pod(
                    name=p.metadata.name,
                    namespace=namespace,
                    phase=p.status.phase or "Unknown",
                    labels=dict(p.metadata.labels or {}),
                    node_name=p.spec.node_name,
                    ready=any(c.type == "Ready" and c.status == "True" for c in conditions),
                    waiting_reason=waiting,
                    ended=ended,
                    ip=p.status.pod_ip,
                )
            )
        return out

    def pod_events(self, namespace: str, name: str) -> list[Event]:
        self._api()
        selector = f"involvedObject.kind=Pod,involvedObject.name={name}"
        items = self._call(
            f"list events of pod {namespace}/{name}",
            lambda: self._core.list_namespaced_event(namespace, field_selector=selector).items,
        )
        return [Event(e.type or "", e.reason or "", e.message or "", e.count or 1) for e in items]

    def daemon_sets(self, namespace: str | None, selector: Mapping[str, str] | None = None) -> list[DaemonSet]:
        self._api()
        labels = selector_string(selector) or ""
        items = self._call(
            f"list DaemonSets in {namespace or 'every namespace'}",
            lambda: (
                self._apps.list_namespaced_daemon_set(namespace, label_selector=labels).items
                if namespace is not None
                else self._apps.list_daemon_set_for_all_namespaces(label_selector=labels).items
            ),
        )
        return [
            DaemonSet(
                name=d.metadata.name,
                namespace=str(d.metadata.namespace or namespace),
                desired=d.status.desired_number_scheduled or 0,
                ready=d.status.number_ready or 0,
                pod_selector=dict(d.spec.selector.match_labels or {}),
                labels=dict(d.metadata.labels or {}),
            )
            for d in items
        ]

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

        def read() -> dict[str, Any] | None:
            try:
                resource = self._dyn().resources.get(api_version=api_version, kind=kind)
                return resource.get(name=name, namespace=namespace).to_dict()
            except (NotFoundError, ResourceNotFoundError):
                return None

        return self._call(f"get {kind} {name}", read)

    # -- writes ----------------------------------------------------------------------------------------------------

    def apply(self, obj: Mapping[str, Any]) -> None:
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        meta = obj.get("metadata", {})
        what = f"apply {obj['kind']} {meta.get('name')}"
        try:
            # Discovery is the dynamic client's first request: a rejected token or a dead endpoint shows here.
            resource = self._call(
                what, lambda: self._dyn().resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            )
        except ResourceNotFoundError:
            raise KubeApiError(
                f"the cluster does not know {obj['kind']} ({obj['apiVersion']})",
                hint="Its CRD is missing: run `raytrain-eks up` to install the KubeRay operator.",
            ) from None
        # Never echo the body: a Secret's value must not reach a log, not even quoted back by the server.
        self._call(
            what,
            lambda: resource.server_side_apply(
                body=dict(obj), namespace=meta.get("namespace"), field_manager="raytrain-eks", force_conflicts=True
            ),
            redact=_secret_values(obj),
        )

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

        def remove() -> bool:
            try:
                resource = self._dyn().resources.get(api_version=api_version, kind=kind)
                resource.delete(name=name, namespace=namespace, body={"propagationPolicy": "Foreground"})
                return True
            except (NotFoundError, ResourceNotFoundError):
                return False

        return self._call(f"delete {kind} {name}", remove)

    def merge_patch(
        self, api_version: str, kind: str, name: str, namespace: str | None, patch: Mapping[str, Any]
    ) -> bool:
        from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

        def change() -> bool:
            try:
                resource = self._dyn().resources.get(api_version=api_version, kind=kind)
                resource.patch(
                    body=dict(patch), name=name, namespace=namespace, content_type="application/merge-patch+json"
                )
                return True
            except (NotFoundError, ResourceNotFoundError):
                return False

        return self._call(f"patch {kind} {name}", change)

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
        from kubernetes.client.exceptions import ApiException
        from kubernetes.stream import stream
        from websocket import WebSocketException

        self._api()
        kwargs: dict[str, object] = {"container": container} if container else {}
        try:
            ws = stream(
                self._core.connect_get_namespaced_pod_exec,
                pod,
                namespace,
                command=list(argv),
                stdin=stdin is not None,
                stdout=True,
                stderr=True,
                tty=False,
                _preload_content=False,
                **kwargs,
            )
        except ApiException as exc:
            raise KubeApiError(f"Kubernetes API: exec in {namespace}/{pod} failed: {exc.status} {exc.reason}") from None
        out: list[str] = []
        err: list[str] = []
        partial = ""
        deadline = time.monotonic() + timeout
        try:
            if stdin is not None:
                ws.write_stdin(stdin)
                ws.close_channel(0)  # EOF on stdin (protocol v5; older servers end stdin when the command does)
            while ws.is_open():
                if time.monotonic() > deadline:
                    return ExecResult(124, "".join(out), "".join(err) + f"\nstopped after {timeout:.0f} s")
                ws.update(timeout=1)
                if ws.peek_stdout():
                    chunk = ws.read_stdout()
                    out.append(chunk)
                    if on_output is not None:
                        partial += chunk
                        *lines, partial = partial.split("\n")
                        for line in lines:
                            on_output(line)
                if ws.peek_stderr():
                    err.append(ws.read_stderr())
            if on_output is not None and partial:
                on_output(partial)
            code = _exec_returncode(ws.read_channel(3))
        except (WebSocketException, OSError) as exc:  # the stream broke: a dropped connection, a reset
            raise KubeApiError(
                f"Kubernetes API: exec in {namespace}/{pod} failed: the connection broke ({type(exc).__name__}: {exc})",
                hint="Run the same raytrain-eks command again; `raytrain-eks submit` follows a job that is still "
                "running instead of submitting it twice.",
            ) from None
        finally:
            ws.close()
        return ExecResult(code, "".join(out), "".join(err))


def _exec_returncode(status_json: str) -> int:
    """The exit status from the exec error channel (a ``v1.Status``); 0 on ``Success``."""
    if not status_json:
        return 0
    try:
        status = json.loads(status_json)
    except ValueError:
        return 1
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            try:
                return int(cause.get("message", "1"))
            except ValueError:
                return 1
    # "executable file not found" and similar: the command never ran, as a shell would say.
    return 127 if re.search(r"not found|no such file", status.get("message", ""), re.I) else 1


def _secret_values(obj: Mapping[str, Any]) -> list[str]:
    """The values of a Secret (``data`` and ``stringData``), to blank out of any message; none for other kinds."""
    if obj.get("kind") != "Secret":
        return []
    values = [*(obj.get("data") or {}).values(), *(obj.get("stringData") or {}).values()]
    return [v for v in values if isinstance(v, str) and v]


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "").get("message", ""))
    except (TypeError, ValueError, AttributeError):
        return ""
