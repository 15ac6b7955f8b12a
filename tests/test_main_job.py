"""The main job exactly as a user runs it: `raytrain-eks train` with no arguments, in a fresh folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.usefixtures("starts_ray")


def test_default_run_end_to_end(tmp_path, builtin_cache):
    exe = shutil.which("raytrain-eks", path=str(Path(sys.executable).parent)) or shutil.which("raytrain-eks")
    assert exe, "the console script must be installed"
    env = {
        k: v for k, v in os.environ.items() if k not in {"STEPS", "MODEL_ID", "NUM_WORKERS", "SEQ_LEN", "BATCH_SIZE"}
    }
    proc = subprocess.run([exe, "train"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("Run folder: ")
    run_dir = Path(last.removeprefix("Run folder: "))
    assert run_dir.parent == (tmp_path / "runs").resolve()
    assert "Traceback" not in proc.stdout + proc.stderr

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["training"]["model_id"] == "builtin:tiny-qwen2"
    assert cfg["training"]["data"] == "builtin:sample-instructions"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = cfg["training"]["steps"]
    assert records[0]["step"] == 1 and records[-1]["step"] == steps
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["mfu"] is None  # no MFU on CPU

    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"steps", "first_loss", "final_loss", "tokens", "wall_s", "tokens_per_s", "mfu"} <= set(summary)
    assert summary["steps"] == steps and summary["world_size"] == 2
    assert summary["compile"] == "off" and summary["first_step_s"] > 0  # compile auto: not on CPUs
    assert summary["first_loss"] == records[0]["loss"] and summary["final_loss"] == records[-1]["loss"]
    assert summary["final_loss"] < 0.5 * summary["first_loss"], summary
    # Every step trains 2 workers' blocks; the tokens count the rows in them, not the padding after the rows.
    positions = steps * 2 * cfg["training"]["batch_size"] * cfg["training"]["seq_len"]
    assert 0.9 * positions < summary["tokens"] == records[-1]["tokens"] <= positions
    # Throughput is the steady state's: the logging windows after the first (step 1 alone), checkpoints left out.
    windows = [(b["tokens"] - a["tokens"], b["tokens_per_s"]) for a, b in zip(records, records[1:], strict=False)]
    steady = sum(t for t, _ in windows) / sum(t / rate for t, rate in windows)
    assert summary["tokens_per_s"] == pytest.approx(steady, rel=1e-6)
    assert summary["trained_tokens"] == summary["tokens"], "a run that never resumed trained every token itself"
    # The default job holds out 5% of the data and evaluates at the end; it writes samples and its report.
    assert summary["eval_loss"] == records[-1]["eval_loss"] and summary["eval_tokens"] > 0
    assert len((run_dir / "samples.jsonl").read_text().splitlines()) == 3
    assert (run_dir / "report.html").is_file() and any((run_dir / "tensorboard").iterdir())
