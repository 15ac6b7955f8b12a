"""What ``up`` and ``submit`` would do on the ``kubernetes`` target (a cluster of the user's kubeconfig): pure,
offline, no credentials; the cluster is never contacted and the kubeconfig never read.

:func:`build_plan` sizes the worker pods and their EFA from what ``up`` recorded in the state folder
(:func:`raytrain_eks.kubernetes.existing.remembered`), else from the settings (``ray.worker_cpu``,
``ray.worker_memory_gib``, ``cluster.efa_per_node``, which ``cluster.gpu_nodes_on_demand`` requires anyway); with
neither it refuses, naming the settings that are missing. The state file is only read. It returns the
:class:`~raytrain_eks.deploy.plan.Plan` the EKS plan returns: up's steps there (find the GPU nodes, install only what is
missing of the pinned charts, the Ray pods' plain service account), then submit's steps and files exactly as the
EKS plan builds them (:func:`~raytrain_eks.deploy.plan.job_steps`), and the cost per hour only at a configured price
(``cluster.usd_per_node_hour`` or ``cluster.usd_per_hour``; else ``total_usd`` is ``None`` and ``unpriced`` says
which setting gives it). No eksctl, IAM role, bucket, quota or node-group step. Example::

    plan = build_plan(cfg, state_dir=Path(".raytrain-eks"), mode="rayjob")
    plan.summary["worker_pod_cpu"], plan.cost["total_usd"]   # (9, None): as up found the nodes; no price set
    write_plan(cfg, "plan-out", state_dir=".raytrain-eks")   # service-account.yaml, raycluster.yaml, plan.json, ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytrain_eks.config import Config
from raytrain_eks.deploy.fit import fit_on_image
from raytrain_eks.deploy.plan import (
    HELM_FILE,
    MODES,
    Mode,
    Plan,
    Step,
    checkpoint_storage,
    checkpoints_on_volume,
    helm_files,
    image_installs,
    job_objects,
    job_steps,
    write_files,
)
from raytrain_eks.deploy.submit import job_config
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.instances import INSTANCE_TYPES, InstanceType
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import DEVICE_PLUGIN_RELEASES, KUBERAY_RELEASE, HelmRelease, helm_releases, install_argv
from raytrain_eks.k8s.prices import configured_price
from raytrain_eks.k8s.state import StateStore
from raytrain_eks.kubernetes import existing
from raytrain_eks.train.memory import unknown_shape_note

TARGET = existing.TARGET  # the target whose plan this is
SERVICE_ACCOUNT_FILE = "service-account.yaml"
# What the worker pods' size and EFA come from when up has not recorded them, in the order the message names them.
SHAPE_SETTINGS = ("ray.worker_cpu", "ray.worker_memory_gib", "cluster.efa_per_node")
PRICE_SETTINGS = "cluster.usd_per_node_hour (each GPU node) or cluster.usd_per_hour (the whole cluster)"


class ShapeUnknown(UserError):
    """Neither up's record nor the settings give the worker pods' size and EFA: a setting to give (exit 2)."""

    exit_code = 2


def _after_up(cfg: Config, store: StateStore) -> tuple[Config, bool]:
    """``cfg`` as submit would get it after ``up``: what ``up`` recorded in ``store`` (:func:`existing.remembered`)
    or, before any ``up``, as ``up`` would record the settings' shape. True when the record was there."""
    if store.created and store.get("target") != existing.TARGET:
        raise UserError(
            f"this folder's {store.path} records an EKS deployment ({store.get('cluster')} in "
            f"{store.get('region')}), not a cluster of cluster.target kubernetes; up would refuse it",
            hint="Give another --state-dir, or run `raytrain-eks down` for that deployment first.",
        )
    recorded = store.get("target") == existing.TARGET
    view = store
    if not recorded:  # what up records before anything else: held in memory, never saved
        view = StateStore(store.root)
        view.data = {"target": existing.TARGET}
    return existing.remembered(cfg, view), recorded


def _words(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _refuse_unknown_shape(cfg: Config, store: StateStore) -> None:
    """One :class:`UserError` naming each setting of :data:`SHAPE_SETTINGS` that neither up's record nor the
    configuration gives, and with them the storage problem the plan would refuse next
    (:meth:`~raytrain_eks.config.Config.check_cluster_storage`): every missing setting in one message."""
    values = (cfg.ray.worker_cpu, cfg.ray.worker_memory_gib, cfg.cluster.efa_per_node)
    missing = [name for name, value in zip(SHAPE_SETTINGS, values, strict=True) if value is None]
    if missing:
        try:
            cfg.check_cluster_storage()
            also: list[str] = []
        except ConfigError as exc:
            also = exc.problems
        raise ShapeUnknown(
            "plan on cluster.target kubernetes needs the worker pods' CPU, memory and EFA interfaces, and neither "
            f"{store.path} (what `raytrain-eks up` records from the GPU nodes) nor the settings give them: "
            f"{_words(missing)} {'is' if len(missing) == 1 else 'are'} not set; nothing was written"
            + "".join(f"\n  - and {problem}" for problem in also),
            hint=f"Run `raytrain-eks up` first (it reads them from the GPU nodes), or set {_words(missing)} (--set "
            + " --set ".join(f"{name}=N" for name in missing)
            + ")."
            + (" Set where the checkpoints go too, as said above." if also else ""),
        )


def gpu_type(cfg: Config, store: StateStore) -> tuple[InstanceType | None, str | None]:
    """The GPU nodes' type for the memory estimate (:func:`~raytrain_eks.kubernetes.existing.gpu_type`, as submit takes
    it), and where it came from: what ``up`` recorded, or ``cluster.gpu_node_type``."""
    found = existing.gpu_type(cfg, store)
    if found is None:
        return None, None
    if store.get("gpu_node_type") in INSTANCE_TYPES or store.get("gpu_mib"):
        return found, f"as up found the GPU nodes ({store.path})"
    return found, "cluster.gpu_node_type"


def _releases(cfg: Config, store: StateStore) -> list[tuple[HelmRelease, str]]:
    """The pinned charts up would install, each with when it does: the device plugins only where nodes exist to
    look at (not for GPU nodes on demand, whose image brings them), the EFA plugin only when the pods request EFA."""
    efa = m.efa_per_pod(cfg)
    ours = {i["name"] for i in store.created if i["type"] == "helm"}
    out = []
    for rel in helm_releases(cfg):
        if rel.name in DEVICE_PLUGIN_RELEASES and cfg.cluster.gpu_nodes_on_demand:
            continue
        if rel.name == "aws-efa-k8s-device-plugin" and not efa:
            continue
        when = {
            "nvidia-device-plugin": f"only if the GPU nodes advertise no {m.GPU_RESOURCE}",
            "aws-efa-k8s-device-plugin": f"only if the GPU nodes advertise fewer than {efa} {m.EFA_RESOURCE}",
            KUBERAY_RELEASE: "only if the cluster has no RayCluster CRD (a KubeRay it runs is kept when its CRDs know "
            "every field submit sets)",
        }[rel.name]
        if rel.name in ours:
            when += f"; up installed it from this folder (recorded in {store.path})"
        out.append((rel, when))
    return out


def _zone_words(cfg: Config) -> str:
    """What up does about zones and the NVIDIA driver, in words: where EFA is required the worker pods are kept to
    one zone, the one they select or the one up will find."""
    cuda = existing.image_cuda(cfg)
    driver = (
        f" It checks the GPU nodes' NVIDIA driver (GPU feature discovery's labels): {existing.MIN_DRIVER[0]} or later "
        f"for the image's CUDA {cuda}."
        if cuda
        else f" The GPU nodes' NVIDIA driver is not checked: the CUDA of ray.image {cfg.ray.image} is not known here."
    )
    if cfg.fabric.require != "efa" or not m.efa_per_pod(cfg):
        return driver
    zone = m.gpu_node_selector(cfg).get(existing.ZONE_LABEL)
    if zone:
        return f" EFA does not cross zones: the worker pods are kept to zone {zone}." + driver
    if cfg.cluster.gpu_nodes_on_demand:
        return (
            " EFA does not cross zones: the worker pods are kept to the zone of the GPU nodes there are, and with "
            "none, to no zone unless cluster.gpu_az chooses one (the nodes they bring may then be apart)." + driver
        )
    return (
        " EFA does not cross zones: the worker pods are kept to the zone of the EFA-capable GPU nodes, and up stops, "
        "naming the zones, when they are in several and cluster.gpu_az chooses none." + driver
    )


def _up_steps(cfg: Config, releases: list[tuple[HelmRelease, str]], where: str) -> list[Step]:
    c, d = cfg.cluster, cfg.derived
    selector = existing.node_labels(cfg)
    which = f"the nodes labelled {selector}" if selector else f"every node that advertises {m.GPU_RESOURCE}"
    efa = m.efa_per_pod(cfg)
    advertise = f"{m.GPU_RESOURCE}={d.ray_gpus_per_worker_pod}" + (f" and {m.EFA_RESOURCE}={efa}" if efa else "")
    if c.gpu_nodes_on_demand:
        look = (
            f"Read {where} (nothing is changed before the question below): the GPU nodes come on demand "
            f"(cluster.gpu_nodes_on_demand) as {which}, so none need exist now; each is taken to have {advertise}, "
            "and its image brings the device plugins (none is installed)."
        )
    else:
        look = (
            f"Read {where} (nothing is changed before the question below): find the GPU nodes, {which} "
            f"({c.gpu_node_count} or more), and read what they advertise; up stops, naming the setting to change, "
            f"when they are fewer or advertise fewer than {d.ray_gpus_per_worker_pod} GPUs."
        )
    steps = [
        Step(
            "find-gpu-nodes",
            look
            + _zone_words(cfg)
            + " Then up lists what is missing of the objects and charts below and asks once before it installs "
            "anything; no cloud resource is created.",
        )
    ]
    for rel, when in releases:
        steps.append(
            Step(
                f"helm-{rel.name}",
                f"Install {rel.repo_name}/{rel.chart} {rel.version} as release {rel.name} in {rel.namespace}, {when}: "
                f"{rel.purpose}.",
                install_argv(rel, rel.values_file, existing.kubeconfig_path(cfg), c.context),
                [HELM_FILE, rel.values_file],
            )
        )
    plugins = ", ".join(rel.name for rel, _ in releases if rel.name in DEVICE_PLUGIN_RELEASES)
    steps.append(
        Step(
            "check-gpu-nodes",
            (
                "Nothing to wait for: submit waits up to ray.job_start_deadline_s = "
                f"{cfg.ray.job_start_deadline_s:.0f} s for the GPU nodes its worker pods make come, each with "
                f"{advertise}."
                if c.gpu_nodes_on_demand
                else f"Wait until {c.gpu_node_count} GPU nodes advertise {advertise}"
                + (f" and the device plugins up installed (of {plugins}) run on each" if plugins else "")
                + "."
            )
            + f" When up installed {KUBERAY_RELEASE}, wait until its operator is ready.",
        )
    )
    return steps


def _cost(cfg: Config) -> dict[str, Any]:
    """The cost per hour at the configured price (:func:`configured_price`, which prices runs the same way), else
    ``total_usd`` ``None`` and ``unpriced``: why, and the setting that gives it."""
    c = cfg.cluster
    price = configured_price(c.usd_per_hour, c.usd_per_node_hour, c.name)
    if price is None:
        return {
            "total_usd": None,
            "items": [],
            "unpriced": "what the nodes of a cluster of the kubeconfig cost is not known here; set " + PRICE_SETTINGS,
            "settings": ["cluster.usd_per_node_hour", "cluster.usd_per_hour"],
        }
    hour = price({"wall_s": 3600.0, "trained_tokens": 0, "nodes": c.gpu_node_count})
    item: dict[str, Any]
    if c.usd_per_node_hour is not None:
        item = {"name": "GPU nodes", "what": "GPU node at cluster.usd_per_node_hour", "count": c.gpu_node_count}
        item["unit_usd_per_hour"], setting = c.usd_per_node_hour, "cluster.usd_per_node_hour"
    else:
        item = {"name": "cluster", "what": "the whole cluster at cluster.usd_per_hour", "count": 1}
        item["unit_usd_per_hour"], setting = c.usd_per_hour, "cluster.usd_per_hour"
    return {
        "total_usd": hour["usd"],
        "priced_as": f"{setting} as configured",
        "basis": hour["basis"].removesuffix(" x the run's wall time"),
        "items": [{**item, "usd_per_hour": hour["usd"]}],
    }


def build_plan(cfg: Config, *, state_dir: str | Path, mode: Mode = "raycluster", hf_token: bool = False) -> Plan:
    """Check the config for the kubernetes target and build the whole plan in memory; ``state_dir`` is only read.
    ``hf_token``: a token will be given (the pods then read ``HF_TOKEN`` from the Secret); its value is never an
    input here."""
    if mode not in MODES:
        raise UserError(f"--mode {mode!r} is not known", hint=f"Choose one of: {', '.join(MODES)}.")
    store = StateStore(state_dir)  # reads state.json when there; creates nothing
    cfg, recorded = _after_up(cfg, store)
    _refuse_unknown_shape(cfg, store)
    cfg = job_config(cfg)  # what submit checks and ships: LoRA layers, --offline's model and data, the chat template
    gpu, gpu_from = gpu_type(cfg, store)
    memory = None
    if gpu is not None:
        cfg, memory = fit_on_image(cfg, gpu)  # DoesNotFit before anything; activation checkpointing where it must be
    cfg.check_cluster_storage()  # storage every node reaches: s3:// (or another URI) or ray.shared_volume

    c, r, d = cfg.cluster, cfg.ray, cfg.derived
    kubeconfig = existing.kubeconfig_path(cfg)
    where = f"the cluster of {kubeconfig}" + (f" (context {c.context})" if c.context else "")
    kubectl = ("kubectl", "--kubeconfig", kubeconfig, *(("--context", c.context) if c.context else ()))
    releases = _releases(cfg, store)
    files, texts, code_dir = job_objects(cfg, mode, hf_token=hf_token)
    files.update(helm_files([rel for rel, _ in releases]))
    files[SERVICE_ACCOUNT_FILE] = [existing.service_account(cfg)]
    account = Step(
        "service-account",
        f"Create the Ray pods' service account {r.namespace}/{m.RAY_SERVICE_ACCOUNT} when it is missing (up does; "
        "submit refuses without it): a plain one, with no cloud role; the pods reach the checkpoints as the "
        "cluster grants it (a node role, workload identity, or the volume they mount).",
        [*kubectl, "apply", "-f", SERVICE_ACCOUNT_FILE],
        [SERVICE_ACCOUNT_FILE],
    )
    steps = _up_steps(cfg, releases, where)
    steps += job_steps(cfg, mode, hf_token=hf_token, code_dir=code_dir, kubectl=kubectl, after_namespace=(account,))
    require = cfg.fabric.require
    steps.append(
        Step(
            "check-nccl-transport",
            "Read the workers' NCCL_DEBUG=INFO lines and "
            + {
                "efa": "fail unless inter-node traffic went over EFA (NET/OFI), not sockets, and fi_info -p efa sees "
                "EFA on a worker.",
                "ib": "fail unless inter-node traffic went over InfiniBand (NET/IB), not sockets.",
                "any": "say which transport carried inter-node traffic; fabric.require is any"
                + ("" if m.efa_per_pod(cfg) else " (the worker pods get no EFA)")
                + ", so none is required.",
            }[require],
        )
    )
    if mode == "rayjob":
        steps.append(
            Step(
                "delete-rayjob-cluster",
                "Once NCCL's lines, fi_info -p efa and nvidia-smi were read from its pods, delete the RayJob's "
                "RayCluster; the GPU nodes are the cluster's and stay as they are.",
            )
        )

    assumptions = []
    if not recorded:
        assumptions.append(
            f"{store.path} records no `raytrain-eks up` here: the worker pods are sized from the settings "
            f"({', '.join(SHAPE_SETTINGS)}); up checks the GPU nodes hold them."
        )
    if gpu is None:
        assumptions.append(
            "The GPU nodes' type is not known here: the memory estimate is left out (a run that does not fit "
            f"fails). `raytrain-eks up` reads it from the nodes' {existing.INSTANCE_TYPE_LABEL} label or GPU feature "
            f"discovery's {existing.GPU_MEMORY_LABEL}; or set cluster.gpu_node_type to their EC2 type (its default, "
            f"{c.gpu_node_type}, counts only when given to this command: --set cluster.gpu_node_type="
            f"{c.gpu_node_type} or GPU_NODE_TYPE; in a file it is what `raytrain-eks init` writes)."
        )
    elif memory is None:
        assumptions.append(unknown_shape_note(cfg.training.model_id))
    cpu, mem = m.worker_pod_size(cfg)
    mount = r.shared_volume_path
    on_volume = checkpoints_on_volume(cfg)
    summary = {
        "where": where,
        "kubeconfig": kubeconfig,
        "context": c.context,
        "worker_pods_from": f"up's record in {store.path}" if recorded else "the settings",
        "gpu_node_selector": m.gpu_node_selector(cfg),
        "gpu_zone": m.gpu_node_selector(cfg).get(existing.ZONE_LABEL),
        "gpu_nodes_on_demand": c.gpu_nodes_on_demand,
        "gpu_node_type": gpu.name if gpu else None,
        "gpu_node_type_from": gpu_from,
        "gpu_nodes": c.gpu_node_count,
        "gpus_per_worker_pod": d.ray_gpus_per_worker_pod,
        "efa_per_worker_pod": m.efa_per_pod(cfg),
        "worker_pod_cpu": cpu,
        "worker_pod_memory_gib": mem,
        "cluster_gpus": d.cluster_gpus,
        "world_size": d.world_size,
        "fabric_require": require,
        "hf_token_secret": r.hf_token_secret if hf_token else None,
        "service_account": f"{r.namespace}/{m.RAY_SERVICE_ACCOUNT}",
        "checkpoints": cfg.training.storage_path,
        "checkpoint_role": (
            f"ray.shared_volume {r.shared_volume}, mounted at {mount} in every Ray pod"
            if on_volume
            else f"as {where} grants the Ray pods access (their service account {r.namespace}/"
            f"{m.RAY_SERVICE_ACCOUNT} is plain)"
        ),
        "checkpoint_storage": checkpoint_storage(cfg),
        "runtime_env": image_installs(cfg),
        "memory_per_gpu": memory.to_dict() if memory else None,
    }
    return Plan(
        mode=mode,
        steps=steps,
        helm_releases=[rel for rel, _ in releases],
        cost=_cost(cfg),
        files=files,
        assumptions=assumptions,
        summary=summary,
        texts=texts,
    )


def write_plan(
    cfg: Config,
    out_dir: str | Path,
    *,
    state_dir: str | Path,
    mode: Mode = "raycluster",
    hf_token: bool = False,
) -> tuple[Plan, list[Path]]:
    """Build the plan and write its files under ``out_dir`` (created), as the EKS plan writes its own; returns the
    plan and the paths written. Nothing is written when a check fails."""
    plan = build_plan(cfg, state_dir=state_dir, mode=mode, hf_token=hf_token)  # raises before the disk is touched
    return plan, write_files(plan, out_dir)
