"""The ``kubernetes`` target: an existing cluster, reached through the user's kubeconfig, taken as it is.

``up`` looks first and changes only what is missing: it finds the GPU nodes (by ``cluster.gpu_node_selector``, or
every node that advertises ``nvidia.com/gpu``), reads what they advertise, and installs the pinned NVIDIA device
plugin only where the selected nodes advertise no GPU, the EFA plugin only where ``cluster.efa_per_node`` asks for
EFA the nodes do not advertise, and KubeRay only where the RayCluster CRD is missing; then the Ray pods' service
account (and namespace). It says all of it and asks once before installing anything, and it never creates a cloud
resource. What it finds (the GPU nodes' EFA, their worker pod size, their EC2 type when they carry a known one) is
recorded in the state file, and later commands configure the job from it (:func:`remembered`). Where EFA is
required, the worker pods are kept to one availability zone (``cluster.gpu_az``, else the one zone of the EFA-capable
GPU nodes; nodes in several zones without a choice are refused), and the GPU nodes' NVIDIA driver must be one the
image's CUDA runs on. ``down`` removes only what the state file records this tool created there (Helm releases and
objects), never the cluster. Example::

    d = Deployment(cfg, kube=KubernetesApi(path, context=ctx), run=runner.run, state=StateStore(".raytrain-eks"),
                   kubeconfig_file=path, context=ctx)
    up(d, confirm=lambda question: True)      # the plan, then the missing add-ons, proven to work
    down(d, confirm=lambda question: True)    # what up and submit created, newest first
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.instances import INSTANCE_TYPES, InstanceType
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import (
    DEVICE_PLUGIN_RELEASES,
    KUBERAY_RELEASE,
    RAYCLUSTER_CRD,
    GpuNodeSpec,
    HelmRelease,
    delete_recorded,
    ensure_release,
    gpu_node_lines,
    helm_releases,
    wait_gpu_nodes,
    wait_kuberay,
)
from raytrain_eks.k8s.cluster import KubeApi, Node, quantity
from raytrain_eks.k8s.cuda import IMAGE_CUDA, MIN_DRIVER, min_driver_text
from raytrain_eks.k8s.job import known_image_packages
from raytrain_eks.k8s.kuberay_fields import check_kuberay_fields
from raytrain_eks.k8s.raypods import check_shared_volume, cluster_words, ray_lines
from raytrain_eks.k8s.state import Cancelled, Deployment, StateStore, describe, object_item, with_shared_volume

TARGET = "kubernetes"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
# What NVIDIA's GPU feature discovery (part of the GPU operator) labels a GPU node with: each GPU's memory in MiB
# and its product name (NVIDIA/k8s-device-plugin, docs/gpu-feature-discovery/README.md, "Generated Labels").
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# The NVIDIA driver's major and minor version, as GPU feature discovery labels a node: the names it writes now, then
# the older ones it still writes beside them (NVIDIA/k8s-device-plugin, internal/lm/nvml.go, newVersionLabeler:
# nvidia.com/cuda.driver-version.major and .minor; "deprecated" nvidia.com/cuda.driver.major and .minor, same values).
DRIVER_LABELS = (
    ("nvidia.com/cuda.driver-version.major", "nvidia.com/cuda.driver-version.minor"),
    ("nvidia.com/cuda.driver.major", "nvidia.com/cuda.driver.minor"),
)
# Where a node is (kubelet's well-known label, set from the cloud provider): EFA traffic does not cross zones.
ZONE_LABEL = "topology.kubernetes.io/zone"
# A worker pod fills 5/6 of the smallest GPU node's allocatable CPU and memory: the rest is for the DaemonSets
# (device plugins, CNI, logging) that also run there. The same share as on EKS (instances.default_worker_pod_size).
POD_SHARE = (5, 6)
# The steps of each command here (:data:`raytrain_eks.k8s.programs.STEPS`): the Kubernetes API, no eksctl; helm only
# for what up installs, which up checks itself once it knows (and for down, the releases recorded).
COMMANDS: dict[str, tuple[str, ...]] = {
    "up": ("kubernetes",),
    "status": ("kubernetes",),
    "submit": ("kubernetes",),
    "compare-fabric": ("kubernetes",),
    "logs": ("kubernetes",),
    "down": (),  # DELETE_STEPS of what is recorded
}


def kubeconfig_path(cfg: Config, environ: dict[str, str] | None = None) -> str:
    """The kubeconfig the target uses, as kubectl picks it: ``cluster.kubeconfig``, else the first file of
    ``$KUBECONFIG``, else ``~/.kube/config``."""
    env = os.environ if environ is None else environ
    if cfg.cluster.kubeconfig:
        return str(Path(cfg.cluster.kubeconfig).expanduser())
    first = next((p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p), None)
    return str(Path(first).expanduser()) if first else str(Path("~/.kube/config").expanduser())


@dataclass
class Found:
    """What ``up`` found in the cluster, and what it will install there."""

    gpu_nodes: list[Node]
    gpus: int
    efa: int
    worker_cpu: int
    worker_memory_gib: int
    gpu_node_type: str | None
    gpu_mib: int | None = None  # from GPU feature discovery's labels, when every GPU node has them
    gpu_model: str | None = None
    zone: str | None = None  # the one zone the worker pods are kept to (EFA required); None: not kept to one
    install: list[HelmRelease] = field(default_factory=list)
    create: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what up could not check, said after what it found


def _min(nodes: list[Node], resource: str) -> float:
    return min(quantity(n.allocatable.get(resource)) for n in nodes)


def node_labels(cfg: Config) -> dict[str, str]:
    """The labels that single out the GPU nodes: the worker pods' node selector without its zone (which
    :func:`remembered` adds where EFA keeps the pods to one zone). Empty: the nodes that advertise GPUs."""
    return {k: v for k, v in m.gpu_node_selector(cfg).items() if k != ZONE_LABEL}


def gpu_nodes_of(kube: KubeApi, labels: dict[str, str]) -> list[Node]:
    """The GPU nodes in every zone: those with ``labels``, else those that advertise ``nvidia.com/gpu``."""
    if labels:
        return kube.nodes(labels)
    return [n for n in kube.nodes() if quantity(n.allocatable.get(m.GPU_RESOURCE))]


def zones_of(nodes: list[Node]) -> str:
    """How many of ``nodes`` each zone has, in words: ``us-east-1a (2 GPU nodes), us-east-1b (1 GPU node)``."""
    counts = sorted(Counter(n.zone or "" for n in nodes).items())
    return ", ".join(f"{zone or f'no {ZONE_LABEL} label'} ({n} GPU node{'s' * (n != 1)})" for zone, n in counts)


def _choose_zone(cfg: Config, zones: list[str], lead: str = "Choose the zone") -> str:
    """How to choose the worker pods' zone: ``cluster.gpu_az`` (with ``cluster.region`` where the zone is in
    another region: the configuration holds the zone to its region)."""
    example = zones[0] if zones else f"{cfg.cluster.region}a"
    region = example[:-1]
    also = f" and --set cluster.region={region}" if region != cfg.cluster.region else ""
    return (
        f"{lead}: --set cluster.gpu_az={example}{also} (or GPU_AZ, or cluster.gpu_az in the file); the worker pods "
        "then run only on the GPU nodes there. Or select the nodes of one zone with cluster.gpu_node_selector."
    )


def _zone_source(d: Deployment, zone: str) -> str:
    if d.cfg.cluster.gpu_az == zone:
        return f"cluster.gpu_az = {zone}"
    if d.state.get("gpu_az") == zone:
        return f"zone {zone}, which up chose before ({d.state.path})"
    return f"zone {zone} of cluster.gpu_node_selector"


def efa_zone(d: Deployment, capable: list[Node], chosen: str | None, efa: int, *, done: str) -> str | None:
    """The one zone the worker pods are kept to where EFA is required (``efa`` interfaces each): ``chosen`` (the
    setting, or the zone up chose before), else the one zone of the EFA-capable GPU nodes ``capable``; ``None`` when
    they carry no zone label, or there are none yet. Nodes in several zones without a choice are refused (``done``:
    what was not done, for the message)."""
    if chosen:
        return chosen
    zones = {n.zone for n in capable}
    if len(zones) <= 1:
        return next(iter(zones), None)
    raise UserError(
        f"EFA is required (fabric.require efa, {m.EFA_RESOURCE}={efa} per worker pod) and its traffic does not cross "
        f"availability zones, but the GPU nodes of {cluster_words(d)} are in {len(zones)} zones: {zones_of(capable)}; "
        f"{done}",
        hint=_choose_zone(d.cfg, sorted(z for z in zones if z)),
    )


def _in_zone(d: Deployment, nodes: list[Node], zone: str, *, done: str) -> list[Node]:
    """The GPU nodes of ``zone``; a :class:`UserError` naming each zone's when they are fewer than
    ``cluster.gpu_node_count``."""
    here, need = [n for n in nodes if n.zone == zone], d.cfg.cluster.gpu_node_count
    counts = Counter(n.zone for n in nodes)
    if len(here) < need:
        raise UserError(
            f"{_zone_source(d, zone)}: the worker pods are kept to that zone (EFA does not cross zones), and "
            f"{len(here)} of the GPU nodes of {cluster_words(d)} are there, for cluster.gpu_node_count = {need} "
            f"(GPU nodes: {zones_of(nodes)}); {done}",
            hint=_choose_zone(
                d.cfg, sorted(z for z, n in counts.items() if z and n >= need), "Choose a zone that has them"
            )
            + " Or set cluster.gpu_node_count to the GPU nodes of that zone.",
        )
    return here


def driver_of(node: Node) -> tuple[int, int] | None:
    """The node's NVIDIA driver version (major, minor) from GPU feature discovery's labels; ``None`` without them."""
    for major, minor in DRIVER_LABELS:
        value = node.labels.get(major, "")
        if value.isdigit():
            low = node.labels.get(minor, "")
            return int(value), int(low) if low.isdigit() else 0
    return None


def image_cuda(cfg: Config) -> str | None:
    """The CUDA version of ``ray.image`` where this tool knows the image (:data:`IMAGE_CUDA`), else ``None``."""
    return IMAGE_CUDA if known_image_packages(cfg.ray.image) is not None else None


def check_driver(cfg: Config, nodes: list[Node]) -> str | None:
    """A :class:`UserError` naming the GPU nodes whose NVIDIA driver is older than the image's CUDA needs
    (:data:`MIN_DRIVER`); else a line saying what could not be checked (nodes without GPU feature discovery's labels,
    an image whose CUDA this tool does not know), or ``None`` when every node was checked."""
    if not nodes:
        return None
    if image_cuda(cfg) is None:
        return (
            f"The GPU nodes' NVIDIA driver was not checked: the CUDA version of ray.image {cfg.ray.image} is not "
            f"known here (a CUDA {IMAGE_CUDA.split('.')[0]} image needs driver {MIN_DRIVER[0]} or later)."
        )
    need = min_driver_text()
    old = [(n.name, v) for n in nodes if (v := driver_of(n)) is not None and v < MIN_DRIVER]
    if old:
        listed = ", ".join(f"{name} ({major}.{minor})" for name, (major, minor) in old)
        raise UserError(
            f"the NVIDIA driver of GPU node{'s' if len(old) > 1 else ''} {listed} is older than the CUDA "
            f"{IMAGE_CUDA} of ray.image needs: {need} or later; nothing was installed",
            hint=f"Upgrade the nodes' NVIDIA driver to the {MIN_DRIVER[0]} branch or later (a newer GPU node image, "
            "or the GPU operator's driver), or select other nodes with cluster.gpu_node_selector. The image's CUDA "
            "forward-compatibility libraries do not help: only its entrypoint adds them, and KubeRay replaces the "
            "Ray containers' command.",
        )
    unknown = [n.name for n in nodes if driver_of(n) is None]
    if not unknown:
        return None
    return (
        f"The NVIDIA driver of GPU node{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} could not be checked: "
        f"no GPU feature discovery label {DRIVER_LABELS[0][0]} (nor {DRIVER_LABELS[1][0]}); the CUDA {IMAGE_CUDA} "
        f"of ray.image needs driver {need} or later."
    )


def look(d: Deployment) -> Found:
    """Read the cluster and decide what ``up`` installs; a :class:`UserError` when it cannot serve the job."""
    cfg, c = d.cfg, d.cfg.cluster
    labels = node_labels(cfg)
    chosen = c.gpu_az or m.gpu_node_selector(cfg).get(ZONE_LABEL)
    everything = d.kube.nodes()  # the first call: a kubeconfig or access problem stops here, with its message
    nodes = d.kube.nodes(labels) if labels else [n for n in everything if quantity(n.allocatable.get(m.GPU_RESOURCE))]
    releases = {rel.name: rel for rel in helm_releases(cfg)}
    if c.gpu_nodes_on_demand:
        return _look_on_demand(d, nodes, releases, chosen)
    if not nodes:
        which = f"matches the labels {labels}" if labels else f"advertises {m.GPU_RESOURCE}"
        raise UserError(
            f"no node of {cluster_words(d)} {which} ({len(everything)} nodes in all); nothing was installed",
            hint="Set cluster.gpu_node_selector to the labels of your GPU nodes (`kubectl get nodes --show-labels` "
            "lists them); up then installs the NVIDIA device plugin there if they do not advertise GPUs yet.",
        )
    nodes, zone, no_zone = _one_zone(d, nodes, chosen)
    if len(nodes) < c.gpu_node_count:
        raise UserError(
            f"{len(nodes)} GPU nodes in {cluster_words(d)}, and cluster.gpu_node_count is {c.gpu_node_count}: "
            f"{', '.join(n.name for n in nodes)}; nothing was installed",
            hint="Set cluster.gpu_node_count to the GPU nodes there are, or add nodes (an autoscaler that adds "
            "them on demand is not waited for).",
        )
    found = Found(nodes, 0, 0, 0, 0, None, zone=zone, notes=[no_zone] if no_zone else [])
    if note := check_driver(cfg, nodes):
        found.notes.append(note)
    found.gpus = int(_min(nodes, m.GPU_RESOURCE))
    if found.gpus == 0:
        found.install.append(releases["nvidia-device-plugin"])
        found.gpus = c.gpus_per_node
    elif found.gpus < c.gpus_per_node:
        raise UserError(
            f"the GPU nodes advertise {m.GPU_RESOURCE}={found.gpus} (the fewest), and cluster.gpus_per_node is "
            f"{c.gpus_per_node}; nothing was installed",
            hint=f"Set cluster.gpus_per_node to {found.gpus} (each worker pod then requests that many).",
        )
    advertised = int(_min(nodes, m.EFA_RESOURCE))
    found.efa = advertised if c.efa_per_node is None else c.efa_per_node
    if found.efa > advertised:
        if advertised:
            raise UserError(
                f"cluster.efa_per_node = {c.efa_per_node}, and the GPU nodes advertise {m.EFA_RESOURCE}={advertised}",
                hint=f"Set cluster.efa_per_node to {advertised}, or leave it empty to use what the nodes have.",
            )
        found.install.append(releases["aws-efa-k8s-device-plugin"])
    share, whole = POD_SHARE
    found.worker_cpu = max(1, int(_min(nodes, "cpu") * share // whole))
    found.worker_memory_gib = max(1, int(_min(nodes, "memory") / 2**30 * share // whole))
    memory = [n.labels.get(GPU_MEMORY_LABEL, "") for n in nodes]
    if all(v.isdigit() for v in memory):
        found.gpu_mib = min(int(v) for v in memory)
        products = {n.labels.get(GPU_PRODUCT_LABEL) for n in nodes}
        found.gpu_model = products.pop() if len(products) == 1 else None
    return _the_rest(d, found, releases)


def _one_zone(d: Deployment, nodes: list[Node], chosen: str | None) -> tuple[list[Node], str | None, str | None]:
    """Where EFA is required (``fabric.require`` efa, and EFA interfaces set or advertised): the GPU nodes of the zone
    the worker pods are kept to and that zone, or, when none could be chosen, every node and a line saying why.
    Else the nodes as they are."""
    c = d.cfg.cluster
    advertising = [n for n in nodes if quantity(n.allocatable.get(m.EFA_RESOURCE))]
    efa = c.efa_per_node if c.efa_per_node is not None else int(_min(advertising, m.EFA_RESOURCE) if advertising else 0)
    if d.cfg.fabric.require != "efa" or not efa:
        return nodes, None, None
    # With cluster.efa_per_node set, the EFA plugin up installs may bring it: every GPU node counts. Else the nodes
    # that advertise EFA are those the worker pods can use.
    capable = nodes if c.efa_per_node is not None else advertising
    zone = efa_zone(d, capable, chosen, efa, done="nothing was installed")
    if not zone:
        return nodes, None, _no_zone_note(d.cfg, nodes)
    return _in_zone(d, nodes, zone, done="nothing was installed"), zone, None


def _the_rest(d: Deployment, found: Found, releases: dict[str, HelmRelease]) -> Found:
    """``found`` completed with what every way of looking shares: the GPU nodes' one EC2 type when known, the
    shared volume checked, KubeRay when its CRD is missing, the namespace and the Ray pods' service account."""
    types = {n.labels.get(INSTANCE_TYPE_LABEL) for n in found.gpu_nodes}
    (only,) = types if len(types) == 1 else (None,)
    found.gpu_node_type = only if only in INSTANCE_TYPES else None
    check_shared_volume(d)
    if d.kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", RAYCLUSTER_CRD) is None:
        found.install.append(releases[KUBERAY_RELEASE])
    else:
        check_kuberay_fields(d)  # the cluster's own KubeRay: it must know every field submit sets
    ns = d.cfg.ray.namespace
    if ns != "default" and d.kube.get("v1", "Namespace", ns) is None:
        found.create.append(m.namespace(d.cfg))
    if d.kube.get("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, ns) is None:
        found.create.append(service_account(d.cfg))
    return found


def _look_on_demand(d: Deployment, nodes: list[Node], releases: dict[str, HelmRelease], chosen: str | None) -> Found:
    """:func:`look` for GPU nodes an autoscaler adds when the worker pods ask for them
    (``cluster.gpu_nodes_on_demand``): none need exist now, so the GPUs, EFA interfaces and the worker pod size are
    the settings' (the configuration requires them), no device plugin is installed (the pool's node image brings
    its own: on nodes that do not exist there is nothing to check), and ``submit`` waits for the pods, which make
    the nodes come. Where EFA is required, the zone is the setting's, else that of the GPU nodes there are now."""
    cfg, c = d.cfg, d.cfg.cluster
    assert c.efa_per_node is not None and cfg.ray.worker_cpu and cfg.ray.worker_memory_gib  # the configuration's
    found = Found(nodes, c.gpus_per_node, c.efa_per_node, cfg.ray.worker_cpu, cfg.ray.worker_memory_gib, None)
    if cfg.fabric.require == "efa" and c.efa_per_node:
        found.zone = efa_zone(d, nodes, chosen, c.efa_per_node, done="nothing was installed")
        if found.zone:
            found.gpu_nodes = [n for n in nodes if n.zone == found.zone]
        else:
            found.notes.append(_no_zone_note(d.cfg, nodes))
    if note := check_driver(cfg, found.gpu_nodes):
        found.notes.append(note)
    return _the_rest(d, found, releases)


def _no_zone_note(cfg: Config, nodes: list[Node]) -> str:
    """What ``up`` says where EFA is required and no zone could be chosen: the GPU nodes carry no zone label, or
    (GPU nodes on demand) none is there yet."""
    why = (
        f"the GPU nodes carry no {ZONE_LABEL} label"
        if nodes
        else "the zone the GPU nodes will come up in is not known (none is there now)"
    )
    lead = "To keep them in one, choose a zone" + ("" if nodes else " of the node pool")
    return f"EFA does not cross zones, and {why}: the worker pods may land in different zones. " + _choose_zone(
        cfg, [], lead
    )


def check_zone(d: Deployment) -> None:
    """Before ``submit`` applies anything, where EFA is required: a :class:`UserError` when the worker pods are kept
    to a zone with fewer GPU nodes than ``cluster.gpu_node_count``, or kept to none while the GPU nodes are in
    several zones (an ``up`` that recorded no zone); GPU nodes on demand are not counted (the pods bring them)."""
    cfg, c = d.cfg, d.cfg.cluster
    efa = m.efa_per_pod(cfg)
    if cfg.fabric.require != "efa" or not efa:
        return
    nodes = gpu_nodes_of(d.kube, node_labels(cfg))
    zone = m.gpu_node_selector(cfg).get(ZONE_LABEL)
    if zone is None:
        efa_zone(d, nodes, None, efa, done="nothing was applied")
        if not nodes and c.gpu_nodes_on_demand:
            d.say(_no_zone_note(cfg, nodes))
    elif not c.gpu_nodes_on_demand:
        _in_zone(d, nodes, zone, done="nothing was applied")


def service_account(cfg: Config) -> dict[str, Any]:
    """The Ray pods' service account, plain: on this target the pods get their storage access as the cluster
    grants it (a node role, workload identity, or the volume they mount), not from this tool."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": m.RAY_SERVICE_ACCOUNT, "namespace": cfg.ray.namespace, "labels": m.labels(cfg)},
    }


def gpu_node_spec(cfg: Config, state: StateStore) -> GpuNodeSpec:
    """What the worker pods need of the GPU nodes; the device plugins checked are only those this tool installed."""
    ours = {i["name"] for i in state.created if i["type"] == "helm"}
    # A zone alone does not single out GPU nodes: then every node advertising GPUs is looked at, and the zone's are
    # counted by check_zone (the spec's own zone check would fault the GPU nodes of the other zones).
    return GpuNodeSpec(
        selector=m.gpu_node_selector(cfg) if node_labels(cfg) else {},
        count=0 if cfg.cluster.gpu_nodes_on_demand else cfg.cluster.gpu_node_count,  # none yet: the pods bring them
        gpus=cfg.derived.ray_gpus_per_worker_pod,
        efa=m.efa_per_pod(cfg),
        plugins=tuple(p for p in DEVICE_PLUGIN_RELEASES if p in ours),
        needs_present_label=False,
        missing_hint="the nodes of cluster.gpu_node_selector are fewer than cluster.gpu_node_count",
    )


def remembered(cfg: Config, store: StateStore) -> Config:
    """``cfg`` with what ``up`` read from the GPU nodes, where the settings leave it open: the EFA interfaces each
    worker pod requests, the worker pod size, and the nodes' EC2 type (for the memory estimate). With no EFA on the
    nodes, ``fabric.require = efa`` (the default) becomes ``any``: a run there could never meet it. Where EFA is
    required, the worker pods' node selector gains the zone (``cluster.gpu_az``, else the one ``up`` chose), since
    EFA does not cross zones."""
    cfg = with_shared_volume(cfg)
    if store.get("target") != TARGET:
        return cfg
    cluster, ray, fabric = cfg.cluster, cfg.ray, cfg.fabric
    if cluster.efa_per_node is None and store.get("efa_per_node") is not None:
        cluster = cluster.model_copy(update={"efa_per_node": store.get("efa_per_node")})
    if store.get("gpu_node_type") and cluster.gpu_node_type != store.get("gpu_node_type"):
        cluster = cluster.model_copy(update={"gpu_node_type": store.get("gpu_node_type")})
    pod = {k: store.get(k) for k in ("worker_cpu", "worker_memory_gib") if getattr(ray, k) is None and store.get(k)}
    if pod:
        ray = ray.model_copy(update=pod)
    if fabric.require == "efa" and not m.efa_per_pod(cfg.model_copy(update={"cluster": cluster})):
        fabric = fabric.model_copy(update={"require": "any"})
    selector = m.gpu_node_selector(cfg)
    zone = cluster.gpu_az or store.get("gpu_az")
    if fabric.require == "efa" and zone and ZONE_LABEL not in selector:  # EFA does not cross zones
        cluster = cluster.model_copy(update={"gpu_node_selector": {**selector, ZONE_LABEL: zone}})
    return cfg.model_copy(update={"cluster": cluster, "ray": ray, "fabric": fabric})


def _check_state_matches(d: Deployment) -> None:
    s = d.state
    if s.created and s.get("target") != TARGET:
        raise UserError(
            f"this folder's {s.path} records an EKS deployment ({s.get('cluster')} in {s.get('region')}), not a "
            "cluster of cluster.target kubernetes",
            hint="Run `raytrain-eks down` for it first, or work in another folder.",
        )
    if s.get("target") == TARGET and (s.get("kubeconfig"), s.get("context")) != (d.kubeconfig, d.context):
        raise UserError(
            f"this folder's {s.path} belongs to the cluster of {s.get('kubeconfig')} (context "
            f"{s.get('context') or 'current'}), not {cluster_words(d)}",
            hint="Run `raytrain-eks down` there first, or work in another folder.",
        )


def up(d: Deployment, *, confirm: Callable[[str], bool]) -> list[str]:
    """Look, say what is missing, ask once, install it, and prove the GPU nodes and KubeRay ready; returns the GPU
    nodes' names. Re-running finds what the last run installed and installs nothing again."""
    _check_state_matches(d)
    found = look(d)
    efa = f", {m.EFA_RESOURCE}={found.efa}" if found.efa else f", no EFA (fabric.require {d.cfg.fabric.require})"
    if found.zone:
        efa += f", in zone {found.zone} (the worker pods are kept there: EFA does not cross zones)"
    pods = f"worker pods of {found.worker_cpu} CPU and {found.worker_memory_gib} GiB"
    if d.cfg.cluster.gpu_nodes_on_demand:
        d.say(
            f"{cluster_words(d)}: GPU nodes on demand (cluster.gpu_nodes_on_demand), {len(found.gpu_nodes)} there "
            f"now; as configured, each with {m.GPU_RESOURCE}={found.gpus}{efa}; {pods}; the device plugins come with "
            "the nodes' image (none is installed here)"
        )
    else:
        d.say(
            f"{cluster_words(d)}: {len(found.gpu_nodes)} GPU nodes ({', '.join(n.name for n in found.gpu_nodes)}) with "
            f"{m.GPU_RESOURCE}={found.gpus}{efa}; {pods}"
            + (f" on {found.gpu_node_type}" if found.gpu_node_type else "")
        )
    for note in found.notes:
        d.say(note)
    if found.install or found.create:
        if found.install:
            d.require_tool("helm")  # before the question: a missing helm is named with how to install it
        todo = [f"  - Helm release {r.namespace}/{r.name} ({r.chart} {r.version}): {r.purpose}" for r in found.install]
        todo += [f"  - {o['kind']} {o['metadata'].get('namespace', '')}/{o['metadata']['name']}" for o in found.create]
        question = (
            f"Install in {cluster_words(d)} (nothing else is changed there, and nothing is created in any cloud; "
            f"`raytrain-eks down` removes exactly these):\n" + "\n".join(todo) + "\nContinue?"
        )
        if not confirm(question):
            raise Cancelled("cancelled: nothing was installed")
    d.state.update(
        target=TARGET,
        kubeconfig=d.kubeconfig,
        context=d.context,
        namespace=d.cfg.ray.namespace,
        efa_per_node=found.efa,
        worker_cpu=found.worker_cpu,
        worker_memory_gib=found.worker_memory_gib,
        gpu_node_type=found.gpu_node_type,
        gpu_mib=found.gpu_mib,
        gpu_model=found.gpu_model,
        gpu_az=found.zone,
    )
    for obj in found.create:
        d.state.record(object_item(obj))
        d.kube.apply(obj)
        d.say(f"Created {describe(object_item(obj))}")
    for rel in found.install:
        ensure_release(d, rel)
    cfg = remembered(d.cfg, d.state)
    nodes = wait_gpu_nodes(d, gpu_node_spec(cfg, d.state))
    if any(i["type"] == "helm" and i["name"] == KUBERAY_RELEASE for i in d.state.created):
        wait_kuberay(d)
    d.state.update(phase="up")
    if not found.gpu_node_type and not found.gpu_mib and configured_gpu_type(d.cfg) is None:
        d.say(
            "The GPU nodes carry neither an EC2 instance type raytrain-eks knows nor GPU feature discovery's "
            f"{GPU_MEMORY_LABEL} label: submit leaves out the memory estimate. To have it, give their EC2 type to "
            "plan and submit (--set cluster.gpu_node_type=TYPE, or GPU_NODE_TYPE)."
        )
    if d.cfg.cluster.gpu_nodes_on_demand:
        d.say(
            f"Ready: the GPU nodes of {cluster_words(d)} come when the worker pods ask for them (submit waits up to "
            f"ray.job_start_deadline_s = {d.cfg.ray.job_start_deadline_s:.0f} s). Next: `raytrain-eks submit`."
        )
    else:
        d.say(f"Ready: {len(nodes)} GPU nodes of {cluster_words(d)}. Next: `raytrain-eks submit`.")
    return [n.name for n in nodes]


def down(d: Deployment, *, confirm: Callable[[str], bool]) -> list[str]:
    """Delete what this folder created in the cluster (Helm releases, objects), newest first, after one question;
    the cluster and everything else in it stay. Returns what was deleted."""
    created = d.state.created
    if not created:
        d.say(f"Nothing to delete: {d.state.path} records nothing created in {cluster_words(d)}.")
        d.state.clear()
        return []
    if any(i["type"] == "helm" for i in created):
        d.require_tool("helm")
    listing = "\n".join(f"  - {describe(i)}" for i in reversed(created))
    if not confirm(f"Delete from {cluster_words(d)}, in this order (the cluster itself stays):\n{listing}\nContinue?"):
        raise Cancelled("cancelled: nothing was deleted")
    deleted = []
    for item in reversed(created):
        if delete_recorded(d, item):
            d.say(f"Deleted {describe(item)}")
            deleted.append(describe(item))
        d.state.forget(item)
    d.state.clear()
    return deleted


def status(d: Deployment) -> list[str]:
    """Readable lines: the cluster, what this folder installed there, the GPU nodes, the Ray pods and the job."""
    s = d.state
    if not s.get("target"):
        return [f"Nothing deployed from this folder ({s.path} does not exist). Start with `raytrain-eks up`."]
    lines = [f"Kubernetes: {cluster_words(d)}"]
    lines += [f"  created: {describe(i)}" for i in s.created]
    return lines + gpu_node_lines(d, gpu_node_spec(d.cfg, s)) + ray_lines(d)


def configured_gpu_type(cfg: Config) -> InstanceType | None:
    """``cluster.gpu_node_type`` when the user set it to a type the instance table knows, for nodes that carry no
    label saying theirs. Its default (the EKS reference's type, which every file ``init`` writes holds) counts only
    when this command was given it (``GPU_NODE_TYPE``, ``--set``): from a file or a preset it names no node of this
    cluster."""
    name = cfg.cluster.gpu_node_type
    default = type(cfg.cluster).model_fields["gpu_node_type"].default
    chosen = name != default or cfg.given_in_command("cluster.gpu_node_type")
    return INSTANCE_TYPES[name] if chosen and name in INSTANCE_TYPES else None


def gpu_type(cfg: Config, state: StateStore) -> InstanceType | None:
    """The GPU nodes' type for the memory estimate: their EC2 type when ``up`` found one it knows on their labels;
    else their GPUs as GPU feature discovery labels them (memory and product); else :func:`configured_gpu_type`; else
    ``None``. Reads only the state file and the settings."""
    if state.get("gpu_node_type") in INSTANCE_TYPES:
        return INSTANCE_TYPES[state.get("gpu_node_type")]
    if not state.get("gpu_mib"):
        return configured_gpu_type(cfg)
    model = state.get("gpu_model")
    # Only the GPU fields are read by the memory estimate; nothing here is priced.
    return InstanceType(f"GPU node ({model or 'GPU'})", cfg.cluster.gpus_per_node, model, int(state.get("gpu_mib")),
                        0, 0, 0.0, m.efa_per_pod(cfg), None, verified=False)  # fmt: skip
