"""The checks only a GPU can answer, in one command (under 8 minutes on one H200), JSON out.

1. ``default_job``: ``raytrain-eks train`` on its built-in defaults, as a user runs it first (Ray, the built-in
   model and data): its summary (steps, losses, precision, attention implementation, device, peak memory).
2. ``qwen_step``: the job's own loop (``train.torchrun_entry.run``, one rank, random data) on the Qwen2.5-1.5B
   architecture (random weights saved to a folder, nothing downloaded) in bf16 at seq 2048: the attention
   implementation it ran with (``training.attention`` auto: flash_attention_2 where flash-attn is installed),
   tokens/s, MFU, the peak allocated and reserved memory against ``train.memory``'s estimate, and the host-device
   syncs the run made (``torch.cuda.set_sync_debug_mode("warn")``): in all, inside ``train_step`` (meant to be
   none: only the logging steps, start and the end's checkpoint wait for the device) and by where they came from.
   It fails when a sync happens inside ``train_step``, when the estimate is more than 15% off the allocated peak,
   or when the allocator reserved more than the fit rule's margin over the estimate (:func:`judge_memory`).
3. ``nccl_gate``: a one-rank NCCL all-reduce with the job's own NCCL environment (``train.fabric_gate.nccl_env``:
   ``NCCL_DEBUG=INFO`` into the file the in-job gate reads), its lines read by the gate's reader and judged by
   the gate (``check_transport``; a one-node job must go on) and by the tool's analyzer (verdict and basis). It
   fails when NCCL wrote no line there or the gate would stop.
4. ``chunked_loss``: ``train.model.chunked_cross_entropy`` against the plain fp32 cross-entropy over full logits
   on the device, in bf16 at the real vocabulary: the loss and both gradients, largest relative difference; it
   fails beyond rounding (:data:`CHUNKED_LIMITS`).

5. ``packed_attention``: a packed batch (``packing: documents``) through the attention the job chooses on this
   device (``training.attention`` auto: flash-attention's variable-length kernel, the batch in one row with the
   documents' bounds, on a bf16 GPU with flash-attn), each document's loss inside it against the same document
   alone through sdpa, on a small random Qwen2. It fails when a document's loss is off beyond rounding
   (:data:`PACKED_LIMITS`), or when the same batch without positions (documents seeing each other) is not, which
   would mean the check cannot tell.

``--tiny`` runs the same checks on a CPU with small shapes (the built-in model, fp32 where a CPU lacks bf16, the
NCCL check skipped with its reason), so the script itself is tested without a GPU. Example::

    python benchmarks/gpu_check.py                 # on a GPU machine
    python benchmarks/gpu_check.py --tiny          # anywhere: checks the script

Each check runs in its own process (fresh allocator, its own process group); one that fails is reported with its
error and the others still run. Human-readable lines first, then one JSON line (``--json-out FILE`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_gpu_step import QWEN25_15B, _free_port  # the same folder: run as a script

# The allocator setting the job's GPU workers start with (train.launch.CUDA_ALLOC_CONF), before torch meets CUDA
# here: the loop check's reserved memory is then what the job's would be.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

CHECKS = (
    "default_job",
    "qwen_step",
    "nccl_gate",
    "chunked_loss",
    "packed_attention",
    "loss_kernels",
    "memory_modes",
    "job_step",
    "best_setting",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, from: {', '.join(CHECKS)}")
    p.add_argument("--tiny", action="store_true", help="small shapes on any device (checks the script on a CPU)")
    p.add_argument("--seq-len", type=int, default=2048, help="qwen_step: tokens per sample (default 2048)")
    p.add_argument("--batch-size", type=int, default=2, help="qwen_step: samples per step (default 2)")
    p.add_argument("--steps", type=int, default=12, help="qwen_step: optimizer steps (default 12)")
    p.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [c for c in args.checks.split(",") if c not in CHECKS]
    if bad:
        p.error(f"unknown check(s) {', '.join(bad)}; choose from {', '.join(CHECKS)}")
    return args


def _one_rank(backend: str, device: Any = None) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend, rank=0, world_size=1, device_id=device)


class SyncLedger:
    """Where the host waited for the device: each ``set_sync_debug_mode("warn")`` warning, counted by the innermost
    frame of this project's code (and the innermost frame of all, when that is elsewhere), and how many came from
    inside ``train_step`` (a step that does not log is meant to make none)."""

    def __init__(self) -> None:
        self.total = 0
        self.in_steps = 0
        self.sources: dict[str, int] = {}

    def record(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None):
        if "synchroniz" not in str(message):
            return
        import traceback

        frames = [f for f in traceback.extract_stack()[:-1] if Path(f.filename).name != "warnings.py"]
        ours = [f for f in frames if "raytrain_eks" in f.filename]
        where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in ours[-1:] + frames[-1:]]
        key = " <- ".join(dict.fromkeys(reversed(where))) or f"{filename}:{lineno}"
        self.total += 1
        self.in_steps += any(f.name == "train_step" for f in ours)
        self.sources[key] = self.sources.get(key, 0) + 1

    def top(self, n: int) -> dict[str, int]:
        return dict(sorted(self.sources.items(), key=lambda kv: -kv[1])[:n])


def check_default_job(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``raytrain-eks train`` on the built-in defaults (``--tiny``: 4 steps), in its own folder."""
    out = work / "default-run"
    argv = [sys.executable, "-m", "raytrain_eks.cli", "train", "--output-dir", str(out)]
    if args.tiny:
        argv += ["--steps", "4"]
    t = time.perf_counter()
    proc = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"train exited {proc.returncode}: {' | '.join(tail)}")
    s = json.loads((out / "summary.json").read_text())
    keep = ("steps", "first_loss", "final_loss", "precision", "attention", "sharding", "device", "world_size")
    keep += ("tokens_per_s",)
    return {
        **{k: s.get(k) for k in keep},
        "peak_memory_gib": s.get("peak_memory_gib"),
        "peak_reserved_gib": s.get("peak_reserved_gib"),
        "wall_s": round(wall, 1),
    }


def check_qwen_step(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The job's loop on one rank: its summary, the estimate beside the measured peak, the syncs it made."""
    import warnings

    import torch

    from raytrain_eks.config import BUILTIN_MODEL, RANDOM_DATA, TrainingConfig
    from raytrain_eks.train.memory import estimate, shape_from_config
    from raytrain_eks.train.torchrun_entry import run

    cuda = torch.cuda.is_available()
    if args.tiny:
        model_id, seq, batch, steps = BUILTIN_MODEL, 64, 2, 4
    else:
        from transformers import AutoModelForCausalLM, Qwen2Config

        folder = work / "qwen2.5-1.5b-random"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(
            Qwen2Config(**{k: v for k, v in QWEN25_15B.items() if k != "model_type"}), dtype=torch.float32
        ).save_pretrained(folder)
        model_id, seq, batch, steps = str(folder), args.seq_len, args.batch_size, args.steps
    cfg = TrainingConfig(
        model_id=model_id,
        data=RANDOM_DATA,
        steps=steps,
        seq_len=seq,
        batch_size=batch,
        log_every=max(1, steps // 2),
        checkpoint_every=0,
        num_workers=1,
    )
    device = torch.device("cuda", 0) if cuda else None
    _one_rank("nccl" if cuda else "gloo", device)
    syncs = SyncLedger()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = syncs.record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        summary = run(cfg, work / "qwen-run")
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    from transformers import AutoConfig

    from raytrain_eks.train.model_source import resolve_model_path

    shape = shape_from_config(model_id, AutoConfig.from_pretrained(resolve_model_path(model_id)))
    est = estimate(
        shape,
        shard_ranks=1,
        precision=summary["precision"],
        micro_batch=batch,
        seq_len=seq,
        activation_checkpointing=False,
        attention=summary.get("attention") or "sdpa",  # what the run built the model with
    )
    reserved = summary.get("peak_reserved_gib")
    logging_steps = len((work / "qwen-run" / "metrics.jsonl").read_text().splitlines())  # the loop's own records
    found = {
        "model": "builtin tiny" if args.tiny else "Qwen2.5-1.5B architecture (random weights)",
        "seq_len": seq,
        "batch_size": batch,
        "steps": steps,
        "precision": summary["precision"],
        "attention": summary.get("attention"),  # the implementation the model was built with (training.attention)
        "device": summary["device"],
        "tokens_per_s": summary["tokens_per_s"],
        "step_time_s": summary["step_time_s"],
        "mfu": summary["mfu"],
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "peak_reserved_gib": reserved,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "estimate_gib": round(est.peak_gib, 3),
        "estimate_phase": est.phase,
        "estimate_over_reserved": round(est.peak_gib / reserved, 3) if reserved else None,
        "host_syncs": syncs.total if cuda else None,
        "host_syncs_in_steps": syncs.in_steps if cuda else None,
        "host_sync_sources": syncs.top(8) if cuda else None,
        "logging_steps": logging_steps,
    }
    problems = [judge_memory(est.peak_gib, summary.get("peak_memory_gib"), reserved)]
    if cuda and syncs.in_steps:  # the step reads nothing back (tests/test_host_syncs.py shows it on the meta device)
        problems.append(f"{syncs.in_steps} host syncs inside train_step, where none is expected")
    if any(problems):
        found["error"] = "; ".join(p for p in problems if p)
    return found


def judge_memory(estimate_gib: float, allocated_gib: float | None, reserved_gib: float | None) -> str | None:
    """What is wrong with the memory estimate against a run's measured peaks (``None``: nothing, or no GPU figures).

    The estimate is of allocated memory and must be within 15% of the measured peak; the run is admitted on the
    estimate times ``RESERVED_PER_ALLOCATED`` (plus fixed terms outside torch's reserve), so the allocator's reserve
    over the estimate must stay within that margin, else a device the estimate just fits could still run out."""
    from raytrain_eks.train.memory import RESERVED_PER_ALLOCATED

    problems = []
    if allocated_gib:
        off = estimate_gib / allocated_gib - 1
        if abs(off) > 0.15:
            problems.append(
                f"the estimate {estimate_gib:.2f} GiB is {off:+.0%} off the allocated peak {allocated_gib:.2f} GiB"
            )
    if reserved_gib and reserved_gib > estimate_gib * RESERVED_PER_ALLOCATED:
        problems.append(
            f"the allocator reserved {reserved_gib:.2f} GiB, {reserved_gib / estimate_gib:.2f} x the estimate: "
            f"more than the {RESERVED_PER_ALLOCATED:.2f} x margin the admission allows"
        )
    return "; ".join(problems) or None


def check_nccl_gate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A one-rank NCCL all-reduce, its INFO lines written to a file and judged by the tool's analyzer."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no GPU: NCCL runs on GPUs only"}
    import torch.distributed as dist

    from raytrain_eks.fabric.nccl_log import analyze
    from raytrain_eks.train.fabric_gate import check_transport, nccl_env, own_nccl_lines

    # The job's own environment (the file where the gate looks) and the gate's own reader and decision.
    os.environ.update(nccl_env(f"gpu-check-{os.getpid()}"), NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    _one_rank("nccl", device)
    t = torch.ones(1 << 20, device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    decision, _ = check_transport("efa", rank=0, world_size=1, node=socket.gethostname(), last_look=True)
    dist.destroy_process_group()
    lines = own_nccl_lines()
    report = analyze(lines, source=os.environ["NCCL_DEBUG_FILE"])
    verdict = {k: getattr(report, k) for k in ("verdict", "reason", "basis", "nccl_version", "world_size")}
    found = {"nccl_lines": len(lines), "all_reduce_ok": bool(t[0].item() == 1.0), **verdict}
    found |= {"gate_action": decision["action"], "gate_met": decision["met"]}
    if not lines:
        found["error"] = "NCCL wrote no line where the in-job gate reads them"
    elif decision["action"] != "continue" or not found["all_reduce_ok"]:
        found["error"] = f"the gate would {decision['action']} a one-node job: {decision['note']}"
    return found


def check_chunked_loss(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The chunked loss against the plain one over full fp32 logits, on the device: loss and gradients."""
    import torch
    import torch.nn.functional as F

    from raytrain_eks.train.model import chunked_cross_entropy

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    tokens, hidden, vocab = (256, 64, 4096) if args.tiny else (4096, 1536, 151936)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    h0 = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    w0 = (0.02 * torch.randn(vocab, hidden, device=device, generator=gen)).to(dtype)
    y = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    y[: tokens // 8] = -100

    def run(fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        return loss.detach().float(), h.grad.float(), w.grad.float()

    plain = run(lambda h, w: F.cross_entropy(F.linear(h, w).float(), y, reduction="sum"))
    chunked = run(lambda h, w: chunked_cross_entropy(h, w, y, max_logits=vocab * max(1, tokens // 9)))

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))

    found: dict[str, Any] = {
        "tokens": tokens,
        "vocab": vocab,
        "dtype": str(dtype).removeprefix("torch."),
        "chunks": 9,
        "loss_rel_diff": rel(chunked[0], plain[0]),
        "hidden_grad_rel_diff": rel(chunked[1], plain[1]),
        "weight_grad_rel_diff": rel(chunked[2], plain[2]),
    }
    wrong = judge_chunked(found)
    return found | ({"error": wrong} if wrong else {})


#: How far the chunked loss may be from the plain one, relatively: rounding only (bf16 keeps 8 bits of mantissa;
#: the H200 run gave 0.0 for the loss, 4.7e-3 and 2.4e-3 for the gradients).
CHUNKED_LIMITS = {"float32": {"loss": 1e-5, "grad": 1e-5}, "bfloat16": {"loss": 1e-3, "grad": 2e-2}}


def judge_chunked(found: dict[str, Any]) -> str | None:
    """What is wrong with :func:`check_chunked_loss`'s differences (``None``: within :data:`CHUNKED_LIMITS`)."""
    limits = CHUNKED_LIMITS[found["dtype"]]
    over = [
        f"{key} {found[key]:.1e} > {limits[kind]:.0e}"
        for key, kind in (("loss_rel_diff", "loss"), ("hidden_grad_rel_diff", "grad"), ("weight_grad_rel_diff", "grad"))
        if not found[key] <= limits[kind]
    ]
    return "the chunked loss is off the plain one: " + ", ".join(over) if over else None


#: How far a document's mean loss inside a packed batch may be from its loss alone, relatively: rounding only (the
#: two runs use different attention kernels, and bf16 keeps 8 bits of mantissa).
PACKED_LIMITS = {"float32": 1e-4, "bfloat16": 2e-2}


def check_packed_attention(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Each document's loss inside a packed batch, through the attention the job chooses here, against its loss
    alone through sdpa (the same weights); and the same batch without positions, where documents see each other."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from raytrain_eks.train.data.encoding import IGNORE_INDEX
    from raytrain_eks.train.data.packing import pack
    from raytrain_eks.train.model import choose_attention, forward_inputs, packing_told_by_host

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision, dtype = ("bf16", torch.bfloat16) if cuda else ("fp32", torch.float32)
    attention, why = choose_attention("auto", Qwen2ForCausalLM, cuda=cuda, precision=precision)
    seq, hidden = (64, 64) if args.tiny else (1024, 256)
    config = Qwen2Config(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * seq,
        initializer_range=0.3,  # weights large enough that what a token sees changes its loss
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype).to(device).eval()
    alone_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    alone_model.load_state_dict(model.state_dict())
    for m in (model, alone_model):  # as the job loads it (train.model.load_model): with a cache, transformers
        m.config.use_cache = False  # builds no mask from the positions and documents would see each other
    gen = torch.Generator().manual_seed(1)
    rows, total = [], 0
    while total < 2 * seq - seq // 4:  # two blocks, the last one partly padding
        n = int(torch.randint(seq // 8, seq // 2, (1,), generator=gen))
        ids = torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()
        rows.append((ids, ids))
        total += n
    batch = {k: torch.from_numpy(v) for k, v in pack(rows, seq_len=seq, pad_id=0, packing="documents").items()}
    labels = batch["labels"]

    def token_losses(m: Any, inputs: dict[str, Any], wanted: Any) -> Any:
        """The loss of predicting each next label (``wanted[:, 1:]``), per position, in fp32."""
        given = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        with packing_told_by_host("position_ids" in inputs):  # as the job's forward tells the mask code
            logits = m(**given).logits.float().reshape(*wanted.shape, -1)
        return F.cross_entropy(
            logits[:, :-1].transpose(1, 2), wanted[:, 1:].to(device), ignore_index=IGNORE_INDEX, reduction="none"
        ).cpu()

    with torch.no_grad():
        inside = token_losses(model, forward_inputs(batch, attention=attention), labels)
        seeing = token_losses(model, {"input_ids": batch["input_ids"]}, labels)  # no positions: one text per block
        diffs, leaks = [], []
        for b, positions in enumerate(batch["position_ids"]):
            starts = [*(positions == 0).nonzero().view(-1).tolist(), seq]
            for s, e in zip(starts, starts[1:], strict=False):
                trained = labels[b, s + 1 : e] != IGNORE_INDEX
                if not bool(trained.any()):
                    continue  # the tail's padding
                alone = token_losses(
                    alone_model, {"input_ids": batch["input_ids"][b : b + 1, s:e]}, labels[b : b + 1, s:e]
                )[0]
                mine, other, ref = (x[trained].mean() for x in (inside[b, s : e - 1], seeing[b, s : e - 1], alone))
                diffs.append(float((mine - ref).abs() / ref))
                leaks.append(float((other - ref).abs() / ref))
    limit = PACKED_LIMITS[str(dtype).removeprefix("torch.")]
    found: dict[str, Any] = {
        "attention": attention,
        "why": why,
        "dtype": str(dtype).removeprefix("torch."),
        "seq_len": seq,
        "documents": len(diffs),
        "max_doc_rel_diff": max(diffs),
        "without_positions_max_rel_diff": max(leaks),
        "limit": limit,
    }
    if not max(diffs) <= limit:
        found["error"] = (
            f"a document's loss inside the packed batch is {max(diffs):.1e} off its loss alone (> {limit:.0e})"
        )
    elif not max(leaks) > limit:
        found["error"] = "without positions the documents' losses barely change: this check cannot tell them apart"
    return found


def check_loss_kernels(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Each loss kernel that runs on this device (``training.loss_kernel``: plain, chunked, and fused by each
    installed library on CUDA) at the real vocabulary in bf16: forward and backward time, peak memory, and the loss
    and gradients against plain's. A kernel that cannot run here is listed with why."""
    import torch

    from raytrain_eks.errors import UserError
    from raytrain_eks.train.loss import FUSED_LIBRARIES, LossKernel, choose_loss_kernel

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    tokens, hidden, vocab = (256, 64, 4096) if args.tiny else (8192, 1536, 151936)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    h0 = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    w0 = (0.02 * torch.randn(vocab, hidden, device=device, generator=gen)).to(dtype)
    y = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    capability = torch.cuda.get_device_capability(device) if cuda else None
    kernels: dict[str, Any] = {"plain": LossKernel("plain"), "chunked": LossKernel("chunked")}
    found: dict[str, Any] = {"tokens": tokens, "vocab": vocab, "dtype": str(dtype).removeprefix("torch.")}
    for module in FUSED_LIBRARIES:
        from importlib.util import find_spec

        try:  # the selection's own refusal says why a fused kernel cannot run here
            choose_loss_kernel(
                "fused",
                device_type=device.type,
                capability=capability,
                transform=None,
                logits_fit=True,
                library=module if find_spec(module) else None,
            )
            kernels[f"fused:{module}"] = LossKernel("fused", library=module)
        except UserError as refused:  # reported, not raised
            found[f"fused:{module}"] = {"skipped": str(refused).split(": ", 1)[-1]}
    reference = None
    for name, kernel in kernels.items():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = kernel(h, w, y, max_logits=vocab * max(1, tokens // 9))
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        got = (loss.detach().float(), h.grad.float(), w.grad.float())
        reference = reference or got
        found[name] = {
            "ms": round(1000 * (time.perf_counter() - t), 2),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
            **{
                f"{what}_rel_diff": _rel(a, b)
                for what, a, b in zip(("loss", "hidden_grad", "weight_grad"), got, reference, strict=True)
            },
        }
    bad = [
        n
        for n, r in found.items()
        if isinstance(r, dict)
        and max(r.get("loss_rel_diff", 0), r.get("hidden_grad_rel_diff", 0)) > CHUNKED_LIMITS[found["dtype"]]["grad"]
    ]
    return found | ({"error": f"off the plain loss beyond rounding: {', '.join(bad)}"} if bad else {})


def _rel(a: Any, b: Any) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def check_memory_modes(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The job's loop on one rank for full fine-tuning, LoRA and LoRA with activation checkpointing: each one's
    estimate (``train.memory.check_fit``: the peak, and what the GPU must hold with the allocator's margin and the
    fixed terms) against the allocated and reserved peaks the run measured."""
    import torch

    from raytrain_eks.config import TrainingConfig
    from raytrain_eks.train.memory import check_fit, shape_from_config
    from raytrain_eks.train.torchrun_entry import run

    cuda = torch.cuda.is_available()
    model_id, seq, batch = _qwen_folder(args, work)
    _one_rank("nccl" if cuda else "gloo", torch.device("cuda", 0) if cuda else None)
    from transformers import AutoConfig

    from raytrain_eks.train.model_source import resolve_model_path

    shape = shape_from_config(model_id, AutoConfig.from_pretrained(resolve_model_path(model_id)))
    found: dict[str, Any] = {}
    for mode, method, ac in (("full", "full", False), ("lora", "lora", False), ("lora_ac", "lora", True)):
        cfg = TrainingConfig(
            model_id=model_id,
            data="random",
            steps=4,
            seq_len=seq,
            batch_size=batch,
            method=method,
            activation_checkpointing=ac,
            log_every=2,
            checkpoint_every=0,
            num_workers=1,
            compile="off",
            loss_kernel="chunked",
        )
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        summary = run(cfg, work / f"memory-{mode}")
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else 2**40
        check = check_fit(
            shape,
            gpu_bytes=gpu_bytes,
            gpu_name=summary["device"],
            shard_ranks=1,
            precision=summary["precision"],
            micro_batch=batch,
            seq_len=seq,
            activation_checkpointing=ac,
            lora=cfg.lora if method == "lora" else None,
            attention=summary.get("attention") or "sdpa",
        )
        reserved = summary.get("peak_reserved_gib")
        found[mode] = {
            "estimate_gib": round(check.estimate.peak_gib, 3),
            "estimate_reserved_gib": round(check.reserved_bytes / 2**30, 3),
            "peak_memory_gib": summary.get("peak_memory_gib"),
            "peak_reserved_gib": reserved,
            "estimate_over_reserved": round(check.estimate.peak_gib / reserved, 3) if reserved else None,
        }
        wrong = judge_memory(check.estimate.peak_gib, summary.get("peak_memory_gib"), reserved)
        if wrong:
            found.setdefault("error", []).append(f"{mode}: {wrong}")
    if "error" in found:
        found["error"] = "; ".join(found["error"])
    return found


def _qwen_folder(args: argparse.Namespace, work: Path) -> tuple[str, int, int]:
    """The model, sequence and micro-batch of the Qwen checks: Qwen2.5-1.5B's architecture with random weights saved
    to a folder (nothing downloaded), or the built-in model with ``--tiny``."""
    if args.tiny:
        return "builtin:tiny-qwen2", 64, 2
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    folder = work / "qwen2.5-1.5b-random"
    if not folder.exists():
        torch.manual_seed(0)
        config = Qwen2Config(**{k: v for k, v in QWEN25_15B.items() if k != "model_type"})
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        from raytrain_eks.train.builtin import ensure_builtin_model

        for name in os.listdir(ensure_builtin_model()):  # a tokenizer, which the job's run reads
            if name.startswith("tokenizer"):
                (folder / name).write_bytes((ensure_builtin_model() / name).read_bytes())
    return str(folder), args.seq_len, args.batch_size


def check_job_step(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``raytrain-eks train`` (Ray, one GPU worker) on the Qwen2.5-1.5B architecture at the goal's 4 x 2048 with every
    setting auto (compile, loss kernel), a checkpoint every 10 steps, twice in the same compile cache: the job's own
    step (tokens/s, MFU), the loss kernel it chose, what each save stalled the training thread, and the time to the
    first step with a cold cache and a warm one."""
    model_id, seq, _ = _qwen_folder(args, work)
    steps = 4 if args.tiny else 30
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}  # cold for the first run
    found: dict[str, Any] = {}
    for attempt in ("cold", "warm"):
        out = work / f"job-{attempt}"
        argv = [
            sys.executable,
            "-m",
            "raytrain_eks.cli",
            "train",
            "--output-dir",
            str(out),
            "--model",
            model_id,
            "--data",
            "random",
            "--steps",
            str(steps),
            "--seq-len",
            str(seq),
            "--batch-size",
            "4" if not args.tiny else "2",
            "--checkpoint-every",
            str(max(2, steps // 3)),
            "--set",
            "training.sample_tokens=0",
            "--set",
            "training.export=false",
            "--set",
            "training.num_workers=1",
        ]
        proc = subprocess.run(argv, cwd=work, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"train exited {proc.returncode}: {' | '.join(tail)}")
        s = json.loads((out / "summary.json").read_text())
        found[f"first_step_s_{attempt}"] = s.get("first_step_s")
        if attempt == "cold":
            keep = (
                "tokens_per_s",
                "mfu",
                "step_time_s",
                "compile",
                "loss_kernel",
                "loss_kernel_reason",
                "checkpoint_stall_s",
                "checkpoint_stall_s_max",
                "peak_memory_gib",
                "peak_reserved_gib",
                "device",
            )
            found |= {k: s.get(k) for k in keep}
            interval = (s.get("step_time_s") or 0) * 100
            stall = s.get("checkpoint_stall_s_max")
            found["stall_share_of_100_steps"] = round(stall / interval, 4) if stall and interval else None
    return found


def check_best_setting(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``bench_gpu_step``'s fastest settings at the same shape in this run (compiled, with and without FSDP), for the
    job's step to be compared with (``main``: ``job_over_best``)."""
    out = work / "gpu_step.json"
    argv = [
        sys.executable,
        str(Path(__file__).with_name("bench_gpu_step.py")),
        "--settings",
        "plain+compile,fsdp+compile",
        "--steps",
        "14",
        "--warmup",
        "4",
        "--json-out",
        str(out),
    ] + (["--tiny"] if args.tiny else [])
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench_gpu_step exited {proc.returncode}: {(proc.stderr or proc.stdout)[-300:]}")
    results = json.loads(out.read_text())["results"]
    best = max(results, key=lambda r: r.get("tokens_per_s") or 0)
    return {
        "settings": {r["setting"]: r.get("mfu") for r in results},
        "best": best["setting"],
        "best_tokens_per_s": best.get("tokens_per_s"),
        "best_mfu": best.get("mfu"),
    }


def job_over_best(results: dict[str, Any]) -> float | None:
    """The job's tokens/s over the best ``bench_gpu_step`` setting's in the same run (the goal: 0.9 or more)."""
    job, best = results.get("job_step", {}), results.get("best_setting", {})
    if not job.get("tokens_per_s") or not best.get("best_tokens_per_s"):
        return None
    return round(job["tokens_per_s"] / best["best_tokens_per_s"], 3)


def results_folder(day: str, device: str) -> Path:
    """Where a GPU run's files go: ``benchmarks/results/<day>-<gpu>``, the GPU by its model's word in the device's
    name (``NVIDIA H100 80GB HBM3`` is ``h100``). Example: ``results_folder("2026-12-08", "NVIDIA H200")``."""
    words = [w for w in device.upper().replace("-", " ").split() if w not in {"NVIDIA", "TESLA"}]
    gpu = (words[0] if words else "gpu").lower()
    return Path(__file__).resolve().parent / "results" / f"{day}-{gpu}"


def refusal_without_cuda(tiny: bool, cuda: bool) -> str | None:
    """Why the check will not run here: its figures are a GPU's (``--tiny`` checks the script on any device)."""
    if tiny or cuda:
        return None
    return (
        "gpu_check measures a GPU, and this machine has no CUDA device (torch.cuda.is_available() is False): run it "
        "on a GPU machine, or with --tiny to check the script here"
    )


RUNNERS = {
    "default_job": check_default_job,
    "qwen_step": check_qwen_step,
    "nccl_gate": check_nccl_gate,
    "chunked_loss": check_chunked_loss,
    "packed_attention": check_packed_attention,
    "loss_kernels": check_loss_kernels,
    "memory_modes": check_memory_modes,
    "job_step": check_job_step,
    "best_setting": check_best_setting,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        with tempfile.TemporaryDirectory(prefix=f"gpu-check-{args.child}-") as work:
            print(json.dumps(RUNNERS[args.child](args, Path(work))), flush=True)
        return 0
    import torch

    refused = refusal_without_cuda(args.tiny, torch.cuda.is_available())
    if refused:
        print(refused, file=sys.stderr)
        return 2
    start = time.monotonic()
    results: dict[str, Any] = {}
    for name in args.checks.split(","):
        child = [sys.executable, __file__, "--child", name, *(argv if argv is not None else sys.argv[1:])]
        t = time.monotonic()
        proc = subprocess.run(child, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            results[name] = {"error": " | ".join(tail)}
        else:
            results[name] = json.loads(lines[-1])
        results[name]["check_s"] = round(time.monotonic() - t, 1)
        shown = ", ".join(f"{k}={v}" for k, v in results[name].items())
        print(f"{name}: {shown}", flush=True)
    print(f"total {time.monotonic() - start:.0f} s")
    failed = [n for n, r in results.items() if "error" in r]
    ratio = job_over_best(results)
    line = json.dumps({"tiny": args.tiny, "results": results, "job_over_best": ratio, "failed": failed})
    print(line)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    if not args.tiny:  # a GPU's figures, kept with the machine's description
        folder = results_folder(time.strftime("%Y-%m-%d"), torch.cuda.get_device_name(0))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "gpu_check.json").write_text(line + "\n")
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
        (folder / "env.txt").write_text(f"torch {torch.__version__}, CUDA {torch.version.cuda}\n{smi}")
        print(f"results: {folder}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
