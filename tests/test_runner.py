"""The runner stops what it started: Ctrl-C (SIGINT) or SIGTERM while eksctl or helm runs stops the command's whole
process group (children it started included), then says what the state file records and that re-running resumes.

Real processes and real signals: a Python script stands in for eksctl, starts a grandchild, and both would run for
minutes; the test signals this very process, as a terminal's Ctrl-C or a `kill` would.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from raytrain_eks.config import load_config
from raytrain_eks.eks import lifecycle
from raytrain_eks.k8s import runner
from raytrain_eks.k8s.state import Deployment, StateStore

# Stands in for eksctl: records its own and a grandchild's pid, then both sleep far longer than any test.
FAKE_EKSCTL = textwrap.dedent(
    """\
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[1], "w") as f:
        f.write(f"{child.pid}\\n")
    print("creating stack", flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie nobody has reaped yet has stopped running: read its state where /proc tells it.
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _group_running(pgid: int) -> list[int]:
    """Pids of processes of group ``pgid`` that still run (zombies excluded), from /proc."""
    running = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            running.append(int(entry.name))
    return running


class _Sender(threading.Thread):
    """Sends ``signum`` to this process once the stand-in has started its grandchild; ``sent_at`` says when."""

    def __init__(self, pid_file: Path, signum: int) -> None:
        super().__init__(daemon=True)
        self.pid_file, self.signum, self.sent_at = pid_file, signum, 0.0

    def run(self) -> None:
        deadline = time.monotonic() + 120  # a loaded 2-core machine can take long to start two interpreters
        while time.monotonic() < deadline and not (self.pid_file.exists() and self.pid_file.read_text().endswith("\n")):
            time.sleep(0.02)
        self.sent_at = time.monotonic()
        os.kill(os.getpid(), self.signum)


def _signal_when_started(pid_file: Path, signum: int) -> _Sender:
    sender = _Sender(pid_file, signum)
    sender.start()
    return sender


@pytest.fixture(autouse=True)
def terminal_ctrl_c():
    """Ctrl-C raises KeyboardInterrupt here, as in a terminal, whatever an earlier test of this process installed."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def fake_eksctl(tmp_path: Path) -> tuple[list[str], Path]:
    script = tmp_path / "eksctl.py"
    script.write_text(FAKE_EKSCTL)
    pid_file = tmp_path / "grandchild.pid"
    return [sys.executable, str(script), str(pid_file)], pid_file


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
@pytest.mark.parametrize(("signum", "name"), [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_a_signal_stops_the_commands_whole_process_group(fake_eksctl, signum, name):
    argv, pid_file = fake_eksctl
    before = signal.getsignal(signal.SIGTERM)
    sender = _signal_when_started(pid_file, signum)
    with pytest.raises(runner.Interrupted) as err:
        runner.run(argv, timeout=300)
    sender.join()
    assert time.monotonic() - sender.sent_at < runner.STOP_GRACE_S + 20, "stopped at once, not at the timeout"
    assert not _alive(int(pid_file.read_text())), "the grandchild it started was stopped too"
    assert err.value.exit_code == 130 and err.value.signal_name == name
    assert f"stopped by {name}" in err.value.message and "resumes where it stopped" in (err.value.hint or "")
    assert signal.getsignal(signal.SIGTERM) == before, "the SIGTERM handler is put back"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_no_process_of_the_group_is_left_running(fake_eksctl, monkeypatch):
    argv, pid_file = fake_eksctl
    seen: dict[str, int] = {}
    real_popen = runner.subprocess.Popen

    def popen(*args, **kwargs):  # note the child's pid (its group id); the real Popen does the work
        proc = real_popen(*args, **kwargs)
        seen["pgid"] = proc.pid
        return proc

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    sender = _signal_when_started(pid_file, signal.SIGINT)
    with pytest.raises(runner.Interrupted):
        runner.run(argv, timeout=300)
    sender.join()
    assert _group_running(seen["pgid"]) == []


def test_up_interrupted_says_what_the_state_file_records(tmp_path: Path, fake_eksctl, aws_env: str):
    # `up` runs the stand-in for eksctl through the real runner; SIGTERM arrives while it "creates the cluster".
    argv, pid_file = fake_eksctl
    cfg = load_config(environ={"GPU_AZ": "us-east-1a"}, path=None)
    store = StateStore(tmp_path / "state")

    def run(cmd, **kw):
        if cmd[:3] == ["eksctl", "get", "cluster"]:
            return runner.Completed(tuple(cmd), 1, "", "ResourceNotFoundException: No cluster found for name: x")
        if cmd[:3] == ["eksctl", "create", "cluster"]:
            return runner.run(argv, **kw)
        raise AssertionError(f"unexpected command {cmd}")

    d = Deployment(cfg=cfg, kube=None, run=run, state=store, require_tool=lambda name: name)  # type: ignore[arg-type]
    sender = _signal_when_started(pid_file, signal.SIGTERM)
    with pytest.raises(runner.Interrupted) as err:
        lifecycle.up(d, confirm=lambda q: True, offered_zones=None)
    sender.join()
    assert not _alive(int(pid_file.read_text()))
    bucket = store.get("bucket")
    assert f"{store.path} records (some may be half made): S3 bucket {bucket}" in err.value.message
    assert "; EKS cluster ray-train-eks (us-east-1)" in err.value.message
    assert StateStore(tmp_path / "state").created == store.created != [], "the record stays for the next run"
