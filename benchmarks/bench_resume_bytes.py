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

``--two-host`` (root, iproute2) runs the same on the two-host world of ``tests/twohost.py``: rank 0 on host 0
beside moto's S3 server, rank 1 on host 1, gloo and S3 both over the link between them; each rank also reports
its host's interface counters (``/proc/net/dev``, the host's own network namespace) around its save and its
resume, so what crossed the link into host 1 stands beside what its resume says it read. There the whole-folder
resume is only counted (its copy would not fit host 1's private ``/tmp``).

Example::

    .venv/bin/python benchmarks/bench_resume_bytes.py                  # 250 M parameters, ~5 min on 2 cores
    .venv/bin/python benchmarks/bench_resume_bytes.py --params 25e6 --skip-before
    .venv/bin/python benchmarks/bench_resume_bytes.py --two-host       # as root: across the two-host link
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
    p.add_argument("--two-host", action="store_true", help="one rank on each host of the two-host world (root)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a two-host rank process
    p.add_argument("--spec", type=Path, default=None, help=argparse.SUPPRESS)
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


def link_bytes(interface: str = "eth0") -> tuple[int, int] | None:
    """(received, sent) bytes of ``interface`` in this process's network namespace (``/proc/net/dev``), or None
    where it has no such interface (one host: loopback only is used)."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() == interface:
            values = fields.split()
            return int(values[0]), int(values[8])
    return None


def _moved(before: tuple[int, int] | None) -> dict[str, int]:
    after = link_bytes()
    if before is None or after is None:
        return {}
    return {"rx": after[0] - before[0], "tx": after[1] - before[1]}


def _work(rank: int, spec: dict[str, Any]) -> None:
    """One rank (moto's endpoint and credentials come in the environment): save, then resume before and after."""
    import torch
    import torch.distributed as dist

    from raytrain_eks.train.checkpoint import load_sharded

    torch.set_num_threads(1)
    address = f"tcp://{spec.get('master', '127.0.0.1')}:{spec['port']}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=WORLD_SIZE)
    local, remote = Path(spec["local"]) / f"rank{rank}", spec["remote"]
    model, optimizer, scheduler = _build(spec["shape"])
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    saved = _fingerprint(model, optimizer)
    position = {"epoch": 0, "sample": 2}
    counters = link_bytes()
    save_to_storage(
        remote, local / "staging", (model, optimizer, scheduler), rank, tokenizer_path=None, position=position
    )
    dist.barrier()
    res: dict[str, Any] = {"rank": rank, "save_link": _moved(counters)}
    shutil.rmtree(local / "staging", ignore_errors=True)
    del model, optimizer, scheduler

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
    counters = link_bytes()
    t = time.perf_counter()
    state = load_sharded(remote, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
    res["after_s"] = time.perf_counter() - t
    res["after_link"] = _moved(counters)
    res["after_bytes"] = state.read_bytes
    res["checkpoint_bytes"] = state.checkpoint_bytes
    res["note"] = state.note
    res["after_restored"] = _fingerprint(model, optimizer) == saved and state.step == 1 and state.data == position
    if rank == 0 and spec.get("list_objects"):  # the checkpoint's objects, read where S3 can be reached
        import boto3

        listed = boto3.client("s3").list_objects_v2(Bucket=spec["bucket"], Prefix="runs/resume/")["Contents"]
        res["objects"] = [{"Key": o["Key"], "Size": o["Size"]} for o in listed]
    Path(spec["result"].format(rank=rank)).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def run_two_host(args: argparse.Namespace, shape: dict[str, int]) -> tuple[list[dict[str, Any]], list[dict]]:
    """One rank on each host of the two-host world, moto's S3 on host 0; the ranks' results and S3's objects."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from twohost import BUCKET as TWOHOST_BUCKET
    from twohost import HOST_IPS, TwoHostCluster, requirement_missing

    missing = requirement_missing()
    if missing:
        raise SystemExit(f"--two-host: {missing}")
    # Outside /tmp (each host's private tmpfs): both hosts see this folder; each rank writes its own part of it.
    shared = Path(tempfile.mkdtemp(prefix="bench-resume-two-host-", dir=args.tmp_dir or "/var/tmp"))
    try:
        spec = {
            "shape": shape,
            "remote": f"s3://{TWOHOST_BUCKET}/runs/resume/ray/checkpoint_00000001",
            "bucket": TWOHOST_BUCKET,
            "list_objects": True,
            "local": str(shared),
            "master": HOST_IPS[0],
            "port": 29517,
            "skip_before": True,
            "result": str(shared / "result-{rank}.json"),
        }
        (shared / "spec.json").write_text(json.dumps(spec))
        with TwoHostCluster(start_ray=False, s3=True) as cluster:
            script = [sys.executable, str(Path(__file__).resolve()), "--spec", str(shared / "spec.json"), "--rank"]
            procs = []
            for r in range(WORLD_SIZE):
                # A rank's temporary files (its share of the checkpoint) on disk: a host's /tmp is a 4 GiB tmpfs,
                # and on host 0 moto keeps the checkpoint's objects there.
                (shared / f"tmp{r}").mkdir()
                argv = ["env", f"TMPDIR={shared / f'tmp{r}'}", *script, str(r)]
                procs.append(cluster.popen(argv, host=r, log=shared / f"rank{r}.log", cwd=str(shared)))
            codes = [proc.wait(timeout=3600) for proc in procs]
        if any(codes):
            logs = "\n".join((shared / f"rank{r}.log").read_text()[-2000:] for r in range(WORLD_SIZE))
            raise SystemExit(f"a rank failed (exit codes {codes}):\n{logs}")
        ranks = [json.loads(Path(spec["result"].format(rank=r)).read_text()) for r in range(WORLD_SIZE)]
        return ranks, ranks[0].pop("objects")
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rank is not None:  # a rank process of --two-host, on its host
        from bench_checkpoint_s3 import _rank as run_rank

        run_rank(args.rank, json.loads(args.spec.read_text()), _work)
        return
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = shape_for(args.params)
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).parameters())
    where = "one rank on each host of the two-host world, moto on host 0" if args.two_host else "moto on loopback"
    print(
        f"benchmark: resume bytes per rank from s3:// ({where}), {WORLD_SIZE} gloo processes on "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(
        f"model: {n / 1e6:.1f} M parameters (Qwen2, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} "
        "layers, tied embeddings), fp32 weights + AdamW moments"
    )
    t = time.perf_counter()
    if args.two_host:
        ranks, objects = run_two_host(args, shape)
    else:
        ranks, objects = _run_one_host(args, shape)
    _report(args, shape, n, ranks, objects, t)


def _run_one_host(args: argparse.Namespace, shape: dict[str, int]) -> tuple[list[dict[str, Any]], list[dict]]:
    """Both ranks here, moto's S3 on loopback; the ranks' results and S3's objects."""
    import boto3
    import torch.multiprocessing as mp

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
    return ranks, objects


def _report(
    args: argparse.Namespace, shape: dict[str, int], n: int, ranks: list[dict], objects: list[dict], t: float
) -> None:
    import torch

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
        if r.get("after_link"):
            print(
                f"          link: {r['after_link']['rx'] / MB:,.1f} MB received during the resume, "
                f"{r['save_link']['tx'] / MB:,.1f} MB sent during the save"
            )
    print(f"benchmark wall time {time.perf_counter() - t:.0f} s")
    line = json.dumps(
        {
            "parameters": n,
            "shape": shape,
            "checkpoint_bytes": total,
            "shard_bytes": shards,
            "ranks": ranks,
            "two_host": args.two_host,
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        }
    )
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")


if __name__ == "__main__":
    main()
