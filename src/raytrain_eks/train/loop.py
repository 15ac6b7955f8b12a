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
from raytrain_eks.train.data.encoding import IGNORE_INDEX, load_tokenizer
from raytrain_eks.train.data.packing import block_documents
from raytrain_eks.train.data.pipeline import random_batch
from raytrain_eks.train.evaluation import HeldOut, greedy_samples
from raytrain_eks.train.fabric_gate import check_transport
from raytrain_eks.train.faults import maybe_die
from raytrain_eks.train.flops import documents_flops, mfu, peak_flops_for
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
from raytrain_eks.train.preemption import Decision, NoticeWatch, StepAgreement, preempted_summary
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
    lora_targets: list[str] | None = None  # the layers given adapters (method lora); None for full fine-tuning
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
) -> PreparedModel:
    """Load, adapt, shard and fill the model: the one place where the model is prepared (a collective).

    Sharded over several ranks, every rank builds the model on the meta device and, once it is sharded, reads only
    its own shard of each weight from the model's safetensors files (:mod:`.start`); when they cannot be read by
    shard, rank 0 reads the whole model and sends each rank its shard. A full fine-tune that ``resuming`` reads no
    weight from the model's files at all (the checkpoint holds them). LoRA's adapters go in right after the model is
    built, on every rank alike, and start from the same values everywhere (drawn from the seed); only they train.
    Every rank builds it with the same ``attention`` implementation (:func:`agreed_attention`; ``None``: transformers'
    default).
    """
    sharded = layout.mode != "none" and ctx.world_size > 1
    start = "whole"  # one rank of its own reads the whole model
    if resuming and cfg.method == "full":
        start = "checkpoint"
    elif sharded:
        start = "own-shard"
    source: WeightFiles | None = None
    model = (
        None
        if start == "whole"
        else load_model_shell(model_path, activation_checkpointing=checkpointing, attention=attention)
    )
    if start == "own-shard":
        found = weights_source(model_path, model)
        if _everywhere(isinstance(found, WeightFiles), device) and isinstance(found, WeightFiles):
            source = found
        else:
            start = "rank0"
            why = found if isinstance(found, str) else "another rank cannot read them by shard"
            ctx.emit(Note(f"model start: rank 0 reads the whole model and sends each rank its shard ({why})"))
    reads_whole = start == "whole" or (start == "rank0" and ctx.rank == 0)
    if model is None or reads_whole:
        model = load_model(model_path, activation_checkpointing=checkpointing, attention=attention)
    targets = apply_lora(model, cfg.lora, base=cfg.model_id) if cfg.method == "lora" else None
    adapters = initial_adapters(model, cfg.seed)  # the same on every rank, whatever its model holds
    # Buffers outside the state dict: computed here where nothing sends them (rank 0's start broadcasts them).
    buffers = computed_buffers(model) if start in ("own-shard", "checkpoint") else {}
    weights = None
    if start == "rank0" and ctx.rank == 0:  # sent from the CPU: the model shards empty, as on the other ranks
        from raytrain_eks.train.start import take_weights

        weights = take_weights(model)
    elif start == "whole":
        model.to(device)
    trainable, total = parameter_counts(model)
    output_weight = output_projection_deferred(model)
    compiled, why = resolve_compile(cfg.compile, device)
    if compiled:  # before sharding: FSDP's gathers and reductions stay outside the compiled code
        ctx.emit(Note(f"compile: {compile_layers(model)} decoder layers with torch.compile ({why})"))
    else:
        ctx.emit(Note(f"compile: off ({why})"))
    shard_model(model, layout, precision=precision, reduce_precision=cfg.reduce_precision, device=device)
    if start == "rank0":
        fill_from_rank0(model, weights, device)
        del weights  # the CPU copy of the whole model
    elif start != "whole":  # storage for this rank's shard, then its values
        model.to_empty(device=device)
        restore_buffers(model, buffers)
        if source is not None:
            read, size = read_own_shard(model, source), files_bytes(source)
            shares = f"rank 0: {_gb(read)} of {_gb(size)}"
            ctx.emit(Note(f"model start: each rank read its own shard of the weights ({shares})"))
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

    loss_sum: torch.Tensor  # this rank's summed token cross-entropy
    aux_sum: torch.Tensor  # a mixture of experts' router term, averaged over the micro-batches
    global_count: torch.Tensor  # trained tokens of all ranks
    grad_norm: torch.Tensor


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
) -> StepResult:
    """Forward and backward over the step's micro-batches, each one's loss normalised by the step's token count over
    all ranks (so any world size computes one process's gradient), then clip, step AdamW and the schedule."""
    model, output_weight = prepared.model, prepared.output_weight
    # Counted on the host (labels are CPU tensors), summed across ranks on the device: no wait for the device.
    count = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro)
    global_count = _to_device(torch.tensor(float(count), dtype=torch.float64), device)
    dist.all_reduce(global_count)
    scale = (world_size / global_count.clamp(min=1.0)).float()
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    aux_sum = torch.zeros((), dtype=torch.float32, device=device)
    for i, mb in enumerate(micro):
        set_gradient_sync(model, mode, last=i == len(micro) - 1)  # sharded; across nodes on the last
        given = forward_inputs(mb, attention=prepared.attention)  # flash-attention: a packed batch in one row
        inputs = {k: _to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in given.items()}
        labels = _to_device(mb["labels"], device)
        outputs = output_weight.forward(model, **inputs)  # .logits: the final hidden states
        token_loss = prepared.loss(  # training.loss_kernel's; a mixture of experts' router term is added below
            outputs.logits.reshape(*labels.shape, -1)[:, :-1],
            output_weight(),
            labels[:, 1:],
            max_logits=LOSS_CHUNK_LOGITS,
            ignore_index=IGNORE_INDEX,
            transform=output_weight.transform,
        )
        router = router_aux_loss(model, outputs)  # a mixture of experts' own load-balancing term, per batch
        if router is None:
            (token_loss * scale).backward()
        else:  # averaged over micro-batches here and over ranks by the gradient reduction, as one batch's
            (token_loss * scale + router / len(micro)).backward()
            aux_sum += router.detach() / len(micro)
        loss_sum += token_loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, aux_sum, global_count, grad_norm)


def logged_loss(result: StepResult, world_size: int) -> tuple[float, float]:
    """The step's loss over all ranks (the tokens' mean cross-entropy, plus a mixture of experts' router term) and
    the gradient norm, as numbers: waits for the device (a collective)."""
    dist.all_reduce(result.loss_sum)
    dist.all_reduce(result.aux_sum)
    loss = float(result.loss_sum) / max(1.0, float(result.global_count)) + float(result.aux_sum) / world_size
    norm = result.grad_norm
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return loss, float(norm)


class ThroughputWindow:
    """Time, steps and tokens since the last logged step; checkpoint and evaluation time are left out of it.

    Each logged step closes a window (:meth:`close`): its time over its steps is that window's step time. The
    steady figures (:meth:`steady`) leave the first window out, which holds the first step's one-off costs.
    """

    def __init__(self) -> None:
        self.steps, self.tokens, self.flops = 0, 0, 0.0  # this rank's, since the window opened
        self.start = time.perf_counter()
        self.closed: list[tuple[float, int, float, float]] = []  # (seconds, steps, tokens, FLOPs) of every rank

    def add(self, tokens: int, flops: float) -> None:
        """One step of this rank: its tokens (padding left out) and their training FLOPs."""
        self.steps += 1
        self.tokens += tokens
        self.flops += flops

    def leave_out(self, seconds: float) -> None:
        """Time spent on something other than training (a checkpoint) while this window is open."""
        self.start += seconds

    def close(self, tokens: float, flops: float) -> tuple[float, float, float]:
        """Close the window at this logged step, given every rank's ``tokens`` and ``flops`` in it: (its step time,
        its tokens per second, its FLOPs per second)."""
        seconds = time.perf_counter() - self.start
        self.closed.append((seconds, self.steps, tokens, flops))
        return seconds / self.steps, tokens / seconds, flops / seconds

    def reopen(self) -> None:
        self.steps, self.tokens, self.flops, self.start = 0, 0, 0.0, time.perf_counter()

    def steady(self) -> tuple[float | None, float, float]:
        """The median step time, and the tokens and FLOPs per second, over the windows after the first."""
        windows = self.closed[1:] or self.closed
        seconds = sum(w[0] for w in windows)
        step_time = statistics.median(w[0] / w[1] for w in windows) if windows else None
        if seconds <= 0:
            return step_time, 0.0, 0.0
        return step_time, sum(w[2] for w in windows) / seconds, sum(w[3] for w in windows) / seconds

    @property
    def trained(self) -> float:
        """Every rank's tokens in the closed windows."""
        return sum(w[2] for w in self.closed)


def _through(trained: float, *, done: int, before: int) -> int:
    """Tokens trained through the last step: ``trained`` in this attempt's ``done`` steps, and a resumed run's
    ``before`` steps counted at this attempt's tokens per step (the same data, so a close estimate; exact for
    random ids)."""
    return round(trained + before * trained / done) if done else 0


def batch_work(batch: dict[str, torch.Tensor], config: Any, *, adapters: int = 0) -> tuple[int, float]:
    """The tokens of a packed batch that hold a row (padding left out) and their training FLOPs, each row's
    attention charged over its own length (:func:`~raytrain_eks.train.flops.documents_flops`), counted on the host
    from the batch's ``filled`` and ``position_ids``. A block without positions (``packing: concat``, random ids)
    attends across all its filled positions."""
    seq_len = batch["input_ids"].shape[-1]
    rows = batch["input_ids"].shape[0]
    filled = batch.get("filled")
    positions = batch.get("position_ids")
    lengths: list[int] = []
    for r in range(rows):
        n = int(filled[r]) if filled is not None else seq_len
        if positions is not None:
            lengths += [length for _, length in block_documents(positions[r].numpy(), n)]
        else:
            lengths.append(n)
    return sum(lengths), documents_flops(config, lengths, adapters=adapters)


def _all_ranks(window: ThroughputWindow, device: torch.device) -> tuple[float, float]:
    """Every rank's tokens and FLOPs in the open window (a collective, on logged steps only)."""
    totals = _to_device(torch.tensor([float(window.tokens), window.flops], dtype=torch.float64), device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    tokens, flops = totals.tolist()
    return tokens, flops


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


@dataclass
class Tally:
    """What a run counts as it goes, for its summary: the steps this attempt trained, the logged losses, the
    checkpoints and the time they took, the last held-out evaluation and the time evaluation took, the transport
    gate's last answer, and the time in the loop and in the final samples."""

    done: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    checkpoints: list[int] = field(default_factory=list)
    checkpoint_s: float = 0.0
    stalls: list[float] = field(default_factory=list)  # per save: from its call until training could go on
    last_eval: dict[str, Any] = field(default_factory=dict)
    eval_s: float = 0.0
    fabric: dict[str, Any] | None = None
    train_s: float = 0.0
    samples_s: float = 0.0
    first_step_s: float | None = None  # from the start of train() to the end of this attempt's first step
    preempted: Decision | None = None  # the notice that ended the run before its last step


def run_summary(
    cfg: TrainingConfig,
    ctx: WorkerContext,
    prepared: PreparedModel,
    *,
    layout: Layout,
    precision: str,
    start: Resumed,
    tally: Tally,
    window: ThroughputWindow,
    fabric_require: str,
    peak: float | None,
) -> dict[str, Any]:
    """The run's ``summary.json`` fields, from what it counted (``tally``), its steady-state throughput (``window``:
    tokens and FLOPs of every rank) and the device's ``peak``."""
    device = ctx.device
    steady_step_time, tps, flops_per_s = window.steady()
    fpt = flops_per_s / tps if tps else 0.0  # the FLOPs of a real token: its row's own attention, no padding
    last_step = start.step + tally.done  # cfg.steps, unless the transport gate stopped the run early
    checkpoints, checkpoint_s, train_s = tally.checkpoints, tally.checkpoint_s, tally.train_s
    trained = round(window.trained)  # by this attempt, padding left out
    return {
        "steps": last_step,
        "first_loss": tally.losses.get(start.step + 1),
        "final_loss": tally.losses.get(cfg.steps),
        "tokens": _through(window.trained, done=tally.done, before=start.step),
        "trained_tokens": trained,
        "train_s": train_s,
        "tokens_per_s": tps,
        "step_time_s": steady_step_time,
        "mfu": mfu(tokens_per_s=tps, flops_per_token=fpt, peak_flops=peak, devices=ctx.world_size),
        "precision": precision,
        "attention": prepared.attention,
        "compile": "on" if prepared.compiled else "off",
        "loss_kernel": prepared.loss.name,
        "loss_kernel_reason": prepared.loss.reason,
        "first_step_s": tally.first_step_s,
        "sharding": layout.mode,
        "reduce_precision": cfg.reduce_precision,
        "flops_per_token": fpt,
        "parameters": prepared.parameters,
        "trainable_parameters": prepared.trainable,
        "method": cfg.method,
        "world_size": ctx.world_size,
        "nodes": len(layout.nodes),  # the nodes the workers ran on (a per-node price counts them)
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
        "fabric": tally.fabric or {"require": fabric_require, "verdict": None, "met": None},
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

    The run, in its named steps: :func:`decide_run`, :func:`prepare_model`, :func:`resume_from`, then per step
    :func:`train_step`, on logged steps :func:`logged_loss` and a :class:`ThroughputWindow`, checkpoints through
    the context, and at the end the samples and :func:`run_summary`.
    """
    began = time.perf_counter()  # the first step's time counts the model's start and its compiling
    torch.manual_seed(cfg.seed)
    device = ctx.device
    precision, layout, checkpointing, attention, loss_kernel = decide_run(cfg, model_path, ctx)
    resume = ctx.resume_checkpoint()
    prepared = prepare_model(
        cfg,
        model_path,
        ctx,
        layout=layout,
        precision=precision,
        checkpointing=checkpointing,
        device=device,
        resuming=resume is not None,
        attention=attention,
    )
    prepared.loss = loss_kernel
    model = prepared.model
    if prepared.lora_targets:
        ctx.emit(
            Note(
                f"lora: rank {cfg.lora.rank} adapters on {', '.join(prepared.lora_targets)}; "
                f"{prepared.trainable:,} of {prepared.parameters:,} parameters train"
            )
        )
    optimizer, scheduler = build_optimizer(model, cfg, device)
    start = resume_from(resume, prepared, optimizer, scheduler, ctx.rank)
    if start.note:  # rank 0's share of a checkpoint in remote storage
        ctx.emit(Note(start.note))
    batches = (
        _RandomCursor(cfg, ctx, model.config.vocab_size, start.position)
        if cfg.uses_random_data
        else ctx.data_batches(cfg.micro_batch, start.position, seed=cfg.seed)
    )
    note = getattr(batches, "note", "")
    if note:  # a data position in an earlier checkpoint format, converted
        ctx.emit(Note(note))

    adapters = prepared.trainable if prepared.lora_targets else 0
    peak = peak_flops_for(device_name(device), precision) if device.type == "cuda" else None
    eval_source = ctx.eval_batches(cfg.micro_batch)
    held_out = (
        HeldOut(eval_source, seq_len=cfg.seq_len, batch_size=cfg.micro_batch, max_logits=LOSS_CHUNK_LOGITS)
        if eval_source is not None
        else None
    )
    tally = Tally()
    window = ThroughputWindow()
    stager = checkpoint_stager(device)  # host buffers kept across the run's saves

    def save(step: int, record: StepRecord | None) -> None:
        t = time.perf_counter()

        def write(folder: Path, background: Any) -> Future[Any] | None:
            written = save_sharded(
                folder,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                step=step,
                data_position=batches.position,
                rank=ctx.rank,
                tokenizer_path=model_path,  # the tokenizer goes into every checkpoint, for export
                chat_template=cfg.chat_template,
                background=background,
                stager=stager,
            )
            maybe_die("checkpoint", step=step, rank=ctx.rank)
            return written

        metrics = record.to_json() if record is not None else {"step": step}
        ctx.save_checkpoint(step, write, metrics, keep=cfg.keep_checkpoints)
        tally.checkpoints.append(step)
        spent = time.perf_counter() - t
        tally.checkpoint_s += spent
        tally.stalls.append(spent)  # what the save cost the training thread: the staging, or the whole write
        window.leave_out(spent)  # throughput and step time leave checkpoint time out

    loop_start = time.perf_counter()
    window.reopen()
    model.train()
    beat = heartbeat(ctx.rank, device, optimizer)  # the driver's watchdog hears of every step (none: a no-op)
    # This node's interruption notices and the run's stop time (None: nothing to watch).
    watch = NoticeWatch.start(cfg.notice_poll_s, stop_at=cfg.stop_at)
    agree = StepAgreement(watch, world_size=ctx.world_size, on_rebalance=cfg.on_rebalance, device=device)
    for step in range(start.step + 1, cfg.steps + 1):
        maybe_die("step", step=step, rank=ctx.rank)
        micro = [next(batches) for _ in range(cfg.grad_accum_steps)]
        result = train_step(
            prepared, optimizer, scheduler, micro, cfg=cfg, mode=layout.mode, world_size=ctx.world_size, device=device
        )
        beat(step)
        decision = agree(step)  # a notice on any rank: every rank saves after this same step
        tally.done += 1
        work = [batch_work(mb, model.config, adapters=adapters) for mb in micro]  # on the host, while the device works
        window.add(sum(t for t, _ in work), sum(f for _, f in work))
        ctx.settle()  # a checkpoint still being written or uploaded goes on (reported, then marked complete)

        record = None
        eval_due = held_out is not None and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0))
        if eval_due or step == start.step + 1 or step % cfg.log_every == 0 or step == cfg.steps:
            loss, grad_norm = logged_loss(result, ctx.world_size)
            _sync(device)
            if step == start.step + 1:  # what starting costs, compiling included: the cache of compiled code cuts it
                tally.first_step_s = time.perf_counter() - began
                held = "model start, compiling and the step" if prepared.compiled else "model start and the step"
                ctx.emit(Note(f"first step: done {tally.first_step_s:.1f} s after training started ({held})"))
            tally.losses[step] = loss
            step_time, tps, flops_per_s = window.close(*_all_ranks(window, device))
            if eval_due and held_out is not None:  # after the window's timing: left out of throughput, like checkpoints
                t = time.perf_counter()
                tally.last_eval = held_out.evaluate(model, prepared.output_weight, device)
                tally.eval_s += time.perf_counter() - t
            record = StepRecord(
                step=step,
                loss=loss,
                lr=scheduler.get_last_lr()[0],
                grad_norm=grad_norm,
                tokens=_through(window.trained, done=tally.done, before=start.step),
                tokens_per_s=tps,
                step_time_s=step_time,
                mfu=mfu(
                    tokens_per_s=tps,
                    flops_per_token=flops_per_s / tps if tps else 0.0,
                    peak_flops=peak,
                    devices=ctx.world_size,
                ),
                resumed_from_step=start.from_step,
                **(tally.last_eval if eval_due else {}),
            )
            ctx.emit(record)
        if fabric_require != "any" and (tally.fabric is None or tally.fabric["action"] == "look-again"):
            last_look = tally.fabric is not None
            tally.fabric, nccl_lines = check_transport(
                fabric_require,
                rank=ctx.rank,
                world_size=ctx.world_size,
                node=ctx.node,
                last_look=last_look,
                require_full_efa=fabric_require_full_efa,
                instance_type=fabric_instance_type,
            )
            ctx.emit(FabricLook(tally.fabric, nccl_lines))
            if tally.fabric["action"] == "stop":
                break
        if decision or step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            save(step, record)
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
    samples_start = time.perf_counter()
    finished = tally.preempted is None and (tally.fabric is None or tally.fabric.get("met") is not False)
    if sample_prompts and cfg.sample_tokens and finished:
        samples = greedy_samples(
            model,
            prepared.output_weight,
            load_tokenizer(model_path),
            sample_prompts,
            max_new_tokens=cfg.sample_tokens,
            device=device,
        )
        ctx.emit(Samples(samples))
    tally.samples_s = time.perf_counter() - samples_start
    summary = run_summary(
        cfg,
        ctx,
        prepared,
        layout=layout,
        precision=precision,
        start=start,
        tally=tally,
        window=window,
        fabric_require=fabric_require,
        peak=peak,
    )
    if tally.preempted is not None:
        summary.update(preempted_summary(tally.preempted, tally.stalls[-1]))
    if tally.stalls:
        most, mean = summary["checkpoint_stall_s_max"], summary["checkpoint_stall_s_mean"]
        saved = len(tally.stalls)
        ctx.emit(Note(f"checkpoints: {saved} saved; training waited at most {most:.2f} s (mean {mean:.2f} s)"))
    ctx.finish(summary)
    stager.close()  # after finish: the last save's write is done
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
