"""Data stored as CSV, TSV, Arrow or NDJSON (a Hugging Face dataset's split, a file, a folder) becomes the rows the
data formats read, its CSV and TSV values as text, a CSV file's fields split at ``training.csv_delimiter``; a
malformed CSV or TSV file is one error that names it; and ``hf:OWNER/NAME`` is read from the Hugging Face cache when
the Hub cannot be reached. The tests that pack rows start Ray (the packing needs it); the others stop before it."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from ray.util.annotations import RayDeprecationWarning

from raytrain_eks.config import load_config
from raytrain_eks.errors import DataError
from raytrain_eks.train.data.encoding import IGNORE_INDEX
from raytrain_eks.train.data.pipeline import DataSettings, prepare_dataset
from raytrain_eks.train.data.sources import list_data_files

QUESTIONS = ["What is 6 times 7?", "Pad 7 to three digits.", "Is water wet?", "Name two primes, comma-separated."]
ANSWERS = ["42", "007", "true", "2, 3"]  # pyarrow would read the first three as 42, 7 and True
CONTEXTS = ["", "", "Answer in one word.", 'Say "two" and "three"\nas digits.']
COLUMNS = {"instruction": "question", "input": "context", "output": "answer"}


def csv_text(rows: list[tuple[str, str, str]], delimiter: str = ",") -> str:
    """A CSV file of (question, context, answer) rows, quoted as a spreadsheet writes them: a field in quotes where
    it holds the ``delimiter``, a quote or a line break (a tab for a TSV file, ';' for a semicolon-separated one)."""

    def field(value: str) -> str:
        return f'"{value.replace(chr(34), chr(34) * 2)}"' if any(c in value for c in delimiter + '"\n') else value

    lines = [delimiter.join(("question", "context", "answer"))] + [delimiter.join(map(field, row)) for row in rows]
    return "\n".join(lines) + "\n"


ROWS = list(zip(QUESTIONS, CONTEXTS, ANSWERS, strict=True))


def prep(data: str, builtin_model: str, *, where: str, **kw):
    return prepare_dataset(
        DataSettings(
            data_format="instruction",
            text_field="text",
            tokenizer_path=builtin_model,
            seq_len=64,
            seed=0,
            columns=kw.get("columns", COLUMNS),
            csv_delimiter=kw.get("csv_delimiter", ","),
        ),
        data=data,
        min_blocks=1,
        in_driver=where == "driver",
    )


def trained_texts(tokenizer, prepared) -> str:
    """The text of every trained token of the packed blocks."""
    rows = prepared.dataset.take_all()
    labels = np.concatenate([r["labels"] for r in rows])
    return tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())


def blocks(prepared) -> np.ndarray:
    rows = prepared.dataset.take_all()
    return np.array([np.concatenate([r["input_ids"], r["labels"], r["position_ids"]]) for r in rows])


def test_csv_and_arrow_data_is_trained_with_csv_values_as_text(
    tmp_path, ray_local, builtin_model, tokenizer, monkeypatch
):
    import datasets

    # A dataset folder in the Hub's layout, its splits stored as CSV, named relative to the working folder.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sums" / "data").mkdir(parents=True)
    (tmp_path / "sums" / "data" / "train-00000-of-00001.csv").write_text(csv_text(ROWS * 3))
    (tmp_path / "sums" / "data" / "test-00000-of-00001.csv").write_text(csv_text(ROWS[:1]))
    (tmp_path / "sums" / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Sums\n")
    train = str(tmp_path / "sums" / "data" / "train-00000-of-00001.csv")
    assert list_data_files("hf:./sums") == ([train], "csv")
    assert list_data_files("hf:./sums:test")[1] == "csv"

    driver = prep("hf:./sums", builtin_model, where="driver")
    ray_data = prep("hf:./sums", builtin_model, where="ray")
    for prepared in (driver, ray_data):
        # Every row is usable: no answer became a number (the instruction format refuses those as not strings).
        assert (prepared.rows, prepared.usable_rows, prepared.malformed) == (12, 12, {})
        trained = trained_texts(tokenizer, prepared)
        assert all(answer in trained for answer in ANSWERS), trained
    np.testing.assert_array_equal(blocks(driver), blocks(ray_data))

    # A plain CSV file, and a folder of them, are read the same way.
    (tmp_path / "mine").mkdir()
    for i in range(2):
        (tmp_path / "mine" / f"part-{i}.csv").write_text(csv_text(ROWS))
    one = prep(str(tmp_path / "mine" / "part-0.csv"), builtin_model, where="driver")
    assert (one.rows, one.usable_rows) == (4, 4)
    both = prep(str(tmp_path / "mine"), builtin_model, where="driver")
    assert (both.rows, both.usable_rows) == (8, 8)

    # A malformed row past the first block (all the driver reads of a file before Ray Data's tasks read it): Ray
    # Data's read fails, the error names the file and the row, counted as pyarrow counts them (the fourth row of
    # ROWS holds a line break).
    big = tmp_path / "big.csv"
    big.write_text(csv_text(ROWS * 9000) + "one,two,three,four\n")  # 1.5 MiB: pyarrow's first block is 1 MiB
    with pytest.raises(DataError) as info:
        prep(str(big), builtin_model, where="ray")
    assert info.value.message == (
        f"--data {str(big)!r}: {big} is not valid CSV: row 36002 (the header is row 1) has 4 fields, the header 3: "
        "'one,two,three,four'"
    )

    # What the datasets library's save_to_disk writes: Arrow stream files beside its metadata.
    saved = tmp_path / "saved"
    columns = {"question": QUESTIONS, "context": CONTEXTS, "answer": ANSWERS}
    datasets.Dataset.from_dict(columns).save_to_disk(str(saved), num_shards=2)
    arrows = sorted(str(p) for p in saved.glob("*.arrow"))
    assert list_data_files(str(saved)) == (arrows, "arrow") == list_data_files(f"hf:{saved}")
    for where in ("driver", "ray"):
        prepared = prep(str(saved), builtin_model, where=where)
        assert (prepared.rows, prepared.usable_rows) == (4, 4)


def test_csv_values_stay_as_the_file_writes_them(tmp_path):
    from raytrain_eks.train.data.tabular import read_table

    path = tmp_path / "values.csv"
    path.write_text(csv_text(ROWS) + "3.50,,\n")
    table = read_table(str(path), "csv")
    assert {f.type for f in table.schema} == {pa.string()}
    assert table.column("answer").to_pylist() == [*ANSWERS, ""]
    assert table.column("question").to_pylist()[-1] == "3.50"
    assert table.column("context").to_pylist() == [*CONTEXTS, ""]  # an empty field is "", never missing


def test_csv_and_arrow_data_give_the_run_its_sample_prompts(tmp_path, tokenizer):
    # The run's samples are answers to the data's first prompts: a CSV or Arrow file gives them as JSON lines do.
    from raytrain_eks.train.prompts import sample_prompts

    path = tmp_path / "sums.csv"
    path.write_text(csv_text(ROWS))
    shown, rendered = sample_prompts(None, ([str(path)], "csv"), "instruction", "text", tokenizer, 3, COLUMNS)
    assert shown == [QUESTIONS[0], QUESTIONS[1], f"{QUESTIONS[2]}\n\n{CONTEXTS[2]}"]  # instruction, then input
    assert rendered[0].startswith("<|im_start|>user\n" + QUESTIONS[0])
    table = pa.table({"question": QUESTIONS, "context": CONTEXTS, "answer": ANSWERS})
    arrow = tmp_path / "sums.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    from_arrow, _ = sample_prompts(None, ([str(arrow)], "arrow"), "instruction", "text", tokenizer, 3, COLUMNS)
    assert from_arrow == shown


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a,b\n1,2\n1,2,3\n", "row 3 (the header is row 1) has 3 fields, the header 2: '1,2,3'"),
        ('a,b\n1,2\n"open quote,3\n', "row 3 (the header is row 1) has 1 field, the header 2: '\"open quote,3'"),
        (b"a,b\n1,2\n\xff\xfe,3\n", "CSV conversion error to string: invalid UTF8 data"),
    ],
    ids=["too-many-fields", "unclosed-quote", "not-utf8"],
)
def test_a_malformed_csv_is_one_error_naming_the_file(tmp_path, builtin_model, text, problem):
    # The driver's read fails before anything else starts: no Ray here.
    path = tmp_path / "bad.csv"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DataError) as info:
        prep(str(path), builtin_model, where="driver", columns=None)
    assert info.value.message.startswith(f"--data {str(path)!r}: {path} is not valid CSV: ")
    assert problem in info.value.message
    assert "one field per column of its header line" in info.value.hint


def test_data_files_of_each_kind_are_listed_and_mixed_folders_refused(tmp_path):
    (tmp_path / "rows.csv").write_text(csv_text(ROWS))
    assert list_data_files(str(tmp_path / "rows.csv")) == ([str(tmp_path / "rows.csv")], "csv")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"question": "Q", "answer": "A"}) + "\n")
    with pytest.raises(DataError, match="the folder mixes CSV and JSON files; keep one kind per folder"):
        list_data_files(str(tmp_path))
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.txt'; use \.jsonl, \.ndjson, \.json, \.parquet, "):
        list_data_files(str(tmp_path / "notes.txt"))
    (tmp_path / "ds" / "data").mkdir(parents=True)
    (tmp_path / "ds" / "data" / "train.txt").write_text("hello\n")
    with pytest.raises(DataError, match="stored as .txt; Parquet, JSON, JSONL, NDJSON, CSV, TSV and Arrow datasets"):
        list_data_files(f"hf:{tmp_path / 'ds'}")


def test_ndjson_data_is_read_and_trained_as_the_same_jsonl(tmp_path, ray_local, builtin_model, tokenizer, monkeypatch):
    # Newline-delimited JSON is JSON lines under another name: a file, a folder and a dataset folder in the Hub's
    # layout are listed as JSON, pack into the blocks the same .jsonl file packs into (both ways), and give the
    # same sample prompts.
    from raytrain_eks.train.prompts import sample_prompts

    lines = "".join(json.dumps(dict(zip(("question", "context", "answer"), row, strict=True))) + "\n" for row in ROWS)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(lines * 3)
    (tmp_path / "nd" / "data").mkdir(parents=True)
    ndjson = tmp_path / "nd" / "data" / "train.ndjson"
    ndjson.write_text(lines * 3)
    assert list_data_files(str(ndjson)) == ([str(ndjson)], "json") == list_data_files(str(tmp_path / "nd"))
    monkeypatch.chdir(tmp_path)
    assert list_data_files("hf:./nd") == ([str(ndjson)], "json")
    expected = blocks(prep(str(jsonl), builtin_model, where="driver"))  # the same on both paths (test_data_pipeline)
    for where in ("driver", "ray"):
        prepared = prep(str(ndjson), builtin_model, where=where)
        assert (prepared.rows, prepared.usable_rows) == (12, 12)
        np.testing.assert_array_equal(blocks(prepared), expected)
    prompts = [
        sample_prompts(None, list_data_files(str(p)), "instruction", "text", tokenizer, 3, COLUMNS)
        for p in (jsonl, ndjson)
    ]
    assert prompts[1] == prompts[0] and prompts[1][0][0] == QUESTIONS[0]


def test_tsv_reads_to_the_rows_of_the_same_csv(tmp_path, builtin_model, tokenizer, monkeypatch):
    # A TSV file is a CSV file with a tab between the fields: its values are text, a quoted field holds line breaks
    # (the fourth row's context), and a comma is just a character (the fourth row's answer, not quoted here).
    from raytrain_eks.train.data.tabular import read_table
    from raytrain_eks.train.prompts import sample_prompts

    csv, tsv = tmp_path / "rows.csv", tmp_path / "rows.tsv"
    csv.write_text(csv_text(ROWS))
    tsv.write_text(csv_text(ROWS, "\t"))
    assert "\t2, 3\n" in tsv.read_text() and "\t" not in csv.read_text()
    assert list_data_files(str(tsv)) == ([str(tsv)], "tsv")
    rows = [dict(zip(("question", "context", "answer"), row, strict=True)) for row in ROWS]
    assert read_table(str(tsv), "tsv").to_pylist() == read_table(str(csv), "csv").to_pylist() == rows
    shown = sample_prompts(None, ([str(tsv)], "tsv"), "instruction", "text", tokenizer, 3, COLUMNS)
    assert shown == sample_prompts(None, ([str(csv)], "csv"), "instruction", "text", tokenizer, 3, COLUMNS)
    # The two kinds split their rows differently: a folder of both is refused, not read with one delimiter.
    with pytest.raises(DataError, match="the folder mixes CSV and TSV files; keep one kind per folder"):
        list_data_files(str(tmp_path))
    # A dataset folder in the Hub's layout whose split is stored as TSV.
    (tmp_path / "sums" / "data").mkdir(parents=True)
    tsv.rename(tmp_path / "sums" / "data" / "train.tsv")
    monkeypatch.chdir(tmp_path)
    assert list_data_files("hf:./sums") == ([str(tmp_path / "sums" / "data" / "train.tsv")], "tsv")
    # A malformed row is one error that names the file, the row and a tab as the delimiter.
    bad = tmp_path / "bad.tsv"
    bad.write_text("a\tb\n1\t2\n1\t2\t3\n")
    with pytest.raises(DataError) as info:
        prep(str(bad), builtin_model, where="driver", columns=None)
    assert info.value.message == (
        f"--data {str(bad)!r}: {bad} is not valid TSV: row 3 (the header is row 1) has 3 fields, the header 2: "
        "'1\\t2\\t3'"
    )
    assert "the delimiter (a tab)" in info.value.hint and "csv_delimiter" not in info.value.hint


def test_csv_delimiter_reads_a_semicolon_separated_file(tmp_path, builtin_model, tokenizer):
    # Spreadsheets set to a language that writes decimal commas export CSV files separated by semicolons.
    from raytrain_eks.train.data.tabular import read_table
    from raytrain_eks.train.prompts import sample_prompts

    comma, semi = tmp_path / "comma.csv", tmp_path / "semi.csv"
    comma.write_text(csv_text(ROWS))
    semi.write_text(csv_text(ROWS, ";"))
    assert read_table(str(semi), "csv", csv_delimiter=";").to_pylist() == read_table(str(comma), "csv").to_pylist()
    shown = sample_prompts(None, ([str(semi)], "csv"), "instruction", "text", tokenizer, 3, COLUMNS, csv_delimiter=";")
    assert shown == sample_prompts(None, ([str(comma)], "csv"), "instruction", "text", tokenizer, 3, COLUMNS)
    # Read with the default comma, the header is one column and the fourth row (commas in its question) two
    # fields: the error names that row, and the hint the setting.
    with pytest.raises(DataError) as info:
        prep(str(semi), builtin_model, where="driver")
    fourth = semi.read_text().splitlines()[4]  # up to the line break inside its quoted context
    assert fourth.startswith("Name two primes, comma-separated.;")
    assert info.value.message == (
        f"--data {str(semi)!r}: {semi} is not valid CSV: row 5 (the header is row 1) has 2 fields, the header 1: "
        f"{fourth!r}"
    )
    assert "set training.csv_delimiter to it" in info.value.hint
    # With it, a malformed row is found and shown as the file splits its fields.
    bad = tmp_path / "bad.csv"
    bad.write_text("a;b\n1,5;2\n1;2;3\n")
    with pytest.raises(DataError) as info:
        prep(str(bad), builtin_model, where="driver", columns=None, csv_delimiter=";")
    assert info.value.message.endswith(
        f"{bad} is not valid CSV: row 3 (the header is row 1) has 3 fields, the header 2: '1;2;3'"
    )
    assert "the delimiter (';')" in info.value.hint
    # Without a comma in any row, every row is one field under the whole header line: no row has the mapped columns.
    plain = tmp_path / "plain.csv"
    plain.write_text(csv_text(ROWS[:3], ";"))
    with pytest.raises(
        DataError, match="no usable row for format 'instruction' \\(3 rows read: 3 x missing field"
    ) as info:
        prep(str(plain), builtin_model, where="driver")
    # ... and the hint names the delimiter the header line holds, and the setting that reads it.
    header = plain.read_text().splitlines()[0]
    assert f"The header line is one field, {header!r}: its fields look separated by ';'" in info.value.hint
    assert """--set 'training.csv_delimiter=";"'""" in info.value.hint
    # The --set the hint gives reads as that delimiter, a tab and '|' (YAML's block marker when bare) too.
    for delimiter in ("|", "\t"):
        (tmp_path / "other.csv").write_text(csv_text(ROWS[:3], delimiter))
        with pytest.raises(DataError) as info:
            prep(str(tmp_path / "other.csv"), builtin_model, where="driver")
        given = re.search(r"--set '([^']+)'", info.value.hint).group(1)
        assert load_config(environ={}, path=None, sets=[given]).training.csv_delimiter == delimiter
    assert "header line is one field" not in _no_usable_hint(tmp_path, builtin_model)  # a plain missing field


def _no_usable_hint(tmp_path, builtin_model) -> str:
    """The hint for a comma-separated file whose columns are not the format's."""
    other = tmp_path / "other.csv"
    other.write_text("question,answer\nWhat is 2 plus 2?,4\n")
    with pytest.raises(DataError) as info:
        prep(str(other), builtin_model, where="driver", columns=None)
    return info.value.hint


def test_csv_delimiter_and_tsv_reach_ray_datas_reads(tmp_path, ray_local, builtin_model):
    # Large or remote data is read by Ray Data's tasks: TSV files and the configured delimiter reach them and give
    # the blocks the driver packs, and a bad row of a TSV file past the first block names the file and row as the
    # driver does.
    csv, tsv, semi = tmp_path / "rows.csv", tmp_path / "rows.tsv", tmp_path / "semi.csv"
    csv.write_text(csv_text(ROWS * 3))
    tsv.write_text(csv_text(ROWS * 3, "\t"))
    semi.write_text(csv_text(ROWS * 3, ";"))
    expected = blocks(prep(str(csv), builtin_model, where="driver"))
    with warnings.catch_warnings(record=True) as said:  # the reads stay on this node through Ray's current API
        warnings.simplefilter("always")
        np.testing.assert_array_equal(blocks(prep(str(tsv), builtin_model, where="ray")), expected)
    assert not [w for w in said if issubclass(w.category, RayDeprecationWarning)], [str(w.message) for w in said]
    np.testing.assert_array_equal(blocks(prep(str(semi), builtin_model, where="ray", csv_delimiter=";")), expected)
    big = tmp_path / "big.tsv"
    big.write_text(csv_text(ROWS * 9000, "\t") + "a\tb\tc\td\n")  # 1.5 MiB: pyarrow's first block is 1 MiB
    with pytest.raises(DataError) as info:  # the setting is the CSV files'; a TSV file's delimiter stays a tab
        prep(str(big), builtin_model, where="ray", csv_delimiter=";")
    assert info.value.message == (
        f"--data {str(big)!r}: {big} is not valid TSV: row 36002 (the header is row 1) has 4 fields, the header 3: "
        "'a\\tb\\tc\\td'"
    )


def test_reads_are_placed_through_the_parameter_each_ray_version_has():
    """Ray 2.60 reads take ``label_selector`` and deprecate ``ray_remote_args``; Ray 2.58 (the cluster image's) has
    only ``ray_remote_args``, whose ``label_selector`` its reads honour (ray 2.58.0 wheel, ray/data/read_api.py:
    ``_resolve_ray_remote_args`` pins local reads the same way)."""
    import ray.data

    from raytrain_eks.train.data.tabular import placed

    here = {"ray.io/node-id": "ab" * 28}
    assert placed(ray.data.read_csv, here) == {"label_selector": here}  # this suite's Ray (2.60)

    def read_csv_of_ray_2_58(paths, *, filesystem=None, parallelism=-1, ray_remote_args=None, **arrow_csv_args):
        """The keyword parameters Ray 2.58.0's ``read_csv`` has around the one that places its tasks."""

    assert placed(read_csv_of_ray_2_58, here) == {"ray_remote_args": {"label_selector": here}}
    assert placed(ray.data.read_csv, None) == placed(read_csv_of_ray_2_58, None) == {}  # remote data: any node


# -- hf:OWNER/NAME when the Hub cannot be reached -------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_dataset(cache: Path, repo: str) -> Path:
    """A dataset in the Hugging Face cache's layout, as an earlier ``snapshot_download`` left it:
    ``datasets--OWNER--NAME/refs/main`` naming a commit, the files under ``snapshots/<commit>/``."""
    repo_dir = cache / f"datasets--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    (snapshot / "data").mkdir(parents=True)
    for split in ("train", "test"):
        (snapshot / "data" / f"{split}.jsonl").write_text(json.dumps({"question": "Q", "answer": "A"}) + "\n")
    (snapshot / "README.md").write_text("---\nlicense: apache-2.0\n---\n# A cached dataset\n")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return snapshot


def closed_port() -> int:
    """A loopback port nothing listens on (taken from the system, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _BranchGone(BaseHTTPRequestHandler):
    """A Hub that answers every request: this revision does not exist (after the dataset's branch was deleted)."""

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RevisionNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Revision Not Found"}')

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(params=["unreachable", "refusing"])
def hub(request):
    """The Hub's address: nothing listening there, or a server that refuses every request with an error that
    huggingface_hub itself does not answer from the cache (so only the project's own fallback reads the cache)."""
    if request.param == "unreachable":
        yield f"http://127.0.0.1:{closed_port()}"
        return
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BranchGone)
    server.block_on_close = False  # a client's kept-alive connection does not hold the teardown
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_hf_dataset_is_read_from_the_cache_when_the_hub_does_not_serve_it(tmp_path, monkeypatch, hub):
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hub"
    snapshot = cached_dataset(cache, "acme/sums")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", hub)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    # huggingface_hub reads these variables once, when it is imported (before this test set them), into its
    # constants, which snapshot_download reads at each call: they are set there too.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub)
    monkeypatch.setattr(hf_constants, "HF_HUB_ETAG_TIMEOUT", 2)

    start = time.monotonic()
    assert list_data_files("hf:acme/sums") == ([str(snapshot / "data" / "train.jsonl")], "json")
    assert list_data_files("hf:acme/sums:test") == ([str(snapshot / "data" / "test.jsonl")], "json")
    with pytest.raises(DataError) as info:
        list_data_files("hf:acme/missing")
    assert "dataset 'acme/missing' is neither reachable on the Hub nor in the Hugging Face cache" in str(info.value)
    assert "HF_HOME" in info.value.hint
    assert time.monotonic() - start < 20  # no retries against the Hub that is not there
