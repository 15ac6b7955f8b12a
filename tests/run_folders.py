"""Run folders as ``raytrain-eks train`` leaves them, written directly, for tests of what reads them; and what a
real run's checkpoint holds."""

from __future__ import annotations

import json
from pathlib import Path


def write_run(folder: Path, *, steps: int = 30, fabric: dict | None = None, cost: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    records = [
        {
            "step": s,
            "loss": 5.0 / s,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 900.0,
            "step_time_s": 0.5,
            "mfu": 0.3,
        }
        | ({"eval_loss": 6.0 / s, "eval_ppl": 2.0} if s % 10 == 0 else {})
        for s in [1, *range(5, steps + 1, 5)]
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"steps": steps, "first_loss": 5.0, "final_loss": 5.0 / steps, "checkpoints": [10, 30]}
    summary |= {"checkpoint_s": 2.5, "checkpoint_s_per_save": 1.25, "checkpoint_share": 0.045}  # train/loop.py's keys
    summary |= {"fabric": fabric} if fabric else {}
    summary |= {"cost": cost} if cost else {}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.yaml").write_text("training:\n  steps: 30\n")
    (folder / "samples.jsonl").write_text(
        json.dumps({"prompt": "Say <hi>", "completion": "hi & bye", "tokens": 3}) + "\n"
    )
    return folder


def checkpoint_tensor_bytes(checkpoint: str) -> int:
    """The bytes of every tensor a DCP checkpoint holds (weights and optimizer moments), from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    held = FileSystemReader(checkpoint).read_metadata().state_dict_metadata.values()
    return sum(m.size.numel() * m.properties.dtype.itemsize for m in held if hasattr(m, "size"))
