"""Default folders named by the time they were made: two made in the same second get different names.

Example::

    new_folder(Path("runs"), "20261202-032457-tiny-qwen2")  # runs/20261202-032457-tiny-qwen2, created
    # made again in the same second:                         # runs/20261202-032457-tiny-qwen2-2, created
    new_folder(Path("runs"), "compare-fabric-20261202-032457", create=False)  # the first name not yet taken
"""

from __future__ import annotations

from pathlib import Path


def new_folder(root: Path, stem: str, *, create: bool = True) -> Path:
    """``root/stem``, or ``root/stem-2``, ``-3``... when that is taken. With ``create`` the folder is made here, in
    one step that fails when another process made it first, so two processes never get the same one; without, it is
    the first name that does not exist yet (for a command that writes its folder only once it has something)."""
    path, n = root / stem, 1
    while True:
        if not create:
            if not path.exists():
                return path
        else:
            try:
                path.mkdir(parents=True)
                return path
            except FileExistsError:
                pass
        n += 1
        path = root / f"{stem}-{n}"
