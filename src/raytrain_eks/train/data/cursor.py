"""One rank's batches of the packed data set, epoch after epoch: :class:`DataCursor`, and the global position
that resumes every rank exactly."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

Batch = dict[str, torch.Tensor]
# What a packed block holds: the tokens, their labels, (``packing: documents``) each row's own positions, and how many
# of its positions hold a row (the rest is padding).
BATCH_COLUMNS = ("input_ids", "labels", "position_ids", "filled")


def global_position(position: dict[str, int] | None, *, world_size: int, batch_size: int) -> tuple[dict[str, int], str]:
    """A checkpoint's data position as ``{"epoch", "sample"}``, and a note for the user when it had to be converted.

    Checkpoints record the epoch and the samples all ranks together took in it (``sample``). Those of earlier
    versions recorded the batches one rank took (``{"epoch", "batch"}``) of a shard that never changed order:
    they resume at the same count of samples, in this version's order, and the note says so.
    """
    pos = dict(position or {})
    if "batch" not in pos:
        return {"epoch": int(pos.get("epoch", 0)), "sample": int(pos.get("sample", 0))}, ""
    epoch, sample = int(pos.get("epoch", 0)), int(pos["batch"]) * world_size * batch_size
    note = (
        f"data: the checkpoint's position (epoch {epoch}, batch {pos['batch']}) is in an earlier format; "
        f"continuing at sample {sample} of epoch {epoch} in this version's order, so the samples from here on "
        "differ from those the run before would have taken"
    )
    return {"epoch": epoch, "sample": sample}, note


class DataCursor:
    """Batches of one rank's share of the packed data set, epoch after epoch, remembering the global position.

    ``take(rows)`` returns the packed set's rows at those positions of its fixed order, in that order, by column
    (``input_ids``, ``labels`` and ``position_ids`` when packed by documents), ``blocks`` rows in the set; a Ray
    worker's is :meth:`~raytrain_eks.train.data.pipeline.PackedSet.take`, which reads only those rows, and
    :func:`take_from_parts` makes one of a reader that yields the whole set. At the start of each epoch the cursor
    works out which rows this rank takes (:func:`~.pipeline.rank_epoch_blocks`: the epoch's order is
    drawn from the seed and the epoch), takes them and hands them out ``batch_size`` at a time; it holds its share
    of the epoch in memory (as int32), not the whole set, and takes the next epoch's share on a thread of its own
    while this epoch's batches train (two epochs' shares are held at that time).

    ``position`` is ``{"epoch": e, "sample": s}``: ``s`` samples of epoch ``e``'s order have been taken by all
    ranks together. Every rank's cursor is at the same position after the same number of batches, so any rank's
    position resumes every rank exactly (an earlier ``{"epoch", "batch"}`` position is converted, see
    :func:`global_position`; ``note`` then says so).

    >>> cursor = DataCursor(packed.take, blocks=64, seed=0, rank=1, world_size=2, batch_size=4, position=None)
    >>> next(cursor)["input_ids"].shape, cursor.position   # (torch.Size([4, seq_len]), {"epoch": 0, "sample": 8})
    """

    def __init__(
        self,
        take: Callable[[np.ndarray], dict[str, np.ndarray]],
        *,
        blocks: int,
        seed: int,
        rank: int,
        world_size: int,
        batch_size: int,
        position: dict[str, int] | None = None,
    ) -> None:
        self._take = take
        self._blocks, self._seed = int(blocks), int(seed)
        self._rank, self._world, self._batch = rank, world_size, batch_size
        pos, self.note = global_position(position, world_size=world_size, batch_size=batch_size)
        self.epoch, self.sample = pos["epoch"], pos["sample"]
        if self._blocks < world_size * batch_size:
            raise RuntimeError(
                f"the packed data set has {self._blocks} blocks, fewer than one global batch "
                f"({world_size} ranks x {batch_size})"
            )
        self._it = self._walk()

    @property
    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample": self.sample}

    def _share(self, epoch: int, start: int) -> dict[str, np.ndarray]:
        """This rank's rows of ``epoch`` from its ``start``-th sample on, in order, by column, as int32."""
        from raytrain_eks.train.data.pipeline import rank_epoch_blocks

        wanted = rank_epoch_blocks(
            self._blocks,
            seed=self._seed,
            epoch=epoch,
            start=start,
            rank=self._rank,
            world_size=self._world,
            batch_size=self._batch,
        )
        share = self._take(wanted)
        if not share or any(len(col) != len(wanted) for col in share.values()):
            raise RuntimeError(f"the packed data set gave {len(next(iter(share.values()), []))} of {len(wanted)} rows")
        return share

    def _walk(self) -> Iterator[Batch]:
        per_step = self._world * self._batch
        ahead: _Ahead | None = None
        while True:
            if self._blocks - self.sample < per_step:  # the tail of this epoch fills no global batch
                self.epoch, self.sample = self.epoch + 1, 0
            share = ahead.result() if ahead is not None else self._share(self.epoch, self.sample)
            # The next epoch's share, read while this one's batches train (each epoch after the first starts at 0).
            ahead = _Ahead(self._share, self.epoch + 1, 0)
            for k in range(len(share["input_ids"]) // self._batch):
                rows = slice(k * self._batch, (k + 1) * self._batch)
                self.sample += per_step
                yield {name: torch.from_numpy(col[rows].astype(np.int64)) for name, col in share.items()}

    def __iter__(self) -> DataCursor:
        return self

    def __next__(self) -> Batch:
        return next(self._it)


def take_from_parts(
    read: Callable[[], Iterable[dict[str, np.ndarray]]], blocks: int
) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """A ``take`` for :class:`DataCursor` over a reader that yields the whole packed set in order (``blocks`` rows, in
    parts of any size): it walks the set once per call, keeping the rows asked for, as int32."""

    def take(wanted: np.ndarray) -> dict[str, np.ndarray]:
        slot = np.full(blocks, -1, dtype=np.int64)
        slot[wanted] = np.arange(len(wanted))
        share: dict[str, np.ndarray] = {}
        seen = 0
        for part in read():
            n = len(part["input_ids"])
            if seen + n > blocks:
                raise RuntimeError(f"the packed data set has more than the {blocks} blocks it was said to have")
            where = slot[seen : seen + n]
            keep = where >= 0
            if not share:
                share = {k: np.empty((len(wanted), *part[k].shape[1:]), np.int32) for k in BATCH_COLUMNS if k in part}
            for k, held in share.items():
                held[where[keep]] = part[k][keep]
            seen += n
        if seen != blocks or not share:
            raise RuntimeError(f"the packed data set has {seen} blocks, not the {blocks} it was said to have")
        return share

    return take


class _Ahead:
    """``read(*args)`` on a thread of its own, started now; :meth:`result` waits for it (and raises its error)."""

    def __init__(self, read: Callable[..., dict[str, np.ndarray]], *args: Any) -> None:
        self._value: dict[str, np.ndarray] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(read, *args), name="raytrain-eks-next-epoch", daemon=True
        )
        self._thread.start()

    def _run(self, read: Callable[..., dict[str, np.ndarray]], *args: Any) -> None:
        try:
            self._value = read(*args)
        except BaseException as exc:  # handed to the training thread, which raises it where it waits
            self._error = exc

    def result(self) -> dict[str, np.ndarray]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value
