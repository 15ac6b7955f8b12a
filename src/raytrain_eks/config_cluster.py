"""The ``cluster`` section: the EKS cluster and its node groups, or an existing Kubernetes cluster whose GPU nodes are
found by their labels."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import Field, ValidationError, field_validator, model_validator

from raytrain_eks import config_layers as layers
from raytrain_eks.config_fields import (
    BUCKET,
    EKS_NAME,
    INSTANCE_TYPE,
    LABEL_KEY,
    LABEL_VALUE,
    REGION,
    RESERVATION,
    ZONE,
    Section,
    check,
    check_optional,
)

# eksctl's amiFamily values for Linux nodes (the enum of ClusterConfig v1alpha5's NodeGroup and ManagedNodeGroup,
# less the Windows images: Ray and the NVIDIA and EFA drivers run on Linux only).
AmiFamily = Literal[
    "AmazonLinux2023",
    "AmazonLinux2",
    "UbuntuPro2604",
    "Ubuntu2604",
    "UbuntuPro2404",
    "Ubuntu2404",
    "UbuntuPro2204",
    "Ubuntu2204",
    "UbuntuPro2004",
    "Ubuntu2004",
    "Bottlerocket",
    "BottlerocketFips",
]
AMI_FAMILIES: tuple[str, ...] = get_args(AmiFamily)
# Where the GPU nodes come from: EC2 on-demand, an on-demand capacity reservation (ODCR), a Capacity Block for ML
# (a reservation bought ahead for a fixed window), or spot. cluster.gpu_capacity lists them in fallback order.
CapacitySource = Literal["on-demand", "reservation", "capacity-block", "spot"]
CAPACITY_SOURCES: tuple[str, ...] = get_args(CapacitySource)
# AWS releases no EKS-optimized Amazon Linux 2 AMI for Kubernetes 1.33 and later (EKS user guide, Kubernetes 1.33).
_LAST_AL2_K8S = (1, 32)


class _Toleration(Section):
    """A pod's toleration as Kubernetes defines it (core/v1 Toleration; the pod template of the KubeRay CRDs in
    tests/schemas/kuberay carries the same five fields). Example: ``{key: nvidia.com/gpu, operator: Exists,
    effect: NoExecute, tolerationSeconds: 300}``."""

    key: str = ""
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""
    tolerationSeconds: int | None = None  # noqa: N815  (Kubernetes' own name)

    @model_validator(mode="after")
    def _consistent(self) -> _Toleration:
        # The rules of the API reference's field descriptions: the API server refuses the first two, and ignores
        # tolerationSeconds on any effect but NoExecute.
        if self.key and not LABEL_KEY.match(self.key):
            raise ValueError(f"key {self.key!r} is not a taint key, such as nvidia.com/gpu")
        if not self.key and self.operator != "Exists":
            raise ValueError("an empty key (every taint) needs operator Exists")
        if self.operator == "Exists" and self.value:
            raise ValueError(f"operator Exists matches any value: leave value ({self.value!r}) out, or use Equal")
        if self.value and not LABEL_VALUE.match(self.value):
            raise ValueError(f"value {self.value!r}: letters, digits, '-', '_' and '.' (63 at most)")
        if self.tolerationSeconds is not None and self.effect != "NoExecute":
            raise ValueError(
                f"tolerationSeconds applies to effect NoExecute only (Kubernetes ignores it with effect "
                f"{self.effect or 'empty'}): set effect: NoExecute, or leave tolerationSeconds out"
            )
        return self


def _toleration_problem(err: Mapping[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return f"{err['loc'][0]!r} is not a field of a toleration (its fields: {', '.join(_Toleration.model_fields)})"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{err['loc'][0]} = {err['input']!r}: {msg}" if err["loc"] else msg


class ClusterConfig(Section):
    """The cluster: EKS with its node groups (reference: two g6.12xlarge GPU nodes, one m7i.xlarge system node), or
    an existing Kubernetes cluster (``target: kubernetes``) whose GPU nodes are found by their labels."""

    target: Literal["eks", "kubernetes"] = Field(
        "eks",
        description=(
            "eks: the EKS cluster up creates with eksctl; kubernetes: the cluster of your kubeconfig as it is (up "
            "installs only what it lacks, after asking, and creates no cloud resource)"
        ),
    )
    kubeconfig: str | None = Field(
        None, description="target kubernetes: the kubeconfig file; empty = $KUBECONFIG, else ~/.kube/config"
    )
    context: str | None = Field(None, description="target kubernetes: the kubeconfig's context; empty = its current")
    gpu_node_selector: dict[str, str] | None = Field(
        None,
        description=(
            "labels of the GPU nodes the worker pods run on; empty = the GPU node group's (eks), any node that "
            "advertises nvidia.com/gpu (kubernetes)"
        ),
    )
    head_node_selector: dict[str, str] | None = Field(
        None, description="labels of the node the Ray head runs on; empty = the system node group (eks), any node"
    )
    gpu_tolerations: list[dict[str, Any]] | None = Field(
        None,
        description=(
            "the worker pods' tolerations as Kubernetes writes them (key, operator, value, effect, "
            "tolerationSeconds); empty = the nvidia.com/gpu NoSchedule taint"
        ),
    )
    efa_per_node: int | None = Field(
        None,
        ge=0,
        le=32,
        description=(
            "EFA interfaces each worker pod requests (0: none); empty = the instance type's (eks), what the GPU "
            "nodes advertise at up (kubernetes)"
        ),
    )
    gpu_nodes_on_demand: bool = Field(
        False,
        description=(
            "kubernetes: the GPU nodes are added when the worker pods ask for them (Karpenter, a cluster "
            "autoscaler), so up does not find them: it takes their GPUs, EFA interfaces and the worker pod size from "
            "gpus_per_node, efa_per_node, ray.worker_cpu and ray.worker_memory_gib, and the node image brings the "
            "device plugins"
        ),
    )
    existing: bool = Field(
        False,
        description=(
            "eks: cluster.name is an EKS cluster that exists already: up adds its node groups, add-ons and service "
            "account there and never creates or deletes the cluster"
        ),
    )
    name: str = Field("ray-train-eks", max_length=100)
    region: str = "us-east-1"
    # The reference's version; newer versions stay longer in EKS standard support ($0.10 instead of $0.60 per hour).
    k8s_version: str = "1.36"
    system_node_type: str = "m7i.xlarge"
    system_node_count: int = Field(1, ge=1, le=100)
    gpu_node_type: str = "g6.12xlarge"
    gpu_node_count: int = Field(2, ge=1, le=1000)
    gpus_per_node: int = Field(
        4, ge=1, le=16, description="also Ray's num-gpus and the pod's nvidia.com/gpu request (never typed twice)"
    )
    gpu_nodegroup_name: str = "gpu-efa"
    gpu_az: str | None = Field(
        None,
        description="one availability zone for every GPU node (EFA cannot cross zones); empty = picked at deploy "
        "(eks), the one zone of the EFA GPU nodes (kubernetes)",
    )
    # An existing on-demand capacity reservation for the GPU nodes (its zone becomes the GPU zone).
    capacity_reservation_id: str | None = Field(
        None,
        description=(
            "an existing on-demand capacity reservation (cr-...) for the GPU nodes; its zone becomes the GPU "
            "zone; empty = up still uses one that holds every node in the zone it picks"
        ),
    )
    gpu_capacity: list[CapacitySource] | None = Field(
        None,
        description=(
            "where the GPU nodes come from, in fallback order: on-demand, reservation (capacity_reservation_id), "
            "capacity-block (capacity_block_id, bought with `raytrain-eks capacity --buy-block`), spot; up tries "
            "the next when one cannot launch the nodes; empty = [reservation] when capacity_reservation_id is set, "
            "else [on-demand]"
        ),
    )
    capacity_block_id: str | None = Field(
        None,
        description=(
            "the Capacity Block for ML (cr-...) the GPU nodes launch into when gpu_capacity has capacity-block; its "
            "zone becomes the GPU zone, and the node group waits at size 0 until the block starts"
        ),
    )
    # Deploy-only settings (eksctl ClusterConfig).
    availability_zones: list[str] = Field(
        default_factory=list, description="the cluster's subnet zones (2 or more, gpu_az among them); empty = at deploy"
    )
    ami_family: AmiFamily = Field(
        "AmazonLinux2023",
        description=(
            "node image, one of eksctl's Linux families; AmazonLinux2023 carries the NVIDIA and EFA drivers "
            "on GPU instances (AmazonLinux2 only up to Kubernetes 1.32)"
        ),
    )
    gpu_volume_gib: int = Field(
        200, ge=20, le=16384, description="root volume of each GPU node, GiB (the image alone is tens of GB)"
    )
    usd_per_hour: float | None = Field(
        None,
        gt=0,
        le=100000,
        description=(
            "what the whole cluster costs per hour, USD, to price runs with train --address on a Ray cluster "
            "this tool did not deploy; empty = such runs are not priced (a cluster up made is priced from its "
            "own record)"
        ),
    )
    usd_per_node_hour: float | None = Field(
        None,
        gt=0,
        le=10000,
        description="what one GPU node costs per hour, USD: a run is priced by the nodes its workers ran on x its "
        "wall time, on any cluster (nodes an autoscaler adds too); instead of usd_per_hour",
    )
    checkpoint_bucket: str | None = Field(
        None,
        description=(
            "S3 bucket for checkpoints and exports, used as it is (never deleted by down); empty = up creates "
            "one, private and encrypted, and down keeps it while it holds anything"
        ),
    )

    @field_validator("gpu_node_selector", "head_node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (v or {}).items():
            check(LABEL_KEY, key, "label keys such as node.kubernetes.io/instance-type or role")
            if value:
                check(LABEL_VALUE, value, "label values of letters, digits, '-', '_' and '.' (63 at most)")
        return v

    @field_validator("gpu_tolerations")
    @classmethod
    def _tolerations(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Each toleration checked as Kubernetes would, and kept as written (the fields given, in their order)."""
        problems: list[str] = []
        kept: list[dict[str, Any]] = []
        for i, toleration in enumerate(v or [], start=1):
            try:
                checked = _Toleration.model_validate(toleration).model_dump()
            except ValidationError as exc:
                problems.extend(f"toleration {i}: {_toleration_problem(e)}" for e in exc.errors())
                continue
            kept.append({k: checked[k] for k in toleration})
        if problems:
            raise ValueError("; ".join(problems))
        return None if v is None else kept

    @field_validator("name", "gpu_nodegroup_name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check(EKS_NAME, v, "letters, digits, '-' and '_', starting with a letter or digit")

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        return check(REGION, v, "an AWS region such as us-east-1")

    @field_validator("k8s_version")
    @classmethod
    def _k8s(cls, v: str) -> str:
        return check(re.compile(r"^1\.\d{2}$"), v, "a Kubernetes minor version such as 1.36")

    @field_validator("system_node_type", "gpu_node_type")
    @classmethod
    def _itype(cls, v: str) -> str:
        return check(INSTANCE_TYPE, v, "an EC2 instance type such as g6.12xlarge")

    @field_validator("gpu_az")
    @classmethod
    def _az(cls, v: str | None) -> str | None:
        return check_optional(ZONE, v, "an availability zone such as us-east-1a")

    @field_validator("capacity_reservation_id", "capacity_block_id")
    @classmethod
    def _reservation(cls, v: str | None) -> str | None:
        return check_optional(RESERVATION, v, "a capacity reservation id such as cr-0123456789abcdef0")

    @field_validator("checkpoint_bucket")
    @classmethod
    def _bucket(cls, v: str | None) -> str | None:
        return check_optional(BUCKET, v, "an S3 bucket name: 3-63 lowercase letters, digits, '-' and '.'")

    @field_validator("availability_zones")
    @classmethod
    def _azs(cls, v: list[str]) -> list[str]:
        for az in v:
            check(ZONE, az, "availability zones such as us-east-1a")
        if v and len(set(v)) < 2:
            raise ValueError("give at least 2 different zones (eksctl needs 2 for the cluster), or leave it empty")
        return v

    @property
    def capacity_order(self) -> tuple[str, ...]:
        """``gpu_capacity`` as given, else its default: ``("reservation",)`` when ``capacity_reservation_id`` is set
        (what such a config always meant), ``("on-demand",)`` otherwise."""
        if self.gpu_capacity:
            return tuple(self.gpu_capacity)
        return ("reservation",) if self.capacity_reservation_id else ("on-demand",)

    @model_validator(mode="after")
    def _capacity_sources(self) -> ClusterConfig:
        """Each source listed once, with what it needs; an id no listed source uses is refused, not ignored."""
        order, given = self.capacity_order, self.gpu_capacity or []
        twice = sorted({s for s in given if given.count(s) > 1})
        if twice:
            raise ValueError(f"gpu_capacity lists {', '.join(twice)} more than once: list each source once")
        needs = {
            "reservation": ("capacity_reservation_id", self.capacity_reservation_id, "an existing on-demand "
                            "capacity reservation (`aws ec2 describe-capacity-reservations` lists yours)"),
            "capacity-block": ("capacity_block_id", self.capacity_block_id, "a Capacity Block for ML: list the "
                               "offerings with `raytrain-eks capacity --blocks`, buy one with --buy-block"),
        }  # fmt: skip
        for source, (name, value, what) in needs.items():
            if source in order and not value:
                raise ValueError(f"gpu_capacity has {source}, but {name} is empty: set it to the id of {what}")
            if value and source not in order:
                raise ValueError(
                    f"{name} = {value!r} is set, but gpu_capacity ({', '.join(order)}) does not list {source}: add "
                    f"{source} where it falls in the order, or leave {name} empty"
                )
        if self.target == "kubernetes" and order != ("on-demand",):
            raise ValueError(
                f"gpu_capacity ({', '.join(order)}) applies to target eks, whose GPU node group up creates; with "
                "target kubernetes the nodes are the cluster's own: leave gpu_capacity out"
            )
        return self

    @model_validator(mode="after")
    def _settings_of_the_target(self) -> ClusterConfig:
        """Refuse a setting the chosen target would ignore, rather than leave the user believing it applies."""
        refusal = layers.cluster_settings_refusal(self)
        if refusal:
            raise ValueError(refusal)
        return self

    @model_validator(mode="after")
    def _az_in_region(self) -> ClusterConfig:
        if self.gpu_az and not self.gpu_az.startswith(self.region):
            raise ValueError(f"gpu_az {self.gpu_az!r} is not in region {self.region!r}; pick a zone of that region")
        other = [az for az in self.availability_zones if not az.startswith(self.region)]
        if other:
            raise ValueError(f"availability_zones {other} are not in region {self.region!r}")
        if self.gpu_az and self.availability_zones and self.gpu_az not in self.availability_zones:
            raise ValueError(f"gpu_az {self.gpu_az!r} must be one of availability_zones {self.availability_zones}")
        version = tuple(int(x) for x in self.k8s_version.split("."))
        if self.ami_family == "AmazonLinux2" and version > _LAST_AL2_K8S:
            raise ValueError(
                f"ami_family 'AmazonLinux2' has no EKS AMI for k8s_version {self.k8s_version} (none after 1.32); "
                "use AmazonLinux2023"
            )
        return self
