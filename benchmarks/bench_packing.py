"""Packing: how much of each block holds a row, and how many trained tokens lose the start of their row.

For the built-in data (its real tokens, the default job's blocks of 128) and for synthetic log-normal length mixes
of the shapes users bring (Alpaca-like, median 150 tokens; median 350; chat-like, median 600; each row's first third
its prompt), packed by ``documents`` (whole rows, :func:`raytrain_eks.train.data.packing.place_rows`) and by ``concat``
(rows run on and cut every ``seq_len``: what documents packing did before it kept rows whole), it prints:

- efficiency: the share of the blocks' positions that hold a row;
- cut: the share of trained targets whose row began in an earlier block (they train without their prompt);
- long: the share of rows longer than the block (truncated under documents packing);
- ms: the time to place one group of 1,024 rows.

    python benchmarks/bench_packing.py [--rows 8192]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from raytrain_eks.train.data.packing import best_fit_decreasing, place_rows

GROUP = 1024  # rows packed together (raytrain_eks.train.data.pipeline.PACK_ROWS)


def synthetic(median: float, rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(8, rng.lognormal(np.log(median), 0.8, rows).astype(np.int64))


def builtin_lengths() -> np.ndarray:
    import json

    from raytrain_eks.train.builtin import sample_data_path
    from raytrain_eks.train.data.encoding import encode, encoding_tokenizer
    from raytrain_eks.train.data.json_reader import json_rows
    from raytrain_eks.train.model_source import resolve_model_path

    tokenizer = encoding_tokenizer(resolve_model_path("builtin:tiny-qwen2"), None)
    with open(sample_data_path(), "rb") as f:
        rows = [json.loads(r["json"]) for r in json_rows([f.read()])]
    return np.array([len(encode(r, "instruction", tokenizer).ids) for r in rows], dtype=np.int64)


def concat_cut(lengths: np.ndarray, seq_len: int) -> float:
    """Under concat packing: the share of trained targets (the last two thirds of each row, its first token left
    out) whose row began in an earlier block."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    cut = total = 0
    for start, n in zip(starts, lengths, strict=True):
        first_trained = start + max(1, n // 3)
        targets = np.arange(first_trained, start + n)
        total += len(targets)
        cut += int((targets // seq_len > start // seq_len).sum())
    return cut / total


def documents(lengths: np.ndarray, seq_len: int, placer=place_rows) -> tuple[float, float]:
    """Efficiency and the milliseconds to place one group, packing groups of GROUP rows (rows over the block
    truncated)."""
    kept = np.minimum(lengths, seq_len)
    blocks, seconds = 0, 0.0
    groups = range(0, len(kept), GROUP)
    for g in groups:
        part = kept[g : g + GROUP]
        t = time.perf_counter()
        bins, _ = placer(part, seq_len)
        seconds += time.perf_counter() - t
        blocks += int(bins.max()) + 1
    return float(kept.sum()) / (blocks * seq_len), 1000 * seconds / len(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8 * GROUP, help="rows of each synthetic mix")
    args = parser.parse_args()
    cases = [("built-in data (390 rows)", builtin_lengths(), 128)]
    for name, median in (("Alpaca-like, median 150", 150), ("median 350", 350), ("chat-like, median 600", 600)):
        lengths = synthetic(median, args.rows, seed=median)
        cases += [(name, lengths, 1024), (name, lengths, 2048)]
    print("| data | seq_len | documents: efficiency | best fit alone | ms per 1,024 rows | concat: cut | long |")
    print("|---|---|---|---|---|---|---|")
    for name, lengths, seq_len in cases:
        efficiency, ms = documents(lengths, seq_len)
        bfd, _ = documents(lengths, seq_len, best_fit_decreasing)
        long = float((lengths > seq_len).mean())
        print(
            f"| {name} | {seq_len} | {100 * efficiency:.1f} % | {100 * bfd:.1f} % | {ms:.1f} | "
            f"{100 * concat_cut(lengths, seq_len):.0f} % | {100 * long:.1f} % |"
        )


if __name__ == "__main__":
    main()
