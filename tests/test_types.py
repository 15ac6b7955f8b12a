"""The type check: mypy over the packages that travel to the cluster or drive it (``k8s``, ``eks``, ``train``; the
list is ``[tool.mypy] files`` in pyproject.toml), as part of the suite, so a change that breaks a type across a
package border fails the test command like any other defect."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_passes_over_the_typed_packages() -> None:
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    for package in ("k8s", "eks", "train"):
        assert f"src/raytrain_eks/{package}" in settings["files"], f"{package} is left out of the type check"
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-pretty"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"mypy found type errors:\n{done.stdout}{done.stderr}"
    # It checked every module of those packages (a path typo in the settings would check nothing and pass).
    m = re.search(r"Success: no issues found in (\d+) source files", done.stdout)
    assert m, done.stdout[-2000:]
    expected = sum(len(list((ROOT / p).rglob("*.py"))) for p in settings["files"])
    assert int(m.group(1)) == expected
