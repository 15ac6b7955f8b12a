"""How much GPU memory one training worker needs, known before any node is paid for.

The estimate follows what the job keeps on each device, phase by phase, with the sharding it applies
(:mod:`raytrain_eks.train.sharding`): fp32 master weights, AdamW's two fp32 moments and fp32 gradients, each split
over the ranks that shard them (all ranks with FSDP, the ranks of one node with HSDP; one fp32 rank has no wrapper);
the root module (embedding, output projection, final norm) and decoder layers gathered in the compute dtype; the
activations of every layer (only each layer's input with activation checkpointing, plus one layer's worth while it
is recomputed); the chunked loss's logits and the output projection's fp32 gradient sum
(:func:`loss_bytes`); and at the end of backward the root's unsharded gradient with its fp32 reduce-scatter buffer.
The peak is the largest of the moments that dominate: the loss's backward with every activation alive, a
checkpointed layer's backward, and the root's gradient reduction. It is checked in the tests against torch's FSDP2
memory tracker following a real training step of the job's own code on CPU (fake tensors, a fake process group),
within 15%. Example::

    shape = model_shape("Qwen/Qwen2.5-1.5B")
    est = estimate(shape, shard_ranks=8, precision="bf16", micro_batch=1, seq_len=2048,
                   activation_checkpointing=False, grad_accum_steps=1)
    est.peak_gib, est.parts   # the per-GPU peak and what it is made of
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from raytrain_eks.errors import UserError
from raytrain_eks.train.flops import predicted_step

if TYPE_CHECKING:  # the settings' type only: the job ships this module, which imports nothing of them at run time
    from raytrain_eks.config import Config
    from raytrain_eks.train.sharding import Layout


class NodeGpu(Protocol):
    """What the estimate reads of the GPU nodes: each GPU's memory and model, and a name for the messages (an
    ``InstanceType`` of the EKS table, or what GPU feature discovery's labels say on another cluster)."""

    @property
    def name(self) -> str: ...

    @property
    def gpu_mib(self) -> int: ...

    @property
    def gpu_model(self) -> str | None: ...


# Logits of one chunk of the loss (raytrain_eks.train.model.chunked_cross_entropy's max_logits).
LOSS_CHUNK_LOGITS = 2**26
# The largest piece of the output projection's gradient the chunked loss's backward computes at once (elements).
GRAD_PIECE_ELEMENTS = 2**24
GIB = 2**30
MIB = 2**20
# What a GPU must hold beyond the tensors the estimate counts; a run is admitted when the estimate's peak, times the
# allocator's margin, plus the fixed terms, fits the GPU's memory (check_fit).
# PyTorch's caching allocator reserves more than it allocates (blocks split and cached per size). Measured on one H200
# for the Qwen2.5-1.5B architecture at 2 x 2048: 37.63 GiB reserved for 30.38 GiB allocated at the peak
# (benchmarks/results/2026-12-04-h200/figures.md), before the job's workers set expandable_segments (worker_env.py's
# CUDA_ALLOC_CONF), which PyTorch's CUDA semantics notes introduce to cut that fragmentation: an upper bound, until
# benchmarks/gpu_check.py measures the margin with them.
RESERVED_PER_ALLOCATED = 1.24
# The CUDA context (the loaded kernels, the driver's state): NVIDIA documents no size; lazy loading
# (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2; CUDA C++ Programming Guide, "Lazy Loading") loads only the
# kernels used. An assumption of 1 GiB on every GPU, outside torch's reserved memory, until gpu_check measures it per
# GPU model (CUDA_CONTEXT_MEASURED, by the words of the device's name).
CUDA_CONTEXT_BYTES = GIB
CUDA_CONTEXT_MEASURED: dict[str, int] = {}
# NCCL's buffers: NCCL_BUFFSIZE, 4 MiB by default (NCCL's documentation, "Environment Variables"), for each channel
# and each of a ring's two peers, per communicator; at most NCCL_MAX_NCHANNELS channels, 32 (the same documentation),
# so an upper bound. FSDP uses one communicator; HSDP three (the world's, the shard group's, the replicate group's).
NCCL_BUFFSIZE = 4 * MIB
NCCL_CHANNELS = 32
NCCL_PEERS = 2
# cuBLAS workspaces, by GPU architecture: the cuBLAS API reference (cublasSetWorkspace) recommends 32 MiB on Hopper
# and later, 4 MiB before. PyTorch gives each (handle, stream) a cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG, default
# ":4096:8" = 32 MiB on Hopper, ":4096:2:16:8" = 8.125 MiB before) and a cuBLASLt one (CUBLASLT_WORKSPACE_SIZE:
# 32 MiB on Hopper, at most 4 MiB before; pytorch/pytorch#120925).
CUBLAS_WORKSPACE_BYTES = {"hopper": 64 * MIB, "earlier": 12 * MIB + 128 * 2**10}
HOPPER_OR_LATER = frozenset({"H100", "H200", "H20", "GH200", "B100", "B200", "GB200", "B300"})

# Shapes of models a plan may name without their config on this machine (their public config.json files).
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-1.5B": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
    },
    "Qwen/Qwen2.5-0.5B": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-3B": {
        "model_type": "qwen2",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its parameter counts (the decoder layers' and the rest, the root) and
    the widths its activations have."""

    name: str
    layers: int
    layer_params: int
    root_params: int
    hidden: int
    intermediate: int
    kv_dim: int
    vocab: int
    heads: int  # the attention's query heads: eager attention keeps a seq x seq matrix of each
    linear: tuple[str, ...] = ()  # the linear layers of a decoder block, as LoRA's target_modules names them
    default_attention: str = "sdpa"  # transformers' choice for the model when none is given: sdpa, or eager
    flash: bool = False  # transformers has a flash-attention path for it (its class's _supports_flash_attn)

    @property
    def params(self) -> int:
        return self.root_params + self.layers * self.layer_params


# The shapes of models a plan may name without their files on this machine: counted from their public config.json
# (KNOWN_CONFIGS) by shape_from_config, which the tests repeat; kept as numbers so a plan needs no transformers.
_QWEN2_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KNOWN_SHAPES: dict[str, ModelShape] = {
    "Qwen/Qwen2.5-1.5B": ModelShape(
        "Qwen/Qwen2.5-1.5B", 28, 46797824, 233375232, 1536, 8960, 256, 151936, 12, _QWEN2_LINEAR, flash=True
    ),
    "Qwen/Qwen2.5-0.5B": ModelShape(
        "Qwen/Qwen2.5-0.5B", 24, 14912384, 136135552, 896, 4864, 128, 151936, 14, _QWEN2_LINEAR, flash=True
    ),
    "Qwen/Qwen2.5-3B": ModelShape(
        "Qwen/Qwen2.5-3B", 36, 77076992, 311166976, 2048, 11008, 256, 151936, 16, _QWEN2_LINEAR, flash=True
    ),
}


def shape_from_config(name: str, config: Any) -> ModelShape:
    """A model's shape from its transformers config: the parameters are counted on a model built on the meta
    device (no memory), so any architecture transformers knows is counted exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    from raytrain_eks.train.lora import linear_layers
    from raytrain_eks.train.sharding import decoder_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = decoder_layers(model)
    total = sum(p.numel() for p in model.parameters())
    layer_params = sum(p.numel() for p in layers[0].parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    return ModelShape(
        name=name,
        layers=len(layers),
        layer_params=layer_params,
        root_params=total - len(layers) * layer_params,
        hidden=text.hidden_size,
        intermediate=intermediate,
        kv_dim=kv_heads * head_dim,
        vocab=text.vocab_size,
        heads=heads,
        linear=tuple(linear_layers(model)),
        # transformers' own choice, made as it built the model: sdpa, or eager for a model without sdpa
        default_attention=getattr(model.config, "_attn_implementation", None) or "sdpa",
        flash=bool(getattr(type(model), "_supports_flash_attn", False)),
    )


@functools.cache
def model_shape(model_id: str) -> ModelShape | None:
    """The shape of ``model_id`` from what this machine has, with no network: the shapes above, a local folder, the
    Hugging Face cache or the built-in model; ``None`` when none of them knows it."""
    if model_id in KNOWN_SHAPES and not Path(model_id).exists():
        return KNOWN_SHAPES[model_id]
    from transformers import AutoConfig

    from raytrain_eks.train.model_source import resolve_model_path

    try:
        path = resolve_model_path(model_id) if model_id.startswith("builtin:") else model_id
        return shape_from_config(model_id, AutoConfig.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError, KeyError, AttributeError):  # not here, or a config transformers cannot build
        return None


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes: ``parts`` of the peak moment (``phase``), and the settings it was made for."""

    phase: str
    parts: dict[str, int]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def describe(self) -> str:
        """One line: the peak and its three largest parts. Example: ``memory: about 9.1 GiB per GPU at peak ...``"""
        top = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        unit, size = ("GiB", GIB) if self.peak_bytes >= GIB else ("MiB", 2**20)
        parts = ", ".join(f"{k} {v / size:.1f}" for k, v in top)
        return f"memory: about {self.peak_bytes / size:.1f} {unit} per GPU at peak ({self.phase}; {parts} {unit})"


def activation_bytes_per_token(shape: ModelShape, compute_bytes: int) -> int:
    """What one decoder layer keeps for backward per token, without checkpointing: its two norms' fp32 inputs and
    outputs, the attention's projections (queries, keys and values, after the rotary embedding too, and the keys and
    values widened to every head), its output, and the MLP's gate, up, activation and product."""
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_dim
    half = compute_bytes / 2  # the counts below are in bf16 bytes
    return int((24 * h + 8 * i + 8 * kv) * half)


# The projections LoRA targets by these names, as (inputs, outputs) of each in a model's widths (the query's
# width taken as the hidden size, as in Llama, Mistral and Qwen2); all-linear is all seven.
def _lora_widths(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_dim
    return {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _lora_targets(shape: ModelShape, lora: Any) -> list[tuple[int, int]]:
    widths = _lora_widths(shape)
    names = list(widths) if isinstance(lora.target_modules, str) else lora.target_modules
    return [widths[n] for n in names if n in widths]


def check_lora_targets(cfg: Config) -> None:
    """Before anything is created: with adapters (method lora, or dpo with adapters lora), every name of
    ``training.lora.target_modules`` is a linear layer of the model's decoder blocks, as the shape :func:`model_shape`
    knows (the one the estimate uses); a :class:`UserError` naming the model's linear layers otherwise (the job checks
    again when the shape is not known here)."""
    from raytrain_eks.train.lora import refuse_unknown_targets

    t = cfg.training
    if t.adapters is None:
        return
    shape = model_shape(t.model_id)
    if shape is not None and shape.linear:
        refuse_unknown_targets(t.lora, list(shape.linear), shape.name)


def lora_params(shape: ModelShape, lora: Any) -> int:
    """The adapters' parameters of ``lora`` (``training.lora``) on ``shape``: rank x (inputs + outputs) of each
    targeted projection, in every decoder layer (layers of other names are not counted)."""
    return shape.layers * lora.rank * sum(i + o for i, o in _lora_targets(shape, lora))


EAGER_MATRICES = "eager attention's matrices"  # the estimate's part that eager attention adds


def eager_attention_bytes(shape: ModelShape, *, micro_batch: int, seq_len: int, compute_bytes: int) -> int:
    """What eager attention keeps for backward in one layer, beyond what SDPA and flash-attention keep: the
    softmax's fp32 output over every query head's seq x seq scores, and its copy in the compute dtype (none in
    fp32), which the product with the values keeps. SDPA and flash-attention never hold the matrix."""
    cast = compute_bytes if compute_bytes < 4 else 0
    return micro_batch * shape.heads * seq_len * seq_len * (4 + cast)


def loss_bytes(
    shape: ModelShape,
    *,
    tokens: int,
    compute_bytes: int,
    loss_chunk_logits: int = LOSS_CHUNK_LOGITS,
    projection_grad: bool = True,
    kernel: str = "chunked",
) -> int:
    """What the loss holds at the height of its backward, by loss ``kernel`` (``training.loss_kernel``, resolved).

    ``chunked`` (:func:`raytrain_eks.train.model.chunked_cross_entropy`), in one chunk: the fp32 log-probabilities
    kept from forward, their fp32 gradient and its copy in the compute dtype, and the output projection's gradient.
    In several: one chunk's recomputed fp32 logits turned into their gradient in place and its copy in the compute
    dtype, the fp32 sum of the projection's gradient, and (bf16) the piece of it computed at once; or the forward's
    chunk, where that is more (a frozen projection's). ``plain``: the
    one chunk of all tokens. ``fused`` (Liger-Kernel's ``fused_linear_cross_entropy_forward``, 0.8.5): a chunk of
    logits in the compute dtype bounded by the hidden states' size (its ``chunk_size``, rounded up to a power of two:
    up to twice that), the hidden states' gradient, and the projection's gradient summed in fp32 (``accum_dtype``).
    A frozen projection (LoRA's base, ``projection_grad`` False) has no gradient."""
    cast = compute_bytes if compute_bytes < 4 else 0  # a bf16 copy of the fp32 gradient; none in fp32
    projection = shape.vocab * shape.hidden if projection_grad else 0
    if kernel == "fused":
        return 3 * tokens * shape.hidden * compute_bytes + 4 * projection
    rows = tokens if kernel == "plain" else max(1, loss_chunk_logits // shape.vocab)
    if rows >= tokens:
        return tokens * shape.vocab * (8 + cast) + compute_bytes * projection
    piece = 4 * min(projection, GRAD_PIECE_ELEMENTS) if cast else 0
    backward = rows * shape.vocab * (4 + cast) + 4 * projection + piece
    # The forward's chunk: its logits in the compute dtype, upcast, and their fp32 log-probabilities, all alive at
    # once. It is the larger where the projection takes no gradient (LoRA): with activation checkpointing, whose
    # activations are small, it is what the estimate missed (15-25% under torch's memory tracker without it).
    return max(backward, rows * shape.vocab * (8 + cast))


def estimate(
    shape: ModelShape,
    *,
    shard_ranks: int,
    precision: str,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: bool,
    grad_accum_steps: int = 1,
    loss_chunk_logits: int = LOSS_CHUNK_LOGITS,
    lora: Any = None,
    attention: str = "sdpa",
    loss_kernel: str = "chunked",
    dpo_reference: bool = False,
) -> MemoryEstimate:
    """The per-GPU peak of one worker; ``shard_ranks`` is how many ranks split each parameter. One rank in fp32
    has no wrapper (:mod:`raytrain_eks.train.sharding`): nothing gathered, nothing reduced.

    ``lora`` (``training.lora``, method lora): the base is frozen, so gradients and AdamW's moments are the
    adapters' only (:func:`lora_params`), the output projection and the root take no gradient, and each adapter
    keeps its dropped-out input (and the dropout's mask) for backward. ``attention`` (``training.attention``):
    ``eager`` keeps each layer's attention matrices (:func:`eager_attention_bytes`); the others keep none.
    ``dpo_reference`` (method dpo with ``dpo.adapters: none``): DPO's frozen copy of the start weights, sharded like
    the model in its fp32 parameters, is held all along; it has no gradient, moments or stored activations."""
    if precision not in {"bf16", "fp32"}:
        raise ValueError(f"precision must be resolved to bf16 or fp32, not {precision!r}")
    s = max(1, shard_ranks)
    wrapped = not (s == 1 and precision == "fp32")
    cdt = 2 if precision == "bf16" else 4
    p, root, layer = shape.params, shape.root_params, shape.layer_params
    tokens = micro_batch * seq_len
    adapters = lora_params(shape, lora) if lora is not None else 0
    trained = adapters if lora is not None else p  # the parameters with gradients and moments
    trained_root = 0 if lora is not None else root
    static = {"weights (fp32, sharded)": 4 * (p + adapters) // s, "AdamW moments (fp32, sharded)": 8 * trained // s}
    # DPO's reference pass runs under no_grad before the policy's forward of the same block: it keeps no activation
    # and its logits are freed before the policy's exist, so it never adds to the peaks below. With adapters the
    # reference is the model itself (adapters off): nothing more is held. A frozen copy's weights are held all along.
    if dpo_reference:
        static["DPO reference weights (fp32, sharded)"] = 4 * p // s
    earlier = {"gradients of earlier micro-batches (fp32, sharded)": 4 * trained // s} if grad_accum_steps > 1 else {}
    per_layer = activation_bytes_per_token(shape, cdt) * tokens
    if lora is not None and lora.dropout > 0:
        per_layer += sum(i for i, _ in _lora_targets(shape, lora)) * tokens * (cdt + 1)
    eager = 0
    if attention == "eager":
        eager = eager_attention_bytes(shape, micro_batch=micro_batch, seq_len=seq_len, compute_bytes=cdt)
    matrices = EAGER_MATRICES
    inputs = shape.layers * tokens * shape.hidden * cdt  # what checkpointed layers keep: their inputs
    stored = inputs if activation_checkpointing else shape.layers * per_layer
    phases: dict[str, dict[str, int]] = {}
    # The loss's backward: every stored activation alive, the root and the last layer still gathered.
    phases["the loss's backward"] = {
        **static,
        **earlier,
        **({"gathered root and a layer": cdt * (root + layer)} if wrapped else {}),
        "activations": stored,
        **({matrices: shape.layers * eager} if eager and not activation_checkpointing else {}),
        "loss": loss_bytes(
            shape,
            tokens=tokens,
            compute_bytes=cdt,
            loss_chunk_logits=loss_chunk_logits,
            projection_grad=lora is None,
            kernel=loss_kernel,
        ),
    }
    if wrapped:
        # The end of backward: the root's unsharded gradient and its fp32 reduce-scatter, every layer's done.
        phases["the root's gradient reduction"] = {
            **static,
            "layer gradients (fp32, sharded)": 4 * (trained - trained_root) // s,
            "root gradient and its reduction": (cdt + 4) * trained_root,
            "gathered root": cdt * root,
            "reduce-scatter buffer": 4 * (layer if lora is None else adapters // shape.layers),
        }
        if activation_checkpointing:
            # A layer recomputed in backward, with the next one prefetched and the root's gradient waiting.
            phases["a checkpointed layer's backward"] = {
                **static,
                **earlier,
                "gathered root and layers": cdt * (root + 2 * layer),
                "root gradient": cdt * trained_root,
                "activations": inputs + per_layer,
                # the recomputed layer's matrices, and in its backward their gradient in fp32 and the compute dtype
                **({matrices: 2 * eager} if eager else {}),
                "layer gradients (fp32, sharded)": 4 * (trained - trained_root) // s,
            }
    else:
        phases["the end of backward"] = {**static, "gradients (fp32)": 4 * trained, "activations": inputs}
    settings = {
        "model": shape.name,
        "shard_ranks": s,
        "precision": precision,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "activation_checkpointing": activation_checkpointing,
        "grad_accum_steps": grad_accum_steps,
        "method": "full" if lora is None else "lora",
        **({"dpo_reference": True} if dpo_reference else {}),
        "attention": attention,
        "loss_kernel": loss_kernel,
    }
    phase, parts = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    return MemoryEstimate(phase, parts, settings)


class DoesNotFit(UserError):
    """The estimate is over the GPU's memory even with activation checkpointing; nothing was started."""

    exit_code = 2


@dataclass(frozen=True)
class MemoryCheck:
    """The estimate against a GPU: ``fits``, whether activation checkpointing had to go on (``checkpointing``),
    and the line a run or plan says."""

    estimate: MemoryEstimate
    gpu_bytes: int
    checkpointing: bool
    switched_on: bool
    fits: bool
    line: str
    loss: str = ""  # the loss kernel the estimate counts, and why (check_training)
    batch: str = ""  # how training.batch_size auto was resolved (auto_batch); "" for a set batch
    speed: str = ""  # the predicted tokens/s and MFU, where a step was measured (flops.predicted_step)
    reserved_bytes: int = 0  # what the GPU must hold: the peak with the allocator's margin and the fixed terms

    def to_dict(self) -> dict[str, Any]:
        """For plan.json: the peak and its parts in GiB, the GPU, and whether checkpointing was switched on."""
        est = self.estimate
        return {
            "peak_gib": round(est.peak_gib, 2),
            "phase": est.phase,
            "parts_gib": {k: round(v / GIB, 3) for k, v in est.parts.items()},
            "gpu_gib": round(self.gpu_bytes / GIB, 1),
            "reserved_gib": round(self.reserved_bytes / GIB, 2),
            "reserved_per_allocated": RESERVED_PER_ALLOCATED,
            "activation_checkpointing": self.checkpointing,
            "activation_checkpointing_switched_on": self.switched_on,
            "settings": est.settings,
            "line": self.line,
            "loss_kernel_line": self.loss,
            "batch_line": self.batch,
            "speed_line": self.speed,
        }


def fixed_bytes(gpu_name: str, communicators: int) -> dict[str, int]:
    """What a worker's GPU holds besides its tensors (:data:`CUDA_CONTEXT_BYTES`, :data:`NCCL_BUFFSIZE`,
    :data:`CUBLAS_WORKSPACE_BYTES`), for a GPU named ``gpu_name`` and a sharding with ``communicators`` NCCL
    communicators (:func:`layout_communicators`)."""
    words = set(gpu_name.upper().replace("-", " ").split())
    context = next((v for k, v in CUDA_CONTEXT_MEASURED.items() if k in words), CUDA_CONTEXT_BYTES)
    cublas = CUBLAS_WORKSPACE_BYTES["hopper" if words & HOPPER_OR_LATER else "earlier"]
    nccl = communicators * NCCL_CHANNELS * NCCL_PEERS * NCCL_BUFFSIZE
    return {"CUDA context": context, "NCCL buffers": nccl, "cuBLAS workspace": cublas}


def _reserved(est: MemoryEstimate, fixed: dict[str, int]) -> int:
    return int(est.peak_bytes * RESERVED_PER_ALLOCATED) + sum(fixed.values())


def _terms(reserved: int, fixed: dict[str, int]) -> str:
    named = ", ".join(f"{name} {size / GIB:.2f}" for name, size in fixed.items() if size)
    return f"{reserved / GIB:.1f} GiB reserved (the peak x {RESERVED_PER_ALLOCATED} for the allocator; {named} GiB)"


def check_fit(
    shape: ModelShape,
    *,
    gpu_bytes: int,
    gpu_name: str,
    shard_ranks: int,
    precision: str,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: bool,
    grad_accum_steps: int = 1,
    lora: Any = None,
    attention: str = "sdpa",
    loss_kernel: str = "chunked",
    communicators: int = 0,
    dpo_reference: bool = False,
) -> MemoryCheck:
    """The estimate against ``gpu_bytes``, judged on what the GPU must hold: the peak times
    :data:`RESERVED_PER_ALLOCATED`, plus :func:`fixed_bytes` (``communicators``: NCCL's). Over the GPU, activation
    checkpointing goes on; if that is not enough, ``fits`` is False and ``line`` names the numbers and the terms."""
    common = dict(shard_ranks=shard_ranks, precision=precision, micro_batch=micro_batch, seq_len=seq_len, lora=lora,
                  attention=attention, loss_kernel=loss_kernel, dpo_reference=dpo_reference)  # fmt: skip
    est = estimate(
        shape, activation_checkpointing=activation_checkpointing, grad_accum_steps=grad_accum_steps, **common
    )
    fixed = fixed_bytes(gpu_name, communicators)
    gpu = f"{gpu_bytes / GIB:.1f} GiB {gpu_name}"
    held = _reserved(est, fixed)
    if held <= gpu_bytes:
        line = f"{est.describe()}; {held / GIB:.1f} GiB reserved with the allocator and fixed terms, of {gpu}"
        return MemoryCheck(est, gpu_bytes, activation_checkpointing, False, True, line, reserved_bytes=held)
    if not activation_checkpointing:
        on = estimate(shape, activation_checkpointing=True, grad_accum_steps=grad_accum_steps, **common)
        if _reserved(on, fixed) <= gpu_bytes:
            line = (
                f"{on.describe()}; {_reserved(on, fixed) / GIB:.1f} GiB reserved with the allocator and fixed terms, "
                f"of {gpu}: activation checkpointing switched on (without it {_terms(held, fixed)}, over the GPU)"
            )
            return MemoryCheck(on, gpu_bytes, True, True, True, line, reserved_bytes=_reserved(on, fixed))
        est, held = on, _reserved(on, fixed)
    line = f"{est.describe()}: {_terms(held, fixed)}, over the {gpu} even with activation checkpointing"
    return MemoryCheck(est, gpu_bytes, True, not activation_checkpointing, False, line, reserved_bytes=held)


def refuse_unless_fits(check: MemoryCheck) -> None:
    """Raise the one message (:class:`DoesNotFit`, exit 2) for an estimate that does not fit."""
    if check.fits:
        return
    s = check.estimate.settings
    matrices = check.estimate.parts.get(EAGER_MATRICES)
    raise DoesNotFit(
        f"{s['model']} does not fit: {check.line}",
        hint=(
            f"Lower training.batch_size ({s['micro_batch']}) or training.seq_len ({s['seq_len']}), shard over more "
            "GPUs (more nodes, or training.sharding: fsdp across them), or pick a GPU with more memory."
            + (
                f" Eager attention keeps {matrices / GIB:.1f} GiB of attention matrices here; flash-attention keeps "
                "none: training.attention flash_attention_2 (or auto) in bf16, on an image with flash-attn, for a "
                "model transformers runs with it."
                + (" This run computes in fp32 (training.precision)." if s["precision"] == "fp32" else "")
                if matrices
                else ""
            )
        ),
    )


def layout_shard_ranks(layout: Any) -> int:
    """How many ranks split each parameter under a sharding :class:`~raytrain_eks.train.sharding.Layout`."""
    if layout.mode == "hsdp":
        return layout.mesh_shape[1]
    return layout.world_size if layout.mode == "fsdp" else 1


def layout_communicators(layout: Any) -> int:
    """The NCCL communicators a worker holds buffers for under a sharding
    :class:`~raytrain_eks.train.sharding.Layout`: three under HSDP, one for FSDP over several ranks, none alone."""
    if layout.mode == "hsdp":
        return 3
    return 1 if layout.mode == "fsdp" and layout.world_size > 1 else 0


def planned_precision(training: Any) -> str:
    """The compute precision of a GPU run of ``training``: bf16 unless it says fp32 (every GPU type this tool deploys
    has bf16)."""
    return "fp32" if training.precision == "fp32" else "bf16"


def planned_layout(cfg: Config) -> Layout:
    """The sharding :class:`~raytrain_eks.train.sharding.Layout` of a GPU run of ``cfg``, as the job's
    :func:`~raytrain_eks.train.sharding.choose_sharding` will choose it: ``training.sharding`` for the run's ranks
    placed ``derived.workers_per_node`` to a GPU node, in :func:`planned_precision`. Example: the reference (2 nodes
    x 4 GPUs, ``auto``) is ``hsdp`` with mesh shape ``(2, 4)``."""
    from raytrain_eks.train.sharding import choose_sharding

    d = cfg.derived
    per_node = max(1, d.workers_per_node)
    node_of_rank = [f"node-{rank // per_node}" for rank in range(d.world_size)]
    return choose_sharding(cfg.training.sharding, node_of_rank, planned_precision(cfg.training))


def check_training(
    shape: ModelShape,
    training: Any,
    *,
    shard_ranks: int,
    precision: str,
    gpu_bytes: int,
    gpu_name: str,
    attention: str | None = None,
    loss_kernel: str | None = None,
    communicators: int = 0,
) -> MemoryCheck:
    """:func:`check_fit` with the batch, sequence, accumulation, checkpointing and attention of ``training``.
    ``attention``: the implementation the run chose (a GPU run's start knows it), or the one a plan expects
    (:func:`planned_attention`); else ``training.attention``, where ``auto`` counts as the model's default (eager for
    a model without sdpa, such as Gemma 2). ``loss_kernel``: the one the run chose, else ``training.loss_kernel``;
    ``auto`` is plain where the full logits fit (:func:`logits_fit`), else chunked; the workers may pick fused, which
    holds less than either (:func:`loss_bytes`)."""
    if attention is None:
        attention = shape.default_attention if training.attention == "auto" else training.attention

    def fit(kernel: str) -> MemoryCheck:
        return check_fit(
            shape,
            gpu_bytes=gpu_bytes,
            gpu_name=gpu_name,
            shard_ranks=shard_ranks,
            precision=precision,
            micro_batch=training.micro_batch,
            seq_len=training.seq_len,
            activation_checkpointing=training.activation_checkpointing,
            grad_accum_steps=training.grad_accum_steps,
            lora=training.adapters,
            attention=attention,
            loss_kernel=kernel,
            communicators=communicators,
            dpo_reference=training.preference and training.adapters is None,
        )

    if training.preference:  # DPO sums each response's log-probabilities from the whole logits, whatever the kernel
        return replace(fit("plain"), loss="loss kernel: plain (method dpo scores each response from the full logits)")
    requested = loss_kernel or training.loss_kernel
    if requested != "auto":
        return replace(fit(requested), loss=f"loss kernel: {requested} (as configured)")
    chunked, plain = fit("chunked"), fit("plain")
    fits = logits_fit(plain, chunked)
    why = "fit" if fits else "do not fit"
    line = (
        f"loss kernel: {'plain' if fits else 'chunked'} (auto: the full logits {why} the memory estimate; fused "
        "instead where the GPU's image has Liger-Kernel or cut-cross-entropy and the model's logits allow it, as "
        "the workers decide)"
    )
    return replace(plain if fits else chunked, loss=line)


def logits_fit(plain: MemoryCheck, chunked: MemoryCheck) -> bool:
    """Whether the full logits fit the GPU: the estimate with the plain loss is admitted, and with no more activation
    checkpointing than the chunked loss's (a recomputed layer costs more than the chunks do)."""
    return plain.fits and plain.checkpointing <= chunked.checkpointing


def check_run(
    model_path: str,
    training: Any,
    *,
    layout: Any,
    precision: str,
    gpu_bytes: int,
    gpu_name: str,
    attention: str | None = None,
    loss_kernel: str | None = None,
) -> MemoryCheck:
    """At a run's start on a GPU: the estimate of ``training`` with the model at ``model_path`` (its config only)
    and the ``attention`` the ranks agreed on, against the device's own memory; ``loss_kernel`` as for
    :func:`check_training`."""
    from transformers import AutoConfig

    shape = shape_from_config(training.model_id, AutoConfig.from_pretrained(model_path))
    return check_training(
        shape,
        training,
        shard_ranks=layout_shard_ranks(layout),
        precision=precision,
        gpu_bytes=gpu_bytes,
        gpu_name=gpu_name,
        attention=attention,
        loss_kernel=loss_kernel,
        communicators=layout_communicators(layout),
    )


def planned_attention(shape: ModelShape, training: Any, precision: str, *, image_flash: bool) -> str:
    """The attention a GPU run of ``training`` will build the model with, as far as it is known before the run:
    ``auto`` is flash-attention in bf16 for a model that has it on an image that ships flash-attn (``image_flash``),
    as the job decides it on CUDA (train/model.py's choose_attention); else the model's default; other settings as
    given. Example: Gemma 2 under ``auto`` on the default image is ``flash_attention_2``, on an unknown image
    ``eager``."""
    if training.attention != "auto":
        return training.attention
    if image_flash and shape.flash and precision == "bf16":
        return "flash_attention_2"
    return shape.default_attention


def check_config(cfg: Config, gpu: NodeGpu, *, image_flash: bool = False) -> MemoryCheck | None:
    """The estimate of ``cfg``'s training on ``gpu`` (an :class:`~raytrain_eks.instances.InstanceType`): bf16 unless
    the config says fp32 (every GPU type this tool deploys has bf16), with the attention of
    :func:`planned_attention` (``image_flash``: ``cfg.ray.image`` ships flash-attn). ``None`` when the model's shape
    is not known on this machine (see :func:`model_shape`)."""
    t = cfg.training
    shape = model_shape(t.model_id)
    if shape is None or not gpu.gpu_mib:
        return None
    precision = planned_precision(t)
    layout = planned_layout(cfg)
    return check_training(
        shape,
        t,
        shard_ranks=layout_shard_ranks(layout),
        precision=precision,
        gpu_bytes=gpu.gpu_mib * 2**20,
        gpu_name=gpu.gpu_model or gpu.name,
        attention=planned_attention(shape, t, precision, image_flash=image_flash),
        communicators=layout_communicators(layout),
    )


def fit_config(cfg: Config, gpu: NodeGpu, *, image_flash: bool = False) -> tuple[Config, MemoryCheck | None]:
    """``cfg`` checked against ``gpu``'s memory before anything is created: raises :class:`DoesNotFit` when it
    cannot fit, and returns the config with activation checkpointing switched on when that makes it fit, and
    ``training.batch_size: auto`` resolved (:func:`auto_batch`). LoRA layers the model does not have are refused first
    (:func:`check_lora_targets`). ``image_flash``: as for :func:`check_config`."""
    check_lora_targets(cfg)
    cfg, batch = auto_batch(cfg, gpu, image_flash=image_flash)
    check = check_config(cfg, gpu, image_flash=image_flash)
    if check is None:
        return cfg, None
    refuse_unless_fits(check)
    if check.switched_on:
        training = cfg.training.model_copy(update={"activation_checkpointing": True})
        cfg = cfg.model_copy(update={"training": training})
    t = cfg.training
    speed = predicted_step(
        gpu.gpu_model or gpu.name,
        t.model_id,
        t.seq_len,
        t.micro_batch,
        compiled=t.compile != "off",  # auto compiles on CUDA
        loss_kernel=check.estimate.settings["loss_kernel"],
    )
    return cfg, replace(check, batch=batch, speed=speed)


def auto_batch(cfg: Config, gpu: NodeGpu, *, image_flash: bool = False) -> tuple[Config, str]:
    """``cfg`` with ``training.batch_size: auto`` resolved for ``gpu``, and the line that says how (``""`` for a set
    batch). A step trains ``2 x grad_accum_steps`` samples per worker (the default batch's, or as many micro-batches of
    it as asked for); auto takes the largest micro-batch up to that which the estimate admits without switching
    activation checkpointing on (one that divides the step's samples where that keeps three quarters of it), and as
    many accumulation steps as keep that number, saying so where it cannot be kept exactly. Example: Qwen2.5-1.5B at
    seq 2048 with ``grad_accum_steps: 16`` on 4 H100s (FSDP) is 8 x 4."""
    from raytrain_eks.config import DEFAULT_BATCH_SIZE

    t = cfg.training
    if t.batch_size != "auto":
        return cfg, ""
    target = DEFAULT_BATCH_SIZE * t.grad_accum_steps

    def admitted(micro: int) -> bool:
        trial = cfg.model_copy(update={"training": t.model_copy(update={"batch_size": micro, "grad_accum_steps": 1})})
        check = check_config(trial, gpu, image_flash=image_flash)
        return check is not None and check.fits and not check.switched_on

    if model_shape(t.model_id) is None or not gpu.gpu_mib:
        micro, how = DEFAULT_BATCH_SIZE, "auto: the default, with no memory estimate for the model here"
    else:
        low, high = 1, target  # the largest admitted micro-batch, by bisection (the estimate grows with it)
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if admitted(middle) else (low, middle - 1)
        # A micro-batch that divides the step's samples keeps them exactly, at a small cost to the fill.
        whole = max(d for d in range(1, low + 1) if target % d == 0)
        micro = whole if 4 * whole >= 3 * low else low
        how = f"auto: the largest micro-batch up to {target} the memory estimate admits on {gpu.gpu_model or gpu.name}"
        if micro < low:
            how += f" ({low}) that divides {target}"
    accum = max(1, -(-target // micro))
    line = f"batch: {micro} samples per micro-batch x {accum} accumulation steps per GPU ({how})"
    if micro * accum != target:
        line += f"; a step trains {micro * accum} samples per GPU instead of {target}, which {micro} does not divide"
    training = t.model_copy(update={"batch_size": micro, "grad_accum_steps": accum})
    return cfg.model_copy(update={"training": training}), line


def unknown_shape_note(model_id: str) -> str:
    """What a plan says when it cannot estimate memory for ``model_id``."""
    return (
        f"No memory estimate: the shape of {model_id} is not known on this machine (download it once, e.g. "
        "`huggingface-cli download MODEL config.json`, or give a local folder)."
    )
