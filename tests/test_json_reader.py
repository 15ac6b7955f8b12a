"""Reading JSON and JSONL in bounded chunks: ``json_rows`` on byte streams cut at
every possible place (rows, malformed lines, arrays that break off), and the Ray Data source built on it, which turns a
file larger than one chunk into several blocks (so no task holds the whole file) with every row, in order."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest

from raytrain_eks.train.data.json_reader import READ_CHUNK_BYTES, TOO_DEEP, json_datasource, json_rows

ROWS = [{"instruction": f"Q{i} é ü", "output": str(i) * (i % 7 + 1), "n": 12345} for i in range(40)]
ROWS += [7, 12.5, 1e20, -3, "s", None, True]


def chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 64, 1 << 20])
def test_rows_survive_any_cut_into_chunks(size):
    array = json.dumps(ROWS, indent=1).encode()
    got = list(json_rows(chunked(array, size)))
    assert [json.loads(r["json"]) for r in got] == ROWS and not any(r["error"] for r in got)
    lines = ("\r\n".join(json.dumps(r) for r in ROWS) + "\n{not json\n\n  \n" + json.dumps(ROWS[0])).encode()
    got = list(json_rows(chunked(lines, size)))
    assert [r["error"] for r in got] == [""] * len(ROWS) + ["the line is not valid JSON", ""]
    assert [json.loads(r["json"]) for r in got if not r["error"]] == [*ROWS, ROWS[0]]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b'[{"a": 1}, {"b":', "Expecting value"),
        (b"[1, 2", "the array is not closed"),
        (b"[1 2]", "expected ',' or ']' between items"),
        (b"[1] x", "extra data after the array"),
        (b"[1,]", "Expecting value"),
        (b"[12.x]", "expected ',' or ']' between items"),
    ],
)
def test_a_broken_array_keeps_the_items_before_the_break_and_says_why(data, why):
    for size in (1, 3, 100):
        *items, last = list(json_rows(chunked(data, size)))
        assert last == {"json": "", "error": f"the file is not valid JSON ({why})"}
        assert all(not r["error"] for r in items)
    assert list(json_rows([b"  [ ]  "])) == [] and list(json_rows([])) == []


@pytest.mark.usefixtures("starts_ray")
def test_a_file_larger_than_a_chunk_is_read_as_several_blocks(tmp_path, ray_local):
    import ray.data

    path = tmp_path / "big.jsonl"
    rows = [{"text": f"{i} " + "x" * 500} for i in range(int(2.5 * READ_CHUNK_BYTES / 500))]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dataset = ray.data.read_datasource(json_datasource([str(path)])).materialize()
    assert dataset.num_blocks() >= 3
    got = [json.loads(r["json"]) for r in dataset.iter_rows()]
    assert got == rows


HOSTILE = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON decoder recurses


@pytest.mark.parametrize("size", [7, 4096, 1 << 20])
def test_one_row_nested_too_deeply_is_one_malformed_row_and_the_others_are_kept(size):
    good = [{"instruction": f"Q{i}", "output": f'A{i} ] [ {{ \\ " end'} for i in range(50)]  # brackets in strings
    lines = [json.dumps(r) for r in good[:20]] + [HOSTILE] + [json.dumps(r) for r in good[20:]]
    got = list(json_rows(chunked("\n".join(lines).encode(), size)))
    assert len(got) == 51 and got[20] == {"json": "", "error": TOO_DEEP}
    assert [json.loads(r["json"]) for r in got if not r["error"]] == good
    # The same inside a JSON array: the item is skipped by its brackets, the items after it are read.
    array = "[" + ", ".join([*lines[:20], HOSTILE, '{"s": "[[[", "t": "\\\\"}', *lines[21:]]) + "]"
    got = list(json_rows(chunked(array.encode(), size)))
    assert len(got) == 52 and got[20] == {"json": "", "error": TOO_DEEP}
    assert json.loads(got[21]["json"]) == {"s": "[[[", "t": "\\"}
    assert [json.loads(r["json"]) for r in got if not r["error"]][20:] == [{"s": "[[[", "t": "\\"}, *good[20:]]


def test_sample_prompts_come_from_the_first_rows_of_a_large_file(tmp_path, tokenizer):
    # The sample prompts read the first data file as training does: a JSON array of 480 KB, and JSON lines whose
    # first row alone is 300 KB, give their first rows' prompts.
    from raytrain_eks.train.prompts import sample_prompts

    rows = [{"instruction": f"Question {i}?", "output": f"Answer {i}. " + "word " * 30} for i in range(2500)]
    array = tmp_path / "big.json"
    array.write_text(json.dumps(rows))
    assert array.stat().st_size > 256 << 10
    shown, rendered = sample_prompts(None, ([str(array)], "json"), "instruction", "text", tokenizer, count=3)
    assert shown == ["Question 0?", "Question 1?", "Question 2?"]
    assert rendered[0] == "<|im_start|>user\nQuestion 0?<|im_end|>\n<|im_start|>assistant\n"
    lines = tmp_path / "long-first-row.jsonl"
    long_row = {"instruction": "Summarise this.", "input": "word " * 60_000, "output": "Words."}
    lines.write_text("\n".join(json.dumps(r) for r in [long_row, *rows[:2]]) + "\n")
    shown, _ = sample_prompts(None, ([str(lines)], "json"), "instruction", "text", tokenizer, count=2)
    assert shown == [f"Summarise this.\n\n{long_row['input']}", "Question 0?"]


def test_a_row_the_reader_decodes_but_a_deeper_stack_cannot_is_one_malformed_row(builtin_model):
    # A row 950 brackets deep decodes where the reader runs, but the tokenize step decodes it again deeper in its
    # stack (under Ray's task frames): there the decoder's RecursionError costs that row only, counted as too deep.
    import inspect
    import sys

    from raytrain_eks.train.data.encoding import encoding_tokenizer
    from raytrain_eks.train.data.json_reader import rows_block
    from raytrain_eks.train.data.pipeline import _encode_batch

    deep = '{"instruction": "Q", "output": "A", "extra": ' + "[" * 950 + "]" * 950 + "}"
    good = json.dumps({"instruction": "What is 2 plus 3?", "output": "5."})

    @contextlib.contextmanager
    def frames_left(n: int) -> Iterator[None]:
        """Python's recursion limit ``n`` frames above this one, whatever runs the test (pytest, xdist's worker)."""
        before = sys.getrecursionlimit()
        sys.setrecursionlimit(len(inspect.stack()) + n)
        try:
            yield
        finally:
            sys.setrecursionlimit(before)

    with frames_left(1000):  # the reader's stack: the thousand levels Python allows, less what called it
        rows = list(json_rows([f"{good}\n{deep}\n".encode()]))
    assert [r["error"] for r in rows] == ["", ""], "the reader passes both rows"
    encoding_tokenizer(builtin_model)  # loaded before the stack is cut short
    with frames_left(600):  # 600 frames left: a task's stack, Ray's frames above it
        out = _encode_batch(
            rows_block(rows), tokenizer_path=builtin_model, data_format="instruction", text_field="text"
        )
    assert out.column("reason").to_pylist() == ["", TOO_DEEP]
    assert out.column("tokens").to_pylist()[0] > 0 and out.column("tokens").to_pylist()[1] == 0
