"""FLOP accounting and model FLOPs utilisation (MFU), from a written formula and a table of GPU peaks.

Training FLOPs per token = 6 * N + 12 * L * H * T, where N counts the parameters that take part in matrix
multiplications (every decoder weight plus the output projection; the input embedding is a lookup), L is the
number of layers, H the hidden size and T the sequence length. The second term is the attention score and
value products (forward and backward), which 6 * N leaves out.

With LoRA the base weights are frozen: each of their products runs forward (2 N) and backward for the
activations' gradient (2 N), but no weight gradient is made; the adapters' A parameters do all three (6 A). So
4 * N + 6 * A + 12 * L * H * T. Example::

    fpt = flops_per_token(model.config, seq_len=2048)
    mfu(tokens_per_s=5_000, flops_per_token=fpt, peak_flops=peak_flops_for("NVIDIA L4", "bf16"), devices=8)
"""

from __future__ import annotations

from typing import Any

# Dense bf16 tensor-core peaks per GPU in TFLOPS (no sparsity), matched against torch.cuda.get_device_name().
# Each row names the words the device name must contain; the first row that matches wins, so the variants of a
# chip come before its plain name (CUDA calls the H100 SXM "NVIDIA H100 80GB HBM3", the others "NVIDIA H100 PCIe"
# and "NVIDIA H100 NVL"). A10G: AWS's variant of the A10, 70 TFLOPS dense bf16 as published for g5 instances.
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("B200",), 2250.0),
    (("H200", "NVL"), 835.0),
    (("H200",), 989.0),
    (("H100", "PCIE"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.0),  # SXM
    (("A100",), 312.0),
    (("L40S",), 362.0),
    (("A10G",), 70.0),
    (("L4",), 121.0),
)


def peak_flops_for(device_name: str | None, precision: str = "bf16") -> float | None:
    """Peak dense FLOP/s of one device at ``precision``, or ``None`` on CPU or for a GPU the table does not know.

    Names are matched whole-word ("NVIDIA L4" is an L4, "NVIDIA L40S" is not), so no card silently gets another
    card's peak. The table holds bf16 peaks: an fp32 run gets ``None`` (no MFU) rather than a bf16 denominator.
    """
    if not device_name or precision != "bf16":
        return None
    words = set(device_name.upper().replace("-", " ").split())
    for keys, tflops in PEAK_BF16_TFLOPS:
        if words.issuperset(keys):
            return tflops * 1e12
    return None


def matmul_params(config: Any) -> int:
    """Parameters in matrix multiplications of a Llama/Qwen2-style decoder, from its Hugging Face config."""
    h = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    attention = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    mlp = 3 * h * inter  # gate, up and down projections
    lm_head = config.vocab_size * h
    return layers * (attention + mlp) + lm_head


def flops_per_token(config: Any, seq_len: int, *, adapters: int = 0) -> float:
    """Training FLOPs per token: 6 * N + 12 * L * H * T; with ``adapters`` (LoRA's trainable parameters, the base
    frozen) 4 * N + 6 * adapters + 12 * L * H * T (see the module docstring)."""
    attention = 12.0 * config.num_hidden_layers * config.hidden_size * seq_len
    if adapters:
        return 4.0 * matmul_params(config) + 6.0 * adapters + attention
    return 6.0 * matmul_params(config) + attention


def mfu(*, tokens_per_s: float, flops_per_token: float, peak_flops: float | None, devices: int) -> float | None:
    """Achieved FLOP/s over the peak of all devices; ``None`` when the peak is unknown (CPU)."""
    if peak_flops is None or devices <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * devices)
