"""A run's bundle: what its run folder holds, kept in its storage folder beside its checkpoints, so that the run's
results outlive the machine (or the head pod) its driver ran on.

With ``training.storage_path`` set, a run's storage folder ``STORAGE_PATH/RUN`` (see
:func:`~raytrain_eks.train.checkpoint.storage_root`) holds its ``config.yaml`` and its checkpoints (``ray/``) from
the start; :class:`RunBundle` adds the rest of the run folder, as the run goes:

- ``run.json`` (:data:`RUN_STATE`): running, finished, failed or stopped; when it started, was last updated and
  ended, steps, last loss, cost, the one-line error. Written first, refreshed at every sync, written last at the end,
  so a bundle that says ``finished`` is whole.
- every :data:`SYNC_S` seconds while the run goes, on a thread of its own: ``metrics.jsonl`` (every attempt's logged
  steps), ``train.log`` (the driver's lines), ``error.log``, ``nccl/rank*.log`` and ``rank_steps.jsonl`` when they
  changed;
- at the end, everything else of the run folder: the export ``model/``, ``summary.json``, ``samples.jsonl``,
  ``eval.json`` (:data:`~raytrain_eks.folders.EVAL_RESULTS`, ``train --eval-tasks``), ``report.html``,
  ``plots/``, ``tensorboard/``;
  after a failure, what the run folder holds then (``error.log`` with every failed rank's traceback among it;
  ``watchdog/``, every rank's stack, when the watchdog ended a hung run).
- ``logs/NODE/`` (:data:`WORKER_LOGS`): the output of the run's Ray worker processes (the training ranks among them)
  on each node, as Ray writes it in the node's session folder, each file's last :data:`LOG_TAIL` bytes; at every
  sync once the driver names its Ray job (:meth:`RunBundle.follow_workers`), and a last time when training has ended
  or failed (:meth:`RunBundle.last_worker_logs`).

A local run without a storage path keeps its run folder as it is, and has no bundle. Example::

    bundle = RunBundle.start(run_dir, "s3://bucket/runs", total_steps=100, lines=said)  # None without storage
    bundle.step({"step": 10, "loss": 2.1, ...})   # in the driver's loop: in memory; uploads happen on their thread
    bundle.finish(summary)                        # the whole run folder, then run.json "finished"
"""

from __future__ import annotations

import functools
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from raytrain_eks.errors import UserError
from raytrain_eks.report.segments import SEGMENTS
from raytrain_eks.train.checkpoint import RAY_DIR, storage_root
from raytrain_eks.train.storage import filesystem, is_remote, join

RUN_STATE = "run.json"
DRIVER_LOG = "train.log"
METRICS = "metrics.jsonl"
ERROR_LOG = "error.log"
# What the sync thread uploads while the run goes (small, and what a run that dies leaves as its evidence); the rest
# of the run folder goes at the end.
LIVE = (METRICS, ERROR_LOG, "nccl", "rank_steps.jsonl")  # the last: each rank's own time per step (stragglers.py)
# Seconds between two uploads of the live files: a few small PUTs every half minute, whatever the step rate.
SYNC_S = 30.0
# Files copied at once at the end (the export's safetensors files, the plots), each in pieces of COPY_CHUNK bytes.
COPY_FILES = 4
COPY_CHUNK = 8 << 20
STATES = ("running", "finished", "failed", "stopped")
# The workers' output: Ray writes each worker process's stdout and stderr to ``worker-<worker id>-<job id>-<pid>``
# ``.out``/``.err`` in its node's session log folder (ray/_private/ray_logging's get_worker_log_file_name), and Ray
# Train's workers run under the job of the driver that created them. Each file's last LOG_TAIL bytes are kept: a
# rank's last words are at its end, and a chatty one stays affordable to upload at every sync.
WORKER_LOGS = "logs"
LOG_TAIL = 4 << 20
# Seconds the driver waits for the nodes' copies; a node that does not answer by then is named in the warning.
LOGS_WAIT_S = 60.0
# A worker file last written before the bundle started (less this, for clocks a little apart) belongs to an earlier
# run of the same Ray job (a driver that trains twice), not to this one.
CLOCK_SLACK_S = 5.0


def now_text() -> str:
    """The time as run.json holds it: ISO 8601 in UTC, to the second (``2026-01-31T12:00:00Z``)."""
    return f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}"


class RunBundle:
    """The run folder ``run_dir`` mirrored into ``location`` (its storage folder); see the module's docstring.

    ``lines`` is the list the driver appends its printed lines to (written as ``train.log``); ``warn`` prints a line
    when storage cannot be written (once while the run goes: training is never stopped for it)."""

    def __init__(
        self,
        run_dir: Path,
        location: str,
        *,
        total_steps: int | None = None,
        lines: list[str] | None = None,
        warn: Callable[[str], None] = print,
        every_s: float = SYNC_S,
    ) -> None:
        self.run_dir = run_dir
        self.location = location
        self.every_s = every_s
        self._fs, self._base = filesystem(location)
        self._local = not is_remote(location)
        self._lines = lines if lines is not None else []
        self._warn = warn
        self._warned = False
        self._unwritten: dict[str, str] = {}  # relative path -> why it could not be written, until it is
        self._sent: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) as last uploaded
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._job: str | None = None  # the Ray job whose workers' logs the syncs copy, once named
        self._since = time.time() - CLOCK_SLACK_S
        self._logs_sent: dict[str, dict[str, tuple[int, int]]] = {}  # node id -> its files as last copied
        self._logs_warned = False
        self.state: dict[str, Any] = {
            "run": run_dir.name,
            "state": "running",
            "started": now_text(),
            "updated": None,
            "ended": None,
            "steps": None,
            "total_steps": total_steps,
            "final_loss": None,
            "cost": None,
            "error": None,
            "run_dir": str(run_dir),
            "host": socket.gethostname(),
        }

    @classmethod
    def start(
        cls,
        run_dir: Path,
        storage_path: str | None,
        *,
        total_steps: int | None = None,
        lines: list[str] | None = None,
        warn: Callable[[str], None] = print,
        every_s: float = SYNC_S,
    ) -> RunBundle | None:
        """The run's bundle, begun: ``run.json`` says ``running``, a run folder that lacks the bundle's metrics (a run
        resumed on another machine) gets them first, and the sync thread runs. ``None`` without a storage path."""
        if not storage_path:
            return None
        bundle = cls(
            run_dir,
            storage_root(run_dir, storage_path),
            total_steps=total_steps,
            lines=lines,
            warn=warn,
            every_s=every_s,
        )
        bundle._restore(METRICS, ERROR_LOG, SEGMENTS)
        bundle.sync()
        bundle._thread = threading.Thread(target=bundle._run, name="run-bundle-sync", daemon=True)
        bundle._thread.start()
        return bundle

    # -- the run's side ------------------------------------------------------------------------------------------

    def step(self, record: dict[str, Any]) -> None:
        """Note a logged step (``metrics.jsonl``'s record): run.json's steps and last loss at the next sync."""
        self.state["steps"] = record.get("step", self.state["steps"])
        self.state["final_loss"] = record.get("loss", self.state["final_loss"])

    def finish(self, summary: dict[str, Any]) -> bool:
        """The whole run folder into the bundle, then run.json ``finished`` with the summary's figures. Returns
        whether every file was written (when not, the line printed says which and why)."""
        self._halt()
        self.state.update(
            steps=summary.get("steps", self.state["steps"]),
            final_loss=summary.get("final_loss", self.state["final_loss"]),
            cost=summary.get("cost"),
            wall_s=summary.get("wall_s"),
        )
        return self._close("finished")

    def fail(self, error: str) -> bool:
        """What the run folder holds now (metrics, error.log, NCCL lines...) into the bundle, then run.json
        ``failed`` with ``error`` (the one-line message the run stopped with)."""
        self._halt()
        self.state["error"] = error
        return self._close("failed")

    def close(self) -> None:
        """Stop the sync thread; a bundle neither finished nor failed (the driver interrupted) is marked
        ``stopped`` with what the run folder holds."""
        if self.state["state"] == "running":
            self._halt()
            self._close("stopped")

    def follow_workers(self, job_id: str) -> None:
        """From now on, every sync also copies the output of the Ray job ``job_id``'s workers into ``logs/``
        (Ray is up, this process its driver)."""
        self._job = job_id

    def last_worker_logs(self) -> bool:
        """Copy the workers' output a last time (training has ended or failed; Ray is still up) and stop copying it:
        Ray may go from here on. Returns whether every node's copy was written (when not, a line said why)."""
        with self._lock:
            ok = self._put_worker_logs()
            self._job = None
            return ok

    # -- uploads -------------------------------------------------------------------------------------------------

    def sync(self) -> bool:
        """Upload the live files that changed since their last upload, ``train.log`` and ``run.json`` (and the
        workers' output, once :meth:`follow_workers` named their job)."""
        with self._lock:
            files = [p for name in LIVE for p in self._files(name)]
            ok = self._put_files(files)
            ok = self._put_text(DRIVER_LOG, "".join(line + "\n" for line in list(self._lines))) and ok
            self._put_worker_logs()  # its own warning: the run's files are whole without it
            return self._put_state() and ok

    def _put_worker_logs(self) -> bool:
        """One task on each alive node of the Ray cluster copies its files of the job's workers into
        ``logs/NODE/`` (:func:`_copy_node_logs`); a failure is said once and never stops the run."""
        if self._job is None:
            return True
        problems: list[str] = []
        try:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
            task = _node_log_task()
            refs = {
                node: task.options(
                    # There and nowhere else: another node's task would copy its own files, not this one's.
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote(self.location, self._job, self._since, self._logs_sent.get(node, {}))
                for node in nodes
            }
            done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=LOGS_WAIT_S) if refs else ([], [])
            for node, ref in refs.items():
                if ref not in done:
                    ray.cancel(ref)
                    problems.append(f"node {node[:8]} did not answer in {LOGS_WAIT_S:.0f} s")
                    continue
                try:
                    sent, why = ray.get(ref)
                except Exception as exc:  # the task failed, or its node went meanwhile
                    problems.append(f"node {node[:8]}: {_first_line(exc)}")
                    continue
                self._logs_sent[node] = sent
                if why:
                    problems.append(why)
        except Exception as exc:  # anything of Ray's: training goes on without the workers' logs
            problems.append(_first_line(exc))
        if problems and not self._logs_warned:
            self._logs_warned = True
            self._warn(
                f"run bundle: the workers' logs were not all copied to {join(self.location, WORKER_LOGS)} "
                f"({'; '.join(problems)}); the run goes on, and each node's Ray session folder keeps them"
            )
        return not problems

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sync()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _close(self, state: str) -> bool:
        with self._lock:
            self.state.update(state=state, ended=now_text())
            ok = self._put_files(self._files(None))
            ok = self._put_text(DRIVER_LOG, "".join(line + "\n" for line in list(self._lines))) and ok
            ok = self._put_state() and ok  # last: a bundle that says it is finished is whole
        if not ok:
            rel, why = next(iter(self._unwritten.items()))
            self._warn(
                f"run bundle: {len(self._unwritten)} file(s) of the run could not be written to {self.location} "
                f"({rel}: {why}); the run folder {self.run_dir} keeps everything"
            )
        return ok

    def _files(self, name: str | None) -> list[Path]:
        """The run folder's files under ``name`` (a file or folder of it; ``None``: all), checkpoints left out."""
        top = self.run_dir if name is None else self.run_dir / name
        if top.is_file():
            return [top]
        if not top.is_dir():
            return []
        return sorted(p for p in top.rglob("*") if p.is_file() and p.relative_to(self.run_dir).parts[0] != RAY_DIR)

    def _put_files(self, files: list[Path]) -> bool:
        changed = []
        for path in files:
            try:
                st = path.stat()
            except OSError:  # removed meanwhile
                continue
            rel = path.relative_to(self.run_dir).as_posix()
            if self._sent.get(rel) != (st.st_size, st.st_mtime_ns):
                changed.append((path, rel, (st.st_size, st.st_mtime_ns)))
        if not changed:
            return True

        def put(item: tuple[Path, str, tuple[int, int]]) -> bool:
            path, rel, stamp = item
            ok = self._write(rel, lambda out: _copy_into(path, out))
            if ok:
                self._sent[rel] = stamp
            return ok

        with ThreadPoolExecutor(max_workers=COPY_FILES) as pool:
            return all(list(pool.map(put, changed)))

    def _put_text(self, rel: str, text: str) -> bool:
        return self._write(rel, lambda out: out.write(text.encode()))

    def _put_state(self) -> bool:
        self.state["updated"] = now_text()
        return self._put_text(RUN_STATE, json.dumps(self.state, indent=2) + "\n")

    def _write(self, rel: str, fill: Callable[[Any], object]) -> bool:
        target = f"{self._base}/{rel}"
        try:
            if self._local:
                self._fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            with self._fs.open_output_stream(target) as out:
                fill(out)
        except OSError as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self._unwritten[rel] = why
            if not self._warned and self.state["state"] == "running":  # once while the run goes; its end says all
                self._warned = True
                self._warn(
                    f"run bundle: cannot write {join(self.location, rel)}: {why}; the run goes on, and its run folder "
                    f"{self.run_dir} keeps everything"
                )
            return False
        self._unwritten.pop(rel, None)
        return True

    def _restore(self, *names: str) -> None:
        """Copy ``names`` from the bundle into a run folder that does not have them (a run resumed on a machine
        without its folder), so the run appends to every earlier attempt's records rather than replacing them."""
        from pyarrow import fs as pafs

        for name in names:
            local = self.run_dir / name
            if local.exists():
                continue
            remote = f"{self._base}/{name}"
            try:
                if self._fs.get_file_info(remote).type != pafs.FileType.File:
                    continue
                with self._fs.open_input_stream(remote) as src:
                    local.write_bytes(src.read())
            except OSError:
                continue  # nothing to continue from: the run writes its own


def worker_log_name(job_id: str) -> re.Pattern[str]:
    """The names Ray gives the output files of the job ``job_id``'s workers: ``worker-<worker id>-<job id>-<pid>``
    then ``.out`` or ``.err``. Example: ``worker_log_name("01000000").fullmatch("worker-ab12-01000000-4242.err")``."""
    return re.compile(rf"worker-[0-9a-f]+-{re.escape(job_id)}-\d+\.(?:out|err)")


def log_tail(path: Path, keep: int = LOG_TAIL) -> bytes:
    """``path``'s bytes, or, when it holds more than ``keep``, its last ``keep`` from a line's start, after a line
    saying how much was left out."""
    with path.open("rb") as src:
        src.seek(0, 2)
        size = src.tell()
        if size <= keep:
            src.seek(0)
            return src.read()
        src.seek(size - keep)
        tail = src.read(keep)
    tail = tail[tail.find(b"\n") + 1 :]  # from a whole line
    note = (
        f"[raytrain-eks: the first {size - len(tail)} of this file's {size} bytes are left out: the run bundle keeps "
        f"the last {keep >> 20} MiB of each worker log; the node's Ray session folder has it all]\n"
    )
    return note.encode() + tail


def _copy_node_logs(
    location: str, job_id: str, since: float, sent: dict[str, tuple[int, int]], keep: int = LOG_TAIL
) -> tuple[dict[str, tuple[int, int]], str | None]:
    """Run on a node (a Ray task): copy the output files of the job ``job_id``'s workers in this node's session log
    folder, written to since ``since``, into ``location/logs/<host>-<node id>/`` (each its :func:`log_tail`),
    leaving out those unchanged since ``sent`` (name -> (size, mtime_ns)). Returns the files as now copied and what
    went wrong (``None``: nothing)."""
    logs_dir, folder = _this_node()
    if logs_dir is None:
        return sent, f"{folder}: its Ray writes no log files (its workers' output goes to stderr)"
    names = worker_log_name(job_id)
    fs, base = filesystem(location)
    copied = dict(sent)
    problem = None
    for path in sorted(logs_dir.iterdir()):
        if not names.fullmatch(path.name):
            continue
        try:
            st = path.stat()
            if st.st_mtime < since or copied.get(path.name) == (st.st_size, st.st_mtime_ns):
                continue
            target = f"{base}/{WORKER_LOGS}/{folder}/{path.name}"
            if not is_remote(location):
                fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            with fs.open_output_stream(target) as out:
                out.write(log_tail(path, keep))
        except OSError as exc:
            problem = problem or f"{folder}: {path.name}: {_first_line(exc)}"
            continue
        copied[path.name] = (st.st_size, st.st_mtime_ns)
    return copied, problem


def _this_node() -> tuple[Path | None, str]:
    """(this node's Ray session log folder, or ``None`` when its Ray writes none; the name of its folder in
    ``logs/``: its host name and the start of its Ray node id), in a Ray worker process."""
    import ray
    from ray._private import worker as ray_worker

    node = ray_worker._global_node  # the Ray node of this worker process (ray/_private/node.py's Node)
    folder = f"{socket.gethostname()}-{ray.get_runtime_context().get_node_id()[:8]}"
    if node is None or not node.should_redirect_logs():
        return None, folder
    return Path(node.get_logs_dir_path()), folder


@functools.cache
def _node_log_task() -> Any:
    import ray

    # No CPU asked: the training ranks may hold every CPU of a node, and the copy must not wait for one of them.
    return ray.remote(num_cpus=0, max_retries=0)(_copy_node_logs)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _copy_into(path: Path, out: Any) -> None:
    with path.open("rb") as src:
        while chunk := src.read(COPY_CHUNK):
            out.write(chunk)


def put_run_file(run_dir: Path, storage_path: str, name: str) -> str:
    """Copy the run folder's file ``name`` into the run's bundle (its storage folder), after the run has ended (a
    later ``raytrain-eks eval`` writes ``eval.json``); returns where it went. A :class:`UserError` when storage
    cannot be written."""
    location = join(storage_root(run_dir, storage_path), name)
    try:
        fs, base = filesystem(location)
        if not is_remote(location):
            fs.create_dir(base.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(base) as out:
            _copy_into(run_dir / name, out)
    except OSError as exc:
        raise UserError(
            f"cannot write {location}: {_first_line(exc)}; the run folder {run_dir} keeps {name}",
            hint="Check that this machine may write to the run's storage (credentials, role), and run again.",
        ) from None
    return location


def bundle_note(location: str) -> str:
    """The line a run prints once its bundle is written: where it is, and the command that fetches it."""
    return f"run bundle: {location} (`raytrain-eks results {location}` fetches it)"


def stale_after_s(every_s: float = SYNC_S) -> float:
    """How long after its last update a bundle that says ``running`` is taken as ``unknown`` (its driver was lost
    without a word): a few missed syncs."""
    return max(10 * every_s, 300.0)


def age_s(updated: str | None) -> float | None:
    """Seconds since run.json's ``updated`` time; ``None`` when it has none or it cannot be read."""
    if not updated:
        return None
    try:
        then = datetime.strptime(updated, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None
    return time.time() - then.timestamp()
