"""Training throughput of the Qwen2.5-1.5B architecture on one GPU, per setting: tokens/s, MFU and peak memory.

The model is built from its configuration alone (random weights, nothing downloaded) and trained in bf16 on random
token ids with the job's own parts: the AdamW and schedule of ``train.loop.build_optimizer`` (fused on CUDA),
``train.sharding.apply_fsdp`` (bf16 parameters, fp32 gradient reduction) for the FSDP settings, and
``train.model.chunked_cross_entropy`` / ``compile_layers`` for the chunked loss and compiled layers. Settings:

- ``plain`` or ``fsdp``: no wrapper (bf16 autocast over fp32 weights), or FSDP2 over a one-rank process group;
- ``+compile``: every decoder layer compiled with the inductor before sharding;
- ``+chunk``: the loss projects to the vocabulary a chunk of tokens at a time instead of full fp32 logits.

Each setting runs in its own process (fresh allocator, fresh compile cache), ``--steps`` optimizer steps of which
the first ``--warmup`` are left out; the step time is the median of the others (each ends with a device sync).
MFU = tokens/s x FLOPs per token (``train.flops``: 6 N + 12 L H T) / the device's dense bf16 peak. Settings that
would start after ``--budget-s`` are skipped and named. Example::

    python benchmarks/bench_gpu_step.py                       # on a GPU machine: 8 settings, under 8 minutes
    python benchmarks/bench_gpu_step.py --tiny --steps 6 --warmup 2 --settings plain,fsdp+chunk   # CPU check

Human-readable lines first, then one JSON line with every figure (``--json-out FILE`` also writes it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from raytrain_eks.train.memory import KNOWN_CONFIGS

SETTINGS = (
    "plain",
    "plain+chunk",
    "plain+compile",
    "plain+compile+chunk",
    "fsdp",
    "fsdp+chunk",
    "fsdp+compile",
    "fsdp+compile+chunk",
)

# Qwen/Qwen2.5-1.5B's config.json, the fields that shape the network (kept once, in the memory estimate's table).
QWEN25_15B = KNOWN_CONFIGS["Qwen/Qwen2.5-1.5B"]
# A small network of the same family, for checking the script on a CPU.
TINY = {
    **QWEN25_15B,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from: {', '.join(SETTINGS)}")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per setting (default 30)")
    p.add_argument("--warmup", type=int, default=8, help="first steps left out of the timing (default 8)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (default 2048)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per step (default 4)")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no setting after this many seconds")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family (checks on CPU)")
    p.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [s for s in args.settings.split(",") if s not in SETTINGS]
    if bad:
        p.error(f"unknown setting(s) {', '.join(bad)}; choose from {', '.join(SETTINGS)}")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_setting(setting: str, args: argparse.Namespace) -> dict[str, Any]:
    """One setting, in this process: build, (compile), (shard), train ``args.steps`` steps; return its figures."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, Qwen2Config

    from raytrain_eks.config import TrainingConfig
    from raytrain_eks.train.flops import flops_per_token, mfu, peak_flops_for
    from raytrain_eks.train.loop import build_optimizer
    from raytrain_eks.train.memory import LOSS_CHUNK_LOGITS
    from raytrain_eks.train.model import chunked_cross_entropy, compile_layers, output_projection_deferred
    from raytrain_eks.train.sharding import apply_fsdp

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    # bf16 on GPUs; on a CPU, fp32 (a CPU without native bf16 emulates its matrix multiplications).
    precision = "bf16" if cuda else "fp32"
    shape = {k: v for k, v in (TINY if args.tiny else QWEN25_15B).items() if k != "model_type"}
    config = Qwen2Config(**shape, use_cache=False)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parts = set(setting.split("+"))
    if "compile" in parts:
        compile_layers(model)
    weight = output_projection_deferred(model) if "chunk" in parts else None
    if "fsdp" in parts:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, device_id=device if cuda else None)
        apply_fsdp(model, precision=precision)
    optimizer, scheduler = build_optimizer(model, TrainingConfig(steps=args.steps), device)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if "fsdp" not in parts and precision == "bf16"
        else contextlib.nullcontext()
    )
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    times = []
    for step in range(args.steps):
        if step == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        with autocast:
            out = model(input_ids=ids).logits
        if weight is not None:
            loss = chunked_cross_entropy(out[:, :-1], weight(), ids[:, 1:], max_logits=LOSS_CHUNK_LOGITS)
        else:
            loss = F.cross_entropy(out[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        (loss / ids[:, 1:].numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times[args.warmup :])
    tokens_per_s = args.batch_size * args.seq_len / step_s
    fpt = flops_per_token(config, args.seq_len)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    figures = {
        "setting": setting,
        "device": name,
        "precision": precision,
        "step_time_s": round(step_s, 4),
        "first_step_s": round(times[0], 2),
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": mfu(
            tokens_per_s=tokens_per_s, flops_per_token=fpt, peak_flops=peak_flops_for(name, precision), devices=1
        ),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
        "final_loss": round(float(loss) / ids[:, 1:].numel(), 4),
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_setting(args.child, args)), flush=True)
        return 0
    start = time.monotonic()
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    shape = "2-layer Qwen2 (tiny)" if args.tiny else "Qwen2.5-1.5B architecture (random weights)"
    print(f"{shape}, batch {args.batch_size} x seq {args.seq_len}, {args.steps} steps ({args.warmup} warm-up)")
    for setting in args.settings.split(","):
        if time.monotonic() - start > args.budget_s:
            skipped.append(setting)
            continue
        child = [sys.executable, __file__, "--child", setting, *[a for a in (argv or sys.argv[1:])]]
        proc = subprocess.run(child, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            results.append({"setting": setting, "error": " | ".join(tail)})
            print(f"  {setting:<22} failed: {' | '.join(tail)}")
            continue
        r = json.loads(lines[-1])
        results.append(r)
        mfu_text = "—" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = "—" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f} GiB"
        print(
            f"  {setting:<22} {r['tokens_per_s']:>10,.0f} tokens/s  step {r['step_time_s']:.3f} s  MFU {mfu_text:>6}"
            f"  peak {mem:>9}  (first step {r['first_step_s']} s)"
        )
    if skipped:
        print(f"  skipped after --budget-s {args.budget_s:.0f}: {', '.join(skipped)}")
    print(f"total {time.monotonic() - start:.0f} s")
    line = json.dumps(
        {"results": results, "skipped": skipped, "args": {k: v for k, v in vars(args).items() if k != "child"}}
    )
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
