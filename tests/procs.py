"""This machine's processes as Linux's /proc shows them: enough for tests to find and stop what they started.

Example::

    train_workers()                 # this process's Ray Train workers (its embedded Ray's)
    kill_newest_train_worker()      # SIGKILL one of them, mid-run
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    sid: int
    state: str  # "Z" for a zombie (exited, not yet reaped)
    cmdline: str
    started: float = 0.0  # seconds after the machine booted (the clock of time.clock_gettime(CLOCK_BOOTTIME))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile, or not ours to read
        return None


def read(pid: int) -> Proc | None:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and parentheses.
    fields = stat[stat.rindex(b")") + 2 :].split()
    raw = _read(f"/proc/{pid}/cmdline") or b""
    cmdline = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    # Field 22, the start time, in clock ticks after boot.
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return Proc(
        pid=pid, ppid=int(fields[1]), sid=int(fields[3]), state=fields[0].decode(), cmdline=cmdline, started=started
    )


def alive(pid: int) -> bool:
    """Whether ``pid`` is a living process (a zombie is not)."""
    p = read(pid)
    return p is not None and p.state != "Z"


def processes() -> list[Proc]:
    """Every living process (zombies left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            p = read(int(entry))
            if p is not None and p.state != "Z":
                found.append(p)
    return found


def descendants(pid: int) -> list[Proc]:
    """The living children of ``pid``, their children, and so on."""
    everyone = processes()
    children: dict[int, list[Proc]] = {}
    for p in everyone:
        children.setdefault(p.ppid, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return found


def environ_value(pid: int, name: str) -> str | None:
    """The value of ``name`` in the environment ``pid`` was started with, or ``None``."""
    raw = _read(f"/proc/{pid}/environ")
    prefix = name.encode() + b"="
    for item in (raw or b"").split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


# Ray stops a task worker left idle for a second once there are more workers than CPUs
# (idle_worker_killing_time_threshold_ms in Ray's system config, default 1000). Ray Data starts more than that for
# its zero-CPU tasks, so each stage of a data preparation then started new workers, each importing Ray Data and
# transformers again: 20-25 s for 12 rows on a 2-core machine, against about 1.3 s with the workers kept. The Rays
# the suite starts itself keep them for ten minutes (ray.init's _system_config, ``ray start --system-config``).
TEST_RAY_SYSTEM_CONFIG = {"idle_worker_killing_time_threshold_ms": 600_000}


def start_local_ray() -> None:
    """Start a Ray of the suite's own in this process: ``address="local"``, always a new one (a bare ``ray.init()``
    would join a Ray already running on this machine), started as the tool starts its own local Ray
    (``ray_session.local_ray_environment``: no preemption watcher, workers looked at every half second), and keeping
    its idle task workers (:data:`TEST_RAY_SYSTEM_CONFIG`)."""
    import ray

    from raytrain_eks.ray_session import local_ray_environment

    with local_ray_environment():
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _system_config=TEST_RAY_SYSTEM_CONFIG,
        )


TRAIN_WORKER = "ray::RayTrainWorker"  # the process title Ray gives a Ray Train worker


def train_workers() -> list[Proc]:
    """The Ray Train workers of this process's own Ray (the embedded one is its child), never another Ray's."""
    return [p for p in descendants(os.getpid()) if p.cmdline.startswith(TRAIN_WORKER)]


def kill_newest_train_worker() -> int:
    """SIGKILL this process's newest Ray Train worker and return its pid; there must be one."""
    workers = train_workers()
    assert workers, "no Ray Train worker process found to kill"
    victim = max(workers, key=lambda p: p.pid)
    victim.kill()
    return victim.pid
