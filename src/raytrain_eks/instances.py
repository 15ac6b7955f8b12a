"""Facts about EC2 instance types and AWS regions that the plan needs, offline.

The figures come from ``docs/reference/infra-facts.md`` (§4, §5 and §7: the EC2 API as published by Karpenter, and
us-east-1 Linux on-demand prices); rows marked ``verified=False`` are common types that file does not tabulate,
filled in from AWS's public instance pages. At deploy time the live EC2 API is the authority (preflight); this
table lets ``plan`` size pods and price the cluster with no credentials. Example::

    it = instance_type("g6.12xlarge")
    it.gpus, it.efa_interfaces, it.usd_per_hour  # (4, 1, 4.6016)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from raytrain_eks.errors import UserError

PRICE_REGION = "us-east-1"
"""The region of every price in the table; other regions cost somewhat more or less."""


@dataclass(frozen=True)
class InstanceType:
    """One EC2 instance type. ``gpu_mib`` is per GPU; ``efa_interfaces`` is ``MaximumEfaInterfaces`` (0: no EFA),
    which is also the node's ``vpc.amazonaws.com/efa`` capacity; ``usd_per_hour`` is us-east-1 on-demand Linux,
    ``None`` where no price is known. ``gpudirect_rdma``: EFA reads and writes GPU memory directly (GPUDirect
    RDMA), so NCCL's inter-node links should show ``/GDRDMA``."""

    name: str
    gpus: int
    gpu_model: str | None
    gpu_mib: int
    vcpu: int
    memory_gib: int
    network_gbps: float
    efa_interfaces: int
    usd_per_hour: float | None
    verified: bool = True
    gpudirect_rdma: bool = False

    @property
    def efa_supported(self) -> bool:
        return self.efa_interfaces > 0


def _gpu(
    name: str,
    gpus: int,
    model: str,
    mib: int,
    vcpu: int,
    gib: int,
    gbps: float,
    efa: int,
    usd: float | None,
    *,
    gdr: bool = False,
) -> InstanceType:
    return InstanceType(name, gpus, model, mib, vcpu, gib, gbps, efa, usd, gpudirect_rdma=gdr)


def _cpu(name: str, vcpu: int, gib: int, gbps: float, usd: float, *, verified: bool = False) -> InstanceType:
    return InstanceType(name, 0, None, 0, vcpu, gib, gbps, 0, usd, verified)


_TABLE: tuple[InstanceType, ...] = (
    # EFA-capable NVIDIA types: docs/reference/infra-facts.md §4-§5 (EC2 API via Karpenter) and §7 (prices). GPUDirect
    # RDMA (gdr): the types whose block in aws-ofi-nccl's platform table sets gdr_required (src/platform-aws.cpp,
    # platform_data_map: p4d/p4de, p5/p5e but not p5.4xlarge, p5en and p6 and later); g5/g6/g6e have no such block
    # and g5.48xlarge's says gdr_required false.
    _gpu("g6.12xlarge", 4, "L4", 22888, 48, 192, 40, 1, 4.6016),
    _gpu("g5.12xlarge", 4, "A10G", 22888, 48, 192, 40, 1, 5.672),
    _gpu("g5.48xlarge", 8, "A10G", 22888, 192, 768, 100, 1, 16.288),
    _gpu("g6.48xlarge", 8, "L4", 22888, 192, 768, 100, 1, 13.3504),
    _gpu("g6e.8xlarge", 1, "L40S", 45776, 32, 256, 25, 1, 4.52856),
    _gpu("g6e.12xlarge", 4, "L40S", 45776, 48, 384, 100, 1, 10.49264),
    _gpu("g6e.16xlarge", 1, "L40S", 45776, 64, 512, 35, 1, 7.57719),
    _gpu("g6e.24xlarge", 4, "L40S", 45776, 96, 768, 200, 2, 15.06559),
    _gpu("g6e.48xlarge", 8, "L40S", 45776, 192, 1536, 400, 4, 30.13118),
    _gpu("p4d.24xlarge", 8, "A100", 40960, 96, 1152, 400, 4, 21.957642, gdr=True),
    _gpu("p4de.24xlarge", 8, "A100", 81920, 96, 1152, 400, 4, 27.44705, gdr=True),
    _gpu("p5.4xlarge", 1, "H100", 81920, 16, 256, 100, 1, 6.88),
    _gpu("p5.48xlarge", 8, "H100", 81920, 192, 2048, 3200, 32, 55.04, gdr=True),
    _gpu("p5e.48xlarge", 8, "H200", 144384, 192, 2048, 3200, 32, None, gdr=True),
    _gpu("p5en.48xlarge", 8, "H200", 144384, 192, 2048, 3200, 16, 63.296, gdr=True),
    _gpu("p6-b200.48xlarge", 8, "B200", 183359, 192, 2048, 3200, 8, 113.9328, gdr=True),
    _gpu("p6-b300.48xlarge", 8, "B300", 275040, 192, 4096, 6400, 16, 142.416, gdr=True),
    # GPU types without EFA (docs/reference/infra-facts.md §5: sizes xlarge to 4xlarge); known so the error can say
    # why, not "unknown".
    InstanceType("g5.xlarge", 1, "A10G", 22888, 4, 16, 10, 0, 1.006, False),
    InstanceType("g5.2xlarge", 1, "A10G", 22888, 8, 32, 10, 0, 1.212, False),
    InstanceType("g5.4xlarge", 1, "A10G", 22888, 16, 64, 25, 0, 1.624, False),
    InstanceType("g6.xlarge", 1, "L4", 22888, 4, 16, 10, 0, 0.8048, False),
    InstanceType("g6.2xlarge", 1, "L4", 22888, 8, 32, 10, 0, 0.9776, False),
    InstanceType("g6.4xlarge", 1, "L4", 22888, 16, 64, 25, 0, 1.3232, False),
    InstanceType("g6e.xlarge", 1, "L40S", 45776, 4, 32, 20, 0, 1.861, False),
    InstanceType("g6e.2xlarge", 1, "L40S", 45776, 8, 64, 20, 0, 2.24208, False),
    InstanceType("g6e.4xlarge", 1, "L40S", 45776, 16, 128, 20, 0, 3.00424, False),
    # System-node types. m7i.xlarge is the reference (price verified, §7); the others are common alternatives.
    _cpu("m7i.xlarge", 4, 16, 12.5, 0.2016, verified=True),
    _cpu("m7i.large", 2, 8, 12.5, 0.1008),
    _cpu("m7i.2xlarge", 8, 32, 12.5, 0.4032),
    _cpu("m6i.xlarge", 4, 16, 12.5, 0.192),
    _cpu("m6i.2xlarge", 8, 32, 12.5, 0.384),
    _cpu("m5.large", 2, 8, 10, 0.096),
    _cpu("m5.xlarge", 4, 16, 10, 0.192),
    _cpu("m5.2xlarge", 8, 32, 10, 0.384),
)

INSTANCE_TYPES: dict[str, InstanceType] = {it.name: it for it in _TABLE}

EFA_GPU_TYPES: tuple[str, ...] = tuple(it.name for it in _TABLE if it.gpus and it.efa_supported)


def same_shape(name: str, table: dict[str, InstanceType] | None = None) -> tuple[str, ...]:
    """``name`` and the types of ``table`` (default: this module's) that can stand in for it in one node group: the
    same GPU model, count and memory per GPU (the training layout and its memory fit are unchanged), the same EFA
    interfaces (the worker pod requests that many) and at least its vCPUs and memory (the worker pod is sized from
    ``name``). A spot node group may list them all. Example: ``same_shape("p5.48xlarge") == ("p5.48xlarge",)``:
    p5e.48xlarge has H200s, p5en.48xlarge H200s and 16 EFA interfaces."""
    rows = INSTANCE_TYPES if table is None else table
    it = rows.get(name)
    if it is None or not it.gpus:
        return (name,)

    def fits(other: InstanceType) -> bool:
        same_gpus = (other.gpu_model, other.gpus, other.gpu_mib) == (it.gpu_model, it.gpus, it.gpu_mib)
        room = other.vcpu >= it.vcpu and other.memory_gib >= it.memory_gib
        return same_gpus and other.efa_interfaces == it.efa_interfaces and room

    return (name, *sorted(n for n, other in rows.items() if n != name and fits(other)))


# Regions where EKS runs (commercial, plus GovCloud). Offline, a region outside this list is refused; whether a
# region offers the GPU type with EFA is checked against the EC2 API at deploy time.
KNOWN_REGIONS: tuple[str, ...] = (
    "us-east-1",
    "us-east-2",
    "us-west-1",
    "us-west-2",
    "ca-central-1",
    "ca-west-1",
    "mx-central-1",
    "sa-east-1",
    "eu-central-1",
    "eu-central-2",
    "eu-north-1",
    "eu-south-1",
    "eu-south-2",
    "eu-west-1",
    "eu-west-2",
    "eu-west-3",
    "il-central-1",
    "me-central-1",
    "me-south-1",
    "af-south-1",
    "ap-east-1",
    "ap-east-2",
    "ap-south-1",
    "ap-south-2",
    "ap-northeast-1",
    "ap-northeast-2",
    "ap-northeast-3",
    "ap-southeast-1",
    "ap-southeast-2",
    "ap-southeast-3",
    "ap-southeast-4",
    "ap-southeast-5",
    "ap-southeast-7",
    "us-gov-east-1",
    "us-gov-west-1",
)

# Quota codes of the on-demand vCPU limits, by family (docs/reference/infra-facts.md §6).
QUOTA_CODES = {"G": "L-DB2E81BA", "P": "L-417A185B", "standard": "L-1216C47A"}
_STANDARD_FAMILIES = frozenset("acdhimrtz")
_OWN_QUOTA = frozenset({"dl", "f", "hpc", "inf", "mac", "trn", "u", "x"})


def quota_family(instance_type: str) -> str | None:
    """The on-demand vCPU quota family of a type: ``G`` (G and VT), ``P``, ``standard`` (A, C, D, H, I, M, R, T,
    Z), or None for the families with quotas of their own (DL, F, HPC, Inf, Mac, Trn, U, X).
    Example: ``quota_family("vt1.3xlarge") == "G"``, ``quota_family("im4gn.large") == "standard"``."""
    family = instance_type.split(".", 1)[0]
    letters = family[: next((i for i, ch in enumerate(family) if not ch.isalpha()), len(family))]
    if not letters or letters in _OWN_QUOTA:
        return None
    if letters.startswith("g") or letters == "vt":
        return "G"
    if letters.startswith("p"):
        return "P"
    return "standard" if letters[0] in _STANDARD_FAMILIES else None


# EKS control plane, NAT gateway (docs/reference/infra-facts.md §7). Extended-support Kubernetes versions cost $0.60
# per cluster-hour.
EKS_CONTROL_PLANE_USD_PER_HOUR = 0.10
EKS_EXTENDED_SUPPORT_USD_PER_HOUR = 0.60
NAT_GATEWAY_USD_PER_HOUR = 0.045

# The last day of EKS standard support of each Kubernetes minor version. Sources: the EKS user guide, "Understand the
# Kubernetes version lifecycle on EKS" (docs.aws.amazon.com/eks/latest/userguide/kubernetes-versions.html: standard
# support for 14 months after the EKS release, then extended support for 12 more months at the extended price), and
# the dates per version as listed by endoflife.date/amazon-eks (read 2026-11-30). A version newer than the table is
# taken to be in standard support (it was released on EKS within the last 14 months).
EKS_STANDARD_SUPPORT_ENDS: dict[str, date] = {
    "1.29": date(2025, 3, 23),
    "1.30": date(2025, 7, 23),
    "1.31": date(2025, 11, 26),
    "1.32": date(2026, 3, 23),
    "1.33": date(2026, 7, 29),
    "1.34": date(2026, 12, 2),
    "1.35": date(2027, 3, 27),
}
EKS_EXTENDED_SUPPORT_MONTHS = 12


@dataclass(frozen=True)
class EksSupport:
    """Where a Kubernetes version stands on EKS on a day: ``standard``, ``extended`` (billed at the extended price)
    or ``ended`` (EKS creates no such cluster), and the day the current period ends (``None`` when unknown)."""

    version: str
    period: str
    ends: date | None

    @property
    def control_plane_usd_per_hour(self) -> float:
        return EKS_EXTENDED_SUPPORT_USD_PER_HOUR if self.period == "extended" else EKS_CONTROL_PLANE_USD_PER_HOUR


def _plus_months(day: date, months: int) -> date:
    month = day.month - 1 + months
    year, month = day.year + month // 12, month % 12 + 1
    return date(year, month, min(day.day, 28 if month == 2 else 30 if month in (4, 6, 9, 11) else 31))


def eks_support(version: str, on: date) -> EksSupport:
    """EKS support of Kubernetes ``version`` (``"1.33"``) on day ``on``.

    Example: ``eks_support("1.33", date(2026, 11, 30)).period == "extended"`` ($0.60 per cluster-hour).
    """
    standard_end = EKS_STANDARD_SUPPORT_ENDS.get(version)
    if standard_end is None:
        newest = max(EKS_STANDARD_SUPPORT_ENDS, key=lambda v: tuple(int(x) for x in v.split(".")))
        older = tuple(int(x) for x in version.split(".")) < tuple(int(x) for x in newest.split("."))
        return EksSupport(version, "ended" if older else "standard", None)
    if on <= standard_end:
        return EksSupport(version, "standard", standard_end)
    extended_end = _plus_months(standard_end, EKS_EXTENDED_SUPPORT_MONTHS)
    if on <= extended_end:
        return EksSupport(version, "extended", extended_end)
    return EksSupport(version, "ended", extended_end)


class UnknownInstanceTypeError(UserError):
    """The instance type is not in the offline table, so the plan cannot size pods or price it."""

    exit_code = 2


def instance_type(name: str) -> InstanceType:
    """The facts for ``name``; raises :class:`UnknownInstanceTypeError` naming the known types.

    Example: ``instance_type("p5.48xlarge").efa_interfaces == 32``.
    """
    try:
        return INSTANCE_TYPES[name]
    except KeyError:
        raise UnknownInstanceTypeError(
            f"instance type {name!r} is not in raytrain-eks's table of instance facts",
            hint=f"EFA GPU types it knows: {', '.join(EFA_GPU_TYPES)}. System-node types: "
            f"{', '.join(it.name for it in _TABLE if not it.gpus)}.",
        ) from None


def default_worker_pod_size(it: InstanceType) -> tuple[int, int]:
    """CPU and memory (GiB) for one Ray worker pod filling a node of type ``it``: 5/6 of each.

    The sixth left over is room for the kubelet's reservation, the system DaemonSets and the OS; it is the
    reference's own ratio (40 of 48 vCPU and 160 of 192 GiB on g6.12xlarge). Example:
    ``default_worker_pod_size(instance_type("p4d.24xlarge")) == (80, 960)``.
    """
    return it.vcpu * 5 // 6, it.memory_gib * 5 // 6


def head_pod_size(it: InstanceType) -> tuple[int, int]:
    """CPU and memory (GiB) for the Ray head on a system node of type ``it``: half of each.

    The other half is for the KubeRay operator, CoreDNS and a RayJob's submitter pod on the same node.
    Example: ``head_pod_size(instance_type("m7i.xlarge")) == (2, 8)``.
    """
    return max(1, it.vcpu // 2), max(1, it.memory_gib // 2)
