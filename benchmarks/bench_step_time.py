"""Steady-state step time of the Ray Train job against the same job under plain ``torchrun``, on this machine.

Both launchers run exactly the same training loop (:func:`raytrain_eks.train.loop.train`) with the same model,
random data, FSDP2 sharding, seed, world size (2) and per-process thread count; only the launcher differs:

- Ray: :func:`raytrain_eks.train.launch.run_training` (embedded Ray, ``TorchTrainer``, 2 CPU workers), then
  ``ray.shutdown()`` so Ray's processes do not compete with the torchrun run that follows;
- torchrun: ``python -m torch.distributed.run --nproc-per-node 2 -m raytrain_eks.train.torchrun_entry``.

Each launcher runs ``--repeats`` times, alternating which goes first. The figure compared is the loop's own
``step_time_s`` (rank 0's median step time after the first steps); ``tokens_per_s`` (whole loop, includes the
metric records) is shown beside it. Ray gives each worker ``OMP_NUM_THREADS=1`` (one logical CPU per worker); the
benchmark checks what the Ray workers really got and gives the torchrun processes the same.

Step times on a small machine are noisy, so each run also accounts for CPU time (Linux ``/proc``) between the
first and the last metric record: cores used by the training workers, by the launcher's other processes (Ray's
daemons and actors, or torchrun's agent) and by processes outside the benchmark. The launcher figure does not
depend on timing noise; with as many cores as workers, what it uses is taken from training. Example::

    .venv/bin/python benchmarks/bench_step_time.py                 # about 5 minutes on an idle 2-core machine
    .venv/bin/python benchmarks/bench_step_time.py --repeats 5 --steps 60   # less noise, about 12 minutes

Human-readable lines first, then one JSON line with every figure (``--json-out FILE`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_eks import presets
from raytrain_eks.config import RANDOM_DATA, Config, TrainingConfig

WORLD_SIZE = 2
GOAL_OVERHEAD_PCT = 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model id (default: the local-tiny preset's, builtin:tiny-qwen2)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sample (default 512)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per worker per step (default 8)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto", help="default auto, as the job")
    p.add_argument(
        "--log-every",
        type=int,
        default=None,
        help="metric record every N steps (default: --steps, i.e. records at the first and last step only)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per launcher, alternating order (default 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the torchrun processes (default: what the Ray workers got, checked on the spot)",
    )
    p.add_argument(
        "--torchrun-nice",
        type=int,
        default=0,
        help="run the torchrun processes at this niceness (default 0, as started by hand; Ray starts its workers\n"
        "at RAY_worker_niceness, 15 by default, which only matters when something else wants the CPUs)",
    )
    p.add_argument("--keep", type=Path, default=None, help="keep run folders here instead of a temporary folder")
    p.add_argument("--json-out", type=Path, default=None, help="also write the final JSON to this file")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 4:
        p.error("--repeats must be at least 1 and --steps at least 4 (the first steps are not steady state)")
    return args


def training_config(args: argparse.Namespace) -> Config:
    """The local-tiny preset with random data and the benchmark's sizes, validated, for both launchers."""
    base = presets.local_tiny()
    updates: dict[str, Any] = {
        "data": RANDOM_DATA,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "num_workers": WORLD_SIZE,
        "log_every": args.log_every or args.steps,
        "output_dir": None,
        # Not what is measured: no periodic checkpoints (the loop still saves one after the last step, on both
        # launchers, outside the step time) and no Hugging Face export at the end of the Ray run.
        "checkpoint_every": 0,
        "export": False,
    }
    warmup = base.training.warmup_steps
    if warmup is not None and warmup > args.steps:
        updates["warmup_steps"] = args.steps
    if args.model:
        updates["model_id"] = args.model
    training = TrainingConfig.model_validate({**base.training.model_dump(mode="json"), **updates})
    return base.model_copy(update={"training": training})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_worker_threads() -> dict[str, Any]:
    """Threads, OMP_NUM_THREADS and niceness inside Ray Train workers started like the job's (same ScalingConfig)."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    def probe(config: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        mine = {
            "torch_num_threads": torch.get_num_threads(),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
            "nice": os.nice(0),
        }
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() == 0:  # a local file: the embedded Ray runs on this machine
            Path(config["out"]).write_text(json.dumps(everyone))

    with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
        out = Path(tmp) / "threads.json"
        TorchTrainer(
            probe,
            train_loop_config={"out": str(out)},
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ray.train.ScalingConfig(num_workers=WORLD_SIZE, use_gpu=False),
            run_config=ray.train.RunConfig(name="probe", storage_path=tmp),
        ).fit()
        workers = json.loads(out.read_text())
    return {
        "torch_num_threads": [w["torch_num_threads"] for w in workers],
        "omp_num_threads_env": [w["omp_num_threads_env"] for w in workers],
        "nice": [w["nice"] for w in workers],
    }


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds so far, command line) for every process (Linux ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ..., utime, stime
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmd)
    return table


def _tree_cpu() -> dict[int, tuple[float, str]]:
    """CPU seconds and command line of this process and all its descendants (Ray's daemons and workers, torchrun)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in table:
            out[pid] = table[pid][1:]
        todo.extend(children.get(pid, []))
    return out


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, every process), from ``/proc/stat``."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal, not guest (already in user)


def _short(cmd: str) -> str:
    parts = cmd.split()
    if not parts:
        return "?"
    if parts[0].startswith("ray::"):
        return parts[0]
    if "python" in Path(parts[0]).name:
        if "-m" in parts[:-1]:
            return parts[parts.index("-m") + 1]
        scripts = [p for p in parts[1:] if not p.startswith("-")]
        return Path(scripts[0]).name if scripts else Path(parts[0]).name
    return Path(parts[0]).name


class CpuWindow:
    """Where the CPU went between the first and the last metric record (steps 2..N): training workers vs the rest.

    "The rest" is everything else under this process: the driver itself, and Ray's GCS, raylet, agents, idle
    workers, controller and queue actors, or torchrun's elastic agent. On a machine with as many cores as training
    processes, every core-second the rest uses is taken from training. Linux only; ``result()`` is ``None`` elsewhere.
    """

    def __init__(self, is_worker: Callable[[str], bool]) -> None:
        self._is_worker = is_worker
        self._start: tuple[float, float, dict[int, tuple[float, str]]] | None = None
        self._stop: tuple[float, float, dict[int, tuple[float, str]]] | None = None
        self.enabled = Path("/proc/self/stat").exists() and Path("/proc/stat").exists()

    @property
    def started(self) -> bool:
        return self._start is not None

    def start(self) -> None:
        if self.enabled and self._start is None:
            self._start = (time.perf_counter(), _busy_cpu_s(), _tree_cpu())

    def stop(self) -> None:
        if self.enabled and self._start is not None and self._stop is None:
            self._stop = (time.perf_counter(), _busy_cpu_s(), _tree_cpu())

    def result(self) -> dict[str, Any] | None:
        if self._start is None or self._stop is None:
            return None
        (t0, busy0, before), (t1, busy1, after) = self._start, self._stop
        window = t1 - t0
        workers, others = 0.0, 0.0
        by_name: dict[str, float] = {}
        for pid, (cpu, cmd) in after.items():
            cpu0, cmd0 = before.get(pid, (0.0, ""))
            used = cpu - cpu0
            cmd = cmd or cmd0  # a process that is exiting has no command line any more
            if self._is_worker(cmd):
                workers += used
            else:
                others += used
                by_name[_short(cmd)] = by_name.get(_short(cmd), 0.0) + used
        top = sorted(by_name.items(), key=lambda kv: -kv[1])
        return {
            "window_s": window,
            "worker_cores": workers / window,
            "launcher_cores": others / window,
            "launcher_top": {name: used / window for name, used in top},  # largest first
            # Busy cores outside this benchmark's processes: other users of the machine, i.e. noise.
            "outside_cores": max(0.0, (busy1 - busy0) - workers - others) / window,
        }


def run_ray(cfg: Config, root: Path, *, probe_threads: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One Ray Train run in a fresh embedded Ray (shut down afterwards); the summary and, if asked, the probe."""
    import ray

    from raytrain_eks.train.launch import run_training

    t0 = time.perf_counter()
    window = CpuWindow(lambda cmd: "RayTrainWorker" in cmd)
    marks: dict[str, float] = {}

    def say(message: str) -> None:
        print(f"    ray [{time.perf_counter() - t0:5.1f} s]: {message}")

    def progress(record: dict[str, Any], total: int) -> None:
        if not window.started:
            marks["first_record_s"] = time.perf_counter() - t0
            window.start()
        elif record["step"] == total:
            marks["last_record_s"] = time.perf_counter() - t0
            window.stop()

    # address=None: run_training starts a Ray of its own (ray.init(address="local"), whatever RAY_ADDRESS says).
    try:
        result = run_training(cfg, address=None, runs_root=root, say=say, progress=progress)
        marks["done_s"] = time.perf_counter() - t0
        threads = ray_worker_threads() if probe_threads else None
    finally:
        ray.shutdown()
    summary = dict(result.summary)
    summary.update(marks)
    summary["launcher_wall_s"] = marks["done_s"]
    summary["cpu"] = window.result()
    summary["run_dir"] = str(result.run_dir)
    return summary, threads


def _record_steps(metrics: Path) -> list[int]:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        with contextlib.suppress(ValueError, KeyError):  # a line being written
            steps.append(int(json.loads(line)["step"]))
    return steps


def run_torchrun(cfg: Config, root: Path, *, threads: int, nice: int = 0) -> dict[str, Any]:
    """One ``torchrun --nproc-per-node 2`` run of the same job; its summary."""
    root.mkdir(parents=True, exist_ok=True)
    config_json = root / "training.json"
    config_json.write_text(json.dumps(cfg.training.model_dump(mode="json"), indent=2) + "\n")
    out = root / "out"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(WORLD_SIZE),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "raytrain_eks.train.torchrun_entry",
        "--config-json",
        str(config_json),
        "--out",
        str(out),
    ]
    if nice:
        argv = [shutil.which("nice") or "nice", "-n", str(nice), *argv]
    print(f"    torchrun: {' '.join(argv)}  (OMP_NUM_THREADS={threads})")
    window = CpuWindow(lambda cmd: "torchrun_entry" in cmd and "torch.distributed.run" not in cmd)
    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    # Popen rather than run: the metric records are watched while it runs, to sample CPU use over steps 2..N.
    with (root / "torchrun.log").open("w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if window.enabled and "last_record_s" not in marks:
                    steps = _record_steps(out / "metrics.jsonl")
                    if steps and not window.started:
                        marks["first_record_s"] = time.perf_counter() - t0
                        window.start()
                    elif cfg.training.steps in steps:
                        marks["last_record_s"] = time.perf_counter() - t0
                        window.stop()
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (root / "torchrun.log").read_text().splitlines()[-30:]
        raise SystemExit(f"torchrun failed with status {proc.returncode}; last lines:\n" + "\n".join(tail))
    summary = json.loads((out / "summary.json").read_text())
    summary.update(marks)
    summary["launcher_wall_s"] = wall
    summary["cpu"] = window.result()
    summary["run_dir"] = str(out)
    return summary


def _fmt(s: dict[str, Any]) -> str:
    line = (
        f"step {1000 * s['step_time_s']:6.1f} ms  {s['tokens_per_s']:6.0f} tok/s  loop {s['train_s']:5.1f} s  "
        f"1st step after {s.get('first_record_s', float('nan')):4.1f} s  wall {s['launcher_wall_s']:5.1f} s"
    )
    cpu = s.get("cpu")
    if cpu:
        line += (
            f"  cores: workers {cpu['worker_cores']:.2f}, launcher {cpu['launcher_cores']:.3f},"
            f" outside {cpu['outside_cores']:.2f}"
        )
    return line


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = training_config(args)
    t = cfg.training

    from raytrain_eks.train.model_source import resolve_model_path

    resolve_model_path(t.model_id)  # build the built-in model now, so neither launcher's first run pays for it

    print(
        f"benchmark: {t.model_id}, {WORLD_SIZE} processes, seq_len {t.seq_len}, batch {t.batch_size} per worker, "
        f"{t.steps} steps, {t.precision}, log_every {t.log_every}, {args.repeats} repeat(s) per launcher, "
        f"{os.cpu_count()} CPUs"
    )
    with tempfile.TemporaryDirectory(prefix="bench-step-time-") as tmp:
        root = args.keep or Path(tmp)
        runs: list[dict[str, Any]] = []
        ray_threads: dict[str, Any] | None = None
        torch_threads = args.threads
        for rep in range(args.repeats):
            # Ray first on even repeats (the very first run is Ray's, so its workers' threads are known in time).
            order = ["ray", "torchrun"] if rep % 2 == 0 else ["torchrun", "ray"]
            for launcher in order:
                print(f"  repeat {rep + 1}/{args.repeats}: {launcher}")
                where = root / f"{rep + 1}-{launcher}"
                if launcher == "ray":
                    summary, probed = run_ray(cfg, where, probe_threads=ray_threads is None)
                    if probed is not None:
                        ray_threads = probed
                        print(
                            f"    ray workers: torch threads {probed['torch_num_threads']}, "
                            f"OMP_NUM_THREADS {probed['omp_num_threads_env']}, nice {probed['nice']} "
                            f"(this process: nice {os.nice(0)})"
                        )
                        if torch_threads is None:
                            torch_threads = max(probed["torch_num_threads"])
                else:
                    summary = run_torchrun(cfg, where, threads=torch_threads or 1, nice=args.torchrun_nice)
                    got = summary.get("torch_num_threads")
                    if got and ray_threads and got != ray_threads["torch_num_threads"]:
                        print(f"    WARNING: torchrun threads {got} differ from Ray workers' {ray_threads}")
                runs.append({"repeat": rep + 1, "launcher": launcher, **summary})
                print(f"    {launcher:8s} {_fmt(summary)}")
                if summary.get("cpu"):
                    top = ", ".join(f"{k} {v:.3f}" for k, v in list(summary["cpu"]["launcher_top"].items())[:6])
                    print(f"    {'':8s} launcher cores by process: {top}")

    def pick(launcher: str, key: str) -> list[Any]:
        return [r.get(key) for r in runs if r["launcher"] == launcher]

    def pick_cpu(launcher: str, key: str) -> list[float | None]:
        return [(r["cpu"] or {}).get(key) if r.get("cpu") else None for r in runs if r["launcher"] == launcher]

    ray_step, tr_step = _median(pick("ray", "step_time_s")), _median(pick("torchrun", "step_time_s"))
    ray_tps, tr_tps = _median(pick("ray", "tokens_per_s")), _median(pick("torchrun", "tokens_per_s"))
    ratio = ray_step / tr_step
    overhead_pct = 100.0 * (ratio - 1.0)
    pair_ratios = [r / t for r, t in zip(pick("ray", "step_time_s"), pick("torchrun", "step_time_s"), strict=True)]
    ray_launcher_cores, tr_launcher_cores = (
        _median(pick_cpu("ray", "launcher_cores")),
        _median(pick_cpu("torchrun", "launcher_cores")),
    )
    outside = [v for v in pick_cpu("ray", "outside_cores") + pick_cpu("torchrun", "outside_cores") if v is not None]
    losses_match = all(
        math.isclose(a["final_loss"], runs[0]["final_loss"], rel_tol=1e-4)
        and math.isclose(a["first_loss"], runs[0]["first_loss"], rel_tol=1e-4)
        for a in runs
    )
    goal_met = overhead_pct < GOAL_OVERHEAD_PCT

    print()
    print("per run (step: rank 0's median steady-state step time; cores: mean busy cores over steps 2..N):")
    for r in runs:
        print(f"  {r['repeat']} {r['launcher']:8s} {_fmt(r)}")
    print(f"step time, median of {args.repeats}:  ray {1000 * ray_step:.1f} ms   torchrun {1000 * tr_step:.1f} ms")
    print(f"ratio ray/torchrun: {ratio:.4f}  ->  Ray overhead {overhead_pct:+.2f}%")
    print(f"  per repeat: {', '.join(f'{x:.4f}' for x in pair_ratios)}")
    print(f"tokens/s, median of {args.repeats}:  ray {ray_tps:.0f}   torchrun {tr_tps:.0f}")
    print(
        "time to the first step, median:  "
        f"ray {_median(pick('ray', 'first_record_s')) or float('nan'):.1f} s   "
        f"torchrun {_median(pick('torchrun', 'first_record_s')) or float('nan'):.1f} s"
    )
    if ray_launcher_cores is not None and tr_launcher_cores is not None:
        extra = ray_launcher_cores - tr_launcher_cores
        print(
            f"launcher CPU while training, median:  ray {ray_launcher_cores:.3f} cores   torchrun "
            f"{tr_launcher_cores:.3f} cores  ->  Ray takes {extra:+.3f} cores "
            f"({100 * extra / WORLD_SIZE:+.2f}% of the {WORLD_SIZE} the workers need)"
        )
    if outside:
        print(f"busy cores outside this benchmark while training: max {max(outside):.2f}")
    print(f"same losses on both launchers: {'yes' if losses_match else 'NO'}")
    print(f"goal (Ray overhead under {GOAL_OVERHEAD_PCT:g}%): {'met' if goal_met else 'NOT met'}")
    spread = 100 * (max(pair_ratios) - min(pair_ratios))
    if len(pair_ratios) > 1 and spread > GOAL_OVERHEAD_PCT:
        print(
            f"  note: the per-repeat ratios spread over {spread:.1f} points, more than the {GOAL_OVERHEAD_PCT:g}% "
            "goal; run more --repeats on an otherwise idle machine before trusting the verdict"
        )
    if outside and max(outside) > 0.1:
        print("  note: other processes were busy during the measurement; the figures include their noise")

    keys = (
        "repeat",
        "launcher",
        "step_time_s",
        "tokens_per_s",
        "train_s",
        "first_record_s",
        "launcher_wall_s",
        "first_loss",
        "final_loss",
        "torch_num_threads",
        "cpu",
    )
    result = {
        "config": {
            "model_id": t.model_id,
            "world_size": WORLD_SIZE,
            "seq_len": t.seq_len,
            "batch_size": t.batch_size,
            "steps": t.steps,
            "precision": t.precision,
            "log_every": t.log_every,
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
            "torchrun_omp_num_threads": torch_threads or 1,
            "torchrun_nice": args.torchrun_nice,
        },
        "ray_worker_threads": ray_threads,
        "ray_step_time_s": ray_step,
        "torchrun_step_time_s": tr_step,
        "ratio": ratio,
        "overhead_pct": overhead_pct,
        "per_repeat_ratios": pair_ratios,
        "ray_tokens_per_s": ray_tps,
        "torchrun_tokens_per_s": tr_tps,
        "ray_launcher_cores": ray_launcher_cores,
        "torchrun_launcher_cores": tr_launcher_cores,
        "max_outside_cores": max(outside) if outside else None,
        "losses_match": losses_match,
        "goal_met": goal_met,
        "runs": [{k: r.get(k) for k in keys} for r in runs],
    }
    line = json.dumps(result)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
