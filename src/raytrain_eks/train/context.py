"""What the training loop needs from whoever launched it, and nothing more.

The loop sees a :class:`WorkerContext`: its rank and world size, its device, its share of the data, a way to
send metric records to the driver, a checkpoint to resume from, a way to save one, and a way to hand in the
final summary. :class:`RayContext` implements it inside a Ray Train worker; :class:`ProcessContext` inside a
plain ``torchrun`` (or single) process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from raytrain_eks.train.checkpoint import checkpoint_name, join, latest_complete, mark_complete, materialize, prune

Batch = dict[str, torch.Tensor]


class WorkerContext(Protocol):
    rank: int
    world_size: int
    node: str  # the node this worker runs on; workers with the same name share a machine
    device: torch.device

    def data_batches(self, batch_size: int, position: dict[str, int] | None) -> DataCursor:
        """This worker's shard of the packed data set, epoch after epoch, from ``position`` on."""
        ...

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        """This worker's share of the held-out data, once through (``None`` when the run has none)."""
        ...

    def emit(self, record: dict[str, Any]) -> None:
        """Send one metric record (called on every rank; only rank 0's is kept). ``{"note": text}`` is a line for
        the user, not a metric."""
        ...

    def resume_checkpoint(self) -> Path | None:
        """The complete checkpoint to continue from, or ``None`` for a fresh start."""
        ...

    def save_checkpoint(self, step: int, write: Callable[[Path], None], metrics: dict[str, Any], keep: int) -> None:
        """Save the checkpoint of ``step`` (``write(folder)`` writes this rank's files; a collective), keep ``keep``."""
        ...

    def finish(self, summary: dict[str, Any]) -> None:
        """Hand in the end-of-run summary (called on every rank)."""
        ...


class DataCursor:
    """Batches of one worker's shard, epoch after epoch, remembering where it is (epoch, batch in epoch).

    Every epoch walks the shard in the same order (the data set is shuffled once, with the run's seed, before it
    is cut into one fixed shard per rank, see :func:`~raytrain_eks.train.data.rank_shards`), so a resume continues
    exactly by skipping ``batch`` batches of the epoch it stopped in.
    """

    def __init__(self, epoch_iter: Callable[[], Iterator[Batch]], position: dict[str, int] | None = None) -> None:
        self._epoch_iter = epoch_iter
        pos = position or {}
        self.epoch = int(pos.get("epoch", 0))
        self.batch = int(pos.get("batch", 0))
        self._it = self._walk()

    @property
    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def _walk(self) -> Iterator[Batch]:
        skip = self.batch
        while True:
            seen = 0
            for item in self._epoch_iter():
                seen += 1
                if seen <= skip:
                    continue
                self.batch = seen
                yield item
            if seen == 0:
                raise RuntimeError("this worker's data shard yields no full batch")
            skip = 0
            self.epoch += 1
            self.batch = 0

    def __iter__(self) -> DataCursor:
        return self

    def __next__(self) -> Batch:
        return next(self._it)


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class RayContext:
    """Inside a Ray Train worker: data from ``get_dataset_shard``, records to a Ray queue, checkpoints via report.

    ``checkpoint_root`` is the run's Ray storage folder, a path every worker can reach (the run folder locally, a
    shared file system) or an ``s3://`` URI; the completion marker of each checkpoint is written there once every
    rank has reported it.
    """

    def __init__(
        self, metrics_queue: Any | None, checkpoint_root: str, resume_from: str | None = None, has_eval: bool = False
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
        self._has_eval = has_eval
        self._downloads = Path(tempfile.mkdtemp(prefix=f"raytrain-eks-resume-r{self.rank}-"))

    def data_batches(self, batch_size: int, position: dict[str, int] | None) -> DataCursor:
        import ray.train

        from raytrain_eks.train.data import rank_dataset_name

        shard = ray.train.get_dataset_shard(rank_dataset_name(self.rank))
        return DataCursor(
            lambda: iter(
                shard.iter_torch_batches(batch_size=batch_size, drop_last=True, dtypes=torch.long, device="cpu")
            ),
            position,
        )

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        import ray.train

        if not self._has_eval:
            return None
        # The whole held-out set reaches every rank (it is not split); each keeps every world_size-th batch.
        every = ray.train.get_dataset_shard("eval").iter_torch_batches(
            batch_size=batch_size, drop_last=False, dtypes=torch.long, device="cpu"
        )
        return (b for i, b in enumerate(every) if i % self.world_size == self.rank)

    def emit(self, record: dict[str, Any]) -> None:
        if self.rank == 0 and self._queue is not None:
            self._queue.put(record)

    def resume_checkpoint(self) -> Path | None:
        # After a worker-group restart: the newest checkpoint in this run's storage that is complete (marked).
        # Ray's own latest checkpoint is every rank's report, but it may lack the marker if rank 0 died right
        # after reporting; the scan then takes the one before, which Ray still keeps (keep_checkpoints >= 2).
        chosen = latest_complete(self._root) or self._resume_from
        if chosen is None:
            return None
        return materialize(chosen, self._downloads / "checkpoint")

    def save_checkpoint(self, step: int, write: Callable[[Path], None], metrics: dict[str, Any], keep: int) -> None:
        import ray.train

        staging = Path(tempfile.mkdtemp(prefix=f"raytrain-eks-ckpt-{step}-r{self.rank}-"))
        try:
            write(staging)
            name = checkpoint_name(step)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(staging), checkpoint_dir_name=name)
            dist.barrier()  # every rank's report (and upload) has returned
            if self.rank == 0:
                mark_complete(join(self._root, name), step=step, world_size=self.world_size)
                prune(self._root, keep)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def finish(self, summary: dict[str, Any]) -> None:
        if self.rank == 0 and self._queue is not None:
            self._queue.put({"summary": summary})
        shutil.rmtree(self._downloads, ignore_errors=True)


class ProcessContext:
    """Inside a ``torchrun`` process (or a lone process): random data only, a fresh start; rank 0 writes the metric
    records (``metrics.jsonl``) and the summary (``summary.json``, with ``summary_extra`` added) into ``out_dir``.

    Checkpoints go to ``out_dir/checkpoints`` (a folder all ranks share), in the same format as under Ray.
    """

    def __init__(self, out_dir: Path, summary_extra: dict[str, Any] | None = None) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        # torchrun numbers its nodes (GROUP_RANK); a lone process is on the machine it runs on.
        group = os.environ.get("GROUP_RANK")
        self.node = f"node-{group}" if group is not None else socket.gethostname()
        self.device = _device(int(os.environ.get("LOCAL_RANK", 0)))
        self._out = out_dir
        self._summary_extra = dict(summary_extra or {})

    def data_batches(self, batch_size: int, position: dict[str, int] | None) -> DataCursor:
        raise NotImplementedError("plain processes run the random-data mode only; real data goes through Ray Data")

    def eval_batches(self, batch_size: int) -> Iterator[Batch] | None:
        return None

    def emit(self, record: dict[str, Any]) -> None:
        if self.rank == 0 and "note" in record:
            print(record["note"], flush=True)
        elif self.rank == 0:
            with (self._out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")

    def resume_checkpoint(self) -> Path | None:
        return None

    def save_checkpoint(self, step: int, write: Callable[[Path], None], metrics: dict[str, Any], keep: int) -> None:
        folder = self._out / "checkpoints" / checkpoint_name(step)
        write(folder)
        dist.barrier()
        if self.rank == 0:
            mark_complete(folder, step=step, world_size=self.world_size)
            prune(folder.parent, keep)

    def finish(self, summary: dict[str, Any]) -> None:
        if self.rank == 0:
            (self._out / "summary.json").write_text(json.dumps({**summary, **self._summary_extra}, indent=2) + "\n")
