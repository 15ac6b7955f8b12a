"""What a training run counts as it goes: its throughput windows, each batch's tokens and FLOPs, and the tally its
summary is made of (:func:`~raytrain_eks.train.loop.run_summary`).

Example::

    window = ThroughputWindow()
    window.add(*batch_work(batch, model.config))
    step_time, tokens_per_s, flops_per_s = window.close(*all_ranks(window, device))
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from raytrain_eks.train.data.packing import block_documents
from raytrain_eks.train.flops import documents_flops
from raytrain_eks.train.preemption import Decision


class ThroughputWindow:
    """Time, steps and tokens since the last logged step; checkpoint and evaluation time are left out of it.

    Each logged step closes a window (:meth:`close`): its time over its steps is that window's step time. The
    steady figures (:meth:`steady`) leave the first window out, which holds the first step's one-off costs.
    """

    def __init__(self) -> None:
        self.steps, self.tokens, self.flops = 0, 0, 0.0  # this rank's, since the window opened
        self.start = time.perf_counter()
        self.closed: list[tuple[float, int, float, float]] = []  # (seconds, steps, tokens, FLOPs) of every rank

    def add(self, tokens: int, flops: float) -> None:
        """One step of this rank: its tokens (padding left out) and their training FLOPs."""
        self.steps += 1
        self.tokens += tokens
        self.flops += flops

    def leave_out(self, seconds: float) -> None:
        """Time spent on something other than training (a checkpoint) while this window is open."""
        self.start += seconds

    def close(self, tokens: float, flops: float) -> tuple[float, float, float]:
        """Close the window at this logged step, given every rank's ``tokens`` and ``flops`` in it: (its step time,
        its tokens per second, its FLOPs per second)."""
        seconds = time.perf_counter() - self.start
        self.closed.append((seconds, self.steps, tokens, flops))
        return seconds / self.steps, tokens / seconds, flops / seconds

    def reopen(self) -> None:
        self.steps, self.tokens, self.flops, self.start = 0, 0, 0.0, time.perf_counter()

    def steady(self) -> tuple[float | None, float, float]:
        """The median step time, and the tokens and FLOPs per second, over the windows after the first."""
        windows = self.closed[1:] or self.closed
        seconds = sum(w[0] for w in windows)
        step_time = statistics.median(w[0] / w[1] for w in windows) if windows else None
        if seconds <= 0:
            return step_time, 0.0, 0.0
        return step_time, sum(w[2] for w in windows) / seconds, sum(w[3] for w in windows) / seconds

    @property
    def trained(self) -> float:
        """Every rank's tokens in the closed windows."""
        return sum(w[2] for w in self.closed)


def through(trained: float, *, done: int, before: int) -> int:
    """Tokens trained through the last step: ``trained`` in this attempt's ``done`` steps, and a resumed run's
    ``before`` steps counted at this attempt's tokens per step (the same data, so a close estimate; exact for
    random ids)."""
    return round(trained + before * trained / done) if done else 0


def batch_work(batch: dict[str, torch.Tensor], config: Any, *, adapters: int = 0) -> tuple[int, float]:
    """The tokens of a packed batch that hold a row (padding left out) and their training FLOPs, each row's
    attention charged over its own length (:func:`~raytrain_eks.train.flops.documents_flops`), counted on the host
    from the batch's ``filled`` and ``position_ids``. A block without positions (``packing: concat``, random ids)
    attends across all its filled positions."""
    seq_len = batch["input_ids"].shape[-1]
    rows = batch["input_ids"].shape[0]
    filled = batch.get("filled")
    positions = batch.get("position_ids")
    lengths: list[int] = []
    for r in range(rows):
        n = int(filled[r]) if filled is not None else seq_len
        if positions is not None:
            lengths += [length for _, length in block_documents(positions[r].numpy(), n)]
        else:
            lengths.append(n)
    return sum(lengths), documents_flops(config, lengths, adapters=adapters)


def all_ranks(window: ThroughputWindow, device: torch.device) -> tuple[float, float]:
    """Every rank's tokens and FLOPs in the open window (a collective, on logged steps only)."""
    totals = torch.tensor([float(window.tokens), window.flops], dtype=torch.float64)
    totals = totals.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else totals.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    tokens, flops = totals.tolist()
    return tokens, flops


@dataclass
class Tally:
    """What a run counts as it goes, for its summary: the steps this attempt trained, the logged losses (and DPO's
    last metrics), the checkpoints and the time they took, the last held-out evaluation and the time evaluation took,
    the transport gate's last answer, and the time in the loop and in the final samples."""

    done: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    checkpoints: list[int] = field(default_factory=list)
    checkpoint_s: float = 0.0
    stalls: list[float] = field(default_factory=list)  # per save: from its call until training could go on
    last_eval: dict[str, Any] = field(default_factory=dict)
    eval_s: float = 0.0
    fabric: dict[str, Any] | None = None
    train_s: float = 0.0
    samples_s: float = 0.0
    first_step_s: float | None = None  # from the start of train() to the end of this attempt's first step
    preempted: Decision | None = None  # the notice that ended the run before its last step
    last_dpo: dict[str, float] | None = None  # DPO's metrics of the last logged step (method dpo)
