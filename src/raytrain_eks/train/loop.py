"""The training loop every worker runs, whoever launched it (Ray Train, torchrun, a test).

Per step: take ``grad_accum_steps`` micro-batches, count the trained tokens across all ranks, run forward and
backward with the loss normalised by that global count (so any world size computes the same gradient as one
process with the whole batch), clip, step AdamW and the warm-up + cosine schedule. Every ``log_every`` steps
(and on the first and last) the global loss and throughput go to the driver as one record; only those steps wait
for the device, the others queue their work and go on.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from raytrain_eks.config import TrainingConfig
from raytrain_eks.errors import UserError
from raytrain_eks.train.checkpoint import checkpoint_stager, load_sharded, save_sharded
from raytrain_eks.train.context import WorkerContext
from raytrain_eks.train.counting import Tally, ThroughputWindow, all_ranks, batch_work, through
from raytrain_eks.train.data.encoding import IGNORE_INDEX, load_tokenizer
from raytrain_eks.train.data.pipeline import random_batch
from raytrain_eks.train.dpo import METRICS as DPO_METRICS
from raytrain_eks.train.dpo import Reference, metrics_of, pairs_in
from raytrain_eks.train.evaluation import HeldOut, greedy_samples
from raytrain_eks.train.fabric_gate import check_transport
from raytrain_eks.train.faults import maybe_die
from raytrain_eks.train.flops import mfu, peak_flops_for
from raytrain_eks.train.lora import apply_lora, parameter_counts
from raytrain_eks.train.loss import LossKernel, agreed_loss_kernel, host_logits_fit
from raytrain_eks.train.memory import LOSS_CHUNK_LOGITS, check_run, refuse_unless_fits  # logits held at once
from raytrain_eks.train.model import (
    FLASH_ATTENTION,
    OutputHead,
    causal_lm_class,
    choose_attention,
    compile_layers,
    default_attention,
    fill_from_rank0,
    forward_inputs,
    load_model,
    load_model_shell,
    logit_transform,
    output_projection_deferred,
    resolve_compile,
    router_aux_loss,
)
from raytrain_eks.train.precision import resolve_precision
from raytrain_eks.train.preemption import NoticeWatch, StepAgreement, preempted_summary
from raytrain_eks.train.records import FabricLook, Note, Samples, StepRecord, WorkerJob
from raytrain_eks.train.sharding import Layout, choose_sharding, set_gradient_sync, shard_model
from raytrain_eks.train.start import (
    WeightFiles,
    computed_buffers,
    files_bytes,
    initial_adapters,
    read_own_shard,
    restore_buffers,
    set_full_values,
    weights_source,
)
from raytrain_eks.train.watchdog import heartbeat

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for it: on a GPU copied from pinned memory, asynchronously (a
    copy from pageable memory, or a tensor made on the device from a Python number, waits for the queued work)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Learning-rate multiplier after ``step`` optimizer steps: linear warm-up, then cosine down to ``min_ratio``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: torch.nn.Module, cfg: TrainingConfig, device: torch.device | None = None
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the (sharded) parameters and its warm-up + cosine schedule, as every launcher trains with them.

    Matrices (projections, embeddings) decay by ``weight_decay``; vectors (norm scales, biases) do not. On CUDA the
    fused AdamW kernel updates all parameters at once; elsewhere the multi-tensor (``foreach``) one, which on FSDP's
    sharded parameters costs a fraction of the per-parameter loop (14 ms against 47-73 ms a step for the built-in
    model's shard on 2 CPU ranks).
    """
    cuda = device is not None and device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=cuda,
        foreach=not cuda,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: warmup_cosine(s, warmup=cfg.effective_warmup_steps, total=cfg.steps, min_ratio=cfg.min_lr_ratio),
    )
    return optimizer, scheduler


class _RandomCursor:
    """The reference's random token ids as a resumable stream: the position is the step count."""

    def __init__(self, cfg: TrainingConfig, ctx: WorkerContext, vocab_size: int, position: dict[str, int] | None):
        self._cfg, self._ctx, self._vocab = cfg, ctx, vocab_size
        self.step = int((position or {}).get("step", 0))
        self._micro = 0

    @property
    def position(self) -> dict[str, int]:
        return {"step": self.step}

    def __iter__(self) -> _RandomCursor:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        cfg = self._cfg
        batch = random_batch(
            seed=cfg.seed,
            step=self.step,
            micro=self._micro,
            rank=self._ctx.rank,
            world_size=self._ctx.world_size,
            batch_size=cfg.micro_batch,
            seq_len=cfg.seq_len,
            vocab_size=self._vocab,
        )
        self._micro += 1
        if self._micro == cfg.grad_accum_steps:
            self._micro, self.step = 0, self.step + 1
        return batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreed_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """:func:`resolve_precision` on every rank, then the same answer everywhere: bf16 only if every rank can."""
    precision, reason = resolve_precision(requested, device)
    everyone = _everywhere(precision == "bf16", device)
    if precision == "bf16" and not everyone:
        precision, reason = "fp32", "auto: another rank's device has no native bf16"
    return precision, reason


def agreed_attention(requested: str, model_path: str, precision: str, device: torch.device) -> tuple[str, str]:
    """:func:`choose_attention` on every rank (before any weight is read), then the same answer everywhere:
    flash-attention only where every rank can run it; a refusal on any rank stops them all (collectives)."""
    from transformers import AutoConfig

    model_class = causal_lm_class(AutoConfig.from_pretrained(model_path))
    refused: UserError | None = None
    attention, why = default_attention(model_class), ""
    try:
        attention, why = choose_attention(requested, model_class, cuda=device.type == "cuda", precision=precision)
    except UserError as error:
        refused = error
    if not _everywhere(refused is None, device):
        raise refused or UserError(
            f"training.attention {requested}: another rank cannot run it (its error says why)",
            hint="Use attention auto or sdpa, or give every worker the same image and GPUs.",
        )
    if not _everywhere(attention == FLASH_ATTENTION, device) and attention == FLASH_ATTENTION:
        attention, why = default_attention(model_class), "auto: another rank cannot run flash_attention_2"
    return attention, why


def agreed_sharding(requested: str, ctx: WorkerContext, precision: str) -> Layout:
    """:func:`choose_sharding` from every rank's node (all-gathered), so every rank decides the same."""
    nodes: list[Any] = [ctx.node]
    if dist.is_initialized() and dist.get_world_size() > 1:
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, ctx.node)
    return choose_sharding(requested, [str(n) for n in nodes], precision)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclass
class PreparedModel:
    """The model as the loop trains it: sharded, its output projection deferred to the loss, its sizes counted
    before sharding (``parameters`` all of them, adapters included; ``trainable`` those the optimizer updates)."""

    model: PreTrainedModel
    output_weight: OutputHead
    parameters: int
    trainable: int
    lora_targets: list[str] | None = None  # the layers given adapters (cfg.adapters); None when every weight trains
    attention: str = "sdpa"  # the attention implementation the model was built with (its config's)
    compiled: bool = False  # its decoder layers compiled with torch.compile (training.compile, resolved)
    loss: LossKernel = field(default_factory=LossKernel)  # training.loss_kernel, resolved (decide_run)


def prepare_model(
    cfg: TrainingConfig,
    model_path: str,
    ctx: WorkerContext,
    *,
    layout: Layout,
    precision: str,
    checkpointing: bool,
    device: torch.device,
    resuming: bool = False,
    attention: str | None = None,
    reference: bool = False,
) -> PreparedModel:
    """Load, adapt, shard and fill the model: the one place where the model is prepared (a collective).

    Sharded over several ranks, every rank builds the model on the meta device and, once it is sharded, reads only
    its own shard of each weight from the model's safetensors files (:mod:`.start`); when they cannot be read by
    shard, rank 0 reads the whole model and sends each rank its shard. A run that trains every weight and is
    ``resuming`` reads no weight from the model's files at all (the checkpoint holds them). LoRA's adapters
    (``cfg.adapters``) go in right after the model is built, on every rank alike, and start from the same values
    everywhere (drawn from the seed); only they train. Every rank builds it with the same ``attention``
    implementation (:func:`agreed_attention`; ``None``: transformers' default). ``reference``: DPO's frozen copy of
    the start weights (``training.dpo.adapters: none``), read from the model's files even when resuming, without
    adapters or compiling, every parameter frozen; its notes say ``dpo reference``.
    """

    def say(text: str) -> None:
        ctx.emit(Note(f"dpo reference {text}" if reference else text))

    start = "whole"  # one rank of its own reads the whole model
    if resuming and cfg.adapters is None and not reference:
        start = "checkpoint"
    elif layout.mode != "none" and ctx.world_size > 1:  # sharded
        start = "own-shard"
    model, start, source = _built(model_path, ctx, start, checkpointing=checkpointing, attention=attention, say=say)
    lora = None if reference else cfg.adapters
    targets = apply_lora(model, lora, base=cfg.model_id) if lora is not None else None
    adapters = initial_adapters(model, cfg.seed)  # the same on every rank, whatever its model holds
    # Buffers outside the state dict: computed here where nothing sends them (rank 0's start broadcasts them).
    buffers = computed_buffers(model) if start in ("own-shard", "checkpoint") else {}
    weights = None
    if start == "rank0" and ctx.rank == 0:  # sent from the CPU: the model shards empty, as on the other ranks
        from raytrain_eks.train.start import take_weights

        weights = take_weights(model)
    elif start == "whole":
        model.to(device)
    if reference:
        model.requires_grad_(False)
    trainable, total = parameter_counts(model)
    output_weight = output_projection_deferred(model)
    compiled = False if reference else _compiled(cfg, model, device, say)
    shard_model(model, layout, precision=precision, reduce_precision=cfg.reduce_precision, device=device)
    _fill(model, start, source, weights, buffers, rank=ctx.rank, device=device, say=say)
    del weights  # rank 0's CPU copy of the whole model
    set_full_values(model, adapters)
    return PreparedModel(
        model,
        output_weight,
        parameters=total,
        trainable=trainable,
        lora_targets=targets,
        attention=str(model.config._attn_implementation),
        compiled=compiled,
    )


def _compiled(cfg: TrainingConfig, model: PreTrainedModel, device: torch.device, say: Callable[[str], None]) -> bool:
    """Whether the decoder layers were compiled (``training.compile``, resolved for ``device``), said either way.
    Before sharding: FSDP's gathers and reductions stay outside the compiled code."""
    compiled, why = resolve_compile(cfg.compile, device)
    say(
        f"compile: {compile_layers(model)} decoder layers with torch.compile ({why})"
        if compiled
        else f"compile: off ({why})"
    )
    return compiled


def _built(
    model_path: str,
    ctx: WorkerContext,
    start: str,
    *,
    checkpointing: bool,
    attention: str | None,
    say: Callable[[str], None],
) -> tuple[PreTrainedModel, str, WeightFiles | None]:
    """The model as ``start`` builds it (a meta shell where a rank reads only its shard or takes it from rank 0), the
    start it ends up with (``own-shard`` falls back to ``rank0`` unless every rank can read by shard) and the files
    each rank reads its shard from."""
    source: WeightFiles | None = None
    model = (
        None
        if start == "whole"
        else load_model_shell(model_path, activation_checkpointing=checkpointing, attention=attention)
    )
    if start == "own-shard":
        found = weights_source(model_path, model)
        if _everywhere(isinstance(found, WeightFiles), ctx.device) and isinstance(found, WeightFiles):
            source = found
        else:
            start = "rank0"
            why = found if isinstance(found, str) else "another rank cannot read them by shard"
            say(f"model start: rank 0 reads the whole model and sends each rank its shard ({why})")
    reads_whole = start == "whole" or (start == "rank0" and ctx.rank == 0)
    if model is None or reads_whole:
        model = load_model(model_path, activation_checkpointing=checkpointing, attention=attention)
    return model, start, source


def _fill(
    model: PreTrainedModel,
    start: str,
    source: WeightFiles | None,
    weights: Any,
    buffers: dict[str, torch.Tensor],
    *,
    rank: int,
    device: torch.device,
    say: Callable[[str], None],
) -> None:
    """The sharded model's values: rank 0's ``weights`` sent to every rank, or storage for this rank's shard and
    its values read from ``source`` (a checkpoint's start leaves them to the resume)."""
    if start == "rank0":
        fill_from_rank0(model, weights, device)
    elif start != "whole":  # storage for this rank's shard, then its values
        model.to_empty(device=device)
        restore_buffers(model, buffers)
        if source is not None:
            read, size = read_own_shard(model, source), files_bytes(source)
            say(f"model start: each rank read its own shard of the weights (rank 0: {_gb(read)} of {_gb(size)})")


def dpo_reference(
    cfg: TrainingConfig, prepared: PreparedModel, build: Callable[..., PreparedModel]
) -> Reference | None:
    """DPO's reference (None unless method dpo): with adapters, the policy itself with its adapters off; without,
    a frozen copy of the start weights made by ``build`` (:func:`prepare_model` with the run's settings) like the
    policy, kept out of the optimizer and the checkpoints."""
    if not cfg.preference:
        return None
    beta, loss_type = cfg.dpo.beta, cfg.dpo.loss_type
    if cfg.adapters is not None:
        return Reference(prepared.model, prepared.output_weight, adapters=True, beta=beta, loss_type=loss_type)
    frozen = build(reference=True)
    frozen.model.eval()  # no dropout: the start weights' own log-probabilities
    return Reference(frozen.model, frozen.output_weight, adapters=False, beta=beta, loss_type=loss_type)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _everywhere(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of the default group (a collective)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    vote = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    return bool(int(vote))


@dataclass
class StepResult:
    """One optimizer step's outcome, still on the device: read only on the steps that log (:func:`logged_loss`)."""

    loss_sum: torch.Tensor  # this rank's summed token cross-entropy (DPO: its pairs' summed loss)
    aux_sum: torch.Tensor  # a mixture of experts' router term, averaged over the micro-batches
    global_count: torch.Tensor  # trained tokens of all ranks (DPO: their pairs)
    grad_norm: torch.Tensor
    dpo: torch.Tensor | None = None  # DPO's metrics summed over this rank's pairs (train/dpo.py's METRICS)


def train_step(
    prepared: PreparedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    micro: list[dict[str, torch.Tensor]],
    *,
    cfg: TrainingConfig,
    mode: str,
    world_size: int,
    device: torch.device,
    reference: Reference | None = None,
) -> StepResult:
    """Forward and backward over the step's micro-batches, each one's loss normalised by the step's token count over
    all ranks (so any world size computes one process's gradient), then clip, step AdamW and the schedule. With a
    DPO ``reference`` the loss is the pairs' (:meth:`Reference.loss`), normalised by the step's pairs over all
    ranks in the same way."""
    model, output_weight = prepared.model, prepared.output_weight
    # Counted on the host (labels are CPU tensors), summed across ranks on the device: no wait for the device.
    if reference is None:
        count = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro)
    else:
        count = sum(pairs_in(mb) for mb in micro)
    global_count = _to_device(torch.tensor(float(count), dtype=torch.float64), device)
    dist.all_reduce(global_count)
    scale = (world_size / global_count.clamp(min=1.0)).float()
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    aux_sum = torch.zeros((), dtype=torch.float32, device=device)
    dpo_sum = torch.zeros(len(DPO_METRICS), dtype=torch.float32, device=device)
    for i, mb in enumerate(micro):
        set_gradient_sync(model, mode, last=i == len(micro) - 1)  # sharded; across nodes on the last
        given = forward_inputs(mb, attention=prepared.attention)  # flash-attention: a packed batch in one row
        inputs = {k: _to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in given.items()}
        labels = _to_device(mb["labels"], device)
        if reference is None:
            outputs = output_weight.forward(model, **inputs)  # .logits: the final hidden states
            loss = prepared.loss(  # training.loss_kernel's; a mixture of experts' router term is added below
                outputs.logits.reshape(*labels.shape, -1)[:, :-1],
                output_weight(),
                labels[:, 1:],
                max_logits=LOSS_CHUNK_LOGITS,
                ignore_index=IGNORE_INDEX,
                transform=output_weight.transform,
            )
        else:
            loss, outputs, metrics = reference.loss(model, output_weight, inputs, labels, mb["position_ids"])
            dpo_sum += metrics
        router = router_aux_loss(model, outputs)  # a mixture of experts' own load-balancing term, per batch
        if router is None:
            (loss * scale).backward()
        else:  # averaged over micro-batches here and over ranks by the gradient reduction, as one batch's
            (loss * scale + router / len(micro)).backward()
            aux_sum += router.detach() / len(micro)
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, aux_sum, global_count, grad_norm, dpo_sum if reference is not None else None)


def logged_loss(result: StepResult, world_size: int) -> tuple[float, float]:
    """The step's loss over all ranks (the tokens' mean cross-entropy, plus a mixture of experts' router term) and
    the gradient norm, as numbers: waits for the device (a collective)."""
    dist.all_reduce(result.loss_sum)
    dist.all_reduce(result.aux_sum)
    loss = float(result.loss_sum) / max(1.0, float(result.global_count)) + float(result.aux_sum) / world_size
    norm = result.grad_norm
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return loss, float(norm)


def logged_dpo(result: StepResult) -> dict[str, float] | None:
    """DPO's metrics of the step, averaged over every pair of every rank and micro-batch (one all-reduce of a small
    tensor, on logged steps only); None for a step without pairs' metrics."""
    if result.dpo is None:
        return None
    dist.all_reduce(result.dpo)
    return metrics_of(result.dpo, float(result.global_count))


@dataclass
class Resumed:
    """Where this attempt starts: the step done before it, the step a resume started from, the data position."""

    step: int = 0
    from_step: int | None = None
    position: dict[str, int] | None = None
    note: str = ""  # what a resume from remote storage read of the checkpoint


def resume_from(
    resume: str | Path | None, prepared: PreparedModel, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int
) -> Resumed:
    """Weights, optimizer moments, schedule and RNG from the checkpoint ``resume`` (``None``: a fresh start)."""
    if resume is None:
        return Resumed()
    state = load_sharded(resume, model=prepared.model, optimizer=optimizer, scheduler=scheduler, rank=rank)
    return Resumed(step=state.step, from_step=state.step, position=state.data, note=state.note)


def decide_run(cfg: TrainingConfig, model_path: str, ctx: WorkerContext) -> tuple[str, Layout, bool, str, LossKernel]:
    """The precision, the sharding, whether activation checkpointing is on, the attention implementation and the loss
    kernel, the same on every rank (collectives); on a GPU the memory estimate against it first, which may switch
    checkpointing on or stop the run."""
    device = ctx.device
    precision, why = agreed_precision(cfg.precision, device)
    ctx.emit(Note(f"precision: {precision} ({why})"))
    attention, why = agreed_attention(cfg.attention, model_path, precision, device)
    ctx.emit(Note(f"attention: {attention} ({why})"))
    layout = agreed_sharding(cfg.sharding, ctx, precision)
    ctx.emit(Note(f"sharding: {layout.describe()}"))
    checkpointing = cfg.activation_checkpointing
    if device.type != "cuda":
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
        fit_logits = host_logits_fit(cfg.micro_batch * cfg.seq_len, vocab)
        loss = agreed_loss_kernel(cfg.loss_kernel, device, None, fit_logits, partial(_everywhere, device=device))
        ctx.emit(Note(f"loss: {loss.name} ({loss.reason})"))
        return precision, layout, checkpointing, attention, loss
    # The estimate against this GPU, before any weight is loaded.
    props = torch.cuda.get_device_properties(device)
    check = partial(
        check_run,
        model_path,
        cfg,
        layout=layout,
        precision=precision,
        gpu_bytes=props.total_memory,
        gpu_name=props.name,
        attention=attention,
    )
    shell = load_model_shell(model_path, activation_checkpointing=False, attention=attention)
    fit_logits = check(loss_kernel="auto").estimate.settings["loss_kernel"] == "plain"  # plain where the logits fit
    loss = agreed_loss_kernel(
        cfg.loss_kernel, device, logit_transform(shell), fit_logits, partial(_everywhere, device=device)
    )
    ctx.emit(Note(f"loss: {loss.name} ({loss.reason})"))
    fit = check(loss_kernel=loss.name)
    ctx.emit(Note(fit.line))
    refuse_unless_fits(fit)  # every rank computes the same estimate, so all stop together
    return precision, layout, fit.checkpointing, attention, loss


@dataclass(frozen=True)
class FabricCheck:
    """The transport the run requires of NCCL (``fabric.require``; ``any``: no look), whether EFA must be used as
    fully as the nodes offer it, and the nodes' configured instance type to compare with."""

    require: str = "any"
    full_efa: bool = False
    instance_type: str | None = None


@dataclass
class Run:
    """One worker's run as :func:`train` takes it through its steps: the settings decided for it, the model (and
    DPO's reference), the optimizer and schedule, where it starts, its data, and what it counts."""

    cfg: TrainingConfig
    ctx: WorkerContext
    model_path: str
    layout: Layout
    precision: str
    prepared: PreparedModel
    reference: Reference | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    start: Resumed
    batches: Any  # the data cursor: next() gives a micro-batch, .position where it stands
    held_out: HeldOut | None
    peak: float | None  # the device's peak FLOP/s for MFU (None: not a GPU we know)
    began: float  # when train() began: the first step's time counts the model's start
    tally: Tally = field(default_factory=Tally)
    window: ThroughputWindow = field(default_factory=ThroughputWindow)
    stager: Any = None  # host buffers kept across the run's checkpoint saves

    @property
    def device(self) -> torch.device:
        return self.ctx.device


def run_summary(run: Run, fabric: FabricCheck) -> dict[str, Any]:
    """The run's ``summary.json`` fields, from what it counted (``run.tally``), its steady-state throughput
    (``run.window``: tokens and FLOPs of every rank) and the device's peak."""
    cfg, ctx, prepared, start, tally, window = run.cfg, run.ctx, run.prepared, run.start, run.tally, run.window
    device = ctx.device
    steady_step_time, tps, flops_per_s = window.steady()
    fpt = flops_per_s / tps if tps else 0.0  # the FLOPs of a real token: its row's own attention, no padding
    checkpoints, checkpoint_s, train_s = tally.checkpoints, tally.checkpoint_s, tally.train_s
    return {
        "steps": start.step + tally.done,  # cfg.steps, unless the transport gate stopped the run early
        "first_loss": tally.losses.get(start.step + 1),
        "final_loss": tally.losses.get(cfg.steps),
        "tokens": through(window.trained, done=tally.done, before=start.step),
        "trained_tokens": round(window.trained),  # by this attempt, padding left out
        "train_s": train_s,
        "tokens_per_s": tps,
        "step_time_s": steady_step_time,
        "mfu": mfu(tokens_per_s=tps, flops_per_token=fpt, peak_flops=run.peak, devices=ctx.world_size),
        "precision": run.precision,
        "attention": prepared.attention,
        "compile": "on" if prepared.compiled else "off",
        "loss_kernel": prepared.loss.name,
        "loss_kernel_reason": prepared.loss.reason,
        "first_step_s": tally.first_step_s,
        "sharding": run.layout.mode,
        "reduce_precision": cfg.reduce_precision,
        "flops_per_token": fpt,
        "parameters": prepared.parameters,
        "trainable_parameters": prepared.trainable,
        "method": cfg.method,
        "world_size": ctx.world_size,
        "nodes": len(run.layout.nodes),  # the nodes the workers ran on (a per-node price counts them)
        "device": device_name(device),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        # What the caching allocator held at most: what must fit the GPU (allocated plus its free blocks).
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
        "resumed_from_step": start.from_step,
        "checkpoints": checkpoints,
        "checkpoint_s": checkpoint_s,
        "checkpoint_s_per_save": checkpoint_s / len(checkpoints) if checkpoints else None,
        # what each save cost the training thread (its staging; the previous save's write where it still ran)
        "checkpoint_stall_s": [round(s, 4) for s in tally.stalls],
        "checkpoint_stall_s_max": max(tally.stalls) if tally.stalls else None,
        "checkpoint_stall_s_mean": statistics.fmean(tally.stalls) if tally.stalls else None,
        # of this attempt's time in the loop and its checkpoints (the share training did not go on)
        "checkpoint_share": checkpoint_s / train_s if train_s > 0 else None,
        "eval_loss": tally.last_eval.get("eval_loss"),
        "eval_ppl": tally.last_eval.get("eval_ppl"),
        "eval_tokens": tally.last_eval.get("eval_tokens"),
        "eval_s": tally.eval_s,
        "samples_s": tally.samples_s,
        "fabric": tally.fabric or {"require": fabric.require, "verdict": None, "met": None},
    }


def train(
    cfg: TrainingConfig,
    model_path: str,
    ctx: WorkerContext,
    fabric_require: str = "any",
    sample_prompts: list[str] | None = None,
    fabric_require_full_efa: bool = False,
    fabric_instance_type: str | None = None,
) -> dict[str, Any]:
    """Run the optimizer steps of ``cfg`` on this worker and return the summary (also handed to ``ctx.finish``).

    Continues from ``ctx.resume_checkpoint()`` when there is one: weights, optimizer moments, schedule, step and
    data position are restored, so the steps that follow are those of an uninterrupted run. Unless
    ``fabric_require`` is ``any``, the transport NCCL chose is checked right after the first step (and once more
    after the second when the first look could not prove it), and the run stops there when it is not the
    required one (or, with ``fabric_require_full_efa``, when EFA is used short of what the nodes offer). With
    held-out data (``ctx.eval_batches``), its loss joins the record every ``eval_every`` steps and at the end;
    ``sample_prompts`` (rendered as trained) are answered greedily at the end.

    The run, in its named steps: :func:`start_run` (:func:`decide_run`, :func:`prepare_model`, DPO's
    :func:`dpo_reference`, :func:`resume_from`), :func:`run_steps` (per step :func:`train_step`, on logged steps
    :func:`log_step`, checkpoints by :func:`save`), and :func:`finish_run` (the samples and :func:`run_summary`).
    """
    began = time.perf_counter()  # the first step's time counts the model's start and its compiling
    torch.manual_seed(cfg.seed)
    fabric = FabricCheck(fabric_require, fabric_require_full_efa, fabric_instance_type)
    run = start_run(cfg, model_path, ctx, began)
    run_steps(run, fabric)
    return finish_run(run, fabric, sample_prompts)


def start_run(cfg: TrainingConfig, model_path: str, ctx: WorkerContext, began: float) -> Run:
    """Everything before the first step: the run's decisions, the model (and DPO's reference), the optimizer, the
    checkpoint resumed from, the data from where it stands, and the held-out set."""
    device = ctx.device
    precision, layout, checkpointing, attention, loss_kernel = decide_run(cfg, model_path, ctx)
    resume = ctx.resume_checkpoint()
    build = partial(
        prepare_model,
        cfg,
        model_path,
        ctx,
        layout=layout,
        precision=precision,
        checkpointing=checkpointing,
        device=device,
        attention=attention,
    )
    prepared = build(resuming=resume is not None)
    prepared.loss = loss_kernel
    if prepared.lora_targets:
        trains = f"{prepared.trainable:,} of {prepared.parameters:,} parameters train"
        ctx.emit(Note(f"lora: rank {cfg.lora.rank} adapters on {', '.join(prepared.lora_targets)}; {trains}"))
    reference = dpo_reference(cfg, prepared, build)
    if reference is not None:
        ctx.emit(Note(reference.describe()))
    optimizer, scheduler = build_optimizer(prepared.model, cfg, device)
    start = resume_from(resume, prepared, optimizer, scheduler, ctx.rank)  # after the reference: the RNG restored
    if start.note:  # rank 0's share of a checkpoint in remote storage
        ctx.emit(Note(start.note))
    batches = (
        _RandomCursor(cfg, ctx, prepared.model.config.vocab_size, start.position)
        if cfg.uses_random_data
        else ctx.data_batches(cfg.micro_batch, start.position, seed=cfg.seed)
    )
    note = getattr(batches, "note", "")
    if note:  # a data position in an earlier checkpoint format, converted
        ctx.emit(Note(note))
    eval_source = ctx.eval_batches(cfg.micro_batch)
    held_out = None
    if eval_source is not None:
        held_out = HeldOut(eval_source, seq_len=cfg.seq_len, batch_size=cfg.micro_batch, max_logits=LOSS_CHUNK_LOGITS)
    peak = peak_flops_for(device_name(device), precision) if device.type == "cuda" else None
    return Run(cfg, ctx, model_path, layout, precision, prepared, reference, optimizer, scheduler, start, batches,
               held_out, peak, began, stager=checkpoint_stager(device))  # fmt: skip


def run_steps(run: Run, fabric: FabricCheck) -> None:
    """The optimizer steps from where the run starts to ``steps``, or to the step a notice or the transport gate
    stops it at; checkpoints on the way."""
    cfg, ctx, tally, window = run.cfg, run.ctx, run.tally, run.window
    adapters = run.prepared.trainable if run.prepared.lora_targets else 0
    loop_start = time.perf_counter()
    window.reopen()
    run.prepared.model.train()
    beat = heartbeat(ctx.rank, run.device, run.optimizer)  # the driver's watchdog hears of every step (none: a no-op)
    # This node's interruption notices and the run's stop time (None: nothing to watch).
    watch = NoticeWatch.start(cfg.notice_poll_s, stop_at=cfg.stop_at)
    agree = StepAgreement(watch, world_size=ctx.world_size, on_rebalance=cfg.on_rebalance, device=run.device)
    for step in range(run.start.step + 1, cfg.steps + 1):
        maybe_die("step", step=step, rank=ctx.rank)
        micro = [next(run.batches) for _ in range(cfg.grad_accum_steps)]
        result = train_step(run.prepared, run.optimizer, run.scheduler, micro, cfg=cfg, mode=run.layout.mode,
                            world_size=ctx.world_size, device=run.device, reference=run.reference)  # fmt: skip
        beat(step)
        decision = agree(step)  # a notice on any rank: every rank saves after this same step
        tally.done += 1
        work = [batch_work(mb, run.prepared.model.config, adapters=adapters) for mb in micro]  # while the device works
        window.add(sum(t for t, _ in work), sum(f for _, f in work))
        ctx.settle()  # a checkpoint still being written or uploaded goes on (reported, then marked complete)
        eval_due = run.held_out is not None and (
            step == cfg.steps or bool(cfg.eval_every and step % cfg.eval_every == 0)
        )
        logs = eval_due or step == run.start.step + 1 or step % cfg.log_every == 0 or step == cfg.steps
        record = log_step(run, step, result, eval_due=eval_due) if logs else None
        looks = fabric.require != "any" and (tally.fabric is None or tally.fabric["action"] == "look-again")
        if looks and look_at_fabric(run, fabric) == "stop":
            break
        if decision or step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            save(run, step, record)
        if decision is not None:
            then = "the run stops once it is written" if decision.stop else "training goes on"
            ctx.emit(Note(f"{decision.notice.reason()}: checkpoint {step} is being saved; {then}"))
            if decision.stop and step < cfg.steps:
                tally.preempted = decision
                break
        if record is not None:
            window.reopen()
    tally.train_s = time.perf_counter() - loop_start
    agree.close()


def log_step(run: Run, step: int, result: StepResult, *, eval_due: bool) -> StepRecord:
    """A logged step's record, sent to the driver: the loss over all ranks (and DPO's metrics), the throughput of
    the window it closes, and the held-out loss when ``eval_due`` (collectives: every rank logs the same steps)."""
    ctx, tally, window, device = run.ctx, run.tally, run.window, run.device
    loss, grad_norm = logged_loss(result, ctx.world_size)
    dpo = logged_dpo(result)
    _sync(device)
    if step == run.start.step + 1:  # what starting costs, compiling included: the cache of compiled code cuts it
        tally.first_step_s = time.perf_counter() - run.began
        held = "model start, compiling and the step" if run.prepared.compiled else "model start and the step"
        ctx.emit(Note(f"first step: done {tally.first_step_s:.1f} s after training started ({held})"))
    tally.losses[step] = loss
    tally.last_dpo = dpo or tally.last_dpo
    step_time, tps, flops_per_s = window.close(*all_ranks(window, device))
    if eval_due and run.held_out is not None:  # after the window's timing: left out of throughput, like checkpoints
        t = time.perf_counter()
        tally.last_eval = run.held_out.evaluate(run.prepared.model, run.prepared.output_weight, device)
        tally.eval_s += time.perf_counter() - t
    record = StepRecord(
        step=step,
        loss=loss,
        lr=run.scheduler.get_last_lr()[0],
        grad_norm=grad_norm,
        tokens=through(window.trained, done=tally.done, before=run.start.step),
        tokens_per_s=tps,
        step_time_s=step_time,
        mfu=mfu(
            tokens_per_s=tps,
            flops_per_token=flops_per_s / tps if tps else 0.0,
            peak_flops=run.peak,
            devices=ctx.world_size,
        ),  # fmt: skip
        resumed_from_step=run.start.from_step,
        **(tally.last_eval if eval_due else {}),
        dpo=dpo,
    )
    ctx.emit(record)
    return record


def look_at_fabric(run: Run, fabric: FabricCheck) -> str:
    """The transport gate's look at NCCL's choice after this step, sent to the driver; its action (``stop``:
    not the required transport)."""
    ctx, tally = run.ctx, run.tally
    tally.fabric, nccl_lines = check_transport(
        fabric.require,
        rank=ctx.rank,
        world_size=ctx.world_size,
        node=ctx.node,
        last_look=tally.fabric is not None,
        require_full_efa=fabric.full_efa,
        instance_type=fabric.instance_type,
    )
    ctx.emit(FabricLook(tally.fabric, nccl_lines))
    return str(tally.fabric["action"])


def save(run: Run, step: int, record: StepRecord | None) -> None:
    """A checkpoint after ``step`` (the policy only: DPO's frozen reference is the model's files), through the
    context; its time is left out of throughput."""
    t = time.perf_counter()
    ctx = run.ctx

    def write(folder: Path, background: Any) -> Future[Any] | None:
        written = save_sharded(
            folder,
            model=run.prepared.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            step=step,
            data_position=run.batches.position,
            rank=ctx.rank,
            tokenizer_path=run.model_path,  # the tokenizer goes into every checkpoint, for export
            chat_template=run.cfg.chat_template,
            background=background,
            stager=run.stager,
        )
        maybe_die("checkpoint", step=step, rank=ctx.rank)
        return written

    metrics = record.to_json() if record is not None else {"step": step}
    ctx.save_checkpoint(step, write, metrics, keep=run.cfg.keep_checkpoints)
    run.tally.checkpoints.append(step)
    spent = time.perf_counter() - t
    run.tally.checkpoint_s += spent
    run.tally.stalls.append(spent)  # what the save cost the training thread: the staging, or the whole write
    run.window.leave_out(spent)  # throughput and step time leave checkpoint time out


def finish_run(run: Run, fabric: FabricCheck, sample_prompts: list[str] | None) -> dict[str, Any]:
    """After the last step: the greedy samples (a run that finished), the summary, handed to the context."""
    cfg, ctx, tally = run.cfg, run.ctx, run.tally
    samples_start = time.perf_counter()
    finished = tally.preempted is None and (tally.fabric is None or tally.fabric.get("met") is not False)
    if sample_prompts and cfg.sample_tokens and finished:
        tokenizer = load_tokenizer(run.model_path)
        model, head = run.prepared.model, run.prepared.output_weight
        samples = greedy_samples(model, head, tokenizer, sample_prompts, max_new_tokens=cfg.sample_tokens,
                                 device=run.device)  # fmt: skip
        ctx.emit(Samples(samples))
    tally.samples_s = time.perf_counter() - samples_start
    summary = run_summary(run, fabric)
    if tally.last_dpo is not None:  # the last logged step's rewards, margin and accuracy
        summary["dpo"] = tally.last_dpo
    if tally.preempted is not None:
        summary.update(preempted_summary(tally.preempted, tally.stalls[-1]))
    if tally.stalls:
        most, mean = summary["checkpoint_stall_s_max"], summary["checkpoint_stall_s_mean"]
        saved = len(tally.stalls)
        ctx.emit(Note(f"checkpoints: {saved} saved; training waited at most {most:.2f} s (mean {mean:.2f} s)"))
    ctx.finish(summary)
    run.stager.close()  # after finish: the last save's write is done
    return summary


def ray_worker_entry(job: WorkerJob) -> None:
    """The ``train_loop_per_worker`` given to Ray Train's ``TorchTrainer`` (its config: ``{"job": WorkerJob}``)."""
    from raytrain_eks.train.context import RayContext

    quiet_libraries()
    cfg = TrainingConfig.model_validate(job.training)
    ctx = RayContext(job.metrics_queue, job.checkpoint_root, job.resume_from, job.datasets)
    model_path = job.model_path
    if "://" in model_path:  # staged where every node reads it: this node's copy
        from raytrain_eks.train.staged import local_copy

        model_path = local_copy(model_path)
    train(
        cfg,
        model_path,
        ctx,
        fabric_require=job.fabric_require,
        sample_prompts=job.sample_prompts,
        fabric_require_full_efa=job.fabric_require_full_efa,
        fabric_instance_type=job.fabric_instance_type,
    )


def quiet_libraries() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
