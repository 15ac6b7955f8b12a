"""Packing by documents: rows packed into one block keep apart, so each trains as it would alone.

Each block carries ``position_ids`` that count from 0 where a row starts; transformers builds the block-causal mask
from them (no attention across rows), and the rotary positions restart with each row. The tests compare, with
real tiny models in fp32, every row's loss inside a packed block (the job's forward and chunked loss) with the
model's own loss for that row alone, and show that ``concat`` packing (rows run on) does not keep them apart.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from raytrain_eks.config import BUILTIN_MODEL, TrainingConfig
from raytrain_eks.train.context import DataCursor, ProcessContext, take_from_parts
from raytrain_eks.train.data import IGNORE_INDEX, pack
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


@torch.no_grad()
def _packed_row_losses(model: torch.nn.Module, rows, packing: str) -> list[float]:
    """Each row's summed loss inside one packed block, as the job computes it (several loss chunks)."""
    packed = pack(rows, seq_len=SEQ, pad_id=0, packing=packing)
    assert len(packed["input_ids"]) == 1, "the rows fit one block"
    batch = {k: torch.from_numpy(v.astype(np.int64)) for k, v in packed.items()}
    head = output_projection_deferred(model)
    hidden = head.forward(model, **forward_inputs(batch)).logits
    losses, start = [], 0
    for ids, _ in rows:
        only = torch.full_like(batch["labels"], IGNORE_INDEX)
        only[0, start : start + len(ids)] = batch["labels"][0, start : start + len(ids)]
        loss = chunked_cross_entropy(
            hidden[:, :-1], head(), only[:, 1:], max_logits=7 * 300, ignore_index=IGNORE_INDEX, transform=head.transform
        )
        losses.append(float(loss))
        start += len(ids)
    return losses


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_row_packed_among_others_has_the_loss_it_has_alone(arch, builtin_model, tmp_path):
    job_model, own_model = _models(arch, builtin_model, tmp_path)
    rows = _rows(min(job_model.config.vocab_size, 300))
    with torch.no_grad():
        alone = [_alone(own_model, ids, labels) for ids, labels in rows]
    assert _packed_row_losses(job_model, rows, "documents") == pytest.approx(alone, rel=1e-5)
    # Run on as one text, every row after the first sees the rows before it (and later positions): another loss.
    concat = _packed_row_losses(job_model, rows, "concat")
    assert concat[0] == pytest.approx(alone[0], rel=1e-5)
    assert all(abs(c - a) > 1e-3 * a for c, a in zip(concat[1:], alone[1:], strict=True))


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
    train(cfg, builtin_model, _PackedContext(tmp_path / "out", blocks))
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["loss"] == pytest.approx(alone / trained, rel=1e-5)
