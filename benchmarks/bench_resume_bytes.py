"""What a resume from S3 downloads per rank: the whole checkpoint folder (as resumes did before) against this
rank's share (what :func:`load_sharded` now reads from an ``s3://`` checkpoint), with moto's S3 on loopback.

2 processes (gloo on CPU, one intra-op thread each, as under Ray) build a Qwen2 model of about ``--params``
parameters (random weights, fp32, tied embeddings; the shape is picked in :func:`shape_for`), shard it with
``apply_fsdp``, take one AdamW step so the moments exist, and save a checkpoint as a run with
``training.storage_path: s3://...`` does: :func:`save_sharded` into a local staging folder, uploaded into the
checkpoint's prefix as ``ray.train.report`` uploads it, then :func:`mark_complete`. Then each rank resumes it twice
into a fresh model and optimizer:

- **before**: the whole checkpoint folder is downloaded (every rank's model and AdamW shards, as resumes did), then
  :func:`load_sharded` loads it from that local copy (``--skip-before`` leaves this out: it then counts the
  folder's size, which is what that download copied);
- **after**: :func:`load_sharded` from the ``s3://`` URI: ``.metadata``, the rank's trainer state and the byte
  ranges its DCP load plan reads, nothing else.

Each resume is checked: the weights' and AdamW moments' local shards must equal those saved. Times are each rank's
own, from a barrier before. moto reads a whole object for every ranged GET and is far from S3's throughput and
latency: the bytes are what matters here, the times show this machine's code path only.

Example::

    .venv/bin/python benchmarks/bench_resume_bytes.py                  # 250 M parameters, ~5 min on 2 cores
    .venv/bin/python benchmarks/bench_resume_bytes.py --params 25e6 --skip-before
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import _fingerprint, folder_bytes, free_port  # noqa: E402
from bench_checkpoint_s3 import _rank, save_to_storage, start_moto  # noqa: E402

WORLD_SIZE = 2
MB = 1e6
BUCKET = "bench-checkpoint-s3"  # start_moto's bucket
VOCAB = 32000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=250e6, help="about this many parameters (default 250e6)")
    p.add_argument("--skip-before", action="store_true", help="do not download the whole folder (only count it)")
    p.add_argument("--tmp-dir", type=Path, default=None, help="where staging and downloads go (default: temp)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the final JSON to this file")
    args = p.parse_args(argv)
    if args.params < 2e6:
        p.error("--params: at least 2e6")
    return args


def _layer_params(hidden: int) -> int:
    """One decoder layer's parameters in :func:`shape_for`'s family (heads of 64, at most 4 KV heads, MLP 3 x
    hidden)."""
    kv = min(4, hidden // 64) * 64
    attention = 2 * hidden * hidden + hidden + 2 * (hidden * kv + kv)
    return attention + 3 * hidden * 3 * hidden + 2 * hidden


def shape_for(params: float) -> dict[str, int]:
    """Qwen2 config fields giving about ``params`` parameters: the widest hidden size that leaves 8 or more layers
    beside the (tied) embedding; 250e6 gives bench_checkpoint.py's 250m shape (1024 wide, 18 layers)."""
    for hidden in (2048, 1024, 512, 256, 128):
        layers = round((params - VOCAB * hidden) / _layer_params(hidden))
        if layers >= 8 or hidden == 128:
            return {
                "vocab_size": VOCAB,
                "hidden_size": hidden,
                "intermediate_size": 3 * hidden,
                "num_hidden_layers": max(layers, 1),
                "num_attention_heads": hidden // 64,
                "num_key_value_heads": min(4, hidden // 64),
            }
    raise AssertionError("unreachable")


def _build(shape: dict[str, int]) -> tuple[Any, Any, Any]:
    """The model (the same random weights on every rank), sharded in fp32, with AdamW and a schedule."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from raytrain_eks.train.sharding import apply_fsdp

    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    apply_fsdp(model, precision="fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def _whole_folder(remote: str, into: Path) -> Path:
    """The whole checkpoint folder copied into ``into``, as a resume downloaded it before it read only its share."""
    from pyarrow import fs as pafs

    from raytrain_eks.train.storage import READ_RANGE_BYTES, filesystem

    fs, base = filesystem(remote)
    into.mkdir(parents=True, exist_ok=True)
    pafs.copy_files(
        base,
        str(into),
        source_filesystem=fs,
        destination_filesystem=pafs.LocalFileSystem(),
        chunk_size=READ_RANGE_BYTES,
    )
    return into


def _work(rank: int, spec: dict[str, Any]) -> None:
    """One rank (moto's endpoint and credentials come in the environment): save, then resume before and after."""
    import torch
    import torch.distributed as dist

    from raytrain_eks.train.checkpoint import load_sharded

    torch.set_num_threads(1)
    address = f"tcp://127.0.0.1:{spec['port']}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=WORLD_SIZE)
    local, remote = Path(spec["local"]) / f"rank{rank}", spec["remote"]
    model, optimizer, scheduler = _build(spec["shape"])
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    saved = _fingerprint(model, optimizer)
    position = {"epoch": 0, "sample": 2}
    save_to_storage(
        remote, local / "staging", (model, optimizer, scheduler), rank, tokenizer_path=None, position=position
    )
    dist.barrier()
    del model, optimizer, scheduler
    res: dict[str, Any] = {"rank": rank}

    if not spec["skip_before"]:
        model, optimizer, scheduler = _build(spec["shape"])
        dist.barrier()
        t = time.perf_counter()
        whole = _whole_folder(remote, local / "whole")
        res["before_download_s"] = time.perf_counter() - t
        res["before_bytes"] = folder_bytes(whole)
        t = time.perf_counter()
        load_sharded(whole, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
        res["before_load_s"] = time.perf_counter() - t
        res["before_restored"] = _fingerprint(model, optimizer) == saved
        shutil.rmtree(whole)
        del model, optimizer, scheduler

    model, optimizer, scheduler = _build(spec["shape"])
    dist.barrier()
    t = time.perf_counter()
    state = load_sharded(remote, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
    res["after_s"] = time.perf_counter() - t
    res["after_bytes"] = state.read_bytes
    res["checkpoint_bytes"] = state.checkpoint_bytes
    res["note"] = state.note
    res["after_restored"] = _fingerprint(model, optimizer) == saved and state.step == 1 and state.data == position
    Path(spec["result"].format(rank=rank)).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import boto3
    import torch
    import torch.multiprocessing as mp
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = shape_for(args.params)
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).parameters())
    print(
        f"benchmark: resume bytes per rank from s3:// (moto on loopback), {WORLD_SIZE} gloo processes on "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(
        f"model: {n / 1e6:.1f} M parameters (Qwen2, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} "
        "layers, tied embeddings), fp32 weights + AdamW moments"
    )
    t = time.perf_counter()
    server, _ = start_moto()  # its endpoint and credentials are in os.environ, which the ranks inherit
    try:
        with tempfile.TemporaryDirectory(prefix="bench-resume-bytes-", dir=args.tmp_dir) as tmp:
            spec = {
                "shape": shape,
                "remote": f"s3://{BUCKET}/runs/resume/ray/checkpoint_00000001",
                "local": tmp,
                "port": free_port(),
                "skip_before": args.skip_before,
                "result": str(Path(tmp) / "result-{rank}.json"),
            }
            mp.spawn(_rank, args=(spec, _work), nprocs=WORLD_SIZE, join=True)
            ranks = [json.loads(Path(spec["result"].format(rank=r)).read_text()) for r in range(WORLD_SIZE)]
        objects = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="runs/resume/")["Contents"]
    finally:
        server.stop()
    total = sum(o["Size"] for o in objects)
    shards = sum(o["Size"] for o in objects if o["Key"].endswith(".distcp"))
    print(f"checkpoint: {total / MB:,.1f} MB in S3 ({len(objects)} files), of which {shards / MB:,.1f} MB DCP shards")
    for r in ranks:
        before = r.get("before_bytes", total)
        how = (
            f"{r['before_download_s']:.1f} s download + {r['before_load_s']:.1f} s load, restored: "
            f"{'yes' if r['before_restored'] else 'NO'}"
            if "before_load_s" in r
            else "not run (--skip-before): the folder's size"
        )
        print(f"  rank {r['rank']}: before {before / MB:,.1f} MB (the whole folder; {how})")
        print(
            f"          after  {r['after_bytes'] / MB:,.1f} MB ({100 * r['after_bytes'] / total:.1f}% of the "
            f"checkpoint; {r['after_s']:.1f} s download + load, restored: {'yes' if r['after_restored'] else 'NO'})"
        )
        print(f"          {r['note']}")
    print(f"benchmark wall time {time.perf_counter() - t:.0f} s")
    line = json.dumps(
        {
            "parameters": n,
            "shape": shape,
            "checkpoint_bytes": total,
            "shard_bytes": shards,
            "ranks": ranks,
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        }
    )
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")


if __name__ == "__main__":
    main()
