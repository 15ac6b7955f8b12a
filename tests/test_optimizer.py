"""AdamW as the loop builds it: decay on matrices only (never on norm scales or biases), fused only on CUDA; the peak
learning rate of the method unless one is set."""

from __future__ import annotations

import torch

from raytrain_eks.config import BUILTIN_MODEL, TrainingConfig, load_config
from raytrain_eks.train.loop import build_optimizer
from raytrain_eks.train.model import load_model


def test_norms_and_biases_get_no_weight_decay(builtin_model):
    model = load_model(builtin_model, activation_checkpointing=False)
    cfg = TrainingConfig(model_id=BUILTIN_MODEL, weight_decay=0.1)
    optimizer, _ = build_optimizer(model, cfg, torch.device("cpu"))
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    names = dict(model.named_parameters())  # tied weights appear once
    assert set(decay_of) == {id(p) for p in names.values()}
    no_decay = sorted(n for n, p in names.items() if decay_of[id(p)] == 0.0)
    decay = sorted(n for n, p in names.items() if decay_of[id(p)] == 0.1)
    assert no_decay and decay
    assert all("norm" in n or n.endswith(".bias") for n in no_decay), no_decay
    assert any(n.endswith("q_proj.bias") for n in no_decay) and any("input_layernorm" in n for n in no_decay)
    assert all(n.endswith(".weight") and "norm" not in n for n in decay), decay
    assert "model.embed_tokens.weight" in decay
    assert not any(g["fused"] for g in optimizer.param_groups)  # the fused kernel is CUDA-only here


def test_a_lora_jobs_optimizer_peaks_at_loras_learning_rate_unless_one_is_set(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 4)
    for sets, peak in [
        (["training.method=lora"], 2e-4),
        (["training.method=lora", "training.learning_rate=1e-3"], 1e-3),
        ([], 2e-5),
    ]:
        cfg = load_config(environ={}, path=None, sets=sets)
        # The settings reach each worker as JSON (the job's training section), and a resumed run from its config.yaml.
        _, scheduler = build_optimizer(model, TrainingConfig.model_validate(cfg.training.model_dump(mode="json")))
        assert scheduler.base_lrs == [peak, peak], sets
        (tmp_path / "config.yaml").write_text(cfg.to_yaml())
        assert load_config(environ={}, path=tmp_path / "config.yaml").training.learning_rate == peak, sets
