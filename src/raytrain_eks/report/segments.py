"""A run's segments: each attempt of one run folder (the first start and every ``--resume``), which steps it trained,
on how many workers and nodes, from what capacity, why it ended (finished, preempted by a spot notice or a Capacity
Block's end, failed) and what it cost.

Every attempt appends one line to the run folder's ``segments.jsonl`` as it ends, so a run that was preempted twice
and finished on a third set of nodes reads as three segments, in ``train``'s last lines, ``status``, ``results`` and
the report. Example::

    append_segment(run_dir, segment_of(summary, started=started, capacity="spot", hosts=["10.0.1.5"]))
    print("\\n".join(segment_lines(read_segments(run_dir / SEGMENTS))))
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

SEGMENTS = "segments.jsonl"
FINISHED, PREEMPTED, FAILED = "finished", "preempted", "failed"
LOCAL = "local"  # the capacity of a run on this machine: no cloud node was paid for

# What each kind of notice ended a segment as: a Capacity Block's drain time is the block ending, not a reclaim.
_NOTICE_ENDINGS = {
    "interruption": "spot reclaim",
    "rebalance": "spot rebalance",
    "sigterm": "node drained",
    "deadline": "capacity block ending",
    "remote": "another node's notice",
}


@dataclass(frozen=True)
class Segment:
    """One attempt of a run. ``first_step`` is the step it resumed from (0 on the first start); ``last_step`` the
    last step it trained (its checkpoint, when preempted). ``cost_usd`` is ``None`` where the run is not priced."""

    started: str
    ended_at: str
    first_step: int
    last_step: int
    world_size: int
    nodes: int
    capacity: str
    ended: str
    reason: str = ""
    hosts: list[str] = field(default_factory=list)
    cost_usd: float | None = None
    wall_s: float | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def now_text() -> str:
    """The time now, as segments record it (UTC, to the second)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _number(value: object, default: int = 0) -> int:
    return int(value) if isinstance(value, int | float) else default


def _cost(summary: Mapping[str, object]) -> float | None:
    cost = summary.get("cost")
    usd = cost.get("usd") if isinstance(cost, Mapping) else None
    return float(usd) if isinstance(usd, int | float) else None


def _ending(summary: Mapping[str, object]) -> tuple[str, str]:
    """(ended, reason) from a finished attempt's summary: a notice's kind says whether a spot reclaim, a drain or the
    block's end stopped it."""
    if summary.get("ended") != PREEMPTED:
        return FINISHED, ""
    preempted = summary.get("preempted")
    details = preempted if isinstance(preempted, Mapping) else {}
    notice = details.get("notice")
    kind = notice.get("kind") if isinstance(notice, Mapping) else None
    what = _NOTICE_ENDINGS.get(str(kind), "notice")
    return PREEMPTED, f"{what}: {details.get('reason', 'a notice')}"


def segment_of(
    summary: Mapping[str, object] | None,
    *,
    started: str,
    capacity: str,
    hosts: Sequence[str] = (),
    world_size: int,
    resumed_from: int | None = None,
    failure: str | None = None,
    last_step: int | None = None,
    cost_usd: float | None = None,
    wall_s: float | None = None,
) -> Segment:
    """The segment an attempt made: from its ``summary.json`` when it sent one (finished or preempted), else from
    what is known of a failure (``failure``, the message; ``last_step``, the last logged step)."""
    if summary is not None and failure is None:
        ended, reason = _ending(summary)
        return Segment(
            started=started,
            ended_at=now_text(),
            first_step=_number(summary.get("resumed_from_step")),
            last_step=_number(summary.get("steps")),
            world_size=_number(summary.get("world_size"), world_size),
            nodes=_number(summary.get("nodes"), max(len(hosts), 1)),
            capacity=capacity,
            ended=ended,
            reason=reason,
            hosts=list(hosts),
            cost_usd=_cost(summary),
            wall_s=float(w) if isinstance(w := summary.get("wall_s"), int | float) else wall_s,
        )
    first = resumed_from or 0
    return Segment(
        started=started,
        ended_at=now_text(),
        first_step=first,
        last_step=max(first, last_step or 0),
        world_size=world_size,
        nodes=max(len(hosts), 1),
        capacity=capacity,
        ended=FAILED,
        reason=(failure or "failed").splitlines()[0][:300],
        hosts=list(hosts),
        cost_usd=cost_usd,
        wall_s=wall_s,
    )


def append_segment(run_dir: Path, segment: Segment) -> None:
    """Add ``segment`` to the run folder's :data:`SEGMENTS` (earlier attempts' lines are kept)."""
    with (run_dir / SEGMENTS).open("a") as f:
        f.write(json.dumps(segment.to_json()) + "\n")


def parse_segments(text: str) -> list[Segment]:
    """The segments of a :data:`SEGMENTS` file's text; a line that is not one (a file cut short while it was written)
    is left out."""
    names = set(Segment.__dataclass_fields__)
    found = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
            found.append(Segment(**{k: v for k, v in row.items() if k in names}))
        except (ValueError, TypeError):
            continue
    return found


def read_segments(path: Path) -> list[Segment]:
    """The segments recorded in ``path`` (none when it does not exist)."""
    return parse_segments(path.read_text()) if path.is_file() else []


def _when(text: str) -> str:
    return text.replace("T", " ").removesuffix("Z")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def segment_lines(segments: Sequence[Segment]) -> list[str]:
    """One line per segment and, for more than one, the total cost: ``segment 2: steps 120-300, 1 worker on 1 node
    (on-demand: 10.0.1.7), 2026-12-07 10:00:03 to 10:41:55 UTC, finished, $3.21``."""
    lines = []
    for n, s in enumerate(segments, 1):
        where = f"{s.capacity}: {', '.join(s.hosts)}" if s.hosts else s.capacity
        workers = f"{_count(s.world_size, 'worker')} on {_count(s.nodes, 'node')}"
        ended = f"{s.ended} ({s.reason})" if s.reason else s.ended
        cost = f", ${s.cost_usd:.2f}" if s.cost_usd is not None else ""
        span = f"{_when(s.started)} to {_when(s.ended_at).split(' ')[-1]} UTC"
        lines.append(f"segment {n}: steps {s.first_step}-{s.last_step}, {workers} ({where}), {span}, {ended}{cost}")
    priced = [s.cost_usd for s in segments if s.cost_usd is not None]
    if len(segments) > 1 and priced:
        unpriced = len(segments) - len(priced)
        rest = f" ({unpriced} segment{'s' if unpriced != 1 else ''} not priced)" if unpriced else ""
        lines.append(f"segments: {len(segments)}, ${sum(priced):.2f} in all{rest}")
    return lines


def capacity_of(record: Mapping[str, object] | None, *, joined: bool) -> str:
    """What a segment ran on: :data:`LOCAL` for a run on this machine; on a cluster, the GPU nodes' source as the
    deployment record ``submit`` put beside the job's configuration says (``spot``, ``capacity-block``...), else
    that it is not recorded (a cluster this tool did not deploy)."""
    if not joined:
        return LOCAL
    source = record.get("gpu_capacity") if record is not None else None
    return str(source) if source else "cluster (capacity not recorded)"


@dataclass
class SegmentStart:
    """What is known of an attempt when it starts: when, on what capacity, the hosts it may use (filled in once a
    cluster is joined) and the step it resumes from. :meth:`ended` and :meth:`failed` make its :class:`Segment`."""

    capacity: str
    world_size: int
    started: str = field(default_factory=now_text)
    hosts: list[str] = field(default_factory=list)
    resumed_from: int | None = None
    t0: float = field(default_factory=time.perf_counter)

    def ended(self, summary: Mapping[str, object]) -> Segment:
        return segment_of(
            summary, started=self.started, capacity=self.capacity, hosts=self.hosts, world_size=self.world_size
        )

    def failed(self, message: str, run_dir: Path, cost_usd: float | None = None) -> Segment:
        """The segment of an attempt that failed with ``message``, its last step the newest in ``metrics.jsonl``."""
        return segment_of(
            None,
            started=self.started,
            capacity=self.capacity,
            hosts=self.hosts,
            world_size=self.world_size,
            resumed_from=self.resumed_from,
            failure=message,
            last_step=last_logged_step(run_dir),
            cost_usd=cost_usd,
            wall_s=time.perf_counter() - self.t0,
        )


def last_logged_step(run_dir: Path) -> int | None:
    """The newest step ``metrics.jsonl`` records (any attempt's), or ``None``."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            last = step if last is None else max(last, step)
    return last


def failed_cost(
    price: Callable[[dict[str, object]], Mapping[str, object] | None] | None, attempt: SegmentStart
) -> float | None:
    """What a failed attempt cost at the run's price: its wall time, nothing trained."""
    if price is None:
        return None
    wall_s = time.perf_counter() - attempt.t0
    cost = price({"wall_s": wall_s, "trained_tokens": 0, "nodes": max(len(attempt.hosts), 1)})
    usd = cost.get("usd") if cost is not None else None
    return float(usd) if isinstance(usd, int | float) else None
