"""FSDP2 sharding: ``fully_shard`` on each decoder layer, then on the root, with one mixed-precision policy.

Kept apart from model loading and the loop. On GPUs this shards over NCCL, on CPUs over gloo; the code is the
same. Example::

    apply_fsdp(model, precision="bf16")   # parameters in bf16 for compute, gradients reduced in fp32
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` for Llama/Qwen2 families)."""
    base = getattr(model, "model", None) or getattr(model, model.base_model_prefix, None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(layers)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16: compute in bf16, reduce gradients in fp32 (fp32 master weights). fp32: no casting at all.

    ``precision`` is the resolved one (train/precision.py); ``auto`` must have been decided before sharding.
    """
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp32":
        return MixedPrecisionPolicy()
    raise ValueError(f"resolved precision must be bf16 or fp32, not {precision!r}")


def apply_fsdp(model: torch.nn.Module, *, precision: str) -> torch.nn.Module:
    """Shard ``model`` in place over the default process group and return it."""
    policy = mixed_precision(precision)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed right after its backward by the root: keep them gathered.
        fully_shard(layer, mp_policy=policy, reshard_after_forward=i < len(layers) - 1)
    # The root (embedding, final norm, output projection) stays gathered after forward: the chunked loss multiplies
    # by the output projection's weight after the model's forward has returned.
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    return model
