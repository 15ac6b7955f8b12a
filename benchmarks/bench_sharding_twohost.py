"""Step time of flat FSDP, HSDP (fp32 and bf16 gradient reduction) and one node alone, on the two-host world.

Builds the two-host world of ``tests/twohost.py`` (two network namespaces joined by a bridge; gloo over the veth
pair, ``tc``-capped), and runs the training loop there under torchrun: one agent per host, 2 ranks each (4 ranks,
2 "nodes"), the same ``raytrain_eks.train.torchrun_entry`` the tests use, random token ids, fp32. The link is
capped so that, for flat FSDP, (bytes over the link per step) / (link rate) over (compute time per step) is the
reference's ratio: 2 x Qwen2.5-1.5B on two nodes joined by 40 Gbit/s moves ~10.9 GB per step across the link
(two bf16 weight all-gathers of 3.1 GB and an fp32 reduce-scatter of 6.2 GB, 7/8 of it between nodes): 2.2-2.7 s
of network against ~0.17 s of compute at the L4's peak, a ratio of ~13-16. The script prints that arithmetic
with the figures it measured here:

1. ``one node``: all 4 ranks on host 0 (FSDP, nothing crosses the link): the compute time per step, and the floor;
2. ``flat FSDP, free link``: the bytes flat FSDP moves across the link per step (host 1's interface counters,
   sampled at each step's metric record);
3. the cap: bytes per step / (ratio x compute time), then flat FSDP, HSDP with fp32 and HSDP with bf16 gradient
   reduction (``training.reduce_precision``) under that cap.

Needs root and iproute2. Default size: a few minutes on a 2-core machine. Example::

    .venv/bin/python benchmarks/bench_sharding_twohost.py                  # smallest setting
    .venv/bin/python benchmarks/bench_sharding_twohost.py --full           # a bigger model and more tokens
    .venv/bin/python benchmarks/bench_sharding_twohost.py --cap 200mbit    # a fixed cap instead of the ratio

Human-readable lines first, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from twohost import IFNAME, WORKDIR, TwoHostCluster, requirement_missing  # noqa: E402

# The reference (issue figures): 2 x g6.12xlarge, 4 L4 each, one 40 Gbit/s link, Qwen2.5-1.5B, batch 2 x 1024.
REFERENCE = {
    "params": 1.54e9,
    "link_gbps": 40.0,
    "allgather_bytes": 3.1e9,  # bf16 weights, twice per step (forward, backward)
    "reduce_bytes": 6.2e9,  # fp32 gradients, once per step
    "cross_fraction": 7 / 8,
    "compute_s": 0.17,
    "ratio": (13.0, 16.0),
}
PER_HOST = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--full", action="store_true", help="hidden 512, 8 layers, seq 512, 8 steps (default: smallest)")
    p.add_argument("--hidden", type=int, help="model width (default 256, --full 512)")
    p.add_argument("--layers", type=int, help="decoder layers (default 4, --full 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default 128, --full 512)")
    p.add_argument("--batch-size", type=int, default=2, help="samples per rank per step (default 2)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 5, --full 8)")
    p.add_argument("--ratio", type=float, default=14.0, help="network / compute time to aim at (default 14)")
    p.add_argument("--cap", help="tc rate for host 1's link (e.g. 200mbit) instead of the one the ratio gives")
    args = p.parse_args(argv)
    full = {"hidden": 512, "layers": 8, "seq_len": 512, "steps": 8}
    small = {"hidden": 256, "layers": 4, "seq_len": 128, "steps": 5}
    for key, value in (full if args.full else small).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def build_model(hidden: int, layers: int) -> tuple[Path, int]:
    """A Qwen2 model of this size with random weights and the built-in tokenizer, in the model cache both hosts
    see; ``(folder, parameter count)``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from raytrain_eks.train.builtin import cache_root, ensure_builtin_model

    builtin = ensure_builtin_model()
    target = cache_root() / f"bench-qwen2-h{hidden}-l{layers}"
    config = Qwen2Config(
        vocab_size=json.loads((builtin / "config.json").read_text())["vocab_size"],
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    if not (target / "config.json").exists():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        tmp = target.with_name(target.name + ".building")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (builtin / name).exists():
                shutil.copy(builtin / name, tmp / name)
        tmp.rename(target)
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    return target, n


def random_training(model_path: Path, *, steps: int, seq_len: int, batch_size: int, **extra: Any) -> dict[str, Any]:
    """The training settings of one benchmark run: random ids in fp32, a record every step, no checkpoint."""
    return {
        "model_id": str(model_path),
        "data": "random",
        "steps": steps,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "precision": "fp32",
        "log_every": 1,
        "checkpoint_every": 0,
        "warmup_steps": 1,
        **extra,
    }


def link_bytes(cluster: TwoHostCluster, host: int) -> tuple[int, int]:
    """``(received, sent)`` bytes so far on host ``host``'s end of its link."""
    out = subprocess.run(
        ["ip", "-n", cluster.host_ns[host], "-s", "-j", "link", "show", IFNAME],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    stats = json.loads(out)[0]["stats64"]
    return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def train(
    cluster: TwoHostCluster, name: str, training: dict[str, Any], *, hosts: list[int], per_host: int, port: int
) -> dict[str, Any]:
    """One torchrun run over ``hosts`` (``per_host`` ranks each); its summary, and host 1's link bytes per step
    (counter deltas between consecutive metric records)."""
    folder = f"{WORKDIR}/{name}"
    for h in hosts:
        cluster.host_path(h, folder).mkdir(parents=True, exist_ok=True)
        cluster.host_path(h, f"{folder}.json").write_text(json.dumps(training))
    results: dict[int, subprocess.CompletedProcess[str]] = {}

    def agent(h: int, node_rank: int) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}", f"--node-rank={node_rank}"]
        argv += [f"--nproc-per-node={per_host}", f"--master-addr={cluster.ips[hosts[0]]}", f"--master-port={port}"]
        argv += ["-m", "raytrain_eks.train.torchrun_entry", "--config-json", f"{folder}.json", "--out", f"{folder}/out"]
        results[h] = cluster.run(argv, host=h, timeout=1500, env={"OMP_NUM_THREADS": "1"})

    threads = [threading.Thread(target=agent, args=(h, i)) for i, h in enumerate(hosts)]
    for t in threads:
        t.start()
    metrics = cluster.host_path(hosts[0], f"{folder}/out/metrics.jsonl")
    samples: list[tuple[int, int]] = []  # host 1's (rx, tx) when each record appeared
    seen = 0
    while any(t.is_alive() for t in threads):
        lines = metrics.read_text().count("\n") if metrics.exists() else 0
        if lines > seen:
            samples.extend([link_bytes(cluster, 1)] * (lines - seen))
            seen = lines
        time.sleep(0.02)
    for t in threads:
        t.join()
    for h, proc in results.items():
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: torchrun on host {h} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads(cluster.host_path(hosts[0], f"{folder}/out/summary.json").read_text())
    # Step k's bytes: the counters at record k minus those at record k-1 (k >= 2: step 1 includes warm-up).
    per_step = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(samples, samples[1:], strict=False)]
    rx = statistics.median(r for r, _ in per_step) if per_step else 0
    tx = statistics.median(t for _, t in per_step) if per_step else 0
    return {"summary": summary, "rx_per_step": rx, "tx_per_step": tx, "per_step": per_step}


def reference_projection() -> dict[str, Any]:
    """What each setting would move across the reference's link per step, and how long that takes (arithmetic)."""
    ref = REFERENCE
    rate = ref["link_gbps"] * 1e9 / 8
    grads_fp32 = ref["params"] * 4  # per node: every gradient once
    flat = (2 * ref["allgather_bytes"] + ref["reduce_bytes"]) * ref["cross_fraction"]
    # HSDP: nothing but the gradient all-reduce between the two nodes' matching shards; between two nodes it
    # sends each node's share of the gradients once each way.
    rows = {
        "flat FSDP": flat,
        "HSDP, fp32 reduce": grads_fp32,
        "HSDP, bf16 reduce": grads_fp32 / 2,
        "one node (no link)": 0.0,
    }
    return {k: {"bytes": v, "network_s": v / rate} for k, v in rows.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = requirement_missing()
    if missing:
        print(f"cannot run: {missing}", file=sys.stderr)
        return 2
    ref = REFERENCE
    ref_flat = (2 * ref["allgather_bytes"] + ref["reduce_bytes"]) * ref["cross_fraction"]
    ref_net = ref_flat / (ref["link_gbps"] * 1e9 / 8)
    print(
        f"reference: flat FSDP moves (2 x {ref['allgather_bytes'] / 1e9:.1f} GB + {ref['reduce_bytes'] / 1e9:.1f} GB)"
        f" x 7/8 = {ref_flat / 1e9:.1f} GB per step over {ref['link_gbps']:.0f} Gbit/s = {ref_net:.2f} s "
        f"(2.2-2.7 s with protocol overhead) against {ref['compute_s']} s of compute: ratio "
        f"{ref_net / ref['compute_s']:.1f} (13-16); aiming at {args.ratio}"
    )
    model_path, n_params = build_model(args.hidden, args.layers)
    print(
        f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.2f} M parameters "
        f"({n_params * 4 / 1e6:.1f} MB fp32); {args.batch_size} x {args.seq_len} tokens per rank per step, "
        f"{2 * PER_HOST} ranks"
    )

    def training(**extra: Any) -> dict[str, Any]:
        return random_training(model_path, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, **extra)

    runs: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    with TwoHostCluster(start_ray=False) as cluster:
        print(f"two hosts up in {time.perf_counter() - t0:.1f} s: {', '.join(cluster.ips)}")
        port = iter(range(29600, 29700))
        floor = train(cluster, "one-node", training(), hosts=[0], per_host=2 * PER_HOST, port=next(port))
        compute_s = floor["summary"]["step_time_s"]
        print(f"one node (4 ranks on host 0): {compute_s:.3f} s per step, {floor['summary']['sharding']}")
        free = train(cluster, "flat-free", training(sharding="fsdp"), hosts=[0, 1], per_host=PER_HOST, port=next(port))
        busier = max(free["rx_per_step"], free["tx_per_step"])
        print(
            f"flat FSDP, free link: {free['summary']['step_time_s']:.3f} s per step; host 1's link per step: "
            f"{free['rx_per_step'] / 1e6:.2f} MB in, {free['tx_per_step'] / 1e6:.2f} MB out"
        )
        if args.cap:
            cap = args.cap
            print(f"cap: {cap} as given")
        else:
            rate = busier / (args.ratio * compute_s)  # bytes/s
            cap = f"{max(1, round(rate * 8 / 1000))}kbit"
            print(
                f"cap: {busier / 1e6:.2f} MB per step (busier direction) / ({args.ratio} x {compute_s:.3f} s of "
                f"compute) = {rate * 8 / 1e6:.1f} Mbit/s -> network {busier / rate:.2f} s per step, ratio "
                f"{busier / rate / compute_s:.1f}"
            )
        runs["one node (no link)"] = floor
        with cluster.capped(1, cap):
            for label, extra in (
                ("flat FSDP", {"sharding": "fsdp"}),
                ("HSDP, fp32 reduce", {"sharding": "auto"}),
                ("HSDP, bf16 reduce", {"sharding": "auto", "reduce_precision": "bf16"}),
            ):
                runs[label] = train(
                    cluster,
                    label.replace(" ", "").replace(",", "-"),
                    training(**extra),
                    hosts=[0, 1],
                    per_host=PER_HOST,
                    port=next(port),
                )
                s = runs[label]["summary"]
                print(f"{label}: {s['step_time_s']:.3f} s per step ({s['sharding']}, reduce {s['reduce_precision']})")

    flat_s = runs["flat FSDP"]["summary"]["step_time_s"]
    projection = reference_projection()
    print(f"\nlink capped at {cap}; {args.steps} steps per run, median of steps 2..{args.steps}")
    head = f"{'setting':<22}{'sharding':>9}{'step (s)':>10}{'vs flat':>9}{'link MB/step in+out':>21}"
    print(head + f"{'2x g6.12xlarge: GB over link':>30}{'network (s)':>13}")
    for label, r in runs.items():
        s = r["summary"]
        moved = (r["rx_per_step"] + r["tx_per_step"]) / 1e6
        p = projection[label]
        print(
            f"{label:<22}{s['sharding']:>9}{s['step_time_s']:>10.3f}{flat_s / s['step_time_s']:>8.2f}x"
            f"{moved:>21.2f}{p['bytes'] / 1e9:>30.1f}{p['network_s']:>13.2f}"
        )
    print(
        json.dumps(
            {
                "model": {"hidden": args.hidden, "layers": args.layers, "parameters": n_params},
                "tokens_per_rank_step": args.batch_size * args.seq_len,
                "ranks": 2 * PER_HOST,
                "cap": cap,
                "compute_s": compute_s,
                "flat_free_link_bytes_per_step": {"rx": free["rx_per_step"], "tx": free["tx_per_step"]},
                "runs": {
                    label: {
                        "step_time_s": r["summary"]["step_time_s"],
                        "sharding": r["summary"]["sharding"],
                        "reduce_precision": r["summary"]["reduce_precision"],
                        "link_rx_per_step": r["rx_per_step"],
                        "link_tx_per_step": r["tx_per_step"],
                        "final_loss": r["summary"]["final_loss"],
                    }
                    for label, r in runs.items()
                },
                "projection_2x_g6_12xlarge": projection,
                "total_s": round(time.perf_counter() - t0, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
