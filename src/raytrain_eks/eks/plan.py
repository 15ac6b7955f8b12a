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

import difflib
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Literal

import yaml

from raytrain_eks.aws import eksctl
from raytrain_eks.config import Config
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.instances import (
    EFA_GPU_TYPES,
    EKS_CONTROL_PLANE_USD_PER_HOUR,
    EKS_EXTENDED_SUPPORT_USD_PER_HOUR,
    INSTANCE_TYPES,
    KNOWN_REGIONS,
    NAT_GATEWAY_USD_PER_HOUR,
    PRICE_REGION,
    QUOTA_CODES,
    InstanceType,
    eks_support,
    quota_family,
)
from raytrain_eks.k8s import job as job_files
from raytrain_eks.k8s import manifests as m

Mode = Literal["raycluster", "rayjob"]
MODES: tuple[Mode, ...] = ("raycluster", "rayjob")

PLAN_FILE = "plan.json"
HELM_FILE = "helm-releases.yaml"
NAMESPACE_FILE = "namespace.yaml"
JOB_CONFIG_FILE = "job-config.yaml"
MANIFEST_FILE: dict[Mode, str] = {"raycluster": "raycluster.yaml", "rayjob": "rayjob.yaml"}
CODE_CONFIG_MAP_FILE = "code-configmap.yaml"  # --mode rayjob: the package, mounted into the submitter pod
PACKAGE_ARCHIVE_FILE = "raytrain_eks-package.tar.gz.b64"  # --mode raycluster: the package, unpacked in the head pod


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


def check_deployable(cfg: Config) -> tuple[InstanceType, InstanceType]:
    """The GPU and system instance types, after checking what only deploying needs; every problem at once.

    Raises :class:`ConfigError` for a region outside the known list, an instance type that is unknown, has no GPU
    or no EFA, ``gpus_per_node`` that differs from the instance's GPUs, a worker pod larger than its node, or more
    training workers than GPUs. Example: ``check_deployable(cfg)[0].efa_interfaces``.
    """
    c, problems = cfg.cluster, []
    if c.region not in KNOWN_REGIONS:
        close = difflib.get_close_matches(c.region, KNOWN_REGIONS, n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else f"known: {', '.join(KNOWN_REGIONS)}"
        problems.append(f"cluster.region = {c.region!r}: not a region where raytrain-eks knows EKS runs; {hint}")
    gpu = INSTANCE_TYPES.get(c.gpu_node_type)
    if gpu is None:
        problems.append(
            f"cluster.gpu_node_type = {c.gpu_node_type!r}: unknown instance type; EFA GPU types: "
            f"{', '.join(EFA_GPU_TYPES)}"
        )
    elif not gpu.gpus:
        problems.append(
            f"cluster.gpu_node_type = {c.gpu_node_type!r}: has no GPU; use one of {', '.join(EFA_GPU_TYPES)}"
        )
    elif not gpu.efa_supported:
        problems.append(
            f"cluster.gpu_node_type = {c.gpu_node_type!r}: does not support EFA, so NCCL would fall back to TCP "
            f"sockets between nodes; use an EFA type such as {', '.join(EFA_GPU_TYPES[:4])}"
        )
    if gpu is not None and gpu.gpus and c.gpus_per_node != gpu.gpus:
        problems.append(
            f"cluster.gpus_per_node = {c.gpus_per_node} (GPUS_PER_NODE): {gpu.name} has {gpu.gpus} GPUs and each "
            f"worker pod takes a whole node; set GPUS_PER_NODE={gpu.gpus}"
        )
    if gpu is not None:
        cpu, mem = cfg.ray.worker_cpu, cfg.ray.worker_memory_gib
        if cpu is not None and cpu >= gpu.vcpu:
            problems.append(
                f"ray.worker_cpu = {cpu}: must be below the {gpu.vcpu} vCPUs of {gpu.name} (the kubelet and "
                "DaemonSets need some); leave it empty for 5/6 of the node"
            )
        if mem is not None and mem >= gpu.memory_gib:
            problems.append(
                f"ray.worker_memory_gib = {mem}: must be below the {gpu.memory_gib} GiB of {gpu.name}; "
                "leave it empty for 5/6 of the node"
            )
    system = INSTANCE_TYPES.get(c.system_node_type)
    if system is None:
        known = ", ".join(name for name, it in INSTANCE_TYPES.items() if not it.gpus)
        problems.append(f"cluster.system_node_type = {c.system_node_type!r}: unknown instance type; known: {known}")
    if c.gpu_nodegroup_name == eksctl.SYSTEM_NODEGROUP:
        problems.append(f"cluster.gpu_nodegroup_name = {c.gpu_nodegroup_name!r}: taken by the system node group")
    d = cfg.derived
    if d.world_size > d.cluster_gpus:
        problems.append(
            f"training.num_workers = {cfg.training.num_workers}: more than the {d.cluster_gpus} GPUs of the cluster "
            "(one worker per GPU); use 0 for one per GPU"
        )
    if problems or gpu is None or system is None:  # each None case has added a problem
        raise ConfigError(problems)
    return gpu, system


def helm_releases(cfg: Config) -> list[HelmRelease]:
    """The three pinned charts (infra-facts §1), device plugins first so GPUs and EFA exist before any Ray pod."""
    a = cfg.addons
    return [
        HelmRelease(
            name="nvidia-device-plugin",
            namespace="kube-system",
            repo_name="nvdp",
            repo_url="https://nvidia.github.io/k8s-device-plugin",
            chart="nvidia-device-plugin",
            version=a.nvidia_device_plugin_version,
            # The chart's default affinity (nvidia.com/gpu.present=true, set on the GPU node group) and its
            # default toleration of the nvidia.com/gpu taint are what we need; nothing to override.
            values={},
            purpose="advertises nvidia.com/gpu on the GPU nodes",
        ),
        HelmRelease(
            name="aws-efa-k8s-device-plugin",
            namespace="kube-system",
            repo_name="eks",
            repo_url="https://aws.github.io/eks-charts",
            chart="aws-efa-k8s-device-plugin",
            version=a.efa_device_plugin_version,
            # The chart tolerates only CriticalAddonsOnly; without this it would never run on the tainted GPU nodes.
            values={"tolerations": [dict(m.GPU_TOLERATION)]},
            purpose="advertises vpc.amazonaws.com/efa on the GPU nodes",
        ),
        HelmRelease(
            name="kuberay-operator",
            namespace="kuberay-system",
            repo_name="kuberay",
            repo_url="https://ray-project.github.io/kuberay-helm/",
            chart="kuberay-operator",
            version=a.kuberay_version,
            values={"nodeSelector": dict(m.SYSTEM_NODE_LABELS)},
            purpose="installs the RayCluster/RayJob CRDs and runs the operator on the system node",
        ),
    ]


def run_cost(cfg: Config, summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a run on the configured cluster cost while it ran, from its ``summary.json`` fields: the cluster's hourly
    cost times this attempt's ``wall_s``, and per million tokens this attempt trained (``tokens_per_s`` x
    ``train_s``: on a resumed run ``tokens`` also counts the steps before the resume). ``None`` when the cluster is
    not one this tool can price.

    Example: 9.5498 $/h for 600 s and 30 M tokens -> ``{"usd": 1.5916, "usd_per_million_tokens": 0.0531, ...}``.
    """
    try:
        gpu, system = check_deployable(cfg)
    except UserError:
        return None
    hourly = cost_per_hour(cfg, gpu, system)
    usd = hourly["total_usd"] * summary["wall_s"] / 3600
    tokens = round(summary["tokens_per_s"] * summary["train_s"])
    return {
        "usd": round(usd, 4),
        "usd_per_million_tokens": round(usd / tokens * 1e6, 4) if tokens else None,
        "usd_per_hour": hourly["total_usd"],
        "basis": f"{hourly['price_region']} on-demand prices x the run's wall time; excludes EBS, data and IPv4",
    }


def cost_per_hour(cfg: Config, gpu: InstanceType, system: InstanceType, *, on: date | None = None) -> dict[str, Any]:
    """Hourly on-demand cost, one item per billable thing (us-east-1 prices, infra-facts §7), on day ``on`` (default
    today): the control plane costs more while its Kubernetes version is in EKS extended support.

    Example (reference, Kubernetes 1.36 in standard support): 2 x 4.6016 + 0.2016 + 0.10 + 0.045 = 9.5498.
    """
    c = cfg.cluster
    support = eks_support(c.k8s_version, on or date.today())

    def item(name: str, what: str, count: int, unit: float | None) -> dict[str, Any]:
        usd = None if unit is None else round(count * unit, 6)
        return {"name": name, "what": what, "count": count, "unit_usd_per_hour": unit, "usd_per_hour": usd}

    items = [
        item("GPU instances", gpu.name, c.gpu_node_count, gpu.usd_per_hour),
        item("system node", system.name, c.system_node_count, system.usd_per_hour),
        item(
            "EKS control plane",
            f"cluster on Kubernetes {c.k8s_version}, {support.period} support",
            1,
            support.control_plane_usd_per_hour,
        ),
        item("NAT gateway", "vpc.nat.gateway: Single", 1, NAT_GATEWAY_USD_PER_HOUR),
    ]
    known = [i["usd_per_hour"] for i in items if i["usd_per_hour"] is not None]
    notes = [
        "Excludes EBS volumes, NAT data processing ($0.045/GB), public IPv4 addresses ($0.005/h each) and data "
        "transfer.",
    ]
    ends = f" until {support.ends.isoformat()}" if support.ends else ""
    if support.period == "standard":
        notes.append(
            f"Kubernetes {c.k8s_version} is in EKS standard support{ends} (${EKS_CONTROL_PLANE_USD_PER_HOUR:.2f}/h); "
            f"after that, extended support costs ${EKS_EXTENDED_SUPPORT_USD_PER_HOUR:.2f}/h."
        )
    elif support.period == "extended":
        notes.append(
            f"Kubernetes {c.k8s_version} is in EKS extended support{ends}: the control plane costs "
            f"${EKS_EXTENDED_SUPPORT_USD_PER_HOUR:.2f}/h instead of ${EKS_CONTROL_PLANE_USD_PER_HOUR:.2f}/h; a "
            "newer version (K8S_VERSION) costs less."
        )
    else:
        since = f" (its extended support ended {support.ends.isoformat()})" if support.ends else ""
        notes.append(
            f"Kubernetes {c.k8s_version} is no longer supported by EKS{since}: a new cluster cannot be created with "
            "it; choose a newer K8S_VERSION."
        )
    if c.region != PRICE_REGION:
        notes.append(f"Prices are {PRICE_REGION}'s; {c.region} differs.")
    missing = [i["what"] for i in items if i["usd_per_hour"] is None]
    if missing:
        notes.append(f"No price known for {', '.join(missing)}: the total leaves it out.")
    return {
        "total_usd": round(sum(known), 4),
        "complete": not missing,
        "currency": "USD",
        "price_region": PRICE_REGION,
        "items": items,
        "notes": notes,
    }


def _quota(instance: str) -> str:
    """The on-demand vCPU quota ``instance`` draws on, in words: ``G quota (L-DB2E81BA)``."""
    family = quota_family(instance)
    return f"{family} quota ({QUOTA_CODES[family]})" if family else f"own quota of {instance}'s family"


def _steps(
    cfg: Config, mode: Mode, *, hf_token: bool, gpu: InstanceType, zones: eksctl.Zones, code_dir: str
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
            "create-cluster",
            f"Create EKS cluster {c.name} (Kubernetes {c.k8s_version}, OIDC, private subnets in "
            f"{', '.join(zones.cluster_azs)} behind one NAT gateway), node group {eksctl.SYSTEM_NODEGROUP} "
            f"({c.system_node_count} x {c.system_node_type}) and EFA node group {c.gpu_nodegroup_name} "
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
            "remove-eksctl-device-plugins",
            "Delete the device-plugin DaemonSets eksctl applies by itself (EFA always, NVIDIA when the cluster was "
            "created without --install-nvidia-plugin=false), so that only the pinned charts run: never two plugins "
            "on one node.",
            [
                "kubectl",
                "delete",
                "daemonset",
                "--namespace",
                "kube-system",
                "--ignore-not-found",
                eksctl.EKSCTL_NVIDIA_PLUGIN_DAEMONSET,
                eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET,
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
    if ns != "default":
        steps.append(
            Step("namespace", f"Create namespace {ns}.", ["kubectl", "apply", "-f", NAMESPACE_FILE], [NAMESPACE_FILE])
        )
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
            f"at {m.CONFIG_DIR}.",
            ["kubectl", "apply", "-f", JOB_CONFIG_FILE],
            [JOB_CONFIG_FILE],
        )
    )
    manifest = MANIFEST_FILE[mode]
    head_exec = ["kubectl", "exec", "--namespace", ns, f"service/{r.cluster_name}-head-svc", "-c", "ray-head"]
    workers = f"{c.gpu_node_count} worker pods (one per GPU node, {d.ray_gpus_per_worker_pod} GPUs each)"
    if mode == "raycluster":
        steps += [
            Step(
                "apply-raycluster",
                f"Apply RayCluster {ns}/{r.cluster_name}: a GPU-less head on the system node and {workers}.",
                ["kubectl", "apply", "-f", manifest],
                [manifest],
            ),
            Step("wait-raycluster", f"Wait until the head and the {c.gpu_node_count} worker pods are running."),
            Step(
                "upload-package",
                f"Unpack the raytrain_eks package ({PACKAGE_ARCHIVE_FILE}, a base64 tar.gz read on stdin) into "
                f"{code_dir} in the head pod: the image has no copy of it, and the job's runtime_env ships it to "
                "every worker from there (py_modules).",
                [*head_exec, "-i", "--", *job_files.unpack_argv(code_dir)],
                [PACKAGE_ARCHIVE_FILE],
                stdin=PACKAGE_ARCHIVE_FILE,
            ),
            Step(
                "submit",
                f"Run the job from inside the head pod (the dashboard port stays inside the cluster): "
                f"{shlex.join(m.train_argv())} on {d.world_size} workers, with a runtime_env that pip-installs the "
                "pinned packages the image lacks and ships the package unpacked above.",
                [*head_exec, "--", *job_files.ray_job_submit_argv(code_dir)],
            ),
        ]
    else:
        steps += [
            Step(
                "code-configmap",
                f"Store the raytrain_eks package as ConfigMap {ns}/{r.cluster_name}-code; the RayJob's submitter pod "
                f"mounts it at {job_files.SUBMITTER_CODE_DIR}, where the job's runtime_env ships it to every worker "
                "from (py_modules). Server-side apply: the package is too large for kubectl's last-applied "
                "annotation.",
                ["kubectl", "apply", "--server-side", "-f", CODE_CONFIG_MAP_FILE],
                [CODE_CONFIG_MAP_FILE],
            ),
            Step(
                "apply-rayjob",
                f"Apply RayJob {ns}/{r.cluster_name}: its own RayCluster ({workers}) runs "
                f"{shlex.join(m.train_argv())}; the cluster is deleted {m.RAYJOB_TTL_S} s after the job ends, "
                f"or after {r.job_deadline_s} s, or if it is not running within {r.job_start_deadline_s} s.",
                ["kubectl", "apply", "-f", manifest],
                [manifest],
            ),
            Step("wait-rayjob", "Follow the job until it succeeds or fails."),
        ]
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
                f"Scale node group {c.gpu_nodegroup_name} to 0 so the GPU instances stop billing once the job ended "
                "(the RayJob removes its pods, not the nodes).",
                eksctl.scale_gpu_nodegroup_argv(cfg, 0),
            )
        )
    return steps


def build_plan(cfg: Config, *, mode: Mode = "raycluster", hf_token: bool = False, on: date | None = None) -> Plan:
    """Check the config for deploying and build the whole plan in memory. ``hf_token``: a token will be given
    (the pods then read ``HF_TOKEN`` from the Secret); its value is never an input here. ``on``: the day the cost
    is for (default today; it decides whether the Kubernetes version is in EKS extended support)."""
    if mode not in MODES:
        raise UserError(f"--mode {mode!r} is not known", hint=f"Choose one of: {', '.join(MODES)}.")
    gpu, system = check_deployable(cfg)
    zones = eksctl.planned_zones(cfg)
    releases = helm_releases(cfg)
    shipped = job_files.package_files()
    texts: dict[str, str] = {}
    if mode == "raycluster":
        job = m.raycluster(cfg, hf_token=hf_token)
        texts[PACKAGE_ARCHIVE_FILE] = job_files.package_archive(shipped)
    else:
        code_map, items = job_files.code_config_map(cfg, shipped)
        job = job_files.rayjob_manifest(cfg, hf_token=hf_token, code_map=code_map, items=items)
    files: dict[str, list[dict[str, Any]]] = {
        eksctl.CONFIG_FILE: [eksctl.cluster_config(cfg, zones)],
        HELM_FILE: [{"releases": [r.to_dict() for r in releases]}],
        JOB_CONFIG_FILE: [m.job_config_map(cfg)],
        MANIFEST_FILE[mode]: [job],
    }
    files.update({r.values_file: [r.values] for r in releases})
    if mode == "rayjob":
        files[CODE_CONFIG_MAP_FILE] = [code_map]
    if cfg.ray.namespace != "default":
        files[NAMESPACE_FILE] = [m.namespace(cfg)]
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
    cpu, mem = m.worker_pod_size(cfg)
    d = cfg.derived
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
    }
    return Plan(
        mode=mode,
        steps=_steps(cfg, mode, hf_token=hf_token, gpu=gpu, zones=zones, code_dir=job_files.head_code_dir(shipped)),
        helm_releases=releases,
        cost=cost_per_hour(cfg, gpu, system, on=on),
        files=files,
        assumptions=assumptions,
        summary=summary,
        texts=texts,
    )


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's embedded YAML) as ``|`` blocks, readable in review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(docs: list[dict[str, Any]]) -> str:
    """Documents as YAML, ``---`` between them, keys in the order they were built."""
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def write_plan(
    cfg: Config, out_dir: str | Path, *, mode: Mode = "raycluster", hf_token: bool = False
) -> tuple[Plan, list[Path]]:
    """Build the plan and write its files under ``out_dir`` (created); returns the plan and the paths written.

    Nothing is written when a check fails. Example: ``write_plan(cfg, "plan-out")[1][-1].name == "plan.json"``.
    """
    plan = build_plan(cfg, mode=mode, hf_token=hf_token)  # raises before anything touches the disk
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
    return plan, written
