"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), and export to Hugging Face format.

A checkpoint folder ``checkpoint_<step>`` holds:

- the DCP shards and ``.metadata`` of the model and optimizer state (each rank writes its own shard);
- ``trainer_rank<r>.pt`` per rank: step, LR-scheduler state, data position and RNG state;
- ``hf/``: the model's ``config.json`` and tokenizer (from rank 0), so export needs nothing else;
- ``complete.json``, written last, once every rank's files are in place. A folder without it was cut short
  (a process died while writing) and is never taken as a checkpoint to resume from.

Example::

    save_sharded(folder, model=model, optimizer=opt, scheduler=sched, state=TrainerState(step=50, data=...), rank=r)
    latest_complete(run_dir / "ray")          # Path of the newest complete checkpoint, or None
    export_hf(latest_complete(run_dir / "ray"), run_dir / "model")
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raytrain_eks.errors import UserError

MARKER = "complete.json"
HF_DIR = "hf"
_NAME = re.compile(r"^checkpoint_(\d+)$")
# Architecture fields that must agree between a checkpoint and the model it is loaded into.
_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def checkpoint_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


@dataclass
class TrainerState:
    """What besides weights and optimizer moments a resume needs to continue exactly."""

    step: int
    scheduler: dict[str, Any] = field(default_factory=dict)
    data: dict[str, int] = field(default_factory=dict)
    rng: Any = None


def save_sharded(
    folder: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int,
    data_position: dict[str, int],
    rank: int,
    tokenizer_path: str | None,
) -> None:
    """Write this rank's part of the checkpoint of ``step`` into ``folder`` (a collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(
        {"step": step, "scheduler": scheduler.state_dict(), "data": dict(data_position), "rng": rng},
        folder / f"trainer_rank{rank:05d}.pt",
    )
    if rank == 0:
        hf = folder / HF_DIR
        model.config.save_pretrained(hf)
        if tokenizer_path:
            from raytrain_eks.train.data import load_tokenizer

            load_tokenizer(tokenizer_path).save_pretrained(hf)


def mark_complete(folder: Path, *, step: int, world_size: int) -> None:
    """Write the marker that makes ``folder`` a usable checkpoint; call after every rank's files are in place."""
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, "world_size": world_size, "time": time.time()}) + "\n")
    tmp.rename(folder / MARKER)


def load_sharded(
    folder: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int
) -> TrainerState:
    """Load model, optimizer, scheduler and RNG state of this rank from ``folder``; return the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    check_compatible(folder, model.config)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    own = folder / f"trainer_rank{rank:05d}.pt"
    # A resume on another world size has no file of this rank: take rank 0's step and schedule.
    extra = torch.load(own if own.exists() else folder / "trainer_rank00000.pt", weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    if own.exists():
        torch.set_rng_state(extra["rng"]["cpu"])
        if "cuda" in extra["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["rng"]["cuda"])
    return TrainerState(step=int(extra["step"]), scheduler=extra["scheduler"], data=extra["data"])


def list_checkpoints(root: Path) -> list[tuple[int, Path, bool]]:
    """(step, folder, complete) for every ``checkpoint_*`` folder under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _NAME.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child, is_complete(child)))
    return sorted(found)


def is_complete(folder: Path) -> bool:
    return (
        (folder / MARKER).is_file() and (folder / ".metadata").is_file() and (folder / HF_DIR / "config.json").is_file()
    )


def latest_complete(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``; folders cut short by a crash are skipped."""
    complete = [folder for _, folder, ok in list_checkpoints(root) if ok]
    return complete[-1] if complete else None


def check_compatible(folder: Path, config: Any) -> None:
    """Raise :class:`UserError` when the checkpoint in ``folder`` belongs to a model of another architecture."""
    saved = json.loads((folder / HF_DIR / "config.json").read_text())
    current = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r}, model {current.get(k)!r}"
        for k in _ARCH_KEYS
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise UserError(
            f"checkpoint {folder} is of a different model ({'; '.join(diffs)})",
            hint="Resume with the model the run was started with, or start a new run without --resume.",
        )


def resolve_checkpoint(path: Path) -> Path:
    """A complete checkpoint folder from a checkpoint folder, a run folder or a Ray storage folder.

    Raises :class:`UserError` naming what is wrong: nothing there, no checkpoint yet, or only incomplete ones.
    """
    path = path.expanduser()
    if not path.exists():
        raise UserError(
            f"{path} does not exist", hint="Give a run folder (runs/...) or one of its checkpoint_* folders."
        )
    if _NAME.match(path.name):
        if not is_complete(path):
            raise UserError(
                f"{path} is not a complete checkpoint (its writing was cut short or files are missing)",
                hint="Use an older checkpoint beside it, or the run folder to pick the newest complete one.",
            )
        return path
    for root in (path / "ray", path):
        found = list_checkpoints(root)
        if found:
            latest = latest_complete(root)
            if latest is None:
                raise UserError(
                    f"{path} has {len(found)} checkpoint folder(s) but none is complete",
                    hint="The run died while writing its first checkpoint: start it again without --resume.",
                )
            return latest
    raise UserError(
        f"{path} holds no checkpoint",
        hint="The run stopped before its first checkpoint (see checkpoint_every): start it again without --resume.",
    )


def export_hf(checkpoint: Path, out_dir: Path, *, dtype: str = "float32") -> Path:
    """Gather the sharded weights of ``checkpoint`` into one Hugging Face model folder (safetensors + tokenizer).

    Runs in a single process with no process group. Returns ``out_dir``.
    """
    import torch.distributed.checkpoint as dcp
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    checkpoint = resolve_checkpoint(checkpoint)
    hf = checkpoint / HF_DIR
    config = AutoConfig.from_pretrained(hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    state = {"model": {k: v for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():  # loading in one process, without a process group, is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(state["model"], strict=True, assign=True)
    model.tie_weights()
    if dtype != "float32":
        model.to(getattr(torch, dtype))
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    if (hf / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(hf).save_pretrained(staging)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return out_dir
