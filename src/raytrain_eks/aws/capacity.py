"""Where the GPU node group can get capacity: a ranked table of regions and zones, and a verdict on the config.

For the configuration's GPU type and count, in each checked region and zone: whether EC2 offers the type there,
whether it supports EFA (and with how many interfaces), the vCPUs needed against the family's on-demand quota minus
the vCPUs of the on-demand instances already running, the spot placement score (a signal only), and whether an
existing cluster of the configured name has a private subnet there. ``probe=True`` also reserves the capacity for
a moment (an on-demand capacity reservation, cancelled at once; every exit path cancels whatever the probe left).

The model and the ranking are pure (:class:`Candidate`, :func:`rank`, :meth:`CapacityReport.problem`,
:func:`table_lines`); :func:`check_capacity` gathers the facts through :mod:`raytrain_eks.aws.services`.
Example::

    aws = connect(cfg.cluster.region)
    report = check_capacity(cfg, aws, boto3_services(aws), regions=["us-east-1", "us-west-2"])
    print("\\n".join(table_lines(report)))
    if (err := report.problem()) is not None:
        raise err
"""

from __future__ import annotations

import difflib
import math
import shlex
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from raytrain_eks.aws import services as svc
from raytrain_eks.aws.eksctl import AVOIDED_ZONE_IDS
from raytrain_eks.aws.session import Aws, AwsCredentialsError
from raytrain_eks.config import Config
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.instances import EFA_GPU_TYPES, KNOWN_REGIONS, QUOTA_CODES, quota_family

QUOTA_NAMES = {
    "G": "Running On-Demand G and VT instances",
    "P": "Running On-Demand P instances",
    "standard": "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
}

PROBE_LIMIT = 8
"""At most this many zones are probed in one run; probing stops at the first zone that has the capacity."""

Say = Callable[[str], None]


# ---------------------------------------------------------------- the model (pure)


@dataclass(frozen=True)
class TypeInfo:
    """What DescribeInstanceTypes says about a type in one region."""

    name: str
    vcpus: int
    gpus: int
    efa_supported: bool
    efa_interfaces: int

    @classmethod
    def from_api(cls, item: dict[str, Any]) -> TypeInfo:
        gpus = item.get("GpuInfo", {}).get("Gpus", [])
        net = item.get("NetworkInfo", {})
        efa = bool(net.get("EfaSupported", False))
        return cls(
            name=item["InstanceType"],
            vcpus=int(item["VCpuInfo"]["DefaultVCpus"]),
            gpus=sum(int(g.get("Count", 0)) for g in gpus),
            efa_supported=efa,
            efa_interfaces=int(net.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0)) if efa else 0,
        )


@dataclass(frozen=True)
class Quota:
    """One region's on-demand vCPU quota for the GPU type's family: the limit, what running instances use, and
    what the node group needs. ``limit is None``: unknown (``source`` says why)."""

    region: str
    family: str
    limit: float | None
    source: str
    used: int
    need: int
    held: int = 0  # the part of ``used`` that unused capacity reservations hold

    @property
    def code(self) -> str:
        return QUOTA_CODES[self.family]

    @property
    def free(self) -> float | None:
        return None if self.limit is None else self.limit - self.used

    @property
    def short(self) -> int:
        """vCPUs missing (0 when enough, or when the limit is unknown)."""
        free = self.free
        if free is None or self.need <= 0 or free >= self.need:
            return 0
        return math.ceil(self.need - max(free, 0))

    def increase_argv(self) -> list[str]:
        """The AWS CLI command asking for a limit that fits the running instances plus the node group."""
        return [
            "aws",
            "service-quotas",
            "request-service-quota-increase",
            "--service-code",
            "ec2",
            "--quota-code",
            self.code,
            "--desired-value",
            str(self.used + self.need),
            "--region",
            self.region,
        ]

    def check_argv(self) -> list[str]:
        """The AWS CLI command that shows the quota's value."""
        argv = ["aws", "service-quotas", "get-service-quota", "--service-code", "ec2", "--quota-code", self.code]
        return [*argv, "--region", self.region]


@dataclass(frozen=True)
class Probe:
    """The result of reserving the capacity for a moment: ``ok`` and what happened (reservation id or error)."""

    ok: bool
    detail: str


@dataclass(frozen=True)
class Candidate:
    """One place the GPU node group could go. ``zone is None``: the region offers the type in no zone.

    ``efa_interfaces``: None when EC2 does not know the type in this region, 0 when it has no EFA there.
    ``cluster``: the configured cluster's name when it exists in this region. ``private_subnets``: its private
    subnets in this zone. ``target``: the configuration's own region (and ``gpu_az`` when set).
    ``reservation``: the existing capacity reservation the GPU group would target here (one holding every node,
    or the configured one); ``reserved``: the GPU instances reservations hold for it here; ``reservation_problem``:
    why the configured reservation cannot hold every node.
    """

    region: str
    zone: str | None
    zone_id: str | None
    offered: bool
    efa_interfaces: int | None
    quota: Quota | None
    spot_score: int | None = None
    cluster: str | None = None
    private_subnets: tuple[str, ...] = ()
    target: bool = False
    probe: Probe | None = None
    system_quota: Quota | None = None
    reservation: svc.ExistingReservation | None = None
    reserved: int = 0
    reservation_problem: str | None = None

    @property
    def covered(self) -> bool:
        """An existing capacity reservation here holds every GPU node: no GPU quota, capacity or probe needed.

        Not ``quota.need == 0``: a system node of the GPU type's quota family adds to that need."""
        return self.reservation is not None and self.reservation_problem is None

    @property
    def problems(self) -> list[str]:
        """Why the node group cannot go here; empty when it can."""
        out: list[str] = []
        if not self.offered:
            out.append("not offered here" if self.zone else "not offered in any zone of the region")
        if self.efa_interfaces is None:
            out.append("type unknown in this region")
        elif self.efa_interfaces == 0:
            out.append("no EFA here")
        if self.quota is not None and self.quota.short:
            out.append(f"quota {self.quota.code} short by {self.quota.short} vCPUs")
        if self.system_quota is not None and self.system_quota.short:
            out.append(f"quota {self.system_quota.code} short by {self.system_quota.short} vCPUs (system node)")
        if self.reservation_problem:
            out.append(self.reservation_problem)
        if self.cluster and self.zone and not self.private_subnets:
            out.append(f"cluster {self.cluster} has no private subnet here")
        if self.probe is not None and not self.probe.ok:
            out.append(f"probe: {self.probe.detail}")
        return out

    @property
    def viable(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        q = self.quota
        return {
            "region": self.region,
            "zone": self.zone,
            "zone_id": self.zone_id,
            "offered": self.offered,
            "efa_interfaces": self.efa_interfaces,
            "quota": _quota_dict(q),
            "spot_score": self.spot_score,
            "cluster": self.cluster,
            "private_subnets": list(self.private_subnets),
            "target": self.target,
            "probe": None if self.probe is None else {"ok": self.probe.ok, "detail": self.probe.detail},
            "system_quota": _quota_dict(self.system_quota),
            "reservation": None if self.reservation is None else self.reservation.id,
            "reserved_instances": self.reserved,
            "viable": self.viable,
            "problems": self.problems,
        }


def _users(q: Quota) -> str:
    if not q.held:
        return f"running on-demand instances use {q.used}"
    return f"running on-demand instances ({q.used - q.held}) and unused capacity reservations ({q.held}) use {q.used}"


def _quota_dict(q: Quota | None) -> dict[str, object] | None:
    if q is None:
        return None
    return {"code": q.code, "limit": q.limit, "source": q.source, "used": q.used, "need": q.need, "free": q.free}


def _rank_key(c: Candidate) -> tuple[object, ...]:
    probe = 0 if c.probe is None else (-1 if c.probe.ok else 1)
    free = c.quota.free if c.quota is not None and c.quota.free is not None else float("-inf")
    return (
        not c.viable,
        not c.offered,  # of the places that cannot take it now, those a quota increase or a retry may fix first
        len(c.problems),
        not c.covered,  # an existing capacity reservation holds the nodes: nothing left to chance
        probe,  # reserved just now beats not probed
        not (c.cluster and c.private_subnets),  # the existing cluster can take a node group here
        -(c.spot_score or 0),  # spot placement score: a hint of spare capacity
        -free,
        not c.target,
        c.region,
        c.zone or "",
    )


def rank(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Best first: usable places, then offered ones that are not; within each, those an existing capacity
    reservation covers, those a probe reserved, in the
    existing cluster's private subnets, with the higher spot score, with more free quota, in the configured region;
    then alphabetical. Pure."""
    return sorted(candidates, key=_rank_key)


class RegionError(UserError):
    """Bad ``--regions``/``--all-regions``: a region EC2 does not list, one the account has not enabled, none, or
    both options at once."""

    exit_code = 2


class CapacityError(UserError):
    """The configured region (or zone) cannot take the GPU node group now; the message says why."""


class ReservationsLeftError(UserError):
    """A probe could not make sure its capacity reservations were cancelled: they cost money until cancelled."""


@dataclass(frozen=True)
class CapacityReport:
    """Everything ``capacity`` found, candidates ranked best first."""

    instance_type: str
    count: int
    vcpus_per_node: int
    family: str
    system_type: str
    config_region: str
    gpu_az: str | None
    regions: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    quotas: dict[str, Quota] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    probed: bool = False

    @property
    def vcpus_needed(self) -> int:
        return self.count * self.vcpus_per_node

    @property
    def quota_code(self) -> str:
        return QUOTA_CODES[self.family]

    @property
    def targets(self) -> list[Candidate]:
        """The configured placement's candidates; every candidate when the configured region was not checked."""
        return [c for c in self.candidates if c.target] or list(self.candidates)

    @property
    def best(self) -> Candidate | None:
        return next((c for c in self.candidates if c.viable), None)

    def short_quotas(self) -> list[Quota]:
        """The regions' quotas that cannot fit the node groups (GPU, then system), for regions offering the type.
        A region's GPU quota counts as short only when it is short in every zone (reservations differ by zone)."""
        out: list[Quota] = []
        for region in sorted({c.region for c in self.candidates if c.offered}):
            here = [c for c in self.candidates if c.region == region and c.offered]
            gpu = [c.quota for c in here if c.quota is not None]
            if gpu and all(q.short for q in gpu):
                out.append(min(gpu, key=lambda q: q.short))
            system = next((c.system_quota for c in here if c.system_quota is not None), None)
            if system is not None and system.short:
                out.append(system)
        return out

    def problem(self) -> CapacityError | None:
        """None when the configured placement can take the node group, else the error to raise: one message."""
        targets = self.targets
        if any(c.viable for c in targets):
            return None
        head = targets[0]
        what = f"{self.count} x {self.instance_type} ({self.vcpus_needed} vCPUs)"
        where = head.zone or head.region
        alt = next((c for c in self.candidates if c.viable and not c.target), None)
        alt_line = f"Best alternative: {alt.zone or alt.region} (REGION={alt.region} GPU_AZ={alt.zone})." if alt else ""
        short = [q for q in (head.quota, head.system_quota) if q is not None and q.short]
        if short:
            others = [p for p in head.problems if not p.startswith("quota ")]
            parts = []
            for q in short:
                who = (
                    f"{self.count} x {self.instance_type} need"
                    if q is head.quota
                    else f"the system node group ({self.system_type}) needs"
                )
                parts.append(
                    f"{who} {q.need} vCPUs of '{QUOTA_NAMES[q.family]}' ({q.code}); the quota is {q.limit:g} "
                    f"and {_users(q)}, so {q.free:g} are free ({q.short} short)"
                )
            message = (
                f"quota short in {head.region}: "
                + "; and ".join(parts)
                + (f"; also {where}: {'; '.join(others)}" if others else "")
            )
            commands = "\n  ".join(shlex.join(q.increase_argv()) for q in short)
            hint = "Ask AWS for more (approval takes minutes to days):\n  " + commands
            return CapacityError(message, hint=f"{hint}\n{alt_line}".strip())
        message = f"{what} cannot go to {where}: {'; '.join(head.problems)}"
        return CapacityError(message, hint=alt_line or "Try other regions: `raytrain-eks capacity --all-regions`.")

    def to_dict(self) -> dict[str, object]:
        problem = self.problem()
        return {
            "instance_type": self.instance_type,
            "count": self.count,
            "vcpus_needed": self.vcpus_needed,
            "quota_family": self.family,
            "quota_code": self.quota_code,
            "config_region": self.config_region,
            "gpu_az": self.gpu_az,
            "regions": list(self.regions),
            "probed": self.probed,
            "ok": problem is None,
            "problem": None if problem is None else problem.message,
            "quota_increase_commands": [shlex.join(q.increase_argv()) for q in self.short_quotas()],
            "notes": list(self.notes),
            "candidates": [c.to_dict() for c in self.candidates],
        }


def table_lines(report: CapacityReport) -> list[str]:
    """The ranked table as text lines, with a header line and the quota-increase commands under it. Pure."""
    header = ["#", "region", "zone", "zone id", "offered", "EFA", "vCPU free/quota", "reserved", "spot"]
    header += ["private subnet"]
    header += ["probe"] if report.probed else []
    header += ["status"]
    rows: list[list[str]] = []
    for i, c in enumerate(report.candidates, 1):
        q = c.quota
        quota = "-" if q is None else ("?" if q.limit is None else f"{q.free:g}/{q.limit:g}")
        subnet = "-" if not c.cluster or not c.zone else (",".join(c.private_subnets) or "none")
        efa = "?" if c.efa_interfaces is None else (str(c.efa_interfaces) if c.efa_interfaces else "no")
        row = [
            str(i),
            c.region,
            (c.zone or "-") + ("*" if c.target and report.config_region in report.regions else ""),
            c.zone_id or "-",
            "yes" if c.offered else "no",
            efa,
            quota,
            "-"
            if c.reservation is None and not c.reserved
            else f"{c.reserved} ({c.reservation.id if c.reservation else 'open'})",
            "-" if c.spot_score is None else str(c.spot_score),
            subnet,
        ]
        if report.probed:
            row.append("-" if c.probe is None else ("reserved" if c.probe.ok else "failed"))
        row.append("ok" if c.viable else "; ".join(c.problems))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [
        f"{report.count} x {report.instance_type} = {report.vcpus_needed} vCPUs of quota {report.quota_code} "
        f"('{QUOTA_NAMES[report.family]}') in each region; best first"
        + (
            f"; * = configured ({report.gpu_az or report.config_region})"
            if report.config_region in report.regions
            else ""
        ),
        fmt.format(*header).rstrip(),
        *(fmt.format(*r).rstrip() for r in rows),
    ]
    for q in report.short_quotas():
        lines.append(f"quota {q.code} short in {q.region} by {q.short} vCPUs; ask for more with:")
        lines.append(f"  {shlex.join(q.increase_argv())}")
    lines += [f"note: {n}" for n in report.notes]
    return lines


# ---------------------------------------------------------------- the probe


def probe_zone(
    reservations: svc.Reservations, *, region: str, zone: str, instance_type: str, count: int, say: Say
) -> Probe:
    """Reserve ``count`` instances in ``zone`` and cancel the reservation at once; report whether EC2 had them.

    Every exit path (success, no capacity, an error or Ctrl-C anywhere between create and cancel, a create whose
    answer was lost) cancels the reservation and anything else tagged with this probe's token.
    """
    token = f"raytrain-eks-probe-{uuid.uuid4().hex[:16]}"
    made: list[str] = []
    try:
        try:
            reservation = reservations.create(
                region=region, instance_type=instance_type, zone=zone, count=count, token=token
            )
        except svc.NoCapacity as exc:
            return Probe(False, exc.code)
        made.append(reservation.id)
        say(f"probe: reserved {count} x {instance_type} in {zone} ({reservation.id}, {reservation.state}); cancelling")
        return Probe(reservation.state == "active", f"{reservation.id} {reservation.state}")
    finally:
        _release(reservations, region=region, token=token, known=made, say=say)


def _release(reservations: svc.Reservations, *, region: str, token: str, known: list[str], say: Say) -> None:
    """Cancel ``known`` and every open reservation tagged ``token``, then check none is left; three tries, and a
    last look after the third.

    A Ctrl-C while cancelling does not stop the cancelling: it is raised again once nothing is left.
    """
    interrupted: KeyboardInterrupt | None = None
    error: Exception | None = None
    cancelled: set[str] = set()
    for attempt in range(4):
        try:
            listed = reservations.open_ids(region=region, token=token)
            todo = [r for r in dict.fromkeys([*known, *listed]) if r not in cancelled]
            if not todo:
                break
            if attempt == 3:  # still open after three tries: said below
                continue
            for rid in todo:
                reservations.cancel(region=region, reservation_id=rid)
                cancelled.add(rid)
                say(f"probe: cancelled {rid}")
        except KeyboardInterrupt as exc:
            interrupted = exc
            say("probe: interrupted; still cancelling the capacity reservation")
        except Exception as exc:  # any failure here: retry, then tell the user what to cancel
            error = exc
    else:
        left = [r for r in known if r not in cancelled]
        find = [
            "aws",
            "ec2",
            "describe-capacity-reservations",
            "--region",
            region,
            "--filters",
            f"Name=tag:{svc.PROBE_TAG},Values={token}",
            "Name=state,Values=active,pending",
        ]
        cancel = [
            shlex.join(
                ["aws", "ec2", "cancel-capacity-reservation", "--capacity-reservation-id", r, "--region", region]
            )
            for r in left
        ]
        why = f"{type(error).__name__}: {error}" if error else "still open"
        raise ReservationsLeftError(
            f"could not make sure the probe's capacity reservations in {region} are cancelled ({why}); "
            "they are billed until cancelled",
            hint="Find and cancel them now:\n  " + "\n  ".join([shlex.join(find), *cancel]),
        ) from error
    if interrupted is not None:
        raise interrupted


# ---------------------------------------------------------------- gathering the facts


@dataclass(frozen=True)
class _Survey:
    """The facts of one region, read without creating anything."""

    region: str
    type_info: TypeInfo | None
    zones: dict[str, str]
    offered: frozenset[str]
    quota: Quota | None = None
    spot: svc.SpotSignal | None = None
    cluster: svc.ClusterSubnets | None = None
    system_quota: Quota | None = None
    reservations: tuple[svc.ExistingReservation, ...] = ()
    reservations_note: str = ""


def resolve_regions(aws: Aws, requested: Sequence[str] | None, all_regions: bool) -> list[str]:
    """The regions to check: ``requested``, every enabled region of the partition, or the config's region.

    Raises :class:`UserError` for a name EC2 does not list (with the closest names) or a region not enabled.
    """
    ask_in = aws.region if aws.region in KNOWN_REGIONS else "us-east-1"
    status = svc.region_opt_in(aws, ask_in)
    partition = aws.partition(ask_in)

    def same_partition(name: str) -> bool:
        try:
            return aws.partition(name) == partition
        except Exception:  # botocore cannot place the name: not ours
            return False

    if all_regions:
        return sorted(n for n, s in status.items() if s != "not-opted-in" and same_partition(n))
    names = list(dict.fromkeys(requested or [aws.region]))
    for name in names:
        source = "--regions" if requested else "cluster.region (REGION)"
        if name not in status:
            close = difflib.get_close_matches(name, list(status), n=3)
            hint = f"did you mean {' or '.join(close)}?" if close else "see `aws ec2 describe-regions --all-regions`"
            if requested:
                raise RegionError(f"{source}: {name!r} is not an AWS region; {hint}")
            raise ConfigError([f"cluster.region = {name!r}: not an AWS region; {hint}"])
        if status[name] == "not-opted-in":
            raise RegionError(
                f"{source}: region {name!r} is not enabled for this AWS account",
                hint=f"Enable it first: `aws account enable-region --region-name {name}` (takes minutes to hours).",
            )
    return names


def _survey(aws: Aws, services: svc.Services, region: str, cfg: Config) -> _Survey:
    c = cfg.cluster
    item = svc.describe_types(aws, region, [c.gpu_node_type]).get(c.gpu_node_type)
    info = TypeInfo.from_api(item) if item else None
    zones = svc.zone_ids(aws, region)
    offered = frozenset(svc.offered_zones(aws, region, c.gpu_node_type)) if info else frozenset()
    family = quota_family(c.gpu_node_type)
    if info is None or not offered or family is None:
        return _Survey(region, info, zones, offered)
    running = svc.on_demand_instance_types(aws, region)
    try:
        reservations, reservations_note = tuple(services.reservations.active(region=region)), ""
    except AwsCredentialsError:
        raise
    except UserError as exc:  # e.g. no ec2:DescribeCapacityReservations: checked without them, and said so
        reservations, reservations_note = (), exc.message
    cluster = svc.cluster_subnets(aws, region, c.name)
    system_family = quota_family(c.system_node_type)
    families = {family, system_family} - {None}
    kinds = {t for t in [*running, *(r.instance_type for r in reservations)] if quota_family(t) in families}
    vcpus = {
        t: TypeInfo.from_api(d).vcpus for t, d in svc.describe_types(aws, region, kinds | {c.system_node_type}).items()
    }
    vcpus[c.gpu_node_type] = info.vcpus

    def quota(fam: str, need: int) -> Quota:
        """``fam``'s quota against ``need``. What already holds it: running on-demand instances, plus the unused
        part of active capacity reservations (a reservation takes its quota when made; instances launched into it
        add none)."""
        limit = services.quotas.vcpu_limit(region, QUOTA_CODES[fam])
        run = sum(n * vcpus.get(t, 0) for t, n in running.items() if quota_family(t) == fam)
        held = sum(
            r.available * vcpus.get(r.instance_type, 0) for r in reservations if quota_family(r.instance_type) == fam
        )
        return Quota(region, fam, limit.value, limit.source, run + held, need, held)

    # The system node group exists with the cluster: its instances are already among the running ones.
    system_need = 0 if cluster.found else c.system_node_count * vcpus.get(c.system_node_type, 0)
    gpu_need = c.gpu_node_count * info.vcpus
    if system_family == family:  # one quota for both node groups
        gpu_need += system_need
    gpu_quota = quota(family, gpu_need)
    system_quota = None
    if system_family is not None and system_family != family and system_need:
        system_quota = quota(system_family, system_need)
    spot = services.spot.scores(region, c.gpu_node_type, c.gpu_node_count)
    return _Survey(
        region, info, zones, offered, gpu_quota, spot, cluster, system_quota, reservations, reservations_note
    )


def _check_type(cfg: Config, surveys: list[_Survey]) -> TypeInfo:
    """The GPU type as EC2 describes it; ConfigError when it is unknown, has no GPU or has EFA nowhere checked."""
    c = cfg.cluster
    infos = [s.type_info for s in surveys if s.type_info is not None]
    where = ", ".join(s.region for s in surveys)
    field_ = f"cluster.gpu_node_type = {c.gpu_node_type!r} (GPU_NODE_TYPE)"
    if not infos:
        raise ConfigError([f"{field_}: EC2 does not know this instance type in {where}"])
    info = infos[0]
    if not info.gpus:
        raise ConfigError([f"{field_}: has no GPU; use an EFA GPU type such as {', '.join(EFA_GPU_TYPES[:4])}"])
    if not any(i.efa_supported for i in infos):
        raise ConfigError(
            [
                f"{field_}: does not support EFA (EC2 DescribeInstanceTypes in {where}), so NCCL would fall back "
                f"to TCP sockets between nodes; use an EFA type such as {', '.join(EFA_GPU_TYPES[:4])}"
            ]
        )
    if quota_family(c.gpu_node_type) is None:
        raise ConfigError([f"{field_}: its on-demand quota is not one of G, P or standard, which capacity checks"])
    return next(i for i in infos if i.efa_supported)


def _check_gpu_az(cfg: Config, surveys: list[_Survey]) -> None:
    c = cfg.cluster
    home = next((s for s in surveys if s.region == c.region), None)
    field_ = f"cluster.gpu_az = {c.gpu_az!r} (GPU_AZ)"
    zone_id = home.zones.get(c.gpu_az) if c.gpu_az and home is not None else None
    if home is not None and c.gpu_az in home.offered and zone_id in AVOIDED_ZONE_IDS.get(c.region, ()):
        usable = [z for z in sorted(home.offered) if home.zones.get(z) not in AVOIDED_ZONE_IDS.get(c.region, ())]
        raise ConfigError(
            [
                f"{field_}: it is zone {zone_id}, where EKS cannot create a cluster (eksctl never picks it either); "
                f"zones of {c.region} that offer {c.gpu_node_type}: {', '.join(usable) or 'none'}"
            ]
        )
    if not c.gpu_az or home is None or c.gpu_az in home.offered:
        return
    if c.gpu_az not in home.zones:
        raise ConfigError([f"{field_}: not an availability zone of {c.region}; its zones: {', '.join(home.zones)}"])
    offered = ", ".join(sorted(home.offered)) or "none"
    raise ConfigError(
        [f"{field_}: {c.gpu_node_type} is not offered in that zone; zones of {c.region} that offer it: {offered}"]
    )


def _check_reservation(cfg: Config, surveys: list[_Survey]) -> None:
    """Stop when the configured ``capacity_reservation_id`` cannot be checked (UserError), is not one EC2 lists or
    cannot hold the GPU nodes (ConfigError: type, zone, platform, tenancy, kind). Whether it has room is said zone
    by zone (:func:`_zone_reservation`)."""
    c = cfg.cluster
    rid = c.capacity_reservation_id
    home = next((s for s in surveys if s.region == c.region), None)
    if rid is None or home is None or home.quota is None:
        return
    field_ = f"cluster.capacity_reservation_id = {rid!r}"
    if home.reservations_note:
        raise UserError(
            f"{field_} is set, but the capacity reservations of {c.region} could not be listed: "
            f"{home.reservations_note}",
            hint="Allow ec2:DescribeCapacityReservations for these credentials, or remove capacity_reservation_id.",
        )
    found = next((r for r in home.reservations if r.id == rid), None)
    if found is None:
        listing = ["aws", "ec2", "describe-capacity-reservations", "--region", c.region]
        raise ConfigError(
            [
                f"{field_}: no active capacity reservation with this id in {c.region}; yours are listed by "
                f"`{shlex.join([*listing, '--filters', 'Name=state,Values=active'])}`"
            ]
        )
    problems = []
    if found.instance_type != c.gpu_node_type:
        problems.append(f"it reserves {found.instance_type}, the GPU node type is {c.gpu_node_type}")
    if c.gpu_az and found.zone != c.gpu_az:
        problems.append(f"it is in {found.zone}, cluster.gpu_az is {c.gpu_az}; leave gpu_az empty or make them agree")
    if found.unusable_why:
        problems.append(found.unusable_why)
    if problems:
        raise ConfigError([f"{field_}: {'; '.join(problems)}"])


def _zone_reservation(
    cfg: Config, survey: _Survey, zone: str
) -> tuple[svc.ExistingReservation | None, int, str | None]:
    """For ``zone``: the reservation the GPU node group would target (one holding every node, the configured one
    first), the instances reservations cover there, and why the configured one cannot hold them (or None)."""
    c = cfg.cluster
    mine = [
        r
        for r in survey.reservations
        if r.zone == zone and r.instance_type == c.gpu_node_type and r.unusable_why is None
    ]
    if c.capacity_reservation_id:
        pinned = next((r for r in mine if r.id == c.capacity_reservation_id), None)
        if pinned is None:
            return None, 0, None
        covered = min(c.gpu_node_count, pinned.available)
        why = None
        if pinned.available < c.gpu_node_count:
            why = f"reservation {pinned.id} has {pinned.available} of {c.gpu_node_count} instances free"
        return pinned, covered, why
    whole = sorted((r for r in mine if r.available >= c.gpu_node_count), key=lambda r: (r.available, r.id))
    if whole:
        return whole[0], c.gpu_node_count, None
    # None holds them all: open reservations still take what they can, without being named.
    return None, min(c.gpu_node_count, sum(r.available for r in mine if r.match == "open")), None


def _candidates(cfg: Config, survey: _Survey) -> list[Candidate]:
    c = cfg.cluster
    info = survey.type_info
    efa = None if info is None else info.efa_interfaces
    in_home = survey.region == c.region
    cluster = survey.cluster.name if survey.cluster is not None and survey.cluster.found else None
    private = survey.cluster.private if survey.cluster is not None else {}
    if not survey.offered:
        return [Candidate(survey.region, None, None, False, efa, survey.quota, target=in_home and not c.gpu_az)]
    scores = (survey.spot.scores if survey.spot is not None else None) or {}
    pinned_zone = next((r.zone for r in survey.reservations if r.id == c.capacity_reservation_id and in_home), None)
    out = []
    for zone in sorted(set(survey.zones) | survey.offered):
        zone_id = survey.zones.get(zone)
        reservation, covered, why = _zone_reservation(cfg, survey, zone)
        quota = survey.quota
        if quota is not None and covered and info is not None:
            quota = replace(quota, need=quota.need - covered * info.vcpus)
        wanted = pinned_zone or c.gpu_az
        out.append(
            Candidate(
                region=survey.region,
                zone=zone,
                zone_id=zone_id,
                offered=zone in survey.offered,
                efa_interfaces=efa,
                quota=quota,
                spot_score=scores.get(zone_id) if zone_id else None,
                cluster=cluster,
                private_subnets=tuple(private.get(zone, ())),
                target=in_home and (wanted is None or wanted == zone),
                system_quota=survey.system_quota,
                reservation=reservation,
                reserved=covered,
                reservation_problem=why,
            )
        )
    return out


def check_capacity(
    cfg: Config,
    aws: Aws,
    services: svc.Services,
    *,
    regions: Sequence[str] | None = None,
    all_regions: bool = False,
    probe: bool = False,
    say: Say = lambda _line: None,
) -> CapacityReport:
    """Check every zone of the chosen regions for ``cfg``'s GPU node group; with ``probe``, reserve it a moment.

    Raises before creating anything: :class:`UserError` for an unknown or disabled region, :class:`ConfigError`
    for a GPU type EC2 does not know, without GPU or without EFA, or a ``gpu_az`` that does not offer it. A short
    quota or missing capacity is not raised here: it is in the report (:meth:`CapacityReport.problem`).
    """
    c = cfg.cluster
    names = resolve_regions(aws, regions, all_regions)
    say(f"checking {c.gpu_node_count} x {c.gpu_node_type} in {len(names)} region(s): {', '.join(names)}")
    with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:
        surveys = list(pool.map(lambda r: _survey(aws, services, r, cfg), names))
    info = _check_type(cfg, surveys)
    _check_gpu_az(cfg, surveys)
    _check_reservation(cfg, surveys)
    family = quota_family(c.gpu_node_type) or "G"
    candidates = rank([cand for s in surveys for cand in _candidates(cfg, s)])
    notes = _notes(surveys)
    if probe:
        candidates = rank(_probe_best(candidates, services.reservations, c.gpu_node_type, c.gpu_node_count, say))
    return CapacityReport(
        instance_type=c.gpu_node_type,
        count=c.gpu_node_count,
        vcpus_per_node=info.vcpus,
        family=family,
        system_type=c.system_node_type,
        config_region=c.region,
        gpu_az=c.gpu_az,
        regions=tuple(names),
        candidates=tuple(candidates),
        quotas={s.region: s.quota for s in surveys if s.quota is not None},
        notes=tuple(notes),
        probed=probe,
    )


def _notes(surveys: list[_Survey]) -> list[str]:
    """What could not be read, each reason once with the regions it applies to."""
    groups: dict[str, list[str]] = {}
    see: dict[str, list[str]] = {}  # a reason's command, in the first region it applies to
    for s in surveys:
        if s.spot is not None and s.spot.scores is None:
            groups.setdefault(f"spot placement score unavailable ({s.spot.note})", []).append(s.region)
        if s.cluster is not None and s.cluster.found is None:
            groups.setdefault(f"cluster {s.cluster.name} could not be looked up ({s.cluster.note})", []).append(
                s.region
            )
        if s.reservations_note:
            groups.setdefault(f"existing capacity reservations not counted ({s.reservations_note})", []).append(
                s.region
            )
        if s.quota is not None and s.quota.limit is None:
            what = f"quota {s.quota.code} unknown ({s.quota.source})"
            groups.setdefault(what, []).append(s.region)
            see.setdefault(what, s.quota.check_argv())
    notes = []
    for what, regions in groups.items():
        note = f"{what} in {', '.join(regions)}"
        if what in see:
            note += f"; see it with `{shlex.join(see[what])}`"
        notes.append(note)
    return notes


def _probe_best(
    ranked: list[Candidate], reservations: svc.Reservations, instance_type: str, count: int, say: Say
) -> list[Candidate]:
    """Probe the usable zones, configured ones first, best first, until one has the capacity (at most
    :data:`PROBE_LIMIT`). Zones that are not usable (quota short, not offered, ...) are never probed."""
    order = [c for c in ranked if c.viable and c.target] + [c for c in ranked if c.viable and not c.target]
    results: dict[tuple[str, str | None], Probe] = {}
    for cand in order[:PROBE_LIMIT]:
        if cand.zone is None:  # cannot happen: a usable place is a zone that offers the type
            continue
        if cand.covered and cand.reservation is not None:  # already held: nothing to probe, nothing to pay
            say(f"probe: {cand.zone} needs none, reservation {cand.reservation.id} holds the nodes")
            results[(cand.region, cand.zone)] = Probe(True, f"{cand.reservation.id} (existing reservation)")
            break
        say(f"probe: reserving {count} x {instance_type} in {cand.zone} for a moment (billed for those seconds)")
        result = probe_zone(
            reservations, region=cand.region, zone=cand.zone, instance_type=instance_type, count=count, say=say
        )
        results[(cand.region, cand.zone)] = result
        if result.ok:
            break
    return [replace(c, probe=results.get((c.region, c.zone), c.probe)) for c in ranked]
