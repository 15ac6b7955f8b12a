"""Loading the model and tokenizer: any Hugging Face causal LM by hub id or local folder, or the built-in one.

Everything goes through ``from_pretrained``; the built-in tiny model is first saved to a folder so it takes the
same path as ``Qwen/Qwen2.5-1.5B``. Example::

    path = resolve_model_path("builtin:tiny-qwen2")      # raytrain_eks.train.model_source
    model = load_model(path, activation_checkpointing=False)
    weight = output_projection_deferred(model)         # model(...).logits are now the final hidden states
    loss = chunked_cross_entropy(model(input_ids=ids).logits[:, :-1], weight(), labels[:, 1:])
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from raytrain_eks.errors import UserError
from raytrain_eks.train.memory import GRAD_PIECE_ELEMENTS


def checkpoint_activations(model: Any) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant). transformers 5.23 names this
    ``activation_checkpointing_enable``; releases before it (the 5.13 of AWS's Ray DLC) only
    ``gradient_checkpointing_enable``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_model(path: str, *, activation_checkpointing: bool) -> Any:
    """The causal LM in fp32 master weights (FSDP's policy casts for compute), ready to shard."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    if activation_checkpointing:
        checkpoint_activations(model)
    return model


def load_model_shell(path: str, *, activation_checkpointing: bool) -> Any:
    """:func:`load_model`'s module tree on the meta device: shapes, no weights, no memory. A rank that gets its
    shard of the weights from rank 0 (:func:`fill_from_rank0`) builds this instead of reading the whole model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    model.config.use_cache = False
    if activation_checkpointing:
        checkpoint_activations(model)
    return model


def fill_from_rank0(model: Any, full_state: dict[str, Any] | None, device: torch.device) -> None:
    """After sharding: every rank's shard of the weights from rank 0's ``full_state`` (the model's state dict,
    taken before sharding; ``None`` on the ranks that built :func:`load_model_shell`, which get storage on
    ``device`` here). Buffers outside the state dict (rotary frequencies) are sent whole. A collective: every
    rank of the default group calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if full_state is None:
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state or {}, options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def compile_layers(model: Any) -> int:
    """Compile each decoder layer in place with ``torch.compile`` (the inductor); returns how many were compiled.

    Called before sharding, so FSDP's gather and reduce hooks stay outside the compiled code. The layers share one
    structure, so the first forward compiles once and the others reuse it.
    """
    import warnings

    from raytrain_eks.train.sharding import decoder_layers

    # Tracing a layer whose parameters FSDP gathers reads ``.grad`` of the gathered (non-leaf) tensors, and torch
    # warns about that read although nothing depends on it; the warning would repeat for every compiled graph.
    warnings.filterwarnings(
        "ignore", message="The .grad attribute of a Tensor that is not a leaf", category=UserWarning
    )
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


# What a causal LM may do to its logits after the output projection, by the config field that says so: the chunked
# loss does the same to each chunk. Read from transformers 5.23's modeling files: Gemma 2/3 (and others)
# ``logits = tanh(logits / cap) * cap`` with ``final_logit_softcapping``; Granite ``logits / logits_scaling``;
# Cohere ``logits * logit_scale``.
KNOWN_LOGIT_FIELDS = ("final_logit_softcapping", "logits_scaling", "logit_scale")
_LOGITS_REASSIGNED = re.compile(r"^\s*logits\s*=\s*(.+)$", re.MULTILINE)


@dataclass(frozen=True)
class LogitTransform:
    """``scale`` times the projected logits, then ``cap * tanh(logits / cap)`` when ``softcap`` is set."""

    scale: float = 1.0
    softcap: float | None = None
    # (object, attribute, identity value): what turns the model's own transform off while the loss applies it.
    neutral: tuple[tuple[Any, str, Any], ...] = field(default=(), compare=False, repr=False)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def logit_transform(model: Any) -> LogitTransform | None:
    """What ``model``'s own forward does to its logits after the output projection, or ``None`` for nothing.

    The forward's source is read: every line that assigns ``logits`` again after the projection must be one of the
    known transforms (:data:`KNOWN_LOGIT_FIELDS`, read from the config), else the model is refused (a
    :class:`UserError`) rather than trained on a different objective than its own.
    """
    import inspect

    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        source = ""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    # The projection's own attribute: lm_head in most models, embed_out in GPT-NeoX before transformers renamed it.
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    projections = ["lm_head", "get_output_embeddings"]
    projections += [f"self.{name}(" for name, child in model.named_children() if head is not None and child is head]
    unknown = []
    for line in _LOGITS_REASSIGNED.findall(source):
        line = line.split("#")[0].strip()
        if line.endswith(","):  # logits=logits, a keyword of the output being built
            continue
        if any(p in line for p in projections) or line.startswith("outputs"):
            continue  # the projection itself
        if line == "torch.tanh(logits)" or any(field in line for field in KNOWN_LOGIT_FIELDS):
            continue
        if line.startswith(("logits.float()", "logits.to(")) or line == "None":
            continue
        unknown.append(line)
    if unknown:
        raise UserError(
            f"model {type(model).__name__} changes its logits after the output projection in a way the chunked loss "
            f"does not know ({'; '.join(f'logits = {u}' for u in unknown)}), so its loss would differ from the "
            "model's own",
            hint="Fine-tune a causal LM whose logits are the output projection's, or scaled or soft-capped through "
            f"one of the config fields {', '.join(KNOWN_LOGIT_FIELDS)} (Llama, Qwen, Mistral, Gemma, Granite, ...).",
        )
    scale, softcap = 1.0, None
    neutral: list[tuple[Any, str, float | None]] = []  # (object, attribute, the value that turns it off)
    if "logits_scaling" in source and getattr(config, "logits_scaling", None) not in (None, 1, 1.0):
        scale /= float(config.logits_scaling)
        neutral.append((config, "logits_scaling", 1.0))
    if "self.logit_scale" in source and getattr(model, "logit_scale", None) not in (None, 1, 1.0):
        scale *= float(model.logit_scale)
        neutral.append((model, "logit_scale", 1.0))
    if "final_logit_softcapping" in source and getattr(config, "final_logit_softcapping", None) is not None:
        softcap = float(config.final_logit_softcapping)
        neutral.append((config, "final_logit_softcapping", None))
    if not neutral:
        return None
    return LogitTransform(scale=scale, softcap=softcap, neutral=tuple(neutral))


def router_aux_loss(model: Any, outputs: Any) -> torch.Tensor | None:
    """A mixture-of-experts model's router load-balancing term as its own loss adds it: the config's
    ``router_aux_loss_coef`` times ``outputs.aux_loss``, when the config asks for it (``output_router_logits``)."""
    config = model.config
    aux = getattr(outputs, "aux_loss", None)
    if not getattr(config, "output_router_logits", False) or aux is None:
        return None
    return config.router_aux_loss_coef * aux


@dataclass(frozen=True)
class OutputHead:
    """The output projection the loss applies: called, its weight (read after each forward, since sharding swaps
    the parameter between its sharded and gathered forms); ``transform``, what the model does to the logits."""

    module: Any
    transform: LogitTransform | None

    def __call__(self) -> torch.Tensor:
        return self.module.weight

    @contextmanager
    def untransformed(self) -> Iterator[None]:
        """The model's own logit transform off (its config read at each forward), so its output is the final
        hidden states themselves; put back after, so a saved or exported config is the model's."""
        neutral = self.transform.neutral if self.transform is not None else ()
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in neutral]
        try:
            for obj, name, value in neutral:
                setattr(obj, name, value)
            yield
        finally:
            for obj, name, value in saved:
                setattr(obj, name, value)

    def forward(self, model: Any, **inputs: Any) -> Any:
        """``model(**inputs)`` with ``.logits`` the final hidden states, for the loss to project. Whether the
        rows are packed is told from the inputs (:func:`forward_inputs` passes ``position_ids`` only then), so the
        model never asks the device (:func:`packing_told_by_host`)."""
        with self.untransformed(), packing_told_by_host("position_ids" in inputs):
            return model(**inputs)


# Whether the current forward's rows are packed, as the host decided it (None: not decided; ask as transformers does).
_HOST_PACKING: ContextVar[bool | None] = ContextVar("raytrain_eks_host_packing", default=None)
_asked_device: Callable[[torch.Tensor], torch.Tensor | None] | None = None  # transformers' own finder, kept


def _packed_indices_from_host(position_ids: torch.Tensor) -> torch.Tensor | None:
    """transformers' ``find_packed_sequence_indices`` without its question to the device. The model's mask code
    calls it on every forward that has no padding mask: it numbers each token's row from the positions, then asks
    whether any batch row holds more than one (a ``bool`` of a device tensor: the host waits for every queued kernel
    on each step). Where the host has said whether the rows are packed, the answer is the same without asking: no
    packing, no row numbers (the causal fast path); packing, the row numbers."""
    packed = _HOST_PACKING.get()
    if packed is None:
        assert _asked_device is not None
        return _asked_device(position_ids)
    if not packed:
        return None
    before_first = position_ids[:, :1] - 1  # the first token starts a row
    return (torch.diff(position_ids, prepend=before_first, dim=-1) != 1).cumsum(-1)


@contextmanager
def packing_told_by_host(packed: bool) -> Iterator[None]:
    """Inside, the model's mask code takes ``packed`` (decided from host tensors) instead of asking the device
    whether the batch's rows are packed (:func:`_packed_indices_from_host`); elsewhere it asks as before."""
    global _asked_device
    from transformers import masking_utils

    # A transformers without this finder (its mask code asks nothing of the kind) is left as it is.
    if _asked_device is None and hasattr(masking_utils, "find_packed_sequence_indices"):
        _asked_device = masking_utils.find_packed_sequence_indices
        masking_utils.find_packed_sequence_indices = _packed_indices_from_host
    token = _HOST_PACKING.set(packed)
    try:
        yield
    finally:
        _HOST_PACKING.reset(token)


def forward_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's inputs for a packed batch (host tensors): ``input_ids``, and ``position_ids`` where a block holds
    more than one row (``packing: documents``), from which transformers keeps attention inside each row (a
    block-causal mask; flash-attention's variable-length path). Decided on the host, so it never waits for a device;
    a block of one row needs no positions (they count from 0 as the model's own would) and keeps the causal fast path.
    """
    inputs = {"input_ids": batch["input_ids"]}
    positions = batch.get("position_ids")
    if positions is not None and bool((positions[:, 1:] - positions[:, :-1] != 1).any()):
        inputs["position_ids"] = positions
    return inputs


def output_projection_deferred(model: Any) -> OutputHead:
    """Make ``model(...).logits`` the final hidden states, and return the :class:`OutputHead` the loss projects with.

    The loss then projects chunk by chunk (:func:`chunked_cross_entropy`) instead of the model materialising the
    full logits, and applies the model's own logit transform (:func:`logit_transform`; a model with one it does not
    know is refused here). Only the projection's ``forward`` changes: its weight, any tying to the embedding and
    the state dict (checkpoints, export) are untouched.
    """
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        what = "has no output projection" if head is None else "has a bias in its output projection"
        raise UserError(
            f"model {type(model).__name__} {what}, which the chunked loss cannot take",
            hint="Fine-tune a causal LM whose output projection (lm_head) is a plain linear layer without bias "
            "(Llama, Qwen, Mistral, GPT-2 and most others).",
        )
    transform = logit_transform(model)
    # A copy, not the view the model hands in: FSDP warns about (in-place ops on) views returned by a sharded root.
    # It costs tokens x hidden, a few thousandths of the logits it replaces.
    head.forward = lambda hidden: hidden.clone()
    return OutputHead(head, transform)


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` in fp32 for bf16 ``a`` and ``b``: on a GPU a bf16 matmul that hands over its fp32
    accumulator (``out_dtype``), so nothing is rounded to bf16 before the sum; elsewhere the operands are upcast."""
    if a.is_cuda:
        out += torch.mm(a, b, out_dtype=torch.float32)
    else:
        out.addmm_(a.float(), b.float())


class _ChunkedLoss(torch.autograd.Function):
    """The summed cross-entropy of ``hidden @ weight.T`` a chunk of ``rows`` tokens at a time, logits recomputed in
    backward. The output projection's gradient is summed over the chunks in fp32 and rounded to the weight's dtype
    once, as one projection of all tokens would round it: left to autograd, a bf16 weight's gradient would be
    rounded to bf16 after every chunk, and the training would depend on how the tokens were cut. Backward holds
    one chunk's fp32 logits (turned into their gradient in place), its bf16 copy, the fp32 sum of the projection's
    gradient and a piece of at most :data:`GRAD_PIECE_ELEMENTS` of it."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        rows: int,
        ignore: int,
        transform: LogitTransform | None,
    ):
        ctx.save_for_backward(hidden, weight, labels)
        ctx.rows, ctx.ignore, ctx.transform = rows, ignore, transform
        total = hidden.new_zeros((), dtype=torch.float32)
        for i in range(0, labels.numel(), rows):
            logits = F.linear(hidden[i : i + rows], weight).float()
            if transform is not None:
                logits = transform(logits)
            total += F.cross_entropy(logits, labels[i : i + rows], ignore_index=ignore, reduction="sum")
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # A frozen projection (LoRA's base) gets no gradient: neither its fp32 sum nor the products are made.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        piece = max(1, GRAD_PIECE_ELEMENTS // weight.size(1))
        for i in range(0, labels.numel(), ctx.rows):
            h, y = hidden[i : i + ctx.rows], labels[i : i + ctx.rows]
            projected = F.linear(h, weight).float()
            if ctx.transform is None:
                # d loss / d logits of a summed cross-entropy: softmax minus the one-hot label, nothing for ignored.
                grad = torch.softmax(projected, dim=-1)
                keep = (y != ctx.ignore).unsqueeze(1)
                grad.scatter_add_(1, torch.where(keep, y.unsqueeze(1), 0), -keep.to(grad.dtype))
                grad.mul_(keep).mul_(grad_total)
            else:  # through the model's own transform of the logits, by autograd on this chunk only
                with torch.enable_grad():
                    projected.requires_grad_(True)
                    chunk_loss = F.cross_entropy(ctx.transform(projected), y, ignore_index=ctx.ignore, reduction="sum")
                    (grad,) = torch.autograd.grad(chunk_loss, projected, grad_total)
            del projected
            if grad.dtype != hidden.dtype:  # cast where autograd would cast it, at the upcast of the logits
                grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[i : i + ctx.rows] = grad @ weight
            if grad_weight is not None and grad.dtype == torch.float32:
                grad_weight.addmm_(grad.t(), h)
            elif grad_weight is not None:
                for v in range(0, weight.size(0), piece):
                    _add_product(grad_weight[v : v + piece], grad[:, v : v + piece].t(), h)
            del grad
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    max_logits: int = 2**26,
    ignore_index: int = -100,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, reduction="sum")`` in fp32, holding at most ``max_logits`` logits.

    Tokens are projected, upcast and scored a chunk at a time, and each chunk's logits are recomputed in backward
    rather than kept, so neither pass holds the full (tokens x vocabulary) fp32 logits. Labels equal to
    ``ignore_index`` count for nothing. ``transform`` is the model's own change to its logits
    (:func:`logit_transform`), applied to each chunk in fp32. The value and gradients are those of the plain loss,
    the output projection's gradient summed over the chunks in fp32 (:class:`_ChunkedLoss`).
    """
    hidden, labels = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    rows = max(1, max_logits // weight.size(0))
    # One chunk on a GPU: nothing to save by recomputing, and its bf16 product sums every token in fp32 and rounds once.
    # A CPU's need not (oneDNN on AVX512-BF16 without AMX rounds the projection's gradient otherwise), so there the
    # gradient is always the fp32 sum of _ChunkedLoss, and the training is the same however the tokens are cut.
    if rows >= labels.numel() and (hidden.is_cuda or weight.dtype == torch.float32):
        logits = F.linear(hidden, weight).float()
        if transform is not None:
            logits = transform(logits)
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return _ChunkedLoss.apply(hidden, weight, labels, rows, ignore_index, transform)
