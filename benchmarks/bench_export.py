"""Peak memory of `raytrain-eks export` against the size of the model it exports.

A Qwen2-shaped model of ~250 M parameters (``--size``; random weights, tied embeddings as Qwen2.5's small models)
is trained for one step on 2 gloo processes, sharded with FSDP2 (``fully_shard`` per decoder layer, then the
root) with AdamW, and saved with :func:`raytrain_eks.train.checkpoint.save_sharded`, as training saves it. Then,
each in a fresh process so its peak resident memory (``VmHWM``) is the export's own:

- **baseline**: Python, torch and transformers imported and the model's architecture read (the floor any export
  process has);
- **streamed**: :func:`raytrain_eks.train.export.export_hf` from the local checkpoint;
- **streamed, S3** (``--s3``): the same checkpoint uploaded to moto's S3 server (started here, on loopback), and
  exported from its ``s3://`` URI;
- **whole model** (``--whole``): for comparison, the way export worked before: the model built and filled whole,
  then ``save_pretrained``.

moto keeps what is uploaded in this process's memory, several times its size while a multipart upload runs: with
``--s3`` at 250m (a 3.2 GB checkpoint) this process passed 22 GB and the OOM killer ended it on a 23 GiB machine,
so use ``--s3`` with ``--size 25m`` unless the machine has far more memory.

The goal: peak RSS under the model's fp32 size / 4 + 1 GiB. The streamed export's files are checked against the
whole-model export's, tensor by tensor, when both run.

Example::

    .venv/bin/python benchmarks/bench_export.py --whole             # 250m: ~4 min on 2 idle cores, ~8 GiB RAM
    .venv/bin/python benchmarks/bench_export.py --size 25m --whole --s3

Human-readable lines, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 2**30
WORLD_SIZE = 2
# Qwen2 shapes (vocabulary of Qwen2.5's tokenizer, grouped-query attention, tied embeddings).
SIZES: dict[str, dict[str, int]] = {
    "25m": dict(
        vocab_size=151936,
        hidden_size=160,
        intermediate_size=448,
        num_hidden_layers=4,
        num_attention_heads=5,
        num_key_value_heads=1,
    ),
    "250m": dict(
        vocab_size=151936,
        hidden_size=768,
        intermediate_size=2816,
        num_hidden_layers=17,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="250m", help="model size (default 250m)")
    p.add_argument("--s3", action="store_true", help="also export from moto's S3 server")
    p.add_argument("--whole", action="store_true", help="also export the old way (whole model), for comparison")
    p.add_argument("--tmp-dir", type=Path, default=None, help="where the checkpoint goes (default: system temp)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the final JSON to this file")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_model(size: str, folder: Path) -> int:
    """Write the model (random fp32 weights) with the built-in tokenizer into ``folder``; return its parameters."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from raytrain_eks.train.builtin import ensure_builtin_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_builtin_model())
    config = Qwen2Config(
        **SIZES[size],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _rank(rank: int, model_path: str, folder: str, port: int) -> None:
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from raytrain_eks.train.checkpoint import mark_complete, save_sharded
        from raytrain_eks.train.model import load_model

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
        model = load_model(model_path, activation_checkpointing=False)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        save_sharded(
            Path(folder),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            step=1,
            data_position={"epoch": 0, "sample": 0},
            rank=rank,
            tokenizer_path=model_path,
        )
        dist.barrier()
        if rank == 0:
            mark_complete(folder, step=1, world_size=WORLD_SIZE)
        dist.barrier()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # past gloo's threads, which can abort the interpreter's shutdown


def write_checkpoint(model_path: Path, folder: Path) -> float:
    import torch.multiprocessing as mp

    t = time.perf_counter()
    mp.spawn(_rank, args=(str(model_path), str(folder), free_port()), nprocs=WORLD_SIZE, join=True)
    return time.perf_counter() - t


# ------------------------------------------------------------------------- what one child process measures


def _child(kind: str, source: str, out: str) -> dict[str, Any]:
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    t = time.perf_counter()
    if kind == "baseline":
        from raytrain_eks.train.export import _meta_model

        _meta_model(Path(source) / "hf", torch.float32)
    elif kind == "streamed":
        from raytrain_eks.train.export import export_hf

        export_hf(source, Path(out))
    elif kind == "whole":
        import warnings

        import torch.distributed.checkpoint as dcp
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(Path(source) / "hf")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.to_empty(device="cpu")
        state = {"model": dict(model.state_dict())}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning)
            dcp.load(state, checkpoint_id=source, no_dist=True)
        model.load_state_dict(state["model"], strict=True, assign=True)
        model.tie_weights()
        model.save_pretrained(out)
    else:
        raise SystemExit(f"unknown kind {kind}")
    return {
        "seconds": time.perf_counter() - t,
        "peak_rss_gib": own_peak_rss() / GiB,
    }


def own_peak_rss() -> int:
    """This process's peak resident memory in bytes (``VmHWM``).

    Not ``ru_maxrss``: Linux carries a parent's peak over into the child it forks, even across ``exec``, so a
    child's ``ru_maxrss`` is never below its parent's size at the fork.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def measure(kind: str, source: str, out: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, source, str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} export failed:\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t
    print(
        f"  {kind} from {source.split('://')[0] if '://' in source else 'disk'}: peak RSS "
        f"{res['peak_rss_gib']:.2f} GiB, {res['seconds']:.1f} s",
        flush=True,
    )
    return res


def same_weights(a: Path, b: Path) -> bool:
    """Every tensor of export ``a`` equals the one of the same name in ``b`` (read a tensor at a time)."""
    import torch
    from safetensors import safe_open

    def files(folder: Path) -> dict[str, Path]:
        found = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                found.update({k: f for k in st.keys()})  # noqa: SIM118 (safe_open has no __iter__)
        return found

    fa, fb = files(a), files(b)
    if fa.keys() != fb.keys():
        return False
    for name, f in fa.items():
        with safe_open(f, "pt") as sa, safe_open(fb[name], "pt") as sb:
            if not torch.equal(sa.get_tensor(name), sb.get_tensor(name)):
                return False
    return True


def upload_to_moto(folder: Path) -> tuple[Any, str, dict[str, str]]:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer
    from pyarrow import fs as pafs

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
    boto3.client("s3").create_bucket(Bucket="bench-export")
    uri = f"s3://bench-export/runs/bench/ray/{folder.name}"
    remote, base = pafs.FileSystem.from_uri(uri)
    pafs.copy_files(str(folder), base, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=remote)
    return server, uri, env


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(*sys.argv[2:5])))
        return 0
    args = parse_args(argv)
    t_all = time.perf_counter()
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-export-", dir=args.tmp_dir) as name:
        tmp = Path(name)
        n = make_model(args.size, tmp / "model")
        fp32 = 4 * n
        goal = fp32 / 4 + GiB
        print(
            f"model {args.size}: {n / 1e6:.1f} M parameters, fp32 size {fp32 / GiB:.2f} GiB; goal peak RSS < "
            f"{goal / GiB:.2f} GiB (fp32 / 4 + 1 GiB)"
        )
        folder = tmp / "ray" / "checkpoint_00000001"
        save_s = write_checkpoint(tmp / "model", folder)
        shutil.rmtree(tmp / "model")
        ckpt = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"sharded checkpoint (2 ranks, model + AdamW): {ckpt / GiB:.2f} GiB, written in {save_s:.1f} s")

        rows["baseline"] = measure("baseline", str(folder), tmp / "none")
        rows["streamed"] = measure("streamed", str(folder), tmp / "streamed")
        if args.whole:
            rows["whole"] = measure("whole", str(folder), tmp / "whole")
            rows["whole"]["same_weights_as_streamed"] = same_weights(tmp / "streamed", tmp / "whole")
            shutil.rmtree(tmp / "whole")
        if args.s3:
            server, uri, env = upload_to_moto(folder)
            try:
                rows["streamed_s3"] = measure("streamed", uri, tmp / "from-s3", env)
                rows["streamed_s3"]["same_weights_as_streamed"] = same_weights(tmp / "streamed", tmp / "from-s3")
            finally:
                server.stop()
        out_bytes = sum(f.stat().st_size for f in (tmp / "streamed").glob("*.safetensors"))

    print(f"{'export':<14} {'peak RSS GiB':>12} {'above baseline':>14} {'seconds':>8}  goal met")
    for kind, r in rows.items():
        above = r["peak_rss_gib"] - rows["baseline"]["peak_rss_gib"]
        met = "" if kind == "baseline" else ("yes" if r["peak_rss_gib"] * GiB < goal else "NO")
        print(
            f"{kind:<14} {r['peak_rss_gib']:12.2f} {above:14.2f} {r['seconds']:8.1f}  {met}"
            + (
                ""
                if "same_weights_as_streamed" not in r
                else f"  (same tensors as streamed: {'yes' if r['same_weights_as_streamed'] else 'NO'})"
            )
        )
    print(f"exported safetensors: {out_bytes / GiB:.2f} GiB; benchmark wall {time.perf_counter() - t_all:.0f} s")
    result = {
        "size": args.size,
        "parameters": n,
        "fp32_gib": fp32 / GiB,
        "goal_gib": goal / GiB,
        "checkpoint_gib": ckpt / GiB,
        "exports": rows,
        "cpus": os.cpu_count(),
    }
    line = json.dumps(result)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
