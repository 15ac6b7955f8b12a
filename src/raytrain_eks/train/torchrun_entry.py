"""Run the training loop under plain ``torchrun``: the same :func:`~raytrain_eks.train.loop.train` the Ray
workers run, with the same model, data and FSDP2 sharding, but no Ray at all (random-data mode only).

It exists to measure what Ray Train costs per step (``benchmarks/bench_step_time.py``) and to check the loop's
maths across world sizes. Example::

    torchrun --nproc-per-node 2 -m raytrain_eks.train.torchrun_entry --config-json job.json --out run/

``job.json`` holds the training settings, either bare (``TrainingConfig.model_dump(mode="json")``) or as the
``training`` section of a whole configuration. Rank 0 writes ``metrics.jsonl`` and ``summary.json`` into ``--out``;
the summary also records the launcher and the number of intra-op threads each process used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from raytrain_eks.config import TrainingConfig
from raytrain_eks.errors import UserError
from raytrain_eks.train.context import ProcessContext
from raytrain_eks.train.loop import quiet_libraries, train
from raytrain_eks.train.model_source import resolve_model_path
from raytrain_eks.train.worker_env import compile_cache_environment


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m raytrain_eks.train.torchrun_entry",
        description="Run the raytrain-eks training loop in a torchrun process group (random data only).",
    )
    parser.add_argument("--config-json", type=Path, required=True, help="training settings as JSON")
    parser.add_argument("--out", type=Path, required=True, help="folder for rank 0's metrics.jsonl and summary.json")
    return parser.parse_args(argv)


def load_training(path: Path) -> TrainingConfig:
    """The :class:`TrainingConfig` in ``path``: bare, or the ``training`` section of a whole configuration."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("training"), dict):
        data = data["training"]
    cfg = TrainingConfig.model_validate(data)
    if not cfg.uses_random_data:
        raise UserError(
            f"torchrun runs use random token ids only, got data={cfg.data!r}",
            hint="Set training.data to 'random'; real data sets go through Ray Data (raytrain-eks train).",
        )
    return cfg


def run(cfg: TrainingConfig, out: Path) -> dict[str, object] | None:
    """Train in the already-initialised process group; rank 0 returns the summary, the others ``None``."""
    # The built-in model is built once per node (by local rank 0) before the others look for it in the cache.
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        resolve_model_path(cfg.model_id)
        out.mkdir(parents=True, exist_ok=True)
    # Before training, not after: no collective of ours runs between the loop's last one and the exit.
    threads: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(threads, torch.get_num_threads())
    launcher = {
        "launcher": "torchrun",
        "torch_num_threads": threads,
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
    }
    ctx = ProcessContext(out, summary_extra=launcher)  # rank 0 writes summary.json with these added
    model_path = resolve_model_path(cfg.model_id)
    summary = train(cfg, model_path, ctx)  # as the Ray workers call it
    return {**summary, **launcher} if ctx.rank == 0 else None


@record
def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        cfg = load_training(args.config_json)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (OSError, ValueError) as exc:  # unreadable file, bad JSON, invalid settings (pydantic's ValidationError)
        print(f"error: {args.config_json}: {exc}", file=sys.stderr)
        return 2
    quiet_libraries()
    # The compile cache the Ray workers use (torch reads these when it compiles), so a run under torchrun and one
    # under Ray on the same node reuse each other's compiled layers.
    os.environ.update(compile_cache_environment(os.environ))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend)
    try:
        run(cfg, args.out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's shutdown. destroy_process_group() does not stop Gloo's worker threads, and
    # one may still be dropping the last collective's tensors (Python objects) when finalization starts; taking
    # the GIL then kills the thread inside a noexcept destructor: "terminate called without an active exception",
    # SIGABRT, a failed torchrun after a successful run (seen in ~1 of 6 runs on 2 CPUs; torch 2.13). Everything
    # this process writes is closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # record() passes main's code through (typed Optional)
