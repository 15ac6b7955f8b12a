"""Packing: encoded rows (token ids and labels) into the fixed ``seq_len`` blocks the model trains on.

``packing: documents`` (the default) keeps every row whole inside one block (:func:`place_rows`), so
every trained token sees its row from the start, prompt included; ``concat`` runs the rows on as one text, cut
every ``seq_len`` tokens, as pre-training text is. :func:`fit_rows` decides, before packing, what happens to a row
longer than ``seq_len`` (``training.overlong``) and counts it. Pure functions over NumPy and pyarrow, tested on
hand-made rows; :mod:`.data` runs them in its pipeline.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from raytrain_eks.config import OVERLONG_MODES, PACKING_MODES
from raytrain_eks.train.data.encoding import IGNORE_INDEX


def pack(
    rows: Iterable[tuple[Sequence[int], Sequence[int]]],
    seq_len: int,
    pad_id: int,
    *,
    packing: str = "documents",
    overlong: str = "truncate",
) -> dict[str, np.ndarray]:
    """Encoded rows (``input_ids``, ``labels``) packed into ``seq_len`` blocks.

    With ``packing="documents"`` (:data:`PACKING_MODES`) each row goes whole into one block: best fit, longest row
    first (:func:`place_rows`), the rest of a block padding that trains nothing. A row longer than
    ``seq_len`` keeps its first ``seq_len`` tokens (``overlong="truncate"``) or is left out (``"drop"``);
    :func:`fit_rows` counts them before the rows get here. ``position_ids`` (``int32``) count from 0 where each row
    starts (the padding after a block's last row goes on counting), so the model's attention and positions stay
    inside each row, and each row's first token is masked in ``labels``: the row before it does not predict it.
    With ``packing="concat"`` the rows run on as one text, cut every ``seq_len`` tokens (pre-training text).

    Returns ``input_ids`` and ``labels`` (``int64``, shape ``[blocks, seq_len]``), ``position_ids`` (documents
    only) and ``filled`` (``int32``, shape ``[blocks]``): the positions of each block that hold a row (the rest,
    at the end of the block, is padding).

    >>> pack([([5, 6, 7], [-100, 6, 7]), ([8, 9], [-100, 9])], seq_len=4, pad_id=0)["input_ids"].tolist()
    [[5, 6, 7, 0], [8, 9, 0, 0]]
    """
    ids: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for row_ids, row_labels in rows:
        if len(row_ids) != len(row_labels):
            raise ValueError("input_ids and labels of a row differ in length")
        ids.append(np.asarray(row_ids, dtype=np.int64))
        labels.append(np.asarray(row_labels, dtype=np.int64))
    lengths = np.array([len(i) for i in ids], dtype=np.int64)
    if ids:
        flat_ids, flat_labels = np.concatenate(ids), np.concatenate(labels)
    else:
        flat_ids, flat_labels = np.empty(0, np.int64), np.empty(0, np.int64)
    return _packed_arrays(flat_ids, flat_labels, lengths, seq_len, pad_id, packing, overlong)


def _packed_arrays(
    ids: np.ndarray,
    labels: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    pad_id: int,
    packing: str,
    overlong: str = "truncate",
    splits: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The joined tokens of :func:`pack` (rows of ``lengths``, one after another) packed as it describes; a row
    with a ``splits`` offset above 0 holds two documents, the second starting there
    (a preference pair: :func:`pack_table`'s ``split``)."""
    if packing not in PACKING_MODES:
        raise ValueError(f"packing must be one of {', '.join(PACKING_MODES)}, not {packing!r}")
    if packing == "concat":
        return _run_on(ids, labels, seq_len, pad_id)
    if overlong not in OVERLONG_MODES:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG_MODES)}, not {overlong!r}")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
    kept = np.minimum(lengths, seq_len) if overlong == "truncate" else np.where(lengths > seq_len, 0, lengths)
    rows = np.flatnonzero(kept > 0)
    starts, kept = starts[rows], kept[rows]
    inner = splits[rows] if splits is not None else np.zeros(len(rows), dtype=np.int64)
    bins, offsets = place_rows(kept, seq_len)
    n_blocks = int(bins.max()) + 1 if len(bins) else 0
    out_ids = np.full(n_blocks * seq_len, pad_id, dtype=np.int64)
    out_labels = np.full(n_blocks * seq_len, IGNORE_INDEX, dtype=np.int64)
    dest = bins * seq_len + offsets  # where each row starts in the flat blocks
    within = np.arange(int(kept.sum()), dtype=np.int64) - np.repeat(np.cumsum(kept) - kept, kept)
    src, to = np.repeat(starts, kept) + within, np.repeat(dest, kept) + within
    out_ids[to], out_labels[to] = ids[src], labels[src]
    dest = np.concatenate([dest, (dest + inner)[inner > 0]])  # and where a pair's second document starts
    out_labels[dest] = IGNORE_INDEX  # a row's first token: nothing of the row before it predicts it
    begins = np.full(n_blocks * seq_len, -1, dtype=np.int64)
    begins[dest] = dest  # every block starts with a row, so each position finds the start of its row (or, in the
    begins = np.maximum.accumulate(begins) if len(begins) else begins  # padding, of the block's last row) before it
    positions = (np.arange(n_blocks * seq_len, dtype=np.int64) - begins).astype(np.int32)
    filled = np.bincount(bins, weights=kept, minlength=n_blocks).astype(np.int32)
    return {
        "input_ids": out_ids.reshape(n_blocks, seq_len),
        "labels": out_labels.reshape(n_blocks, seq_len),
        "position_ids": positions.reshape(n_blocks, seq_len),
        "filled": filled,
    }


# Best fit decreasing leaves this share of the positions empty or less on every length mix but tightly clustered
# short rows; only then is the slower, fuller placement tried as well (:func:`place_rows`).
GOOD_FILL = 0.97


def place_rows(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``lengths`` (each at most ``capacity``) placed whole into bins of ``capacity``: each row's bin and its
    offset in the bin, bins numbered from 0. :func:`best_fit_decreasing`, or :func:`fullest_bins` where that
    leaves more than ``1 - GOOD_FILL`` of the positions empty and the fuller placement needs fewer bins. Depends
    only on the lengths and their order."""
    bins, offsets = best_fit_decreasing(lengths, capacity)
    count = int(bins.max()) + 1 if len(bins) else 0
    if count and int(lengths.sum()) < GOOD_FILL * count * capacity:
        fuller, fuller_offsets = fullest_bins(lengths, capacity)
        if int(fuller.max()) + 1 < count:
            return fuller, fuller_offsets
    return bins, offsets


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``lengths`` (each at most ``capacity``) placed whole into bins of ``capacity``: longest first (ties
    in the given order), each into the bin with the least room that still takes it, else a new bin. Returns each
    row's bin and its offset in the bin; bins are numbered in the order they were opened. The same lengths in the
    same order always give the same bins.

    >>> [b.tolist() for b in best_fit_decreasing(np.array([3, 2, 2, 1]), 4)]
    [[0, 1, 1, 0], [0, 0, 2, 3]]
    """
    _check_fits(lengths, capacity)
    bins = np.empty(len(lengths), dtype=np.int64)
    offsets = np.empty(len(lengths), dtype=np.int64)
    used: list[int] = []  # tokens placed in each bin so far
    open_bins: list[tuple[int, int]] = []  # (room left, bin) of the bins not yet full, by room
    for row in np.argsort(-lengths, kind="stable"):
        n = int(lengths[row])
        k = bisect.bisect_left(open_bins, (n, -1))
        if k < len(open_bins):
            _, b = open_bins.pop(k)
        else:
            b = len(used)
            used.append(0)
        bins[row], offsets[row] = b, used[b]
        used[b] += n
        if used[b] < capacity:
            bisect.insort(open_bins, (capacity - used[b], b))
    return bins, offsets


def fullest_bins(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows placed as :func:`best_fit_decreasing` places them, by another rule: one bin at a time, the longest row
    left, then the rows left whose lengths fill the rest of the bin most nearly (an exact subset sum, as bits of a
    Python integer). Slower (a pass over the rows left for each bin), and fuller where the rows are short and of
    nearly one length, where best fit leaves a gap in every bin.

    >>> [b.tolist() for b in fullest_bins(np.array([5, 4, 3, 3, 3, 2]), 10)]
    [[0, 1, 0, 1, 1, 0], [0, 0, 7, 7, 4, 5]]
    """
    _check_fits(lengths, capacity)
    bins = np.empty(len(lengths), dtype=np.int64)
    offsets = np.empty(len(lengths), dtype=np.int64)
    left = [int(i) for i in np.argsort(-lengths, kind="stable")]
    shortest = int(lengths.min()) if len(lengths) else 0
    b = 0
    while left:
        first, rest = left[0], left[1:]
        room = capacity - int(lengths[first])
        chosen = [first]
        if rest and room >= shortest:
            window = (1 << (room + 1)) - 1
            sums = [1]  # sums[k]: the bits of the totals that rows rest[:k] can make, up to room
            for i in rest:
                sums.append((sums[-1] | (sums[-1] << int(lengths[i]))) & window)
            total = sums[-1].bit_length() - 1
            for k in range(len(rest) - 1, -1, -1):  # walk back: a row is taken when the total needs it
                if total == 0:
                    break
                if not (sums[k] >> total) & 1:
                    chosen.append(rest[k])
                    total -= int(lengths[rest[k]])
        at = 0
        for row in chosen:
            bins[row], offsets[row] = b, at
            at += int(lengths[row])
        taken = set(chosen)
        left = [i for i in rest if i not in taken]
        b += 1
    return bins, offsets


def _check_fits(lengths: np.ndarray, capacity: int) -> None:
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f"a row of {int(lengths.max())} tokens does not fit a block of {capacity}")


def _run_on(ids: np.ndarray, labels: np.ndarray, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """``packing: concat``: the joined tokens cut every ``seq_len``, the tail block padded and masked."""
    n_blocks = -(-len(ids) // seq_len)
    out_ids = np.full((n_blocks, seq_len), pad_id, dtype=np.int64)
    out_labels = np.full((n_blocks, seq_len), IGNORE_INDEX, dtype=np.int64)
    out_ids.reshape(-1)[: len(ids)] = ids
    out_labels.reshape(-1)[: len(labels)] = labels
    filled = np.minimum(seq_len, len(ids) - seq_len * np.arange(n_blocks)).astype(np.int32)
    return {"input_ids": out_ids, "labels": out_labels, "filled": filled}


def pack_table(
    table: Any, seq_len: int, pad_id: int, *, packing: str = "documents", overlong: str = "truncate"
) -> dict[str, np.ndarray]:
    """:func:`pack` of a pyarrow table's ``input_ids`` and ``labels`` list columns, from their values as they lie
    (no Python int per token). A ``split`` column makes each row a preference pair joined at that offset
    (:func:`~.encoding.encode_joined_pair`): each pair kept whole in one block, its chosen then its rejected
    answer as two documents (``position_ids`` count from 0 at each), so a block's documents pair up in order; a pair
    longer than ``seq_len`` is left out, since cutting it would lose the rejected answer."""
    import pyarrow.compute as pc

    ids, labels = table.column("input_ids"), table.column("labels")
    lengths = pc.list_value_length(ids)
    if pc.any(pc.not_equal(lengths, pc.list_value_length(labels))).as_py():
        raise ValueError("input_ids and labels of a row differ in length")
    counts = lengths.to_numpy(zero_copy_only=False).astype(np.int64) if len(lengths) else np.empty(0, np.int64)
    splits = None
    if "split" in table.column_names:  # joined preference pairs: whole, or not at all
        if (packing, overlong) != ("documents", "drop"):
            raise ValueError("preference pairs pack as documents, a pair too long left out (overlong drop)")
        splits = table.column("split").to_numpy(zero_copy_only=False).astype(np.int64)
    return _packed_arrays(_values(ids), _values(labels), counts, seq_len, pad_id, packing, overlong, splits)


def _values(column: Any) -> np.ndarray:
    """All the values of a list column, rows one after another (sliced and chunked columns included)."""
    import pyarrow.compute as pc

    chunks = [pc.list_flatten(chunk).to_numpy(zero_copy_only=False) for chunk in column.chunks]
    return np.concatenate(chunks) if chunks else np.empty(0, np.int64)


def block_documents(positions: np.ndarray, filled: int) -> list[tuple[int, int]]:
    """The rows of one packed block (``packing: documents``) as (start, length), from its ``position_ids`` and the
    positions that hold a row (``filled``; the padding after them is no row).

    >>> block_documents(np.array([0, 1, 2, 0, 1, 2, 3]), 5)
    [(0, 3), (3, 2)]
    """
    starts = np.flatnonzero(np.asarray(positions[:filled]) == 0)
    ends = np.append(starts[1:], filled)
    return [(int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)]


# What became of a usable row before packing (column ``fate`` of :func:`fit_rows`).
KEPT, TRUNCATED, DROPPED = "", "truncated", "dropped"


def fit_rows(table: Any, *, seq_len: int, packing: str, overlong: str) -> Any:
    """Encoded rows (a pyarrow table with ``input_ids``, ``labels``, ``reason``, ``tokens`` and ``trained``) as
    they will be packed, with what became of each: column ``fate`` (:data:`KEPT`, :data:`TRUNCATED` or
    :data:`DROPPED`) and ``cut`` (the tokens the row lost).

    Under ``packing: documents`` a row longer than ``seq_len`` keeps its first ``seq_len`` tokens (``overlong:
    truncate``) or is dropped whole (``drop``); a truncated row left with no trained token (its answer lay past the
    cut) is dropped too. ``tokens`` and ``trained`` then count what is packed (0 for a dropped row). Under
    ``concat`` no row is too long: rows run across blocks.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if overlong not in OVERLONG_MODES:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG_MODES)}, not {overlong!r}")
    n = table.num_rows
    tokens = table.column("tokens").to_numpy(zero_copy_only=False).astype(np.int64) if n else np.empty(0, np.int64)
    usable = np.array([r == "" for r in table.column("reason").to_pylist()], dtype=bool)
    long_rows = np.flatnonzero(usable & (tokens > seq_len)) if packing == "documents" else np.empty(0, np.int64)
    fate = np.full(n, KEPT, dtype=object)
    cut = np.zeros(n, dtype=np.int64)
    if not len(long_rows):
        return table.append_column("fate", pa.array(fate, pa.string())).append_column("cut", pa.array(cut))
    new_tokens = tokens.copy()
    trained = table.column("trained").to_numpy(zero_copy_only=False).astype(np.int64).copy()
    ids, labels = table.column("input_ids"), table.column("labels")
    if overlong == "truncate":
        ids, labels = pc.list_slice(ids, 0, seq_len), pc.list_slice(labels, 0, seq_len)
        for row in long_rows:
            kept_labels = np.asarray(labels[int(row)].values, dtype=np.int64)
            trained[row] = int((kept_labels[1:] != IGNORE_INDEX).sum())
        new_tokens[long_rows] = seq_len
        fate[long_rows] = TRUNCATED
        fate[long_rows[trained[long_rows] == 0]] = DROPPED
    else:
        fate[long_rows] = DROPPED
    dropped = fate == DROPPED
    new_tokens[dropped], trained[dropped] = 0, 0
    cut[long_rows] = tokens[long_rows] - new_tokens[long_rows]
    columns = {name: table.column(name) for name in table.column_names}
    columns.update(
        input_ids=ids,
        labels=labels,
        tokens=pa.array(new_tokens),
        trained=pa.array(trained),
        fate=pa.array(fate, pa.string()),
        cut=pa.array(cut),
    )
    return pa.table(columns)
