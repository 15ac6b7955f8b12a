"""`raytrain-eks train` as a person sees it in a real terminal (tmux): data preparation and training show as one
display of ours, and none of Ray Data's own progress bars (they are left to ``--verbose``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("starts_ray")

TMUX = shutil.which("tmux")
# Words of Ray Data's own progress bars and operator names, seen in a terminal without this display.
RAY_DATA_WORDS = ("Running Dataset", "ReadBinary", "MapBatches", "RandomShuffle", "Shuffle Reduce", "row/s")
# The lines of a local run, in their order: what the run decided (each once), its bar, and where things are.
OUR_LINES = (
    "run folder: ",
    "ray: ",
    "data: ",
    "eval: ",
    "precision: ",
    "attention: ",
    "sharding: ",
    "loss: ",
    "compile: ",
    "model start: ",
    "first step: ",
    "checkpoints: ",
    "model: ",
    "report: ",
    "train ",
    "done: ",
    "Run folder: ",
)


@pytest.fixture
def terminal(tmp_path):
    if TMUX is None:
        if os.environ.get("CI"):
            pytest.fail("tmux is missing in CI")
        pytest.skip("needs tmux (apt-get install -y tmux)")
    socket = f"raytrain-eks-test-{os.getpid()}"

    def tmux(*args: str) -> str:
        done = subprocess.run([TMUX, "-L", socket, "-f", "/dev/null", *args], capture_output=True, text=True)
        assert done.returncode == 0, f"tmux {args[0]} exited {done.returncode}: {done.stderr.strip()}"  # tmux's why
        return done.stdout

    tmux("new-session", "-d", "-s", "t", "-x", "150", "-y", "60", "-c", str(tmp_path), "sleep", "900")
    tmux("set-option", "-g", "remain-on-exit", "on")
    yield tmux
    subprocess.run([TMUX, "-L", socket, "kill-server"], check=False, capture_output=True)


def test_one_display_for_data_and_training(tmp_path, terminal, builtin_cache):
    exe = shutil.which("raytrain-eks", path=str(Path(sys.executable).parent))
    assert exe
    terminal(
        "new-window", "-t", "t", "-n", "run", "-c", str(tmp_path), exe, "train", "--steps", "2", "--output-dir", "run"
    )
    deadline = time.monotonic() + 600
    screen, stages = "", set()
    while time.monotonic() < deadline:
        screen = terminal("capture-pane", "-p", "-t", "t:run", "-S", "-200")
        stages |= {
            line.split("0/?")[1].strip() for line in screen.splitlines() if line.startswith("data ") and "0/?" in line
        }
        if "Run folder:" in screen or "error" in screen.lower():
            break
        time.sleep(0.5)
    # tmux's own last line once the command has ended (remain-on-exit) is the terminal's, not the run's.
    lines = [line for line in screen.splitlines() if line.strip() and not line.startswith("Pane is dead")]
    assert any(line.startswith("Run folder:") for line in lines), screen
    assert any(line.startswith("data: builtin:sample-instructions: 390/390 rows usable") for line in lines), screen
    assert any(line.startswith("train") and "2/2" in line for line in lines), screen
    assert not [line for line in lines if any(word in line for word in RAY_DATA_WORDS)], screen
    # Every line is one of ours, each said once: nothing of Ray's, no warning, no line repeated.
    foreign = [line for line in lines if not line.startswith(OUR_LINES)]
    assert not foreign, screen
    assert all(sum(line.startswith(prefix) for line in lines) <= 1 for prefix in OUR_LINES), screen
    # While it ran, data preparation was one line of ours (gone once training shows its bar).
    assert stages and all(
        s.startswith(("reading and tokenizing", "shuffling and packing", "ready;")) for s in stages
    ), stages
