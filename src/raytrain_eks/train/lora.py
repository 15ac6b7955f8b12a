"""LoRA: low-rank adapters (the ``peft`` library's) on a frozen base model, put in before sharding.

:func:`apply_lora` injects peft's LoRA layers into the Hugging Face model in place (``inject_adapter_in_model``:
no wrapper, so sharding, the deferred output head and the checkpoints see the same model as in full fine-tuning)
and leaves only the adapters trainable. A targeted ``q_proj`` becomes a peft layer holding the original as
``q_proj.base_layer`` and the adapters as ``q_proj.lora_A.default`` / ``q_proj.lora_B.default``;
``lora_B`` starts at zero, so the adapted model starts as the base.

Checkpoints hold the adapters and their optimizer state only (never the frozen base) and, in ``hf/``, the
adapters' ``adapter_config.json``; export merges them into the base (``W + alpha / rank * B @ A``) or writes them
as a peft adapter folder (:mod:`.export`).

Example::

    targets = apply_lora(model, cfg.lora, base="Qwen/Qwen2.5-1.5B")   # ['q_proj', 'k_proj', ...]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, TypedDict

from raytrain_eks.config import LORA_ALL_LINEAR, LoraSettings
from raytrain_eks.errors import UserError

if TYPE_CHECKING:
    import torch
    from peft.tuners.lora.config import LoraConfig
    from transformers import PretrainedConfig

ADAPTER_CONFIG = "adapter_config.json"  # peft's file name, in a checkpoint's hf/ and in an adapter export
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name for the adapters' weights
ADAPTER_NAME = "default"  # peft's adapter name; it appears in the model's parameter names, not in peft's files
_LORA_PART = ".lora_"  # in the name of every adapter parameter (lora_A, lora_B)


class AdapterSettings(TypedDict):
    """What tells two runs' adapters apart for a resume: their rank and the layers they adapt, sorted."""

    r: int
    target_modules: list[str]


def linear_layers(model: torch.nn.Module) -> list[str]:
    """The names of the linear layers inside the model's decoder blocks, as peft's ``target_modules`` takes them
    (``q_proj``, ``k_proj``, ..., ``down_proj`` for Qwen2), in the order the first block holds them."""
    import torch

    from raytrain_eks.train.sharding import decoder_layers

    names: list[str] = []
    for layer in decoder_layers(model):
        for path, module in layer.named_modules():
            short = path.rsplit(".", 1)[-1]
            if isinstance(module, torch.nn.Linear) and short not in names:
                names.append(short)
    return names


def lora_targets(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """The layer names ``settings.target_modules`` picks in ``model``'s decoder blocks; raise :class:`UserError`
    naming the model's linear layers when a name matches none of them."""
    have = linear_layers(model)
    if settings.target_modules == LORA_ALL_LINEAR:
        if not have:
            raise UserError(f"model {type(model).__name__} has no linear layer in its decoder blocks for LoRA")
        return have
    refuse_unknown_targets(settings, have, type(model).__name__)
    return list(settings.target_modules)


def refuse_unknown_targets(settings: LoraSettings, have: list[str], model: str) -> None:
    """Raise :class:`UserError` naming ``have``, the linear layers of ``model``'s decoder blocks, when a name of
    ``settings.target_modules`` is none of them (``all-linear`` always matches)."""
    if settings.target_modules == LORA_ALL_LINEAR:
        return
    unknown = [name for name in settings.target_modules if name not in have]
    if unknown:
        raise UserError(
            f"training.lora.target_modules: {', '.join(repr(n) for n in unknown)} "
            f"{'matches' if len(unknown) == 1 else 'match'} no linear layer of {model}'s decoder "
            f"blocks; its linear layers are: {', '.join(have)}",
            hint=f"Name some of those, or use {LORA_ALL_LINEAR}.",
        )


def lora_config(settings: LoraSettings, targets: list[str], base: str | None = None) -> LoraConfig:
    """peft's ``LoraConfig`` for ``settings`` on the layers ``targets`` (``base`` recorded as the base model)."""
    from peft.tuners.lora.config import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # annotated int; peft scales by alpha / rank
        lora_dropout=settings.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )


def apply_lora(model: torch.nn.Module, settings: LoraSettings, *, base: str | None = None) -> list[str]:
    """Put LoRA adapters into ``model`` in place (on its device, the meta device included) and freeze everything
    else; return the targeted layer names. ``model.raytrain_lora`` keeps the ``LoraConfig`` for the checkpoints."""
    from peft import inject_adapter_in_model

    targets = lora_targets(model, settings)
    config = lora_config(settings, targets, base)
    on_meta = next(model.parameters()).is_meta
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=on_meta)
    for name, param in model.named_parameters():
        param.requires_grad_(_LORA_PART in name)
    model.raytrain_lora = config
    return targets


def lora_of(model: torch.nn.Module) -> LoraConfig | None:
    """The ``LoraConfig`` :func:`apply_lora` put into ``model``; ``None`` for full fine-tuning."""
    return getattr(model, "raytrain_lora", None)


def is_adapter(name: str) -> bool:
    """Whether a parameter (or state dict key) of an adapted model is one of the adapters."""
    return _LORA_PART in name


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of ``model``, before sharding (``parameters()`` yields a tied weight once)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def adapter_key(name: str) -> str:
    """The name peft's adapter files give a parameter of the adapted model: under ``base_model.model.``, without
    the adapter's name (``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")


def base_weight_of(adapter: str) -> str:
    """The base model's weight an adapter parameter belongs to (``...q_proj.lora_A.default.weight`` ->
    ``...q_proj.weight``), as the base model's own files name it."""
    module = adapter.split(_LORA_PART, 1)[0]
    return f"{module}.weight"


def check_lora(config: PretrainedConfig, settings: LoraSettings) -> AdapterSettings:
    """Before a run: the layers ``settings`` targets in the model of ``config`` (a Hugging Face config), from its
    module tree on the meta device (no weight read); raise :class:`UserError` as :func:`lora_targets` does.
    Returns what :func:`~raytrain_eks.train.checkpoint.check_compatible` compares (``{"r", "target_modules"}``)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # an architecture this transformers cannot build: its own words, not a traceback
        raise UserError(
            f"training.method lora: the model's architecture cannot be built to find its linear layers "
            f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})",
            hint="Use a causal LM that transformers builds (AutoModelForCausalLM), or method full.",
        ) from None
    return adapter_settings(settings.rank, lora_targets(shell, settings))


def adapter_settings(rank: int, targets: Iterable[str]) -> AdapterSettings:
    """What tells two runs' adapters apart for a resume: their rank and the layers they adapt."""
    return {"r": int(rank), "target_modules": sorted(targets)}
