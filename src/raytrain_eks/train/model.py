"""Loading the model and tokenizer: any Hugging Face causal LM by hub id or local folder, or the built-in one.

Everything goes through ``from_pretrained``; the built-in tiny model is first saved to a folder so it takes the
same path as ``Qwen/Qwen2.5-1.5B``. Example::

    path = resolve_model_path("builtin:tiny-qwen2")      # raytrain_eks.train.model_source
    model = load_model(path, activation_checkpointing=False)
    weight = output_projection_deferred(model)         # model(...).logits are now the final hidden states
    loss = chunked_cross_entropy(model(input_ids=ids).logits[:, :-1], weight(), labels[:, 1:])
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from raytrain_eks.config import FLASH_ATTN_MIN
from raytrain_eks.errors import UserError
from raytrain_eks.train.memory import GRAD_PIECE_ELEMENTS

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast


def checkpoint_activations(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant). transformers 5.23 names this
    ``activation_checkpointing_enable``; releases before it (the 5.13 of AWS's Ray DLC) only
    ``gradient_checkpointing_enable``."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_model(path: str, *, activation_checkpointing: bool, attention: str | None = None) -> PreTrainedModel:
    """The causal LM in fp32 master weights (FSDP's policy casts for compute), ready to shard. ``attention``: the
    attention implementation (:func:`choose_attention`); ``None``, transformers' default (sdpa where the model has
    it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    model.config.use_cache = False
    if activation_checkpointing:
        checkpoint_activations(model)
    return model


def load_model_shell(path: str, *, activation_checkpointing: bool, attention: str | None = None) -> PreTrainedModel:
    """:func:`load_model`'s module tree on the meta device: shapes, no weights, no memory. A rank that gets its
    shard of the weights from rank 0 (:func:`fill_from_rank0`) builds this instead of reading the whole model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path), dtype=torch.float32, attn_implementation=attention
        )
    model.config.use_cache = False
    if activation_checkpointing:
        checkpoint_activations(model)
    return model


FLASH_ATTENTION = "flash_attention_2"


def causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel] | None:
    """The class ``AutoModelForCausalLM`` builds for ``config`` (a Hugging Face config); ``None`` where it has none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def default_attention(model_class: type[PreTrainedModel] | None) -> str:
    """transformers' own choice when none is given: sdpa, or eager for a model without an sdpa path."""
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", False) else "eager"


def _flash_missing(
    model_class: type[PreTrainedModel] | None, *, cuda: bool | None, flash_installed: bool | None, precision: str | None
) -> list[str]:
    """What :data:`FLASH_ATTENTION` lacks to run: the model's support for it in transformers (its class's
    ``_supports_flash_attn``), a CUDA device, the flash-attn package, bf16 compute. An answer given as ``None`` is not
    known where this is asked (the driver, before the workers start) and is not counted."""
    missing = []
    if model_class is None or not getattr(model_class, "_supports_flash_attn", False):
        name = model_class.__name__ if model_class is not None else "this model"
        missing.append(f"{name} has no flash-attention path in transformers")
    if cuda is False:
        missing.append("the run's device is not a CUDA GPU")
    if flash_installed is False:
        missing.append(
            f"flash-attn 2 ({FLASH_ATTN_MIN} or later) is not installed (transformers' is_flash_attn_2_available)"
        )
    if precision == "fp32":
        missing.append("the run computes in fp32 (training.precision), and flash-attn only in bf16 or fp16")
    return missing


def choose_attention(
    requested: str,
    model_class: type[PreTrainedModel] | None,
    *,
    cuda: bool | None,
    precision: str,
    flash_installed: bool | None = None,
) -> tuple[str, str]:
    """The attention implementation to build the model with (``training.attention``), and why, decided on the host.

    ``auto`` is :data:`FLASH_ATTENTION` (flash-attn's variable-length kernel for packed rows) on a ``cuda`` device in
    bf16 where flash-attn is installed (``flash_installed``; transformers' own ``is_flash_attn_2_available()`` when not
    given) and ``model_class`` supports it; else the model's default, as transformers picks it: sdpa, or eager for a
    model without it. ``flash_attention_2`` where it cannot run is refused (:class:`UserError` naming what is
    missing); so is ``sdpa`` for a model without it. ``cuda`` ``None``: the device is not known where this is asked
    (the driver of a run on a cluster), and only what is known is held against flash-attention. Example:
    ``choose_attention("auto", LlamaForCausalLM, cuda=False, precision="fp32")`` is ``("sdpa", "auto: ...")``.
    """
    default = default_attention(model_class)
    if requested == "eager" or (requested == "sdpa" and default == "sdpa"):
        return requested, "as configured"
    if requested == "sdpa":
        name = getattr(model_class, "__name__", "the model")  # a model without a class has sdpa (the default)
        raise UserError(
            f"training.attention sdpa: {name} has no sdpa path in transformers",
            hint="Use attention auto or eager.",
        )
    if cuda and flash_installed is None:
        from transformers.utils import is_flash_attn_2_available

        flash_installed = is_flash_attn_2_available()
    missing = _flash_missing(model_class, cuda=cuda, flash_installed=flash_installed, precision=precision)
    if requested == FLASH_ATTENTION:
        if missing:
            raise UserError(
                f"training.attention {FLASH_ATTENTION} cannot run here: {'; '.join(missing)}",
                hint="Use attention auto (flash-attention where it can run, else sdpa) or sdpa; for flash-attention, "
                "train in bf16 on CUDA GPUs whose image has flash-attn installed (pip install flash-attn "
                "--no-build-isolation).",
            )
        return FLASH_ATTENTION, "as configured"
    if not missing:
        return FLASH_ATTENTION, "auto: flash-attn's variable-length kernel on a bf16 CUDA run"
    return default, f"auto: {missing[0]}"


def check_attention(requested: str, precision: str, config: PretrainedConfig, *, local: bool) -> None:
    """Before the workers start: refuse the ``training.attention`` that cannot run (:func:`choose_attention`), from
    what the driver knows (the model's class from its ``config``, an fp32 ``precision`` set as such) and, for a
    ``local`` run whose workers are on this machine, its CUDA and flash-attn too. The workers decide the rest."""
    if requested in ("sdpa", FLASH_ATTENTION):
        cuda = torch.cuda.is_available() if local else None
        choose_attention(requested, causal_lm_class(config), cuda=cuda, precision=precision)


def fill_from_rank0(model: torch.nn.Module, weights: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """After sharding a model that holds no weights (on the meta device: a :func:`load_model_shell`, or rank 0's
    model after :func:`~raytrain_eks.train.start.take_weights`): storage for every rank's shard on ``device``, then
    its values from rank 0's ``weights`` (``take_weights``'s, on the CPU; ``None`` on the other ranks). Buffers
    outside the state dict (rotary frequencies) are sent whole. A collective: every rank of the default group
    calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    held = set(model.state_dict())
    # torch sends rank 0's weights one at a time, each moved to the device only while it is sent (the
    # broadcast_from_rank0 load), and every rank keeps its shard of it: rank 0's CPU copy is never on the device.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, {k: v for k, v in (weights or {}).items() if k in held}, options=options)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in held:
                continue
            if weights is not None:
                buffer.copy_(weights[name])
            dist.broadcast(buffer, src=0)


def resolve_compile(requested: str, device: torch.device) -> tuple[bool, str]:
    """Whether this worker compiles the decoder layers (``training.compile``: auto, on or off) on ``device``, and why.

    ``auto`` compiles on CUDA, where the compiled layers train faster (benchmarks/results/2026-12-04-h200: 35-47% MFU
    against 28.1% eager on an H200), and not on other devices: on a CPU compiling takes longer than a short run saves.
    Example: ``resolve_compile("auto", torch.device("cpu"))`` is ``(False, "auto: the device is a CPU")``.
    """
    if requested in {"on", "off"}:
        return requested == "on", "as configured"
    if requested != "auto":
        raise ValueError(f"compile must be auto, on or off, not {requested!r}")
    if device.type == "cuda":
        return True, "auto: CUDA"
    if device.type == "cpu":
        return False, "auto: the device is a CPU"
    return False, f"auto: compiled by default on CUDA only, not on {device.type}"


def compile_layers(model: torch.nn.Module) -> int:
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


# What a causal LM may do to its logits after the output projection, by the attribute that holds the number: the
# chunked loss does the same to each chunk. Read from transformers 5.23's modeling files: Gemma 2/3 (and others)
# ``logits = tanh(logits / cap) * cap`` with ``final_logit_softcapping``; Granite ``logits / logits_scaling`` and
# HyperCLOVAX ``logits * logits_scaling`` (the same field, the other way); Cohere ``logits * logit_scale``; Falcon-H1
# ``logits * lm_head_multiplier``. Each of these fields does nothing but that, so setting it to its identity while
# the loss applies it changes nothing else.
KNOWN_LOGIT_FIELDS = ("final_logit_softcapping", "logits_scaling", "logit_scale", "lm_head_multiplier")
_CASTS = ("float", "to", "contiguous")  # the loss computes in fp32 in any case
_TANH = ("torch.tanh", "nn.functional.tanh", "torch.nn.functional.tanh", "F.tanh")


@dataclass(frozen=True)
class LogitTransform:
    """``scale`` times the projected logits, then ``cap * tanh(logits / cap)`` when ``softcap`` is set."""

    scale: float = 1.0
    softcap: float | None = None
    # (object, attribute, identity value): what turns the model's own transform off while the loss applies it.
    neutral: tuple[tuple[object, str, float | None], ...] = field(default=(), compare=False, repr=False)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class _Unknown(Exception):
    """A statement of the forward that the loss cannot reproduce; its text is the message."""


@dataclass(frozen=True)
class _Step:
    """One operation on the logits: ``*`` or ``/`` by the number in ``owner.name``, or ``tanh``."""

    op: str  # "*", "/" or "tanh"
    owner: object = None
    name: str = ""
    guarded: bool = False  # inside ``if <the number> is not None:``, so ``None`` turns it off

    @property
    def value(self) -> float | None:
        # _ForwardReader._number let only a number or None through
        return getattr(self.owner, self.name) if self.owner is not None else None


class _ForwardReader:
    """The forward's source as a syntax tree: which variable its loss is computed from, and every assignment to it
    after the output projection, as :class:`_Step` s. Keyword arguments of a call (``logits=logits``) assign
    nothing; any statement on that variable that is not the projection, a cast or a known step is :class:`_Unknown`.
    """

    def __init__(self, model: PreTrainedModel, source: str) -> None:
        import textwrap

        self.model = model
        self.tree = ast.parse(textwrap.dedent(source))
        self.parents = {child: node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)}
        # Local names bound to an attribute of the model or its config (``cap = self.config.logits_soft_cap``).
        self.aliases: dict[str, ast.expr] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self.aliases[node.targets[0].id] = node.value
            elif isinstance(node, ast.NamedExpr):
                self.aliases[node.target.id] = node.value
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.heads = {"lm_head"} | {name for name, child in model.named_children() if child is head}

    def loss_variable(self) -> str | None:
        """The name of the logits the forward hands to ``self.loss_function``, or ``None`` where it computes its
        loss some other way (its own ``CrossEntropyLoss``, unshifted labels, ...)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.loss_function":
                given = [k.value for k in node.keywords if k.arg == "logits"] or node.args[:1]
                if given and isinstance(given[0], ast.Name):
                    return given[0].id
        return None

    def steps(self, variable: str) -> list[_Step]:
        found: list[tuple[int, ast.Assign | ast.AnnAssign | ast.AugAssign]] = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    stored = [n for n in ast.walk(target) if isinstance(n, ast.Name) and n.id == variable]
                    if stored and not isinstance(target, ast.Name):  # logits[...] = ..., a, logits = ...
                        raise _Unknown(ast.unparse(node))
                    if stored:
                        found.append((node.lineno, node))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and ast.unparse(node.func.value) == variable
                and node.func.attr.endswith("_")
            ):  # logits.mul_(...)
                raise _Unknown(ast.unparse(node))
        steps: list[_Step] = []
        for _, node in sorted(found, key=lambda pair: pair[0]):
            if node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None):
                continue
            value = node.value
            if isinstance(node, ast.AugAssign):
                value = ast.BinOp(left=ast.Name(id=variable), op=node.op, right=node.value)
            try:
                base, ops = self._expression(value, variable)
            except _Unknown:
                raise _Unknown(ast.unparse(node)) from None
            if base == "projection":
                steps = ops
            elif base == variable:
                steps += ops
            else:
                raise _Unknown(ast.unparse(node))
        return steps

    def _expression(self, node: ast.expr, variable: str) -> tuple[str, list[_Step]]:
        """What ``node`` is: (``"projection"`` or the variable, the steps applied to it)."""
        if isinstance(node, ast.Name) and node.id == variable:
            return variable, []
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in {f"self.{h}" for h in self.heads} or func == "self.get_output_embeddings()":
                return "projection", []
            if func in _TANH and len(node.args) == 1 and not node.keywords:
                base, ops = self._expression(node.args[0], variable)
                return base, [*ops, _Step("tanh")]
            if isinstance(node.func, ast.Attribute) and node.func.attr in _CASTS:
                return self._expression(node.func.value, variable)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Div):
            op = "*" if isinstance(node.op, ast.Mult) else "/"
            for inner, number in ((node.left, node.right), (node.right, node.left)):
                if op == "/" and inner is node.right:
                    break  # number / logits is no scaling
                try:
                    base, ops = self._expression(inner, variable)
                except _Unknown:
                    continue
                owner, name = self._number(number)
                return base, [*ops, _Step(op, owner, name, self._guarded(node, owner, name))]
        raise _Unknown(ast.unparse(node))

    def _number(self, node: ast.expr) -> tuple[object, str]:
        """The (object, attribute) a known field is read from: ``self.config.x``, ``self.model.x``,
        ``self.config.get_text_config().x``, or a local name bound to one of these."""
        if isinstance(node, ast.Name) and node.id in self.aliases:
            node = self.aliases[node.id]
        if not (isinstance(node, ast.Attribute) and node.attr in KNOWN_LOGIT_FIELDS):
            raise _Unknown(ast.unparse(node))
        owner = self._object(node.value)
        value = getattr(owner, node.attr, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _Unknown(ast.unparse(node))  # a learned scale (a parameter) or something else
        return owner, node.attr

    def _object(self, node: ast.expr) -> object:
        if isinstance(node, ast.Name) and node.id == "self":
            return self.model
        if isinstance(node, ast.Attribute) and hasattr(owner := self._object(node.value), node.attr):
            return getattr(owner, node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_text_config":
            return getattr(self._object(node.func.value), "get_text_config")()  # noqa: B009  (an object here)
        raise _Unknown(ast.unparse(node))

    def _guarded(self, node: ast.AST, owner: object, name: str) -> bool:
        """Whether ``node`` runs only under ``if <owner.name> is not None:``."""
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
                test = node.test
                left = test.left.value if isinstance(test.left, ast.NamedExpr) else test.left
                is_not_none = [type(o) for o in test.ops] == [ast.IsNot] and ast.unparse(test.comparators[0]) == "None"
                try:
                    read = self._number(left) if is_not_none else None
                    if read is not None and read[0] is owner and read[1] == name:
                        return True
                except _Unknown:
                    pass
        return False


def _compose(steps: list[_Step]) -> LogitTransform | None:
    """The steps as one :class:`LogitTransform`: scalings first, then at most one soft-cap (``/ c``, ``tanh``,
    ``* c`` by the same number), which must be turned off by ``None``; anything else raises :class:`_Unknown`."""
    scale, softcap = 1.0, None
    neutral: list[tuple[object, str, float | None]] = []  # (object, attribute, the value that turns it off)
    i = 0
    while i < len(steps):
        step = steps[i]
        if step.op == "tanh" or (i + 2 < len(steps) and steps[i + 1].op == "tanh"):
            cap = steps[i : i + 3]
            same = len(cap) == 3 and cap[0].op == "/" and cap[2].op == "*"
            same = same and cap[0].owner is cap[2].owner and cap[0].name == cap[2].name
            if not same or softcap is not None or i + 3 != len(steps):
                raise _Unknown("a tanh that is not the last step's soft-cap by one number")
            if cap[0].value is not None:
                if not (cap[0].guarded and cap[2].guarded):
                    raise _Unknown(f"a soft-cap by {cap[0].name} that nothing turns off")
                softcap = float(cap[0].value)
                neutral.append((cap[0].owner, cap[0].name, None))
            i += 3
            continue
        if step.value is not None and float(step.value) != 1.0:
            scale = scale * float(step.value) if step.op == "*" else scale / float(step.value)
            neutral.append((step.owner, step.name, 1.0))
        i += 1
    if not neutral:
        return None
    return LogitTransform(scale=scale, softcap=softcap, neutral=tuple(neutral))


def logit_transform(model: PreTrainedModel) -> LogitTransform | None:
    """What ``model``'s own forward does to its logits after the output projection, or ``None`` for nothing.

    The forward's source is read: its loss must be ``self.loss_function`` of one logits variable (the causal-LM
    cross-entropy of the next token), and every statement that changes that variable after the projection must be
    multiplying or dividing by one of :data:`KNOWN_LOGIT_FIELDS` or a soft-cap by one, the numbers read from the
    model and its config. Anything else is refused (a :class:`UserError`) rather than trained on a different
    objective than the model's own. Example: a Granite config's ``logits_scaling=4`` gives ``scale == 0.25``, a
    HyperCLOVAX config's ``scale == 4``.
    """
    import inspect

    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(model).__name__
    try:
        reader = _ForwardReader(model, inspect.getsource(type(model).forward))
    except (OSError, TypeError, SyntaxError):
        raise _refusal(name, "its forward's source cannot be read") from None
    variable = reader.loss_variable()
    if variable is None or getattr(model, "loss_function", None) is not ForCausalLMLoss:
        raise _refusal(name, "computes its loss in its own way, not as the next token's cross-entropy")
    try:
        return _compose(reader.steps(variable))
    except _Unknown as unknown:
        raise _refusal(
            name, f"changes its logits after the output projection in a way the chunked loss does not know ({unknown})"
        ) from None


def _refusal(name: str, what: str) -> UserError:
    return UserError(
        f"model {name} {what}, so the job's loss would differ from the model's own",
        hint="Fine-tune a causal LM whose loss is the next token's cross-entropy of the output projection's logits, "
        f"scaled or soft-capped through one of the fields {', '.join(KNOWN_LOGIT_FIELDS)} at most (Llama, Qwen, "
        "Mistral, Gemma, Granite, ...).",
    )


def router_aux_loss(model: PreTrainedModel, outputs: CausalLMOutputWithPast) -> torch.Tensor | None:
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

    module: torch.nn.Linear
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

    def forward(self, model: torch.nn.Module, **inputs: torch.Tensor | int) -> CausalLMOutputWithPast:
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


def forward_inputs(batch: dict[str, torch.Tensor], *, attention: str | None = None) -> dict[str, torch.Tensor | int]:
    """The model's inputs for a packed batch (host tensors): ``input_ids``, and ``position_ids`` where a block holds
    more than one row (``packing: documents``), from which transformers keeps attention inside each row (a
    block-causal mask). Decided on the host, so it never waits for a device; a block of one row needs no positions
    (they count from 0 as the model's own would) and keeps the causal fast path. With ``attention``
    :data:`FLASH_ATTENTION` the blocks of a packed batch go in as one row (:func:`_packed_as_one_row`): the model's
    output is then one row too, ``(1, blocks * seq_len, ...)``; reshape it to the labels' shape.
    """
    inputs: dict[str, torch.Tensor | int] = {"input_ids": batch["input_ids"]}
    positions = batch.get("position_ids")
    if positions is not None and bool((positions[:, 1:] - positions[:, :-1] != 1).any()):
        if attention == FLASH_ATTENTION:
            return _packed_as_one_row(batch["input_ids"], positions)
        inputs["position_ids"] = positions
    return inputs


def _packed_as_one_row(ids: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """A packed batch as flash-attention's variable-length kernel takes it. transformers (5.x,
    ``_flash_attention_forward``) uses that kernel for packed positions in a batch of one row only: given several rows
    without a padding mask, it runs each row as one causal sequence, across its documents. So the blocks go in as one
    row, with the documents' bounds (``cu_seq_lens_q/k``) and the longest (``max_length_q/k``) computed here on the
    host, where transformers would compute them from the positions on the device with a wait in every layer. Every
    block starts a document (position 0, :func:`~raytrain_eks.train.data.packing.pack`), so no document spans two
    blocks."""
    flat = positions.reshape(1, -1)
    starts = (flat[0] == 0).nonzero().view(-1)
    bounds = torch.cat([starts, torch.tensor([flat.size(1)])]).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return {
        "input_ids": ids.reshape(1, -1),
        "position_ids": flat,
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def output_projection_deferred(model: PreTrainedModel) -> OutputHead:
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
