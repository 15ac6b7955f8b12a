"""What the training loop needs from whoever launched it, and nothing more.

The loop sees a :class:`WorkerContext`: its rank and world size, its device, its share of the data, a way to
send metric records to the driver and a way to hand in the final summary. :class:`RayContext` implements it
inside a Ray Train worker; :class:`ProcessContext` inside a plain ``torchrun`` (or single) process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch


class WorkerContext(Protocol):
    rank: int
    world_size: int
    device: torch.device

    def data_batches(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """This worker's shard of the packed data set, epoch after epoch, ``batch_size`` blocks at a time."""
        ...

    def emit(self, record: dict[str, Any]) -> None:
        """Send one metric record (called on every rank; only rank 0's is kept)."""
        ...

    def finish(self, summary: dict[str, Any]) -> None:
        """Hand in the end-of-run summary (called on every rank)."""
        ...


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class RayContext:
    """Inside a Ray Train worker: data from ``get_dataset_shard``, records to a Ray queue, summary via report."""

    def __init__(self, metrics_queue: Any | None) -> None:
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self._queue = metrics_queue

    def data_batches(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        import ray.train

        shard = ray.train.get_dataset_shard("train")
        while True:  # one pass per epoch; the shards are equal, so every rank gets the same number of batches
            yielded = False
            for batch in shard.iter_torch_batches(
                batch_size=batch_size, drop_last=True, dtypes=torch.long, device="cpu"
            ):
                yielded = True
                yield batch
            if not yielded:
                raise RuntimeError(f"rank {self.rank} received no full batch of {batch_size} blocks")

    def emit(self, record: dict[str, Any]) -> None:
        if self.rank == 0 and self._queue is not None:
            self._queue.put(record)

    def finish(self, summary: dict[str, Any]) -> None:
        import ray.train

        if self.rank == 0 and self._queue is not None:
            self._queue.put({"summary": summary})
        # One report at the end: report() is a barrier across workers that costs about a second here.
        ray.train.report(summary)


class ProcessContext:
    """Inside a ``torchrun`` process (or a lone process): random data only; rank 0 writes records as JSON lines."""

    def __init__(self, out_dir: Path | None = None) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.device = _device(int(os.environ.get("LOCAL_RANK", 0)))
        self._out = out_dir
        self.records: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None

    def data_batches(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        raise NotImplementedError("plain processes run the random-data mode only; real data goes through Ray Data")

    def emit(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            self.records.append(record)
            if self._out is not None:
                with (self._out / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(record) + "\n")

    def finish(self, summary: dict[str, Any]) -> None:
        if self.rank == 0:
            self.summary = summary
            if self._out is not None:
                (self._out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
