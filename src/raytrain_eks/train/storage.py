"""Where checkpoints and exports live: a local folder or a URI (``s3://bucket/prefix``), read and written alike.

Example::

    fs, path = filesystem("s3://my-bucket/runs/a")     # a pyarrow FileSystem and the path inside it
    join("s3://my-bucket/runs/a", "checkpoint_000050") # "s3://my-bucket/runs/a/checkpoint_000050"
    is_remote("/data/runs/a")                           # False
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def filesystem(location: str | Path) -> tuple[Any, str]:
    """(pyarrow file system, path in it) for a local path or a URI such as ``s3://bucket/prefix``."""
    from pyarrow import fs as pafs

    text = str(location)
    if "://" in text:
        return pafs.FileSystem.from_uri(text)
    return pafs.LocalFileSystem(), str(Path(text).expanduser().resolve())


def join(location: str | Path, name: str) -> str:
    """``location/name`` for a local path or a URI."""
    return f"{str(location).rstrip('/')}/{name}"


def is_remote(location: str | Path) -> bool:
    return "://" in str(location)
