"""Where checkpoints and exports live: a local folder or a URI (``s3://bucket/prefix``), read and written alike.

Example::

    fs, path = filesystem("s3://my-bucket/runs/a")     # a pyarrow FileSystem and the path inside it
    join("s3://my-bucket/runs/a", "checkpoint_000050") # "s3://my-bucket/runs/a/checkpoint_000050"
    is_remote("/data/runs/a")                           # False
    copy_ranges("s3://my-bucket/runs/a", Path("local"), [("__0_0.distcp", 0, 4096)])  # part of a file, sparse
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyarrow.fs import FileSystem


def filesystem(location: str | Path) -> tuple[FileSystem, str]:
    """(pyarrow file system, path in it) for a local path or a URI such as ``s3://bucket/prefix``."""
    from pyarrow import fs as pafs

    text = str(location)
    if "://" in text:
        found: tuple[FileSystem, str] = pafs.FileSystem.from_uri(text)
        return found
    return pafs.LocalFileSystem(), str(Path(text).expanduser().resolve())


def join(location: str | Path, name: str) -> str:
    """``location/name`` for a local path or a URI."""
    return f"{str(location).rstrip('/')}/{name}"


def is_remote(location: str | Path) -> bool:
    return "://" in str(location)


# Copying out of remote storage: COPY_FILES files at once (a rank's share of a checkpoint is that many files), each
# read in ranges of READ_RANGE_BYTES (S3's guidance for ranged GETs is 8-16 MB; pyarrow's default of 1 MiB would be
# thousands of GETs per file), so few requests per file and 64 MiB in flight at most.
READ_RANGE_BYTES = 16 << 20
COPY_FILES = 4


def merged(spans: list[tuple[int, int]], gap: int = 2**20) -> list[tuple[int, int]]:
    """(offset, length) byte ranges, sorted, with ranges less than ``gap`` apart joined: a tensor's saved bytes
    lie next to the previous one's, so a run of them in one file is read in few large requests."""
    out: list[list[int]] = []
    for offset, length in sorted(spans):
        if out and offset - (out[-1][0] + out[-1][1]) < gap:
            out[-1][1] = max(out[-1][1], offset + length - out[-1][0])
        else:
            out.append([offset, length])
    return [(o, n) for o, n in out]


def copy_ranges(location: str | Path, into: Path, pieces: Iterable[tuple[str, int, int]]) -> int:
    """Copy ``(relative path, offset, length)`` pieces of the files in the folder ``location`` into files of the
    same names in ``into``, each written at its own offset into a sparse file of the remote file's size (the
    bytes not asked for are neither read nor stored); :data:`COPY_FILES` files at a time. Returns the bytes read
    (nearby pieces are read together, see :func:`merged`). A file that cannot be read, or ends early, is a
    :class:`UserError`."""
    from concurrent.futures import ThreadPoolExecutor

    spans: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in pieces:
        spans.setdefault(name, []).append((offset, length))
    fs, base = filesystem(location)

    def copy(name: str) -> int:
        return _copy_file(fs, f"{base}/{name}", into / name, merged(spans[name]), shown=join(location, name))

    with ThreadPoolExecutor(max_workers=COPY_FILES) as pool:
        return sum(pool.map(copy, spans))


def _copy_file(fs: FileSystem, remote: str, local: Path, ranges: list[tuple[int, int]], *, shown: str) -> int:
    from raytrain_eks.errors import UserError

    step = READ_RANGE_BYTES
    try:
        size = fs.get_file_info(remote).size
        local.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_file(remote) as src, open(local, "wb") as dst:
            dst.truncate(size)
            for offset, length in ranges:
                dst.seek(offset)
                done = 0
                while done < length:
                    chunk = src.read_at(min(step, length - done), offset + done)
                    if not chunk:
                        raise UserError(f"{shown} ends before byte {offset + length}: the checkpoint is damaged")
                    dst.write(chunk)
                    done += len(chunk)
    except OSError as exc:
        raise UserError(
            f"cannot copy {shown} into {local.parent}: {str(exc).strip().splitlines()[0]}",
            hint=f"Check that this machine may read that storage (credentials, role, network) and has room in "
            f"{local.parent}.",
        ) from None
    return sum(length for _, length in ranges)
