"""Reading JSON and JSONL training files in bounded chunks: :func:`json_rows` turns a stream of byte chunks into
rows (each kept as its JSON text, with why it cannot be used), never holding the whole file; :func:`json_datasource`
is the Ray Data source built on it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def json_rows(chunks: Iterable[bytes]) -> Iterator[dict[str, str]]:
    """The rows of one JSON or JSONL file given as a stream of byte chunks, each kept as a JSON string (so rows of
    any shape fit one column), with ``error`` saying why a row cannot be used.

    A file whose first character is ``[`` is one JSON array, read item by item; any other file is JSON lines.
    Only the current chunk and the row being read are held, never the whole file. An array that breaks off yields
    the items before the break, then one row with the error.

    >>> list(json_rows([b'{"a": 1}\\n{no', b't json\\n']))
    [{'json': '{"a": 1}', 'error': ''}, {'json': '', 'error': 'the line is not valid JSON'}]
    """
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    texts = (decoder.decode(c) for c in chunks)
    buf = ""
    for text in texts:
        buf += text
        if buf.strip():
            break
    if buf.lstrip().startswith("["):
        yield from _array_items(buf[buf.index("[") + 1 :], texts)
        return
    while True:
        *lines, buf = buf.split("\n")
        for line in lines:
            if line.strip():
                yield _json_line(line)
        chunk = next(texts, None)
        if chunk is None:
            break
        buf += chunk
    buf += decoder.decode(b"", final=True)
    if buf.strip():
        yield _json_line(buf)


# A row nested more deeply than Python's JSON decoder recurses (about a thousand levels) is one malformed row.
TOO_DEEP = "the row is nested too deeply to decode (over about a thousand levels of brackets)"


def _json_line(line: str) -> dict[str, str]:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return {"json": "", "error": "the line is not valid JSON"}
    except RecursionError:
        return {"json": "", "error": TOO_DEEP}
    return {"json": line.rstrip("\r"), "error": ""}


class _ValueEnd:
    """Finds where a bracketed JSON value ends without recursion, in text that arrives piece by piece: strings
    (and their escapes) are skipped, brackets counted. ``scan(buf, start)`` goes on from where it stopped; it
    returns the end's index in ``buf``, or ``None`` when ``buf`` ends first."""

    def __init__(self) -> None:
        self.done, self.depth, self.in_string, self.escaped = 0, 0, False, False

    def scan(self, buf: str, start: int) -> int | None:
        i = start + self.done
        while i < len(buf):
            c = buf[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "[{":
                self.depth += 1
            elif c in "]}":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            i += 1
        self.done = i - start
        return None


def _array_items(buf: str, texts: Iterator[str]) -> Iterator[dict[str, str]]:
    """The items of a JSON array whose ``[`` has been read; ``buf`` holds what follows it, ``texts`` the rest."""
    decoder = json.JSONDecoder()
    pos, first, ended = 0, True, False

    def more() -> bool:
        nonlocal buf, pos
        text = next(texts, None)
        if text is None:
            return False
        buf, pos = buf[pos:] + text, 0
        return True

    def skip_space() -> bool:  # False at the end of the file
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos].isspace():
                pos += 1
            if pos < len(buf) or not more():
                return pos < len(buf)

    def broken(why: str) -> dict[str, str]:
        return {"json": "", "error": f"the file is not valid JSON ({why})"}

    while True:
        if not skip_space():
            yield broken("the array is not closed")
            return
        if buf[pos] == "]":
            pos += 1
            break
        if not first:
            if buf[pos] != ",":
                yield broken("expected ',' or ']' between items")
                return
            pos += 1
            if not skip_space():
                yield broken("the array is not closed")
                return
        first = False
        deep = False
        while True:
            try:
                item, end = decoder.raw_decode(buf, pos)
                # A number at the end of what has been read ("12", "12.", "1e+") may go on in the next chunk.
                number = isinstance(item, (int, float)) and not isinstance(item, bool)
                if ended or not number or len(buf) - end > 2 or buf[end:].strip(".eE+-"):
                    break
            except json.JSONDecodeError as exc:
                if not ended and more():
                    continue
                yield broken(exc.msg)
                return
            except RecursionError:
                deep = True  # skipped by its brackets, counted as one malformed row
                scanner = _ValueEnd()
                while (found := scanner.scan(buf, pos)) is None:
                    if not more():
                        yield broken("the array is not closed")
                        return
                end = found
                break
            if not more():
                ended = True
        yield {"json": "", "error": TOO_DEEP} if deep else {"json": buf[pos:end], "error": ""}
        pos = end
    if skip_space():
        yield broken("extra data after the array")


READ_CHUNK_BYTES = 4 << 20  # bytes of a JSON/JSONL file read at once, and about the text of one block of rows


def rows_block(rows: list[dict[str, str]]) -> Any:
    import pyarrow as pa

    return pa.table({"json": [r["json"] for r in rows], "error": [r["error"] for r in rows]})


def json_datasource(files: list[str]) -> Any:
    """A Ray Data source of JSON/JSONL rows (columns ``json`` and ``error``) read in bounded chunks."""
    from ray.data.datasource import FileBasedDatasource

    class JsonRowsDatasource(FileBasedDatasource):
        def _read_stream(self, f: Any, path: str) -> Iterator[Any]:
            rows: list[dict[str, str]] = []
            size = 0
            for row in json_rows(iter(lambda: f.read(READ_CHUNK_BYTES), b"")):
                rows.append(row)
                size += len(row["json"]) + 64
                if size >= READ_CHUNK_BYTES:
                    yield rows_block(rows)
                    rows, size = [], 0
            if rows:
                yield rows_block(rows)

    return JsonRowsDatasource(files)
