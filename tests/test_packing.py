"""Packing by documents: every row goes whole into one block and keeps apart from the others there, so each trains
as it would alone, its prompt in front of its answer.

Each block carries ``position_ids`` that count from 0 where a row starts; transformers builds the block-causal mask
from them (no attention across rows), and the rotary positions restart with each row. The tests pack rows of mixed
lengths, some longer than a block, and check that every row lies whole (or, over ``seq_len``, its start) in one
block, and compare, with real tiny models in fp32, every row's loss inside a packed block (the job's forward and
chunked loss) with the model's own loss for that row alone; ``concat`` packing (rows run on) keeps neither.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from raytrain_eks.config import BUILTIN_MODEL, TrainingConfig
from raytrain_eks.errors import DataError
from raytrain_eks.presets import local_tiny
from raytrain_eks.train.builtin import sample_data_path
from raytrain_eks.train.context import ProcessContext
from raytrain_eks.train.data.cursor import DataCursor, take_from_parts
from raytrain_eks.train.data.encoding import IGNORE_INDEX, encode
from raytrain_eks.train.data.packing import block_documents, fullest_bins, pack, pack_table, place_rows
from raytrain_eks.train.data.pipeline import DataSettings, first_blocks, prepare_dataset
from raytrain_eks.train.flops import documents_flops
from raytrain_eks.train.loop import train
from raytrain_eks.train.model import chunked_cross_entropy, forward_inputs, load_model, output_projection_deferred

LENGTHS = (9, 14, 6, 11)  # four rows in one block of SEQ tokens, the tail padded
SEQ = 48
PROMPT = 3  # each row's first tokens are its prompt: masked, as the instruction format masks them


def _rows(vocab: int, seed: int = 0, lengths: tuple[int, ...] = LENGTHS) -> list[tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        rows.append((ids, [IGNORE_INDEX] * PROMPT + ids[PROMPT:]))
    return rows


def save_tiny_llama(path: str) -> str:
    """A tiny random Llama (vocabulary 300, untied output layer) saved at ``path`` as from_pretrained reads it."""
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.3,  # weights large enough that a token's context changes its loss
    )
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _models(arch: str, builtin_model: str, tmp_path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """One model twice: as the job loads it (:func:`load_model`), and as it comes."""
    path = builtin_model  # the built-in model: Qwen2's architecture, tied embedding
    if arch == "llama":
        path = save_tiny_llama(str(tmp_path / "llama"))
    return load_model(path, activation_checkpointing=False), AutoModelForCausalLM.from_pretrained(path)


def _alone(model: torch.nn.Module, ids: list[int], labels: list[int]) -> float:
    """The model's own loss of one row, summed over its trained tokens (``.loss`` is their mean)."""
    out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
    return float(out.loss) * sum(t != IGNORE_INDEX for t in labels[1:])


def _where(packed: dict[str, np.ndarray], rows) -> list[tuple[int, int, int]]:
    """(block, start, length) of each row in blocks packed by documents, found by its tokens (``None`` when the row
    is in no block); every document of every block must be one of the rows, whole, or its start."""
    found: dict[int, tuple[int, int, int]] = {}
    for b, (ids, filled) in enumerate(zip(packed["input_ids"], packed["filled"], strict=True)):
        for start, n in block_documents(packed["position_ids"][b], int(filled)):
            matches = [i for i, (row, _) in enumerate(rows) if list(ids[start : start + n]) == list(row[:n])]
            assert len(matches) == 1, f"block {b} at {start}: {n} tokens that start no row (a row cut apart)"
            assert matches[0] not in found, f"row {matches[0]} trains twice"
            found[matches[0]] = (b, start, n)
    return [found.get(i) for i in range(len(rows))]


@torch.no_grad()
def _packed_row_losses(model: torch.nn.Module, rows, packing: str, seq: int = SEQ) -> list[float]:
    """Each row's summed loss inside its packed block, as the job computes it (several loss chunks); the blocks go
    through the model as one batch."""
    packed = pack(rows, seq_len=seq, pad_id=0, packing=packing)
    batch = {k: torch.from_numpy(v.astype(np.int64)) for k, v in packed.items()}
    head = output_projection_deferred(model)
    hidden = head.forward(model, **forward_inputs(batch)).logits
    if packing == "documents":
        places = _where(packed, rows)
    else:  # run on, in the given order
        ends = np.cumsum([len(ids) for ids, _ in rows])
        places = [
            (int(e - len(ids)) // seq, int(e - len(ids)) % seq, len(ids))
            for e, (ids, _) in zip(ends, rows, strict=True)
        ]
    losses = []
    for block, start, n in places:
        only = torch.full_like(batch["labels"], IGNORE_INDEX)
        only[block, start : start + n] = batch["labels"][block, start : start + n]
        loss = chunked_cross_entropy(
            hidden[:, :-1], head(), only[:, 1:], max_logits=7 * 300, ignore_index=IGNORE_INDEX, transform=head.transform
        )
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_row_packed_among_others_has_the_loss_it_has_alone(arch, builtin_model, tmp_path):
    job_model, own_model = _models(arch, builtin_model, tmp_path)
    vocab = min(job_model.config.vocab_size, 300)
    # Rows of mixed lengths for blocks of 48: several share a block, one is longer than a block (its first 48 tokens
    # train), and no order of them fills the blocks without cutting one apart when they run on.
    rows = _rows(vocab, lengths=(30, 9, 14, 60, 6, 11, 25, 40))
    with torch.no_grad():
        alone = [_alone(own_model, ids[:SEQ], labels[:SEQ]) for ids, labels in rows]
    assert _packed_row_losses(job_model, rows, "documents") == pytest.approx(alone, rel=1e-5)
    # Run on as one text, every row after the first sees the rows before it (and later positions): another loss.
    few = rows[1:3] + rows[4:6]  # rows that fit one block together
    concat = _packed_row_losses(job_model, few, "concat")
    assert concat[0] == pytest.approx(alone[1], rel=1e-5)
    assert all(abs(c - a) > 1e-3 * a for c, a in zip(concat[1:], [alone[2], alone[4], alone[5]], strict=True))


def _length_mix(count: int, median: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """Rows of log-normal lengths around ``median`` (a few over a block), each starting with its own token (its
    index, so every row is told apart by its first tokens) and its first third masked as prompt."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(3, rng.lognormal(np.log(median), 0.8, count).astype(int))
    rows = []
    for i, n in enumerate(lengths):
        ids = [1000 + i, *rng.integers(3, 1000, n - 1).tolist()]
        prompt = max(1, n // 3)
        rows.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return rows


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
@pytest.mark.parametrize(("median", "seq"), [(20, 64), (40, 64), (90, 128)])
def test_every_trained_token_sees_its_row_from_the_start(overlong, median, seq):
    # Short, middling and long rows for the block (some longer than it): each row lies whole in one block, from its
    # first token (its prompt) on; a row over seq_len keeps its first seq_len tokens or is left out, per the setting.
    rows = _length_mix(300, median, seed=median)
    packed = pack(rows, seq_len=seq, pad_id=0, overlong=overlong)
    places = _where(packed, rows)
    for (ids, labels), place in zip(rows, places, strict=True):
        if len(ids) > seq and overlong == "drop":
            assert place is None
            continue
        block, start, n = place
        assert n == min(len(ids), seq)
        assert packed["labels"][block, start : start + n].tolist() == [IGNORE_INDEX, *labels[1:n]]
        assert packed["position_ids"][block, start : start + n].tolist() == list(range(n))
    # Nothing outside the rows trains: the padding after each block's rows is masked.
    inside = np.zeros(packed["labels"].shape, dtype=bool)
    for block, start, n in filter(None, places):
        inside[block, start : start + n] = True
    assert (packed["labels"][~inside] == IGNORE_INDEX).all()
    assert packed["filled"].tolist() == inside.sum(axis=1).tolist()
    assert any(len(ids) > seq for ids, _ in rows), "the mix has rows longer than a block"


def test_rows_are_placed_the_same_way_every_time_and_fill_the_blocks():
    rng = np.random.default_rng(0)
    for capacity, lengths in [(128, rng.integers(25, 40, 370)), (1024, rng.lognormal(np.log(150), 0.8, 1024))]:
        lengths = np.minimum(capacity, np.maximum(4, lengths.astype(np.int64)))
        bins, offsets = place_rows(lengths, capacity)
        again = place_rows(lengths.copy(), capacity)
        assert bins.tolist() == again[0].tolist() and offsets.tolist() == again[1].tolist()
        used = np.bincount(bins, weights=lengths)
        assert used.max() <= capacity
        for b in range(len(used)):  # the rows of a bin lie end to end from its start
            spans = sorted((int(offsets[i]), int(offsets[i] + lengths[i])) for i in np.flatnonzero(bins == b))
            assert spans[0][0] == 0 and all(a[1] == c[0] for a, c in zip(spans, spans[1:], strict=False))
        assert lengths.sum() / (len(used) * capacity) >= 0.95
    # Short rows of nearly one length (the built-in data in blocks of 128): the fuller placement is taken.
    lengths = np.random.default_rng(1).integers(25, 40, 400)
    assert place_rows(lengths, 128)[0].max() == fullest_bins(lengths, 128)[0].max()


def test_a_block_of_one_row_is_given_no_positions():
    # One row filling a block counts positions from 0 as the model would: no position_ids, the causal fast path.
    one = pack([(list(range(3, 3 + SEQ)), list(range(3, 3 + SEQ)))], seq_len=SEQ, pad_id=0)
    batch = {k: torch.from_numpy(v.astype(np.int64)) for k, v in one.items()}
    assert set(forward_inputs(batch)) == {"input_ids"}
    two = pack(_rows(300), seq_len=SEQ, pad_id=0)
    assert set(forward_inputs({k: torch.from_numpy(v) for k, v in two.items()})) == {"input_ids", "position_ids"}


class _PackedContext(ProcessContext):
    """A lone process whose data is a packed set in memory, read as the Ray workers read theirs."""

    def __init__(self, out, blocks: dict[str, np.ndarray]) -> None:
        super().__init__(out)
        self._set = blocks

    def data_batches(self, batch_size, position, seed):
        return DataCursor(
            take_from_parts(lambda: [self._set], len(self._set["input_ids"])),
            blocks=len(self._set["input_ids"]),
            seed=seed,
            rank=0,
            world_size=1,
            batch_size=batch_size,
            position=position,
        )


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_training_loop_keeps_packed_rows_apart(tmp_path, one_process_group, builtin_model):
    # Two blocks of four rows each; the loop's first loss (before any update) is the mean over every trained token
    # of the rows' losses alone.
    vocab = 300
    groups = [pack(_rows(vocab, seed=seed), seq_len=SEQ, pad_id=0) for seed in (2, 3)]  # one block each
    blocks = {k: np.concatenate([g[k] for g in groups]) for k in groups[0]}
    rows = _rows(vocab, seed=2) + _rows(vocab, seed=3)
    assert len(blocks["input_ids"]) == 2
    own = AutoModelForCausalLM.from_pretrained(builtin_model, dtype=torch.float32)
    with torch.no_grad():
        alone = sum(_alone(own, ids, labels) for ids, labels in rows)
    trained = sum(sum(t != IGNORE_INDEX for t in labels[1:]) for _, labels in rows)
    cfg = TrainingConfig(
        model_id=BUILTIN_MODEL,
        data="builtin:sample-instructions",  # the set itself comes from the context above
        steps=1,
        seq_len=SEQ,
        batch_size=2,
        log_every=1,
        checkpoint_every=0,
        precision="fp32",
    )
    (tmp_path / "out").mkdir()
    summary = train(cfg, builtin_model, _PackedContext(tmp_path / "out", blocks))
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["loss"] == pytest.approx(alone / trained, rel=1e-5)
    # Throughput counts the rows' tokens, not the padding after them, and charges each row's attention over its own
    # length: the FLOPs of the eight rows as eight documents, not of two blocks of SEQ tokens.
    lengths = [len(ids) for ids, _ in rows]
    assert summary["trained_tokens"] == record["tokens"] == sum(lengths) < 2 * SEQ
    config = own.config
    assert summary["flops_per_token"] == pytest.approx(documents_flops(config, lengths) / sum(lengths), rel=1e-9)
    assert summary["flops_per_token"] < documents_flops(config, [SEQ, SEQ]) / (2 * SEQ)


def _prepared(path, builtin_model, *, seq_len: int, overlong: str = "truncate", eval_fraction: float = 0.0):
    """The data set as ``train`` prepares it in the driver, its packed blocks kept out of Ray (no Ray starts)."""
    return prepare_dataset(
        DataSettings(
            data_format="instruction",
            text_field="text",
            tokenizer_path=builtin_model,
            seq_len=seq_len,
            overlong=overlong,
            seed=0,
        ),
        data=str(path),
        min_blocks=1,
        eval_fraction=eval_fraction,
        in_driver=True,
        ray_dataset=False,
    )


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_rows_longer_than_a_block_are_truncated_or_dropped_and_counted(overlong, builtin_model, tokenizer, tmp_path):
    rng = np.random.default_rng(3)
    words = ["the", "a", "model", "trains", "on", "whole", "rows", "of", "text", "each", "with", "its", "prompt"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words, n))

    rows = [
        {"instruction": text(int(rng.integers(3, 12))), "output": text(int(rng.integers(2, 120)))} for _ in range(60)
    ]
    rows.append({"instruction": text(150), "output": "the answer lies past the block"})  # nothing trains in its start
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seq = 64
    encoded = [encode(r, "instruction", tokenizer) for r in rows]
    over = [e for e in encoded if len(e.ids) > seq]
    answer_past = [e for e in over if all(t == IGNORE_INDEX for t in e.labels[1:seq])]
    assert len(over) >= 5 and len(answer_past) == 1

    prepared = _prepared(path, builtin_model, seq_len=seq, overlong=overlong)

    if overlong == "truncate":
        assert prepared.truncated_rows == len(over) - 1
        assert prepared.truncated_tokens == sum(len(e.ids) - seq for e in over if e not in answer_past)
        assert (prepared.dropped_rows, prepared.dropped_tokens) == (1, len(answer_past[0].ids))
        assert f"truncated {len(over) - 1} rows longer than 64 tokens" in prepared.describe("mixed.jsonl")
    else:
        assert (prepared.truncated_rows, prepared.truncated_tokens) == (0, 0)
        assert (prepared.dropped_rows, prepared.dropped_tokens) == (len(over), sum(len(e.ids) for e in over))
    assert f"dropped {prepared.dropped_rows} rows longer than 64 tokens" in prepared.describe("mixed.jsonl")
    assert prepared.usable_rows == len(rows) - prepared.dropped_rows
    # The blocks hold exactly the rows kept, each whole or its start: no token lost beyond those counted.
    blocks = first_blocks(prepared.dataset, prepared.blocks)
    kept = [e for e in encoded if len(e.ids) <= seq or (overlong == "truncate" and e not in answer_past)]
    assert int(blocks["filled"].sum()) == prepared.tokens == sum(min(len(e.ids), seq) for e in kept)
    assert int((blocks["labels"][:, 1:] != IGNORE_INDEX).sum()) == prepared.trained_tokens


def test_a_set_of_rows_all_too_long_to_keep_is_refused_with_what_to_do(builtin_model, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"instruction": "tell me " * 40, "output": "a long answer " * 40}) + "\n")
    with pytest.raises(DataError, match=r"every usable row is longer than seq_len = 32 tokens and was dropped") as err:
        _prepared(path, builtin_model, seq_len=32, overlong="drop")
    assert "training.overlong is 'drop'" in str(err.value)
    assert "Raise --seq-len, or set training.overlong to truncate" in err.value.hint
    # Truncated, the row keeps only its prompt: nothing to train, so it is dropped too, and the message says why.
    with pytest.raises(DataError, match=r"nothing of a row's answer lay within its first 32 tokens") as err:
        _prepared(path, builtin_model, seq_len=32, overlong="truncate")
    assert err.value.hint == "Raise --seq-len."


def test_the_built_in_data_fills_its_blocks(builtin_model):
    # The default job's data and block length, its held-out rows apart: whole rows, and under 5 % padding.
    prepared = _prepared(sample_data_path(), builtin_model, seq_len=local_tiny().training.seq_len, eval_fraction=0.05)
    assert prepared.efficiency >= 0.95
    assert prepared.counts()["padding_tokens"] == prepared.blocks * prepared.seq_len - (
        prepared.tokens - prepared.eval_tokens
    )


def test_pack_concat_runs_the_rows_on_and_pads_the_tail_block():
    rows = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [4, 5]), ([6], [-100])]
    packed = pack(rows, seq_len=4, pad_id=0, packing="concat")
    ids, labels = packed["input_ids"], packed["labels"]
    assert set(packed) == {"input_ids", "labels", "filled"}, "concat gives no positions: the model counts them itself"
    assert ids.dtype == np.int64 and ids.shape == (2, 4)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert labels.tolist() == [[-100, 2, 3, 4], [5, -100, -100, -100]]
    assert packed["filled"].tolist() == [4, 2]


def test_pack_documents_keeps_each_row_whole_numbered_from_its_start_with_its_first_token_masked():
    rows = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [4, 5]), ([6], [-100]), ([7, 8, 9], [7, 8, 9])]
    packed = pack(rows, seq_len=4, pad_id=0)  # documents is the default
    # Longest first, each into the fullest block that takes it: [1 2 3] + [6], [7 8 9], then [4 5] (no block has 2
    # free positions left but a new one). No row is cut at a block's edge.
    assert packed["input_ids"].tolist() == [[1, 2, 3, 6], [7, 8, 9, 0], [4, 5, 0, 0]]
    # The padded tail goes on from the block's last row.
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert packed["position_ids"].dtype == np.int32
    # No row's first token is a target: the token before it belongs to another row, or to none.
    assert packed["labels"].tolist() == [[-100, 2, 3, -100], [-100, 8, 9, -100], [-100, 5, -100, -100]]
    assert packed["filled"].tolist() == [4, 3, 2]
    with pytest.raises(ValueError, match="packing must be one of documents, concat"):
        pack(rows, seq_len=4, pad_id=0, packing="sorted")
    with pytest.raises(ValueError, match="overlong must be one of truncate, drop"):
        pack(rows, seq_len=4, pad_id=0, overlong="split")


def test_pack_exact_fit_has_no_padding_and_rejects_ragged_rows():
    for packing in ("concat", "documents"):
        packed = pack([([1, 2], [1, 2]), ([3, 4], [3, 4])], seq_len=2, pad_id=9, packing=packing)
        assert packed["input_ids"].tolist() == [[1, 2], [3, 4]] and packed["filled"].tolist() == [2, 2]
    with pytest.raises(ValueError, match="differ in length"):
        pack([([1, 2], [1])], seq_len=2, pad_id=0)


def test_pack_table_packs_a_sliced_chunked_table_as_pack_packs_its_rows():
    import pyarrow as pa

    rng = np.random.default_rng(7)
    rows = [rng.integers(0, 50_000, int(n)).tolist() for n in rng.integers(0, 40, 60)]
    labels = [[t if i % 3 else -100 for i, t in enumerate(r)] for r in rows]
    tokens = pa.list_(pa.int32())
    table = pa.Table.from_batches(
        [
            pa.record_batch({"input_ids": pa.array(rows[a:b], tokens), "labels": pa.array(labels[a:b], tokens)})
            for a, b in [(0, 25), (25, 26), (26, 60)]
        ]
    )
    part = table.slice(10, 41)  # across all three chunks, starting inside the first
    assert part.column("input_ids").num_chunks == 3
    for packing in ("documents", "concat"):
        got = pack_table(part, seq_len=16, pad_id=5, packing=packing)
        want = pack(list(zip(rows[10:51], labels[10:51], strict=True)), seq_len=16, pad_id=5, packing=packing)
        assert got["input_ids"].dtype == np.int64 and len(got["input_ids"]) > 10 and set(got) == set(want)
        for k, v in want.items():
            assert got[k].shape == v.shape and got[k].tolist() == v.tolist(), k
    assert pack_table(table.slice(0, 0), seq_len=16, pad_id=5)["input_ids"].shape == (0, 16)
    ragged = pa.table({"input_ids": pa.array([[1, 2]], tokens), "labels": pa.array([[1]], tokens)})
    with pytest.raises(ValueError, match="differ in length"):
        pack_table(ragged, seq_len=2, pad_id=0)
