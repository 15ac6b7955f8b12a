"""What sharded checkpoints cost on this machine: save, load and Hugging Face export by model size, and the share
of a training run spent checkpointing.

Part 1, by model size (Qwen2 configs of ~1M, ~25M, ~100M and ~250M parameters, each built with
``Qwen2ForCausalLM(config)``, written with ``save_pretrained`` and loaded through
:func:`raytrain_eks.train.model.load_model`, the training path):

- 2 processes (``torch.multiprocessing`` spawn, gloo on CPU, one intra-op thread each as under Ray), the model
  sharded as training does (``apply_fsdp(model, precision="bf16")``), AdamW and the warm-up + cosine schedule
  built as the loop builds them, and one optimizer step taken so the AdamW moments exist;
- **save**: :func:`save_sharded` on both ranks, a barrier, then :func:`mark_complete` on rank 0, as
  ``ProcessContext.save_checkpoint`` does (without its pruning of older checkpoints); timed on rank 0 from a
  barrier before to the marker written. Every repeat writes a new folder (the DCP writer fsyncs its files, so this
  is the time to durable files);
- **Ray's copy** (once per size): under Ray each rank writes into a local staging folder that ``ray.train.report``
  then copies into the run's storage (``pyarrow.fs.copy_files``), inside the loop's checkpoint time. Each rank
  copies the files it wrote, concurrently, as Ray would; shown as what Ray adds to a save;
- **load**: :func:`load_sharded` into a freshly loaded and sharded model with a fresh optimizer (what a resume
  does; the model build is not timed), timed from a barrier before to a barrier after. Before each load the
  checkpoint's pages are dropped from the page cache (``posix_fadvise(DONTNEED)``; the files are clean after the
  fsync), so the load reads from disk; ``--hot`` keeps them cached. Each load is checked: the weights' and AdamW
  moments' local shards must equal those that were saved;
- **export**: :func:`export_hf` of the last checkpoint in this (single) process, to safetensors, page cache
  dropped likewise;
- the checkpoint's size on disk and MB/s (10^6 bytes per second) for save, load and export (of the bytes read).

Part 2, the share of a run spent checkpointing: the default local job (``local_tiny`` preset, embedded Ray, 2
CPU workers) once, ``summary["checkpoint_s"] / summary["train_s"]`` (the loop's time includes its saves), with
the default ``checkpoint_every``. Then an **estimate** for the reference preset (``TrainingConfig()``:
``checkpoint_every`` 50 of 100 steps): the largest (last) size's measured save time against that model's step
time on the same 2 processes at the reference's shape (2 x 1024 tokens per rank), estimated from steps of
1 x 512 and 1 x 1024 tokens: linear in tokens, within the bounds t(1 x 1024) .. 2 x t(1 x 1024), both shown.
``--step-time-s`` replaces it with a known step time, e.g. one measured on GPUs. Shown without and with Ray's
copy.

Example::

    .venv/bin/python benchmarks/bench_checkpoint.py                  # ~3 min on 2 idle cores, < 10 GiB RAM
    .venv/bin/python benchmarks/bench_checkpoint.py --sizes tiny,25m --repeats 2 --skip-run

Human-readable lines first, then one JSON line with every figure (``--json-out FILE`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raytrain_eks.train.builtin import _RECIPE as BUILTIN_RECIPE

WORLD_SIZE = 2
MB = 1e6
FIRST_STEP_SEQ_LEN = 32  # the step that creates the AdamW moments: short, it is not what is measured
ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)

# name -> Qwen2Config fields. "tiny" is the built-in model's recipe, read from it; the others are scaled up with
# a Qwen-like vocabulary, tied embeddings (as Qwen2.5-0.5B/1.5B) and grouped-query attention.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {k: BUILTIN_RECIPE[k] for k in ARCH_FIELDS},
    "25m": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=7,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
    "250m": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=18,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
}


def probe_seq_lens() -> list[int]:
    """Step-time probes (batch 1 per rank): half the reference's sequence length and the whole of it."""
    from raytrain_eks.config import TrainingConfig

    seq = TrainingConfig().seq_len
    return [seq // 2, seq]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)} (default all)")
    p.add_argument("--repeats", type=int, default=3, help="saves, loads and exports per size; median shown (3)")
    p.add_argument("--hot", action="store_true", help="load and export from the page cache (default: from disk)")
    p.add_argument(
        "--step-time-s",
        type=float,
        default=None,
        help="step time for the reference estimate instead of the one measured here (e.g. a GPU step time)",
    )
    p.add_argument("--skip-run", action="store_true", help="skip part 2's training run (the Ray job)")
    p.add_argument("--tmp-dir", type=Path, default=None, help="where checkpoints go (default: the system temp dir)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the final JSON to this file")
    args = p.parse_args(argv)
    args.size_list = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in args.size_list if s not in SIZES]
    if unknown or not args.size_list:
        p.error(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    args.probe_lens = probe_seq_lens()
    return args


# ------------------------------------------------------------------------------------------------ helpers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def drop_page_cache(folder: Path) -> None:
    """Evict ``folder``'s files from the page cache (clean pages only; DCP fsyncs what it writes)."""
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cpu_ticks() -> list[int] | None:
    """The machine's CPU time so far (``/proc/stat``: user nice system idle iowait irq softirq steal), or None."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None


def cpu_shares(start: list[int] | None, end: list[int] | None) -> dict[str, float] | None:
    """Busy, I/O-wait and steal (time the hypervisor gave to others) in % of all CPU time between two samples."""
    if not start or not end:
        return None
    d = [b - a for a, b in zip(start, end, strict=True)]
    total = sum(d) or 1
    return {
        "busy_pct": 100 * (total - d[3] - d[4] - d[7]) / total,
        "iowait_pct": 100 * d[4] / total,
        "steal_pct": 100 * d[7] / total,
    }


class OutsideCpu:
    """CPU used by everything but this process and its reaped children (the 2 ranks), in cores, over a window.

    On a 2-core machine the 2 ranks need both cores; anything else running (other users' jobs, kernel threads
    flushing writes) shows here and slows the figures down. Linux only; ``cores()`` is None elsewhere.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        ticks = cpu_ticks()
        if ticks is None:
            return None
        busy = (sum(ticks) - ticks[3] - ticks[4] - ticks[7]) / os.sysconf("SC_CLK_TCK")
        own = sum(
            ru.ru_utime + ru.ru_stime
            for ru in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
        )
        return time.perf_counter(), busy, own

    def cores(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._start, end
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(1e-9, t1 - t0)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def make_model(name: str, folder: Path, tokenizer_src: Path) -> int:
    """Write the Qwen2 model ``name`` (random weights, fp32) and the built-in tokenizer into ``folder``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    config = Qwen2Config(
        **SIZES[name],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del model
    gc.collect()
    return n


# ------------------------------------------------------------------------------------------ worker (2 ranks)


def _build(model_path: str) -> tuple[Any, Any, Any]:
    """Model, optimizer and schedule exactly as :func:`raytrain_eks.train.loop.train` builds them (CPU)."""
    from raytrain_eks.config import TrainingConfig
    from raytrain_eks.train.loop import build_optimizer
    from raytrain_eks.train.model import load_model
    from raytrain_eks.train.sharding import apply_fsdp

    cfg = TrainingConfig()
    model = load_model(model_path, activation_checkpointing=cfg.activation_checkpointing)
    apply_fsdp(model, precision="bf16")
    optimizer, scheduler = build_optimizer(model, cfg)
    return model, optimizer, scheduler


def _train_step(model: Any, optimizer: Any, scheduler: Any, *, step: int, rank: int, seq_len: int) -> float:
    """One optimizer step as the loop takes it (batch 1 per rank, random ids); its wall time on this rank."""
    import torch
    import torch.nn.functional as F

    from raytrain_eks.train.data.pipeline import random_batch

    t0 = time.perf_counter()
    mb = random_batch(
        seed=0,
        step=step,
        micro=0,
        rank=rank,
        world_size=WORLD_SIZE,
        batch_size=1,
        seq_len=seq_len,
        vocab_size=model.config.vocab_size,
    )
    logits = model(input_ids=mb["input_ids"]).logits
    loss = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), mb["labels"][:, 1:].reshape(-1), reduction="mean"
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _fingerprint(model: Any, optimizer: Any) -> list[float]:
    """Float64 sums of this rank's shards of every weight and AdamW moment (bit-exact restores match exactly)."""
    import torch

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    out = []
    with torch.no_grad():
        for p in model.parameters():
            out.append(float(local(p).double().sum()))
            st = optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                out.append(float(local(st[key]).double().sum()) if key in st else float("nan"))
    return out


def _ray_copy(folder: Path, dest: Path, rank: int) -> float:
    """What ``ray.train.report`` adds under Ray: each rank copies its own staged files into the run's storage.

    ``RayContext.save_checkpoint`` has every rank write into a local staging folder, then Ray copies that folder
    (``pyarrow.fs.copy_files``, as Ray does) into storage; in a run both happen in the background while training
    goes on (its ``checkpoint_done_s``), measured here in the foreground. Here each rank copies
    the files it wrote (rank 0 also ``.metadata`` and ``hf/``), concurrently; timed from barrier to barrier.
    """
    import pyarrow.fs as pafs
    import torch.distributed as dist

    mine = [f"__{rank}_", f"trainer_rank{rank:05d}"] + ([".metadata", "hf"] if rank == 0 else [])
    local = pafs.LocalFileSystem()
    dest.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    t = time.perf_counter()
    for item in sorted(folder.iterdir()):
        if any(item.name.startswith(prefix) for prefix in mine):
            if item.is_dir():  # as Ray's upload: create the folder, then copy into it
                (dest / item.name).mkdir(parents=True, exist_ok=True)
            pafs.copy_files(str(item), str(dest / item.name), source_filesystem=local, destination_filesystem=local)
    dist.barrier()
    took = time.perf_counter() - t
    if rank == 0:
        shutil.rmtree(dest.parent)
    return took


def worker(rank: int, spec: dict[str, Any]) -> None:
    """One of the 2 ranks of one model size; rank 0 writes the figures to ``spec["result"]``."""
    try:
        _worker(rank, spec)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Leave without the interpreter's shutdown (as raytrain_eks.train.torchrun_entry does): gloo's threads can
    # abort the process while it finalizes, failing a run that did all its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank: int, spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from raytrain_eks.train.checkpoint import checkpoint_name, load_sharded, mark_complete, save_sharded

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=WORLD_SIZE)
    model_path, root, repeats = spec["model_path"], Path(spec["root"]), spec["repeats"]
    res: dict[str, Any] = {}
    torch.manual_seed(0)

    t = time.perf_counter()
    model, optimizer, scheduler = _build(model_path)
    res["build_s"] = time.perf_counter() - t
    step = 1
    res["first_step_s"] = _train_step(model, optimizer, scheduler, step=step, rank=rank, seq_len=FIRST_STEP_SEQ_LEN)
    if spec["probe"]:  # the faster of two steps at each of two shapes (after the first), for the estimate
        probes = {}
        for seq_len in spec["probe_lens"]:
            times = []
            for _ in range(2):
                step += 1
                times.append(_train_step(model, optimizer, scheduler, step=step, rank=rank, seq_len=seq_len))
            probes[seq_len] = min(times)
        res["probe_step_s"] = probes
    saved = _fingerprint(model, optimizer)

    save_s, folder = [], root
    for r in range(repeats):
        if r:  # keep one checkpoint only (disk), outside the timing
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder)
        folder = root / checkpoint_name(step + r)
        if rank == 0:  # start from a clean page cache: no earlier writes still being flushed during the save
            os.sync()
        dist.barrier()
        t = time.perf_counter()
        save_sharded(
            folder,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            step=step,
            data_position={"step": step},
            rank=rank,
            tokenizer_path=model_path,
        )
        dist.barrier()  # every rank's files are in place (ProcessContext.save_checkpoint)
        if rank == 0:
            mark_complete(folder, step=step, world_size=WORLD_SIZE)
        save_s.append(time.perf_counter() - t)
    res["save_s"] = save_s
    res["folder"] = str(folder)
    res["ray_copy_s"] = _ray_copy(folder, root / "ray-storage" / folder.name, rank)
    del model, optimizer, scheduler
    gc.collect()

    load_s, restored = [], True
    for _ in range(repeats):
        model, optimizer, scheduler = _build(model_path)
        dist.barrier()
        if rank == 0:
            os.sync()
            if not spec["hot"]:
                drop_page_cache(folder)
        dist.barrier()
        t = time.perf_counter()
        state = load_sharded(folder, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
        dist.barrier()
        load_s.append(time.perf_counter() - t)
        restored = restored and state.step == step and _fingerprint(model, optimizer) == saved
        del model, optimizer, scheduler
        gc.collect()
    res["load_s"] = load_s
    ok = torch.tensor([1.0 if restored else 0.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    res["restored"] = bool(ok.item() == 1.0)
    rss = [None] * WORLD_SIZE
    dist.all_gather_object(rss, peak_rss_gib())
    res["peak_rss_gib"] = rss
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- part 1


def bench_size(name: str, args: argparse.Namespace, tmp: Path, tokenizer_src: Path, probe: bool) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from raytrain_eks.train.export import export_hf

    model_dir = tmp / f"model-{name}"
    load_avg = [os.getloadavg()[0]]
    outside = OutsideCpu()
    t = time.perf_counter()
    n_params = make_model(name, model_dir, tokenizer_src)
    make_s = time.perf_counter() - t
    print(
        f"  {name}: {n_params / 1e6:.1f}M parameters ({4 * n_params / MB:.0f} MB fp32), "
        f"built and saved in {make_s:.1f} s; 2 ranks ..."
    )
    spec = {
        "model_path": str(model_dir),
        "root": str(tmp / f"ckpt-{name}"),
        "repeats": args.repeats,
        "hot": args.hot,
        "probe": probe,
        "probe_lens": args.probe_lens,
        "threads": max(1, (os.cpu_count() or WORLD_SIZE) // WORLD_SIZE),
        "port": free_port(),
        "result": str(tmp / f"result-{name}.json"),
    }
    t = time.perf_counter()
    mp.spawn(worker, args=(spec,), nprocs=WORLD_SIZE, join=True)
    ranks_s = time.perf_counter() - t
    res = json.loads(Path(spec["result"]).read_text())
    folder = Path(res["folder"])
    size = folder_bytes(folder)
    dcp_bytes = sum(f.stat().st_size for f in folder.glob("*.distcp"))

    export_s, out_bytes = [], 0
    for r in range(args.repeats):
        out = tmp / f"export-{name}-{r}"
        if not args.hot:
            drop_page_cache(folder)
        t = time.perf_counter()
        export_hf(folder, out)
        export_s.append(time.perf_counter() - t)
        out_bytes = folder_bytes(out)
        shutil.rmtree(out)

    shutil.rmtree(folder.parent)
    shutil.rmtree(model_dir)
    load_avg.append(os.getloadavg()[0])
    outside_cores = outside.cores()

    save, load, export = statistics.median(res["save_s"]), statistics.median(res["load_s"]), statistics.median(export_s)
    row = {
        "size": name,
        "parameters": n_params,
        "config": SIZES[name],
        "checkpoint_mb": size / MB,
        "dcp_shards_mb": dcp_bytes / MB,
        "expected_mb": 12 * n_params / MB,  # fp32 weights + two fp32 AdamW moments
        "save_s": save,
        "load_s": load,
        "export_s": export,
        "save_mb_s": size / MB / save,
        "load_mb_s": size / MB / load,
        "export_mb_s": 4 * n_params / MB / export,
        "export_out_mb": out_bytes / MB,
        "save_runs_s": res["save_s"],
        "load_runs_s": res["load_s"],
        "export_runs_s": export_s,
        "restored": res["restored"],
        "peak_rss_gib_per_rank": res["peak_rss_gib"],
        "build_s": res["build_s"],
        "first_step_s": res["first_step_s"],
        "probe_step_s": res.get("probe_step_s"),
        "ray_copy_s": res["ray_copy_s"],
        "ranks_wall_s": ranks_s,
        "load_average": load_avg,  # 1-minute load average before and after this size
        "outside_cores": outside_cores,  # mean CPU used by other processes meanwhile
    }
    print(
        f"    checkpoint {row['checkpoint_mb']:8.1f} MB (weights+moments would be {row['expected_mb']:.1f} MB)  "
        f"save {save:6.2f} s {row['save_mb_s']:6.0f} MB/s   load {load:6.2f} s {row['load_mb_s']:6.0f} MB/s   "
        f"export {export:6.2f} s   restored: {'yes' if res['restored'] else 'NO'}"
    )
    print(
        "    runs: save "
        + ", ".join(f"{x:.2f}" for x in res["save_s"])
        + "  load "
        + ", ".join(f"{x:.2f}" for x in res["load_s"])
        + "  export "
        + ", ".join(f"{x:.2f}" for x in export_s)
        + f" s;  Ray's copy into storage would add {res['ray_copy_s']:.2f} s;"
        f"  peak RSS per rank {', '.join(f'{g:.2f}' for g in res['peak_rss_gib'])} GiB;  2-rank wall {ranks_s:.0f} s"
        + (f";  other processes used {outside_cores:.2f} cores meanwhile" if outside_cores is not None else "")
    )
    return row


# ----------------------------------------------------------------------------------------------- part 2


def checkpoints_in_run(steps: int, every: int) -> int:
    """Saves the loop makes: every ``every`` steps, and always after the last step."""
    periodic = steps // every if every else 0
    return periodic + (0 if every and steps % every == 0 else 1)


def run_default_job(tmp: Path) -> dict[str, Any]:
    import ray

    from raytrain_eks import presets
    from raytrain_eks.config import load_config
    from raytrain_eks.train.launch import run_training

    cfg = load_config(preset=presets.local_tiny(), environ={}, overrides={"training": {"output_dir": str(tmp / "run")}})
    t0 = time.perf_counter()
    try:
        result = run_training(cfg, runs_root=tmp, say=lambda m: print(f"    [{time.perf_counter() - t0:5.1f} s] {m}"))
    finally:
        ray.shutdown()
    s = result.summary
    t = cfg.training
    n = checkpoints_in_run(t.steps, t.checkpoint_every)
    out = {
        "preset": "local_tiny",
        "steps": t.steps,
        "checkpoint_every": t.checkpoint_every,
        "checkpoints_saved": n,
        "checkpoint_s": s["checkpoint_s"],
        "train_s": s["train_s"],
        "share_pct": 100 * s["checkpoint_s"] / s["train_s"],
        "per_checkpoint_s": s["checkpoint_s"] / n,
        "step_time_s": s.get("step_time_s"),
        "wall_s": s.get("wall_s"),
        "parameters": s.get("parameters"),
    }
    shutil.rmtree(result.run_dir, ignore_errors=True)
    return out


def reference_estimate(row: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from raytrain_eks.config import TrainingConfig

    ref = TrainingConfig()
    per_rank = ref.batch_size * ref.grad_accum_steps  # sequences per rank and step
    tokens = per_rank * ref.seq_len
    low = high = None
    if args.step_time_s is not None:
        step_s, source = args.step_time_s, "--step-time-s"
    else:
        # A step of `per_rank` sequences costs at least one of 1 sequence (t_full) and at most `per_rank` of them
        # (the fixed part, FSDP's gathers and the optimizer, counted once per sequence). The point estimate adds
        # the per-sequence cost (t_full - t_half) * 2, i.e. linear in tokens, kept inside those bounds.
        (half, t_half), (full, t_full) = sorted((int(k), v) for k, v in row["probe_step_s"].items())
        low, high = t_full, per_rank * t_full
        per_seq = (t_full - t_half) * full / (full - half)
        step_s = min(high, max(low, t_full + (per_rank - 1) * per_seq))
        source = (
            f"{row['size']} model on this machine's 2 CPU processes, faster of 2 steps at batch 1: {t_half:.2f} s at "
            f"{half} and {t_full:.2f} s at {full} tokens per rank; the reference's {per_rank} x {ref.seq_len} "
            f"tokens per rank: {step_s:.2f} s linear in tokens, bounds {low:.2f} .. {high:.2f} s"
        )
        if t_full <= t_half:
            source += " (the longer probe was not slower: noise; the point estimate is the lower bound)"
    save = row["save_s"]
    n = checkpoints_in_run(ref.steps, ref.checkpoint_every)
    out = {
        "model": row["size"],
        "parameters": row["parameters"],
        "save_s": save,
        "step_time_s": step_s,
        "step_time_source": source,
        "tokens_per_rank_step": tokens,
        "checkpoint_every": ref.checkpoint_every,
        "steps": ref.steps,
        "checkpoints_in_run": n,
        "interval_share_pct": 100 * save / (ref.checkpoint_every * step_s + save),
        # The step time at and above which a save costs under 1% of its interval.
        "step_time_for_1pct_s": save * 99 / ref.checkpoint_every,
        "run_share_pct": 100 * n * save / (ref.steps * step_s + n * save),
        "step_time_bounds_s": [low, high] if low is not None else None,
        # interval share at the upper and the lower step-time bound
        "interval_share_range_pct": (
            [100 * save / (ref.checkpoint_every * t + save) for t in (high, low)] if low is not None else None
        ),
    }
    if row.get("ray_copy_s") is not None:
        with_copy = save + row["ray_copy_s"]
        out["ray_copy_s"] = row["ray_copy_s"]
        out["interval_share_with_ray_copy_pct"] = 100 * with_copy / (ref.checkpoint_every * step_s + with_copy)
        out["run_share_with_ray_copy_pct"] = 100 * n * with_copy / (ref.steps * step_s + n * with_copy)
    return out


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    from raytrain_eks.train.builtin import ensure_builtin_model

    t_all, ticks0 = time.perf_counter(), cpu_ticks()
    load_avg = os.getloadavg()
    tokenizer_src = ensure_builtin_model()
    estimate_size = args.size_list[-1]  # parse_args refuses an empty --sizes
    print(
        f"benchmark: checkpoints of {', '.join(args.size_list)} with {WORLD_SIZE} gloo processes on "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {args.repeats} repeat(s) each (median shown), "
        f"loads and exports {'from the page cache' if args.hot else 'from disk (page cache dropped)'}"
    )
    rows: list[dict[str, Any]] = []
    run: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=args.tmp_dir) as tmp_name:
        tmp = Path(tmp_name)
        print("part 1: save / load / export by model size")
        for name in args.size_list:
            rows.append(bench_size(name, args, tmp, tokenizer_src, probe=name == estimate_size))
        if not args.skip_run:
            print("part 2: the default local job (local_tiny preset, Ray, 2 CPU workers)")
            try:
                run = run_default_job(tmp)
            except Exception as exc:  # part 1's figures still count: say what failed and report them
                run = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"    FAILED: {run['error']}")
    estimate = reference_estimate(rows[-1], args)

    print()
    print(
        f"{'size':>5} {'params':>8} {'ckpt MB':>9} {'save s':>7} {'MB/s':>6} {'load s':>7} {'MB/s':>6} "
        f"{'export s':>8} {'MB/s':>6} {'+ray copy s':>11}"
    )
    for r in rows:
        print(
            f"{r['size']:>5} {r['parameters'] / 1e6:7.1f}M {r['checkpoint_mb']:9.1f} {r['save_s']:7.2f} "
            f"{r['save_mb_s']:6.0f} {r['load_s']:7.2f} {r['load_mb_s']:6.0f} {r['export_s']:8.2f} "
            f"{r['export_mb_s']:6.0f} {r['ray_copy_s']:11.2f}"
        )
    print(
        "  (MB = 10^6 bytes; save = save_sharded + barrier + mark_complete on 2 ranks; load = load_sharded into a fresh"
        " model; export MB/s counts the fp32 weights read)"
    )
    if run and "error" not in run:
        print(
            f"default local job: {run['checkpoints_saved']} checkpoints (every {run['checkpoint_every']} of "
            f"{run['steps']} steps) took {run['checkpoint_s']:.2f} s of the loop's {run['train_s']:.2f} s  ->  "
            f"{run['share_pct']:.1f}% of training time checkpointing ({run['per_checkpoint_s']:.2f} s each; "
            f"step {1000 * (run['step_time_s'] or 0):.0f} ms)"
        )
    e = estimate
    print(
        f"ESTIMATE, reference preset (checkpoint_every {e['checkpoint_every']}, {e['steps']} steps): "
        f"{e['model']} save {e['save_s']:.2f} s vs step {e['step_time_s']:.2f} s  ->  "
        f"{e['interval_share_pct']:.2f}% of each {e['checkpoint_every']}-step interval, "
        f"{e['run_share_pct']:.2f}% of a {e['steps']}-step run ({e['checkpoints_in_run']} saves)"
    )
    print(f"  step time: {e['step_time_source']}")
    if e["interval_share_range_pct"]:
        lo, hi = e["interval_share_range_pct"]
        print(f"  over the step-time bounds the interval share is {lo:.2f}% .. {hi:.2f}%")
    print(
        f"  a save costs under 1% of its interval once a step takes {e['step_time_for_1pct_s']:.2f} s or more "
        f"(save s x 99 / {e['checkpoint_every']})"
    )
    if "ray_copy_s" in e:
        print(
            f"  with Ray's copy of the staged checkpoint into storage (+{e['ray_copy_s']:.2f} s): "
            f"{e['interval_share_with_ray_copy_pct']:.2f}% per interval, {e['run_share_with_ray_copy_pct']:.2f}% "
            "of the run"
        )
    wall, machine = time.perf_counter() - t_all, cpu_shares(ticks0, cpu_ticks())
    print(
        f"benchmark wall time {wall:.0f} s; peak RSS of this process {peak_rss_gib():.2f} GiB; load average at start "
        f"{load_avg[0]:.2f}"
        + (
            f"; CPU over the run: busy {machine['busy_pct']:.0f}%, I/O wait {machine['iowait_pct']:.0f}%, "
            f"steal {machine['steal_pct']:.1f}%"
            if machine
            else ""
        )
    )
    busiest = max((r["outside_cores"] for r in rows if r["outside_cores"] is not None), default=None)
    if busiest is not None and busiest > 0.2:
        print(
            f"  note: other processes used up to {busiest:.2f} of the {os.cpu_count()} cores while a size was measured "
            "(see 'other processes' above): the figures include their noise; rerun on an idle machine to trust them"
        )
    result = {
        "config": {
            "world_size": WORLD_SIZE,
            "cpus": os.cpu_count(),
            "repeats": args.repeats,
            "hot": args.hot,
            "torch": torch.__version__,
            "probe_seq_lens": args.probe_lens,
        },
        "sizes": rows,
        "default_job": run,
        "reference_estimate": estimate,
        "wall_s": wall,
        "load_average_at_start": load_avg[0],
        "machine_cpu": machine,
    }
    line = json.dumps(result)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
