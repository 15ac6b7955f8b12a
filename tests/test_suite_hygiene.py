"""The suite's own end-of-session check: a test run fails when a process it started outlives it.

A throw-away test run with this suite's conftest.py starts processes the way a leaking test would (a child left
running, and a grandchild whose parent exited, so it belongs to no test process any more); the run must fail,
name both, and leave neither running. A run that cleans up after itself passes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import procs
import pytest

LEAKY = """
import subprocess


def test_starts_nothing():
    pass


def test_leaves_processes_behind():
    subprocess.Popen(["sleep", "307"])  # a child never waited for
    subprocess.run(["sh", "-c", "sleep 308 &"], check=True)  # an orphan: its shell has exited
"""

CLEAN = """
import subprocess


def test_cleans_up():
    proc = subprocess.Popen(["sleep", "309"])
    proc.kill()
    proc.wait()
"""


pytestmark = pytest.mark.usefixtures("starts_programs")

# The suite's own command runs it in two processes (pytest-xdist): the check must hold there too.
IN_TWO_PROCESSES = ["-n", "2", "--dist", "loadfile"]


def _run_suite(tmp_path: Path, test_source: str, *options: str) -> subprocess.CompletedProcess[str]:
    for name in ("conftest.py", "procs.py", "tiers.py"):
        shutil.copy(Path(__file__).with_name(name), tmp_path / name)
    (tmp_path / "test_it.py").write_text(test_source)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, str(tmp_path / "test_it.py")]
    env = {**os.environ, "RAYTRAIN_EKS_TEST_LEFTOVER_GRACE_S": "1"}  # these sleepers never end by themselves
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


def _sleepers(seconds: str) -> list[procs.Proc]:
    return [p for p in procs.processes() if p.cmdline == f"sleep {seconds}"]


@pytest.mark.parametrize("options", [[], IN_TWO_PROCESSES], ids=["one-process", "xdist"])
def test_a_process_left_running_fails_the_run_and_is_stopped(tmp_path, options):
    proc = _run_suite(tmp_path, LEAKY, *options)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 passed" in out
    assert "2 process(es) started by this test session outlived it (stopped now)" in out
    assert "sleep 307" in out and "sleep 308" in out
    # Each is named with the test during which it started (not the one before it), and the orphan as one.
    named = [line for line in out.splitlines() if "started during" in line]
    assert len(named) == 2, out
    assert all("test_it.py::test_leaves_processes_behind;" in line for line in named), out
    assert sorted("an orphan (its parent exited)" in line for line in named) == [False, True], out
    assert not _sleepers("307") and not _sleepers("308")


@pytest.mark.parametrize("options", [[], IN_TWO_PROCESSES], ids=["one-process", "xdist"])
def test_a_run_that_stops_what_it_started_passes(tmp_path, options):
    proc = _run_suite(tmp_path, CLEAN, *options)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "outlived" not in proc.stdout
