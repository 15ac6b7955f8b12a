"""What the driver hands each training worker, and what the workers send back: one dataclass per kind.

The driver starts every worker with a :class:`WorkerJob`; rank 0 sends :data:`Record` values on the run's queue:
a :class:`Note` (a line for the user), a :class:`StepRecord` (one logged step: a line of ``metrics.jsonl``), a
:class:`FabricLook` (the transport gate's verdict and the NCCL lines behind it), :class:`Samples` (greedy answers at
the end) and :class:`Finished` (the run's summary); a failing worker sends a :class:`WorkerFailure` (its traceback).
The driver tells them apart by type (``match``), never by which keys a dictionary happens to hold.

Example::

    ctx.emit(Note("precision: bf16 (auto: the GPU has bf16)"))
    match record:
        case StepRecord(): metrics_file.write(json.dumps(record.to_json()) + "\\n")
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The held-out set's fields of a step record, present only on the steps that evaluated it.
EVAL_FIELDS = ("eval_loss", "eval_ppl", "eval_tokens")


@dataclass(frozen=True)
class WorkerJob:
    """Everything a training worker needs, as the driver hands it over (Ray Train's ``train_loop_config``)."""

    training: dict[str, Any]  # TrainingConfig as JSON
    model_path: str
    checkpoint_root: str
    metrics_queue: Any | None = None
    resume_from: str | None = None
    fabric_require: str = "any"
    fabric_require_full_efa: bool = False
    fabric_instance_type: str | None = None  # the GPU nodes' configured type, to compare EFA's use with
    datasets: dict[str, Any] = field(default_factory=dict)
    sample_prompts: list[str] | None = None


@dataclass(frozen=True)
class Note:
    """A line for the user (the precision chosen, how the model was started, ...)."""

    text: str


@dataclass(frozen=True)
class StepRecord:
    """One logged step, as ``metrics.jsonl`` holds it (held-out fields only on the steps that evaluated)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    tokens_per_s: float
    step_time_s: float
    mfu: float | None
    resumed_from_step: int | None
    eval_loss: float | None = None
    eval_ppl: float | None = None
    eval_tokens: int | None = None
    dpo: dict[str, float] | None = None  # method dpo: TRL's metrics by name (train/dpo.py's METRICS)

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        for name in (*EVAL_FIELDS, "dpo"):
            if record[name] is None:
                del record[name]
        return record


def dpo_line(record: dict[str, Any]) -> str:
    """What a run's line shows of a DPO step's record: its reward margin and accuracy (``margin 0.12 acc 0.75``);
    ``""`` for a record without DPO's metrics."""
    dpo = record.get("dpo")
    if not dpo:
        return ""
    return f"margin {dpo['rewards/margins']:.2f} acc {dpo['rewards/accuracies']:.2f}"


@dataclass(frozen=True)
class FabricLook:
    """The transport gate's look at NCCL's choice (its verdict as the gate reports it) and every rank's lines."""

    fabric: dict[str, Any]
    nccl_lines: list[list[str]]


@dataclass(frozen=True)
class Samples:
    """The greedy answers to the sample prompts at the end of the run."""

    samples: list[dict[str, Any]]


@dataclass(frozen=True)
class Finished:
    """The run's summary, as ``summary.json`` holds it (the driver adds its own fields)."""

    summary: dict[str, Any]


@dataclass(frozen=True)
class WorkerFailure:
    """A worker's full traceback, sent before its error ends the run."""

    rank: int
    traceback: str


Record = Note | StepRecord | FabricLook | Samples | Finished | WorkerFailure
