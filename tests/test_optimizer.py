"""AdamW as the loop builds it: decay on matrices only (never on norm scales or biases), fused only on CUDA."""

from __future__ import annotations

import torch

from raytrain_eks.config import BUILTIN_MODEL, TrainingConfig
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
