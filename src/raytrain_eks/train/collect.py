"""The driver's side of a run's messages: what the workers send through the metric records' queue, heard until
training ends, and where each goes (``metrics.jsonl``, the tracker, the bundle, the display, the run folder).

Example::

    heard = collect(queue, run_dir, steps, say=print, tracker=tracker, bundle=None, progress=None, prompts=[])
    heard.records[-1]["loss"], heard.summary
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from raytrain_eks.train.records import FabricLook, Finished, Note, Samples, StepRecord, WorkerFailure
from raytrain_eks.train.stragglers import Straggler
from raytrain_eks.train.watchdog import Finding

if TYPE_CHECKING:
    from ray.util.queue import Queue

    from raytrain_eks.report.tracking import Tracker
    from raytrain_eks.train.bundle import RunBundle

DONE = {"done": True}  # put into the queue once the trainer has returned: the last message


class Progress(Protocol):
    """What shows the run's progress: called with every metric record as it arrives and the run's total steps (it may
    also have a ``stage(text)`` method, told what data preparation is doing)."""

    def __call__(self, record: dict[str, object], total: int, /) -> None: ...


@dataclass
class Collected:
    """What the driver heard from the workers: the summary rank 0 sent, the logged steps, the stragglers named, the
    workers' tracebacks, and the watchdog's finding when the ranks stopped advancing."""

    summary: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, object]] = field(default_factory=list)
    stragglers: list[dict[str, object]] = field(default_factory=list)
    tracebacks: list[str] = field(default_factory=list)
    hung: Finding | None = None


def collect(
    queue: Queue,
    run_dir: Path,
    steps: int,
    *,
    say: Callable[[str], None],
    tracker: Tracker,
    bundle: RunBundle | None,
    progress: Progress | None,
    prompts: list[str],
) -> Collected:
    """The workers' messages until training ends (or the watchdog finds the ranks hung): each logged step appended
    to ``metrics.jsonl`` (never truncated: a resumed run keeps every attempt's steps), tracked, bundled and shown;
    notes, stragglers and the fabric's report said; the samples written."""
    from raytrain_eks.train.prompts import write_samples

    heard = Collected()
    unlogged = 0  # the stragglers named so far that a logged step's record carries
    # Appended, never truncated: a resumed run keeps the steps of every attempt.
    with (run_dir / "metrics.jsonl").open("a") as metrics_file:
        while True:
            record = queue.get()
            if record == DONE:
                break
            match record:
                case Finished():
                    heard.summary.update(record.summary)
                case WorkerFailure():
                    heard.tracebacks.append(f"--- worker rank {record.rank} ---\n{record.traceback}")
                case Note():  # a line for the user from rank 0, such as the precision chosen
                    say(record.text)
                case Finding():  # the watchdog's: no rank advances; the stacks are in the run folder
                    heard.hung = record
                    say(record.message)
                    break
                case Straggler():
                    say(record.line())
                    heard.stragglers.append(record.to_json())
                case Samples():
                    write_samples(run_dir, prompts, record.samples)
                case FabricLook():
                    _write_nccl_lines(run_dir / "nccl", record.nccl_lines)
                    say(record.fabric["report"])
                case StepRecord():
                    line = record.to_json()
                    if len(heard.stragglers) > unlogged:
                        line["stragglers"], unlogged = heard.stragglers[unlogged:], len(heard.stragglers)
                    heard.records.append(line)
                    metrics_file.write(json.dumps(line) + "\n")
                    metrics_file.flush()
                    tracker.log(line)
                    if bundle is not None:
                        bundle.step(line)
                    if progress is not None:
                        progress(line, steps)
    return heard


def _write_nccl_lines(folder: Path, lines_by_rank: list[list[str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, lines in enumerate(lines_by_rank):
        (folder / f"rank{rank:05d}.log").write_text("".join(line + "\n" for line in lines))
