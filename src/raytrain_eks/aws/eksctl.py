"""The eksctl ``ClusterConfig`` (``eksctl.io/v1alpha5``) as a dict: a pure function of the config and the zones.

Private subnets behind one NAT gateway, OIDC, the Kubernetes version, a system node group (KubeRay operator and
Ray head) and a managed EFA GPU node group pinned to exactly one availability zone. eksctl's own schema cannot
express its cross-field EFA rules (infra-facts §3), so they are kept here by construction: one AZ for the EFA
group, at least two for the cluster, ``privateNetworking`` on, no ``placement`` (eksctl then adds a cluster
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
from raytrain_eks.k8s.manifests import GPU_NODE_LABELS, GPU_TAINT, RAY_SERVICE_ACCOUNT, SYSTEM_NODE_LABELS

SYSTEM_NODEGROUP = "system"
CONFIG_FILE = "eksctl-cluster.yaml"

# DaemonSets eksctl applies by itself (infra-facts §1). The pinned Helm charts replace them; two plugins
# advertising the same resource on one node is what must never happen.
EKSCTL_NVIDIA_PLUGIN_DAEMONSET = "nvidia-device-plugin-daemonset"
EKSCTL_EFA_PLUGIN_DAEMONSET = "aws-efa-k8s-device-plugin-daemonset"


@dataclass(frozen=True)
class Zones:
    """``gpu_az``: the one zone of every GPU node. ``cluster_azs``: the cluster's subnets (2 or more, GPU zone
    first). ``assumed``: the config named no zone, so these are placeholders that deploy replaces with zones the
    EC2 API says offer the GPU type. ``reservation``: the capacity reservation the GPU group targets (the configured
    ``capacity_reservation_id``, or one the capacity check found holding every GPU node in ``gpu_az``)."""

    gpu_az: str
    cluster_azs: tuple[str, ...]
    assumed: bool
    reservation: str | None = None


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
    return Zones(
        gpu_az=gpu_az, cluster_azs=(gpu_az, *rest), assumed=c.gpu_az is None, reservation=c.capacity_reservation_id
    )


def cluster_tags(cfg: Config) -> dict[str, str]:
    """The tags on everything raytrain-eks creates for the cluster (stacks, node groups, the checkpoint bucket)."""
    return {"created-by": "raytrain-eks", "raytrain-eks/cluster": cfg.cluster.name}


def cluster_config(cfg: Config, zones: Zones, bucket: str | None = None) -> dict[str, Any]:
    """The whole ClusterConfig for ``eksctl create cluster -f`` (see :func:`create_cluster_argv`); with ``bucket``,
    the Ray pods' service account gets an IAM role (IRSA) that may use that S3 bucket and nothing else."""
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
        "labels": dict(SYSTEM_NODE_LABELS),
        "tags": dict(tags),
    }
    gpu = {
        "name": c.gpu_nodegroup_name,
        "instanceType": c.gpu_node_type,
        "amiFamily": c.ami_family,
        "desiredCapacity": c.gpu_node_count,
        "minSize": c.gpu_node_count,
        "maxSize": c.gpu_node_count,
        # EFA traffic cannot cross an availability zone: every GPU node in one zone, and exactly one listed,
        # or eksctl spreads the group over every zone that offers the type.
        "availabilityZones": [zones.gpu_az],
        "privateNetworking": True,
        "efaEnabled": True,
        "volumeSize": c.gpu_volume_gib,
        "volumeType": "gp3",
        "labels": dict(GPU_NODE_LABELS),
        # Keeps the operator, the head and everything else without a GPU toleration off the GPU nodes.
        "taints": [dict(GPU_TAINT)],
        "tags": dict(tags),
    }
    iam: dict[str, Any] = {"withOIDC": True}
    if bucket:
        iam["serviceAccounts"] = [
            {
                "metadata": {"name": RAY_SERVICE_ACCOUNT, "namespace": cfg.ray.namespace},
                "attachPolicy": bucket_policy(bucket),
                "tags": dict(tags),
            }
        ]
    if zones.reservation:
        # Launch into the existing reservation (its zone is gpu_az). eksctl then adds no placement group.
        gpu["capacityReservation"] = {"capacityReservationTarget": {"capacityReservationID": zones.reservation}}
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


def create_cluster_argv(config_path: str = CONFIG_FILE) -> list[str]:
    """``eksctl create cluster``; the NVIDIA flag stops eksctl's own static plugin (the Helm chart is used).

    eksctl has no such switch for its EFA plugin: that DaemonSet is removed afterwards (a plan step).
    """
    return ["eksctl", "create", "cluster", "-f", config_path, "--install-nvidia-plugin=false"]


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
    ]


def bucket_policy(bucket: str) -> dict[str, Any]:
    """The IAM policy of the Ray pods' role: list, read, write and delete objects of this bucket, nothing else."""
    arn = f"arn:aws:s3:::{bucket}"
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
        ],
    }
