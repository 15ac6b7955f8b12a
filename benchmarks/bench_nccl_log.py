"""Throughput and peak memory of the NCCL log analyzer (``verify-transport``) on large generated logs.

Writes two synthetic logs into a temporary folder (deleted afterwards): a small one (default 100 MB) and a large
one (default 1 GB). Both repeat the same kind of content as a long multi-node job run with ``NCCL_DEBUG=INFO`` and
``NCCL_DEBUG_SUBSYS=INIT,NET,COLL`` under Ray: 8 ranks on 2 nodes, Ray-prefixed and interleaved, communicator
set-up (aws-ofi-nccl, EFA, ring connections) repeated for a few restarts, and between them per-collective NCCL
lines, training output and Python warnings. About 70% of the lines mention NCCL.

Each log is analyzed in a fresh child process (so that one peak does not hide the other) with
:func:`raytrain_eks.fabric.nccl_log.analyze_paths`, exactly as the command does. The child reports wall time,
CPU time (the fairer figure on a busy machine), peak RSS (``resource.getrusage``) and, with ``--tracemalloc``, the
peak of Python allocations. Flat memory means the large log's peak is about the small one's. Example::

    .venv/bin/python benchmarks/bench_nccl_log.py                       # 100 MB and 1 GB, about a minute
    .venv/bin/python benchmarks/bench_nccl_log.py --large-mb 4096 --tracemalloc

Human-readable lines first, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

HOSTS = ("raytrain-gpu-worker-7xk2p", "raytrain-gpu-worker-q9m4d")
IPS = ("10.0.1.21", "10.0.1.87")
RANKS, PER_NODE, RESTARTS = 8, 4, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small-mb", type=int, default=100, help="size of the small log in MB (default 100)")
    p.add_argument("--large-mb", type=int, default=1024, help="size of the large log in MB (default 1024)")
    p.add_argument("--dir", type=Path, default=None, help="where to write the logs (default: a new temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the generated logs")
    p.add_argument("--tracemalloc", action="store_true", help="also measure the Python heap peak (about 4x slower)")
    p.add_argument(
        "--runtime-lines",
        type=int,
        default=6000,
        help="run-time lines between two communicator set-ups (default 6000); 0 = set-up lines only, the worst "
        "case where every line is one the analyzer parses",
    )
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the generated log ---------------------------------------------------------------------------------------------


def _init_lines(restart: int) -> list[list[str]]:
    """One communicator set-up, per rank, in the NCCL 2.29 / aws-ofi-nccl 1.16 formats."""
    per_rank = []
    for r in range(RANKS):
        node, dev = divmod(r, PER_NODE)
        pid = 400 + 100 * restart + r
        ray = f"(RayTrainWorker pid={pid}, ip={IPS[node]}) "
        head = f"{ray}{HOSTS[node]}:{pid}:{pid + 37} [{dev}] NCCL INFO "
        ptr, cid = f"0x55{restart}{r}ac18960", f"0x{restart + 1:x}dcff2626d08b830"
        lines = [
            head + "NCCL version 2.29.7+cuda13.0",
            head + f"Bootstrap: Using eth0:{IPS[node]}<0>",
            head + "NET/Plugin: Loaded net plugin Libfabric (v10)",
            head + "NET/OFI Initializing aws-ofi-nccl 1.16.2",
            head + "NET/OFI Selected provider is efa, fabric is efa (found 1 nics)",
            head + "Using network Libfabric",
            head + f"ncclCommInitRankConfig comm {ptr} rank {r} nranks {RANKS} cudaDev {dev} nvmlDev {dev} "
            f"busId 38000 commId {cid} - Init START",
            head + f"comm {ptr} rank {r} nRanks {RANKS} nNodes 2 localRanks {PER_NODE} localRank {dev} MNNVL 0",
            head + f"Trees [0] -1/-1/-1->{r}->-1 [1] -1/-1/-1->{r}->-1",
        ]
        nxt, prv = (r + 1) % RANKS, (r - 1) % RANKS
        for ch in range(4):
            if prv // PER_NODE != node:
                lines.append(
                    head + f"Channel {ch:02d}/0 : {prv}[{prv % PER_NODE}] -> {r}[{dev}] [receive] via NET/Libfabric/0"
                )
            if nxt // PER_NODE != node:
                lines.append(
                    head + f"Channel {ch:02d}/0 : {r}[{dev}] -> {nxt}[{nxt % PER_NODE}] [send] via NET/Libfabric/0"
                )
            else:
                lines.append(head + f"Channel {ch:02d}/0 : {r}[{dev}] -> {nxt}[{nxt % PER_NODE}] via SHM/direct/direct")
        lines += [
            head + "Connected all rings, use ring PXN 0 GDR 0",
            head + f"ncclCommInitRankConfig comm {ptr} rank {r} nranks {RANKS} cudaDev {dev} nvmlDev {dev} "
            f"busId 38000 commId {cid} - Init COMPLETE",
        ]
        per_rank.append(lines)
    return per_rank


def _runtime_lines(rng: random.Random, restart: int, n: int) -> list[str]:
    """What fills a long log between set-ups: per-collective INFO lines, training output, warnings."""
    out = []
    for i in range(n):
        r = rng.randrange(RANKS)
        node, dev = divmod(r, PER_NODE)
        pid = 400 + 100 * restart + r
        ray = f"(RayTrainWorker pid={pid}, ip={IPS[node]}) "
        kind = rng.random()
        if kind < 0.7:
            op = rng.choice(("AllGather", "ReduceScatter", "AllReduce"))
            out.append(
                f"{ray}{HOSTS[node]}:{pid}:{pid} [{dev}] NCCL INFO {op}: opCount {i:x} sendbuff 0x7f3a{i:08x} "
                f"recvbuff 0x7f3b{i:08x} count {rng.randrange(1, 1 << 24)} datatype 9 op 0 root 0 "
                f"comm 0x55{restart}{r}ac18960 [nranks={RANKS}] stream 0x5612e0c4d0a0"
            )
        elif kind < 0.95:
            out.append(
                f"{ray}step {i} loss {rng.uniform(1.5, 3.0):.4f} tokens/s {rng.uniform(4000, 4600):.1f} lr 2.0e-05"
            )
        else:
            out.append(
                f"{ray}/usr/lib/python3.12/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_state.py:412: "
                "UserWarning: a warning that Python prints on every rank"
            )
    return out


def _block(rng: random.Random, restart: int, runtime_lines: int) -> bytes:
    ranks = _init_lines(restart)
    merged: list[str] = []
    while any(ranks):  # interleave the ranks' lines as Ray's log monitor does
        r = rng.choice([i for i, lines in enumerate(ranks) if lines])
        merged.append(ranks[r].pop(0))
    merged += _runtime_lines(rng, restart, runtime_lines)
    return ("\n".join(merged) + "\n").encode()


def write_log(path: Path, size_mb: int, runtime_lines: int = 6000) -> int:
    """Write about ``size_mb`` MB of generated log to ``path``; return the exact size in bytes."""
    rng = random.Random(0)
    blocks = [_block(rng, restart, runtime_lines) for restart in range(RESTARTS)]
    target, written = size_mb * 1_000_000, 0
    with open(path, "wb") as f:
        i = 0
        while written < target:
            data = blocks[i % RESTARTS]
            f.write(data)
            written += len(data)
            i += 1
    return written


# -- measuring -----------------------------------------------------------------------------------------------------


def child(path: Path, trace: bool) -> dict[str, Any]:
    from raytrain_eks.fabric.nccl_log import analyze_paths

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if trace:
        tracemalloc.start()
    t0, c0 = time.perf_counter(), time.process_time()
    report = analyze_paths([path])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak_py = tracemalloc.get_traced_memory()[1] if trace else None
    return {
        "bytes": report.stats["bytes"],
        "lines": report.stats["lines"],
        "analyzed_lines": report.stats["analyzed_lines"],
        "wall_s": wall,
        "mb_per_s": report.stats["bytes"] / 1e6 / wall,
        "cpu_s": cpu,
        "mb_per_cpu_s": report.stats["bytes"] / 1e6 / cpu,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_after_import_mb": rss_before / 1024,
        "tracemalloc_peak_mb": None if peak_py is None else peak_py / 1e6,
        "verdict": report.verdict,
        "inter_node": report.inter_node,
    }


def measure(path: Path, trace: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(path)] + (["--tracemalloc"] if trace else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.tracemalloc)))
        return
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench-nccl-log-"))
    folder.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    try:
        for name, size in (("small", args.small_mb), ("large", args.large_mb)):
            path = folder / f"nccl-{size}mb.log"
            t0 = time.perf_counter()
            nbytes = write_log(path, size, args.runtime_lines)
            print(f"{name}: wrote {nbytes / 1e6:,.0f} MB in {time.perf_counter() - t0:.1f} s", flush=True)
            r = results[name] = measure(path, args.tracemalloc)
            assert r["verdict"] == "efa", r  # the generated job uses EFA: anything else is a bug
            py = f", Python heap peak {r['tracemalloc_peak_mb']:.1f} MB" if args.tracemalloc else ""
            print(
                f"{name}: {r['bytes'] / 1e6:,.0f} MB, {r['lines']:,} lines ({r['analyzed_lines']:,} analyzed) in "
                f"{r['wall_s']:.1f} s = {r['mb_per_s']:.0f} MB/s ({r['mb_per_cpu_s']:.0f} MB per CPU-second); "
                f"peak RSS {r['peak_rss_mb']:.0f} MB (after import {r['rss_after_import_mb']:.0f} MB){py}; "
                f"verdict {r['verdict']}",
                flush=True,
            )
            if not args.keep:
                path.unlink()
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    growth = results["large"]["peak_rss_mb"] - results["small"]["peak_rss_mb"]
    ratio = results["large"]["bytes"] / results["small"]["bytes"]
    flat = growth < max(16.0, 0.1 * results["small"]["peak_rss_mb"])
    print(f"peak RSS grows by {growth:+.1f} MB for {ratio:.0f}x the input: memory is {'flat' if flat else 'NOT flat'}")
    print(json.dumps({"small": results["small"], "large": results["large"], "rss_growth_mb": growth, "flat": flat}))


if __name__ == "__main__":
    main()
