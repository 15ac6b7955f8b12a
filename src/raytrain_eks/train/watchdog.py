"""The run's watchdog: every rank beats once per step; when no rank advances for too long, the driver finds the rank
that stopped, keeps every rank's stack and ends the run, instead of every rank waiting out the collective timeout.

Each rank's :func:`heartbeat` notes ``(step, time, its optimizer step's time)`` after every optimizer step (a list
append) and sends what it noted to the run's :class:`BeatBoard` actor at most every :data:`SEND_S` seconds (a
fire-and-forget call), so a step costs about a microsecond on average. The driver's :class:`Watchdog` thread reads
the board every second (and checks for stragglers, :mod:`.stragglers`). Once every rank has beaten,
a run is *stalled* when the newest beat of any rank is older than ``max(training.watchdog_factor x the median step
time, training.watchdog_floor_s)`` (:func:`stalled`). It then inspects each rank's process on its own node
(:func:`inspect_ranks`, a task with no CPU): the process state from ``/proc/PID/stat`` and its Python stack from
``py-spy dump --nonblocking`` (which reads a process's memory without pausing it, so it also works on a stopped
process, where py-spy's default mode fails to suspend it); on CUDA, the NCCL flight recorder's last collectives
too, asked through the pipe file torch's NCCL monitor polls (:func:`nccl_trace_env`). :func:`diagnose` names the rank
that stopped: one whose process cannot run (stopped, a zombie), else one that is not inside a collective while the
others are, else the one whose last beat is oldest; and the collective the others wait in. The findings go into
``RUN_DIR/watchdog/`` (``findings.json``, ``rank<N>.txt`` with every thread's stack) and the run ends with one message
naming the rank, its host and the collective. A rank whose process is gone (killed, its node lost) is not a hang:
Ray Train restarts the worker group from the last checkpoint (``training.max_failures``), and the watchdog waits
until every rank beats again.

Ray only: under ``torchrun`` (no driver, no board) :func:`heartbeat` is a no-op. Example::

    beat = heartbeat(ctx.rank, ctx.device)   # in the loop, before the first step
    beat(step)                               # after each optimizer step
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from raytrain_eks.train.stragglers import (
    RANK_STEPS,
    RankIdentity,
    RankOnBoard,
    StepClock,
    Straggler,
    append_rank_steps,
    find_stragglers,
)

if TYPE_CHECKING:
    import torch
    from ray.actor import ActorHandle

ENV = "RAYTRAIN_EKS_WATCHDOG"  # the run's board actor, by name: set in the workers' environment by the driver
SEND_S = (
    0.25  # a rank sends its noted beats at most this often (an actor call costs 0.3-0.4 ms), whatever the step rate
)
KEEP = 512  # beats kept per rank on the board: the median step time and the straggler check need the recent ones
POLL_S = 1.0  # how often the driver reads the board
INSPECT_WAIT_S = 60.0  # how long the driver waits for a node's answer when it inspects the ranks
FOLDER = "watchdog"  # in the run folder
# The NCCL flight recorder (CUDA only): with TORCH_NCCL_DEBUG_INFO_PIPE_FILE=STEM and TORCH_NCCL_TRACE_BUFFER_SIZE > 0,
# torch's ProcessGroupNCCL makes a named pipe ``STEM{rank}.pipe`` (mkfifo: its folder must exist, hence /tmp) and,
# when a line is written to it, dumps its ring buffer of collectives to ``{TORCH_NCCL_DEBUG_INFO_TEMP_FILE}{rank}``
# (torch's ProcessGroupNCCL.cpp, DumpPipe; ProcessGroupNCCL.hpp lists the variables).
NCCL_TRACE_WAIT_S = 10.0
# Python functions that send or wait for a collective: torch.distributed's (distributed_c10d.py) and FSDP2's
# (_fully_shard/_fsdp_collectives.py, _fsdp_param_group.py). The innermost one in a rank's stack names its wait.
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "monitored_barrier",
        "reduce",
        "gather",
        "scatter",
        "send",
        "recv",
        "foreach_all_gather",
        "foreach_reduce",
        "wait_for_unshard",
        "wait",
    }
)
NOT_RUNNABLE = {"T": "stopped", "t": "stopped by a debugger", "Z": "a zombie", "X": "dead"}


def nccl_stems(name: str) -> tuple[str, str]:
    """The run's (pipe, dump) file stems of the NCCL flight recorder, ``name`` its board's (one run's own, on a node
    that runs several)."""
    return f"/tmp/{name}-nccl-pipe-rank", f"/tmp/{name}-nccl-trace-rank"


def nccl_trace_env(name: str) -> dict[str, str]:
    """The variables that keep NCCL's flight recorder on in the workers and let the watchdog ask for its dump."""
    pipe, trace = nccl_stems(name)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "2000",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": pipe,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace,
    }


class SpyFrame(TypedDict, total=False):
    """A frame of ``py-spy dump --json`` (py-spy's ``Frame``, of which these fields are read)."""

    name: str
    filename: str
    line: int


class SpyThread(TypedDict, total=False):
    """A thread of ``py-spy dump --json`` (py-spy's ``StackTrace``, of which these fields are read), innermost frame
    first."""

    os_thread_id: int
    thread_name: str
    active: bool
    frames: list[SpyFrame]


class RankProcess(TypedDict):
    """A rank's process as its node saw it (:func:`inspect_ranks`): its state, its threads, why there are none, and
    the NCCL flight recorder's dump."""

    state: str
    threads: list[SpyThread]
    error: str | None
    nccl: bytes | None


# -- the ranks' side --------------------------------------------------------------------------------------------


class _Beats:
    """A rank's beat: notes ``(step, wall time, its own time)`` (``clock``: the optimizer step's time, see
    :mod:`.stragglers`), sends the notes to the board at most every :data:`SEND_S`."""

    def __init__(self, board: ActorHandle, rank: int, who: RankIdentity, clock: StepClock | None = None) -> None:
        self._board, self._rank, self._who, self._clock = board, rank, who, clock
        self._noted: list[tuple[int, float, float | None]] = []
        self._sent = 0.0

    def __call__(self, step: int) -> None:
        now = time.time()  # wall time: the ranks' beats are compared across hosts
        self._noted.append((step, now, self._clock.take() if self._clock is not None else None))
        if now - self._sent >= SEND_S:
            self._board.beat.remote(self._rank, self._who, self._noted)  # not waited for
            self._noted, self._sent = [], now


def _no_beat(step: int) -> None:
    """Nothing watches this run (torchrun, a test, the watchdog off)."""


def heartbeat(
    rank: int, device: torch.device | None = None, optimizer: torch.optim.Optimizer | None = None
) -> Callable[[int], None]:
    """This rank's per-step beat: to the run's board when the driver started one (its name in :data:`ENV`), else a
    no-op. ``device`` (a torch device) names the GPU in the board's record of the rank; ``optimizer``'s steps are
    timed for the straggler check (:class:`~raytrain_eks.train.stragglers.StepClock`)."""
    name = os.environ.get(ENV)
    if not name:
        return _no_beat
    import ray

    if not ray.is_initialized():
        return _no_beat
    gpu = None
    if device is not None and getattr(device, "type", "") == "cuda":
        import torch

        gpu = f"{torch.cuda.get_device_name(device)} (cuda:{device.index}, CUDA_VISIBLE_DEVICES="
        gpu += f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')})"
    who: RankIdentity = {
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "gpu": gpu,
    }
    try:
        board = ray.get_actor(name)
    except ValueError:  # the driver's board is gone: the run trains on, unwatched
        return _no_beat
    return _Beats(board, rank, who, StepClock(optimizer, device) if optimizer is not None else None)


class BeatBoard:
    """The run's beats, rank by rank (a Ray actor with no CPU, on the driver's node): who each rank is (node, host,
    process, GPU) and its last :data:`KEEP` ``(step, time)`` beats. A rank that beats from a new process (a restarted
    worker group) starts afresh."""

    def __init__(self) -> None:
        self._ranks: dict[int, RankOnBoard] = {}

    def beat(self, rank: int, who: RankIdentity, beats: list[tuple[int, float, float | None]]) -> None:
        held = self._ranks.get(rank)
        if held is None or held["pid"] != who["pid"]:
            held = self._ranks[rank] = {**who, "rank": rank, "beats": []}
        held["beats"] = (held["beats"] + [list(b) for b in beats])[-KEEP:]

    def snapshot(self) -> dict[int, RankOnBoard]:
        return self._ranks

    def reset(self) -> None:
        self._ranks = {}


# -- detection, on recorded beats ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stall:
    """No rank advanced for ``quiet_s`` seconds, more than ``threshold_s``."""

    quiet_s: float
    threshold_s: float
    median_step_s: float | None


def step_times(beats: list[list[float]]) -> dict[int, float]:
    """Seconds of each step of one rank, from its beats (``[step, time]``, oldest first): the time from the beat of
    the step before; a step after a gap (a restart) has none."""
    return {int(b[0]): b[1] - a[1] for a, b in zip(beats, beats[1:], strict=False) if b[0] == a[0] + 1}


def median_step_s(ranks: dict[int, RankOnBoard]) -> float | None:
    """The median step time over every rank's recorded steps; ``None`` before any rank took two steps."""
    times = [t for r in ranks.values() for t in step_times(r["beats"]).values()]
    return statistics.median(times) if times else None


def stalled(
    ranks: dict[int, RankOnBoard], *, world_size: int, last_step: int, now: float, factor: float, floor_s: float
) -> Stall | None:
    """A :class:`Stall` when every rank has beaten, not all reached ``last_step``, and the newest beat of any rank is
    older than ``max(factor x median step time, floor_s)``; else ``None``."""
    if len(ranks) < world_size or any(not r["beats"] for r in ranks.values()):
        return None  # not armed: the run (or a restarted worker group) has not stepped on every rank yet
    if all(int(r["beats"][-1][0]) >= last_step for r in ranks.values()):
        return None  # the steps are done: the end of the run (samples, the last checkpoint) is not watched
    median = median_step_s(ranks)
    threshold = max(factor * median, floor_s) if median is not None else floor_s
    quiet = now - max(float(r["beats"][-1][1]) for r in ranks.values())
    return Stall(quiet, threshold, median) if quiet > threshold else None


@dataclass(frozen=True)
class RankLook:
    """One rank's process as its node saw it: its state (``/proc``'s letter; ``gone`` when the process is not
    there, ``unreachable`` when its node did not answer), its stack as text, and the collective it waits in."""

    state: str
    stack: str = ""
    collective: str | None = None
    in_loop: bool = False  # its stack shows the training loop (a stack was read)


@dataclass(frozen=True)
class Finding:
    """What the watchdog found: the rank that stopped, its host, why it is named, the collective the others wait
    in, and the one message for the user."""

    rank: int | None
    host: str | None
    hostname: str | None
    gpu: str | None
    step: int | None
    reason: str
    collective: str | None
    message: str
    quiet_s: float
    threshold_s: float
    ranks: list[dict[str, object]] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def diagnose(ranks: dict[int, RankOnBoard], looks: dict[int, RankLook], stall: Stall) -> Finding:
    """Name the rank that stopped (see the module's docstring for the order of evidence) and the collective the
    other ranks wait in."""
    last = {r: int(info["beats"][-1][0]) for r, info in ranks.items()}
    waiting = {r for r, look in looks.items() if look.collective}
    culprit, reason = None, "no rank stands out: every rank waits"
    for rank in sorted(ranks, key=lambda r: (ranks[r]["beats"][-1][1], r)):
        look = looks.get(rank, RankLook("unknown"))
        if look.state in NOT_RUNNABLE:
            culprit, reason = rank, f"its process is {NOT_RUNNABLE[look.state]} (state {look.state})"
            break
    if culprit is None and waiting and len(waiting) < len(ranks):
        outside = [r for r in sorted(ranks) if r not in waiting and looks.get(r, RankLook("unknown")).in_loop]
        if outside:
            culprit, reason = outside[0], "it is not inside a collective while the other ranks are"
    if culprit is None and len(set(last.values())) > 1:
        culprit = min(last, key=lambda r: (last[r], r))
        reason = f"its last step ({last[culprit]}) is behind the others'"
    others = [looks[r].collective for r in sorted(looks) if r != culprit and looks[r].collective]
    collective = max(set(others), key=others.count) if others else None
    info = ranks.get(culprit) if culprit is not None else None
    finding = Finding(
        rank=culprit,
        host=info["host"] if info else None,
        hostname=info["hostname"] if info else None,
        gpu=info["gpu"] if info else None,
        step=last.get(culprit) if culprit is not None else None,
        reason=reason,
        collective=collective,
        message="",
        quiet_s=stall.quiet_s,
        threshold_s=stall.threshold_s,
        ranks=[
            {**{k: v for k, v in ranks[r].items() if k != "beats"}, "last_step": last[r], **_look_json(looks.get(r))}
            for r in sorted(ranks)
        ],
    )
    return _with_message(finding, stall)


def _look_json(look: RankLook | None) -> dict[str, object]:
    if look is None:
        return {"state": "unknown", "collective": None}
    return {"state": look.state, "collective": look.collective}


def _with_message(finding: Finding, stall: Stall) -> Finding:
    median = f"{stall.median_step_s:.2f} s" if stall.median_step_s is not None else "not known yet"
    quiet = f"no rank advanced for {stall.quiet_s:.0f} s (threshold {stall.threshold_s:.0f} s; median step {median})"
    if finding.rank is None:
        text = f"watchdog: the run hangs, {quiet}; {finding.reason}"
    else:
        where = finding.host + (f" ({finding.hostname})" if finding.hostname else "") if finding.host else "?"
        gpu = f", GPU {finding.gpu}" if finding.gpu else ""
        text = f"watchdog: rank {finding.rank} on host {where}{gpu} stopped after step {finding.step}: {finding.reason}"
        text += f"; {quiet}"
    waits = f"the other ranks wait in {finding.collective}" if finding.collective else "no rank is in a collective"
    return replace(finding, message=f"{text}; {waits}")


def waiting_in(frames: list[SpyFrame]) -> str | None:
    """The collective a thread waits in (py-spy's frames, innermost first): the innermost frame of torch.distributed
    in :data:`COLLECTIVES`, the outermost such frame when it is another (FSDP's, which called it), and the innermost
    frame of this package above them (where the run called it). ``None`` when the thread is not in one."""
    inside = [
        i
        for i, f in enumerate(frames)
        if f.get("name") in COLLECTIVES and f"torch{os.sep}distributed" in str(f.get("filename", ""))
    ]
    if not inside:
        return None
    name = str(frames[inside[0]]["name"])
    outer = frames[inside[-1]]["name"]
    if outer != name:
        name += f" via {outer}"
    caller = next((f for f in frames[inside[-1] + 1 :] if "raytrain_eks" in str(f.get("filename", ""))), None)
    if caller is not None:
        name += f" called from {caller.get('name')} ({Path(caller.get('filename', '')).name}:{caller.get('line')})"
    return name


def look_from_dump(state: str, threads: list[SpyThread]) -> RankLook:
    """A rank's :class:`RankLook` from its process state and ``py-spy dump --json``'s threads: the thread of the
    training loop decides (the one whose stack shows this package's loop), else the first."""
    loop = next((t for t in threads if any(_is_loop(f) for f in t.get("frames", []))), None)
    chosen: SpyThread = loop or (threads[0] if threads else {"frames": []})
    return RankLook(
        state=state,
        stack=format_threads(threads),
        collective=waiting_in(chosen.get("frames", [])),
        in_loop=loop is not None,
    )


def _is_loop(frame: SpyFrame) -> bool:
    return str(frame.get("filename", "")).endswith(os.path.join("raytrain_eks", "train", "loop.py"))


def format_threads(threads: list[SpyThread]) -> str:
    """py-spy's threads as text, innermost frame first (as ``py-spy dump`` prints them)."""
    out = []
    for t in threads:
        out.append(f"Thread {t.get('os_thread_id')} ({'active' if t.get('active') else 'idle'}) {t.get('thread_name')}")
        out += [f"    {f.get('name')} ({f.get('filename')}:{f.get('line')})" for f in t.get("frames", [])]
    return "\n".join(out) + "\n"


# -- the nodes' side: what a rank's process is doing ---------------------------------------------------------------


def process_state(pid: int) -> str:
    """``/proc/PID/stat``'s state letter (``R`` running, ``S`` sleeping, ``T`` stopped...), ``gone`` without it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces and brackets


def inspect_ranks(pids: dict[int, int], nccl: str | None) -> dict[int, RankProcess]:
    """On a node: each rank's (``pids``: rank -> pid) process state, its threads from ``py-spy dump --nonblocking
    --json`` (or why there are none), and with ``nccl`` (the run's name, :func:`nccl_stems`) the flight recorder's
    dump (bytes, or ``None``)."""
    import subprocess

    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    out: dict[int, RankProcess] = {}
    for rank, pid in pids.items():
        entry: RankProcess = {"state": process_state(pid), "threads": [], "error": None, "nccl": None}
        out[rank] = entry
        if entry["state"] == "gone":
            continue
        if spy is None:
            entry["error"] = "py-spy is not installed on this node (pip install py-spy==0.4.3)"
        else:
            argv = [spy, "dump", "--pid", str(pid), "--nonblocking", "--json"]
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
                if proc.returncode == 0:
                    entry["threads"] = json.loads(proc.stdout)
                else:
                    entry["error"] = f"py-spy failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
            except (subprocess.TimeoutExpired, ValueError) as exc:
                entry["error"] = f"py-spy failed: {exc}"
        if nccl:
            entry["nccl"] = _nccl_dump(nccl, rank)
    return out


def _nccl_dump(name: str, rank: int) -> bytes | None:
    """Ask torch's NCCL monitor of ``rank`` for the flight recorder's dump through its pipe, and read it."""
    pipe_stem, trace_stem = nccl_stems(name)
    pipe, trace = Path(f"{pipe_stem}{rank}.pipe"), Path(f"{trace_stem}{rank}")
    if not pipe.exists():
        return None
    trace.unlink(missing_ok=True)
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)  # fails at once when no monitor reads it
        with os.fdopen(fd, "w") as f:
            f.write("1\n")
    except OSError:
        return None
    deadline = time.monotonic() + NCCL_TRACE_WAIT_S
    while time.monotonic() < deadline:
        if trace.exists() and trace.stat().st_size:
            time.sleep(0.5)  # the dump may still be written
            return trace.read_bytes()
        time.sleep(0.2)
    return None


# -- the driver's side ---------------------------------------------------------------------------------------------


@dataclass
class WatchSettings:
    """What the watchdog watches for: the run's ranks and last step, ``training.watchdog_factor`` and
    ``training.watchdog_floor_s``; ``nccl``: the run's name (:func:`nccl_stems`) to ask the NCCL flight recorder
    for its dump too (GPU workers); and the straggler check's
    ``training.straggler_margin`` and ``training.straggler_steps``."""

    world_size: int
    last_step: int
    factor: float
    floor_s: float
    nccl: str | None = None
    poll_s: float = POLL_S
    straggler_margin: float = 1.3
    straggler_steps: int = 5


class Watchdog:
    """The driver's watch over the board (a thread): each :class:`~raytrain_eks.train.stragglers.Straggler` is handed
    to ``found`` as it is found, and each step's times appended to ``run_dir/rank_steps.jsonl``; on a stall, the ranks
    are inspected, the findings written to ``run_dir/watchdog/`` and handed to ``found`` (once); a rank whose process
    is gone is Ray Train's to restart, and ``say`` tells the user the watch waits for every rank to step again."""

    def __init__(
        self,
        board: ActorHandle,
        settings: WatchSettings,
        run_dir: Path,
        found: Callable[[Finding | Straggler], None],
        say: Callable[[str], None],
    ) -> None:
        self._board, self._settings, self._run_dir = board, settings, run_dir
        self._found, self._say = found, say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-eks-watchdog", daemon=True)
        self.finding: Finding | None = None
        self._named: set[int] = set()  # the ranks named as stragglers, until they are not slow any more
        self._written = 0  # the newest step in rank_steps.jsonl

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=INSPECT_WAIT_S + 10)

    def _run(self) -> None:
        import ray

        s = self._settings
        while not self._stop.wait(s.poll_s):
            try:
                ranks = ray.get(self._board.snapshot.remote(), timeout=30)
            except Exception:  # Ray going down with the run: nothing left to watch
                return
            stall = stalled(
                ranks,
                world_size=s.world_size,
                last_step=s.last_step,
                now=time.time(),
                factor=s.factor,
                floor_s=s.floor_s,
            )
            self._stragglers(ranks)
            if stall is None or self._stop.is_set():
                continue
            looks, dumps = self._inspect(ranks)
            gone = sorted(r for r, look in looks.items() if look.state in ("gone", "unreachable"))
            if gone:
                self._say(
                    f"watchdog: rank {', '.join(map(str, gone))} has no process (or its node does not answer): Ray "
                    "Train restarts the worker group; watching again once every rank steps"
                )
                self._board.reset.remote()
                continue
            self.finding = diagnose(ranks, looks, stall)
            write_findings(self._run_dir / FOLDER, self.finding, looks, dumps)
            self._found(self.finding)
            return

    def _stragglers(self, ranks: dict[int, RankOnBoard]) -> None:
        s = self._settings
        self._written = append_rank_steps(self._run_dir / RANK_STEPS, ranks, self._written)
        for straggler in find_stragglers(ranks, margin=s.straggler_margin, steps=s.straggler_steps, named=self._named):
            self._found(straggler)

    def _inspect(self, ranks: dict[int, RankOnBoard]) -> tuple[dict[int, RankLook], dict[int, bytes]]:
        """Every rank's :class:`RankLook` (and NCCL dumps), from one task on each of their nodes."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(inspect_ranks)  # no CPU: the ranks may hold every one
        by_node: dict[str, dict[int, int]] = {}
        for rank, info in ranks.items():
            by_node.setdefault(info["node_id"], {})[rank] = int(info["pid"])
        refs = {
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                pids, self._settings.nccl
            ): pids
            for node, pids in by_node.items()
        }
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=INSPECT_WAIT_S)
        looks: dict[int, RankLook] = {}
        dumps: dict[int, bytes] = {}
        for ref, pids in refs.items():
            try:
                answers = ray.get(ref, timeout=1) if ref in done else None
            except Exception:  # the task failed, or its node went meanwhile
                answers = None
            if answers is None:
                ray.cancel(ref, force=True)
                looks.update({r: RankLook("unreachable") for r in pids})
                continue
            for rank, entry in answers.items():
                look = look_from_dump(entry["state"], entry["threads"])
                looks[rank] = look if not entry["error"] else RankLook(look.state, stack=entry["error"] + "\n")
                if entry["nccl"]:
                    dumps[rank] = entry["nccl"]
        return looks, dumps


def write_findings(folder: Path, finding: Finding, looks: dict[int, RankLook], dumps: dict[int, bytes]) -> None:
    """``findings.json``, ``rank<N>.txt`` (each rank's process state and every thread's stack) and, on CUDA,
    ``nccl_trace_rank<N>.pkl`` (the flight recorder's dump, read with torch's ``fr_trace`` tool)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "findings.json").write_text(json.dumps(finding.to_json(), indent=2) + "\n")
    for rank, look in sorted(looks.items()):
        head = f"rank {rank}: process state {look.state}; waits in {look.collective or 'no collective'}\n\n"
        (folder / f"rank{rank}.txt").write_text(head + look.stack)
    for rank, data in dumps.items():
        (folder / f"nccl_trace_rank{rank}.pkl").write_bytes(data)


def start_board(name: str) -> ActorHandle:
    """The run's :class:`BeatBoard`, named ``name`` (the workers find it by that name), on the driver's node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    board = (
        ray.remote(BeatBoard)
        .options(name=name, num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
        .remote()
    )
    ray.get(board.snapshot.remote(), timeout=120)  # up (and found by its name) before any worker looks for it
    return board
