"""Stated, stateful fakes of the three AWS interfaces moto 5.2 does not implement (see raytrain_eks.aws.services),
and CloudFormation's termination protection, which moto's server does not keep.

- :class:`FakeQuotas`: moto's Service Quotas knows only the ``vpc`` service, so EC2's vCPU quotas
  (``L-DB2E81BA``, ``L-417A185B``, ``L-1216C47A``) are values the test states.
- :class:`FakeSpotScores`: moto has no ``GetSpotPlacementScores``; scores by (region, zone id) as stated.
- :class:`FakeReservations`: moto has no ``CreateCapacityReservation``/``CancelCapacityReservation``/
  ``DescribeCapacityReservations``; this keeps every reservation with its state and tags, holds free capacity per
  zone, can fail the ways AWS does (no capacity, a create whose answer is lost after the reservation was made,
  cancels that fail), and lists the account's own reservations as the test states them.
- :class:`FakeCapacityBlocks`: moto 5.2 has no ``DescribeCapacityBlockOfferings`` nor ``PurchaseCapacityBlock``;
  offerings are stated in the EC2 API's response shape and parsed by the product's own reader, purchases are kept
  and answered as ``DescribeCapacityReservations`` answers for a block.
- :func:`keep_termination_protection`: moto records a stack's ``EnableTerminationProtection`` and reports it, but
  deletes a protected stack all the same and has no ``UpdateTerminationProtection``; after this call its server
  refuses the delete as CloudFormation does, and turns the protection on and off.

Everything else ``capacity`` reads comes from moto's server. Example::

    services = Services(FakeQuotas({("us-east-1", "L-DB2E81BA"): 96}), FakeSpotScores({}), FakeReservations())
    keep_termination_protection()  # before a test deletes stacks through moto's server
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from raytrain_eks.aws.market import Block, BlockOffering, Window
from raytrain_eks.aws.services import ExistingReservation, NoCapacity, QuotaLimit, Reservation, SpotSignal


class FakeQuotas:
    """vCPU limits by (region, quota code); a pair not given is unknown, like a lookup AWS refused."""

    def __init__(self, limits: Mapping[tuple[str, str], float]) -> None:
        self.limits = dict(limits)

    def vcpu_limit(self, region: str, quota_code: str) -> QuotaLimit:
        value = self.limits.get((region, quota_code))
        return QuotaLimit(value, "applied" if value is not None else "not stated in the fake")


class FakeSpotScores:
    """Scores by (region, zone id); a region listed in ``unavailable`` answers with that note instead."""

    def __init__(self, scores: Mapping[tuple[str, str], int], unavailable: Mapping[str, str] | None = None) -> None:
        self.scores_by_zone = dict(scores)
        self.unavailable = dict(unavailable or {})

    def scores(self, region: str, instance_type: str, count: int) -> SpotSignal:
        if region in self.unavailable:
            return SpotSignal(None, self.unavailable[region])
        return SpotSignal({z: s for (r, z), s in self.scores_by_zone.items() if r == region})


@dataclass
class FakeReservation:
    id: str
    region: str
    zone: str
    instance_type: str
    count: int
    token: str
    state: str = "active"


@dataclass
class FakeReservations:
    """On-demand capacity reservations in memory.

    ``free``: instances EC2 can reserve by (region, zone); a zone not listed has plenty.
    ``lose_create_answer``: the next create makes the reservation, then raises as if its answer never came back.
    ``failing_cancels``: that many cancel calls raise ``cancel_error`` before one succeeds.
    ``on_create``: called with each new reservation before create returns (a test raises from it, e.g.
    KeyboardInterrupt, to stop the caller after the reservation exists).
    ``existing``: the account's own active reservations, by region (what :meth:`active` lists).
    """

    free: dict[tuple[str, str], int] = field(default_factory=dict)
    lose_create_answer: bool = False
    failing_cancels: int = 0
    cancel_error: type[BaseException] = ConnectionError
    on_create: Callable[[FakeReservation], None] | None = None
    reservations: dict[str, FakeReservation] = field(default_factory=dict)
    existing: dict[str, list[ExistingReservation]] = field(default_factory=dict)
    active_error: Exception | None = None  # raised by :meth:`active` (e.g. a permission AWS refused)
    calls: list[str] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def create(self, *, region: str, instance_type: str, zone: str, count: int, token: str) -> Reservation:
        self.calls.append(f"create {zone}")
        same = [r for r in self.reservations.values() if r.token == token]
        if same:  # the ClientToken makes a retried create return the first reservation
            return Reservation(same[0].id, same[0].state)
        if self.free.get((region, zone), 1_000) < count:
            raise NoCapacity(
                "InsufficientInstanceCapacity", f"There is not enough capacity for {instance_type} in {zone}."
            )
        res = FakeReservation(f"cr-{next(self._ids):017x}", region, zone, instance_type, count, token)
        self.reservations[res.id] = res
        if self.on_create is not None:
            self.on_create(res)
        if self.lose_create_answer:
            self.lose_create_answer = False
            raise ConnectionError("Read timed out (the reservation was made; its answer was lost)")
        return Reservation(res.id, res.state)

    def cancel(self, *, region: str, reservation_id: str) -> None:
        self.calls.append(f"cancel {reservation_id}")
        if self.failing_cancels:
            self.failing_cancels -= 1
            raise self.cancel_error("cancel failed: connection reset")
        res = self.reservations.get(reservation_id)
        if res is not None and res.region == region:
            res.state = "cancelled"

    def open_ids(self, *, region: str, token: str) -> list[str]:
        self.calls.append("list")
        return [
            r.id
            for r in self.reservations.values()
            if r.region == region and r.token == token and r.state in ("active", "pending")
        ]

    def active(self, *, region: str) -> list[ExistingReservation]:
        if self.active_error is not None:
            raise self.active_error
        return list(self.existing.get(region, []))

    @property
    def created(self) -> list[FakeReservation]:
        return list(self.reservations.values())

    @property
    def open(self) -> list[FakeReservation]:
        return [r for r in self.reservations.values() if r.state in ("active", "pending")]


@dataclass
class FakeCapacityBlocks:
    """Capacity Blocks for ML in memory, answering as the EC2 API Reference documents:

    - DescribeCapacityBlockOfferings (API_DescribeCapacityBlockOfferings.html): InstanceType, InstanceCount and
      CapacityDurationHours are required; StartDateRange is "the earliest start date" and EndDateRange "the latest
      end date" of an offering. ``offered`` holds items of its ``CapacityBlockOffering`` shape
      (CapacityBlockOfferingId, InstanceType, AvailabilityZone, InstanceCount, StartDate, EndDate,
      CapacityBlockDurationHours, UpfrontFee as a string, CurrencyCode); an offering is listed when all four match.
      A type with none gives an empty list, as the API's for a type it offers no block of.
    - PurchaseCapacityBlock (API_PurchaseCapacityBlock.html): CapacityBlockOfferingId and InstancePlatform in, the
      CapacityReservation out; the block is then listed by DescribeCapacityReservations with ReservationType
      ``capacity-block`` and its StartDate and EndDate.
    ``asked``: the instance types offerings were asked for, in order.
    """

    offered: list[dict[str, Any]] = field(default_factory=list)
    bought: dict[str, Block] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def offerings(self, *, region: str, instance_type: str, count: int, window: Window) -> list[BlockOffering]:
        self.asked.append(instance_type)
        return [
            BlockOffering.from_api(o)
            for o in self.offered
            if o["InstanceType"] == instance_type
            and o["InstanceCount"] == count
            and o["CapacityBlockDurationHours"] == window.hours
            and o["StartDate"] >= window.start
            and o["EndDate"] <= window.end
        ]

    def purchase(self, *, region: str, offering_id: str) -> Block:
        o = next(o for o in self.offered if o["CapacityBlockOfferingId"] == offering_id)
        block_id = f"cr-{next(self._ids):017x}"
        block = Block(
            block_id, o["InstanceType"], o["AvailabilityZone"], o["InstanceCount"], o["StartDate"], o["EndDate"],
            "scheduled",
        )  # fmt: skip
        self.bought[block_id] = block
        return block

    def describe(self, *, region: str, block_id: str) -> Block | None:
        return self.bought.get(block_id)


# CloudFormation's answer to DeleteStack for a stack whose termination protection is on: error code ValidationError
# and this message, NAME the stack's name (the text SDK callers match, "ValidationError: Stack [NAME] cannot be deleted
# while TerminationProtection is enabled"). The CloudFormation User Guide, "Protect CloudFormation stacks from being
# deleted" (using-cfn-protect-stacks.html): "If a user attempts to delete a stack with termination protection
# enabled, the deletion fails and the stack, including its status, remains unchanged."
PROTECTED_STACK_REFUSAL = "Stack [{name}] cannot be deleted while TerminationProtection is enabled"


def keep_termination_protection() -> None:
    """Make moto's CloudFormation (its server included: it runs in this process) keep termination protection.

    ``DeleteStack`` of a live stack whose ``EnableTerminationProtection`` is on fails with ValidationError
    :data:`PROTECTED_STACK_REFUSAL` and leaves the stack as it was; ``UpdateTerminationProtection`` (CloudFormation
    API Reference: StackName and EnableTerminationProtection in, StackId out) sets the flag moto already stores from
    ``CreateStack`` and reports in ``DescribeStacks``. It lasts for the rest of the process and a second call changes
    nothing: it only makes moto refuse what CloudFormation refuses, so nothing that works against CloudFormation
    works differently."""
    from moto.cloudformation.exceptions import ValidationError
    from moto.cloudformation.responses import CloudFormationResponse
    from moto.core.responses import ActionResult

    if getattr(CloudFormationResponse, "keeps_termination_protection", False):
        return
    moto_delete = CloudFormationResponse.delete_stack

    def live_stack(response: CloudFormationResponse, name_or_id: str) -> Any:
        backend = response.cloudformation_backend
        by_id = backend.stacks.get(name_or_id)
        return by_id or next((s for s in backend.stacks.values() if s.name == name_or_id), None)

    def delete_stack(self: CloudFormationResponse) -> Any:
        stack = live_stack(self, self._get_param("StackName"))
        if stack is not None and stack.enable_termination_protection:
            raise ValidationError(message=PROTECTED_STACK_REFUSAL.format(name=stack.name))
        return moto_delete(self)

    def update_termination_protection(self: CloudFormationResponse) -> ActionResult:
        name_or_id = self._get_param("StackName")
        stack = live_stack(self, name_or_id)
        if stack is None:  # CloudFormation's answer for a stack it does not have, as moto gives it elsewhere
            raise ValidationError(name_or_id)
        stack.enable_termination_protection = bool(self._get_bool_param("EnableTerminationProtection"))
        return ActionResult({"StackId": stack.stack_id})

    CloudFormationResponse.delete_stack = delete_stack  # type: ignore[method-assign]
    CloudFormationResponse.update_termination_protection = update_termination_protection  # type: ignore[attr-defined]
    CloudFormationResponse.keeps_termination_protection = True  # type: ignore[attr-defined]
