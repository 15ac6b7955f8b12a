"""What checkpoints in S3 cost: save and resume through ``s3://`` storage (moto's S3 server on loopback), by model
size, and the share of a run they take.

For each size (``--sizes``: the Qwen2 configs of ``bench_checkpoint.py``, default 25m, see below), 2 processes
(gloo on CPU, one intra-op thread each, as under Ray) build the model as training does (``load_model``,
``apply_fsdp`` in fp32, AdamW and the schedule from ``build_optimizer``), take one optimizer step so AdamW's
moments exist, then, as ``RayContext`` does with ``training.storage_path: s3://...``:

- **save** = **write** (each rank :func:`save_sharded` into a local staging folder) + **upload** (each rank copies
  its staging folder into the checkpoint's S3 prefix with ``pyarrow.fs.copy_files``, as ``ray.train.report``
  does; concurrently) + the complete marker written to S3 by rank 0 after a barrier;
- **resume** = :func:`load_sharded` from the ``s3://`` URI into a fresh model and optimizer, as a worker's
  restore does: each rank downloads ``.metadata``, its trainer state and the byte ranges its load plan reads (its
  share, shown in MB), then loads. The restored weights and AdamW moments are checked against those saved.

Times are from barrier to barrier (the slower rank counts). The share of a run uses a step time measured here on
the same 2 processes (batch 1 x ``--seq-len`` tokens per rank, fp32; the median of 3 steps after the first), or
``--step-time-s`` (e.g. a GPU step time): a save every ``checkpoint_every`` steps of the default
``TrainingConfig`` (and one at the end), and one resume.

``--resume-sizes`` (default 25m) names the sizes whose resume is measured. Each rank writes its share as
``FILES_PER_RANK`` files, so the upload and download move several files at once, and a download reads 16 MiB
ranges (``storage.READ_RANGE_BYTES``). moto answers every ranged GET by reading the whole object and slicing it, so with
pyarrow's default 1 MiB ranges a download from moto cost (file size)^2 / 1 MiB of copying (186 s for the 25m
checkpoint's two 160 MB files); that is moto's, not S3's.

moto keeps each object's bytes in a temporary file but assembles a multipart upload in memory (its parts joined,
then copied), several times the file's size while the uploads of a rank's files run at once. With a rank's share
in one 1.6 GB file, a 250m checkpoint (weights + 2 AdamW moments, 3.1 GB) took moto's process past 22 GB and the
OOM killer ended it on a 23 GiB machine; in 4 files per rank it peaked at 6.8 GB (shown as "moto's process
peaked at"), so ``--sizes 25m,250m --resume-sizes 25m,250m`` runs on a 24 GiB machine (about 8 minutes on 2
cores). moto is far from S3's throughput and latency; the figures show what the code path costs on this
machine, not what AWS S3 gives.

Example::

    .venv/bin/python benchmarks/bench_checkpoint_s3.py                 # 25m: ~1 min on 2 idle cores
    .venv/bin/python benchmarks/bench_checkpoint_s3.py --sizes 25m,250m --resume-sizes 25m,250m
    .venv/bin/python benchmarks/bench_checkpoint_s3.py --sizes 25m --step-time-s 0.8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import (  # noqa: E402
    SIZES,
    _fingerprint,
    checkpoints_in_run,
    free_port,
    make_model,
    peak_rss_gib,
)

WORLD_SIZE = 2
MB = 1e6
BUCKET = "bench-checkpoint-s3"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="25m", help=f"comma-separated, of {', '.join(SIZES)} (default 25m)")
    p.add_argument("--resume-sizes", default="25m", help="sizes whose resume (download + load) is measured (25m)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per rank of a measured step (256)")
    p.add_argument("--step-time-s", type=float, default=None, help="use this step time instead of measuring one")
    p.add_argument("--tmp-dir", type=Path, default=None, help="where staging and downloads go (default: temp)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the final JSON to this file")
    args = p.parse_args(argv)
    args.size_list = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not args.size_list or any(s not in SIZES for s in args.size_list):
        p.error(f"--sizes: choose from {', '.join(SIZES)}")
    return args


def _step(model: Any, optimizer: Any, scheduler: Any, seq_len: int, seed: int) -> float:
    import torch

    t = time.perf_counter()
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def _build(model_path: str) -> tuple[Any, Any, Any]:
    from raytrain_eks.config import TrainingConfig
    from raytrain_eks.train.loop import build_optimizer
    from raytrain_eks.train.model import load_model
    from raytrain_eks.train.sharding import apply_fsdp

    cfg = TrainingConfig()
    model = load_model(model_path, activation_checkpointing=False)
    apply_fsdp(model, precision="fp32")
    optimizer, scheduler = build_optimizer(model, cfg)
    return model, optimizer, scheduler


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _rank(rank: int, spec: dict[str, Any], work: Any = None) -> None:
    """One spawned rank: ``work(rank, spec)`` (default :func:`_work`); a failure prints its traceback, exit 1."""
    try:
        (work or _work)(rank, spec)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # past gloo's threads, which can abort the interpreter's shutdown


def save_to_storage(
    remote: str,
    staging: Path,
    trained: tuple[Any, Any, Any],
    rank: int,
    *,
    tokenizer_path: str | None,
    position: dict[str, int] | None = None,
) -> tuple[float, float, float]:
    """Save a checkpoint as a run with ``training.storage_path: s3://...`` does (a collective): each rank writes
    into ``staging`` (:func:`save_sharded`), copies it into ``remote`` as ``ray.train.report`` does, then rank 0
    writes the complete marker after a barrier. Returns the three steps' times (write, upload, marker)."""
    from pyarrow import fs as pafs

    from raytrain_eks.train.checkpoint import mark_complete, save_sharded
    from raytrain_eks.train.storage import filesystem

    model, optimizer, scheduler = trained

    def write() -> None:
        save_sharded(
            staging,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            step=1,
            data_position=position or {"epoch": 0, "sample": 0},
            rank=rank,
            tokenizer_path=tokenizer_path,
        )

    def upload() -> None:
        fs, base = filesystem(remote)
        pafs.copy_files(str(staging), base, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)

    def marker() -> None:
        if rank == 0:
            mark_complete(remote, step=1, world_size=WORLD_SIZE)

    times = _timed(write), _timed(upload), _timed(marker)
    shutil.rmtree(staging)
    return times


def _work(rank: int, spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from raytrain_eks.train.checkpoint import checkpoint_name, load_sharded
    from raytrain_eks.train.storage import join

    transformers.utils.logging.set_verbosity_error()
    os.environ.update(spec["env"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=WORLD_SIZE)
    local = Path(spec["local"]) / f"rank{rank}"
    model, optimizer, scheduler = _build(spec["model_path"])
    res: dict[str, Any] = {"first_step_s": _step(model, optimizer, scheduler, 32, rank)}
    if spec["measure_step"]:
        res["step_s"] = statistics.median(
            _step(model, optimizer, scheduler, spec["seq_len"], 10 * i + rank) for i in range(4)[1:]
        )
    saved = _fingerprint(model, optimizer)
    remote = join(spec["root"], checkpoint_name(1))
    times = save_to_storage(
        remote, local / "staging", (model, optimizer, scheduler), rank, tokenizer_path=spec["model_path"]
    )
    res["write_s"], res["upload_s"], res["marker_s"] = times
    if not spec["resume"]:
        if rank == 0:
            Path(spec["result"]).write_text(json.dumps(res))
        dist.barrier()
        dist.destroy_process_group()
        return
    del model, optimizer, scheduler
    model, optimizer, scheduler = _build(spec["model_path"])
    states: list[Any] = []
    res["resume_s"] = _timed(
        lambda: states.append(load_sharded(remote, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank))
    )
    res["read_mb"] = states[0].read_bytes / MB
    ok = torch.tensor([1.0 if _fingerprint(model, optimizer) == saved else 0.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    res["restored"] = bool(ok.item() == 1.0)
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def start_moto() -> tuple[Any, dict[str, str]]:
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    os.environ.update(env)
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    return server, env


def bench_size(name: str, args: argparse.Namespace, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    import boto3
    import torch.multiprocessing as mp

    from raytrain_eks.config import TrainingConfig
    from raytrain_eks.train.builtin import ensure_builtin_model

    model_dir = tmp / f"model-{name}"
    n = make_model(name, model_dir, ensure_builtin_model())
    spec = {
        "model_path": str(model_dir),
        "root": f"s3://{BUCKET}/runs/{name}/ray",
        "local": str(tmp / f"local-{name}"),
        "env": env,
        "port": free_port(),
        "seq_len": args.seq_len,
        "measure_step": args.step_time_s is None,
        "resume": name in args.resume_sizes.split(","),
        "result": str(tmp / f"result-{name}.json"),
    }
    t = time.perf_counter()
    mp.spawn(_rank, args=(spec,), nprocs=WORLD_SIZE, join=True)
    wall = time.perf_counter() - t
    res = json.loads(Path(spec["result"]).read_text())
    s3 = boto3.client("s3")
    objects = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{name}/")["Contents"]
    size = sum(o["Size"] for o in objects)
    for o in objects:  # moto holds them in this process's memory
        s3.delete_object(Bucket=BUCKET, Key=o["Key"])
    shutil.rmtree(model_dir)
    shutil.rmtree(spec["local"], ignore_errors=True)

    ref = TrainingConfig()
    step_s = args.step_time_s if args.step_time_s is not None else res["step_s"]
    save = res["write_s"] + res["upload_s"] + res["marker_s"]
    resume = res.get("resume_s")
    saves = checkpoints_in_run(ref.steps, ref.checkpoint_every)
    train = ref.steps * step_s
    row = {
        "size": name,
        "parameters": n,
        "checkpoint_mb": size / MB,
        **{k: res.get(k) for k in ("write_s", "upload_s", "marker_s", "read_mb", "restored")},
        "save_s": save,
        "resume_s": resume,
        "upload_mb_s": size / MB / res["upload_s"],
        "step_s": step_s,
        "step_source": "--step-time-s" if args.step_time_s is not None else f"measured, 1 x {args.seq_len} fp32",
        "checkpoint_every": ref.checkpoint_every,
        "steps": ref.steps,
        "saves_in_run": saves,
        "interval_share_pct": 100 * save / (ref.checkpoint_every * step_s + save),
        "run_share_pct": 100 * saves * save / (train + saves * save),
        "run_share_with_resume_pct": (
            100 * (saves * save + resume) / (train + saves * save + resume) if resume is not None else None
        ),
        "ranks_wall_s": wall,
        "server_peak_rss_mb": peak_rss_gib() * 2**30 / MB,  # moto serves from this process
        "load_average": os.getloadavg()[0],
    }
    resumed = (
        f"resume {resume:.2f} s (rank 0 read its share, {res['read_mb']:.0f} MB, and loaded it); "
        f"restored: {'yes' if res['restored'] else 'NO'}"
        if resume is not None
        else "resume not measured (--resume-sizes)"
    )
    print(
        f"  {name}: {n / 1e6:.1f} M parameters, checkpoint {row['checkpoint_mb']:.0f} MB in S3; "
        f"save {save:.2f} s (write {res['write_s']:.2f} + upload {res['upload_s']:.2f} "
        f"[{row['upload_mb_s']:.0f} MB/s] + marker {res['marker_s']:.2f}); {resumed}"
    )
    with_resume = f", {row['run_share_with_resume_pct']:.1f}% with one resume" if resume is not None else ""
    print(
        f"    step {step_s:.2f} s ({row['step_source']}): a save is {row['interval_share_pct']:.1f}% of its "
        f"{ref.checkpoint_every}-step interval; {saves} saves are {row['run_share_pct']:.1f}% of a {ref.steps}-step "
        f"run{with_resume} (load average {row['load_average']:.1f}); moto's process peaked at "
        f"{row['server_peak_rss_mb']:.0f} MB"
    )
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    print(
        f"benchmark: checkpoints through s3:// (moto on loopback), {WORLD_SIZE} gloo processes on "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    t = time.perf_counter()
    server, env = start_moto()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-checkpoint-s3-", dir=args.tmp_dir) as name:
            for size in args.size_list:
                rows.append(bench_size(size, args, Path(name), env))
    finally:
        server.stop()
    print(f"benchmark wall time {time.perf_counter() - t:.0f} s")
    line = json.dumps({"sizes": rows, "cpus": os.cpu_count(), "torch": torch.__version__})
    if args.json_out:
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
