"""Columnar and delimited data files: Parquet, CSV, TSV and Arrow files read as pyarrow tables, whose rows the data
formats read as they read JSON rows (each column a field).

:func:`read_table` reads one local file whole (the driver's path, for small data); :func:`read_dataset` reads many,
local or ``s3://``, as a Ray dataset of bounded blocks; :func:`unreadable` turns either's failure into one
:class:`DataError` that names the file.

CSV values stay text: every column is read as a string, so an answer ``42`` is ``"42"`` (not the number 42) and
``007`` keeps its zeros, as the file has them; an empty field is the empty string. TSV files are read as CSV files
are, their fields separated by a tab; a CSV file's are separated by ``training.csv_delimiter`` (a comma unless set;
the ``csv_delimiter`` arguments below). Arrow files are the Arrow IPC stream files of ``datasets``' ``save_to_disk``
and the Hub (``*.arrow``), or Arrow IPC files.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Sequence
from pathlib import PurePath
from typing import Any

from raytrain_eks.errors import DataError
from raytrain_eks.train.data.sources import DATA_SUFFIXES, root_cause

TABLE_KINDS = ("parquet", "csv", "tsv", "arrow")  # the readers of this module (JSON: .json_reader's json_rows)
DELIMITED = ("csv", "tsv")  # text files of delimited fields under a header line, read by pyarrow's CSV reader
_NAMES = {"parquet": "Parquet", "csv": "CSV", "tsv": "TSV", "arrow": "Arrow"}
# Ray Data's CSV reader names the file it failed on in the error it raises around pyarrow's.
_RAY_CSV_FILE = re.compile(r"Failed to read CSV file: (.+?)\. Please check")


def delimiter_of(kind: str, csv_delimiter: str = ",") -> str:
    """The field delimiter of a ``kind`` file: a tab in TSV files, ``csv_delimiter`` (``training.csv_delimiter``)
    in CSV files."""
    return "\t" if kind == "tsv" else csv_delimiter


def _delimited(files: Sequence[str], kind: str, csv_delimiter: str) -> tuple[Any, Any]:
    """pyarrow's parse and conversion options for reading ``files`` (``kind``: one of :data:`DELIMITED`): fields split
    on the kind's delimiter, every column of their header lines read as text."""
    delimiter = delimiter_of(kind, csv_delimiter)
    return csv_parsing(delimiter), csv_options(csv_columns(files, kind, delimiter))


def csv_hint(kind: str, delimiter: str = ",") -> str:
    """What a malformed CSV or TSV file's error suggests: how its rows are written, and the setting that names
    another delimiter."""
    named = {",": "a comma", "\t": "a tab"}.get(delimiter, repr(delimiter))
    other = " If its fields are separated by another character (';', '|'), set training.csv_delimiter to it."
    other = other if kind == "csv" else ""  # a TSV file's delimiter is always a tab
    return (
        f"Each row of a {_NAMES[kind]} file needs one field per column of its header line; a field that holds the "
        f"delimiter ({named}), a quote or a line break is written in double quotes, its own quotes doubled. Fix or "
        f"remove the row, or save the data as JSONL or Parquet.{other}"
    )


class UnreadableFile(Exception):
    """``path`` could not be read as its ``kind``, because ``why``; :func:`unreadable` says so."""

    def __init__(self, path: str, kind: str, why: str) -> None:
        self.path, self.kind, self.why = path, kind, why
        super().__init__(path, kind, why)  # its arguments, so that it pickles (Ray sends it from a read task)

    def __str__(self) -> str:
        return f"{self.path}: not a valid {_NAMES.get(self.kind, self.kind)} file: {self.why}"


def csv_columns(files: Sequence[str], kind: str = "csv", delimiter: str = ",") -> list[str]:
    """The column names of the header lines of ``files`` (local or remote; ``kind``: one of :data:`DELIMITED`, its
    fields separated by ``delimiter``), each once, in order of appearance."""
    import pyarrow.csv as pacsv

    from raytrain_eks.train.storage import filesystem

    names: dict[str, None] = {}
    for path in files:
        fs, where = filesystem(path)
        try:
            with fs.open_input_stream(where) as f:
                # the header and the first block: the names, never the rows
                reader = pacsv.open_csv(f, parse_options=csv_parsing(delimiter))
                names.update(dict.fromkeys(reader.schema.names))
        except Exception as exc:
            raise UnreadableFile(path, kind, root_cause(exc)) from exc
    return list(names)


def delimiter_hint(files: Sequence[str], kind: str, delimiter: str) -> str:
    """For CSV files whose header is one field holding another usual delimiter (``a;b``), the sentence naming it
    and the setting that reads it (its ``--set`` quoted as YAML: a bare ``|`` is YAML's block marker); else ``""``
    (the header read again: only after no row was usable)."""
    if kind != "csv":
        return ""
    names = csv_columns(files, kind, delimiter)
    found = next((d for d in (";", "|", "\t") if len(names) == 1 and d in names[0]), None)
    if found is None:
        return ""
    shown = "\\t" if found == "\t" else found
    return (
        f" The header line is one field, {names[0]!r}: its fields look separated by {found!r}; set "
        f"""training.csv_delimiter to it (--set 'training.csv_delimiter="{shown}"')."""
    )


def csv_problem(path: str, delimiter: str = ",") -> str:
    """What is wrong with the CSV or TSV file ``path`` (local or remote; fields separated by ``delimiter``): read
    again, a block at a time, up to its first problem. Ray Data's CSV reader names the file it failed on but drops
    pyarrow's reason, which this finds."""
    import pyarrow.csv as pacsv

    from raytrain_eks.train.storage import filesystem

    bad: list[Any] = []

    def note(row: Any) -> str:
        bad.append(row)
        return "error"

    parse = csv_parsing(delimiter, invalid_row_handler=note)
    read = pacsv.ReadOptions(use_threads=False)  # rows numbered as the file has them
    try:
        fs, where = filesystem(path)
        with fs.open_input_stream(where) as f:  # the header (and the first block's rows)
            names = pacsv.open_csv(f, read_options=read, parse_options=parse).schema.names
        with fs.open_input_stream(where) as f:
            options = csv_options(names)
            for _ in pacsv.open_csv(f, read_options=read, parse_options=parse, convert_options=options):
                pass
    except Exception as exc:
        if bad:
            row, s = bad[0], "" if bad[0].actual_columns == 1 else "s"
            # pyarrow counts rows, not lines (a quoted field may hold line breaks); the header is row 1
            where = f"row {row.number} (the header is row 1)" if row.number is not None else "a row"
            return f"{where} has {row.actual_columns} field{s}, the header {row.expected_columns}: {row.text[:200]!r}"
        return root_cause(exc).removeprefix("CSV parse error: ")
    return "it reads without error now (was it changed while it was read?)"


def csv_parsing(delimiter: str = ",", **options: Any) -> Any:
    """pyarrow CSV parse options for fields separated by ``delimiter``: a quoted field may hold line breaks
    (multi-line text is common in CSV datasets; without this, pyarrow cuts a large file into blocks at line breaks
    inside quotes and fails)."""
    import pyarrow.csv as pacsv

    return pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True, **options)


def csv_options(columns: Sequence[str]) -> Any:
    """pyarrow CSV conversion options that read ``columns`` as strings, an empty field as ``""`` (never null)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    return pacsv.ConvertOptions(column_types=dict.fromkeys(columns, pa.string()), strings_can_be_null=False)


def _arrow_batches(f: Any) -> Iterator[Any]:
    """The record batches of an open, seekable Arrow IPC stream or file ``f``."""
    import pyarrow as pa

    try:
        yield from pa.ipc.open_stream(f)
    except pa.ArrowInvalid:  # not a stream: the IPC file format (its footer says where the batches are)
        f.seek(0)
        reader = pa.ipc.open_file(f)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def first_table_rows(path: str, kind: str, wanted: int, csv_delimiter: str = ",") -> list[dict[str, Any]]:
    """Up to ``wanted`` rows from the start of the CSV, TSV or Arrow file ``path`` (local or remote), read a block
    at a time and only as far as they need (the sample prompts' rows), CSV values as text, as training reads them."""
    import pyarrow.csv as pacsv

    from raytrain_eks.train.storage import filesystem

    fs, where = filesystem(path)
    rows: list[dict[str, Any]] = []
    try:
        if kind in DELIMITED:
            parse, options = _delimited([path], kind, csv_delimiter)
            with fs.open_input_stream(where) as f:
                for batch in pacsv.open_csv(f, parse_options=parse, convert_options=options):
                    rows += batch.slice(0, wanted - len(rows)).to_pylist()
                    if len(rows) >= wanted:
                        break
            return rows
        with fs.open_input_file(where) as f:  # Arrow: seekable, for the IPC file format's footer
            for batch in _arrow_batches(f):
                rows += batch.slice(0, wanted - len(rows)).to_pylist()
                if len(rows) >= wanted:
                    break
        return rows
    except UnreadableFile:
        raise
    except Exception as exc:
        raise UnreadableFile(path, kind, root_cause(exc)) from exc


def read_table(path: str, kind: str, csv_delimiter: str = ",") -> Any:
    """The rows of the local file ``path`` (``kind``: one of :data:`TABLE_KINDS`), as one pyarrow table;
    :class:`UnreadableFile` when a CSV, TSV or Arrow file cannot be read (pyarrow's own error for Parquet)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if kind == "parquet":
        return pq.read_table(path)
    try:
        if kind in DELIMITED:
            parse, options = _delimited([path], kind, csv_delimiter)
            return pacsv.read_csv(path, parse_options=parse, convert_options=options)
        if kind == "arrow":
            with pa.OSFile(path) as f:
                return pa.Table.from_batches(list(_arrow_batches(f)))
    except UnreadableFile:
        raise
    except Exception as exc:
        raise UnreadableFile(path, kind, root_cause(exc)) from exc
    raise ValueError(f"no table reader for {kind!r} files")


def read_dataset(
    files: list[str], kind: str, *, label_selector: dict[str, str] | None, csv_delimiter: str = ","
) -> Any:
    """A Ray dataset of the rows of ``files`` (local or remote; ``kind``: one of :data:`TABLE_KINDS`), read by Ray
    Data's tasks (on the nodes ``label_selector`` picks, any node for ``None``) in bounded blocks."""
    import ray.data

    if kind == "parquet":
        return ray.data.read_parquet(files, **placed(ray.data.read_parquet, label_selector))
    if kind in DELIMITED:
        # Hive partitioning off: a folder named like key=value adds no column.
        parse, options = _delimited(files, kind, csv_delimiter)
        return ray.data.read_csv(
            files,
            partitioning=None,
            parse_options=parse,
            convert_options=options,
            **placed(ray.data.read_csv, label_selector),
        )
    if kind == "arrow":
        return ray.data.read_datasource(_arrow_datasource(files), **placed(ray.data.read_datasource, label_selector))
    raise ValueError(f"no table reader for {kind!r} files")


def placed(read: Any, label_selector: dict[str, str] | None) -> dict[str, Any]:
    """The keyword arguments that give Ray Data's ``read`` function the nodes its tasks run on: its own
    ``label_selector`` parameter where it has one (Ray 2.60 on, which deprecates ``ray_remote_args``), else inside
    ``ray_remote_args`` (Ray 2.58, the cluster image's, has no such parameter). Nothing for ``None``."""
    if label_selector is None:
        return {}
    if "label_selector" in inspect.signature(read).parameters:
        return {"label_selector": label_selector}
    return {"ray_remote_args": {"label_selector": label_selector}}


def _arrow_datasource(files: list[str]) -> Any:
    """A Ray Data source of the record batches of Arrow IPC stream or file files, one block each."""
    import pyarrow as pa
    from ray.data.datasource import FileBasedDatasource

    class ArrowIpcDatasource(FileBasedDatasource):
        def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> Any:
            return filesystem.open_input_file(path)  # seekable: the IPC file format is read from its footer

        def _read_stream(self, f: Any, path: str) -> Iterator[Any]:
            try:
                for batch in _arrow_batches(f):
                    yield pa.Table.from_batches([batch])
            except Exception as exc:
                raise UnreadableFile(path, "arrow", root_cause(exc)) from exc

    return ArrowIpcDatasource(files)


def unreadable(exc: BaseException, option: str, data: str, csv_delimiter: str = ",") -> DataError:
    """The :class:`DataError` for a read of ``data`` (from the setting ``option``; CSV fields separated by
    ``csv_delimiter``) that failed with ``exc``: the file and what is wrong with it where the error names them, else
    the innermost cause."""
    path: str | None = None
    kind: str | None = None
    why: str | None = None
    seen: BaseException | None = exc
    chain: list[BaseException] = []
    while seen is not None and len(chain) < 32:
        chain.append(seen)
        # Ray's task errors hold the task's own error as ``cause`` (Ray Data chains its SystemException instead)
        cause = getattr(seen, "cause", None)
        seen = cause if isinstance(cause, BaseException) else seen.__cause__
    for err in chain:
        if isinstance(err, UnreadableFile):
            path, kind, why = err.path, err.kind, err.why
            break
        if found := _RAY_CSV_FILE.search(str(err)):  # Ray Data's CSV reader reads the TSV files too
            path = found.group(1)
            kind = DATA_SUFFIXES.get(PurePath(path).suffix, "csv")
            break
    if kind in DELIMITED and path is not None:
        delimiter = delimiter_of(kind, csv_delimiter)
        problem = csv_problem(path, delimiter)
        return DataError(
            f"{option} {data!r}: {path} is not valid {_NAMES[kind]}: {problem}", hint=csv_hint(kind, delimiter)
        )
    if path is not None:
        why = f"{path} is not a valid {_NAMES.get(str(kind), kind)} file ({why})"
    return DataError(f"{option} {data!r}: cannot be read: {why or root_cause(chain[-1])}")
