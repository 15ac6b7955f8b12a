"""RayCluster, RayJob and the core objects beside them, as plain dicts built by pure functions of the config.

Nothing here talks to a cluster or writes a file; YAML is dumped at the edge (:mod:`raytrain_eks.deploy.plan`). Every
number that appears twice comes from one place: Ray's ``num-gpus`` and the pod's ``nvidia.com/gpu`` from
``cfg.derived.ray_gpus_per_worker_pod``, the EFA count from the instance table, CPU and memory from the instance
size unless set. The Hugging Face token is only ever *referenced* (a Secret key); :func:`hf_token_secret` builds
the Secret for the API and its result must never be dumped. Example::

    doc = raycluster(cfg, hf_token=True)
    doc["spec"]["workerGroupSpecs"][0]["replicas"]  # 2 on the reference
"""

from __future__ import annotations

import copy
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.k8s.placement import placement_for

# Labels and taint of the node groups (set in the eksctl ClusterConfig); pods select and tolerate them.
SYSTEM_NODE_LABELS: dict[str, str] = {"role": "system"}
# nvidia.com/gpu.present is what the NVIDIA device-plugin chart's affinity looks for; nothing on EKS sets it.
GPU_NODE_LABELS: dict[str, str] = {"role": "gpu-worker", "nvidia.com/gpu.present": "true"}
GPU_TAINT: dict[str, str] = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
GPU_TOLERATION: dict[str, str] = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}

GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
WORKER_GROUP = "gpu-workers"
HF_TOKEN_ENV = "HF_TOKEN"
HF_TOKEN_KEY = "token"
CONFIG_DIR = "/etc/raytrain-eks"
CONFIG_FILE = "raytrain-eks.yaml"
RAY_LOG_DIR = "/tmp/ray"
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
# How long after a RayJob's end KubeRay deletes its RayCluster (ttlSecondsAfterFinished; the operator counts from
# status.endTime, the moment it saw the job end: handleShutdownAfterJobFinishes in
# ray-operator/controllers/ray/rayjob_controller.go, v1.7.0). `submit` reads the evidence in the pods (NCCL's lines,
# fi_info, nvidia-smi) and then deletes the cluster itself: this is only the backstop for when it is not there to
# (interrupted, or the plan's rayjob.yaml applied by hand), long enough never to cut the reading short.
RAYJOB_TTL_S = 3600
# The Ray pods' service account: eksctl gives it an IAM role that may use the checkpoint bucket (IRSA).
RAY_SERVICE_ACCOUNT = "raytrain-eks-ray"
# The interpreter every command run inside the image calls: the reference's scripts rely on python3 only (a bare
# `python` is not promised by the image).
IMAGE_PYTHON = "python3"
# Before a Ray pod is killed, a clean `ray stop` lets its raylet and workers (and on the head the GCS and the job's
# driver) shut down instead of dying mid-write; the reference has it on the head and on the workers.
RAY_STOP_HOOK: dict[str, object] = {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}}
# The environment of a container that must see no GPU (the Ray head; a RayJob's submitter): "void" keeps the NVIDIA
# container runtime from exposing any GPU to it, whatever node it lands on.
NO_GPU_ENV: dict[str, str] = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}


def merge(base: Mapping[str, object], over: Mapping[str, object]) -> dict[str, object]:
    """A new dict: ``over`` laid on ``base``, mappings merged key by key, anything else replaced. No input changes.

    Example: ``merge({"a": {"x": 1}}, {"a": {"y": 2}}) == {"a": {"x": 1, "y": 2}}``.
    """
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(held := out.get(key), Mapping):
            out[key] = merge(held, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def labels(cfg: Config) -> dict[str, str]:
    """Labels on every object raytrain-eks creates, so status and teardown can find them."""
    return {"app.kubernetes.io/managed-by": "raytrain-eks", "app.kubernetes.io/instance": cfg.ray.cluster_name}


def _meta(cfg: Config, name: str) -> dict[str, object]:
    return {"name": name, "namespace": cfg.ray.namespace, "labels": labels(cfg)}


def namespace(cfg: Config) -> dict[str, object]:
    """The namespace of the Ray objects."""
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": cfg.ray.namespace, "labels": labels(cfg)}}


def config_map_name(cfg: Config) -> str:
    return f"{cfg.ray.cluster_name}-config"


def job_config_map(cfg: Config) -> dict[str, Any]:
    """The resolved configuration as a ConfigMap, mounted into the head pod for the job's driver.

    The driver then reads exactly the settings the plan was made from (``train --config``), instead of a
    second copy typed into flags. It holds no secret: the Hugging Face token is not a setting.
    """
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cfg, config_map_name(cfg)),
        "data": {CONFIG_FILE: cfg.to_yaml()},
    }


def hf_token_env(cfg: Config) -> dict[str, object]:
    """The container environment entry that reads the token from the Secret (the value never enters a manifest)."""
    ref = {"name": cfg.ray.hf_token_secret, "key": HF_TOKEN_KEY}
    return {"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}}


def hf_token_secret(cfg: Config, token: str) -> dict[str, object]:
    """The Secret holding the token, for the Kubernetes API only: never dump, print or log the result."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(cfg, cfg.ray.hf_token_secret),
        "type": "Opaque",
        "stringData": {HF_TOKEN_KEY: token},
    }


# What `submit` passes from its environment to the job (Hugging Face, W&B and MLflow settings and credentials):
# into a Secret through the API, read by the Ray pods (envFrom, optional), never written into a manifest or argv.
# HF_TOKEN has a Secret of its own (ray.hf_token_secret).
JOB_ENV_PREFIXES = ("HF_", "HUGGING_FACE_", "WANDB_", "MLFLOW_")


def passed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` the job receives: those of :data:`JOB_ENV_PREFIXES` with a value, but HF_TOKEN."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(JOB_ENV_PREFIXES) and v and k != HF_TOKEN_ENV}


def job_env_secret_name(cfg: Config) -> str:
    return f"{cfg.ray.cluster_name}-job-env"


def job_env_secret(cfg: Config, values: Mapping[str, str]) -> dict[str, object]:
    """The Secret holding :func:`passed_env`'s variables, for the Kubernetes API only: never dump or log it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(cfg, job_env_secret_name(cfg)),
        "type": "Opaque",
        "stringData": dict(values),
    }


def _job_env_from(cfg: Config) -> list[dict[str, object]]:
    # optional: pods start without it (nothing passed); a running pod keeps the values it started with.
    return [{"secretRef": {"name": job_env_secret_name(cfg), "optional": True}}]


def train_argv() -> list[str]:
    """The job's command inside the cluster: join the running Ray cluster and train with the mounted config.

    Every setting travels in the mounted ConfigMap (:func:`job_config_map`), none as a flag, so nothing typed by
    a user is ever spliced into a command line. The module form, because the package reaches the image through
    the job's runtime_env (``py_modules``), which installs no console script. Example:
    ``["python3", "-m", "raytrain_eks.cli", "train", "--address", "auto", "--config", "/etc/raytrain-eks/..."]``.
    """
    config = f"{CONFIG_DIR}/{CONFIG_FILE}"
    return [IMAGE_PYTHON, "-m", "raytrain_eks.cli", "train", "--address", "auto", "--config", config]


def worker_pod_size(cfg: Config) -> tuple[int, int]:
    """CPU and memory (GiB) of each GPU worker pod: the configured values, else the target's
    (:meth:`~raytrain_eks.k8s.placement.PodPlacement.worker_pod`: 5/6 of the instance on eks; on the kubernetes target
    ``up`` reads them from the GPU nodes and they are configured from its record)."""
    if cfg.ray.worker_cpu and cfg.ray.worker_memory_gib:
        return cfg.ray.worker_cpu, cfg.ray.worker_memory_gib
    placed = placement_for(cfg).worker_pod(cfg)
    if placed is None:
        raise UserError(
            "the worker pods' CPU and memory are not known: ray.worker_cpu and ray.worker_memory_gib are unset "
            "and `raytrain-eks up` has not read them from the GPU nodes",
            hint="Run `raytrain-eks up` (it records them from the nodes), or set ray.worker_cpu and "
            "ray.worker_memory_gib.",
        )
    cpu, mem = placed
    return cfg.ray.worker_cpu or cpu, cfg.ray.worker_memory_gib or mem


def head_pod_resources(cfg: Config) -> tuple[int, int]:
    """CPU and memory (GiB) of the Ray head pod: the configured values, else the target's (a share of the system
    node on eks)."""
    cpu, mem = placement_for(cfg).head_pod(cfg)
    return cfg.ray.head_cpu or cpu, cfg.ray.head_memory_gib or mem


def efa_per_pod(cfg: Config) -> int:
    """EFA interfaces each worker pod requests: ``cluster.efa_per_node``, else the target's (the instance type's on
    eks, none on kubernetes)."""
    if cfg.cluster.efa_per_node is not None:
        return cfg.cluster.efa_per_node
    return placement_for(cfg).efa_per_pod(cfg)


def gpu_node_selector(cfg: Config) -> dict[str, str]:
    """The labels the worker pods select: ``cluster.gpu_node_selector``, else the target's (the GPU node group's on
    eks; none on kubernetes, where the ``nvidia.com/gpu`` request alone keeps them on GPU nodes)."""
    if cfg.cluster.gpu_node_selector is not None:
        return dict(cfg.cluster.gpu_node_selector)
    return placement_for(cfg).gpu_node_labels(cfg)


def head_node_selector(cfg: Config) -> dict[str, str]:
    if cfg.cluster.head_node_selector is not None:
        return dict(cfg.cluster.head_node_selector)
    return placement_for(cfg).head_node_labels(cfg)


def gpu_tolerations(cfg: Config) -> list[dict[str, str]]:
    if cfg.cluster.gpu_tolerations is not None:
        return [dict(t) for t in cfg.cluster.gpu_tolerations]
    return [dict(GPU_TOLERATION)]


def _guaranteed(resources: dict[str, str]) -> dict[str, dict[str, str]]:
    # requests == limits for every resource gives the pod Guaranteed QoS (never evicted for another pod's sake).
    return {"requests": dict(resources), "limits": dict(resources)}


def _head_template(cfg: Config, *, hf_token: bool) -> dict[str, object]:
    cpu, mem = head_pod_resources(cfg)
    env: list[dict[str, object]] = [dict(NO_GPU_ENV)]
    if hf_token:
        env.append(hf_token_env(cfg))
    mounts, volumes = shared_volume(cfg)
    container = {
        "name": "ray-head",
        "image": cfg.ray.image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": name, "containerPort": port} for name, port in HEAD_PORTS.items()],
        "env": env,
        "envFrom": _job_env_from(cfg),
        "resources": _guaranteed({"cpu": str(cpu), "memory": f"{mem}Gi"}),
        "lifecycle": copy.deepcopy(RAY_STOP_HOOK),
        "volumeMounts": [
            {"name": "ray-logs", "mountPath": RAY_LOG_DIR},
            {"name": "job-config", "mountPath": CONFIG_DIR, "readOnly": True},
            *mounts,
        ],
    }
    return {
        "metadata": {"labels": labels(cfg)},
        "spec": {
            "serviceAccountName": RAY_SERVICE_ACCOUNT,
            **({"nodeSelector": selector} if (selector := head_node_selector(cfg)) else {}),
            "containers": [container],
            "volumes": [
                {"name": "ray-logs", "emptyDir": {}},
                {"name": "job-config", "configMap": {"name": config_map_name(cfg)}},
                *volumes,
            ],
        },
    }


def _worker_template(cfg: Config, *, hf_token: bool) -> dict[str, object]:
    cpu, mem = worker_pod_size(cfg)
    env: list[dict[str, object]] = [{"name": k, "value": v} for k, v in cfg.network.env.items()]
    if hf_token:
        env.append(hf_token_env(cfg))
    resources = {
        "cpu": str(cpu),
        "memory": f"{mem}Gi",
        GPU_RESOURCE: str(cfg.derived.ray_gpus_per_worker_pod),
    }
    efa = efa_per_pod(cfg)
    if efa:  # requested only where the nodes have EFA (the request would keep the pods Pending elsewhere)
        # Without the EFA request the device plugin mounts no EFA device and NCCL silently falls back to sockets.
        resources[EFA_RESOURCE] = str(efa)
    mounts, volumes = shared_volume(cfg)
    container = {
        "name": "ray-worker",
        "image": cfg.ray.image,
        "imagePullPolicy": "IfNotPresent",
        "env": env,
        "envFrom": _job_env_from(cfg),
        "resources": _guaranteed(resources),
        "lifecycle": copy.deepcopy(RAY_STOP_HOOK),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "ray-logs", "mountPath": RAY_LOG_DIR},
            *mounts,
        ],
    }
    return {
        "metadata": {"labels": labels(cfg)},
        "spec": {
            "serviceAccountName": RAY_SERVICE_ACCOUNT,
            **({"nodeSelector": selector} if (selector := gpu_node_selector(cfg)) else {}),
            "tolerations": gpu_tolerations(cfg),
            "containers": [container],
            "volumes": [
                # NCCL's intra-node transport uses /dev/shm; the container default of 64 MiB is far too small.
                # tmpfs pages count against the pod's memory limit, so a quarter of it is the cap.
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{max(1, mem // 4)}Gi"}},
                {"name": "ray-logs", "emptyDir": {}},
                *volumes,
            ],
        },
    }


SHARED_VOLUME = "shared"


def shared_volume(cfg: Config) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The mount and the volume of ``ray.shared_volume`` in every Ray pod (none when it is not set)."""
    if not cfg.ray.shared_volume:
        return [], []
    mount: dict[str, object] = {"name": SHARED_VOLUME, "mountPath": cfg.ray.shared_volume_path}
    return [mount], [{"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": cfg.ray.shared_volume}}]


def ray_cluster_spec(cfg: Config, *, hf_token: bool = False) -> dict[str, object]:
    """The ``spec`` of a RayCluster (also a RayJob's ``rayClusterSpec``): a GPU-less head on the system node and
    one worker pod per GPU node, the group fixed at ``gpu_node_count`` pods."""
    pods = cfg.cluster.gpu_node_count
    return {
        "rayVersion": cfg.ray.version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            # ClusterIP only: the dashboard (8265) is reachable inside the cluster, never from outside it.
            "serviceType": "ClusterIP",
            # No CPUs, no GPUs offered: no task or actor needing one (Ray Data reads, training workers) lands on the
            # head pod, whose memory holds Ray's control plane and the driver.
            "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
            "template": _head_template(cfg, hf_token=hf_token),
        },
        "workerGroupSpecs": [
            {
                "groupName": WORKER_GROUP,
                "replicas": pods,
                "minReplicas": pods,
                "maxReplicas": pods,
                "rayStartParams": {"num-gpus": str(cfg.derived.ray_gpus_per_worker_pod)},
                "template": _worker_template(cfg, hf_token=hf_token),
            }
        ],
    }


def raycluster(cfg: Config, *, hf_token: bool = False) -> dict[str, object]:
    """The ``ray.io/v1`` RayCluster that ``train --address auto`` later runs on (submitted in the head pod)."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _meta(cfg, cfg.ray.cluster_name),
        "spec": ray_cluster_spec(cfg, hf_token=hf_token),
    }


def rayjob(cfg: Config, *, hf_token: bool = False, runtime_env: Mapping[str, object] | None = None) -> dict[str, Any]:
    """A ``ray.io/v1`` RayJob: its own RayCluster, the training entrypoint, and a cluster deleted after it ends
    (by ``submit`` once it has read the pods' evidence, else by KubeRay :data:`RAYJOB_TTL_S` later).

    ``activeDeadlineSeconds`` bounds the whole run and ``preRunningDeadlineSeconds`` the wait for pods, so a job
    that hangs or never gets its GPUs stops costing. ``runtime_env`` (packages the image lacks) is optional.
    """
    spec: dict[str, object] = {
        # shlex.join: the entrypoint is a shell string to Ray; quoting each argv item keeps it one argv again.
        "entrypoint": shlex.join(train_argv()),
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": RAYJOB_TTL_S,
        "activeDeadlineSeconds": cfg.ray.job_deadline_s,
        "preRunningDeadlineSeconds": cfg.ray.job_start_deadline_s,
        "backoffLimit": 0,
        "rayClusterSpec": ray_cluster_spec(cfg, hf_token=hf_token),
    }
    if runtime_env:
        spec["runtimeEnvYAML"] = yaml.safe_dump(dict(runtime_env), sort_keys=False)
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _meta(cfg, cfg.ray.cluster_name), "spec": spec}


def pod_templates(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The pod templates in a RayCluster or RayJob (head first), e.g. to validate them as core ``Pod`` objects."""
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's embedded YAML) as ``|`` blocks, readable in review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(docs: list[dict[str, object]]) -> str:
    """Documents as YAML, ``---`` between them, keys in the order they were built."""
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
