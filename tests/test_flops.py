"""FLOPs formula and MFU: the written formula agrees with the real model, and the peak table never guesses."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

from raytrain_eks.train.flops import flops_per_token, matmul_params, mfu, peak_flops_for


def test_matmul_params_match_the_built_model(builtin_model):
    config = AutoConfig.from_pretrained(builtin_model)
    model = AutoModelForCausalLM.from_pretrained(builtin_model)
    linear = sum(m.weight.numel() for m in model.modules() if m.__class__.__name__ == "Linear")
    # lm_head is tied to the embedding; it is a matmul all the same, and counted once.
    assert matmul_params(config) == linear


def test_qwen2_5_1_5b_figures():
    # Qwen2.5-1.5B's published architecture: 28 layers, hidden 1536, 12 heads (2 KV), MLP 8960, vocab 151936.
    config = Qwen2Config(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
    )
    n = matmul_params(config)
    assert 1.52e9 < n < 1.56e9  # 1.31 B in the decoder + 0.23 B output projection
    assert flops_per_token(config, 2048) == pytest.approx(6 * n + 12 * 28 * 1536 * 2048)


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA L4", 121),
        ("NVIDIA A100-SXM4-80GB", 312),
        # CUDA's names for the three H100s: SXM (HBM3), PCIe and NVL have different clocks and power limits.
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA B200", 2250),
        ("NVIDIA A10G", 70),
        ("NVIDIA L40S", 362),
    ],
)
def test_peak_table_knows_the_gpus(name, tflops):
    assert peak_flops_for(name) == tflops * 1e12


@pytest.mark.parametrize("name", ["cpu", None, "", "NVIDIA GeForce RTX 4090", "Tesla T4", "NVIDIA GB200", "NVIDIA L40"])
def test_unknown_devices_get_no_peak(name):
    assert peak_flops_for(name) is None
    assert mfu(tokens_per_s=1000.0, flops_per_token=1e9, peak_flops=peak_flops_for(name), devices=8) is None


def test_mfu_arithmetic():
    assert mfu(tokens_per_s=10_000, flops_per_token=1.2e10, peak_flops=121e12, devices=8) == pytest.approx(
        1.2e14 / 968e12
    )
