"""The eksctl ``ClusterConfig`` (``eksctl.io/v1alpha5``) as a dict: a pure function of the config and the zones.

Private subnets behind one NAT gateway, OIDC, the Kubernetes version, a system node group (KubeRay operator and
Ray head) and a managed EFA GPU node group pinned to exactly one availability zone. eksctl's own schema cannot
express its cross-field EFA rules (docs/reference/infra-facts.md §3), so they are kept here by construction: one AZ for
the EFA group, at least two for the cluster, ``privateNetworking`` on, no ``placement`` (eksctl then adds a cluster
placement group itself). Example::

    zones = planned_zones(cfg)
    doc = cluster_config(cfg, zones)
    doc["managedNodeGroups"][1]["availabilityZones"]  # [zones.gpu_az]
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

from raytrain_eks.config import Config
from raytrain_eks.instances import same_shape
from raytrain_eks.k8s.manifests import GPU_NODE_LABELS, GPU_TAINT, RAY_SERVICE_ACCOUNT, SYSTEM_NODE_LABELS

SYSTEM_NODEGROUP = "system"
CONFIG_FILE = "eksctl-cluster.yaml"

# eksctl's own wait for its CloudFormation stacks (``--timeout``). Its default, ``DefaultWaitTimeout`` (eksctl
# v0.230.0, pkg/apis/eksctl.io/v1alpha5/types.go), is 25 minutes: shorter than a cluster (15-20 minutes) plus
# margin, and than a GPU node group whose instances are slow to come. These are given on every create, delete and
# scale, and kept below the runner's own limits (raytrain_eks.eks.nodegroups), so eksctl's message is the one seen.
CLUSTER_WAIT_MIN = 40
NODEGROUP_WAIT_MIN = 35

# Zone IDs eksctl leaves out when it picks a cluster's zones itself (``zoneIDsToAvoid``, eksctl v0.230.0,
# pkg/az/az.go): EKS lacks the capacity for control planes there (UnsupportedAvailabilityZoneException). Zone names
# map to IDs differently in each account, so zones are matched by ID (EC2 DescribeAvailabilityZones).
AVOIDED_ZONE_IDS: dict[str, tuple[str, ...]] = {
    "us-east-1": ("use1-az3",),
    "us-west-1": ("usw1-az2",),
    "ca-central-1": ("cac1-az3",),
}

# DaemonSets eksctl applies by itself in kube-system (docs/reference/infra-facts.md §1), named as in eksctl's
# pkg/addons/assets/{nvidia,efa}-device-plugin.yaml (v0.230.0). The pinned Helm charts replace them; two plugins
# advertising the same resource on one node is what must never happen. The EFA one has the very name of the EFA
# chart's DaemonSet: it is told apart by Helm's ownership metadata (raytrain_eks.k8s.addons).
EKSCTL_NVIDIA_PLUGIN_DAEMONSET = "nvidia-device-plugin-daemonset"
EKSCTL_EFA_PLUGIN_DAEMONSET = "aws-efa-k8s-device-plugin"

# The system node's root volume, GiB (gp3). eksctl's default is 80 (``DefaultNodeVolumeSize``, eksctl v0.230.0
# pkg/apis/eksctl.io/v1alpha5/types.go), shared by everything the node keeps. The Ray head runs there (beside the
# KubeRay operator), so it holds the cluster image, pulled and unpacked (containerd keeps the compressed layers
# beside the unpacked snapshot; the DLC's /opt/venv alone is built from 2.5 GB of wheels by its uv.lock, several
# times that unpacked, on a CUDA base: tens of GB), the head's run folder (the job's driver writes the model's
# export there, 2 bytes a parameter, and for a LoRA run first fetches the base model it merges into: 30 GB for a
# 7B model), and Ray's session folder (logs, the job's runtime_env files; a pip runtime_env would add a whole copy
# of /opt/venv). The kubelet deletes images from 85% use (imageGCHighThresholdPercent) and evicts pods under 10%
# free (nodefs.available): 200, as the GPU nodes' default, leaves room for a model of up to about 30B parameters.
SYSTEM_VOLUME_GIB = 200
SYSTEM_VOLUME_REASON = (
    "room for the image pulled and unpacked (tens of GB), the head's run folder (the model's export, and a LoRA run's "
    "base model: 30 GB for a 7B model) and Ray's session folder, under the kubelet's 85% image clean-up; eksctl's "
    "default is 80 GiB"
)


@dataclass(frozen=True)
class Zones:
    """``gpu_az``: the one zone of every GPU node. ``cluster_azs``: the cluster's subnets (2 or more, GPU zone
    first). ``assumed``: the config named no zone, so these are placeholders that deploy replaces with zones the
    EC2 API says offer the GPU type. ``reservation``: the capacity reservation the GPU group targets (the configured
    ``capacity_reservation_id``, or one the capacity check found holding every GPU node in ``gpu_az``; for
    ``capacity="capacity-block"``, the block). ``capacity``: where the GPU nodes come from (one of
    ``cluster.gpu_capacity``). ``at_zero``: the group is created with no node (a Capacity Block not yet started)."""

    gpu_az: str
    cluster_azs: tuple[str, ...]
    assumed: bool
    reservation: str | None = None
    capacity: str = "on-demand"
    at_zero: bool = False


def planned_zones(cfg: Config) -> Zones:
    """The zones to render: the configured ones, else ``<region>a`` (and the next letter) as a stated assumption.

    Example: with ``gpu_az: us-east-1c`` and no ``availability_zones``: ``("us-east-1c", "us-east-1a")``.
    """
    c = cfg.cluster
    gpu_az = c.gpu_az or (c.availability_zones[0] if c.availability_zones else f"{c.region}a")
    if c.availability_zones:
        rest = [az for az in c.availability_zones if az != gpu_az]
    else:
        other = next(ch for ch in string.ascii_lowercase if f"{c.region}{ch}" != gpu_az)
        rest = [f"{c.region}{other}"]
    capacity = c.capacity_order[0]
    return Zones(
        gpu_az=gpu_az,
        cluster_azs=(gpu_az, *rest),
        assumed=c.gpu_az is None,
        reservation=source_reservation(cfg, capacity),
        capacity=capacity,
    )


def source_reservation(cfg: Config, capacity: str) -> str | None:
    """The reservation a capacity source launches into: the configured one for ``reservation``, the block for
    ``capacity-block``, none for spot or on-demand (the placement search may still find one for on-demand)."""
    c = cfg.cluster
    return {"reservation": c.capacity_reservation_id, "capacity-block": c.capacity_block_id}.get(capacity)


def cluster_tags(cfg: Config) -> dict[str, str]:
    """The tags on everything raytrain-eks creates for the cluster (stacks, node groups, the checkpoint bucket)."""
    return {"created-by": "raytrain-eks", "raytrain-eks/cluster": cfg.cluster.name}


def cluster_config(cfg: Config, zones: Zones, bucket: str | None = None, kms_key: str | None = None) -> dict[str, Any]:
    """The whole ClusterConfig for ``eksctl create cluster -f`` (see :func:`create_cluster_argv`); with ``bucket``,
    the Ray pods' service account gets an IAM role (IRSA) that may use that S3 bucket (and ``kms_key``, the ARN of
    the KMS key that encrypts it, when it has one) and nothing else."""
    c = cfg.cluster
    tags = cluster_tags(cfg)
    system = {
        "name": SYSTEM_NODEGROUP,
        "instanceType": c.system_node_type,
        "amiFamily": c.ami_family,
        "desiredCapacity": c.system_node_count,
        "minSize": c.system_node_count,
        "maxSize": c.system_node_count,
        "privateNetworking": True,
        "volumeSize": SYSTEM_VOLUME_GIB,
        "volumeType": "gp3",
        "labels": dict(SYSTEM_NODE_LABELS),
        "tags": dict(tags),
    }
    gpu = gpu_nodegroup(cfg, zones)
    iam: dict[str, object] = {"withOIDC": True}
    if bucket:
        iam["serviceAccounts"] = [ray_service_account(cfg, bucket, kms_key)]
    return {
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {"name": c.name, "region": c.region, "version": c.k8s_version, "tags": tags},
        "availabilityZones": list(zones.cluster_azs),
        "iam": iam,
        "vpc": {
            # Nodes sit in private subnets; the NAT gateway lets them pull the image and the model weights.
            "nat": {"gateway": "Single"},
            "clusterEndpoints": {"publicAccess": True, "privateAccess": True},
        },
        "managedNodeGroups": [system, gpu],
    }


def gpu_nodegroup(cfg: Config, zones: Zones) -> dict[str, object]:
    """The managed EFA GPU node group for ``zones.capacity``, as eksctl v0.230.0 reads it (pkg/cfn/builder/
    managed_nodegroup.go and managed_launch_template.go, vendored in tests/fixtures/eksctl):

    - ``on-demand`` / ``reservation``: ``instanceType``; with a reservation, ``capacityReservation``'s target, which
      eksctl writes into the launch template it makes (``CapacityReservationSpecification``).
    - ``capacity-block``: the same target plus ``instanceMarketOptions.marketType: capacity-block``; eksctl then
      puts ``InstanceMarketOptions.MarketType`` in the launch template and gives the node group capacity type
      ``CAPACITY_BLOCK``: the launch template the EKS user guide asks for ("Create a managed node group with
      Capacity Blocks for ML"). Before the block starts the group has no node (``at_zero``).
    - ``spot``: ``spot: true`` (capacity type ``SPOT``) and ``instanceTypes``: every type of the same shape
      (:func:`~raytrain_eks.instances.same_shape`), so EC2 may take any of them.
    """
    c = cfg.cluster
    size = 0 if zones.at_zero else c.gpu_node_count
    kind: dict[str, object] = {"instanceType": c.gpu_node_type}
    if zones.capacity == "spot":
        kind = {"instanceTypes": list(same_shape(c.gpu_node_type)), "spot": True}
    gpu: dict[str, object] = {
        "name": c.gpu_nodegroup_name,
        **kind,
        "amiFamily": c.ami_family,
        "desiredCapacity": size,
        "minSize": size,
        "maxSize": c.gpu_node_count,
        # EFA traffic cannot cross an availability zone: every GPU node in one zone, and exactly one listed,
        # or eksctl spreads the group over every zone that offers the type. For a reservation or a block that is
        # its zone, so the group has subnets of that zone only.
        "availabilityZones": [zones.gpu_az],
        "privateNetworking": True,
        "efaEnabled": True,
        "volumeSize": c.gpu_volume_gib,
        "volumeType": "gp3",
        "labels": dict(GPU_NODE_LABELS),
        # Keeps the operator, the head and everything else without a GPU toleration off the GPU nodes.
        "taints": [dict(GPU_TAINT)],
        "tags": cluster_tags(cfg),
    }
    if zones.reservation and zones.capacity != "spot":
        # Launch into the reservation (its zone is gpu_az). eksctl then adds no placement group.
        gpu["capacityReservation"] = {"capacityReservationTarget": {"capacityReservationID": zones.reservation}}
    if zones.capacity == "capacity-block":
        gpu["instanceMarketOptions"] = {"marketType": "capacity-block"}
    return gpu


def ray_service_account(cfg: Config, bucket: str, kms_key: str | None = None) -> dict[str, object]:
    """The Ray pods' service account as an entry of ``iam.serviceAccounts``: eksctl gives it an IAM role whose
    inline policy is :func:`bucket_policy`, and annotates it with the role's ARN."""
    return {
        "metadata": {"name": RAY_SERVICE_ACCOUNT, "namespace": cfg.ray.namespace},
        "attachPolicy": bucket_policy(bucket, kms_key),
        "tags": cluster_tags(cfg),
    }


def service_account_config(cfg: Config, bucket: str, kms_key: str | None = None) -> dict[str, object]:
    """The ClusterConfig for ``eksctl create iamserviceaccount -f`` (and ``update``): the cluster's name and region
    and the Ray pods' service account, nothing else, so the command touches only that service account."""
    c = cfg.cluster
    return {
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {"name": c.name, "region": c.region},
        "iam": {"withOIDC": True, "serviceAccounts": [ray_service_account(cfg, bucket, kms_key)]},
    }


def wait_flag(minutes: int) -> list[str]:
    """``--timeout`` in eksctl's (Go's) duration syntax: how long eksctl waits for its CloudFormation stacks."""
    return ["--timeout", f"{minutes}m"]


def create_cluster_argv(config_path: str = CONFIG_FILE, *, kubeconfig: str | None = None) -> list[str]:
    """``eksctl create cluster``; the NVIDIA flag stops eksctl's own static plugin (the Helm chart is used).

    eksctl has no such switch for its EFA plugin: that DaemonSet is removed afterwards (a plan step). eksctl writes
    the new cluster's kubeconfig and makes it the current context (``--write-kubeconfig`` and
    ``--set-kubeconfig-context`` default to true) in ``--kubeconfig``, by default ``$KUBECONFIG`` or
    ``~/.kube/config``: ``up`` gives its own folder's file, so the user's is never touched; the plan's commands
    use the default one, as ``kubectl`` and ``helm`` there do.
    """
    argv = ["eksctl", "create", "cluster", "-f", config_path, "--install-nvidia-plugin=false"]
    if kubeconfig is not None:
        argv += ["--kubeconfig", kubeconfig]
    return argv + wait_flag(CLUSTER_WAIT_MIN)


def scale_gpu_nodegroup_argv(cfg: Config, nodes: int) -> list[str]:
    """``eksctl scale nodegroup`` for the GPU group, e.g. to 0 when a RayJob has finished."""
    c = cfg.cluster
    return [
        "eksctl",
        "scale",
        "nodegroup",
        "--cluster",
        c.name,
        "--region",
        c.region,
        "--name",
        c.gpu_nodegroup_name,
        "--nodes",
        str(nodes),
        "--nodes-min",
        str(min(nodes, c.gpu_node_count)),
        # Without --wait eksctl returns once EKS accepts the update; with it, once the node group is ACTIVE again
        # (pkg/actions/nodegroup/scale.go), within --timeout: a node group's wait, as a scale up launches instances.
        # A job started next never meets a scale still in progress.
        "--wait",
        *wait_flag(NODEGROUP_WAIT_MIN),
    ]


# What S3 asks KMS for on behalf of the Ray pods' role, for objects of a bucket encrypted with a KMS key: a data
# key to write one (also for each part of a multipart upload), and its decryption to read one back.
KMS_ACTIONS = ("kms:GenerateDataKey", "kms:Decrypt")


def bucket_policy(bucket: str, kms_key: str | None = None) -> dict[str, object]:
    """The IAM policy of the Ray pods' role: list, read, write and delete objects of this bucket, nothing else; and,
    for a bucket encrypted with a KMS key (SSE-KMS; ``kms_key`` is the key's ARN), make and read that key's data
    keys, without which every write of a checkpoint is refused (AccessDenied)."""
    arn = f"arn:aws:s3:::{bucket}"
    kms = [{"Effect": "Allow", "Action": list(KMS_ACTIONS), "Resource": [kms_key]}] if kms_key else []
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"], "Resource": [arn]},
            {
                "Effect": "Allow",
                "Action": [
                    "s3:GetObject",
                    "s3:PutObject",
                    "s3:DeleteObject",
                    "s3:AbortMultipartUpload",
                    "s3:ListMultipartUploadParts",
                ],
                "Resource": [f"{arn}/*"],
            },
            *kms,
        ],
    }
