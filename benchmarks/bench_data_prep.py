"""Peak memory of data preparation against the size of one JSONL file: is it flat?

For each size (MB of JSONL, ``--sizes``), a file of ``text`` rows (about 2 KB each, words drawn with a fixed seed)
is written, then :func:`raytrain_eks.train.data.pipeline.prepare_dataset` prepares it (read, tokenize with the built-in
model's tokenizer, count malformed rows, shuffle, pack into ``--seq-len`` blocks, materialize) in a fresh Python
process with its own embedded Ray (``--cpus`` CPUs), as ``raytrain-eks train`` does on the driver. Measured:

- **largest task**: the highest private resident memory (``RssAnon`` in ``/proc/PID/status``, polled every
  0.2 s) of any Ray worker process the run started, and what that worker was running when it rose last. A
  worker runs many tasks in turn, so this bounds the largest task from above. Also shown: the highest peak
  resident set (``VmHWM``) of any worker, which also counts the pages of Ray's shared object store the worker
  has read (blocks held once for the whole node, and spilled to disk past its size), so it grows with the
  data a worker has read over its life, not with what one task holds;
- **read/tokenize tasks**: the highest private memory of a worker while it ran a read or tokenize task (the
  worker's memory at that moment, so what earlier tasks left in its heap is included);
- **driver**: the same two figures for the preparing process itself;
- the rows, tokens and packed blocks, and the seconds it took: in all, reading (read, tokenize, count) and
  shuffling (keyed sort, pack, materialize).

Data preparation is flat when the largest task does not grow with the file. Each size runs in its own process,
so one size's peaks never carry into the next. The built-in tokenizer took in about 0.5 MB of text per second
on one core of the 2-core AMD EPYC test machine (2 characters per token), so the defaults (10, 20, 40 MB) take a
few minutes on 2 idle cores; ``--sizes 50,100,200,1000`` goes to 1 GB (about 17 minutes of tokenizing alone
there; less on more cores).

Example::

    .venv/bin/python benchmarks/bench_data_prep.py
    .venv/bin/python benchmarks/bench_data_prep.py --sizes 50,100,200,1000 --workdir /mnt/scratch

Human-readable lines first, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MB = 1e6
VOCABULARY = (
    "the of and to in is that for it as with was on be by this are at from or have an they which one you were all "
    "we her she there would their will when who him been has more if no out so said what up its about than into "
    "them can only other new some could time these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get"
)


def write_jsonl(path: Path, size_mb: float, seed: int = 0) -> int:
    """A JSONL file of about ``size_mb`` MB of ``text`` rows; returns the number of rows."""
    rng, words = random.Random(seed), VOCABULARY.split()
    target, written, rows = size_mb * MB, 0, 0
    with path.open("w") as f:
        while written < target:
            line = json.dumps({"text": " ".join(rng.choices(words, k=400))}) + "\n"
            f.write(line)
            written += len(line)
            rows += 1
    return rows


def _status_mb(pid: int, field: str) -> float | None:
    """A memory field of ``/proc/PID/status`` (``VmHWM``, ``RssAnon``) in MB, or None when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / MB
    except OSError:
        return None
    return None


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _ray_worker_title(pid: int) -> str | None:
    """What a Ray worker process says it runs (``ray::MapBatches(_encode_batch)``, ``ray::IDLE``), or None."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    if cmdline.startswith("ray::"):
        return cmdline.split(" ")[0]
    return "ray::(starting)" if "default_worker.py" in cmdline else None


def measure_one(path: Path, cpus: int, seq_len: int) -> dict[str, Any]:
    """Prepare ``path`` in this process (a fresh one per size) and return the figures."""
    import ray

    from raytrain_eks.train.builtin import ensure_builtin_model
    from raytrain_eks.train.data.pipeline import DataSettings, prepare_dataset

    model = str(ensure_builtin_model())
    # address="local": a Ray of this measurement's own, never one already running on the machine.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    private: dict[int, float] = {}  # per worker, the highest RssAnon seen
    running: dict[int, str] = {}  # per worker, what it ran when that rose last
    hwm: dict[int, float] = {}  # per worker, VmHWM (object-store pages it mapped included)
    by_task: dict[str, float] = {}  # per kind of task, the highest RssAnon of a worker while running it
    driver_private = 0.0
    done = threading.Event()

    def poll() -> None:
        nonlocal driver_private
        while not done.is_set():
            driver_private = max(driver_private, _status_mb(os.getpid(), "RssAnon") or 0.0)
            for pid in _descendants(os.getpid()):
                title = _ray_worker_title(pid)
                if title is None:
                    continue
                hwm[pid] = max(hwm.get(pid, 0.0), _status_mb(pid, "VmHWM") or 0.0)
                anon = _status_mb(pid, "RssAnon")
                if anon is not None and title not in ("ray::IDLE", "ray::(starting)"):
                    by_task[title] = max(by_task.get(title, 0.0), anon)
                if anon is not None and anon > private.get(pid, 0.0):
                    private[pid] = anon
                    if title not in ("ray::IDLE", "ray::(starting)") or pid not in running:
                        running[pid] = title
            done.wait(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    start = time.perf_counter()
    stages: list[tuple[str, float]] = []  # what prepare_dataset says it does, and when it began

    def stage(text: str) -> None:
        stages.append((text.split(" ", 1)[0], time.perf_counter()))

    prepared = prepare_dataset(
        DataSettings(
            data_format="text",
            text_field="text",
            tokenizer_path=model,
            seq_len=seq_len,
            seed=0,
        ),
        data=str(path),
        min_blocks=1,
        stage=stage,
    )
    end = time.perf_counter()
    seconds = end - start
    # "reading" (read, tokenize, count) and "shuffling" (keyed sort, pack, materialize), in seconds
    ends = [t for _, t in stages[1:]] + [end]
    stage_seconds = {name: after - began for (name, began), after in zip(stages, ends, strict=True)}
    done.set()
    watcher.join()
    ray.shutdown()
    return {
        "file_mb": path.stat().st_size / MB,
        "rows": prepared.rows,
        "tokens": prepared.tokens,
        "blocks": prepared.blocks,
        "seconds": seconds,
        "stage_seconds": stage_seconds,
        "largest_task_peak_private_mb": max(private.values()) if private else None,
        "largest_task": running.get(max(private, key=private.get)) if private else None,
        "largest_task_peak_rss_mb": max(hwm.values()) if hwm else None,
        "read_tokenize_peak_private_mb": max(
            (mb for task, mb in by_task.items() if "json" in task.lower() or "_encode_batch" in task), default=None
        ),
        "peak_private_mb_by_task": by_task,
        "workers_seen": len(private),
        "driver_peak_private_mb": driver_private,
        "driver_peak_rss_mb": _status_mb(os.getpid(), "VmHWM"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,20,40", help="JSONL file sizes in MB, comma-separated")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the embedded Ray")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--workdir", default=None, help="where the JSONL files are written (default: a temp dir)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure this file and print
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(Path(args.one), args.cpus, args.seq_len)), flush=True)
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-data-prep-", dir=args.workdir) as tmp:
        for size in [float(s) for s in args.sizes.split(",")]:
            path = Path(tmp) / f"data-{size:g}mb.jsonl"
            write_jsonl(path, size)
            run = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    str(path),
                    "--cpus",
                    str(args.cpus),
                    "--seq-len",
                    str(args.seq_len),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if run.returncode != 0:
                sys.exit(f"preparing {path.name} failed:\n{run.stderr[-4000:]}")
            figures = json.loads(run.stdout.strip().splitlines()[-1])
            path.unlink()
            results.append(figures)
            print(
                f"{figures['file_mb']:7.1f} MB JSONL: read/tokenize {figures['read_tokenize_peak_private_mb']:5.0f}"
                f" MB private; largest task {figures['largest_task_peak_private_mb']:5.0f} MB "
                f"private ({figures['largest_task']}), {figures['largest_task_peak_rss_mb']:5.0f} MB RSS; driver "
                f"{figures['driver_peak_private_mb']:5.0f} MB private, {figures['driver_peak_rss_mb']:5.0f} MB RSS; "
                f"{figures['rows']} rows, {figures['tokens']} tokens, {figures['blocks']} blocks, "
                f"{figures['seconds']:.0f} s ("
                + ", ".join(f"{name} {sec:.0f} s" for name, sec in figures["stage_seconds"].items())
                + ")",
                flush=True,
            )
    print(json.dumps({"bench": "data_prep", "cpus": args.cpus, "seq_len": args.seq_len, "results": results}))


if __name__ == "__main__":
    main()
