"""What ``deploy`` would create, apply and submit, and what it costs per hour: pure, offline, no credentials.

:func:`build_plan` checks the configuration against the instance table (EFA, GPU count, pod size, region) and
returns a :class:`Plan`: the ordered steps, the pinned Helm releases, the eksctl ClusterConfig, the Kubernetes
objects and the hourly cost. :func:`write_plan` dumps it to a folder, writing nothing unless every check passed.
Example::

    plan = build_plan(cfg, mode="rayjob")
    plan.cost["total_usd"]  # about 9.55 for the reference
    write_plan(cfg, Path("plan-out"))  # eksctl-cluster.yaml, raycluster.yaml, helm/..., plan.json
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Literal

from raytrain_eks.aws import eksctl
from raytrain_eks.config import Config
from raytrain_eks.eks import irsa
from raytrain_eks.eks.buckets import planned_bucket, storage_estimate
from raytrain_eks.eks.fit import fit_on_image, sharding_line
from raytrain_eks.eks.pricing import check_deployable, cost_per_hour
from raytrain_eks.eks.submit import job_config
from raytrain_eks.errors import UserError
from raytrain_eks.instances import (
    QUOTA_CODES,
    InstanceType,
    quota_family,
)
from raytrain_eks.k8s import job as job_files
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s import wheelhouse
from raytrain_eks.k8s.addons import HelmRelease, helm_releases, node_words
from raytrain_eks.k8s.manifests import to_yaml
from raytrain_eks.k8s.state import with_bucket_storage, with_shared_volume
from raytrain_eks.train.memory import planned_layout, unknown_shape_note

Mode = Literal["raycluster", "rayjob"]
MODES: tuple[Mode, ...] = ("raycluster", "rayjob")
BUCKET_SUFFIX_PLACEHOLDER = "xxxxxxxx"

PLAN_FILE = "plan.json"
HELM_FILE = "helm-releases.yaml"
NAMESPACE_FILE = "namespace.yaml"
JOB_CONFIG_FILE = "job-config.yaml"
MANIFEST_FILE: dict[Mode, str] = {"raycluster": "raycluster.yaml", "rayjob": "rayjob.yaml"}
CODE_CONFIG_MAP_FILE = "code-configmap.yaml"  # --mode rayjob: the package, mounted into the submitter pod
PACKAGE_ARCHIVE_FILE = "raytrain_eks-package.tar.gz.b64"  # --mode raycluster: the package, unpacked in the head pod


@dataclass(frozen=True)
class Step:
    """One step of the deploy, in order: its ``name``, what it would do, and the command when it is one."""

    name: str
    action: str
    command: list[str] | None = None
    files: list[str] = field(default_factory=list)
    stdin: str | None = None  # a file of the plan folder the command reads on its standard input

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "action": self.action, "command": self.command, "files": self.files}
        if self.stdin is not None:
            out["stdin"] = self.stdin
        return out


@dataclass(frozen=True)
class Plan:
    """Everything ``deploy`` would do. ``files`` maps a relative path to the documents written there, ``texts`` a
    relative path to a file's text (the package archive a command reads on stdin)."""

    mode: Mode
    steps: list[Step]
    helm_releases: list[HelmRelease]
    cost: dict[str, Any]
    files: dict[str, list[dict[str, Any]]]
    assumptions: list[str]
    summary: dict[str, Any]
    texts: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "commands_run_in": "the plan folder: file paths in commands are relative to it",
            "summary": self.summary,
            "assumptions": self.assumptions,
            "steps": [s.to_dict() for s in self.steps],
            "helm_releases": [r.to_dict() for r in self.helm_releases],
            "cost_per_hour": self.cost,
            "files": sorted([*self.files, *self.texts, PLAN_FILE]),
        }


def _quota(instance: str) -> str:
    """The on-demand vCPU quota ``instance`` draws on, in words: ``G quota (L-DB2E81BA)``."""
    family = quota_family(instance)
    return f"{family} quota ({QUOTA_CODES[family]})" if family else f"own quota of {instance}'s family"


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
            f"({c.gpu_node_count} x {gpu.name} in {zones.gpu_az}, "
            + (
                f"launched into capacity reservation {c.capacity_reservation_id})."
                if c.capacity_reservation_id
                else "with the cluster placement group eksctl adds)."
            ),
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


def job_steps(
    cfg: Config,
    mode: Mode,
    *,
    hf_token: bool,
    code_dir: str,
    kubectl: tuple[str, ...] = ("kubectl",),
    after_namespace: tuple[Step, ...] = (),
) -> list[Step]:
    """The steps of ``submit`` on any target, in order: the namespace (when not ``default``), ``after_namespace``
    (a target's own objects there), the token's Secret, the job's ConfigMap, then the RayCluster or RayJob and what
    runs the job on it; ``--offline``'s wheelhouse comes before the Secret and the ConfigMap. ``kubectl``: the
    program and flags the command lines start with."""
    c, r, d = cfg.cluster, cfg.ray, cfg.derived
    head_where = node_words(m.head_node_selector(cfg))
    ns = r.namespace
    steps: list[Step] = []
    if ns != "default":
        steps.append(
            Step("namespace", f"Create namespace {ns}.", [*kubectl, "apply", "-f", NAMESPACE_FILE], [NAMESPACE_FILE])
        )
    steps += after_namespace
    if hf_token:
        steps.append(
            Step(
                "hf-token-secret",
                f"Create Secret {ns}/{r.hf_token_secret} (key {m.HF_TOKEN_KEY}) from the HF_TOKEN environment "
                "variable of this shell, through the Kubernetes API. The value is never written to a file, a "
                "command line or a log; the pods read it with secretKeyRef.",
            )
        )
    steps.append(
        Step(
            "job-config",
            f"Store the resolved configuration as ConfigMap {ns}/{m.config_map_name(cfg)}, mounted in the head pod "
            f"at {m.CONFIG_DIR}: training.method {cfg.training.method}, learning_rate {cfg.training.learning_rate!r} "
            f"({cfg.training.learning_rate_reason}).",
            [*kubectl, "apply", "-f", JOB_CONFIG_FILE],
            [JOB_CONFIG_FILE],
        )
    )
    manifest = MANIFEST_FILE[mode]
    sharding = sharding_line(cfg)
    head_exec = [*kubectl, "exec", "--namespace", ns, f"service/{r.cluster_name}-head-svc", "-c", "ray-head"]
    workers = f"{c.gpu_node_count} worker pods (one per GPU node, {d.ray_gpus_per_worker_pod} GPUs each)"
    if mode == "raycluster":
        steps += [
            Step(
                "apply-raycluster",
                f"Apply RayCluster {ns}/{r.cluster_name}: a GPU-less head {head_where} and {workers}.",
                [*kubectl, "apply", "-f", manifest],
                [manifest],
            ),
            Step("wait-raycluster", f"Wait until the head and the {c.gpu_node_count} worker pods are running."),
            Step(
                "upload-package",
                f"Unpack the raytrain_eks package ({PACKAGE_ARCHIVE_FILE}, a base64 tar.gz read on stdin) into "
                f"{code_dir} in the head pod: the image has no copy of it, and the job's runtime_env ships it to "
                "every worker from there (py_modules). Packages the image lacks that travel unpacked (below) are "
                f"unpacked the same way into {job_files.HEAD_CODE_ROOT}/packages-DIGEST by submit.",
                [*head_exec, "-i", "--", *job_files.unpack_argv(code_dir)],
                [PACKAGE_ARCHIVE_FILE],
                stdin=PACKAGE_ARCHIVE_FILE,
            ),
            Step(
                "submit",
                f"Run the job from inside the head pod (the dashboard port stays inside the cluster): "
                f"{shlex.join(m.train_argv())} on {d.world_size} workers; {sharding}; with a runtime_env that ships "
                f"the package unpacked above and brings those of {', '.join(job_files.job_requirements())} the "
                "image does not have in range (asked of the head pod's python3 first): unpacked beside it, each "
                "top-level folder one more py_modules entry, else pip (the command below lists them all for pip). "
                + image_installs(cfg)["how"],
                [*head_exec, "--", *job_files.ray_job_submit_argv(code_dir)],
            ),
        ]
    else:
        steps += [
            Step(
                "check-no-raycluster",
                f"Refuse while RayCluster {ns}/{r.cluster_name} (of --mode raycluster) exists: its worker pods hold "
                "the GPU nodes, and the RayJob's own RayCluster would wait for GPUs until its start deadline. "
                "Nothing is deleted; the message names the command that deletes it.",
            ),
            Step(
                "code-configmap",
                f"Store the raytrain_eks package (a tar.gz) as ConfigMap {ns}/{r.cluster_name}-code; the RayJob's "
                f"submitter pod mounts it at {job_files.SUBMITTER_ARCHIVE_DIR} and unpacks it into "
                f"{job_files.SUBMITTER_CODE_DIR}, where the job's runtime_env ships it to every worker from "
                "(py_modules). Server-side apply: the package is too large for kubectl's last-applied annotation. "
                f"Packages that travel unpacked (below) go as ConfigMap {ns}/{r.cluster_name}-packages, unpacked by "
                f"the submitter pod into {job_files.SUBMITTER_PACKAGES_DIR}.",
                [*kubectl, "apply", "--server-side", "-f", CODE_CONFIG_MAP_FILE],
                [CODE_CONFIG_MAP_FILE],
            ),
            Step(
                "apply-rayjob",
                f"Apply RayJob {ns}/{r.cluster_name}: its own RayCluster ({workers}) runs "
                f"{shlex.join(m.train_argv())}, submitted by its submitter pod under {m.IMAGE_PYTHON}; {sharding}; "
                f"the job is stopped after {r.job_deadline_s} s, or if it is not running within "
                f"{r.job_start_deadline_s} s. "
                f"KubeRay deletes the cluster {m.RAYJOB_TTL_S} s after the job ended unless submit has (below). "
                "Its runtime_env is fixed before a pod exists, so submit first asks the image which of "
                + ", ".join(job_files.job_requirements())
                + " it has in range (what an earlier submit remembered of it, else a short-lived pod of the image on "
                "a node the workers use) and applies the RayJob with only the others; the file here lists them all "
                "for pip. " + image_installs(cfg)["how"],
                [*kubectl, "apply", "-f", manifest],
                [manifest],
            ),
            Step("wait-rayjob", "Follow the job until it succeeds or fails."),
        ]
    if cfg.ray.offline:  # before the token's Secret, the job's ConfigMap and any Ray object
        at = next(i for i, s in enumerate(steps) if s.name in ("hf-token-secret", "job-config"))
        steps.insert(at, Step("offline-wheelhouse", _offline_step(cfg, mode)))
    return steps


def planned_sharding(cfg: Config) -> dict[str, Any]:
    """For plan.json: the sharding the job's ``training.sharding`` gives on the planned GPUs, the one the memory
    estimate assumes: ``mode``, ``mesh_shape`` (``[nodes, ranks per node]`` for hsdp, ``[ranks]`` for fsdp, ``[]``
    for none) and ``line`` (:func:`~raytrain_eks.eks.fit.sharding_line`, which the job's step says too)."""
    layout = planned_layout(cfg)
    return {"mode": layout.mode, "mesh_shape": list(layout.mesh_shape), "line": sharding_line(cfg)}


# How submit brings what the image lacks, in words (eks/offline.py's choose).
_PACKAGES_RULE = (
    "submit downloads here the wheels of what the image lacks in range, for its Python: pure-Python ones travel "
    "unpacked beside the package (py_modules), so the runtime_env has no pip and no node copies the image's Python; "
    "compiled ones (or more than {max} packages) pip installs, after Ray copies the image's whole virtualenv on every "
    "node"
)


def image_installs(cfg: Config) -> dict[str, Any]:
    """How the job's packages beyond ``ray.image`` reach it, where this tool knows the image's packages
    (:func:`~raytrain_eks.k8s.job.planned_installs`): ``installs``, what pip installs, and ``ships``, what travels
    unpacked in py_modules (:func:`~raytrain_eks.k8s.job.expected_not_shipped`; both ``None`` for an image not
    known); ``local_only``, what the job never gets on the cluster; ``how``, that in words. Example (the DLC):
    ``{"installs": [], "ships": ["peft>=0.21.2,<0.22"], "local_only": ["matplotlib"], "how": "The image has 9 of
    ..."}``."""
    local = sorted(job_files.LOCAL_ONLY)
    kept = (
        f"{', '.join(local)} (the report's plots) is not shipped: on an image without it the run writes its metrics "
        "and no report, and `raytrain-eks results` draws the report here."
    )
    rule = _PACKAGES_RULE.format(max=job_files.MAX_SHIPPED)
    known = job_files.planned_installs(cfg.ray.image)
    if known is None:
        how = f"Which of them {cfg.ray.image} has is known only once it runs (submit says so): {rule}. {kept}"
        return {"installs": None, "ships": None, "local_only": local, "how": how}
    left, said = known
    if not left:
        return {"installs": [], "ships": [], "local_only": local, "how": f"{said}: the job adds nothing. {kept}"}
    why = job_files.expected_not_shipped(cfg.ray.image, left)
    if why is None:
        how = (
            f"{said}: {', '.join(left)} {'travels' if len(left) == 1 else 'travel'} unpacked beside the package "
            "(py_modules), as pure-Python wheels whose dependencies the image has (so are the copies installed "
            "here; submit checks the wheels it downloads for the image's Python): the runtime_env has no pip, and "
            f"no node copies the image's Python. {kept}"
        )
        return {"installs": [], "ships": left, "local_only": local, "how": how}
    how = (
        f"{said}: pip installs {', '.join(left)} there ({why}), after Ray copies the image's whole virtualenv on "
        f"every node. {kept}"
    )
    return {"installs": left, "ships": [], "local_only": local, "how": how}


def _offline_step(cfg: Config, mode: Mode) -> str:
    """What ``submit --offline`` does; the wheels and their size are known only once the image is asked."""
    sources = ["the Ray head pod's python3 when this RayCluster already runs"] if mode == "raycluster" else []
    if not wheelhouse.on_volume(cfg):  # a wheelhouse for the volume is written through a pod: one is always asked
        sources.append("what an earlier `submit --offline` remembered of this image")
    sources.append(
        f"a short-lived pod {cfg.ray.namespace}/{cfg.ray.cluster_name}{wheelhouse.PROBE_POD_SUFFIX} of the image on a "
        "node the workers use (deleted again)"
    )
    return (
        "--offline, before any Ray object: read the image's Python, platform tags and packages from "
        + ", else from ".join(sources)
        + ". Download here wheels (`pip download --no-deps --only-binary=:all:` for that Python "
        "and platform) of those of " + ", ".join(job_files.job_requirements()) + " the image lacks in range and of "
        "their dependencies the image does not meet; submit prints each wheel and the total size, and stops "
        "(exit 2) naming a package without a wheel. When every one is pure Python they travel unpacked beside the "
        "package (py_modules), and what follows is not done. "
        + (
            f"Write them through that pod onto ray.shared_volume {cfg.ray.shared_volume} at "
            f"{wheelhouse.storage_location(cfg)}/DIGEST (in pieces, each file checked against the manifest, which is "
            "written last); every Ray pod mounts it, and the runtime_env installs with --no-index --find-links there."
            if wheelhouse.on_volume(cfg)
            else "Upload them with a manifest (names, sizes, sha256; written last) to "
            f"{cfg.training.storage_path or 'training.storage_path'}/{wheelhouse.STORAGE_FOLDER}/DIGEST; every Ray "
            f"pod copies them into {wheelhouse.WHEELS_DIR}/DIGEST (an init container"
            + (", and an exec in pods of an earlier RayCluster" if mode == "raycluster" else "")
            + "), and the runtime_env installs with --no-index --find-links there."
        )
    )


def job_objects(
    cfg: Config, mode: Mode, *, hf_token: bool
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], str]:
    """What :func:`job_steps` applies and reads, on any target: the files (the job's ConfigMap, the RayCluster or
    the RayJob with its code ConfigMap, the namespace when not ``default``), the texts (the package archive of
    ``--mode raycluster``), and the folder of the head pod the package is unpacked into."""
    shipped = job_files.package_files()
    texts: dict[str, str] = {}
    files: dict[str, list[dict[str, Any]]] = {JOB_CONFIG_FILE: [m.job_config_map(cfg)]}
    if mode == "raycluster":
        files[MANIFEST_FILE[mode]] = [m.raycluster(cfg, hf_token=hf_token)]
        texts[PACKAGE_ARCHIVE_FILE] = job_files.package_archive(shipped)
    else:
        code_map, items = job_files.code_config_map(cfg, shipped)
        job = job_files.rayjob_manifest(cfg, hf_token=hf_token, code_map=code_map, items=items)
        files[MANIFEST_FILE[mode]] = [job]
        files[CODE_CONFIG_MAP_FILE] = [code_map]
    if cfg.ray.namespace != "default":
        files[NAMESPACE_FILE] = [m.namespace(cfg)]
    return files, texts, job_files.head_code_dir(shipped)


def helm_files(releases: list[HelmRelease]) -> dict[str, list[dict[str, Any]]]:
    """``helm-releases.yaml`` (every pinned release) and each release's values file."""
    files: dict[str, list[dict[str, Any]]] = {HELM_FILE: [{"releases": [r.to_dict() for r in releases]}]}
    files.update({r.values_file: [r.values] for r in releases})
    return files


def checkpoints_on_volume(cfg: Config) -> bool:
    """Whether ``training.storage_path`` is on ``ray.shared_volume`` (its mount path or a folder under it)."""
    stored, mount = cfg.training.storage_path or "", cfg.ray.shared_volume_path
    return bool(cfg.ray.shared_volume) and (stored == mount or stored.startswith(f"{mount}/"))


def checkpoint_storage(cfg: Config) -> dict[str, Any] | None:
    """:func:`~raytrain_eks.eks.buckets.storage_estimate` for where the checkpoints go: S3 (priced), the shared
    volume, or another place (size only)."""
    stored = cfg.training.storage_path or ""
    if checkpoints_on_volume(cfg):
        where = f"ray.shared_volume {cfg.ray.shared_volume}"
    else:
        where = "S3" if stored.startswith("s3://") else stored or "the run folder"
    return storage_estimate(cfg, where=where)


def build_plan(cfg: Config, *, mode: Mode = "raycluster", hf_token: bool = False, on: date | None = None) -> Plan:
    """Check the config for deploying and build the whole plan in memory. ``hf_token``: a token will be given
    (the pods then read ``HF_TOKEN`` from the Secret); its value is never an input here. ``on``: the day the cost
    is for (default today; it decides whether the Kubernetes version is in EKS extended support)."""
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
            f"Facts for {', '.join(unverified)} are not from infra-facts.md; deploy re-reads the EC2 API."
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
        cost=cost_per_hour(cfg, gpu, system, on=on),
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


def write_files(plan: Plan, out_dir: str | Path) -> list[Path]:
    """Write a built ``plan``'s files and ``plan.json`` under ``out_dir`` (created); returns the paths written.
    Example: ``write_files(plan, "plan-out")[-1].name == "plan.json"``."""
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise UserError(f"--output-dir {str(root)!r} is a file", hint="Give a folder (it is created if missing).")
    written = []
    for rel, docs in sorted(plan.files.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(to_yaml(docs))
        written.append(path)
    for rel, text in sorted(plan.texts.items()):
        path = root / rel
        path.write_text(text)
        written.append(path)
    path = root / PLAN_FILE
    path.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    written.append(path)
    return written
