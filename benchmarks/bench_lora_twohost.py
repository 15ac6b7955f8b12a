"""Bytes over the link between two nodes per optimizer step: full fine-tuning against LoRA, on the two-host world.

Builds the two-host world of ``tests/twohost.py`` (two network namespaces joined by a veth pair; gloo between them,
the link left free) and runs the training loop there under torchrun, one agent per host, 2 ranks each (4 ranks, 2
"nodes"), random token ids, fp32, with the functions of ``bench_sharding_twohost.py``. For each setting it reads
host 1's interface counters at every metric record and reports the median bytes in and out per step (steps 2..N):

- HSDP, full fine-tune: every gradient crosses (one all-reduce of each node's shard between the nodes);
- HSDP, LoRA: only the adapters' gradients cross; the frozen base is never reduced;
- flat FSDP, full and LoRA: the weights are gathered across the nodes twice a step in both (the frozen base is
  sharded over all 4 ranks too), so LoRA saves only the gradients' share there.

Needs root and iproute2; a few minutes on a 2-core machine. Example::

    .venv/bin/python benchmarks/bench_lora_twohost.py                 # hidden 256, 4 layers, rank 16
    .venv/bin/python benchmarks/bench_lora_twohost.py --hidden 512 --layers 8 --rank 8

Human-readable lines first, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_sharding_twohost import PER_HOST, build_model, random_training, train  # noqa: E402
from twohost import TwoHostCluster, requirement_missing  # noqa: E402

SETTINGS = (
    ("HSDP, full", {"sharding": "auto"}),
    ("HSDP, LoRA", {"sharding": "auto", "method": "lora"}),
    ("flat FSDP, full", {"sharding": "fsdp"}),
    ("flat FSDP, LoRA", {"sharding": "fsdp", "method": "lora"}),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run (default 5)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    args = p.parse_args(argv)
    missing = requirement_missing()
    if missing:
        print(f"cannot run: {missing}", file=sys.stderr)
        return 2
    model_path, n_params = build_model(args.hidden, args.layers)
    print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.2f} M parameters")

    def training(**extra: Any) -> dict[str, Any]:
        settings = {"steps": args.steps, "seq_len": args.seq_len, "batch_size": 2, "lora": {"rank": args.rank}}
        return random_training(model_path, **settings, **extra)

    runs: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    with TwoHostCluster(start_ray=False) as cluster:
        port = iter(range(29700, 29800))
        for label, extra in SETTINGS:
            name = label.replace(" ", "").replace(",", "-")
            runs[label] = train(cluster, name, training(**extra), hosts=[0, 1], per_host=PER_HOST, port=next(port))
            r = runs[label]
            print(
                f"{label}: {r['summary']['sharding']}, {r['summary']['trainable_parameters']:,} trainable; "
                f"host 1's link per step {r['rx_per_step'] / 1e6:.3f} MB in, {r['tx_per_step'] / 1e6:.3f} MB out"
            )
    print(f"\n{'setting':<18}{'trainable':>12}{'in + out per step (MB)':>25}{'vs full':>9}")
    for label, r in runs.items():
        full = runs[label.replace("LoRA", "full")]
        moved = r["rx_per_step"] + r["tx_per_step"]
        share = moved / max(1, full["rx_per_step"] + full["tx_per_step"])
        print(f"{label:<18}{r['summary']['trainable_parameters']:>12,}{moved / 1e6:>25.3f}{share:>8.1%}")
    print(
        json.dumps(
            {
                "model": {"hidden": args.hidden, "layers": args.layers, "parameters": n_params},
                "lora_rank": args.rank,
                "ranks": 2 * PER_HOST,
                "runs": {
                    label: {
                        "sharding": r["summary"]["sharding"],
                        "method": r["summary"]["method"],
                        "trainable_parameters": r["summary"]["trainable_parameters"],
                        "link_rx_per_step": r["rx_per_step"],
                        "link_tx_per_step": r["tx_per_step"],
                        "step_time_s": r["summary"]["step_time_s"],
                        "final_loss": r["summary"]["final_loss"],
                    }
                    for label, r in runs.items()
                },
                "total_s": round(time.perf_counter() - t0, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
