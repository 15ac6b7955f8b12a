"""How long training waits for a checkpoint against how long the checkpoint takes, in a real run of the job.

A Qwen2 model of about ``--params`` parameters (random weights, fp32, tied embeddings, the built-in model's tokenizer;
the shape from ``bench_resume_bytes.shape_for``) is written to a folder, and :func:`run_training` trains it on random
tokens with 2 CPU workers (embedded Ray, FSDP2), saving a checkpoint every ``--every`` steps into the run folder.
Each save copies the model and AdamW state in memory and returns; the files are written and copied into the run's
storage while the next steps train (:class:`~raytrain_eks.train.context.RayContext`). The run's ``summary.json``
gives what training waited (``checkpoint_s``), what each save cost the training thread (``checkpoint_stall_s``: the
staging into host buffers kept across saves, or the previous save's write where it still ran) and each save's time
until it was complete (``checkpoint_done_s``).

Example::

    .venv/bin/python benchmarks/bench_async_checkpoint.py                  # 100 M parameters, about 3 minutes here
    .venv/bin/python benchmarks/bench_async_checkpoint.py --params 25e6 --steps 8 --every 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import folder_bytes  # noqa: E402
from bench_resume_bytes import shape_for  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=100e6, help="about this many parameters (default 100e6)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument(
        "--every", type=int, default=3, help="a checkpoint every this many steps (default 3), and at the end"
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    return p.parse_args(argv)


def build_model(folder: Path, params: float) -> int:
    """A random Qwen2 model of about ``params`` parameters saved into ``folder`` with the built-in tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from raytrain_eks.train.builtin import ensure_builtin_model

    builtin = ensure_builtin_model()
    shape = shape_for(params)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0)
    )
    model.save_pretrained(folder)
    for name in os.listdir(builtin):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(builtin / name, folder / name)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from raytrain_eks import presets
    from raytrain_eks.config import load_config
    from raytrain_eks.train.launch import run_training

    work = Path(tempfile.mkdtemp(prefix="bench-async-checkpoint-"))
    try:
        n = build_model(work / "model", args.params)
        print(f"model: {n / 1e6:.1f} M parameters (Qwen2, random, fp32, tied embeddings), 2 CPU workers, FSDP2")
        training = {
            "model_id": str(work / "model"),
            "data": "random",
            "steps": args.steps,
            "seq_len": args.seq_len,
            "batch_size": 1,
            "log_every": 1,
            "checkpoint_every": args.every,
            "keep_checkpoints": 2,
            "precision": "fp32",
            "export": False,
            "sample_tokens": 0,
            "output_dir": str(work / "run"),
        }
        cfg = load_config(preset=presets.local_tiny(), environ={}, overrides={"training": training})
        t = time.perf_counter()
        result = run_training(cfg, runs_root=work, say=lambda _: None)
        wall = time.perf_counter() - t
        summary = result.summary
        size = folder_bytes(Path(summary["checkpoints"][-1]))
        done = summary["checkpoint_done_s"]
        steps = [
            json.loads(line)["step_time_s"] for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        print(f"checkpoint: {size / 1e9:.2f} GB each (model + AdamW moments), {len(done)} saves in {args.steps} steps")
        print(f"step time (median of the logged steps): {statistics.median(steps):.2f} s; run {wall:.0f} s")
        print(
            f"training waited for its saves: {summary['checkpoint_s']:.2f} s in all "
            f"({summary['checkpoint_s'] / len(done):.2f} s per save)"
        )
        stalls = summary["checkpoint_stall_s"]
        print(
            "each save's stall of the training thread (its staging; the save before it, where still written): "
            + ", ".join(f"{s:.2f} s" for s in stalls)
            + f" (max {summary['checkpoint_stall_s_max']:.2f} s, mean {summary['checkpoint_stall_s_mean']:.2f} s)"
        )
        print(
            "each save until complete (written, copied into storage, marked), while training went on: "
            + ", ".join(f"{s:.2f} s" for s in done)
        )
        figures = {"params": n, "checkpoint_bytes": size, "checkpoint_s": summary["checkpoint_s"], "done_s": done}
        print(json.dumps({**figures, "stall_s": stalls}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
