"""The cluster's add-ons, installed with helm, and the proof that they work, on any target.

The NVIDIA and EFA device plugins and the KubeRay operator are pinned Helm releases. helm's exit status is not taken
as proof: the plugins' DaemonSets must be Ready on every GPU node, and every GPU node must advertise
``nvidia.com/gpu`` (and ``vpc.amazonaws.com/efa`` where the worker pods request it); KubeRay's operator must run and
its RayCluster CRD exist. What a target expects of its GPU nodes is one :class:`GpuNodeSpec`.

Nor is a release's status taken as proof that its objects are there: eksctl applies its own EFA plugin DaemonSet,
``aws-efa-k8s-device-plugin`` in kube-system, whenever it creates an EFA node group, under the very name the EFA
chart gives its DaemonSet, and over the chart's copy when there is one. So eksctl's copy is deleted whenever it
lacks Helm's ownership metadata for the release (Helm refuses to install over it), and a chart whose workload is
missing or not its own is installed again even when Helm says the release is deployed. The helm commands work
with Helm 3 (3.13 and later) and Helm 4 alike.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.cluster import DaemonSet, KubeApiError, Node, quantity
from raytrain_eks.k8s.manifests import to_yaml
from raytrain_eks.k8s.placement import placement_for
from raytrain_eks.k8s.runner import QUICK_TIMEOUT_S, CommandError, Completed
from raytrain_eks.k8s.state import Deployment, Item

HELM_TIMEOUT_S = 15 * 60
GPU_READY_TIMEOUT_S = 15 * 60
# How long a chart's workload that is being deleted may take to go before the chart is installed in its place:
# KubeApi.delete deletes in the foreground, so the object stays (with a deletionTimestamp) until the garbage
# collector has deleted its pods, each within its termination grace period (30 s unless the pod says otherwise).
WORKLOAD_GONE_TIMEOUT_S = 5 * 60

DEVICE_PLUGIN_RELEASES = ("nvidia-device-plugin", "aws-efa-k8s-device-plugin")
KUBERAY_RELEASE = "kuberay-operator"
RAYCLUSTER_CRD = "rayclusters.ray.io"

# The metadata by which Helm knows an object as a release's own, and refuses to take over one that lacks it
# ("... exists and cannot be imported into the current release: invalid ownership metadata"): helm/helm
# pkg/action/validate.go (checkOwnership), v3.17.3 and v4.1.4.
HELM_MANAGED_BY = ("app.kubernetes.io/managed-by", "Helm")
HELM_RELEASE_NAME = "meta.helm.sh/release-name"
HELM_RELEASE_NAMESPACE = "meta.helm.sh/release-namespace"
# What Helm 3 and 4 print when a release does not exist (pkg/storage/driver/driver.go, ErrReleaseNotFound).
RELEASE_NOT_FOUND = "release: not found"


@dataclass(frozen=True)
class HelmRelease:
    """One pinned Helm chart: installed with ``helm upgrade --install`` (idempotent) from its repository URL."""

    name: str
    namespace: str
    repo_name: str
    repo_url: str
    chart: str
    version: str
    values: dict[str, Any]
    purpose: str
    # The chart's object that does the work, (kind, name) in ``namespace`` (apps/v1): what the checks look for, and
    # what must carry the release's ownership metadata for the release to count as installed.
    workload: tuple[str, str]

    @property
    def values_file(self) -> str:
        return f"helm/{self.name}.values.yaml"

    def argv(self) -> list[str]:
        return [
            "helm",
            "upgrade",
            "--install",
            self.name,
            self.chart,
            "--repo",
            self.repo_url,
            "--version",
            self.version,
            "--namespace",
            self.namespace,
            "--create-namespace",
            "--values",
            self.values_file,
            "--wait",
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "repo": {"name": self.repo_name, "url": self.repo_url},
            "chart": f"{self.repo_name}/{self.chart}",
            "version": self.version,
            "purpose": self.purpose,
            "values": self.values,
        }


def helm_releases(cfg: Config) -> list[HelmRelease]:
    """The three pinned charts (docs/reference/infra-facts.md §1), device plugins first so GPUs and EFA exist before
    any Ray pod.

    On EKS the values fit the node groups this tool makes. On another target the plugins go to the nodes of
    ``cluster.gpu_node_selector`` (tolerating the worker pods' tolerations) and the operator to those of
    ``cluster.head_node_selector``; the NVIDIA chart's own affinity (labels that node feature discovery sets) is
    replaced by that selector, which every cluster can give.
    """
    return _releases(cfg, **placement_for(cfg).chart_values(cfg))


def node_words(selector: dict[str, str]) -> str:
    """Where a pod whose node selector is ``selector`` runs, in words. Example: ``{"role": "system"}`` (the EKS
    system node group's labels) -> ``on the system node``; ``{}`` -> ``on any node that takes it``."""
    if selector == m.SYSTEM_NODE_LABELS:
        return "on the system node"
    if selector:
        return "on a node labelled " + ", ".join(f"{key}={value}" for key, value in selector.items())
    return "on any node that takes it"


def _releases(
    cfg: Config, *, nvidia: dict[str, Any], efa: dict[str, Any], kuberay: dict[str, Any]
) -> list[HelmRelease]:
    a = cfg.addons
    return [
        HelmRelease(
            name="nvidia-device-plugin",
            namespace="kube-system",
            repo_name="nvdp",
            repo_url="https://nvidia.github.io/k8s-device-plugin",
            chart="nvidia-device-plugin",
            version=a.nvidia_device_plugin_version,
            values=nvidia,
            purpose="advertises nvidia.com/gpu on the GPU nodes",
            # The chart also renders nvidia-device-plugin-mps-control-daemon, which runs only on nodes labelled
            # nvidia.com/mps.capable=true: not on these, and not checked.
            workload=("DaemonSet", "nvidia-device-plugin"),
        ),
        HelmRelease(
            name="aws-efa-k8s-device-plugin",
            namespace="kube-system",
            repo_name="eks",
            repo_url="https://aws.github.io/eks-charts",
            chart="aws-efa-k8s-device-plugin",
            version=a.efa_device_plugin_version,
            values=efa,
            purpose="advertises vpc.amazonaws.com/efa on the GPU nodes",
            # The same name as the DaemonSet eksctl applies by itself (remove_eksctl_device_plugins).
            workload=("DaemonSet", "aws-efa-k8s-device-plugin"),
        ),
        HelmRelease(
            name="kuberay-operator",
            namespace="kuberay-system",
            repo_name="kuberay",
            repo_url="https://ray-project.github.io/kuberay-helm/",
            chart="kuberay-operator",
            version=a.kuberay_version,
            values=kuberay,
            purpose="installs the RayCluster/RayJob CRDs and runs the operator "
            + node_words(kuberay.get("nodeSelector") or {}),
            workload=("Deployment", "kuberay-operator"),
        ),
    ]


def helm_item(rel: HelmRelease) -> Item:
    return {"type": "helm", "name": rel.name, "namespace": rel.namespace}


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
            hint="Run `raytrain-eks up` again: it installs the device plugins the nodes lack and waits until every "
            "GPU node advertises what the worker pods request. `raytrain-eks status` shows the nodes.",
        )


# ----------------------------------------------------------------------------------------------------------------
# Add-ons (helm) and the proof that they work
# ----------------------------------------------------------------------------------------------------------------


def helm(d: Deployment, argv: list[str], **kwargs: Any) -> Completed:
    return d.run([*argv, *d.kube_flags("--kube-context")], **kwargs)


def shown(d: Deployment, *argv: str) -> str:
    """A helm or kubectl command for the user to run, on this deployment's cluster (its kubeconfig named)."""
    context = "--kube-context" if argv[0] == "helm" else "--context"
    return shlex.join([argv[0], *d.kube_flags(context), *argv[1:]])


def release_info_argv(name: str, namespace: str) -> list[str]:
    """``helm get metadata``: the one command of Helm 3 (3.13 and later) and Helm 4 alike whose JSON holds a release's
    status and chart version. (``helm list --all`` is gone in Helm 4; ``helm status`` leaves the chart out.)"""
    return ["helm", "get", "metadata", name, "--namespace", namespace, "--output", "json"]


def release_info(d: Deployment, name: str, namespace: str) -> dict[str, Any] | None:
    """The release's metadata (``status``, ``chart``, ``version`` = the chart's version, ``revision``), or ``None``
    when there is no such release. Only Helm's "release: not found" means that; any other failure (the cluster
    unreachable, a refused token) raises :class:`~raytrain_eks.k8s.runner.CommandError`."""
    done = helm(d, release_info_argv(name, namespace), timeout=QUICK_TIMEOUT_S, check=False)
    if done.returncode != 0:
        if RELEASE_NOT_FOUND in done.stderr:
            return None
        hint = "Fix the problem above, then run the same command again."
        # A Helm before 3.13 has no `helm get metadata`: its `helm get` then refuses the flags ("Error: unknown flag:
        # --output", as Helm 3.17 answers `helm get` of a subcommand it does not have).
        if "unknown flag" in done.stderr or "unknown command" in done.stderr:
            hint = "Install Helm 3.13 or later, or Helm 4 (`helm version` shows yours), then run the command again."
        raise CommandError(done.argv, done.returncode, done.stderr, hint=hint)
    try:
        info = json.loads(done.stdout)
    except ValueError:
        info = None
    if not isinstance(info, dict) or not isinstance(info.get("status"), str):
        raise CommandError(
            done.argv, 0, f"printed no release metadata as JSON: {done.stdout[:200]!r}", hint="Check helm's version."
        )
    return info


def owned_by(obj: dict[str, Any] | None, rel: HelmRelease) -> bool:
    """Whether ``obj`` carries the ownership metadata Helm looks for before it takes an object into ``rel``."""
    meta = (obj or {}).get("metadata") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    key, value = HELM_MANAGED_BY
    return (
        labels.get(key) == value
        and annotations.get(HELM_RELEASE_NAME) == rel.name
        and annotations.get(HELM_RELEASE_NAMESPACE) == rel.namespace
    )


def workload_of(d: Deployment, rel: HelmRelease) -> dict[str, Any] | None:
    kind, name = rel.workload
    return d.kube.get("apps/v1", kind, name, rel.namespace)


def settled_workload(
    d: Deployment, rel: HelmRelease, timeout: float = WORKLOAD_GONE_TIMEOUT_S
) -> dict[str, Any] | None:
    """The release's workload (:func:`workload_of`) once it is not being deleted: while it has a
    ``deletionTimestamp`` (eksctl's plugin DaemonSet just deleted in the foreground, its pods still terminating),
    wait until it is gone. Helm refuses to install over an object it does not own, and what it would apply to one
    being deleted goes with it. Raises :class:`UserError` naming the object when it is still there after
    ``timeout`` seconds. Example: ``settled_workload(d, efa_release) is None`` right after eksctl's copy is gone."""
    kind, name = rel.workload
    where = f"{kind} {rel.namespace}/{name}"

    def probe() -> tuple[tuple[dict[str, Any] | None] | None, str]:
        found = workload_of(d, rel)
        meta = (found or {}).get("metadata") or {}
        if not meta.get("deletionTimestamp"):
            return (found,), "not being deleted"
        finalizers = ", ".join(meta.get("finalizers") or []) or "none"
        return None, f"being deleted since {meta['deletionTimestamp']} (finalizers: {finalizers})"

    (found,) = d.wait(
        probe,
        what=f"{where} to be deleted",
        timeout=timeout,
        on_timeout=lambda last, waited: UserError(
            f"{where} is still there after {waited:.0f} s, {last}: the chart {rel.chart} cannot be installed in "
            "its place until it is gone",
            hint=f"`{shown(d, 'kubectl', '-n', rel.namespace, 'get', 'pods', '-o', 'wide')}` shows the pods its "
            "deletion waits for (a node that stopped answering keeps its pods until the node is removed); once "
            f"`{shown(d, 'kubectl', '-n', rel.namespace, 'get', kind.lower(), name)}` finds nothing, run "
            "`raytrain-eks up` again.",
        ),
    )
    return found


def install_argv(rel: HelmRelease, values: str, kubeconfig: str, context: str | None = None) -> list[str]:
    """``helm upgrade --install`` of ``rel`` with its values file at ``values``: what ``up`` runs and ``up --plan``
    shows. helm's own wait stops before the runner's ``HELM_TIMEOUT_S``, so its message is the one seen."""
    argv = [values if a == rel.values_file else a for a in rel.argv()]
    return [*argv, "--timeout", "10m", "--kubeconfig", kubeconfig, *(["--kube-context", context] if context else [])]


def ensure_release(d: Deployment, rel: HelmRelease) -> None:
    """Install or upgrade one pinned chart, unless that exact chart version is deployed and its workload (a
    DaemonSet or Deployment) is there as the release's own: eksctl replaces the EFA chart's DaemonSet with its own
    whenever it creates an EFA node group, and the release's status does not show that."""
    info = release_info(d, rel.name, rel.namespace)
    workload = settled_workload(d, rel)  # before helm: an object being deleted is neither installed nor replaceable
    if info and info.get("status") == "deployed" and info.get("version") == rel.version:
        kind, name = rel.workload
        if owned_by(workload, rel):
            d.say(f"Helm release {rel.name} ({rel.chart} {rel.version}) is installed")
            return
        d.say(
            f"Helm release {rel.name} is deployed but its {kind} {rel.namespace}/{name} is "
            + ("missing" if workload is None else "not the release's own")
            + " (eksctl applies its own when it creates a node group); installing the chart again"
        )
    values = d.state.write_file(rel.values_file, to_yaml([rel.values]))
    d.state.record(helm_item(rel))
    d.say(f"Installing {rel.repo_name}/{rel.chart} {rel.version} ({rel.purpose})")
    d.run(
        install_argv(rel, str(values), d.kubeconfig, d.context),
        timeout=HELM_TIMEOUT_S,
        hint=f"Run `raytrain-eks up` again; `{shown(d, 'helm', 'status', rel.name, '-n', rel.namespace)}` shows the "
        "release.",
    )


@dataclass(frozen=True)
class GpuNodeSpec:
    """What the worker pods need of the GPU nodes, as a target knows it: the nodes' labels, how many, the GPUs and
    EFA interfaces each pod requests, one zone (EFA cannot cross zones; ``None``: not checked), the device-plugin
    releases whose DaemonSets must be Ready on every node (those the target installs), whether the NVIDIA chart's
    ``nvidia.com/gpu.present`` label is needed, and where to look when nodes are missing."""

    selector: dict[str, str]
    count: int
    gpus: int
    efa: int
    zone: str | None = None
    plugins: tuple[str, ...] = DEVICE_PLUGIN_RELEASES
    needs_present_label: bool = True
    missing_hint: str = ""

    @property
    def wants(self) -> str:
        return m.GPU_RESOURCE + (f" and {m.EFA_RESOURCE}" if self.efa else "")


# ----------------------------------------------------------------------------------------------------------------
# The device plugins a cluster already runs, and whether their pods would run on given nodes
# ----------------------------------------------------------------------------------------------------------------

# Each plugin release's kind of plugin, known by its first container's image (the last part of its repository name)
# and the command that is the plugin (None: any). NVIDIA's chart, the GPU operator and eksctl's static manifest all
# run nvcr.io/nvidia/k8s-device-plugin; the same image's mps-control-daemon (the chart's MPS DaemonSet) is no plugin.
PLUGIN_IMAGES: dict[str, tuple[str, str | None]] = {
    "nvidia-device-plugin": ("k8s-device-plugin", "nvidia-device-plugin"),
    "aws-efa-k8s-device-plugin": ("aws-efa-k8s-device-plugin", None),
}
# Where the plugins are installed: kube-system (eksctl, AWS's EFA docs, this tool), the namespace of NVIDIA's chart
# README (`helm upgrade -i nvdp ... --namespace nvidia-device-plugin`) and the GPU operator's.
PLUGIN_NAMESPACES = ("kube-system", "nvidia-device-plugin", "gpu-operator")


@dataclass(frozen=True)
class RunningPlugin:
    """A device-plugin DaemonSet found in the cluster: which plugin release it stands for, where, its pod spec."""

    release: str
    namespace: str
    name: str
    pod_spec: dict[str, Any]

    @property
    def where(self) -> str:
        return f"DaemonSet {self.namespace}/{self.name}"


def plugin_kind(pod_spec: dict[str, Any]) -> str | None:
    """The plugin release (of :data:`DEVICE_PLUGIN_RELEASES`) a pod template's first container is, or ``None``."""
    container = (pod_spec.get("containers") or [{}])[0]
    image = str(container.get("image", "")).rsplit("/", 1)[-1].split(":", 1)[0]
    for release, (name, command) in PLUGIN_IMAGES.items():
        given = container.get("command") or []
        if image == name and (command is None or not given or given[0] == command):
            return release
    return None


def _all_daemon_sets(d: Deployment) -> list[DaemonSet]:
    """Every DaemonSet of the cluster (a device plugin may run in any namespace: the GPU operator's own, a chart's
    release namespace); those of :data:`PLUGIN_NAMESPACES` alone when listing across namespaces is refused
    (a kubeconfig with rights in some namespaces only)."""
    try:
        return d.kube.daemon_sets(None)
    except KubeApiError:
        return [ds for ns in PLUGIN_NAMESPACES for ds in d.kube.daemon_sets(ns)]


def running_plugins(d: Deployment, ignore: Collection[tuple[str, str]] = ()) -> dict[str, list[RunningPlugin]]:
    """The device-plugin DaemonSets of the cluster, by plugin release, known by their image (:func:`plugin_kind`)
    in whatever namespace they run; ``ignore``: (namespace, name) of DaemonSets that are this tool's own."""
    found: dict[str, list[RunningPlugin]] = {}
    for ds in _all_daemon_sets(d):
        ns = ds.namespace
        if (ns, ds.name) in ignore:
            continue
        obj = d.kube.get("apps/v1", "DaemonSet", ds.name, ns) or {}
        spec = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
        kind = plugin_kind(spec)
        if kind is not None:
            found.setdefault(kind, []).append(RunningPlugin(kind, ns, ds.name, spec))
    return found


def _expression_holds(labels: dict[str, str], expr: dict[str, Any]) -> bool:
    key, op, values = expr.get("key", ""), expr.get("operator"), [str(v) for v in expr.get("values") or []]
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt") and labels.get(key, "").isdigit() and values and values[0].lstrip("-").isdigit():
        return int(labels[key]) > int(values[0]) if op == "Gt" else int(labels[key]) < int(values[0])
    return False


def _tolerates(toleration: Mapping[str, object], taint: Mapping[str, object]) -> bool:
    """Kubernetes' Toleration.ToleratesTaint (k8s.io/api/core/v1/toleration.go): the effect and key, when given,
    must match; ``Exists`` tolerates any value, ``Equal`` (the default) only the taint's."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator") == "Exists":
        return True
    return bool(toleration.get("key")) and str(toleration.get("value", "")) == str(taint.get("value", ""))


def placement_refusal(
    pod_spec: dict[str, Any], labels: dict[str, str], taints: Sequence[Mapping[str, object]]
) -> str | None:
    """Why a pod of ``pod_spec`` could not run on a node with these labels and taints (its ``nodeSelector``, its
    required node affinity, a ``NoSchedule``/``NoExecute`` taint it does not tolerate), as the scheduler says it;
    ``None``: it could. Labels not given are taken as absent."""
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms")
    selector = pod_spec.get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()) or (
        terms is not None
        and not any(all(_expression_holds(labels, e) for e in t.get("matchExpressions") or []) for t in terms)
    ):
        return "it does not select them (nodeSelector or required node affinity)"
    for taint in taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(
            _tolerates(t, taint) for t in pod_spec.get("tolerations") or []
        ):
            return f"it does not tolerate their taint {taint['key']}={taint.get('value', '')}:{taint['effect']}"
    return None


def _count(value: str | None) -> int:
    return int(quantity(value))


def gpu_nodes(d: Deployment, spec: GpuNodeSpec) -> list[Node]:
    """The nodes of ``spec.selector``; with no selector, those that advertise ``nvidia.com/gpu``."""
    nodes = d.kube.nodes(spec.selector or None)
    if not spec.selector:
        nodes = [n for n in nodes if _count(n.allocatable.get(m.GPU_RESOURCE))]
    return nodes


def gpu_node_problems(d: Deployment, spec: GpuNodeSpec) -> tuple[list[Node], list[str]]:
    """The GPU nodes, and everything that keeps a worker pod from running on them, each with its fix.

    Checked: the number of nodes, Ready, the ``nvidia.com/gpu.present`` label (when the NVIDIA chart's affinity
    needs it), one zone, allocatable ``nvidia.com/gpu`` and ``vpc.amazonaws.com/efa`` at least what a worker pod
    requests, and a Ready pod of each of ``spec.plugins``' DaemonSets on every GPU node. Empty problems: the nodes
    are ready for the workers.
    """
    nodes = gpu_nodes(d, spec)
    problems: list[str] = []
    if len(nodes) < spec.count:
        labels = ",".join(f"{k}={v}" for k, v in spec.selector.items()) or f"advertising {m.GPU_RESOURCE}"
        problems.append(f"{len(nodes)} of {spec.count} GPU nodes ({labels}) are in the cluster; {spec.missing_hint}")
    for node in nodes:
        if not node.ready:
            problems.append(
                f"node {node.name} is not Ready; `{shown(d, 'kubectl', 'describe', 'node', node.name)}` says why"
            )
        if spec.needs_present_label and node.labels.get("nvidia.com/gpu.present") != "true":
            problems.append(
                f"node {node.name} lacks the label nvidia.com/gpu.present=true, so the NVIDIA device plugin does not "
                f"run there; fix: `{shown(d, 'kubectl', 'label', 'node', node.name, 'nvidia.com/gpu.present=true')}`"
            )
        if spec.zone and node.zone and node.zone != spec.zone:
            problems.append(f"node {node.name} is in {node.zone}, not {spec.zone}: EFA traffic cannot cross zones")
        have_gpu = _count(node.allocatable.get(m.GPU_RESOURCE))
        if have_gpu < spec.gpus:
            problems.append(
                f"node {node.name} advertises {m.GPU_RESOURCE}={have_gpu}, a worker pod needs {spec.gpus}: the NVIDIA "
                "device plugin is not running there (fix: `raytrain-eks up` installs it)"
            )
        have_efa = _count(node.allocatable.get(m.EFA_RESOURCE))
        if have_efa < spec.efa:
            problems.append(
                f"node {node.name} advertises {m.EFA_RESOURCE}={have_efa}, a worker pod needs {spec.efa}: the EFA "
                "device plugin is not running there or the node has no EFA interface (fix: `raytrain-eks up` "
                "installs the plugin; an EKS node group needs efaEnabled: true)"
            )
    problems += _plugin_problems(d, nodes, spec.plugins)
    return nodes, problems


def gpu_node_lines(d: Deployment, spec: GpuNodeSpec) -> list[str]:
    """``status``'s lines for the GPU nodes: each node's GPUs, EFA and readiness, then every problem found."""
    nodes, problems = gpu_node_problems(d, spec)
    lines = [
        f"GPU node {n.name}{f' ({n.zone})' if n.zone else ''}: {m.GPU_RESOURCE}={n.allocatable.get(m.GPU_RESOURCE, 0)} "
        f"{m.EFA_RESOURCE}={n.allocatable.get(m.EFA_RESOURCE, 0)} {'Ready' if n.ready else 'NotReady'}"
        for n in nodes
    ]
    return lines + [f"  problem: {p}" for p in problems]


def delete_recorded(d: Deployment, item: Item) -> bool:
    """Delete a Helm release or an object the state file records, when it is still there (every target's ``down``);
    ``True`` when something was deleted."""
    if item["type"] == "object":
        return d.kube.delete(item["apiVersion"], item["kind"], item["name"], item.get("namespace"))
    namespace = item.get("namespace")
    if item["type"] == "helm" and namespace is not None:  # helm_item records every release with its namespace
        if release_info(d, item["name"], namespace) is None:
            return False
        helm(d, ["helm", "uninstall", item["name"], "--namespace", namespace, "--wait"], timeout=HELM_TIMEOUT_S)
        return True
    raise ValueError(f"not a Helm release or an object: {item}")


def _plugin_problems(d: Deployment, nodes: list[Node], plugins: Sequence[str]) -> list[str]:
    """The device-plugin DaemonSet of each of the ``plugins`` releases (found by the release's label, as the chart
    sets it) without a Ready pod on some GPU node."""
    problems = []
    for rel in [rel for rel in helm_releases(d.cfg) if rel.name in plugins]:
        name = rel.workload[1]
        sets = d.kube.daemon_sets(rel.namespace, {"app.kubernetes.io/instance": rel.name})
        ds = next((s for s in sets if s.name == name), None)
        if ds is None:
            problems.append(f"no DaemonSet {rel.namespace}/{name} of Helm release {rel.name} (fix: `raytrain-eks up`)")
            continue
        pods = d.kube.pods(rel.namespace, ds.pod_selector)
        for node in nodes:
            on_node = [p for p in pods if p.node_name == node.name]
            if not any(p.ready for p in on_node):
                state = ", ".join(f"{p.name} {p.waiting_reason or p.phase}" for p in on_node) or "no pod"
                problems.append(
                    f"DaemonSet {rel.namespace}/{ds.name} has no Ready pod on node {node.name} ({state}); "
                    f"`{shown(d, 'kubectl', '-n', rel.namespace, 'describe', 'daemonset', ds.name)}` says why"
                )
    return problems


def wait_gpu_nodes(d: Deployment, spec: GpuNodeSpec, timeout: float = GPU_READY_TIMEOUT_S) -> list[Node]:
    """Wait until :func:`gpu_node_problems` finds nothing; raise :class:`NodesNotReady` with every problem."""
    latest: list[str] = []

    def probe() -> tuple[list[Node] | None, str]:
        nodes, problems = gpu_node_problems(d, spec)
        if not problems:
            return nodes, "ready"
        latest[:] = problems
        return None, problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")

    nodes = d.wait(
        probe,
        what="the GPU nodes",
        timeout=timeout,
        on_timeout=lambda _, waited: NodesNotReady(latest, waited_s=waited),
    )
    plugins = ", device plugins Ready on every one" if spec.plugins else ""
    d.say(f"{len(nodes)} GPU nodes ready: each advertises {spec.wants}{plugins}")
    return nodes


def wait_kuberay(d: Deployment, timeout: float = GPU_READY_TIMEOUT_S) -> None:
    """Wait for the RayCluster CRD and a Ready KubeRay operator pod."""

    def probe() -> tuple[bool | None, str]:
        crd = d.kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", RAYCLUSTER_CRD)
        pods = d.kube.pods("kuberay-system", {"app.kubernetes.io/instance": KUBERAY_RELEASE})
        if crd is not None and any(p.ready for p in pods):
            return True, "Ready"
        state = ", ".join(f"{p.name} {p.waiting_reason or p.phase}" for p in pods) or "no operator pod"
        return None, f"CRD {'present' if crd else 'missing'}; {state}"

    d.wait(
        probe,
        what="the KubeRay operator",
        timeout=timeout,
        on_timeout=lambda last, waited: UserError(
            f"the KubeRay operator is not Ready after {timeout:.0f} s ({last})",
            hint=f"`{shown(d, 'kubectl', '-n', 'kuberay-system', 'describe', 'pods')}` says why; then run "
            "`raytrain-eks up` again.",
        ),
    )
    d.say("KubeRay operator is Ready")
