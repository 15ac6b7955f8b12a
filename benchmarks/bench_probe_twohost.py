"""The collective bandwidth probe (``raytrain-eks probe``) on the two-host test cluster, with and without a cap.

Builds the cluster of ``tests/twohost.py`` (two network namespaces joined by a bridge, a Ray node in each, gloo
over the veth pair), then runs ``raytrain-eks probe --address 10.213.0.11:6379 --json`` from the head host once
per link setting: first free, then with host 1's link capped by ``tc ... tbf rate RATE`` for each ``--caps`` rate.
Everything is torn down at the end, also after an error. Needs root and iproute2. Example::

    .venv/bin/python benchmarks/bench_probe_twohost.py                    # free, 1gbit, 200mbit: about 3 minutes
    .venv/bin/python benchmarks/bench_probe_twohost.py --caps 500mbit --max-bytes 64M --iters 10

The verdicts compare with ``--expected-gbps`` (default 1 Gbit/s, a stand-in line rate for this veth). Human-readable
lines first (each probe's table, then a summary), then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from twohost import TwoHostCluster, requirement_missing, tool  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--caps", default="1gbit,200mbit", help="tc rates for host 1's link, comma-separated ('' = none)")
    p.add_argument("--min-bytes", default="1M", help="smallest message (default 1M)")
    p.add_argument("--max-bytes", default="16M", help="largest message (default 16M)")
    p.add_argument("--iters", type=int, default=5, help="timed calls per size (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up calls per size (default 1)")
    p.add_argument("--expected-gbps", type=float, default=1.0, help="line rate for the verdict (default 1)")
    return p.parse_args(argv)


def probe(cluster: TwoHostCluster, args: argparse.Namespace) -> tuple[dict[str, Any], str, float]:
    cmd = [tool("raytrain-eks"), "probe", "--address", cluster.address, "--preset", "local-tiny"]
    cmd += ["--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--iters", str(args.iters)]
    cmd += ["--warmup", str(args.warmup), "--expected-gbps", str(args.expected_gbps)]
    t0 = time.perf_counter()
    proc = cluster.run([*cmd, "--json"], timeout=1800)  # in host 0's own working folder
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"probe failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    report = json.loads(proc.stdout)
    return report, _table(report), wall


def _table(report: dict[str, Any]) -> str:
    lines = [f"{'collective':<15}{'size':>12}{'time (us)':>14}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"]
    for r in report["results"]:
        lines.append(
            f"{r['op']:<15}{r['bytes']:>12}{r['time_us']:>14.1f}{r['algbw_GBps']:>14.3f}{r['busbw_GBps']:>14.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = requirement_missing()
    if missing:
        print(f"cannot run: {missing}", file=sys.stderr)
        return 2
    caps = [c.strip() for c in args.caps.split(",") if c.strip()]
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with TwoHostCluster() as cluster:
        print(f"cluster up in {time.perf_counter() - t0:.1f} s: hosts {', '.join(cluster.ips)}")
        for cap in [None, *caps]:
            with cluster.capped(1, cap) if cap else contextlib.nullcontext():
                report, table, wall = probe(cluster, args)
            label = f"capped at {cap}" if cap else "free"
            print(f"\n== {label}: {report['world_size']} ranks on {report['num_nodes']} nodes, {wall:.1f} s")
            print(table)
            print(f"verdict: {report['verdict']} ({report['reason']})")
            largest = max(r["bytes"] for r in report["results"])
            all_reduce = next(r for r in report["results"] if r["op"] == "all_reduce" and r["bytes"] == largest)
            results.append(
                {
                    "link": cap or "free",
                    "best_busbw_gbps": report["best_busbw_gbps"],
                    "all_reduce_busbw_gbps_at_max": all_reduce["busbw_GBps"] * 8,
                    "verdict": report["verdict"],
                    "nodes": report["nodes"],
                    "wall_s": round(wall, 1),
                    "results": report["results"],
                }
            )
    print(f"\n{'link':<12}{'best busbw (Gbit/s)':>22}{'all_reduce at max (Gbit/s)':>29}{'verdict':>11}")
    for r in results:
        line = f"{r['link']:<12}{r['best_busbw_gbps']:>22.3f}{r['all_reduce_busbw_gbps_at_max']:>29.3f}"
        print(f"{line}{r['verdict']:>11}")
    summary = {
        "expected_gbps": args.expected_gbps,
        "sizes": [args.min_bytes, args.max_bytes],
        "iters": args.iters,
        "runs": results,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
