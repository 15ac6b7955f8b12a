"""GPU capacity bought other than on-demand: Capacity Blocks for ML and spot, as ``capacity`` shows and buys them.

Capacity Blocks (EC2 ``DescribeCapacityBlockOfferings``, ``PurchaseCapacityBlock``): the offerings for the GPU type,
node count and a window, each with its zone, start, end and upfront fee; buying one is a separate, confirmed step.
The block bought (or the one ``cluster.capacity_block_id`` names, read with ``DescribeCapacityReservations``) is
recorded in the state folder under :data:`BLOCK_KEY` with its start and end: ``up`` creates the node group at size
0 before the start, and the job can be told the end (EKS advises draining more than 30 minutes before it).

Spot (EC2 ``DescribeSpotPriceHistory``): the lowest and highest price of each same-shape type over a window, by
zone, recorded under :data:`SPOT_KEY` for ``plan``'s price range. The spot placement score is read by
:mod:`raytrain_eks.aws.capacity` already. Example::

    window = Window.from_now(hours=24, days=14)
    offers = block_offerings(cfg, Ec2CapacityBlocks(aws), window)   # cheapest first; refused types name others
    prices = spot_prices(cfg, Ec2SpotPrices(aws), days=7)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from raytrain_eks.aws.session import Aws, aws_errors, error_code
from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.instances import EFA_GPU_TYPES, same_shape

BLOCK_KEY = "capacity_block"
"""State key of the Capacity Block the GPU nodes use: id, type, count, zone, ISO ``start`` and ``end``, fee."""
SPOT_KEY = "spot_prices"
"""State key of the spot price range ``capacity`` last read: region, window and each type's low and high."""
DRAIN_BEFORE_END = timedelta(minutes=30)
"""EKS user guide, "Create self-managed nodes with Capacity Blocks for ML": scale to zero more than 30 minutes
before the block's end, to drain the nodes gracefully."""
# Codes with which DescribeCapacityBlockOfferings says the type (or count, or window) is not one it offers.
_NOT_OFFERED = frozenset({"InvalidParameterValue", "InvalidParameterCombination", "Unsupported"})


class CapacityBlockError(UserError):
    """No Capacity Block offering fits, an offering id that is not among them, or a purchase refused."""


def _as_json(record: Any) -> dict[str, Any]:
    """A dataclass's fields as JSON values, its times in ISO 8601."""
    values = {f.name: getattr(record, f.name) for f in fields(record)}
    return {name: v.isoformat() if isinstance(v, datetime) else v for name, v in values.items()}


@dataclass(frozen=True)
class Window:
    """When a block may run: ``hours`` long, starting no earlier than ``start`` and ending no later than ``end``."""

    hours: int
    start: datetime
    end: datetime

    @classmethod
    def from_now(cls, *, hours: int, days: int, now: datetime | None = None) -> Window:
        begin = (now or datetime.now(UTC)).replace(microsecond=0)
        return cls(hours, begin, begin + timedelta(days=days))

    def problem(self) -> str | None:
        if self.hours < 1:
            return f"--block-hours {self.hours}: give the block's length in hours, 1 or more"
        if self.end - self.start < timedelta(hours=self.hours):
            return f"the window {self.start:%Y-%m-%d %H:%M} to {self.end:%Y-%m-%d %H:%M} UTC is shorter than the block"
        return None


@dataclass(frozen=True)
class BlockOffering:
    """One offering of DescribeCapacityBlockOfferings: ``count`` x ``instance_type`` in ``zone`` from ``start`` to
    ``end``, for ``upfront_usd`` in all (paid when bought)."""

    id: str
    instance_type: str
    zone: str
    count: int
    start: datetime
    end: datetime
    hours: int
    upfront_usd: float
    currency: str = "USD"

    @classmethod
    def from_api(cls, item: dict[str, Any]) -> BlockOffering:
        return cls(
            id=item["CapacityBlockOfferingId"],
            instance_type=item["InstanceType"],
            zone=item["AvailabilityZone"],
            count=int(item["InstanceCount"]),
            start=item["StartDate"],
            end=item["EndDate"],
            hours=int(item["CapacityBlockDurationHours"]),
            upfront_usd=float(item["UpfrontFee"]),
            currency=item.get("CurrencyCode", "USD"),
        )

    def to_dict(self) -> dict[str, object]:
        return _as_json(self)


@dataclass(frozen=True)
class Block:
    """A Capacity Block the account holds (a capacity reservation of type ``capacity-block``): its state is
    ``payment-pending``, ``scheduled`` before ``start``, ``active`` until ``end``, then ``expired``."""

    id: str
    instance_type: str
    zone: str
    count: int
    start: datetime
    end: datetime
    state: str
    upfront_usd: float | None = None

    @property
    def drain_by(self) -> datetime:
        """When the job should have checkpointed and stopped (:data:`DRAIN_BEFORE_END` before the end)."""
        return self.end - DRAIN_BEFORE_END

    def started(self, now: datetime) -> bool:
        return now >= self.start

    def to_state(self) -> dict[str, object]:
        return {**_as_json(self), "drain_by": self.drain_by.isoformat()}

    @classmethod
    def from_state(cls, data: dict[str, Any]) -> Block:
        return cls(
            id=data["id"],
            instance_type=data["instance_type"],
            zone=data["zone"],
            count=int(data["count"]),
            start=datetime.fromisoformat(data["start"]),
            end=datetime.fromisoformat(data["end"]),
            state=data.get("state", "scheduled"),
            upfront_usd=data.get("upfront_usd"),
        )


@dataclass(frozen=True)
class SpotRange:
    """Spot prices of one type over a window: the lowest and highest seen in any zone, and each zone's."""

    instance_type: str
    low: float
    high: float
    zones: dict[str, tuple[float, float]]


class CapacityBlocks(Protocol):
    """Capacity Blocks for ML in one region."""

    def offerings(self, *, region: str, instance_type: str, count: int, window: Window) -> list[BlockOffering]:
        """Offerings of ``count`` x ``instance_type`` that fit ``window``; [] when EC2 offers none (or not the type)."""
        ...

    def purchase(self, *, region: str, offering_id: str) -> Block:
        """Buy the offering (Linux/UNIX); the fee is charged at once."""
        ...

    def describe(self, *, region: str, block_id: str) -> Block | None:
        """The account's block of that id, or None when EC2 lists none (or it is not a Capacity Block)."""
        ...


class SpotPrices(Protocol):
    """EC2's spot price history of Linux instances in one region."""

    def history(self, *, region: str, instance_types: Sequence[str], since: datetime) -> list[tuple[str, str, float]]:
        """(type, zone, USD per hour) of every price change since ``since``, plus the price in force then."""
        ...


@dataclass(frozen=True)
class Market:
    """The two interfaces ``capacity`` needs for blocks and spot prices (tests give fakes or moto-backed ones)."""

    blocks: CapacityBlocks
    spot_prices: SpotPrices


# ---------------------------------------------------------------- boto3 implementations


def _block_from_reservation(r: dict[str, Any], fee: float | None = None) -> Block:
    return Block(
        id=r["CapacityReservationId"],
        instance_type=r["InstanceType"],
        zone=r["AvailabilityZone"],
        count=int(r.get("TotalInstanceCount", 0)),
        start=r["StartDate"],
        end=r["EndDate"],
        state=r.get("State", "scheduled"),
        upfront_usd=fee,
    )


class Ec2CapacityBlocks:
    """:class:`CapacityBlocks` over EC2's API (boto3)."""

    def __init__(self, aws: Aws) -> None:
        self._aws = aws

    def offerings(self, *, region: str, instance_type: str, count: int, window: Window) -> list[BlockOffering]:
        import botocore.exceptions

        ec2 = self._aws.client("ec2", region)
        found: list[BlockOffering] = []
        try:
            with aws_errors(f"listing Capacity Block offerings in {region}", expected=_NOT_OFFERED):
                pages = ec2.get_paginator("describe_capacity_block_offerings").paginate(
                    InstanceType=instance_type,
                    InstanceCount=count,
                    CapacityDurationHours=window.hours,
                    StartDateRange=window.start,
                    EndDateRange=window.end,
                )
                for page in pages:
                    found += [BlockOffering.from_api(o) for o in page.get("CapacityBlockOfferings", [])]
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in _NOT_OFFERED:
                return []
            raise
        return found

    def purchase(self, *, region: str, offering_id: str) -> Block:
        ec2 = self._aws.client("ec2", region)
        tags = [{"Key": "created-by", "Value": "raytrain-eks"}]
        with aws_errors(f"buying Capacity Block offering {offering_id}"):
            made = ec2.purchase_capacity_block(
                CapacityBlockOfferingId=offering_id,
                InstancePlatform="Linux/UNIX",
                TagSpecifications=[{"ResourceType": "capacity-reservation", "Tags": tags}],
            )["CapacityReservation"]
        return _block_from_reservation(made)

    def describe(self, *, region: str, block_id: str) -> Block | None:
        import botocore.exceptions

        ec2 = self._aws.client("ec2", region)
        missing = {"InvalidCapacityReservationId.NotFound", "InvalidCapacityReservationId.Malformed"}
        try:
            with aws_errors(f"reading Capacity Block {block_id}", expected=missing):
                listed = ec2.describe_capacity_reservations(CapacityReservationIds=[block_id])["CapacityReservations"]
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in missing:
                return None
            raise
        blocks = [r for r in listed if r.get("ReservationType") == "capacity-block"]
        return _block_from_reservation(blocks[0]) if blocks else None


class Ec2SpotPrices:
    """:class:`SpotPrices` from ``describe_spot_price_history`` (product ``Linux/UNIX``)."""

    def __init__(self, aws: Aws) -> None:
        self._aws = aws

    def history(self, *, region: str, instance_types: Sequence[str], since: datetime) -> list[tuple[str, str, float]]:
        pages = (
            self._aws.client("ec2", region)
            .get_paginator("describe_spot_price_history")
            .paginate(InstanceTypes=list(instance_types), ProductDescriptions=["Linux/UNIX"], StartTime=since)
        )
        with aws_errors(f"reading the spot price history in {region}"):
            return [
                (p["InstanceType"], p["AvailabilityZone"], float(p["SpotPrice"]))
                for page in pages
                for p in page.get("SpotPriceHistory", [])
            ]


def boto3_market(aws: Aws) -> Market:
    return Market(blocks=Ec2CapacityBlocks(aws), spot_prices=Ec2SpotPrices(aws))


# ---------------------------------------------------------------- what capacity does with them


def block_offerings(
    cfg: Config, blocks: CapacityBlocks, window: Window, *, others: Iterable[str] = EFA_GPU_TYPES
) -> list[BlockOffering]:
    """The offerings for the GPU type and node count in ``window``, cheapest first.

    When EC2 lists none for the type, :class:`CapacityBlockError` names the ``others`` (EFA GPU types) that do
    have offerings for the same count and window, so the user can change ``cluster.gpu_node_type``.
    """
    c = cfg.cluster
    if (why := window.problem()) is not None:
        raise CapacityBlockError(why, hint="See `raytrain-eks capacity --help` for --block-hours/--block-days.")
    found = blocks.offerings(region=c.region, instance_type=c.gpu_node_type, count=c.gpu_node_count, window=window)
    if found:
        return sorted(found, key=lambda o: (o.upfront_usd, o.start, o.zone))
    offered = [
        t
        for t in others
        if t != c.gpu_node_type
        and blocks.offerings(region=c.region, instance_type=t, count=c.gpu_node_count, window=window)
    ]
    what = f"{c.gpu_node_count} x {c.gpu_node_type} for {window.hours} h"
    span = f"between {window.start:%Y-%m-%d %H:%M} and {window.end:%Y-%m-%d %H:%M} UTC"
    listed = ", ".join(offered) if offered else "none of the EFA GPU types either"
    raise CapacityBlockError(
        f"cluster.gpu_node_type = {c.gpu_node_type!r}: EC2 offers no Capacity Block of {what} in {c.region} {span}; "
        f"types with offerings for that count and window: {listed}",
        hint="Set GPU_NODE_TYPE to one of those, or widen the window (--block-days) or change --block-hours.",
    )


def buy_block(
    cfg: Config,
    blocks: CapacityBlocks,
    offering_id: str,
    offerings: Sequence[BlockOffering],
    confirm: Callable[[str], bool],
) -> Block | None:
    """Buy ``offering_id``, one of ``offerings`` (those just listed for the config), once ``confirm`` agrees to its
    fee; None when it does not (nothing bought). The block keeps the offering's fee."""
    chosen = next((o for o in offerings if o.id == offering_id), None)
    if chosen is None:
        ids = ", ".join(o.id for o in offerings[:5])
        raise CapacityBlockError(
            f"--buy-block {offering_id!r} is not among the offerings for {cfg.cluster.gpu_node_count} x "
            f"{cfg.cluster.gpu_node_type} in this window ({ids}{', ...' if len(offerings) > 5 else ''})",
            hint="Give an id from the list `raytrain-eks capacity --blocks` prints, with the same window options.",
        )
    question = (
        f"Buy Capacity Block {chosen.id}: {chosen.count} x {chosen.instance_type} in {chosen.zone}, "
        f"{chosen.start:%Y-%m-%d %H:%M} to {chosen.end:%Y-%m-%d %H:%M} UTC, for {chosen.upfront_usd:,.2f} "
        f"{chosen.currency} charged now (not refundable)?"
    )
    if not confirm(question):
        return None
    made = blocks.purchase(region=cfg.cluster.region, offering_id=chosen.id)
    return Block(
        made.id, made.instance_type, made.zone, made.count, made.start, made.end, made.state, chosen.upfront_usd
    )


def configured_block(cfg: Config, blocks: CapacityBlocks, known: dict[str, Any] | None) -> Block:
    """The block ``cluster.capacity_block_id`` names, as EC2 lists it now (its fee from ``known``, the state's
    record, when that is the same block); :class:`CapacityBlockError` when it is not one, or cannot hold the GPU
    nodes (type, count, zone, ended)."""
    c = cfg.cluster
    bid = c.capacity_block_id or ""
    block = blocks.describe(region=c.region, block_id=bid)
    field_ = f"cluster.capacity_block_id = {bid!r}"
    if block is None:
        raise CapacityBlockError(
            f"{field_}: EC2 lists no Capacity Block of this id in {c.region}",
            hint=f"`aws ec2 describe-capacity-reservations --region {c.region} --filters "
            "Name=reservation-type,Values=capacity-block` lists yours.",
        )
    problems = []
    if block.instance_type != c.gpu_node_type:
        problems.append(f"it holds {block.instance_type}, the GPU node type is {c.gpu_node_type}")
    if block.count < c.gpu_node_count:
        problems.append(f"it holds {block.count} instances, the GPU node group needs {c.gpu_node_count}")
    if c.gpu_az and block.zone != c.gpu_az:
        problems.append(f"it is in {block.zone}, cluster.gpu_az is {c.gpu_az}; leave gpu_az empty or make them agree")
    if block.state in ("expired", "cancelled", "failed", "payment-failed"):
        problems.append(f"it is {block.state} (it ended {block.end:%Y-%m-%d %H:%M} UTC)")
    if problems:
        raise CapacityBlockError(f"{field_}: {'; '.join(problems)}")
    fee = known.get("upfront_usd") if known and known.get("id") == block.id else None
    return Block(block.id, block.instance_type, block.zone, block.count, block.start, block.end, block.state, fee)


def spot_prices(cfg: Config, prices: SpotPrices, *, days: int, now: datetime | None = None) -> list[SpotRange]:
    """The spot price range of each type the spot node group may use (the GPU type and its same-shape ones) over
    the last ``days`` days; a type with no price in that window is left out."""
    since = (now or datetime.now(UTC)) - timedelta(days=days)
    types = same_shape(cfg.cluster.gpu_node_type)
    seen: dict[str, dict[str, list[float]]] = {}
    for itype, zone, usd in prices.history(region=cfg.cluster.region, instance_types=types, since=since):
        seen.setdefault(itype, {}).setdefault(zone, []).append(usd)
    out = []
    for itype in types:
        zones = {z: (min(v), max(v)) for z, v in sorted(seen.get(itype, {}).items())}
        if zones:
            lows, highs = zip(*zones.values(), strict=True)
            out.append(SpotRange(itype, min(lows), max(highs), zones))
    return out


def spot_record(cfg: Config, ranges: Sequence[SpotRange], days: int, now: datetime | None = None) -> dict[str, object]:
    """What the state keeps of a spot price read (under :data:`SPOT_KEY`) for ``plan``."""
    return {
        "region": cfg.cluster.region,
        "days": days,
        "read_at": (now or datetime.now(UTC)).replace(microsecond=0).isoformat(),
        "types": {r.instance_type: {"low": r.low, "high": r.high} for r in ranges},
    }


def offering_lines(offers: Sequence[BlockOffering]) -> list[str]:
    """The offerings as a table, cheapest first."""
    rows = [["offering id", "zone", "nodes", "start (UTC)", "end (UTC)", "hours", "upfront fee"]]
    for o in offers:
        start, end = f"{o.start:%Y-%m-%d %H:%M}", f"{o.end:%Y-%m-%d %H:%M}"
        fee = f"{o.upfront_usd:,.2f} {o.currency}"
        rows.append([o.id, o.zone, f"{o.count} x {o.instance_type}", start, end, str(o.hours), fee])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def spot_lines(cfg: Config, ranges: Sequence[SpotRange], days: int) -> list[str]:
    """Each type's spot price range, and per zone, over the window."""
    if not ranges:
        return [f"spot: EC2 lists no spot price of {', '.join(same_shape(cfg.cluster.gpu_node_type))} in the last "
                f"{days} days in {cfg.cluster.region}"]  # fmt: skip
    lines = []
    for r in ranges:
        zones = ", ".join(f"{z} ${lo:.4f}-{hi:.4f}" for z, (lo, hi) in r.zones.items())
        lines.append(f"spot {r.instance_type}: ${r.low:.4f}-{r.high:.4f} per hour over {days} days ({zones})")
    return lines
