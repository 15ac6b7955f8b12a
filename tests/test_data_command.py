"""``raytrain-eks data``: what the model will be trained on, with no cluster, no GPU and (for small local data) no
Ray, read from the console entry as a user reads it. The built-in data, a generated Alpaca-like length mix and a
chat-like mix of many turns (some rows longer than a block): the counts add up to the rows and positions, the shown
blocks hold whole rows with the trained tokens marked. That the blocks are those ``train`` trains on is checked
against the Ray dataset in test_data_pipeline.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_json_output import run_cli

from raytrain_eks.train.data.encoding import IGNORE_INDEX

# Words of the generated rows (each a token or two of the built-in tokenizer).
WORDS = "the model reads each row whole and learns to answer from its prompt while rivers run to the sea".split()  # noqa: SIM905


def _text(rng: np.random.Generator, median: float) -> str:
    return " ".join(rng.choice(WORDS, max(1, int(rng.lognormal(np.log(median), 0.7)))))


def alpaca_like(path, rows: int = 300, seed: int = 0):
    """Instruction rows of Alpaca's shape: short instructions, sometimes an input, answers of log-normal length."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(rows):
            row = {"instruction": _text(rng, 12), "output": _text(rng, 60)}
            if rng.random() < 0.4:
                row["input"] = _text(rng, 15)
            f.write(json.dumps(row) + "\n")
    return path


def chat_like(path, rows: int = 120, seed: int = 1):
    """Conversations of 1 to 4 exchanges (a system prompt in some), long enough that some pass a block of 256."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(rows):
            messages = [{"role": "system", "content": _text(rng, 10)}] if rng.random() < 0.3 else []
            for _ in range(int(rng.integers(1, 5))):
                messages += [
                    {"role": "user", "content": _text(rng, 20)},
                    {"role": "assistant", "content": _text(rng, 45)},
                ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _check_counts(got: dict) -> None:
    assert got["rows"] == got["usable_rows"] + got["malformed_rows"] + got["dropped_rows"]
    assert got["masked_tokens"] == got["tokens"] - got["trained_tokens"]
    positions = got["blocks"] * got["seq_len"]
    assert got["padding_tokens"] == positions - (got["tokens"] - got["eval_tokens"])
    assert got["packing_efficiency"] == pytest.approx(1 - got["padding_tokens"] / positions, abs=1e-4)


def _check_block(block: dict, seq_len: int) -> None:
    ids, labels = block["input_ids"], block["labels"]
    assert len(ids) == len(labels) == seq_len
    documents = block["documents"]
    assert documents[0]["start"] == 0
    assert [d["start"] for d in documents[1:]] == [d["start"] + d["length"] for d in documents[:-1]]
    assert sum(d["length"] for d in documents) == block["filled"]
    assert all(labels[d["start"]] == IGNORE_INDEX for d in documents), "a row's first token is nobody's target"
    assert all(t == IGNORE_INDEX for t in labels[block["filled"] :]), "padding trains nothing"


@pytest.mark.parametrize("mix", ["builtin", "alpaca", "chat"])
def test_data_json_gives_the_counts_and_the_first_blocks(mix, builtin_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["data", "--json", "--show", "3"]
    if mix == "alpaca":
        args += ["--data", str(alpaca_like(tmp_path / "alpaca.jsonl")), "--seq-len", "512"]
    elif mix == "chat":
        args += ["--data", str(chat_like(tmp_path / "chat.jsonl")), "--data-format", "chat", "--seq-len", "256"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    got = json.loads(out)
    _check_counts(got)
    assert len(got["shown_blocks"]) == 3
    for block in got["shown_blocks"]:
        _check_block(block, got["seq_len"])
    # The generated mixes have a long tail past the block: those rows are counted, not cut apart.
    long_rows = got["truncated_rows"] + got["dropped_rows"]
    assert long_rows == 0 if mix == "builtin" else long_rows > 0
    assert got["packing_efficiency"] >= 0.95
    assert not (tmp_path / "runs").exists(), "looking at the data creates no run folder"


def test_data_marks_the_trained_tokens_between_brackets_when_piped(builtin_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "qa.jsonl"
    path.write_text(
        "".join(
            json.dumps({"instruction": f"Name river {i}.", "output": f"River number {i}."}) + "\n" for i in range(12)
        )
    )
    code, out, err = run_cli(["data", "--data", str(path), "--seq-len", "64", "--show", "1"], capsys)
    assert code == 0, err
    assert "12/12 rows usable" in out and "trained tokens between [[ and ]]" in out
    block = out[out.index("block 0:") :]
    answers = [part.split("]]")[0] for part in block.split("[[")[1:]]
    assert answers and all(a.startswith("River number ") for a in answers), answers
    assert all("Name river" not in a for a in answers), "the prompt is not trained"
    assert "-- row 1: positions 0-" in block


def test_data_on_random_ids_says_there_is_nothing_to_show(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["data", "--data", "random"], capsys)
    assert code != 0 and "training.data is 'random'" in err and "--data" in err
