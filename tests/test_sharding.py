"""The sharding chosen from where the ranks run (``training.sharding``), and the same training whatever it is.

First the choice itself (pure): auto gives no wrapper to one fp32 worker, FSDP on one node, HSDP across nodes
(with the mesh's rows the nodes' ranks, in any rank order) and flat FSDP when the ranks are spread unevenly;
explicit modes the placement cannot give are refused with one line. Then the settings (file, flags) and the
mixed-precision policies. Then real runs of the training loop under torchrun with gloo on CPU: a run on two
"nodes" is two torchrun agents on this machine (``--nnodes 2``), each with its own ``GROUP_RANK``, which is the
node id the loop's context reports. Every mode, with gradient accumulation and activation checkpointing, gives
the losses of one process training on the whole batch (fp32, to 1e-5) and its gradient norms (to 5e-5: matmuls of
another shape round differently, 1.4e-5 apart after two updates on an AVX-512 Xeon; a wrong reduction is off by 2x).
Last, HSDP with bf16 reduction adds up many micro-batches in fp32, as fp32 reduction does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from raytrain_eks.config import BUILTIN_MODEL, RANDOM_DATA, TrainingConfig
from raytrain_eks.errors import ConfigError
from raytrain_eks.train.sharding import ShardingError, choose_sharding, mixed_precision
from raytrain_eks.train.torchrun_entry import run

STEPS = 3
GLOBAL_BATCH = 8
MICRO_BATCHES = 32  # of the accumulation probe (tests/sharding_runs.py): enough for a bf16 sum to lose bits


# ------------------------------------------------------------------------------------------------ the choice


def test_auto_follows_the_nodes():
    one = choose_sharding("auto", ["a"])
    assert (one.mode, one.mesh_shape) == ("none", ())
    flat = choose_sharding("auto", ["a"] * 4)
    assert (flat.mode, flat.mesh_shape) == ("fsdp", (4,))
    hybrid = choose_sharding("auto", ["a", "a", "b", "b"])
    assert (hybrid.mode, hybrid.mesh_shape) == ("hsdp", (2, 2))
    assert hybrid.nodes == (("a", (0, 1)), ("b", (2, 3)))
    assert "auto: 4 ranks on 2 nodes" in hybrid.describe() and hybrid.describe().startswith("hsdp: 2 nodes x 2")


def test_hsdp_rows_are_the_nodes_whatever_the_rank_order():
    # A launcher may number the ranks round-robin over the nodes: each row still holds one node's ranks.
    layout = choose_sharding("auto", ["x", "y", "x", "y", "x", "y"])
    assert layout.mode == "hsdp" and layout.mesh_shape == (2, 3)
    assert layout.nodes == (("x", (0, 2, 4)), ("y", (1, 3, 5)))


def test_auto_falls_back_to_flat_fsdp_on_uneven_nodes():
    layout = choose_sharding("auto", ["a", "a", "b"])
    assert layout.mode == "fsdp" and layout.mesh_shape == (3,)
    assert "uneven (2, 1 ranks per node)" in layout.reason


def test_one_bf16_worker_keeps_the_wrapper_for_mixed_precision():
    layout = choose_sharding("auto", ["a"], precision="bf16")
    assert layout.mode == "fsdp" and "bf16 mixed precision" in layout.reason


def test_explicit_modes_win_when_the_placement_allows_them():
    assert choose_sharding("fsdp", ["a", "a", "b", "b"]).mode == "fsdp"  # flat across nodes, as asked
    assert choose_sharding("fsdp", ["a"]).mode == "fsdp"
    replicated = choose_sharding("hsdp", ["a", "b"])
    assert replicated.mesh_shape == (2, 1) and replicated.describe().startswith("hsdp: 2 nodes x 1 rank,")
    assert choose_sharding("none", ["a"]).mode == "none"


@pytest.mark.parametrize(
    ("requested", "nodes", "precision", "message"),
    [
        ("hsdp", ["a", "a"], "fp32", "'hsdp' replicates across nodes, but the run has 2 ranks on 1 node"),
        ("hsdp", ["a", "a", "b"], "fp32", "same number of ranks on every node, but the run has 3 ranks on 2 nodes"),
        ("none", ["a", "a"], "fp32", "'none' needs a single worker, but the run has 2 ranks on 1 node"),
        ("none", ["a"], "bf16", "'none' computes in fp32 only"),
        ("zero3", ["a"], "fp32", "must be one of auto, fsdp, hsdp, none"),
    ],
)
def test_impossible_modes_are_one_clear_line(requested, nodes, precision, message):
    with pytest.raises(ShardingError, match=message) as info:
        choose_sharding(requested, nodes, precision)
    assert "\n" not in str(info.value) and "training.sharding" in str(info.value)


# ------------------------------------------------------------------------------------------------ settings


def test_settings_defaults_and_refusals(cfg_for):
    cfg = cfg_for().training
    assert (cfg.sharding, cfg.reduce_precision) == ("auto", "fp32")
    with pytest.raises(ValueError, match="sharding 'none' needs a single worker, not num_workers = 4"):
        TrainingConfig(sharding="none", num_workers=4)
    with pytest.raises(ValueError, match="replicates across nodes, but num_workers = 1"):
        TrainingConfig(sharding="hsdp", num_workers=1)
    with pytest.raises(ValueError, match="reduce_precision"):
        TrainingConfig(reduce_precision="fp16")


def test_settings_from_the_file_and_bad_values_in_one_message(tmp_path, monkeypatch):
    from raytrain_eks.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "raytrain-eks.yaml").write_text("training:\n  sharding: hsdp\n  reduce_precision: bf16\n")
    cfg = load_config(environ={})
    assert (cfg.training.sharding, cfg.training.reduce_precision) == ("hsdp", "bf16")
    (tmp_path / "raytrain-eks.yaml").write_text("training:\n  sharding: zero3\n  reduce_precision: fp8\n")
    with pytest.raises(ConfigError) as info:
        load_config(environ={})
    text = "\n".join(info.value.problems)
    assert "training.sharding" in text and "zero3" in text and "training.reduce_precision" in text


def test_train_flags_reach_the_settings(tmp_path, train_settings, capsys):
    from raytrain_eks.cli import main

    training = train_settings("--sharding", "fsdp", "--reduce-precision", "bf16")
    assert (training.sharding, training.reduce_precision) == ("fsdp", "bf16")
    with pytest.raises(SystemExit) as info:
        main(["train", "--sharding", "zero3", "--num-workers", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "training.sharding = 'zero3' (from flag --sharding)" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sharding", "hsdp"], "training.sharding = 'hsdp' replicates across nodes, but the workers have 1 node"),
        (["--sharding", "none"], "training.sharding = 'none' needs a single worker, but the run has 2"),
    ],
)
def test_a_local_run_refuses_what_one_node_cannot_give(tmp_path, monkeypatch, capsys, builtin_model, flags, message):
    from raytrain_eks.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", *flags, "--output-dir", str(tmp_path / "run")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_policies_reduce_in_the_asked_dtype():
    assert mixed_precision("bf16").reduce_dtype == torch.float32
    assert mixed_precision("bf16", "bf16").reduce_dtype == torch.bfloat16
    fp32_over_bf16 = mixed_precision("fp32", "bf16")
    assert fp32_over_bf16.param_dtype is None and fp32_over_bf16.reduce_dtype == torch.bfloat16
    assert mixed_precision("fp32", "fp32").reduce_dtype is None
    with pytest.raises(ValueError, match="reduce_precision must be bf16 or fp32"):
        mixed_precision("fp32", "fp16")


# ------------------------------------------------------------------------------------------------ real runs


def _training(batch_size: int, **extra: Any) -> dict[str, Any]:
    return {
        "model_id": BUILTIN_MODEL,
        "data": RANDOM_DATA,
        "steps": STEPS,
        "seq_len": 32,
        "batch_size": batch_size,
        "grad_accum_steps": 2,
        "activation_checkpointing": True,
        "learning_rate": 1e-2,
        "warmup_steps": 1,
        "precision": "fp32",
        "log_every": 1,
        "checkpoint_every": 0,
        "seed": 0,
        **extra,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PLAN = [  # (name, settings over _training's, every rank on one node)
    ("auto-2x2", {}, False),
    ("fsdp-2x2", {"sharding": "fsdp"}, False),
    ("auto-1x4", {}, True),
    ("hsdp-bf16-2x2", {"sharding": "hsdp", "reduce_precision": "bf16"}, False),
]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, builtin_cache, starts_process_group) -> dict[str, Any]:
    """The runs of :data:`PLAN` on 4 ranks: two torchrun agents (``--nnodes 2``) of 2 processes each, all on this
    machine, one rendezvous; each run's ``(summary, records, all_reduces on subgroups)`` and rank 0's output."""
    tmp = tmp_path_factory.mktemp("four-ranks")
    plan: list[dict[str, Any]] = [
        {"name": name, "training": _training(GLOBAL_BATCH // 4, **extra), "one_node": one_node}
        for name, extra, one_node in PLAN
    ]
    plan.append({"name": "accumulation", "micro_batches": MICRO_BATCHES})
    (tmp / "plan.json").write_text(json.dumps(plan))
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYTRAIN_EKS_CACHE": str(builtin_cache)}
    script = str(Path(__file__).with_name("sharding_runs.py"))
    agents = []
    for node in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}"]
        argv += ["--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}"]
        argv += [script, str(tmp / "plan.json")]
        agents.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for agent in agents:
            stdout, stderr = agent.communicate(timeout=300)
            outputs.append((agent.returncode, stdout, stderr))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for code, stdout, stderr in outputs:
        assert code == 0, f"torchrun exited with {code}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    runs: dict[str, Any] = {"output": outputs[0][1]}
    runs["accumulation"] = json.loads((tmp / "accumulation" / "gradients.json").read_text())
    for entry in plan[: len(PLAN)]:
        out = tmp / entry["name"]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[entry["name"]] = (
            json.loads((out / "summary.json").read_text()),
            records,
            json.loads((out / "collectives.json").read_text()),
        )
    return runs


def _one_process(tmp: Path, **extra: Any) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = run(TrainingConfig(**_training(GLOBAL_BATCH, **extra)), tmp)
    assert summary["world_size"] == 1
    return summary, [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()], out.getvalue()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, builtin_cache) -> dict[str, Any]:
    """One process training on the whole batch, in this process (a process group of one): with the auto sharding
    (no wrapper) and with FSDP; each run's ``(summary, records, output)``."""
    tmp = tmp_path_factory.mktemp("one-process")
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    try:
        return {"auto": _one_process(tmp / "auto"), "fsdp": _one_process(tmp / "fsdp", sharding="fsdp")}
    finally:
        dist.destroy_process_group()


def _assert_same_training(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert abs(want[-1]["loss"] - want[0]["loss"]) > 1e-3  # the weights moved: later losses test the updates
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]
        # A batch of 4 in one process and 1 per rank are matmuls of different shapes: oneDNN's AVX-512 kernels round
        # them differently (1.4e-5 apart at step 3 on a Sapphire Rapids Xeon); a sum for a mean would be 2x or 4x.
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-5, abs=1e-6), a["step"]


def test_every_mode_trains_as_one_process(one_process, four_ranks):
    none, reference, output = one_process["auto"]
    assert none["sharding"] == "none"
    assert "sharding: none: no wrapper (auto: one worker" in output
    fsdp_one, fsdp_one_records, _ = one_process["fsdp"]
    assert fsdp_one["sharding"] == "fsdp"
    _assert_same_training(fsdp_one_records, reference)

    hybrid, hybrid_records, _ = four_ranks["auto-2x2"]
    assert (hybrid["sharding"], hybrid["world_size"], hybrid["reduce_precision"]) == ("hsdp", 4, "fp32")
    assert "sharding: hsdp: 2 nodes x 2 ranks, sharded inside a node (auto: 4 ranks on 2 nodes" in four_ranks["output"]
    _assert_same_training(hybrid_records, reference)

    across, across_records, _ = four_ranks["fsdp-2x2"]
    assert across["sharding"] == "fsdp"  # as configured: one flat group over both nodes
    _assert_same_training(across_records, reference)

    flat, flat_records, _ = four_ranks["auto-1x4"]
    assert (flat["sharding"], flat["world_size"]) == ("fsdp", 4)
    assert "sharding: fsdp: 4 ranks in one group on 1 node (auto: 4 ranks on 1 node)" in four_ranks["output"]
    _assert_same_training(flat_records, reference)


def test_hsdp_reduces_across_nodes_once_per_optimizer_step(builtin_model, four_ranks):
    """With 2 micro-batches per step, the replicas' gradient all-reduce still runs once per step and sharded
    module: the first micro-batch's gradients stay on the ranks (no traffic between nodes). Reduced in bf16, it runs
    every micro-batch (so that they add up in fp32), each of half the bytes: with 2, the bytes of one fp32 step."""
    from raytrain_eks.train.model import load_model
    from raytrain_eks.train.sharding import decoder_layers

    modules = len(decoder_layers(load_model(builtin_model, activation_checkpointing=False))) + 1  # + the root
    _, _, reductions = four_ranks["auto-2x2"]
    # Rank 0's replica group pairs it with the rank of the same position on the other node.
    assert {tuple(r["ranks"]) for r in reductions} == {(0, 2)}
    assert len(reductions) == STEPS * modules
    _, _, flat = four_ranks["fsdp-2x2"]
    assert flat == []  # one flat group: its reduce-scatter is over all ranks, nothing over a subgroup
    _, _, bf16 = four_ranks["hsdp-bf16-2x2"]
    assert {tuple(r["ranks"]) for r in bf16} == {(0, 2)}
    assert len(bf16) == 2 * len(reductions) and sum(r["bytes"] for r in bf16) == sum(r["bytes"] for r in reductions)


def test_hsdp_with_bf16_reduction_stays_close(one_process, four_ranks):
    """Gradients rounded to bf16 on their way between ranks: not the same numbers, but the same training."""
    _, reference, _ = one_process["auto"]
    summary, records, _ = four_ranks["hsdp-bf16-2x2"]
    assert (summary["sharding"], summary["reduce_precision"]) == ("hsdp", "bf16")
    assert records[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-5)  # before any update
    for a, b in zip(records, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-2)
    # ...and not secretly fp32: the rounding shows in the gradient norms.
    assert any(
        a["grad_norm"] != pytest.approx(b["grad_norm"], rel=1e-6) for a, b in zip(records, reference, strict=True)
    )


def test_hsdp_with_bf16_reduction_adds_up_micro_batches_in_fp32(four_ranks):
    """32 micro-batches of gradient accumulation under HSDP (2 nodes x 2 ranks), every rank's gradient and every mean
    of them exact in bf16 (tests/sharding_runs.py), so reducing one micro-batch rounds nothing. Their sum, 33.5, is
    what fp32 reduction gets; reduced in bf16, the micro-batches add up in fp32 too. Summed in bf16 they would not:
    each addition rounds to the sum's step, 1/8 past 16, where the 3/64s vanish (FSDP2's per-node bf16 running sums
    came to 32.5, 3% off)."""
    probe = four_ranks["accumulation"]
    want = MICRO_BATCHES * (1 + 3 / 64)
    in_bf16 = torch.zeros((), dtype=torch.bfloat16)
    for _ in range(MICRO_BATCHES):
        in_bf16 += 1 + 3 / 64
    assert want - float(in_bf16) == 0.5  # what this test tells apart: even the mean's bf16 sum is 1.5% off
    fp32, bf16 = probe["fp32"]["gradients"], probe["bf16"]["gradients"]
    assert len(fp32) == len(bf16) == 3 * 32 and set(fp32) == {want}  # the root's and two layers' 4 x 8
    assert bf16 == pytest.approx(fp32, rel=2**-8)  # bf16's rounding of one reduction, at most
    # Each micro-batch crosses the nodes in bf16 (2 bytes a value): one all-reduce per micro-batch and sharded module.
    assert len(probe["bf16"]["all_reduces"]) == MICRO_BATCHES * 3 and len(probe["fp32"]["all_reduces"]) == 3
    assert {r["bytes"] for r in probe["bf16"]["all_reduces"]} == {2 * 16}
