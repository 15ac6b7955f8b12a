"""Default folders named by the time they were made: two made in the same second get different names.

Example::

    new_folder(Path("runs"), "20261202-032457-tiny-qwen2")  # runs/20261202-032457-tiny-qwen2, created
    # made again in the same second:                         # runs/20261202-032457-tiny-qwen2-2, created
    new_folder(Path("runs"), "compare-fabric-20261202-032457", create=False)  # the first name not yet taken
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

# The node checks ``submit`` ran before a job (``raytrain-eks check``'s JSON): the job finds them at the path this
# variable names (in the head pod, where its driver runs) and keeps them in its run folder as NODE_CHECKS, which the
# report's health section and the run bundle read.
NODE_CHECKS_ENV = "RAYTRAIN_EKS_NODE_CHECKS"
NODE_CHECKS = "health/check.json"
# A run's benchmark scores (``raytrain-eks eval``, ``train --eval-tasks``), in its run folder and so in its bundle.
EVAL_RESULTS = "eval.json"


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


def keep_node_checks(run_dir: Path, environ: Mapping[str, str] = os.environ) -> bool:
    """Copy the node checks ``submit`` ran before this job (the file :data:`NODE_CHECKS_ENV` names) into the run
    folder (:data:`NODE_CHECKS`), where the report's health section and the bundle find them. Whether it did."""
    source = environ.get(NODE_CHECKS_ENV)
    if not source or not Path(source).is_file():
        return False
    (run_dir / NODE_CHECKS).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, run_dir / NODE_CHECKS)
    return True
