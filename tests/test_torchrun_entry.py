"""The torchrun entry runs the same training loop as the Ray workers, and the loop's maths hold across world sizes.

Two processes with batch 2 each and one process with batch 4 see the same global batch (``random_batch`` draws the
global batch and each rank takes its slice) and normalise the loss by the same global token count, so in fp32 they
must report the same losses.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from raytrain_eks.config import BUILTIN_MODEL, RANDOM_DATA

pytestmark = pytest.mark.usefixtures("starts_process_group")

STEPS = 3


def _torchrun(tmp: Path, cache: Path, *, nproc: int, batch_size: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    training = {
        "model_id": BUILTIN_MODEL,
        "data": RANDOM_DATA,
        "steps": STEPS,
        "seq_len": 32,
        "batch_size": batch_size,
        "learning_rate": 3e-3,
        "warmup_steps": 1,
        "precision": "fp32",
        "log_every": 1,
        "seed": 0,
    }
    config = tmp / f"training-{nproc}.json"
    config.write_text(json.dumps(training))
    out = tmp / f"out-{nproc}"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "raytrain_eks.train.torchrun_entry",
        "--config-json",
        str(config),
        "--out",
        str(out),
    ]
    # The session's model cache (conftest's builtin_cache): the built-in model is built once for every test.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYTRAIN_EKS_CACHE": str(cache)}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, (
        f"torchrun exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def test_two_processes_match_one_process_with_the_whole_batch(tmp_path: Path, builtin_cache: Path) -> None:
    two, two_records = _torchrun(tmp_path, builtin_cache, nproc=2, batch_size=2)
    assert two["steps"] == STEPS
    assert two["world_size"] == 2
    assert two["launcher"] == "torchrun"
    assert two["torch_num_threads"] == [1, 1]
    assert math.isfinite(two["first_loss"])
    assert math.isfinite(two["step_time_s"]) and two["step_time_s"] > 0
    assert [r["step"] for r in two_records] == list(range(1, STEPS + 1))

    one, one_records = _torchrun(tmp_path, builtin_cache, nproc=1, batch_size=4)
    assert one["world_size"] == 1
    assert one["tokens"] == two["tokens"]  # the same global batch
    assert one["first_loss"] == pytest.approx(two["first_loss"], rel=1e-4)
    # Not only the forward pass: the gradients (normalised by the global token count) match too, step after step.
    for a, b in zip(one_records, two_records, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]


def test_rejects_real_data(tmp_path: Path) -> None:
    config = tmp_path / "training.json"
    config.write_text(json.dumps({"training": {"data": "builtin:sample-instructions", "model_id": BUILTIN_MODEL}}))
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain_eks.train.torchrun_entry", "--config-json", str(config), "--out", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "random token ids only" in proc.stderr
