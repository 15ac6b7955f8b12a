"""What the training loop needs from whoever launched it, and nothing more.

The loop sees a :class:`WorkerContext`: its rank and world size, its device, its share of the data, a way to
send metric records to the driver, a checkpoint to resume from, a way to save one, and a way to hand in the
final summary. :class:`RayContext` implements it inside a Ray Train worker; :class:`ProcessContext` inside a
plain ``torchrun`` (or single) process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.distributed as dist

from raytrain_eks.train.checkpoint import TEMP_PREFIX, checkpoint_name, latest_complete, mark_complete, prune
from raytrain_eks.train.data.cursor import Batch, DataCursor
from raytrain_eks.train.records import FabricLook, Finished, Note, Record, StepRecord
from raytrain_eks.train.storage import join

if TYPE_CHECKING:
    from ray.util.queue import Queue
    from torch.distributed import ProcessGroup

    from raytrain_eks.train.data.pipeline import PackedSet

# Writes this rank's files of a checkpoint into a folder: at once (the process group None), or in the background over
# the given process group, returning the write's future.
CheckpointWriter = Callable[[Path, "ProcessGroup | None"], "Future[None] | None"]


class WorkerContext(Protocol):
    rank: int
    world_size: int
    node: str  # the node this worker runs on; workers with the same name share a machine
    device: torch.device

    def data_batches(self, batch_size: int, position: dict[str, int] | None, seed: int) -> DataCursor:
        """This worker's share of the packed data set, epoch after epoch (each in an order drawn from ``seed`` and
        the epoch), from ``position`` on."""
        ...

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        """This worker's share of the held-out data, once through (``None`` when the run has none)."""
        ...

    def emit(self, record: Record) -> None:
        """Send one record to the driver (called on every rank; only rank 0's is kept): a :class:`Note` is a line
        for the user, a :class:`StepRecord` a logged step (see :mod:`.records`)."""
        ...

    def resume_checkpoint(self) -> str | Path | None:
        """The complete checkpoint to continue from (a local path or a remote URI, read where it lies by
        :func:`~raytrain_eks.train.checkpoint.load_sharded`), or ``None`` for a fresh start."""
        ...

    def save_checkpoint(self, step: int, write: CheckpointWriter, metrics: Mapping[str, object], keep: int) -> None:
        """Save the checkpoint of ``step``, keep ``keep`` (a collective). ``write(folder, group)`` writes this rank's
        files: at once with ``group`` None, else in the background over that process group, returning the future
        of the write; the context then goes on with it at :meth:`settle`."""
        ...

    def settle(self) -> None:
        """Move a checkpoint still being written or uploaded on, without waiting (a collective while one is: every
        rank calls it once per step)."""
        ...

    def finish(self, summary: dict[str, object]) -> None:
        """Hand in the end-of-run summary, once the last checkpoint is complete (called on every rank)."""
        ...


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class RayContext:
    """Inside a Ray Train worker: the run's Ray datasets, records to a Ray queue, checkpoints via report.

    ``checkpoint_root`` is the run's Ray storage folder, a path every worker can reach (the run folder locally, a
    shared file system) or an ``s3://`` URI; the completion marker of each checkpoint is written there once every
    rank has reported it. ``datasets`` are :func:`~raytrain_eks.train.data.pipeline.train_datasets`'s packed sets (block
    references), handed over in the loop's configuration: each rank takes the training rows it trains on, and reads
    the held-out set whole.
    """

    def __init__(
        self,
        metrics_queue: Queue | None,
        checkpoint_root: str,
        resume_from: str | None = None,
        datasets: dict[str, PackedSet] | None = None,
    ) -> None:
        import ray
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.node = ray.get_runtime_context().get_node_id()
        self.device = ray.train.torch.get_device()
        self._queue = metrics_queue
        self._root = checkpoint_root
        self._resume_from = resume_from
        self._datasets = datasets or {}
        self._pending: _InFlight | None = None  # the checkpoint being written or uploaded
        self._groups: tuple[ProcessGroup, ProcessGroup] | None = None
        self._done_s: list[float] = []
        remove_stale_folders()  # what workers killed mid-run left (a rank's downloaded share of a checkpoint)

    def data_batches(self, batch_size: int, position: dict[str, int] | None, seed: int) -> DataCursor:
        from raytrain_eks.train.data.pipeline import TRAIN_DATASET

        packed = self._datasets[TRAIN_DATASET]  # each rank reads the rows it trains on, beside their blocks
        return DataCursor(
            packed.take,
            blocks=packed.rows,
            seed=seed,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=batch_size,
            position=position,
        )

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        from raytrain_eks.train.data.pipeline import EVAL_DATASET

        if EVAL_DATASET not in self._datasets:
            return None
        # The whole held-out set reaches every rank (it is not split); each keeps every world_size-th batch.
        every = self._datasets[EVAL_DATASET].batches(batch_size)
        return (
            {k: torch.from_numpy(v.astype(np.int64)) for k, v in b.items()}
            for i, b in enumerate(every)
            if i % self.world_size == self.rank
        )

    def emit(self, record: Record) -> None:
        if self.rank == 0 and self._queue is not None:
            self._queue.put(record)

    def resume_checkpoint(self) -> str | Path | None:
        # After a worker-group restart: the newest checkpoint in this run's storage that is complete (marked).
        # Ray's own latest checkpoint is every rank's report, but it may lack the marker if rank 0 died right
        # after reporting; the scan then takes the one before, which Ray still keeps (keep_checkpoints >= 2).
        # Not downloaded here: load_sharded reads from remote storage only this rank's share of it.
        return latest_complete(self._root) or self._resume_from

    def save_checkpoint(self, step: int, write: CheckpointWriter, metrics: Mapping[str, object], keep: int) -> None:
        """Write this rank's files in the background (DCP's asynchronous save, over a gloo group of its own), and
        go on training: :meth:`settle` reports the checkpoint to Ray Train once every rank's files are written, Ray
        uploads it on a thread of its own, and once every rank's upload is done rank 0 marks it complete. A save
        waits first for the one before it (one in flight at a time, in order)."""
        self._settle(wait=True)
        started = time.perf_counter()
        groups = self._checkpoint_groups()
        staging = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}ckpt-{step}-r{self.rank}-p{os.getpid()}-"))
        try:
            written = write(staging, groups[0])
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._pending = _InFlight(step, checkpoint_name(step), staging, written, metrics, keep, started=started)
        self._settle(wait=False)

    def settle(self) -> None:
        self._settle(wait=False)

    def _checkpoint_groups(self) -> tuple[ProcessGroup, ProcessGroup]:
        """Two gloo groups of all ranks (made once, by every rank at its first save): one for the background writes'
        own collectives, one for :meth:`_settle`'s vote, so neither meets the training's collectives nor the other."""
        if self._groups is None:
            self._groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
        return self._groups

    def _settle(self, *, wait: bool) -> None:
        while self._pending is not None:
            flight = self._pending
            vote = torch.tensor([flight.stage()], dtype=torch.int32)
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self._checkpoint_groups()[1])
            agreed = int(vote)
            if agreed == _InFlight.FAILED:
                self._pending = None
                flight.raise_failure()  # on the rank that failed; the others stop with a note of it
                raise RuntimeError(f"another rank could not save checkpoint {flight.name}")
            if agreed >= _InFlight.WRITTEN and not flight.reported:
                import ray.train
                from ray.train import CheckpointUploadMode

                storage = ray.train.get_context().get_storage()
                ray.train.report(
                    flight.metrics,
                    checkpoint=ray.train.Checkpoint.from_directory(flight.staging),
                    checkpoint_dir_name=flight.name,
                    checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                    checkpoint_upload_fn=flight.uploader(storage),
                    delete_local_checkpoint_after_upload=False,
                )
                flight.reported = True
                continue
            if agreed == _InFlight.UPLOADED:
                if self.rank == 0:
                    mark_complete(join(self._root, flight.name), step=flight.step, world_size=self.world_size)
                    prune(self._root, flight.keep)
                shutil.rmtree(flight.staging, ignore_errors=True)
                self._pending = None
                self._done_s.append(time.perf_counter() - flight.started)
                return
            if not wait:
                return
            time.sleep(_SETTLE_POLL_S)

    def finish(self, summary: dict[str, object]) -> None:
        self._settle(wait=True)  # the last checkpoint complete before the run is over
        # Seconds from each save's start until it was complete, while training went on (checkpoint_s: what it waited).
        summary["checkpoint_done_s"] = list(self._done_s)
        if self.rank == 0 and self._queue is not None:
            self._queue.put(Finished(summary))


_SETTLE_POLL_S = 0.05  # how often a save (or the end of the run) looks whether the one in flight is done


class _Persists(Protocol):
    """What :meth:`_InFlight.uploader` asks of Ray Train's storage context (``StorageContext``)."""

    def persist_current_checkpoint(self, checkpoint: object, name: str) -> object: ...


class _InFlight:
    """A checkpoint on its way: this rank's files being written (a future), then uploaded by Ray (on its upload
    thread, through :meth:`uploader`); :meth:`stage` says how far this rank is."""

    FAILED, WRITING, WRITTEN, UPLOADED = -1, 0, 1, 2

    def __init__(
        self,
        step: int,
        name: str,
        staging: Path,
        written: Future[None] | None,
        metrics: Mapping[str, object],
        keep: int,
        *,
        started: float,
    ) -> None:
        self.step, self.name, self.staging, self.metrics, self.keep = step, name, staging, metrics, keep
        self.started = started
        self._written = written
        self.reported = False
        self._uploaded = threading.Event()
        self._failure: BaseException | None = None

    def stage(self) -> int:
        if self._failure is not None:
            return self.FAILED
        if self._written is not None and self._written.done() and self._written.exception() is not None:
            self._failure = self._written.exception()
            return self.FAILED
        if self._uploaded.is_set():
            return self.UPLOADED
        return self.WRITTEN if self._written is None or self._written.done() else self.WRITING

    def uploader(self, storage: _Persists) -> Callable[[object, str], object]:
        """Ray's own upload of the checkpoint (``persist_current_checkpoint``, what it does by default), which
        also tells this rank when it is done."""

        def upload(checkpoint: object, name: str) -> object:
            try:
                persisted = storage.persist_current_checkpoint(checkpoint, name)
            except BaseException as exc:
                self._failure = exc
                raise
            self._uploaded.set()
            return persisted

        return upload

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


# The temporary folders a worker makes: its share of a checkpoint it downloads to resume from (load_sharded), one it
# stages to save; each named with the worker's process id.
_TEMP_FOLDER = re.compile(rf"^{TEMP_PREFIX}(?:resume|ckpt)-.*-p(\d+)-[^/]+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_folders(root: str | Path | None = None) -> list[Path]:
    """Delete the temporary folders of workers that are gone (killed before they could clean up: a node lost, an
    out-of-memory kill, a worker group restarted); those of running workers stay. Returns what was deleted."""
    base = Path(root or tempfile.gettempdir())
    removed = []
    for path in base.glob(f"{TEMP_PREFIX}*"):
        found = _TEMP_FOLDER.match(path.name)
        if found and path.is_dir() and not _alive(int(found.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class ProcessContext:
    """Inside a ``torchrun`` process (or a lone process): random data only, a fresh start; rank 0 writes the metric
    records (``metrics.jsonl``) and the summary (``summary.json``, with ``summary_extra`` added) into ``out_dir``.

    Checkpoints go to ``out_dir/checkpoints`` (a folder all ranks share), in the same format as under Ray.
    """

    def __init__(self, out_dir: Path, summary_extra: Mapping[str, object] | None = None) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        # torchrun numbers its nodes (GROUP_RANK); a lone process is on the machine it runs on.
        group = os.environ.get("GROUP_RANK")
        self.node = f"node-{group}" if group is not None else socket.gethostname()
        self.device = _device(int(os.environ.get("LOCAL_RANK", 0)))
        self._out = out_dir
        self._summary_extra = dict(summary_extra or {})

    def data_batches(self, batch_size: int, position: dict[str, int] | None, seed: int) -> DataCursor:
        raise NotImplementedError("plain processes run the random-data mode only; real data goes through Ray Data")

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        return None

    def emit(self, record: Record) -> None:
        if self.rank != 0:
            return
        if isinstance(record, Note):
            print(record.text, flush=True)
        elif isinstance(record, FabricLook):
            print(record.fabric.get("report", ""), flush=True)
        elif isinstance(record, StepRecord):
            with (self._out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record.to_json()) + "\n")

    def resume_checkpoint(self) -> str | Path | None:
        return None

    def save_checkpoint(self, step: int, write: CheckpointWriter, metrics: Mapping[str, object], keep: int) -> None:
        folder = self._out / "checkpoints" / checkpoint_name(step)
        write(folder, None)  # at once: the files are in place when it returns
        dist.barrier()
        if self.rank == 0:
            mark_complete(folder, step=step, world_size=self.world_size)
            prune(folder.parent, keep)

    def settle(self) -> None:
        """Nothing is in flight: every checkpoint is written when :meth:`save_checkpoint` returns."""

    def finish(self, summary: dict[str, object]) -> None:
        if self.rank == 0:
            (self._out / "summary.json").write_text(json.dumps({**summary, **self._summary_extra}, indent=2) + "\n")
