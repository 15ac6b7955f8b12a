"""The GPU check runs end to end on a CPU with ``--tiny`` (the default job is covered by test_main_job): the job's
own loop with its memory estimate beside it, the NCCL check skipped with its reason, and the chunked loss equal
to the plain one on this device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_runs_on_a_cpu_with_tiny_shapes(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--checks", "qwen_step,nccl_gate,chunked_loss"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failed"] == [] and out["tiny"] is True
    step = out["results"]["qwen_step"]
    assert step["steps"] == 4 and step["tokens_per_s"] > 0 and step["estimate_gib"] > 0
    assert step["peak_reserved_gib"] is None and step["host_syncs"] is None  # CUDA figures: none on a CPU
    assert out["results"]["nccl_gate"]["skipped"].startswith("no GPU")
    loss = out["results"]["chunked_loss"]
    assert loss["chunks"] == 9 and max(loss["loss_rel_diff"], loss["hidden_grad_rel_diff"]) < 1e-5
    assert loss["weight_grad_rel_diff"] < 1e-5
    assert "qwen_step: model=builtin tiny" in proc.stdout


def test_sync_ledger_names_where_the_host_waited_and_counts_those_inside_a_step():
    """The check's sync report: each CUDA sync warning counted by the innermost frame of this project's code (and
    the frame that raised it), and how many came from inside ``train_step``; other warnings are not counted."""
    import warnings

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_check import SyncLedger
    finally:
        sys.path.remove(str(SCRIPT.parent))
    source = (
        "import warnings\n"
        "def logged_loss():\n"
        "    warnings.warn('called a synchronizing CUDA operation')\n"
        "def train_step():\n"
        "    warnings.warn('called a synchronizing CUDA operation')\n"
        "    warnings.warn('something else entirely')\n"
        "    logged_loss()\n"
    )
    space: dict = {}
    exec(compile(source, "/site/raytrain_eks/train/loop.py", "exec"), space)
    ledger = SyncLedger()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = ledger.record
        space["train_step"]()
        space["logged_loss"]()
    assert ledger.total == 3 and ledger.in_steps == 2
    assert ledger.top(8) == {"loop.py:5 train_step": 1, "loop.py:3 logged_loss": 2}
