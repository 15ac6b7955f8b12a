"""The AWS calls behind ``capacity``: EC2 and EKS reads, and three small interfaces for what moto cannot serve.

Reads that moto's server implements with real data (instance types, offerings per zone, regions, zones,
instances, subnets, route tables, EKS clusters) are plain functions over boto3 clients. Three things sit behind
an interface, each with a boto3 implementation here and a stated fake in the tests (tests/fake_aws.py), because
moto 5.2 does not implement them: the EC2 vCPU quotas (:class:`Quotas`; moto's Service Quotas knows only the
``vpc`` service), the spot placement score (:class:`SpotScores`; no ``GetSpotPlacementScores``), and on-demand
capacity reservations (:class:`Reservations`; no ``CreateCapacityReservation`` nor
``DescribeCapacityReservations``). Example::

    services = boto3_services(aws)
    services.quotas.vcpu_limit("us-east-1", "L-DB2E81BA").value  # 96.0
    offered_zones(aws, "us-east-1", "g6.12xlarge")                 # {"us-east-1a", ...}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from raytrain_eks.aws.session import Aws, aws_errors, error_code, error_message, short_reason

PROBE_TAG = "raytrain-eks/probe"
"""Tag key on every capacity reservation a probe creates; its value is the probe's token (also the ClientToken)."""

# Instance lifecycles that do not count against the on-demand vCPU quotas.
_NOT_ON_DEMAND = frozenset({"spot", "scheduled", "capacity-block"})

# Codes with which CreateCapacityReservation says "not now / not here" rather than "you did something wrong".
NO_CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientReservedInstanceCapacity",
        "InstanceLimitExceeded",
        "VcpuLimitExceeded",
        "ReservationCapacityExceeded",
        "Unsupported",
    }
)


# ---------------------------------------------------------------- interfaces for what moto does not implement


@dataclass(frozen=True)
class QuotaLimit:
    """A vCPU quota's value and where it came from (``applied``, ``default``); ``None`` with why in ``source``."""

    value: float | None
    source: str


@dataclass(frozen=True)
class SpotSignal:
    """Spot placement scores (1-10) by zone id (``use1-az1``); ``scores is None`` when unavailable, ``note`` why."""

    scores: dict[str, int] | None
    note: str = ""


@dataclass(frozen=True)
class Reservation:
    """A capacity reservation as created: its id and state (``active`` when the capacity is held)."""

    id: str
    state: str


@dataclass(frozen=True)
class ExistingReservation:
    """An active on-demand capacity reservation of the account: ``available`` of ``total`` instances are free.

    ``match``: ``open`` (matching instances use it by themselves) or ``targeted`` (only instances that name it).
    ``kind``: EC2's ReservationType (``default``, or ``capacity-block`` for ML capacity blocks).
    """

    id: str
    instance_type: str
    zone: str
    total: int
    available: int
    match: str = "open"
    platform: str = "Linux/UNIX"
    tenancy: str = "default"
    kind: str = "default"

    @property
    def unusable_why(self) -> str | None:
        """Why EKS nodes cannot launch into it (None when they can): platform, tenancy or kind."""
        if self.platform != "Linux/UNIX":
            return f"its platform is {self.platform}, EKS nodes run Linux/UNIX"
        if self.tenancy != "default":
            return f"its tenancy is {self.tenancy}, node groups use default tenancy"
        if self.kind != "default":
            return f"it is a {self.kind} reservation, not an on-demand capacity reservation"
        return None


class NoCapacity(Exception):
    """CreateCapacityReservation refused for lack of capacity or quota: a probe result, not a failure."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Quotas(Protocol):
    """The on-demand vCPU quotas of EC2 (Service Quotas, service code ``ec2``)."""

    def vcpu_limit(self, region: str, quota_code: str) -> QuotaLimit: ...


class SpotScores(Protocol):
    """EC2's spot placement score: how likely a spot request of ``count`` instances succeeds, per zone."""

    def scores(self, region: str, instance_type: str, count: int) -> SpotSignal: ...


class Reservations(Protocol):
    """On-demand capacity reservations, as the probe uses them. ``token`` tags (and idempotently names) each."""

    def create(self, *, region: str, instance_type: str, zone: str, count: int, token: str) -> Reservation:
        """Reserve ``count`` instances now; raise :class:`NoCapacity` when EC2 cannot."""
        ...

    def cancel(self, *, region: str, reservation_id: str) -> None:
        """Cancel one reservation; cancelling one that is already cancelled is not an error."""
        ...

    def open_ids(self, *, region: str, token: str) -> list[str]:
        """Ids of the reservations tagged with ``token`` that are still active or pending."""
        ...

    def active(self, *, region: str) -> list[ExistingReservation]:
        """The account's active capacity reservations in ``region``, of every type, except the probe's own."""
        ...


@dataclass(frozen=True)
class Services:
    """The three interfaces ``capacity`` needs beyond moto-served reads."""

    quotas: Quotas
    spot: SpotScores
    reservations: Reservations


# ---------------------------------------------------------------- boto3 implementations


class ServiceQuotasLimits:
    """:class:`Quotas` from Service Quotas: the applied value, else AWS's default, else unknown (with why)."""

    def __init__(self, aws: Aws) -> None:
        self._aws = aws

    def vcpu_limit(self, region: str, quota_code: str) -> QuotaLimit:
        import botocore.exceptions

        sq = self._aws.client("service-quotas", region)
        errors = (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError)
        try:
            quota = sq.get_service_quota(ServiceCode="ec2", QuotaCode=quota_code)["Quota"]
            return QuotaLimit(float(quota["Value"]), "applied")
        except errors as exc:
            if error_code(exc) != "NoSuchResourceException":
                return QuotaLimit(None, short_reason(exc))
        # No applied value: the quota still has its default, which GetAWSDefaultServiceQuota returns.
        try:
            quota = sq.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=quota_code)["Quota"]
            return QuotaLimit(float(quota["Value"]), "default")
        except errors as exc:
            return QuotaLimit(None, short_reason(exc))


class Ec2SpotScores:
    """:class:`SpotScores` from ``ec2.get_spot_placement_scores`` (single-zone scores for ``count`` instances).

    The score is a signal only: when the call fails (no ``ec2:GetSpotPlacementScores`` permission, or the
    account's limit on such queries), the signal is unavailable and the note says why.
    """

    def __init__(self, aws: Aws) -> None:
        self._aws = aws

    def scores(self, region: str, instance_type: str, count: int) -> SpotSignal:
        import botocore.exceptions
        from botocore.parsers import ResponseParserError

        ec2 = self._aws.client("ec2", region)
        found: dict[str, int] = {}
        try:
            pages = ec2.get_paginator("get_spot_placement_scores").paginate(
                InstanceTypes=[instance_type],
                TargetCapacity=count,
                TargetCapacityUnitType="units",
                SingleAvailabilityZone=True,
                RegionNames=[region],
            )
            for page in pages:
                for score in page.get("SpotPlacementScores", []):
                    if score.get("Region") == region and score.get("AvailabilityZoneId"):
                        found[score["AvailabilityZoneId"]] = int(score["Score"])
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError, ResponseParserError) as exc:
            return SpotSignal(None, short_reason(exc))
        return SpotSignal(found)


class Ec2Reservations:
    """:class:`Reservations` over EC2 on-demand capacity reservations (targeted, so no running instance uses
    them; tagged with the probe's token, which is also the ClientToken, so a retried create makes no second)."""

    def __init__(self, aws: Aws) -> None:
        self._aws = aws

    def create(self, *, region: str, instance_type: str, zone: str, count: int, token: str) -> Reservation:
        import botocore.exceptions

        ec2 = self._aws.client("ec2", region)
        tags = [{"Key": PROBE_TAG, "Value": token}, {"Key": "created-by", "Value": "raytrain-eks"}]
        try:
            with aws_errors(f"creating a capacity reservation in {zone}", expected=NO_CAPACITY_CODES):
                made = ec2.create_capacity_reservation(
                    ClientToken=token,
                    InstanceType=instance_type,
                    InstancePlatform="Linux/UNIX",
                    AvailabilityZone=zone,
                    InstanceCount=count,
                    InstanceMatchCriteria="targeted",
                    EndDateType="unlimited",
                    TagSpecifications=[{"ResourceType": "capacity-reservation", "Tags": tags}],
                )["CapacityReservation"]
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in NO_CAPACITY_CODES:
                raise NoCapacity(error_code(exc), error_message(exc)) from None
            raise
        return Reservation(made["CapacityReservationId"], made.get("State", "active"))

    def cancel(self, *, region: str, reservation_id: str) -> None:
        import botocore.exceptions

        ec2 = self._aws.client("ec2", region)
        # Already gone (cancelled, or never made): what cancelling is for has happened.
        gone = ("InvalidCapacityReservationId.NotFound", "InvalidCapacityReservationId.Malformed")
        try:
            with aws_errors(f"cancelling capacity reservation {reservation_id}", expected=gone):
                ec2.cancel_capacity_reservation(CapacityReservationId=reservation_id)
        except botocore.exceptions.ClientError:
            pass

    def open_ids(self, *, region: str, token: str) -> list[str]:
        ec2 = self._aws.client("ec2", region)
        ids: list[str] = []
        with aws_errors(f"listing the probe's capacity reservations in {region}"):
            pages = ec2.get_paginator("describe_capacity_reservations").paginate(
                Filters=[
                    {"Name": f"tag:{PROBE_TAG}", "Values": [token]},
                    {"Name": "state", "Values": ["active", "pending"]},
                ]
            )
            for page in pages:
                ids += [r["CapacityReservationId"] for r in page.get("CapacityReservations", [])]
        return ids

    def active(self, *, region: str) -> list[ExistingReservation]:
        ec2 = self._aws.client("ec2", region)
        found: list[ExistingReservation] = []
        with aws_errors(f"listing the capacity reservations in {region}"):
            pages = ec2.get_paginator("describe_capacity_reservations").paginate(
                Filters=[{"Name": "state", "Values": ["active"]}]
            )
            for page in pages:
                for r in page.get("CapacityReservations", []):
                    if any(t.get("Key") == PROBE_TAG for t in r.get("Tags", [])):
                        continue
                    found.append(
                        ExistingReservation(
                            id=r["CapacityReservationId"],
                            instance_type=r["InstanceType"],
                            zone=r["AvailabilityZone"],
                            total=int(r.get("TotalInstanceCount", 0)),
                            available=int(r.get("AvailableInstanceCount", 0)),
                            match=r.get("InstanceMatchCriteria", "open"),
                            platform=r.get("InstancePlatform", "Linux/UNIX"),
                            tenancy=r.get("Tenancy", "default"),
                            kind=r.get("ReservationType", "default"),
                        )
                    )
        return found


def boto3_services(aws: Aws) -> Services:
    """The real implementations, all over ``aws``'s session."""
    return Services(quotas=ServiceQuotasLimits(aws), spot=Ec2SpotScores(aws), reservations=Ec2Reservations(aws))


# ---------------------------------------------------------------- reads moto implements


def region_opt_in(aws: Aws, region: str) -> dict[str, str]:
    """Every region EC2 lists (``AllRegions``), asked in ``region``, with its opt-in status
    (``opt-in-not-required``, ``opted-in`` or ``not-opted-in``)."""
    with aws_errors("listing the AWS regions"):
        listed = aws.client("ec2", region).describe_regions(AllRegions=True)["Regions"]
    return {r["RegionName"]: r.get("OptInStatus", "opt-in-not-required") for r in listed}


def describe_types(aws: Aws, region: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """DescribeInstanceTypes for ``names`` in ``region``, by name; a name EC2 does not know there is left out."""
    import botocore.exceptions

    ec2 = aws.client("ec2", region)

    def describe(chunk: list[str]) -> list[dict[str, Any]]:
        try:
            with aws_errors(f"describing instance types in {region}", expected={"InvalidInstanceType"}):
                return list(ec2.describe_instance_types(InstanceTypes=chunk)["InstanceTypes"])
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) != "InvalidInstanceType":
                raise
            # One unknown name fails the whole call: ask name by name to keep the others.
            return [] if len(chunk) == 1 else [t for name in chunk for t in describe([name])]

    wanted = sorted(set(names))
    found: dict[str, dict[str, Any]] = {}
    for i in range(0, len(wanted), 100):  # at most 100 names per call
        found.update({t["InstanceType"]: t for t in describe(wanted[i : i + 100])})
    return found


def zone_ids(aws: Aws, region: str) -> dict[str, str]:
    """The region's available availability zones (no local or wavelength zones): name to zone id."""
    with aws_errors(f"listing the availability zones of {region}"):
        zones = aws.client("ec2", region).describe_availability_zones(
            Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}]
        )["AvailabilityZones"]
    return {z["ZoneName"]: z["ZoneId"] for z in zones if z.get("State", "available") == "available"}


def offered_zones(aws: Aws, region: str, instance_type: str) -> set[str]:
    """The zones of ``region`` whose offerings include ``instance_type`` (DescribeInstanceTypeOfferings)."""
    pages = (
        aws.client("ec2", region)
        .get_paginator("describe_instance_type_offerings")
        .paginate(LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}])
    )
    with aws_errors(f"reading the offerings of {instance_type} in {region}"):
        return {o["Location"] for page in pages for o in page.get("InstanceTypeOfferings", [])}


def on_demand_instance_types(aws: Aws, region: str) -> Counter[str]:
    """Instance types of the pending and running on-demand instances in ``region``, counted."""
    pages = (
        aws.client("ec2", region)
        .get_paginator("describe_instances")
        .paginate(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
    )
    counts: Counter[str] = Counter()
    with aws_errors(f"listing the running instances in {region}"):
        for page in pages:
            for reservation in page.get("Reservations", []):
                for inst in reservation.get("Instances", []):
                    if inst.get("InstanceLifecycle") not in _NOT_ON_DEMAND:
                        counts[inst["InstanceType"]] += 1
    return counts


@dataclass(frozen=True)
class ClusterSubnets:
    """An existing EKS cluster's private subnets by zone. ``found``: False when no cluster has the name,
    None when it could not be looked up (``note`` says why)."""

    name: str
    found: bool | None
    private: dict[str, list[str]] = field(default_factory=dict)
    note: str = ""


def cluster_subnets(aws: Aws, region: str, name: str) -> ClusterSubnets:
    """The private subnets, by zone, of EKS cluster ``name`` in ``region``.

    A subnet is private when its route table (its own, else the VPC's main one) sends 0.0.0.0/0 to no internet
    gateway: the EFA node group needs one in its zone (docs/reference/infra-facts.md §3).
    """
    import botocore.exceptions

    try:
        cluster = aws.client("eks", region).describe_cluster(name=name)["cluster"]
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
        if error_code(exc) == "ResourceNotFoundException":
            return ClusterSubnets(name, False)
        return ClusterSubnets(name, None, note=short_reason(exc))
    subnet_ids = list(cluster.get("resourcesVpcConfig", {}).get("subnetIds", []))
    if not subnet_ids:
        return ClusterSubnets(name, True)
    ec2 = aws.client("ec2", region)
    with aws_errors(f"reading the subnets of cluster {name}"):
        subnets = ec2.describe_subnets(SubnetIds=subnet_ids)["Subnets"]
        vpcs = sorted({s["VpcId"] for s in subnets})
        tables = ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": vpcs}])["RouteTables"] if vpcs else []
    main: dict[str, dict[str, Any]] = {}
    by_subnet: dict[str, dict[str, Any]] = {}
    for table in tables:
        for assoc in table.get("Associations", []):
            if assoc.get("Main"):
                main[table["VpcId"]] = table
            elif assoc.get("SubnetId"):
                by_subnet[assoc["SubnetId"]] = table
    private: dict[str, list[str]] = {}
    for s in subnets:
        table = by_subnet.get(s["SubnetId"]) or main.get(s["VpcId"]) or {}
        to_internet = any(
            r.get("DestinationCidrBlock") == "0.0.0.0/0" and str(r.get("GatewayId", "")).startswith("igw-")
            for r in table.get("Routes", [])
        )
        if not to_internet:
            private.setdefault(s["AvailabilityZone"], []).append(s["SubnetId"])
    return ClusterSubnets(name, True, {z: sorted(ids) for z, ids in private.items()})


# ---------------------------------------------------------------- what ``down`` may leave behind

CLUSTER_NAME_TAG = "alpha.eksctl.io/cluster-name"
"""eksctl tags every CloudFormation stack with the cluster's name (``NewStackCollection``'s shared tags), and
CloudFormation passes stack tags on to the resources it makes: the VPC stack's NAT gateway and its Elastic IP."""
NODE_CLUSTER_TAG = "eks:cluster-name"
"""EKS tags the instances of a managed node group with the cluster's name."""


@dataclass(frozen=True)
class Leftover:
    """Something billable that outlived the cluster: what it is, its id, and the AWS CLI command deleting it."""

    kind: str
    id: str
    delete_argv: tuple[str, ...]

    def describe(self) -> str:
        import shlex

        return f"{self.kind} {self.id}: `{shlex.join(self.delete_argv)}`"


def _tagged(item: dict[str, Any], key: str, value: str) -> bool:
    return any(t.get("Key") == key and t.get("Value") == value for t in item.get("Tags", []))


def billable_leftovers(aws: Aws, region: str, cluster: str) -> list[Leftover]:
    """NAT gateways, Elastic IPs and instances of ``cluster`` in ``region`` that still exist (and so cost money).

    Each is matched by tag, on the server and again here (a filter the server ignores must not report the
    resources of other clusters). Deleted and deleting NAT gateways and terminated instances are not counted.
    """
    ec2 = aws.client("ec2", region)
    tag_filter = [{"Name": f"tag:{CLUSTER_NAME_TAG}", "Values": [cluster]}]
    found: list[Leftover] = []
    with aws_errors(f"looking for what cluster {cluster} left behind in {region}"):
        pages = ec2.get_paginator("describe_nat_gateways").paginate(
            Filter=[*tag_filter, {"Name": "state", "Values": ["pending", "available"]}]
        )
        for page in pages:
            for nat in page.get("NatGateways", []):
                if _tagged(nat, CLUSTER_NAME_TAG, cluster) and nat.get("State") in ("pending", "available"):
                    argv = ("aws", "ec2", "delete-nat-gateway", "--region", region, "--nat-gateway-id")
                    found.append(Leftover("NAT gateway", nat["NatGatewayId"], (*argv, nat["NatGatewayId"])))
        for addr in ec2.describe_addresses(Filters=tag_filter).get("Addresses", []):
            if _tagged(addr, CLUSTER_NAME_TAG, cluster) and "AllocationId" in addr:
                argv = ("aws", "ec2", "release-address", "--region", region, "--allocation-id")
                found.append(Leftover("Elastic IP", addr["AllocationId"], (*argv, addr["AllocationId"])))
        alive = {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}
        seen: set[str] = set()
        for key in (NODE_CLUSTER_TAG, CLUSTER_NAME_TAG):
            pages = ec2.get_paginator("describe_instances").paginate(
                Filters=[{"Name": f"tag:{key}", "Values": [cluster]}, alive]
            )
            for page in pages:
                for reservation in page.get("Reservations", []):
                    for inst in reservation.get("Instances", []):
                        iid = inst["InstanceId"]
                        state = inst.get("State", {}).get("Name")
                        if iid in seen or not _tagged(inst, key, cluster) or state not in alive["Values"]:
                            continue
                        seen.add(iid)
                        found.append(
                            Leftover(
                                "instance",
                                iid,
                                ("aws", "ec2", "terminate-instances", "--region", region, "--instance-ids", iid),
                            )
                        )
    return found
