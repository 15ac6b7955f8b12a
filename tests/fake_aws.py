"""Stated, stateful fakes of the three AWS interfaces moto 5.2 does not implement (see raytrain_eks.aws.services).

- :class:`FakeQuotas`: moto's Service Quotas knows only the ``vpc`` service, so EC2's vCPU quotas
  (``L-DB2E81BA``, ``L-417A185B``, ``L-1216C47A``) are values the test states.
- :class:`FakeSpotScores`: moto has no ``GetSpotPlacementScores``; scores by (region, zone id) as stated.
- :class:`FakeReservations`: moto has no ``CreateCapacityReservation``/``CancelCapacityReservation``/
  ``DescribeCapacityReservations``; this keeps every reservation with its state and tags, holds free capacity per
  zone, can fail the ways AWS does (no capacity, a create whose answer is lost after the reservation was made,
  cancels that fail), and lists the account's own reservations as the test states them.

Everything else ``capacity`` reads comes from moto's server. Example::

    services = Services(FakeQuotas({("us-east-1", "L-DB2E81BA"): 96}), FakeSpotScores({}), FakeReservations())
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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
