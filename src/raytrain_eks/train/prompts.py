"""The prompts answered at the end of a run: given ones, or the first prompts of the training data.

A prompt is shown to the model as training showed it: for instruction and chat data, the conversation up to the
assistant's turn, rendered with the tokenizer's chat template (or the plain ``role: content`` layout without
one); for text data, the text as it is, after the BOS token its rows start with (where the tokenizer adds one on
its own). Example::

    shown, rendered = sample_prompts(None, data_files, "instruction", "text", tokenizer, count=3)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from raytrain_eks.errors import DataError
from raytrain_eks.formats import MalformedRow, renamed
from raytrain_eks.formats import data_format as registered_format
from raytrain_eks.train.data.encoding import _segments, text_start
from raytrain_eks.train.data.json_reader import json_rows
from raytrain_eks.train.storage import filesystem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_COUNT = 3
SAMPLES_FILE = "samples.jsonl"
_CHUNK_BYTES = 1 << 16  # the first data file is read this much at a time, until its first rows are in


def render(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase) -> str:
    """The conversation ``messages`` (ending before the assistant's answer) as the model reads it, answer next.

    It is the untrained text that training puts before an answer (the pieces of ``encoding._segments``), so the two
    layouts, with a chat template and without, are written once.
    """
    pieces = _segments([*messages, {"role": "assistant", "content": ""}], tokenizer)
    return "".join(text for text, trained in pieces if not trained)


def _prompt_of(
    row: dict[str, object], data_format: str, text_field: str, columns: dict[str, str] | None = None
) -> tuple[str, list[dict[str, str]] | None]:
    """(what a person reads, the messages before the first answer); messages are ``None`` for text data."""
    fmt = registered_format(data_format)
    row = dict(renamed(row, columns))
    if fmt.conversation is None:
        words = str(row.get(text_field, "")).split()
        return " ".join(words[: max(1, min(12, len(words) // 2))]), None
    messages = fmt.conversation(row).messages
    first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    before = messages[:first_answer]
    return before[-1]["content"] if before else "", before


def first_rows(files: list[str], kind: str, count: int, csv_delimiter: str = ",") -> list[dict[str, object]]:
    """Up to ``count`` rows (and a few more, for rows that turn out malformed) from the start of the first data file
    (local or ``s3://``), read as training reads it (:func:`~raytrain_eks.train.data.json_reader.json_rows`): chunk by
    chunk, a JSON array item by item, so however large the file or its first rows, only what they need is read. A CSV
    file's fields are separated by ``csv_delimiter`` (``training.csv_delimiter``), as training separates them."""
    wanted = count * 4
    fs, path = filesystem(files[0])
    if kind == "parquet":
        import pyarrow.parquet as pq

        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            return pf.read_row_group(0).slice(0, wanted).to_pylist() if pf.num_row_groups else []
    if kind in ("csv", "tsv", "arrow"):
        from raytrain_eks.train.data.tabular import first_table_rows

        return first_table_rows(files[0], kind, wanted, csv_delimiter)
    rows: list[dict[str, object]] = []
    with fs.open_input_stream(path) as f:
        for item in json_rows(iter(lambda: f.read(_CHUNK_BYTES), b"")):
            if item["error"]:  # a malformed row (one nested too deeply, too) is skipped
                continue
            try:
                row = json.loads(item["json"])
            except RecursionError:  # decoded by the reader a few frames higher up the stack
                continue
            if isinstance(row, dict):
                rows.append(row)
            if len(rows) >= wanted:
                break
    return rows


def sample_prompts(
    given: list[str] | None,
    listed: tuple[list[str], str] | None,
    data_format: str,
    text_field: str,
    tokenizer: PreTrainedTokenizerBase,
    count: int = DEFAULT_COUNT,
    columns: dict[str, str] | None = None,
    csv_delimiter: str = ",",
) -> tuple[list[str], list[str]]:
    """(prompts as a person reads them, the same prompts rendered for the model).

    ``given`` prompts are user turns for instruction and chat data and plain text for text data; without them the
    first ``count`` well-formed rows of the data give theirs (a CSV file's fields separated by ``csv_delimiter``).
    Random token ids have no prompts: ``([], [])``.
    """
    if given:
        if registered_format(data_format).conversation is None:  # plain text: the prompts as given
            return list(given), [text_start(tokenizer) + p for p in given]
        try:
            return list(given), [render([{"role": "user", "content": p}], tokenizer) for p in given]
        except MalformedRow as exc:
            raise DataError(
                f"training.sample_prompts: the chat template refuses a prompt given alone as a user turn: {exc}",
                hint="Give prompts the template accepts alone, or leave training.sample_prompts empty (the first "
                "prompts of the data are used).",
            ) from None
    if listed is None:
        return [], []
    shown, rendered = [], []
    for row in first_rows(*listed, count, csv_delimiter):
        # A row the format or the chat template refuses (Gemma 2 has no system role) is skipped here as training
        # skips it; the data's summary counts it with its reason.
        try:
            text, before = _prompt_of(row, data_format, text_field, columns)
            if not text:
                continue
            prompt = text_start(tokenizer) + text if before is None else render(before, tokenizer)
        except (MalformedRow, StopIteration):
            continue
        shown.append(text)
        rendered.append(prompt)
        if len(shown) == count:
            break
    return shown, rendered


def write_samples(run_dir: Path, shown: list[str], samples: list[dict[str, object]]) -> Path:
    """``RUN_DIR/samples.jsonl``: one ``{"prompt", "completion", "tokens"}`` line per prompt, as a person reads it."""
    path = run_dir / SAMPLES_FILE
    with path.open("w") as f:
        for text, sample in zip(shown, samples, strict=True):
            f.write(json.dumps({**sample, "prompt": text, "rendered_prompt": sample["prompt"]}) + "\n")
    return path
