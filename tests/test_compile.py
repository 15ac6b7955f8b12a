"""``training.compile``: every decoder layer compiled with the inductor (on CPU here) before sharding, and the run
trains as it does eagerly: same losses and gradient norms, step by step, in one process with FSDP (fp32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from raytrain_eks.config import BUILTIN_MODEL, RANDOM_DATA, TrainingConfig
from raytrain_eks.train.torchrun_entry import run

pytestmark = pytest.mark.integration

STEPS = 3


def _training(**extra: Any) -> TrainingConfig:
    return TrainingConfig(
        model_id=BUILTIN_MODEL,
        data=RANDOM_DATA,
        steps=STEPS,
        seq_len=32,
        batch_size=4,
        grad_accum_steps=2,
        learning_rate=1e-2,
        warmup_steps=1,
        precision="fp32",
        sharding="fsdp",
        log_every=1,
        checkpoint_every=0,
        **extra,
    )


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_compiled_layers_train_as_eager_ones(tmp_path, one_process_group, builtin_model, capsys):
    import torch._dynamo

    run(_training(), tmp_path / "eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    summary = run(_training(compile=True), tmp_path / "compiled")
    assert summary["steps"] == STEPS
    out = capsys.readouterr().out
    from raytrain_eks.train.model import load_model
    from raytrain_eks.train.sharding import decoder_layers

    layers = len(decoder_layers(load_model(builtin_model, activation_checkpointing=False)))
    assert f"compile: {layers} decoder layers with torch.compile (inductor)" in out
    # The inductor really compiled (at least one graph), and the layers ran compiled code without falling back.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    eager, compiled = _records(tmp_path / "eager"), _records(tmp_path / "compiled")
    assert [r["step"] for r in compiled] == list(range(1, STEPS + 1))
    assert abs(eager[-1]["loss"] - eager[0]["loss"]) > 1e-3  # the weights moved: later steps test the updates
    for a, b in zip(compiled, eager, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]


def test_the_flag_reaches_the_settings(train_settings):
    assert TrainingConfig().compile is False
    assert train_settings("--compile").compile is True
    assert train_settings().compile is False
