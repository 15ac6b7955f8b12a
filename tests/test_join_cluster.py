"""`train --address HOST:PORT` joins a Ray cluster someone else started, as the job does inside the head pod."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import procs
import pytest
import ray.util

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} must be installed"
    return found


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head of this test's own, stopped with everything it started, and no other Ray on this machine.

    ``ray start --block`` in a session of its own stops its node on SIGTERM; what is left in that session is
    killed. (``ray stop`` would stop every Ray on the machine.) Its temp dir is its own, so only the clients
    given ``RAY_ADDRESS`` find it; ``--address auto`` reads that variable first, as it reads the head pod's
    address file.
    """
    port = _free_port()
    temp_dir = Path(tempfile.mkdtemp(prefix="rtj-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    # Token auth decided here for the head and its clients alike (``ray start`` turns it on by itself when
    # ~/.ray/auth_token exists).
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    # The address this machine's Ray nodes and drivers take by default (a driver looks for a raylet on it).
    ip = ray.util.get_node_ip_address()
    argv = [_bin("ray"), "start", "--head", "--block", f"--node-ip-address={ip}", f"--port={port}"]
    argv += ["--num-cpus=4", "--include-dashboard=false", f"--temp-dir={temp_dir}"]
    argv += [f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}"]
    log = (temp_dir / "ray-start.out").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    client_env = {**env, "RAY_ADDRESS": f"{ip}:{port}"}
    try:
        _wait_for_head(proc, client_env, temp_dir)
        yield client_env
    finally:
        _stop_session(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_head(proc: subprocess.Popen[bytes], env: dict[str, str], temp_dir: Path) -> None:
    probe = "import ray; ray.init(log_to_driver=False); print(int(ray.cluster_resources()['CPU']))"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"ray start exited {proc.returncode}:\n{(temp_dir / 'ray-start.out').read_text()[-3000:]}")
        ready = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        if ready.returncode == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the Ray head did not answer within 120 s: {ready.stderr[-2000:]}")
        time.sleep(1)


def _stop_session(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    for p in procs.processes():
        if p.sid == proc.pid:  # it was started in a session of its own: only its processes are in it
            p.kill()
    proc.wait(timeout=10)


def test_train_joins_an_existing_cluster(tmp_path, ray_head):
    run = tmp_path / "run"
    # "auto" finds the cluster started on this machine, as inside the Ray head pod.
    cmd = [_bin("raytrain-eks"), "train", "--address", "auto", "--preset", "local-tiny"]
    cmd += ["--steps", "5", "--output-dir", str(run)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ray_head, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"Run folder: {run.resolve()}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["world_size"] == 2
    # A run on a cluster is priced with the configured cluster's hourly cost (reference: $9.5498/h).
    cost = summary["cost"]
    assert cost["usd_per_hour"] == pytest.approx(9.5498)
    assert cost["usd"] == pytest.approx(9.5498 * summary["wall_s"] / 3600, abs=1e-4)
    assert cost["usd_per_million_tokens"] == pytest.approx(cost["usd"] / summary["tokens"] * 1e6, rel=1e-2)
    assert "cost: $" in proc.stdout
    assert "at $9.55/h" in (run / "report.html").read_text(), "the run's own report shows what it cost"
    # The cluster outlives the job: it was not ours to stop.
    probe = "import ray; ray.init(address='auto', log_to_driver=False); print(int(ray.cluster_resources()['CPU']))"
    alive = subprocess.run([sys.executable, "-c", probe], env=ray_head, capture_output=True, text=True, timeout=120)
    assert alive.returncode == 0, alive.stderr[-2000:]
    assert alive.stdout.strip().splitlines()[-1] == "4"


def test_an_unreachable_cluster_is_one_clear_error(tmp_path):
    cmd = [_bin("raytrain-eks"), "train", "--address", f"127.0.0.1:{_free_port()}", "--preset", "local-tiny"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "cannot connect to the Ray cluster at 127.0.0.1:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
