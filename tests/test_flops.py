"""FLOPs formula and MFU: the written formula agrees with the real model, and the peak table never guesses.

The formula is checked against torch's ``FlopCounterMode`` on tiny random models built from configs (fp32, CPU,
nothing downloaded): dense Llama, Qwen2, Qwen3 and Gemma 2 with heads x head_dim unlike the hidden size; packed
blocks, each document counted alone as it attends only within itself; Mixture-of-Experts models (Qwen3-MoE,
Qwen2-MoE, Mixtral, DeepSeek-V3) with dense and sparse layers, shared experts and routers. The MoE counts also stand
as arithmetic written here, beside the published active sizes of full-size models; sliding windows are arithmetic
only (the counter charges a masked product as a full square).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
)

from raytrain_eks.train.flops import (
    attention_flops_coefficient,
    documents_flops,
    flops_per_token,
    matmul_flops_per_token,
    matmul_params,
    mfu,
    peak_flops_for,
)

# Tiny decoders: 4 heads of 24 (96 wide, against a hidden size of 64) over 2 KV heads, so a formula that reads the
# hidden size where it means heads x head_dim is visibly wrong; a small vocabulary keeps the output projection from
# drowning the rest.
H, HEADS, HEAD_DIM, KV_HEADS, INTER, VOCAB = 64, 4, 24, 2, 96, 128
TINY = {
    "hidden_size": H,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "intermediate_size": INTER,
    "vocab_size": VOCAB,
}
# One layer's attention projections with the tiny shapes: q and o are 64 x 96, k and v 64 x 48.
ATTENTION = 2 * H * HEADS * HEAD_DIM + 2 * H * KV_HEADS * HEAD_DIM
DENSE_MLP = 3 * H * INTER  # gate, up and down
LM_HEAD = VOCAB * H


def counted(config, lengths: list[int]) -> tuple[float, float]:
    """FlopCounterMode's FLOPs of one training step (forward, loss, backward) over each document run alone, summed:
    (all of them, the batched matmuls alone, which are eager attention's score and value products)."""
    torch.manual_seed(0)
    # Eager attention: the counter knows no CPU kernel of sdpa (it would count no attention at all), and eager's two
    # batched matmuls are the full square the formula charges. Eager experts: one plain matmul per expert hit.
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    total = attention = 0.0
    for n in lengths:
        ids = torch.randint(0, config.vocab_size, (1, n))
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        total += counter.get_total_flops()
        attention += sum(v for op, v in counter.get_flop_counts()["Global"].items() if str(op) == "aten.bmm")
    return total, attention


DENSE = ["llama", "qwen2", "qwen3", "gemma2"]


@pytest.mark.parametrize("model_type", DENSE)
def test_dense_models_match_the_flop_counter(model_type):
    config = AutoConfig.for_model(model_type, **TINY)
    seq_len, rows = 128, 2
    total, attention = counted(config, [seq_len] * rows)
    tokens = seq_len * rows
    # Attention: 12 x layers x heads x head_dim per token per token of context (96 wide here, not the hidden 64).
    assert attention_flops_coefficient(config) == 12 * 2 * HEADS * HEAD_DIM
    assert attention_flops_coefficient(config) * seq_len * tokens == pytest.approx(attention, rel=0.02)
    assert matmul_flops_per_token(config) * tokens == pytest.approx(total - attention, rel=0.02)
    assert flops_per_token(config, seq_len) * tokens == pytest.approx(total, rel=0.02)
    assert (
        flops_per_token(config, seq_len)
        == matmul_flops_per_token(config) + attention_flops_coefficient(config) * seq_len
    )


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_a_packed_block_is_charged_by_its_documents(model_type):
    # Three whole documents in a block of 128: each attends only within itself, so the attention of the block is
    # 23² + 70² + 35², not 128 x 128; the counter runs each alone.
    config = AutoConfig.for_model(model_type, **TINY)
    lengths = [23, 70, 35]
    total, _ = counted(config, lengths)
    assert documents_flops(config, lengths) == pytest.approx(total, rel=0.02)
    c = attention_flops_coefficient(config)
    assert documents_flops(config, lengths) == pytest.approx(
        matmul_flops_per_token(config) * 128 + c * (23**2 + 70**2 + 35**2)
    )
    assert documents_flops(config, []) == 0.0


def test_lora_charges_the_frozen_base_no_weight_gradient():
    config = AutoConfig.for_model("gemma2", **TINY)
    n = 2 * (ATTENTION + DENSE_MLP) + LM_HEAD
    adapters = 5000
    assert matmul_flops_per_token(config, adapters=adapters) == 4 * n + 6 * adapters
    assert flops_per_token(config, 64, adapters=adapters) == 4 * n + 6 * adapters + 12 * 2 * HEADS * HEAD_DIM * 64
    assert documents_flops(config, [64, 10], adapters=adapters) == pytest.approx(
        (4 * n + 6 * adapters) * 74 + 12 * 2 * HEADS * HEAD_DIM * (64**2 + 10**2)
    )


# Mixture-of-Experts fields for the tiny decoders (head_dim 16 x 4 heads = the hidden size, so only the MLP differs
# from a dense count). Each case's active weights per token are written out below.
MOE_FIELDS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
MOE_ATTENTION = 2 * H * H + 2 * H * KV_HEADS * 16
MOE_CASES = {
    # 3 layers, layer 0 dense (mlp_only_layers); layers 1 and 2: 2 of 8 experts of 16 and the 64 x 8 router.
    "qwen3_moe": (
        {**MOE_FIELDS, "num_hidden_layers": 3, "mlp_only_layers": [0]},
        3 * MOE_ATTENTION + DENSE_MLP + 2 * (2 * 3 * H * 16 + H * 8) + LM_HEAD,
    ),
    # 3 layers, experts every 2nd (decoder_sparse_step 2: layer 1 only); it adds a shared MLP of 32 and its 64 x 1
    # sigmoid gate to the 2 routed experts of 16 and the router.
    "qwen2_moe": (
        {**MOE_FIELDS, "num_hidden_layers": 3, "decoder_sparse_step": 2, "shared_expert_intermediate_size": 32},
        3 * MOE_ATTENTION + 2 * DENSE_MLP + (2 * 3 * H * 16 + H * 8 + 3 * H * 32 + H) + LM_HEAD,
    ),
    # Every layer sparse; Mixtral's experts are intermediate_size (96) wide: 2 of 4 and the 64 x 4 router.
    "mixtral": (
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        2 * MOE_ATTENTION + 2 * (2 * 3 * H * INTER + H * 4) + LM_HEAD,
    ),
    # Latent attention (queries through rank 32, keys and values through rank 16; query-key dims 16 + 8 rotary,
    # values 12) and first_k_dense_replace 1: layer 0 dense, layers 1 and 2 with 2 of 8 experts of 16, one shared
    # expert of 16 and the router.
    "deepseek_v3": (
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": HEADS,
            "head_dim": 8,  # DeepSeek's config keeps the rotary width here
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 12,
        },
        3 * (H * 32 + 32 * HEADS * 24 + H * (16 + 8) + 16 * HEADS * (16 + 12) + HEADS * 12 * H)
        + DENSE_MLP
        + 2 * (2 * 3 * H * 16 + H * 8 + 3 * H * 16)
        + LM_HEAD,
    ),
}


def moe_config(model_type: str):
    fields, _ = MOE_CASES[model_type]
    return AutoConfig.for_model(model_type, **{**TINY, "head_dim": 16, **fields})


@pytest.mark.parametrize("model_type", list(MOE_CASES))
def test_moe_weights_by_arithmetic(model_type):
    config = moe_config(model_type)
    _, expected = MOE_CASES[model_type]
    assert matmul_params(config) == expected
    layers = config.num_hidden_layers
    # Attention of the latent kind: 4 heads x (24 query-key + 12 value) in 6 x (...) per layer; else 12 x 4 x 16.
    c = 6 * layers * HEADS * (24 + 12) if model_type == "deepseek_v3" else 12 * layers * H
    assert flops_per_token(config, 32) == 6 * expected + c * 32


@pytest.mark.parametrize("model_type", list(MOE_CASES))
def test_moe_models_match_the_flop_counter(model_type):
    # The counter charges each expert's matmuls on the tokens routed to it: k per token whatever the routing.
    config = moe_config(model_type)
    seq_len, rows = 32, 2
    total, attention = counted(config, [seq_len] * rows)
    tokens = seq_len * rows
    assert matmul_flops_per_token(config) * tokens == pytest.approx(total - attention, rel=0.02)
    assert flops_per_token(config, seq_len) * tokens == pytest.approx(total, rel=0.02)


def test_an_unrecognised_expert_layout_counts_as_dense():
    # Experts without a top-k: not a layout the formula knows, so the config's dense MLP is counted.
    config = AutoConfig.for_model("qwen3_moe", **{**TINY, "head_dim": 16, "num_hidden_layers": 3, **MOE_FIELDS})
    assert matmul_params(config) == 3 * MOE_ATTENTION + 3 * (2 * 3 * H * 16 + H * 8) + LM_HEAD
    config.num_experts_per_tok = 0
    assert matmul_params(config) == 3 * (MOE_ATTENTION + DENSE_MLP) + LM_HEAD


@pytest.mark.parametrize(
    ("config", "published"),
    [
        # Mixtral-8x7B: "12.9B active parameters" (of 46.7B).
        pytest.param(
            MixtralConfig(
                hidden_size=4096,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                intermediate_size=14336,
                vocab_size=32000,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
            12.9e9,
            id="mixtral-8x7b",
        ),
        # Qwen1.5-MoE-A2.7B (Qwen2-MoE): 2.7B activated; 4 of 60 experts and a shared expert of 5632.
        pytest.param(
            Qwen2MoeConfig(
                hidden_size=2048,
                num_hidden_layers=24,
                num_attention_heads=16,
                num_key_value_heads=16,
                intermediate_size=5632,
                moe_intermediate_size=1408,
                shared_expert_intermediate_size=5632,
                num_experts=60,
                num_experts_per_tok=4,
                vocab_size=151936,
            ),
            2.7e9,
            id="qwen1.5-moe-a2.7b",
        ),
        # DeepSeek-V3: 37B activated of 671B; 3 dense layers, then 8 of 256 experts and one shared.
        pytest.param(
            DeepseekV3Config(
                hidden_size=7168,
                num_hidden_layers=61,
                num_attention_heads=128,
                num_key_value_heads=128,
                intermediate_size=18432,
                moe_intermediate_size=2048,
                n_routed_experts=256,
                num_experts_per_tok=8,
                n_shared_experts=1,
                first_k_dense_replace=3,
                q_lora_rank=1536,
                kv_lora_rank=512,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                vocab_size=129280,
            ),
            37e9,
            id="deepseek-v3",
        ),
    ],
)
def test_published_active_sizes(config, published):
    # Published active sizes include the input embedding, which does no matmul and is not in matmul_params.
    embedding = config.vocab_size * config.hidden_size
    assert matmul_params(config) + embedding == pytest.approx(published, rel=0.02)


@pytest.mark.parametrize("model_type", ["gemma2", "mistral"])
def test_sliding_windows_charge_what_the_window_reaches(model_type):
    # Gemma 2 alternates a local layer (window 16 here) with a global one; Mistral windows every layer.
    config = AutoConfig.for_model(model_type, **TINY, sliding_window=16)
    windowed = 2 if model_type == "mistral" else 1
    per_layer = 12 * HEADS * HEAD_DIM
    n = 2 * (ATTENTION + DENSE_MLP) + LM_HEAD
    assert attention_flops_coefficient(config) == 2 * per_layer  # every layer as full attention
    # 10 tokens fit the window: the full square; 40 do not: 40² less the (40 - 16)² no query reaches.
    assert documents_flops(config, [10]) == 6 * n * 10 + 2 * per_layer * 10**2
    full, reach = 40**2, 40**2 - (40 - 16) ** 2
    expected = 6 * n * 40 + per_layer * ((2 - windowed) * full + windowed * reach)
    assert documents_flops(config, [40]) == expected
    assert flops_per_token(config, 40) * 40 == pytest.approx(expected)


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
