"""Data formats on small hand-made rows: tokenization, prompt masking and packing; random data's global batch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from raytrain_eks.train.data import IGNORE_INDEX, MalformedRow, encode_row, pack, pack_table, random_batch


def trained_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])


def masked_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX])


def test_text_format_trains_every_token_and_ends_with_eos(tokenizer):
    ids, labels = encode_row({"body": "the river runs"}, "text", tokenizer, text_field="body")
    assert labels == ids
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[:-1]) == "the river runs"


def test_instruction_format_masks_the_prompt(tokenizer):
    row = {"instruction": "What is 2 plus 3?", "input": "", "output": "2 plus 3 is 5."}
    ids, labels = encode_row(row, "instruction", tokenizer)
    assert tokenizer.decode(ids) == (
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n2 plus 3 is 5.<|im_end|>\n"
    )
    assert trained_text(tokenizer, ids, labels) == "2 plus 3 is 5.<|im_end|>\n"
    assert (
        masked_text(tokenizer, ids, labels) == "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    first_trained = next(i for i, lab in enumerate(labels) if lab != IGNORE_INDEX)
    assert all(lab == IGNORE_INDEX for lab in labels[:first_trained])
    assert labels[first_trained:] == ids[first_trained:]


def test_instruction_input_goes_into_the_prompt(tokenizer):
    row = {"instruction": "Reverse the order of these words.", "input": "red blue", "output": "blue red"}
    ids, labels = encode_row(row, "instruction", tokenizer)
    assert "Reverse the order of these words.\n\nred blue" in masked_text(tokenizer, ids, labels)
    assert trained_text(tokenizer, ids, labels) == "blue red<|im_end|>\n"


def test_chat_format_trains_only_assistant_turns(tokenizer):
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "What is EFA?"},
            {"role": "assistant", "content": "A fabric."},
        ]
    }
    ids, labels = encode_row(row, "chat", tokenizer)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert trained_text(tokenizer, ids, labels) == "Hello.<|im_end|>\nA fabric.<|im_end|>\n"
    assert "Be brief." in masked_text(tokenizer, ids, labels)
    assert "What is EFA?" in masked_text(tokenizer, ids, labels)


def test_without_a_chat_template_a_plain_layout_is_used(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    ids, labels = encode_row({"instruction": "Say hi.", "output": "hi"}, "instruction", plain)
    assert masked_text(plain, ids, labels) == "user: Say hi.\nassistant: "
    assert trained_text(plain, ids, labels) == "hi<|endoftext|>\n"


@pytest.mark.parametrize(
    ("row", "fmt", "reason"),
    [
        ({"instruction": "Q"}, "instruction", "missing field 'output'"),
        ({"output": "A"}, "instruction", "missing field 'instruction'"),
        ({"instruction": "Q", "output": 3}, "instruction", "field 'output' is not a string"),
        ({"messages": [{"role": "user", "content": "Q"}]}, "chat", "no assistant message"),
        ({"messages": [{"role": "robot", "content": "Q"}]}, "chat", "not {role: system|user|assistant"),
        ({"messages": "hello"}, "chat", "missing field 'messages'"),
        ({"title": "x"}, "text", "missing field 'text'"),
        (["not", "an", "object"], "text", "not a JSON object"),
    ],
)
def test_malformed_rows_say_why(tokenizer, row, fmt, reason):
    with pytest.raises(MalformedRow, match=reason.replace("|", r"\|").replace("{", r"\{")):
        encode_row(row, fmt, tokenizer)


def test_pack_concatenates_and_pads_the_tail_block():
    rows = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [4, 5]), ([6], [-100])]
    ids, labels = pack(rows, seq_len=4, pad_id=0)
    assert ids.dtype == np.int64 and ids.shape == (2, 4)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert labels.tolist() == [[-100, 2, 3, 4], [5, -100, -100, -100]]


def test_pack_exact_fit_has_no_padding_and_rejects_ragged_rows():
    ids, labels = pack([([1, 2], [1, 2]), ([3, 4], [3, 4])], seq_len=2, pad_id=9)
    assert ids.tolist() == [[1, 2], [3, 4]] and labels.tolist() == ids.tolist()
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
    got = pack_table(part, seq_len=16, pad_id=5)
    want = pack(list(zip(rows[10:51], labels[10:51], strict=True)), seq_len=16, pad_id=5)
    assert got[0].dtype == np.int64 and got[0].shape == want[0].shape and len(got[0]) > 10
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    assert pack_table(table.slice(0, 0), seq_len=16, pad_id=5)[0].shape == (0, 16)
    ragged = pa.table({"input_ids": pa.array([[1, 2]], tokens), "labels": pa.array([[1]], tokens)})
    with pytest.raises(ValueError, match="differ in length"):
        pack_table(ragged, seq_len=2, pad_id=0)


def test_random_batch_gives_the_same_global_batch_for_any_world_size():
    common = {"seed": 3, "step": 5, "micro": 0, "seq_len": 16, "vocab_size": 100}
    whole = random_batch(rank=0, world_size=1, batch_size=8, **common)["input_ids"]
    halves = [random_batch(rank=r, world_size=2, batch_size=4, **common)["input_ids"] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), whole)
    other_step = random_batch(rank=0, world_size=1, batch_size=8, **{**common, "step": 6})["input_ids"]
    assert not torch.equal(other_step, whole)
