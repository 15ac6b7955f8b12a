"""Training data: the Ray Data pipeline (rows are encoded by :mod:`.encoding`, packed by :mod:`.packing`, files
found by :mod:`.sources`).

:func:`prepare_dataset` builds the pipeline the driver runs before any worker starts: read (JSONL and JSON here,
Parquet, CSV, TSV and Arrow by :mod:`.tabular`; local or ``s3://``), tokenize, count malformed rows, fit rows longer
than ``seq_len`` (``training.overlong``), shuffle, pack, materialize; and :func:`train_datasets` hands the packed set
to Ray Train, whole, for every rank. :func:`random_batch` makes the reference's synthetic token ids for one rank
and step.

Determinism: the shuffle orders rows by a keyed hash of their tokens (the key is the seed), so the order does
not depend on how Ray Data cut the input into blocks or which task finished first; packing runs with Ray Data's
``preserve_order`` on, in groups of rows fixed by the row count alone, so the packed blocks have one fixed order,
the same on every world size and after a resume. Each epoch then walks the packed blocks in an
order drawn from (seed, epoch) (:func:`epoch_order`), cut into global batches of which each rank takes its share
(:func:`rank_epoch_blocks`). A rank's samples therefore depend only on the data, the seed, the epoch, the world
size and the batch size, whichever node it runs on, and a position of (epoch, samples taken by all ranks in it)
resumes exactly.

Memory: JSON and JSONL files are read in chunks of :data:`READ_CHUNK_BYTES` (:func:`json_datasource`), never
whole, and the pipeline keeps its blocks to :data:`PIPELINE_BLOCK_BYTES`, so no read or tokenize task holds a
whole file, and every later task works a bounded block at a time.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raytrain_eks.errors import DataError
from raytrain_eks.formats import FORMAT_NAMES, MalformedRow
from raytrain_eks.train.data.encoding import (
    IGNORE_INDEX,
    encode,
    encode_joined_pair,
    encoding_tokenizer,
    load_tokenizer,
)
from raytrain_eks.train.data.json_reader import READ_CHUNK_BYTES, TOO_DEEP, json_datasource, json_rows, rows_block
from raytrain_eks.train.data.packing import DROPPED, TRUNCATED, fit_rows, pack_table
from raytrain_eks.train.data.sources import list_data_files
from raytrain_eks.train.data.tabular import delimiter_hint, placed, read_dataset, read_table, unreadable

PACK_ROWS = 1024  # rows packed together (best fit within the group)


def random_batch(
    *, seed: int, step: int, micro: int, rank: int, world_size: int, batch_size: int, seq_len: int, vocab_size: int
) -> dict[str, Any]:
    """The reference's synthetic data: uniform random token ids, the same global batch whatever the world size.

    The global batch of (step, micro) is drawn from one generator and each rank takes its slice, so a run with
    2 workers x batch 4 sees exactly the tokens of a run with 1 worker x batch 8.
    """
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro)
    full = torch.randint(0, vocab_size, (world_size * batch_size, seq_len), generator=gen)
    mine = full[rank * batch_size : (rank + 1) * batch_size]
    return {"input_ids": mine, "labels": mine.clone()}


# --------------------------------------------------------------------------------------------- Ray Data


# The largest block the pipeline makes (Ray Data's default is 128 MiB): a read task merges the rows it yields into
# blocks up to this size, and every later step works a block at a time, so this bounds each task's memory.
PIPELINE_BLOCK_BYTES = 16 << 20
# The most input one task of the keyed sort takes at once. Ray Data's default (1 GiB) merges the blocks of a node
# into map tasks of up to 1 GiB of rows, so the sort's tasks grew with the data set until they held 1 GiB (1.6 GB
# of private memory for a 200 MB JSONL file); at four blocks a task they stay flat.
SORT_BATCH_BYTES = 4 * PIPELINE_BLOCK_BYTES


def _encode_batch(
    batch: Any,
    *,
    tokenizer_path: str,
    data_format: str,
    text_field: str,
    columns: dict[str, str] | None = None,
    chat_template: str | None = None,
    pairs: bool = False,
) -> Any:
    """Ray Data ``map_batches`` step: encode a batch of rows (a pyarrow table), marking malformed ones instead of
    failing. ``pairs``: each row a preference pair, joined (:func:`encode_joined_pair`; column ``split``)."""
    import pyarrow as pa

    tokenizer = encoding_tokenizer(tokenizer_path, chat_template)
    rows = batch.to_pylist()
    ids_out, labels_out, reasons, last_only, splits = [], [], [], [], []
    for row in rows:
        encoded, reason = None, ""
        try:
            if "json" in row:
                if row.get("error"):
                    raise MalformedRow(row["error"])
                row = json.loads(row["json"])
            if pairs:
                encoded = encode_joined_pair(row, data_format, tokenizer, columns)
            else:
                encoded = encode(row, data_format, tokenizer, text_field, columns)
        except MalformedRow as exc:
            reason = str(exc)
        except RecursionError:  # the reader decoded it higher up its stack; this task runs deeper (Ray's frames)
            reason = TOO_DEEP
        except Exception as exc:  # any other failure is this row's (a tokenizer refusing its text), not the file's
            reason = str(MalformedRow.of(exc))
        ids_out.append(encoded.ids if encoded else [])
        labels_out.append(encoded.labels if encoded else [])
        reasons.append(reason)
        last_only.append(encoded is not None and encoded.last_answer_only)
        splits.append(encoded.split if encoded else 0)
    tokens = pa.list_(pa.int32())  # half of int64's bytes through the sort and the object store; ids < 2**31
    return pa.table(
        {
            "input_ids": pa.array(ids_out, tokens),
            "labels": pa.array(labels_out, tokens),
            "reason": pa.array(reasons, pa.string()),
            "tokens": pa.array([len(i) for i in ids_out], pa.int64()),
            # a row's first token is predicted by nothing of the row (packed by documents, by nothing at all)
            "trained": pa.array([sum(t != IGNORE_INDEX for t in lab[1:]) for lab in labels_out], pa.int64()),
            # the chat template rewrote earlier turns: of several answers, only the last one is trained
            "last_only": pa.array(last_only, pa.bool_()),
            **({"split": pa.array(splits, pa.int32())} if pairs else {}),
        }
    )


def _encode_fit_batch(batch: Any, *, fit: dict[str, Any], **encode: Any) -> Any:
    """Ray Data ``map_batches`` step: :func:`_encode_batch`, then :func:`fit_rows` (``fit``: ``seq_len``, ``packing``
    and ``overlong``): the rows as they will be packed, and what became of each."""
    return fit_rows(_encode_batch(batch, **encode), **fit)


def _pack_batch(batch: Any, *, seq_len: int, pad_id: int, packing: str, overlong: str) -> dict[str, np.ndarray]:
    """Ray Data ``map_batches`` step: a group of rows (a pyarrow table) packed into ``seq_len`` blocks."""
    return pack_table(batch, seq_len, pad_id, packing=packing, overlong=overlong)


@dataclass
class PreparedData:
    """The packed, materialized training set and what was learned while making it."""

    dataset: Any
    rows: int
    usable_rows: int
    malformed: dict[str, int] = field(default_factory=dict)
    blocks: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    eval_dataset: Any = None  # the held-out rows, packed like the training set (``eval_fraction``)
    eval_rows: int = 0
    last_answer_only: int = 0  # usable rows of several answers of which only the last is trained (:func:`encode`)
    seq_len: int = 0
    eval_blocks: int = 0
    eval_tokens: int = 0  # of ``tokens``, those of the held-out rows
    truncated_rows: int = 0  # rows longer than seq_len of which the start is packed (``training.overlong``)
    truncated_tokens: int = 0  # the tokens they lost
    dropped_rows: int = 0  # rows longer than seq_len left out (``overlong: drop``, or nothing trained in the start)
    dropped_tokens: int = 0
    pairs: bool = False  # each row a preference pair (method dpo): counted and described as pairs

    @property
    def padding(self) -> int:
        """Positions of the packed training blocks that hold no row."""
        return self.blocks * self.seq_len - (self.tokens - self.eval_tokens)

    @property
    def efficiency(self) -> float:
        """The share of the packed training blocks' positions that hold a row (the rest is padding, which trains
        nothing)."""
        positions = self.blocks * self.seq_len
        return (self.tokens - self.eval_tokens) / positions if positions else 0.0

    def counts(self) -> dict[str, Any]:
        """What was read, kept and packed, by name (``summary.json``'s ``data``, ``raytrain-eks data --json``); of
        preference pairs, ``pairs`` for ``rows`` in each name (a pair is never truncated)."""
        counts = {
            "rows": self.rows,
            "usable_rows": self.usable_rows,
            "malformed_rows": sum(self.malformed.values()),
            "malformed": dict(self.malformed),
            "truncated_rows": self.truncated_rows,
            "truncated_tokens": self.truncated_tokens,
            "dropped_rows": self.dropped_rows,
            "dropped_tokens": self.dropped_tokens,
            "eval_rows": self.eval_rows,
            "eval_tokens": self.eval_tokens,
            "tokens": self.tokens,
            "trained_tokens": self.trained_tokens,
            "masked_tokens": self.tokens - self.trained_tokens,
            "padding_tokens": self.padding,
            "blocks": self.blocks,
            "eval_blocks": self.eval_blocks,
            "seq_len": self.seq_len,
            "packing_efficiency": round(self.efficiency, 4),
            "last_answer_only_rows": self.last_answer_only,
        }
        if not self.pairs:
            return counts
        return {k.replace("rows", "pairs"): v for k, v in counts.items() if not k.startswith("truncated")}

    def describe(self, data: str, seq_len: int | None = None) -> str:
        seq_len = seq_len or self.seq_len
        unit = "pairs" if self.pairs else "rows"
        line = (
            f"data: {data}: {self.usable_rows}/{self.rows} {unit} usable, {self.tokens} tokens "
            f"({self.trained_tokens} trained), {self.blocks} blocks of {seq_len}, "
            f"{100 * self.efficiency:.1f}% of their positions filled"
        )
        if self.malformed:
            reasons = "; ".join(f"{n} x {why}" for why, n in sorted(self.malformed.items(), key=lambda kv: -kv[1]))
            line += f"\n  skipped {sum(self.malformed.values())} malformed {unit}: {reasons}"
        if self.truncated_rows:
            line += (
                f"\n  truncated {self.truncated_rows} rows longer than {seq_len} tokens to their first {seq_len} "
                f"({self.truncated_tokens} tokens cut; training.overlong: drop leaves them out)"
            )
        if self.dropped_rows and self.pairs:
            line += (
                f"\n  dropped {self.dropped_rows} pairs longer than {seq_len} tokens ({self.dropped_tokens} tokens): "
                "a pair's chosen and rejected answers go whole into one block (raise --seq-len to keep them)"
            )
        elif self.dropped_rows:
            line += (
                f"\n  dropped {self.dropped_rows} rows longer than {seq_len} tokens ({self.dropped_tokens} tokens): "
                "training.overlong is drop, or nothing of the row's answer lay within its first "
                f"{seq_len} tokens (raise --seq-len to keep them)"
            )
        if self.last_answer_only:
            line += (
                f"\n  trained on the last answer only: {self.last_answer_only} rows (the chat template rewrites "
                "earlier turns; their answers are context)"
            )
        return line


def _shuffle_key(batch: Any, *, seed: int) -> Any:
    """Ray Data ``map_batches`` step: a column ``order``, a hash of each row's tokens keyed by the seed."""
    import hashlib

    import pyarrow as pa

    key = seed.to_bytes(8, "little")
    order = []
    for ids, labels in zip(_lists(batch.column("input_ids")), _lists(batch.column("labels")), strict=True):
        digest = hashlib.blake2b(ids.astype(np.int64).tobytes(), digest_size=8, key=key)
        digest.update(labels.astype(np.int64).tobytes())
        order.append(int.from_bytes(digest.digest(), "little") >> 1)  # fits int64
    return batch.append_column("order", pa.array(order, pa.int64()))


def _lists(column: Any) -> Iterator[np.ndarray]:
    """Each row of a list column as a NumPy view of its values (no Python int per token, as ``to_pylist`` makes)."""
    for chunk in column.chunks:
        values, offsets = chunk.values.to_numpy(zero_copy_only=False), chunk.offsets.to_numpy()
        for start, end in zip(offsets[:-1], offsets[1:], strict=True):
            yield values[start:end]


TRAIN_DATASET = "train"  # the packed training set, of which each rank reads the rows it trains on
EVAL_DATASET = "eval"  # the packed held-out set, read whole by every rank


@dataclass(frozen=True)
class PackedSet:
    """A materialized packed set as its blocks' object references, in their stored order, and each block's row count
    (``rows``: the set's).

    What the training ranks read: each asks for the rows it trains on (:meth:`take`), and a task beside each block
    that holds some of them returns just those, so a rank receives its share, not the set. The held-out set is read
    whole (:meth:`batches`, zero-copy from the object store). No Ray Data execution (nor its stats actor) starts
    inside a training worker. Picklable: it travels in the loop's configuration; the driver that prepared the data
    owns the blocks for as long as the run lasts.
    """

    blocks: tuple[Any, ...]
    block_rows: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.block_rows)

    @classmethod
    def of(cls, dataset: Any) -> PackedSet:
        """The blocks of a materialized Ray dataset (``prepare_dataset``'s) and their row counts, without moving them
        (counted by one small task per node that stores some of them)."""
        refs = tuple(dataset.to_arrow_refs())
        counts = _per_block(_blocks_rows, refs, dict.fromkeys(range(len(refs))))
        return cls(blocks=refs, block_rows=tuple(int(counts[b]) for b in range(len(refs))))

    def take(self, wanted: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at positions ``wanted`` of the stored order, in that order, by column, as int32: only the blocks
        holding one of them are read, by one task on each node that stores some of them, which returns just those
        rows (so the number of tasks, and of Ray's worker processes, follows the nodes, not the blocks)."""
        wanted = np.asarray(wanted, dtype=np.int64)
        if len(wanted) and (wanted.min() < 0 or wanted.max() >= self.rows):
            raise IndexError(f"rows {wanted.min()}..{wanted.max()} asked of a packed set of {self.rows}")
        edges = np.concatenate([[0], np.cumsum(self.block_rows, dtype=np.int64)])
        block_of = np.searchsorted(edges, wanted, side="right") - 1
        slots_of = {int(b): np.flatnonzero(block_of == b) for b in np.unique(block_of)}  # slots of `wanted`
        parts = _per_block(_blocks_take, self.blocks, {b: wanted[slots] - edges[b] for b, slots in slots_of.items()})
        share: dict[str, np.ndarray] = {}
        for b, part in parts.items():
            if not share:
                share = {k: np.empty((len(wanted), *v.shape[1:]), np.int32) for k, v in part.items()}
            for k, held in share.items():
                held[slots_of[b]] = part[k]
        return share

    def batches(self, size: int) -> Iterator[dict[str, np.ndarray]]:
        """The whole set in order as numpy batches of ``size`` rows (the last one may be shorter), across blocks."""
        import ray
        from ray.data.block import BlockAccessor

        held: list[dict[str, np.ndarray]] = []
        count = 0
        for ref in self.blocks:
            part = BlockAccessor.for_block(ray.get(ref)).to_batch_format("numpy")
            held.append(part)
            count += len(next(iter(part.values()))) if part else 0
            while count >= size:
                joined = {k: np.concatenate([h[k] for h in held]) for k in held[0]}
                yield {k: v[:size] for k, v in joined.items()}
                held, count = [{k: v[size:] for k, v in joined.items()}], count - size
        if count:
            yield {k: np.concatenate([h[k] for h in held]) for k in held[0]}


def _blocks_rows(refs: list[Any], _: list[None]) -> list[int]:
    """Each block's row count (a Ray task on the node that stores them; :func:`_per_block`)."""
    import ray
    from ray.data.block import BlockAccessor

    return [int(BlockAccessor.for_block(block).num_rows()) for block in ray.get(refs)]


def _blocks_take(refs: list[Any], rows: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Rows ``rows[i]`` of each packed block ``refs[i]`` (a Ray task on the node that stores them: read there from
    the object store without a copy), by column, as int32."""
    import ray
    from ray.data.block import BlockAccessor

    out = []
    for block, these in zip(ray.get(refs), rows, strict=True):
        columns = BlockAccessor.for_block(block).to_batch_format("numpy")
        out.append({k: np.ascontiguousarray(v[these], dtype=np.int32) for k, v in columns.items()})
    return out


def _per_block(fn: Callable[..., list[Any]], refs: Sequence[Any], args: Mapping[int, Any]) -> dict[int, Any]:
    """For each block that ``args`` names (an index into ``refs``), what ``fn(blocks, their args)`` returned for it,
    run by one task per node that stores some of them (:func:`_by_node`, :func:`_on_node`)."""
    import ray

    groups = _by_node(refs, args)
    tasks = [_on_node(fn, node).remote([refs[b] for b in bs], [args[b] for b in bs]) for node, bs in groups.items()]
    out: dict[int, Any] = {}
    for bs, got in zip(groups.values(), ray.get(tasks), strict=True):
        out.update(zip(bs, got, strict=True))
    return out


def _by_node(refs: Sequence[Any], blocks: Iterable[int]) -> dict[str | None, list[int]]:
    """``blocks`` (indices into ``refs``) grouped by a node that stores them, this one first where it holds a copy;
    ``None`` for blocks with no known place (small ones travel inside their owner's messages)."""
    import ray
    import ray.experimental

    blocks = list(blocks)
    here = ray.get_runtime_context().get_node_id()
    found = ray.experimental.get_object_locations([refs[b] for b in blocks])
    groups: dict[str | None, list[int]] = {}
    for b in blocks:
        nodes = found.get(refs[b], {}).get("node_ids") or [None]
        groups.setdefault(here if here in nodes else nodes[0], []).append(b)
    return groups


def _on_node(fn: Callable[..., Any], node: str | None) -> Any:
    """``fn`` as a Ray task that asks for no CPU (the training workers hold every CPU a small machine has, and a read
    beside a block must not wait for one of them to end), placed on ``node`` while it lives (anywhere for ``None``).
    One such task per node and read keeps Ray's worker processes few: a task per block would start one per block
    at once, since tasks that ask for no CPU all run together."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = _remote(fn)
    if node is None:
        return task
    return task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True))


@functools.cache
def _remote(fn: Callable[..., Any]) -> Any:
    import ray

    return ray.remote(num_cpus=0)(fn)


def train_datasets(dataset: Any, eval_dataset: Any = None) -> dict[str, PackedSet]:
    """The packed sets every training rank reads whole, by name, for the loop's configuration
    (:class:`~raytrain_eks.train.context.RayContext` takes them).

    ``dataset`` is the packed, materialized training set in its fixed order; it is not split: each epoch, each rank
    takes from it the rows that :func:`rank_epoch_blocks` gives it (:meth:`PackedSet.take`, see
    :class:`~raytrain_eks.train.context.DataCursor`). Only the blocks' references are handed over (the blocks stay
    in the object store): nothing is split or placed.
    """
    sets = {TRAIN_DATASET: PackedSet.of(dataset)}
    if eval_dataset is not None:
        sets[EVAL_DATASET] = PackedSet.of(eval_dataset)
    return sets


def epoch_order(blocks: int, *, seed: int, epoch: int) -> np.ndarray:
    """The order of the packed blocks in ``epoch``: a permutation of ``range(blocks)`` drawn from (seed, epoch).

    The same numbers give the same order on every machine (numpy's PCG64 stream is fixed); another epoch or seed
    gives another order.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), blocks])))
    return rng.permutation(blocks)


def rank_epoch_blocks(
    blocks: int, *, seed: int, epoch: int, start: int, rank: int, world_size: int, batch_size: int
) -> np.ndarray:
    """The packed blocks rank ``rank`` trains on in ``epoch`` from the epoch's ``start``-th sample on, in order.

    The epoch's order (:func:`epoch_order`) is cut, from ``start``, into global batches of ``world_size *
    batch_size`` samples; rank ``r`` takes the ``r``-th ``batch_size`` of each. The tail that does not fill a
    global batch is left out of this epoch (the next epoch's order is another). ``start`` counts the samples every
    rank together has taken in this epoch, so a resume continues the same global stream, whatever the layout.

    >>> rank_epoch_blocks(8, seed=0, epoch=0, start=0, rank=1, world_size=2, batch_size=2)  # 2 batches of 2 blocks
    """
    per_step = world_size * batch_size
    steps = max(0, (blocks - start) // per_step)
    order = epoch_order(blocks, seed=seed, epoch=epoch)[start : start + steps * per_step]
    return order.reshape(steps, world_size, batch_size)[:, rank].reshape(-1)


@contextlib.contextmanager
def _order_preserved() -> Iterator[None]:
    """Ray Data's ``preserve_order`` on while inside: blocks come out in input order, so packing is reproducible."""
    import ray.data

    options = ray.data.DataContext.get_current().execution_options
    before = options.preserve_order
    options.preserve_order = True
    try:
        yield
    finally:
        options.preserve_order = before


@contextlib.contextmanager
def _blocks_bounded() -> Iterator[None]:
    """Datasets made while inside keep their blocks to :data:`PIPELINE_BLOCK_BYTES` and a sort task's input to
    :data:`SORT_BATCH_BYTES` (or less, if set lower)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    before = context.target_max_block_size, context.shuffle_input_batch_bytes
    context.target_max_block_size = min(before[0] or PIPELINE_BLOCK_BYTES, PIPELINE_BLOCK_BYTES)
    if before[1] > SORT_BATCH_BYTES:  # 0 or less: one task per block already
        context.shuffle_input_batch_bytes = SORT_BATCH_BYTES
    try:
        yield
    finally:
        context.target_max_block_size, context.shuffle_input_batch_bytes = before


# Local data up to this size in all is prepared in the driver process by the same steps (read, tokenize, shuffle,
# pack), and the packed blocks are handed to Ray Data from there: for a few MiB, starting Ray Data's read, map and
# sort tasks (each a process that imports the tokenizer) costs tens of seconds on a small machine, the work itself
# well under one. Larger data, and any data on s3://, goes through Ray Data's tasks with bounded blocks.
DRIVER_PREP_BYTES = 8 << 20


def prepared_in_driver(files: Sequence[str]) -> bool:
    """Whether :func:`prepare_dataset` prepares ``files`` in the driver: local, and :data:`DRIVER_PREP_BYTES` or less
    in all."""
    import os

    from raytrain_eks.train.storage import is_remote

    if any(is_remote(f) for f in files):
        return False
    try:
        return sum(os.path.getsize(f) for f in files) <= DRIVER_PREP_BYTES
    except OSError:  # gone or unreadable since it was listed: Ray Data's read says what is wrong
        return False


def _encode_in_driver(files: Sequence[str], kind: str, csv_delimiter: str, **encode: Any) -> Any:
    """The rows of ``files`` encoded by :func:`_encode_fit_batch`, as one pyarrow table (the driver's path)."""
    import pyarrow as pa

    tables = []
    for path in files:
        if kind != "json":
            raw = read_table(path, kind, csv_delimiter)
        else:
            with open(path, "rb") as f:
                raw = rows_block(list(json_rows(iter(functools.partial(f.read, READ_CHUNK_BYTES), b""))))
        if raw.num_rows:
            tables.append(_encode_fit_batch(raw, **encode))
    if not tables:
        return _encode_fit_batch(rows_block([]), **encode)
    return pa.concat_tables(tables, promote_options="permissive")


def _pack_groups(count: int) -> int:
    """How many packing groups ``count`` rows make (both paths): :data:`PACK_ROWS` rows or fewer each."""
    return max(1, -(-count // PACK_ROWS))


def _group_bounds(count: int) -> list[int]:
    """Where the packing groups of ``count`` rows start and end: ``ceil(count / PACK_ROWS)`` groups cut where Ray
    Data's ``repartition(n, shuffle=False)`` cuts them, so both paths pack the same rows together."""
    groups = _pack_groups(count)
    bounds, cut = [0], 0.0
    for _ in range(groups - 1):
        cut += count / groups
        bounds.append(int(cut))
    return [*bounds, count]


def _packed_in_driver(rows: Any, seq_len: int, pad_id: int, packing: str, overlong: str) -> list[Any]:
    """``rows`` (a pyarrow table, in order) packed like :func:`_packed`: one pyarrow table of packed blocks per
    group (:func:`as_ray_dataset` hands them to Ray Data)."""
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    bounds = _group_bounds(rows.num_rows)
    blocks = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        part = rows.slice(start, end - start)
        packed = pack_table(part, seq_len, pad_id, packing=packing, overlong=overlong)
        if len(packed["input_ids"]):
            blocks.append(
                pa.table({k: ArrowTensorArray.from_numpy(v) if v.ndim > 1 else pa.array(v) for k, v in packed.items()})
            )
    return blocks


def as_ray_dataset(tables: list[Any]) -> Any:
    """Packed blocks made in the driver (:func:`_packed_in_driver`) as a materialized Ray dataset, a block each."""
    import ray.data

    if not tables:
        return ray.data.from_items([]).materialize()
    return ray.data.from_arrow(tables).materialize()


def first_blocks(dataset: Any, count: int) -> dict[str, np.ndarray]:
    """The first ``count`` packed blocks of a prepared set in their stored order, by column: of a Ray dataset
    (read as the training ranks read it, :class:`PackedSet`) or of the tables made in the driver
    (``prepare_dataset(..., ray_dataset=False)``)."""
    if isinstance(dataset, list):
        from ray.data.block import BlockAccessor

        parts, taken = [], 0
        for table in dataset:
            if taken >= count:
                break
            part = table.slice(0, count - taken)
            parts.append(BlockAccessor.for_block(part).to_batch_format("numpy"))
            taken += part.num_rows
        return {k: np.concatenate([p[k] for p in parts]).astype(np.int32) for k in parts[0]} if parts else {}
    packed = PackedSet.of(dataset)
    return packed.take(np.arange(min(count, packed.rows)))


@dataclass(frozen=True)
class DataSettings:
    """How rows become packed blocks: the tokenizer, ``seq_len``, the format and its fields, the chat template,
    packing and rows over ``seq_len``, and the shuffle's seed. :meth:`of` reads them from the training settings, so
    ``train`` and ``raytrain-eks data`` make the same blocks.

    ``packing`` (:data:`PACKING_MODES`) packs whole rows into blocks, kept apart (``documents``), or runs them on
    (``concat``); ``overlong`` (:data:`OVERLONG_MODES`) truncates or drops a row longer than ``seq_len`` under
    ``documents`` (:func:`~raytrain_eks.train.data.packing.fit_rows`). ``chat_template`` (Jinja text) renders
    conversations instead of the tokenizer's own template; ``csv_delimiter`` separates the fields of CSV files.
    """

    tokenizer_path: str
    seq_len: int
    data_format: str
    text_field: str = "text"
    columns: dict[str, str] | None = None
    csv_delimiter: str = ","
    packing: str = "documents"
    overlong: str = "truncate"
    chat_template: str | None = None
    seed: int = 0
    pairs: bool = False  # rows are preference pairs, packed whole (``overlong`` drop) as two documents side by side

    @classmethod
    def of(cls, training: Any, tokenizer_path: str) -> DataSettings:
        """The data settings of ``training`` (a :class:`~raytrain_eks.config.TrainingConfig`): method dpo's rows are
        pairs, never truncated."""
        return cls(
            tokenizer_path=tokenizer_path,
            seq_len=training.seq_len,
            data_format=training.data_format,
            text_field=training.text_field,
            columns=training.columns or None,
            csv_delimiter=training.csv_delimiter,
            packing=training.packing,
            overlong="drop" if training.preference else training.overlong,
            chat_template=training.chat_template,
            seed=training.seed,
            pairs=training.preference,
        )

    @property
    def shape(self) -> tuple[int, int, str, str]:
        """What packing needs besides the rows: ``seq_len``, the pad id, ``packing``, ``overlong``."""
        tokenizer = load_tokenizer(self.tokenizer_path)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
        return self.seq_len, pad_id, self.packing, self.overlong


_COUNTED = ["reason", "tokens", "trained", "last_only", "fate", "cut"]  # what an encoded row says of itself


@_order_preserved()
def prepare_dataset(
    settings: DataSettings,
    *,
    data: str,
    min_blocks: int,
    listed: tuple[list[str], str] | None = None,
    eval_fraction: float = 0.0,
    stage: Callable[[str], None] | None = None,
    option: str = "--data",
    in_driver: bool | None = None,
    ray_dataset: bool = True,
) -> PreparedData:
    """Read, tokenize, shuffle and pack the data as ``settings`` say; raise :class:`DataError` when it is unusable.

    Runs on the driver (Ray must be initialised unless ``ray_dataset`` is false) before any training worker starts.
    ``min_blocks`` is the number of packed blocks one optimizer step consumes across all workers. ``listed`` is
    :func:`list_data_files`'s answer when the caller already has it. ``eval_fraction`` of the usable rows (at least
    one), chosen by the seeded shuffle, are held out before packing and packed apart as ``eval_dataset``. ``stage``
    (optional) hears what is being done now, as a short line such as ``"packing 390 rows (13359 tokens)"``.
    ``option`` is the setting ``data`` came from, named in the errors (``training.eval_data`` for the evaluation
    set). ``in_driver`` forces where the work is done (default: :func:`prepared_in_driver`); both paths give the same
    packed blocks. ``ray_dataset=False`` (only with data prepared in the driver) keeps the packed blocks as a list of
    pyarrow tables and needs no Ray (``raytrain-eks data``).
    """
    say = stage or (lambda _: None)
    files, kind = listed or list_data_files(data, option)
    in_driver = prepared_in_driver(files) if in_driver is None else in_driver
    if not in_driver and not ray_dataset:
        raise ValueError("packed blocks are kept out of Ray only when the data is prepared in the driver")
    say(f"reading and tokenizing {len(files)} file{'s' if len(files) > 1 else ''}")
    try:
        encoded = _encoded(files, kind, settings, in_driver)
    except DataError:
        raise
    except Exception as exc:  # Ray wraps reader errors; show the root cause, not Ray's traceback.
        raise unreadable(exc, option, data, settings.csv_delimiter) from None
    tally = _tally(
        [encoded.select(_COUNTED)]
        if in_driver
        else encoded.select_columns(_COUNTED).iter_batches(batch_size=None, batch_format="pyarrow")
    )
    usable = _usable_rows(tally, settings, files, kind, data=data, option=option)
    say(f"shuffling and packing {usable} {'pairs' if settings.pairs else 'rows'} ({tally.tokens} tokens)")
    eval_rows = max(1, round(eval_fraction * usable)) if eval_fraction else 0
    if in_driver:
        packed, eval_dataset = _shuffled_and_packed_here(encoded, settings, eval_rows, ray_dataset=ray_dataset)
    else:
        packed, eval_dataset = _shuffled_and_packed(encoded, settings, eval_rows, usable)
    blocks = _count(packed)
    if blocks < min_blocks:
        left = f" left after {eval_rows} held out for evaluation" if eval_rows else ""
        raise DataError(
            f"{option} {data!r}: {usable - eval_rows} usable rows{left} pack into {blocks} blocks of "
            f"{settings.seq_len} tokens, but one step needs {min_blocks} (workers x batch size x accumulation steps)",
            hint="Use more data, a smaller --seq-len or batch size, or fewer workers.",
        )
    return PreparedData(
        dataset=packed,
        rows=sum(tally.reasons.values()),
        usable_rows=usable,
        malformed={why: n for why, n in tally.reasons.items() if why},
        blocks=blocks,
        tokens=tally.tokens,
        trained_tokens=tally.trained,
        eval_dataset=eval_dataset,
        eval_rows=eval_rows,
        last_answer_only=tally.last_only,
        seq_len=settings.seq_len,
        eval_blocks=_count(eval_dataset) if eval_dataset is not None else 0,
        eval_tokens=_filled(eval_dataset) if eval_dataset is not None else 0,
        truncated_rows=tally.fates[TRUNCATED],
        truncated_tokens=tally.cut[TRUNCATED],
        dropped_rows=tally.fates[DROPPED],
        dropped_tokens=tally.cut[DROPPED],
        pairs=settings.pairs,
    )


def _encoded(files: list[str], kind: str, settings: DataSettings, in_driver: bool) -> Any:
    """Every row of ``files`` encoded and fitted to ``seq_len``: one pyarrow table (in the driver) or a materialized
    Ray dataset, with the columns of :data:`_COUNTED` saying what each row is."""
    encode = {
        "tokenizer_path": settings.tokenizer_path,
        "data_format": settings.data_format,
        "text_field": settings.text_field,
        "columns": settings.columns,
        "chat_template": settings.chat_template,
        "pairs": settings.pairs,
        "fit": {"seq_len": settings.seq_len, "packing": settings.packing, "overlong": settings.overlong},
    }
    if in_driver:
        return _encode_in_driver(files, kind, settings.csv_delimiter, **encode)
    import ray.data

    # Local files (a hf: dataset's cache included) lie on this node only: their reads run here.
    where = _reads_here(files)
    with _blocks_bounded():  # the steps below inherit the read's settings
        raw = (
            read_dataset(files, kind, label_selector=where, csv_delimiter=settings.csv_delimiter)
            if kind != "json"
            else ray.data.read_datasource(json_datasource(files), **placed(ray.data.read_datasource, where))
        )
    return raw.map_batches(_encode_fit_batch, batch_format="pyarrow", fn_kwargs=encode).materialize()


def _usable_rows(
    tally: _Tally, settings: DataSettings, files: Sequence[str], kind: str, *, data: str, option: str
) -> int:
    """The rows that train (well formed, not dropped as too long); :class:`DataError` when there is none."""
    reasons, fates = tally.reasons, tally.fates
    usable = reasons.get("", 0) - fates[DROPPED]
    seq_len, overlong = settings.seq_len, settings.overlong
    if usable == 0 and fates[DROPPED]:
        why = (
            "training.overlong is 'drop'"
            if overlong == "drop"
            else f"nothing of a row's answer lay within its first {seq_len} tokens"
        )
        raise DataError(
            f"{option} {data!r}: every usable row is longer than seq_len = {seq_len} tokens and was dropped "
            f"({fates[DROPPED]} rows: {why})",
            hint="Raise --seq-len"
            + (", or set training.overlong to truncate (keep each row's start)." if overlong == "drop" else "."),
        )
    if usable == 0:
        malformed = {why: n for why, n in reasons.items() if why}
        detail = "; ".join(f"{n} x {why}" for why, n in malformed.items()) or "the data set is empty"
        raise DataError(
            f"{option} {data!r}: no usable row for format '{settings.data_format}' ({sum(reasons.values())} rows "
            f"read: {detail})",
            hint=f"Check --data-format ({', '.join(FORMAT_NAMES)}) and the field names of your rows "
            "(training.columns maps them)." + delimiter_hint(files, kind, settings.csv_delimiter),
        )
    return usable


def _shuffled_and_packed_here(encoded: Any, settings: DataSettings, eval_rows: int, *, ray_dataset: bool) -> Any:
    """In the driver: the usable rows in the seed's order, the first ``eval_rows`` packed apart (``None`` when
    none), the rest packed; as Ray datasets, or (``ray_dataset`` false) lists of pyarrow tables."""
    import pyarrow.compute as pc

    keep = pc.and_(pc.equal(encoded["reason"], ""), pc.not_equal(encoded["fate"], DROPPED))
    rows = _shuffle_key(encoded.filter(keep).drop_columns(_COUNTED), seed=settings.seed).sort_by("order")
    rows = rows.drop_columns(["order"])
    wrap = as_ray_dataset if ray_dataset else (lambda tables: tables)
    shape = settings.shape
    held = wrap(_packed_in_driver(rows.slice(0, eval_rows), *shape)) if eval_rows else None
    return wrap(_packed_in_driver(rows.slice(eval_rows), *shape)), held


def _shuffled_and_packed(encoded: Any, settings: DataSettings, eval_rows: int, usable: int) -> Any:
    """:func:`_shuffled_and_packed_here` through Ray Data's tasks (a global sort by the seeded key)."""
    from ray.data.expressions import col

    rows = (
        encoded.filter(expr=(col("reason") == "") & (col("fate") != DROPPED))
        .drop_columns(_COUNTED)
        .map_batches(_shuffle_key, batch_format="pyarrow", fn_kwargs={"seed": settings.seed})
        .sort("order")
        .drop_columns(["order"])
        .materialize()
    )
    shape, held = settings.shape, None
    if eval_rows:
        evaluated, rows = rows.split_at_indices([eval_rows])
        held = _packed(evaluated, eval_rows, *shape)
    return _packed(rows, usable - eval_rows, *shape), held


def _count(packed: Any) -> int:
    """The blocks of a packed set: a Ray dataset, or the driver's list of tables."""
    return sum(t.num_rows for t in packed) if isinstance(packed, list) else int(packed.count())


def _filled(packed: Any) -> int:
    """The positions of a packed set's blocks that hold a row (its ``filled`` column summed)."""
    if isinstance(packed, list):
        import pyarrow.compute as pc

        return sum(int(pc.sum(t.column("filled")).as_py() or 0) for t in packed)
    return int(packed.sum("filled") or 0)


def prepare_for(training: Any, tokenizer_path: str, **given: Any) -> PreparedData:
    """:func:`prepare_dataset` with the data settings of ``training`` (:meth:`DataSettings.of`); ``given`` adds the
    rest (``data``, ``min_blocks``, ``listed``, ``eval_fraction``, ``stage``, ``option``, ``in_driver``,
    ``ray_dataset``). ``train`` and ``raytrain-eks data`` both prepare through it, so they make the same blocks."""
    return prepare_dataset(DataSettings.of(training, tokenizer_path), **given)


def _reads_here(files: Sequence[str]) -> dict[str, str] | None:
    """The label selector that keeps the read tasks of local ``files`` on this node (on a cluster, another node has
    no such files): Ray's own node-id label; none for remote storage, which every node reaches."""
    from raytrain_eks.train.storage import is_remote

    if all(is_remote(f) for f in files):
        return None
    import ray
    from ray.util.placement_group import NODE_ID_LABEL_KEY

    return {NODE_ID_LABEL_KEY: ray.get_runtime_context().get_node_id()}


@dataclass
class _Tally:
    """What the encoded rows hold: rows by reason (``""``: usable), usable rows by fate (:func:`fit_rows`) and the
    tokens each fate cut, and of the rows that will be packed: tokens, trained tokens, rows trained on their last
    answer only."""

    reasons: Counter[str] = field(default_factory=Counter)
    fates: Counter[str] = field(default_factory=Counter)
    cut: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    trained: int = 0
    last_only: int = 0


def _tally(tables: Iterable[Any]) -> _Tally:
    """:class:`_Tally` of encoded tables (counted column-wise)."""
    import pyarrow.compute as pc

    tally = _Tally()
    for table in tables:
        for pair in pc.value_counts(table.column("reason")).to_pylist():
            tally.reasons[pair["values"]] += pair["counts"]
        usable = table.filter(pc.equal(table.column("reason"), ""))
        for pair in pc.value_counts(usable.column("fate")).to_pylist():
            tally.fates[pair["values"]] += pair["counts"]
        for fate in (TRUNCATED, DROPPED):
            tally.cut[fate] += pc.sum(usable.filter(pc.equal(usable.column("fate"), fate)).column("cut")).as_py() or 0
        packed = usable.filter(pc.not_equal(usable.column("fate"), DROPPED))
        tally.tokens += pc.sum(packed.column("tokens")).as_py() or 0
        tally.trained += pc.sum(packed.column("trained")).as_py() or 0
        tally.last_only += pc.sum(packed.column("last_only")).as_py() or 0
    return tally


def _packed(rows: Any, count: int, seq_len: int, pad_id: int, packing: str, overlong: str) -> Any:
    """``rows`` (``count`` of them, in order) packed into ``seq_len`` blocks, in groups of rows fixed by the row count
    alone (not by how the blocks happen to be cut)."""
    return (
        rows.repartition(_pack_groups(count), shuffle=False)
        .map_batches(
            _pack_batch,
            batch_size=None,
            batch_format="pyarrow",
            fn_kwargs={"seq_len": seq_len, "pad_id": pad_id, "packing": packing, "overlong": overlong},
        )
        .materialize()
    )
