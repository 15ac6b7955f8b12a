"""Stragglers: a rank that does its own share of each step slower than the others, named as the run goes.

In data-parallel training every rank waits for the slowest inside the step's collectives, so every rank's wall time
per step is the same: it cannot tell which rank is slow. What each rank does alone can: the optimizer's step (AdamW
on the rank's own shards, no collective inside). :class:`StepClock` times it on every rank through the optimizer's
step hooks (``perf_counter`` on a CPU; on a GPU, CUDA events read once they are done, so nothing waits), and the
rank's beat carries it to the watchdog's board (:mod:`.watchdog`). :func:`find_stragglers` compares, step by step,
each rank's time with the median of all ranks: a rank slower than ``training.straggler_margin`` times the median
(and by at least :data:`MIN_GAP_S`, under which timer noise decides) for ``training.straggler_steps`` steps in a
row is a straggler; it is named once per such stretch (host, rank, GPU), in a line, in ``metrics.jsonl`` (the next
logged step's ``stragglers``) and in ``summary.json``. Each step's times go to ``RUN_DIR/rank_steps.jsonl`` (drawn
in the report). A slowdown of the forward and backward passes alone, inside their collectives, is not seen.

Example::

    found = find_stragglers(board_snapshot, margin=1.3, steps=5, named=set())
    found[0].line()   # "straggler: rank 1 on host 10.0.0.12 ..."
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    import torch

MIN_GAP_S = 0.002
RANK_STEPS = "rank_steps.jsonl"  # in the run folder: {"step": S, "own_s": [rank 0's, rank 1's, ...]} per step


class RankIdentity(TypedDict):
    """Who a rank is, as its beat tells the watchdog's board: its Ray node, host address and name, process, GPU."""

    node_id: str
    host: str
    hostname: str
    pid: int
    gpu: str | None


class RankOnBoard(RankIdentity):
    """A rank as the watchdog's board holds it: who it is, and its recent beats, oldest first."""

    rank: int
    # [step, wall time, own seconds]: the own seconds (None before the first is timed) may be left out altogether.
    beats: list[list[Any]]


class StepClock:
    """This rank's optimizer step times, from the optimizer's own hooks: :meth:`take` returns the newest finished
    one (seconds), or ``None``."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device | None) -> None:
        self._cuda = getattr(device, "type", "cpu") == "cuda"
        self._started = 0.0
        self._last: float | None = None
        self._events: deque[tuple[torch.cuda.Event, torch.cuda.Event | None]] = deque(
            maxlen=8
        )  # CUDA: (start, end) pairs not read yet
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def _before(self, *_: object) -> None:
        if self._cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))
        else:
            self._started = time.perf_counter()

    def _after(self, *_: object) -> None:
        if self._cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
        else:
            self._last = time.perf_counter() - self._started

    def take(self) -> float | None:
        while self._events and (done := self._events[0][1]) is not None and done.query():
            start = self._events.popleft()[0]
            self._last = start.elapsed_time(done) / 1000.0
        return self._last


@dataclass(frozen=True)
class Straggler:
    """A rank slower than the median of ranks for ``steps`` steps in a row, up to ``last_step``."""

    rank: int
    host: str | None
    hostname: str | None
    gpu: str | None
    first_step: int
    last_step: int
    ratio: float  # its time over the median of ranks, the median over those steps
    own_s: float  # its median time over those steps
    median_s: float  # the median of ranks' times, the median over those steps

    def line(self) -> str:
        where = f"{self.host} ({self.hostname})" if self.host and self.hostname else self.host or "?"
        gpu = f", GPU {self.gpu}" if self.gpu else ""
        return (
            f"straggler: rank {self.rank} on host {where}{gpu} took {self.ratio:.1f}x the median of ranks for its "
            f"own work in steps {self.first_step}-{self.last_step} (optimizer step {self.own_s * 1e3:.1f} ms against "
            f"{self.median_s * 1e3:.1f} ms)"
        )

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def own_times(ranks: dict[int, RankOnBoard]) -> dict[int, dict[int, float]]:
    """Each rank's own time per step, from its beats (``[step, time, own seconds]``); a restart's repeated steps keep
    the later time."""
    return {
        rank: {int(b[0]): float(b[2]) for b in info["beats"] if len(b) > 2 and b[2] is not None}
        for rank, info in ranks.items()
    }


def common_steps(times: dict[int, dict[int, float]]) -> list[int]:
    """The steps every rank has a time for, in order."""
    if len(times) < 2:
        return []
    return sorted(set.intersection(*(set(t) for t in times.values())))


def find_stragglers(ranks: dict[int, RankOnBoard], *, margin: float, steps: int, named: set[int]) -> list[Straggler]:
    """The ranks slower than ``margin`` x the median of ranks (and by :data:`MIN_GAP_S`) in each of the last
    ``steps`` steps they all have times for, consecutive ones, that ``named`` does not hold yet. ``named`` is
    updated: a rank found is added, a rank no longer slow in the newest step is taken out (a later stretch is named
    again)."""
    times = own_times(ranks)
    common = common_steps(times)
    if not common:
        return []
    recent = common[-steps:]
    consecutive = len(recent) == steps and recent[-1] - recent[0] == steps - 1
    found = []
    for rank in sorted(times):
        slow = [_slow(times, rank, s, margin) for s in recent]
        if not slow[-1]:
            named.discard(rank)
        if not consecutive or not all(slow) or rank in named:
            continue
        medians = [statistics.median(t[s] for t in times.values()) for s in recent]
        own = statistics.median(times[rank][s] for s in recent)
        mid = statistics.median(medians)
        info = ranks[rank]
        found.append(
            Straggler(
                rank=rank,
                host=info.get("host"),
                hostname=info.get("hostname"),
                gpu=info.get("gpu"),
                first_step=recent[0],
                last_step=recent[-1],
                ratio=own / mid if mid > 0 else float("inf"),
                own_s=own,
                median_s=mid,
            )
        )
        named.add(rank)
    return found


def _slow(times: dict[int, dict[int, float]], rank: int, step: int, margin: float) -> bool:
    median = statistics.median(t[step] for t in times.values())
    own = times[rank][step]
    return own > margin * median and own - median >= MIN_GAP_S


def append_rank_steps(path: Path, ranks: dict[int, RankOnBoard], after: int) -> int:
    """Append to ``path`` (:data:`RANK_STEPS`) every step past ``after`` that every rank has a time for; return the
    newest step written (``after`` when none)."""
    times = own_times(ranks)
    new = [s for s in common_steps(times) if s > after]
    if not new:
        return after
    with path.open("a") as f:
        for s in new:
            f.write(json.dumps({"step": s, "own_s": [times[r][s] for r in sorted(times)]}) + "\n")
    return new[-1]
