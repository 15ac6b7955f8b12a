"""The GPU check runs end to end on a CPU with ``--tiny`` (the default job is covered by test_main_job): the job's
own loop with its memory estimate beside it, the NCCL check skipped with its reason, and the chunked loss equal
to the plain one on this device, and a packed batch's documents each with the loss it has alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("starts_programs")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_runs_on_a_cpu_with_tiny_shapes(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--checks",
            "qwen_step,nccl_gate,chunked_loss,packed_attention,loss_kernels,memory_modes",
        ],
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
    assert step["attention"] == "sdpa"  # training.attention auto on a CPU
    assert out["results"]["nccl_gate"]["skipped"].startswith("no GPU")
    loss = out["results"]["chunked_loss"]
    assert loss["chunks"] == 9 and max(loss["loss_rel_diff"], loss["hidden_grad_rel_diff"]) < 1e-5
    assert loss["weight_grad_rel_diff"] < 1e-5
    packed = out["results"]["packed_attention"]  # each document inside a packed batch as it is alone
    assert packed["attention"] == "sdpa" and packed["documents"] >= 4 and packed["max_doc_rel_diff"] < 1e-4
    assert packed["without_positions_max_rel_diff"] > 1e-2  # documents that see each other would show
    assert "qwen_step: model=builtin tiny" in proc.stdout
    kernels = out["results"]["loss_kernels"]  # plain and chunked run here, the fused kernels say why not
    assert kernels["chunked"]["loss_rel_diff"] < 1e-5 and kernels["plain"]["ms"] > 0
    assert kernels["fused:liger_kernel"]["skipped"].startswith("the device is a CPU")
    modes = out["results"]["memory_modes"]  # the estimate of each mode, with no GPU figures beside it here
    assert set(modes) >= {"full", "lora", "lora_ac"} and modes["lora_ac"]["peak_reserved_gib"] is None
    assert modes["full"]["estimate_gib"] > modes["lora"]["estimate_gib"] > 0
    assert modes["full"]["estimate_reserved_gib"] > modes["full"]["estimate_gib"]  # the margin and fixed terms
    assert out["job_over_best"] is None  # neither the job's step nor the best setting was measured


def test_the_gpu_check_refuses_a_machine_without_cuda_unless_it_checks_itself(tmp_path):
    g = _gpu_check_module()
    assert (
        g.refusal_without_cuda(tiny=True, cuda=False) is None and g.refusal_without_cuda(tiny=False, cuda=True) is None
    )
    proc = subprocess.run([sys.executable, str(SCRIPT), "--checks", "loss_kernels"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "has no CUDA device" in proc.stderr and "--tiny" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_the_gpu_checks_figures_go_to_a_folder_named_for_the_day_and_the_gpu_and_the_job_is_compared_with_the_best():
    g = _gpu_check_module()
    assert g.results_folder("2026-12-08", "NVIDIA H100 80GB HBM3").name == "2026-12-08-h100"
    assert g.results_folder("2026-12-08", "NVIDIA H200").parent == SCRIPT.parent / "results"
    ratio = g.job_over_best({"job_step": {"tokens_per_s": 40000.0}, "best_setting": {"best_tokens_per_s": 44835.0}})
    assert ratio == 0.892  # short of the goal's 0.9
    assert g.job_over_best({"job_step": {"tokens_per_s": 40000.0}}) is None


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


def _gpu_check_module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return gpu_check


def test_the_gpu_check_fails_an_estimate_off_the_peak_or_a_reserve_beyond_the_admissions_margin():
    """With the H200 run's figures (estimate 30.89 GiB, 30.38 allocated, 37.63 reserved: 1.22 x) the loop check
    passes the admission's margin, which that run measured (1.24 x the allocated peak); beyond it, it fails."""
    judge = _gpu_check_module().judge_memory
    assert judge(30.89, 30.38, 37.63) is None
    assert judge(1.0, None, None) is None  # a CPU: no device figures to judge
    held = judge(30.89, 30.38, 39.5)
    assert held and "reserved 39.50 GiB, 1.28 x the estimate" in held and "1.24 x margin" in held
    off = judge(40.0, 30.38, 34.0)
    assert off and "+32% off the allocated peak 30.38 GiB" in off


def test_the_gpu_check_fails_a_chunked_loss_beyond_rounding():
    g = _gpu_check_module()
    h200 = {"dtype": "bfloat16", "loss_rel_diff": 0.0, "hidden_grad_rel_diff": 4.7e-3, "weight_grad_rel_diff": 2.4e-3}
    assert g.judge_chunked(h200) is None
    wrong = g.judge_chunked(h200 | {"weight_grad_rel_diff": 0.3})
    assert wrong and "weight_grad_rel_diff 3.0e-01 > 2e-02" in wrong and "hidden" not in wrong
    assert g.judge_chunked(
        {"dtype": "float32", "loss_rel_diff": 1e-4, "hidden_grad_rel_diff": 0.0, "weight_grad_rel_diff": float("nan")}
    )
