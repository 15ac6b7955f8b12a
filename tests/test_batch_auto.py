"""``training.batch_size: auto``: the largest micro-batch the memory estimate admits on the planned GPU, the
accumulation steps that keep the samples a step trains, what a plan says and what the job is given; the default on a
local run. Hermetic: the memory model and the plan, no GPU."""

from __future__ import annotations

import pytest

from raytrain_eks.config import DEFAULT_BATCH_SIZE, load_config
from raytrain_eks.errors import ConfigError
from raytrain_eks.instances import instance_type
from raytrain_eks.train.memory import auto_batch, check_config, fit_config


@pytest.fixture
def cfg_at(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no raytrain-eks.yaml of the current folder

    def build(gpu: str, *sets: str, **environ: str):
        environ = {"MODEL_ID": "Qwen/Qwen2.5-1.5B", "SEQ_LEN": "2048", "BATCH_SIZE": "auto", **environ}
        return load_config(environ={"GPU_NODE_TYPE": gpu, "GPU_NODE_COUNT": "1", **environ}, sets=sets)

    return build


def test_auto_is_accepted_beside_a_number_and_anything_else_is_refused_naming_both(cfg_at):
    assert cfg_at("p5en.48xlarge").training.batch_size == "auto"
    with pytest.raises(ConfigError, match="training.batch_size = 'many'.*should be a valid integer.*'auto'"):
        cfg_at("p5en.48xlarge", BATCH_SIZE="many")


def test_a_local_run_trains_the_default_batch(cfg_at):
    assert cfg_at("p5en.48xlarge").training.micro_batch == DEFAULT_BATCH_SIZE == 2


def test_auto_fills_the_gpu_up_to_the_samples_a_step_trains(cfg_at):
    h200 = instance_type("p5en.48xlarge")
    cfg, line = auto_batch(cfg_at("p5en.48xlarge", "training.grad_accum_steps=4"), h200)
    t = cfg.training
    # A step trains 2 x 4 = 8 samples per GPU; an H200 holds 8 of 2048 at once with the sharded model (8 ranks).
    assert (t.batch_size, t.grad_accum_steps) == (8, 1)
    assert line.startswith("batch: 8 samples per micro-batch x 1 accumulation steps per GPU (auto: the largest")
    # The micro-batch is admitted: it fits the GPU with the allocator's margin and the fixed terms, without
    # activation checkpointing.
    admitted = check_config(cfg, h200)
    assert admitted is not None and admitted.fits and not admitted.switched_on


@pytest.mark.parametrize(
    ("accumulation", "expected", "kept"),
    [
        # H100s (4 ranks sharding Qwen2.5-1.5B) admit 9 of 2048 each: 8 x 4 keeps a step's 32 samples.
        (16, (8, 4), True),
        # 26 samples a step: 2, its largest divisor up to 9, would fill a fifth of the GPU, so 9 x 3 = 27, said.
        (13, (9, 3), False),
    ],
)
def test_a_micro_batch_that_divides_the_step_is_preferred_and_one_that_does_not_is_said(
    cfg_at, accumulation, expected, kept
):
    h100 = instance_type("p5.4xlarge")
    cfg, line = auto_batch(cfg_at("p5.4xlarge", f"training.grad_accum_steps={accumulation}"), h100)
    t = cfg.training
    assert (t.batch_size, t.grad_accum_steps) == expected
    assert ("a step trains 27 samples per GPU instead of 26, which 9 does not divide" in line) != kept
    assert (
        "(auto: the largest micro-batch up to 32 the memory estimate admits on H100 (9) that divides 32)" in line
    ) == kept
    # 9 is the most admitted: 10 would switch activation checkpointing on.
    over = check_config(cfg.model_copy(update={"training": t.model_copy(update={"batch_size": 10})}), h100)
    assert over is not None and over.switched_on


def test_a_set_batch_is_kept_and_a_plan_of_auto_gives_the_job_numbers(cfg_at):
    h200 = instance_type("p5en.48xlarge")
    cfg = cfg_at("p5en.48xlarge", BATCH_SIZE="3")
    assert auto_batch(cfg, h200) == (cfg, "")
    fitted, check = fit_config(cfg_at("p5en.48xlarge"), h200)
    assert isinstance(fitted.training.batch_size, int) and check is not None
    assert check.to_dict()["batch_line"].startswith(f"batch: {fitted.training.batch_size} samples per micro-batch")


def test_a_plan_predicts_the_speed_only_where_the_same_step_was_measured(cfg_at):
    h200 = instance_type("p5en.48xlarge")
    _, check = fit_config(cfg_at("p5en.48xlarge", "training.grad_accum_steps=2"), h200)
    assert check is not None and check.estimate.settings["micro_batch"] == 4
    # Compiled (auto, on CUDA) with the full logits (they fit): bench_gpu_step's fsdp+compile on one H200.
    assert check.to_dict()["speed_line"] == (
        "speed: predicted about 38,545 tokens/s and 40.2% MFU per H200 (measured on one H200 for Qwen/Qwen2.5-1.5B, "
        "4 x 2048, compiled, plain loss: benchmarks/results/2026-12-04-h200; the reduction across GPUs is not in it)"
    )
    _, eager = fit_config(cfg_at("p5en.48xlarge", "training.grad_accum_steps=2", "training.compile=off"), h200)
    assert eager is not None and "34.7% MFU" in eager.speed
    _, l4 = fit_config(cfg_at("g6.12xlarge", "training.grad_accum_steps=2"), instance_type("g6.12xlarge"))
    assert l4 is not None and l4.speed.startswith("speed: no prediction (no step measured on L4 for Qwen/Qwen2.5-1.5B")
