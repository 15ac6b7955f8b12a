"""What ``deploy`` would create, apply and submit on the EKS target, and what it costs per hour: pure, offline, no
credentials.

:func:`build_plan` checks the configuration against the instance table (EFA, GPU count, pod size, region) and
returns a :class:`~raytrain_eks.deploy.plan.Plan`: the ordered steps, the pinned Helm releases, the eksctl
ClusterConfig, the Kubernetes objects and the hourly cost. :func:`write_plan` dumps it to a folder, writing nothing
unless every check passed. The parts every target's plan shares (the job's steps and objects, the files) are
:mod:`raytrain_eks.deploy.plan`'s. Example::

    plan = build_plan(cfg, mode="rayjob")
    plan.cost["total_usd"]  # about 9.55 for the reference
    write_plan(cfg, Path("plan-out"))  # eksctl-cluster.yaml, raycluster.yaml, helm/..., plan.json
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date
from pathlib import Path

from raytrain_eks.aws import eksctl
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
    planned_sharding,
    write_files,
)
from raytrain_eks.deploy.submit import job_config
from raytrain_eks.eks import irsa
from raytrain_eks.eks.buckets import planned_bucket
from raytrain_eks.eks.pricing import check_deployable, cost_per_hour
from raytrain_eks.errors import UserError
from raytrain_eks.instances import QUOTA_CODES, InstanceType, quota_family, same_shape
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import helm_releases
from raytrain_eks.k8s.state import with_bucket_storage, with_shared_volume
from raytrain_eks.train.memory import unknown_shape_note

BUCKET_SUFFIX_PLACEHOLDER = "xxxxxxxx"


def _quota(instance: str) -> str:
    """The on-demand vCPU quota ``instance`` draws on, in words: ``G quota (L-DB2E81BA)``."""
    family = quota_family(instance)
    return f"{family} quota ({QUOTA_CODES[family]})" if family else f"own quota of {instance}'s family"


def _gpu_source_words(cfg: Config) -> str:
    """How the GPU node group gets its nodes, the end of the create-cluster step's sentence."""
    c = cfg.cluster
    first, rest = c.capacity_order[0], c.capacity_order[1:]
    words = {
        "on-demand": "on-demand, with the cluster placement group eksctl adds",
        "reservation": f"launched into capacity reservation {c.capacity_reservation_id}",
        "capacity-block": f"launched into Capacity Block {c.capacity_block_id} (capacity type CAPACITY_BLOCK), at "
        "size 0 until the block starts",
        "spot": f"spot (capacity type SPOT), any of {', '.join(same_shape(c.gpu_node_type))}",
    }
    then = f"; when they cannot launch, {' then '.join(rest)}" if rest else ""
    return f"{words[first]}{then})."


def _steps(
    cfg: Config, mode: Mode, *, hf_token: bool, gpu: InstanceType, zones: eksctl.Zones, code_dir: str, bucket: str
) -> list[Step]:
    c, r, d = cfg.cluster, cfg.ray, cfg.derived
    ns = r.namespace
    where = f"zone {zones.gpu_az}" if not zones.assumed else f"one zone of {c.region} (chosen at deploy)"
    steps = [
        Step(
            "preflight",
            f"Check AWS credentials; that {c.region} offers {gpu.name} with EFA in {where}; and that the on-demand "
            "vCPU quotas hold the nodes, net of running instances and unused capacity reservations: the "
            f"{_quota(gpu.name)} {c.gpu_node_count * gpu.vcpu} vCPUs (less what an existing reservation of the GPU "
            f"type holds there), and the {_quota(c.system_node_type)} the system node. Nothing is created if a "
            "check fails.",
        ),
        Step(
            "checkpoint-bucket",
            (
                f"Use the existing S3 bucket {bucket} for checkpoints and exports (never deleted by down)."
                if c.checkpoint_bucket
                else f"Create S3 bucket {bucket} for checkpoints and exports: public access blocked, encrypted "
                "(SSE-S3), tagged with the cluster. down keeps it while it holds anything (--delete-checkpoints "
                "deletes it)."
            ),
        ),
        Step(
            "create-cluster",
            f"Create EKS cluster {c.name} (Kubernetes {c.k8s_version}, OIDC; the Ray pods' service account "
            f"{m.RAY_SERVICE_ACCOUNT} gets an IAM role that may use bucket {bucket} only; private subnets in "
            f"{', '.join(zones.cluster_azs)} behind one NAT gateway), node group {eksctl.SYSTEM_NODEGROUP} "
            f"({c.system_node_count} x {c.system_node_type}, a {eksctl.SYSTEM_VOLUME_GIB} GiB gp3 root volume "
            f"each: {eksctl.SYSTEM_VOLUME_REASON}) and EFA node group {c.gpu_nodegroup_name} "
            f"({c.gpu_node_count} x {gpu.name} in {zones.gpu_az}, " + _gpu_source_words(cfg),
            eksctl.create_cluster_argv(),
            [eksctl.CONFIG_FILE],
        ),
        Step(
            "iam-service-account",
            f"Make sure the service account {ns}/{m.RAY_SERVICE_ACCOUNT} exists with its IAM role (what create-cluster "
            "makes; an existing cluster gets them here): nothing is run when they do; else eksctl creates the role "
            "and the service account, or annotates one that exists (when the bucket is encrypted with a KMS key, "
            "the role may also use that key).",
            irsa.create_argv(irsa.CONFIG_FILE),
            [irsa.CONFIG_FILE],
        ),
        Step(
            "remove-eksctl-device-plugins",
            f"Delete the EFA device-plugin DaemonSet eksctl applies by itself for an EFA node group, kube-system/"
            f"{eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET}: it has the name of the EFA chart's DaemonSet, and Helm refuses to "
            "install the chart over an object without its ownership metadata. Only a copy without Helm's label "
            "app.kubernetes.io/managed-by=Helm is deleted, never the chart's own. eksctl applies its copy again, "
            "over the chart's, whenever it creates an EFA node group: then run this step and the EFA chart's step "
            "again. (eksctl's NVIDIA plugin, DaemonSet "
            f"{eksctl.EKSCTL_NVIDIA_PLUGIN_DAEMONSET}, is not applied: the cluster is created with "
            "--install-nvidia-plugin=false.) Only the pinned charts then run: never two plugins on one node.",
            [
                "kubectl",
                "delete",
                "daemonset",
                "--namespace",
                "kube-system",
                "--ignore-not-found",
                "--selector",
                "app.kubernetes.io/managed-by!=Helm",
                "--field-selector",
                f"metadata.name={eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET}",
            ],
        ),
    ]
    for rel in helm_releases(cfg):
        steps.append(
            Step(
                f"helm-{rel.name}",
                f"Install {rel.repo_name}/{rel.chart} {rel.version} as release {rel.name} in {rel.namespace}: "
                f"{rel.purpose}.",
                rel.argv(),
                [HELM_FILE, rel.values_file],
            )
        )
    steps.append(
        Step(
            "check-gpu-nodes",
            f"Wait for {c.gpu_node_count} nodes labelled role=gpu-worker, all in {where}, each with label "
            f"nvidia.com/gpu.present=true and allocatable {m.GPU_RESOURCE}={d.ray_gpus_per_worker_pod} and "
            f"{m.EFA_RESOURCE}={gpu.efa_interfaces}, and exactly one NVIDIA and one EFA device-plugin pod per node.",
        )
    )
    steps += job_steps(cfg, mode, hf_token=hf_token, code_dir=code_dir)
    steps.append(
        Step(
            "check-nccl-transport",
            "Read the workers' NCCL_DEBUG=INFO lines and fail unless inter-node traffic went over EFA (NET/OFI), "
            "not sockets.",
        )
    )
    if mode == "rayjob":
        steps.append(
            Step(
                "scale-down-gpus",
                "Once NCCL's lines, fi_info -p efa and nvidia-smi were read from its pods, delete the RayJob's "
                f"RayCluster; then scale node group {c.gpu_nodegroup_name} to 0 so the GPU instances stop billing "
                "(the RayJob removes its pods, not the nodes).",
                eksctl.scale_gpu_nodegroup_argv(cfg, 0),
            )
        )
    return steps


def build_plan(
    cfg: Config,
    *,
    mode: Mode = "raycluster",
    hf_token: bool = False,
    on: date | None = None,
    market: Mapping[str, object] | None = None,
) -> Plan:
    """Check the config for deploying and build the whole plan in memory. ``hf_token``: a token will be given
    (the pods then read ``HF_TOKEN`` from the Secret); its value is never an input here. ``on``: the day the cost
    is for (default today; it decides whether the Kubernetes version is in EKS extended support). ``market``: what
    ``capacity`` recorded in the state folder (the spot price range, the Capacity Block's fee), for the GPU
    nodes' price (:func:`~raytrain_eks.eks.pricing.gpu_price`)."""
    if mode not in MODES:
        raise UserError(f"--mode {mode!r} is not known", hint=f"Choose one of: {', '.join(MODES)}.")
    gpu, system = check_deployable(cfg)
    cfg = job_config(cfg)  # what submit checks and ships: LoRA layers, --offline's model and data, the chat template
    cfg, memory = fit_on_image(cfg, gpu)  # DoesNotFit before anything; activation checkpointing on where it must be
    # The job's checkpoints go where submit puts them (apply_state): on ray.shared_volume when one is mounted, else
    # in the cluster's bucket unless storage_path says otherwise. Every node reaches either.
    bucket = planned_bucket(cfg, suffix=BUCKET_SUFFIX_PLACEHOLDER)
    cfg = with_bucket_storage(with_shared_volume(cfg), bucket)
    cfg.check_cluster_storage()
    zones = eksctl.planned_zones(cfg)
    releases = helm_releases(cfg)
    files, texts, code_dir = job_objects(cfg, mode, hf_token=hf_token)
    files.update(helm_files(releases))
    files[eksctl.CONFIG_FILE] = [eksctl.cluster_config(cfg, zones, bucket=bucket)]
    files[irsa.CONFIG_FILE] = [eksctl.service_account_config(cfg, bucket)]
    assumptions = []
    if zones.assumed:
        assumptions.append(
            f"cluster.gpu_az is not set: the files use {zones.gpu_az} (cluster zones {', '.join(zones.cluster_azs)}) "
            f"as placeholders; deploy picks a zone of {cfg.cluster.region} that offers {gpu.name} (or set GPU_AZ)."
        )
    if not (gpu.verified and system.verified):
        unverified = [it.name for it in (gpu, system) if not it.verified]
        assumptions.append(
            f"Facts for {', '.join(unverified)} are not from the checked instance facts "
            "(docs/reference/infra-facts.md); deploy re-reads the EC2 API."
        )
    if not cfg.cluster.checkpoint_bucket:
        assumptions.append(
            f"The checkpoint bucket's name ends in a random suffix that up chooses (here {BUCKET_SUFFIX_PLACEHOLDER}); "
            "set CHECKPOINT_BUCKET to use a bucket of your own."
        )
    if memory is None:
        assumptions.append(unknown_shape_note(cfg.training.model_id))
    cpu, mem = m.worker_pod_size(cfg)
    d = cfg.derived
    mount = cfg.ray.shared_volume_path
    on_volume = checkpoints_on_volume(cfg)
    summary = {
        "cluster": cfg.cluster.name,
        "region": cfg.cluster.region,
        "gpu_node_type": gpu.name,
        "gpu_nodes": cfg.cluster.gpu_node_count,
        "gpus_per_worker_pod": d.ray_gpus_per_worker_pod,
        "efa_per_worker_pod": gpu.efa_interfaces,
        "worker_pod_cpu": cpu,
        "worker_pod_memory_gib": mem,
        "cluster_gpus": d.cluster_gpus,
        "world_size": d.world_size,
        "gpu_az": zones.gpu_az,
        "hf_token_secret": cfg.ray.hf_token_secret if hf_token else None,
        "checkpoint_bucket": bucket,
        "checkpoints": cfg.training.storage_path,
        "checkpoint_role": (
            f"ray.shared_volume {cfg.ray.shared_volume}, mounted at {mount} in every Ray pod"
            if on_volume
            else f"IAM role of service account {cfg.ray.namespace}/{m.RAY_SERVICE_ACCOUNT}, this bucket only"
        ),
        "checkpoint_storage": checkpoint_storage(cfg),  # what they take, and cost in S3
        "runtime_env": image_installs(cfg),
        # EBS is not priced here (the cost's note says so): the size and why.
        "system_node_volume": {
            "gib": eksctl.SYSTEM_VOLUME_GIB,
            "type": "gp3",
            "why": eksctl.SYSTEM_VOLUME_REASON,
        },
        "memory_per_gpu": memory.to_dict() if memory else None,
        "sharding": planned_sharding(cfg),
    }
    return Plan(
        mode=mode,
        steps=_steps(cfg, mode, hf_token=hf_token, gpu=gpu, zones=zones, code_dir=code_dir, bucket=bucket),
        helm_releases=releases,
        cost=cost_per_hour(cfg, gpu, system, on=on, market=market),
        files=files,
        assumptions=assumptions,
        summary=summary,
        texts=texts,
    )


def write_plan(
    cfg: Config, out_dir: str | Path, *, mode: Mode = "raycluster", hf_token: bool = False
) -> tuple[Plan, list[Path]]:
    """Build the plan and write its files under ``out_dir`` (created); returns the plan and the paths written.

    Nothing is written when a check fails. Example: ``write_plan(cfg, "plan-out")[1][-1].name == "plan.json"``.
    """
    plan = build_plan(cfg, mode=mode, hf_token=hf_token)  # raises before anything touches the disk
    return plan, write_files(plan, out_dir)
