"""The Ray Data pipeline on hand-made files: reading JSONL/JSON/Parquet, counting malformed rows, packing, and
the errors a user gets for unusable data before any worker starts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_eks.errors import DataError
from raytrain_eks.train.data import IGNORE_INDEX, prepare_dataset

pytestmark = pytest.mark.integration


def prep(path, builtin_model, fmt="instruction", seq_len=32, min_blocks=1, **kw):
    return prepare_dataset(
        data=str(path),
        data_format=fmt,
        text_field=kw.get("text_field", "text"),
        tokenizer_path=builtin_model,
        seq_len=seq_len,
        seed=0,
        min_blocks=min_blocks,
    )


def test_jsonl_with_malformed_rows_is_counted_and_packed(tmp_path, ray_local, builtin_model, tokenizer):
    good = [{"instruction": f"What is {i} plus 1?", "output": f"{i + 1}."} for i in range(5)]
    lines = [json.dumps(r) for r in good] + [
        json.dumps({"instruction": "no answer"}),
        json.dumps({"instruction": "Q", "output": 7}),
        "{not json",
        "",
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    prepared = prep(path, builtin_model)
    assert (prepared.rows, prepared.usable_rows) == (8, 5)
    assert prepared.malformed == {
        "missing field 'output'": 1,
        "field 'output' is not a string": 1,
        "the line is not valid JSON": 1,
    }
    assert "3 malformed rows" in prepared.describe(str(path), 32)
    rows = prepared.dataset.take_all()
    assert len(rows) == prepared.blocks
    assert all(len(r["input_ids"]) == 32 for r in rows)
    # Every trained label is one of the answers' tokens: prompts are masked through the whole pipeline.
    trained = [int(t) for r in rows for t in r["labels"] if t != IGNORE_INDEX]
    assert len(trained) == prepared.trained_tokens
    text = tokenizer.decode(trained)
    for i in range(5):
        assert f"{i + 1}." in text
    assert "plus" not in text


def test_json_array_folder_and_chat_format(tmp_path, ray_local, builtin_model):
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
    ]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.json").write_text(json.dumps(rows))
    (tmp_path / "data" / "b.jsonl").write_text(json.dumps(rows[0]) + "\n")
    prepared = prep(tmp_path / "data", builtin_model, fmt="chat")
    assert (prepared.rows, prepared.usable_rows) == (3, 2)
    assert prepared.malformed == {"no assistant message to learn from": 1}


def test_parquet_text_format(tmp_path, ray_local, builtin_model):
    table = pa.table({"body": ["the river runs to the sea"] * 6 + [None]})
    pq.write_table(table, tmp_path / "t.parquet")
    prepared = prep(tmp_path / "t.parquet", builtin_model, fmt="text", text_field="body", seq_len=16)
    assert (prepared.rows, prepared.usable_rows) == (7, 6)
    assert prepared.trained_tokens == prepared.tokens  # text trains on every token


def test_no_usable_row_is_a_clear_error(tmp_path, ray_local, builtin_model):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"instruction": "Q", "output": "A"}) + "\n")
    with pytest.raises(DataError) as info:
        prep(path, builtin_model, fmt="chat")
    assert "no usable row for format 'chat' (1 rows read: 1 x missing field 'messages'" in str(info.value)
    assert "--data-format" in info.value.hint


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing.jsonl", "no such file or folder"),
        (lambda p: (p / "x.csv").write_text("a,b\n") and p / "x.csv", "unsupported file type '.csv'"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "has no .jsonl, .json or .parquet file"),
    ],
)
def test_bad_paths(tmp_path, ray_local, builtin_model, make, message):
    with pytest.raises(DataError, match=message):
        prep(make(tmp_path), builtin_model)


def test_too_little_data_for_one_step(tmp_path, ray_local, builtin_model):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"instruction": "Q", "output": "A"}) + "\n")
    with pytest.raises(DataError, match=r"pack into 1 blocks of 32 tokens, but one step needs 16"):
        prep(path, builtin_model, min_blocks=16)
