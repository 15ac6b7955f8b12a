"""FLOP accounting and model FLOPs utilisation (MFU), from a written formula and a table of GPU peaks.

Training FLOPs of one document of n tokens = 6 * N * n + c * n * n.

N counts the weights each token's matrix multiplications use, read from the model's Hugging Face config: the
attention projections (``num_attention_heads * head_dim`` wide for queries and outputs, ``num_key_value_heads *
head_dim`` for keys and values; DeepSeek's latent attention by its low-rank projections), the MLP, and the output
projection (a tied one too: the input embedding is a lookup, the output a matmul). In a Mixture-of-Experts layer the
MLP is what a token runs through: its ``num_experts_per_tok`` routed experts (``moe_intermediate_size``, or
``intermediate_size`` where the experts have no size of their own, as in Mixtral), the shared experts where the
config has them (Qwen2-MoE's ``shared_expert_intermediate_size`` and its gate, DeepSeek's ``n_shared_experts``,
Granite's ``shared_intermediate_size``) and the router. Layers the config keeps dense (``mlp_only_layers``,
``decoder_sparse_step``, ``first_k_dense_replace``) count a dense MLP of ``intermediate_size``. What the formula
does not recognise is counted as a dense Llama-style decoder rather than refused: an expert count without a top-k
gives a dense MLP of ``intermediate_size``, a layer kind other than full or sliding attention (linear attention,
say) ordinary attention.

c * n * n is the attention score and value products, forward and backward, counted as a full square (the convention
of 12 * L * H * T, which c * T generalises): c = 6 * sum over layers of heads * (query-key dim + value dim), which is
12 * L * heads * head_dim for ordinary attention. Each document of a packed block attends only within itself, so
attention is charged by each document's own length, and padding is no token. A sliding-window layer (Mistral,
Gemma 2's local layers, Qwen2's windowed layers) charges a document longer than its window W the full square less
the part no query reaches, n * n - (n - W) ** 2; ``documents_flops`` and ``flops_per_token`` do so, while
``attention_flops_coefficient`` is the full-attention c, exact for documents no longer than any window.

With LoRA the base weights are frozen: each of their products runs forward (2 N) and backward for the
activations' gradient (2 N), but no weight gradient is made; the adapters' A parameters do all three (6 A). So
4 * N + 6 * A per token, plus attention as above. Example::

    fpt = flops_per_token(model.config, seq_len=2048)
    mfu(tokens_per_s=5_000, flops_per_token=fpt, peak_flops=peak_flops_for("NVIDIA L4", "bf16"), devices=8)
    step_flops = documents_flops(model.config, [812, 1100, 136])  # one packed block of three documents
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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

# Where configs keep their number of routed experts: Qwen-MoE and OLMoE; Mixtral, PhiMoE, Granite and GPT-OSS;
# DeepSeek.
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


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


@dataclass(frozen=True)
class _Layout:
    """What a model's config says one token costs: the matmul weights it uses, and its attention layers grouped by
    sliding window (``None``: full attention) as (window, summed heads * (query-key dim + value dim))."""

    matmul_params: int
    attention: tuple[tuple[int | None, int], ...]


def _positive(config: PretrainedConfig, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and value > 0 else None


def _attention(config: PretrainedConfig) -> tuple[int, int]:
    """(projection weights, heads * (query-key dim + value dim)) of one attention layer."""
    h, heads = config.hidden_size, config.num_attention_heads
    kv_lora = _positive(config, "kv_lora_rank")
    if kv_lora:  # DeepSeek's multi-head latent attention: queries and keys/values through low-rank projections
        nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        qk, v = nope + rope, config.v_head_dim
        q_lora = _positive(config, "q_lora_rank")
        q = h * q_lora + q_lora * heads * qk if q_lora else h * heads * qk
        kv = h * (kv_lora + rope) + kv_lora * heads * (nope + v)
        return q + kv + heads * v * h, heads * (qk + v)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    return h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h, 2 * heads * head_dim


def _sparse_mlp(config: PretrainedConfig) -> int | None:
    """Weights a token uses in a Mixture-of-Experts MLP (routed experts, shared experts, router), or ``None`` when
    the config names no experts and top-k."""
    experts = next((n for n in (_positive(config, f) for f in _EXPERT_COUNT_FIELDS) if n), None)
    top_k = _positive(config, "num_experts_per_tok")
    if not experts or not top_k:
        return None
    h = config.hidden_size
    size = _positive(config, "moe_intermediate_size") or config.intermediate_size
    shared = 0
    if qwen_shared := _positive(config, "shared_expert_intermediate_size"):
        shared = 3 * h * qwen_shared + h  # Qwen2-MoE: one shared MLP and its one-output sigmoid gate
    elif n_shared := _positive(config, "n_shared_experts"):
        shared = 3 * h * size * n_shared  # DeepSeek: one MLP n_shared times an expert's width
    elif granite_shared := _positive(config, "shared_intermediate_size"):
        shared = 3 * h * granite_shared
    return int(top_k * 3 * h * size + h * experts + shared)  # gate, up and down of each; the router's h x experts


def _is_sparse(config: PretrainedConfig, layer: int) -> bool:
    """Whether ``layer`` of a Mixture-of-Experts config has experts, by the fields that keep some layers dense."""
    if layer in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    step = _positive(config, "decoder_sparse_step")
    if step and (layer + 1) % step:
        return False
    first_dense = _positive(config, "first_k_dense_replace")
    return not (first_dense and layer < first_dense)


def _windows(config: PretrainedConfig, layers: int) -> list[int | None]:
    """Each layer's sliding window, ``None`` for full attention. Configs with ``layer_types`` window only their
    "sliding_attention" layers (Gemma 2, Qwen2); the others apply ``sliding_window`` to every layer (Mistral)."""
    window = _positive(config, "sliding_window")
    types = getattr(config, "layer_types", None)
    if window is None or types is None:
        return [window] * layers
    return [window if i < len(types) and types[i] == "sliding_attention" else None for i in range(layers)]


def _layout(config: PretrainedConfig) -> _Layout:
    get_text_config = getattr(config, "get_text_config", None)
    config = get_text_config(decoder=True) if callable(get_text_config) else config
    h, layers = config.hidden_size, config.num_hidden_layers
    projections, width = _attention(config)
    dense_mlp = 3 * h * config.intermediate_size  # gate, up and down projections
    sparse_mlp = _sparse_mlp(config)
    params = config.vocab_size * h  # the output projection
    by_window: dict[int | None, int] = {}
    for layer, window in enumerate(_windows(config, layers)):
        mlp = sparse_mlp if sparse_mlp is not None and _is_sparse(config, layer) else dense_mlp
        params += projections + mlp
        by_window[window] = by_window.get(window, 0) + width
    return _Layout(params, tuple(by_window.items()))


def matmul_params(config: PretrainedConfig) -> int:
    """Weights one token's matrix multiplications use, from a Hugging Face config: every decoder weight and the
    output projection of a dense model; in Mixture-of-Experts layers only the routed top-k experts, the shared
    experts and the router. Example: 1.54 B for Qwen2.5-1.5B, 12.75 B for Mixtral-8x7B (46.7 B stored)."""
    return _layout(config).matmul_params


def _matmul_flops(layout: _Layout, adapters: int) -> float:
    return 4.0 * layout.matmul_params + 6.0 * adapters if adapters else 6.0 * layout.matmul_params


def _attention_flops(layout: _Layout, n: int) -> float:
    """Attention score and value FLOPs of one document of ``n`` tokens: the full square, or for a window W < n the
    full square less what no query reaches, n * n - (n - W) ** 2."""
    squares = 0
    for window, width in layout.attention:
        squares += width * (n * n if window is None or n <= window else n * n - (n - window) ** 2)
    return 6.0 * squares


def matmul_flops_per_token(config: PretrainedConfig, *, adapters: int = 0) -> float:
    """Training FLOPs per token of everything but the attention score and value products: 6 * N, or with
    ``adapters`` (LoRA's trainable parameters, the base frozen) 4 * N + 6 * adapters."""
    return _matmul_flops(_layout(config), adapters)


def attention_flops_coefficient(config: PretrainedConfig) -> float:
    """c such that a document of n tokens costs c * n * n in the attention score and value products, forward and
    backward, as a full square: 12 * layers * heads * head_dim for ordinary attention.

    It counts every layer as full attention, which is exact for documents no longer than the model's sliding
    window (every document, for a model without one); ``documents_flops`` charges windowed layers less beyond it.
    """
    return 6.0 * sum(width for _, width in _layout(config).attention)


def documents_flops(config: PretrainedConfig, lengths: Iterable[int], *, adapters: int = 0) -> float:
    """Training FLOPs of documents of these token counts, each attending only within itself (the rows of a packed
    block, padding left out): the sum of ``matmul_flops_per_token * n`` and each document's attention,
    ``attention_flops_coefficient * n * n`` where no sliding window cuts it short.

    Example: ``documents_flops(config, [812, 1100, 136])`` for one packed block of 2048 tokens.
    """
    layout = _layout(config)
    per_token = _matmul_flops(layout, adapters)
    return sum((per_token * n + _attention_flops(layout, n) for n in map(int, lengths)), 0.0)


def flops_per_token(config: PretrainedConfig, seq_len: int, *, adapters: int = 0) -> float:
    """Training FLOPs per token of sequences of ``seq_len`` tokens that attend across their whole length:
    ``matmul_flops_per_token + attention_flops_coefficient * seq_len`` (less, beyond a sliding window)."""
    layout = _layout(config)
    attention = _attention_flops(layout, seq_len) / seq_len if seq_len > 0 else 0.0
    return _matmul_flops(layout, adapters) + attention


def mfu(*, tokens_per_s: float, flops_per_token: float, peak_flops: float | None, devices: int) -> float | None:
    """Achieved FLOP/s over the peak of all devices; ``None`` when the peak is unknown (CPU)."""
    if peak_flops is None or devices <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * devices)


# Steps measured on one GPU, by (GPU model, model, seq_len, micro-batch, decoder layers compiled, loss kernel): tokens/s
# and MFU of the job's wrapping (FSDP2 over one rank, bf16). benchmarks/results/2026-12-04-h200/gpu_step.json
# (bench_gpu_step.py: the Qwen2.5-1.5B architecture, random weights, 30 steps after 8 warm-up, torch 2.11 + CUDA 13):
# its settings fsdp, fsdp+chunk, fsdp+compile and fsdp+compile+chunk.
MEASURED_STEPS: dict[tuple[str, str, int, int, bool, str], tuple[float, float]] = {
    ("H200", "Qwen/Qwen2.5-1.5B", 2048, 4, False, "plain"): (33287.9, 0.347),
    ("H200", "Qwen/Qwen2.5-1.5B", 2048, 4, False, "chunked"): (26894.4, 0.281),
    ("H200", "Qwen/Qwen2.5-1.5B", 2048, 4, True, "plain"): (38545.4, 0.402),
    ("H200", "Qwen/Qwen2.5-1.5B", 2048, 4, True, "chunked"): (33665.5, 0.351),
}
MEASURED_IN = "benchmarks/results/2026-12-04-h200"


def predicted_step(gpu: str, model_id: str, seq_len: int, micro_batch: int, *, compiled: bool, loss_kernel: str) -> str:
    """A plan's line on the step's speed per GPU: a prediction only where a step of the same GPU model, model, sequence,
    micro-batch, compiling and loss kernel was measured (:data:`MEASURED_STEPS`), said as one; otherwise that there is
    none, rather than a figure carried over from another card or setting. Example:
    ``predicted_step("H200", "Qwen/Qwen2.5-1.5B", 2048, 4, compiled=True, loss_kernel="plain")``."""
    measured = MEASURED_STEPS.get((gpu, model_id, seq_len, micro_batch, compiled, loss_kernel))
    setting = f"{model_id}, {micro_batch} x {seq_len}, {'compiled' if compiled else 'eager'}, {loss_kernel} loss"
    if measured is None:
        return f"speed: no prediction (no step measured on {gpu} for {setting})"
    tokens, share = measured
    return (
        f"speed: predicted about {tokens:,.0f} tokens/s and {share:.1%} MFU per {gpu} (measured on one {gpu} for "
        f"{setting}: {MEASURED_IN}; the reduction across GPUs is not in it)"
    )
