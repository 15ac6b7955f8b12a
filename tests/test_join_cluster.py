"""`train --address HOST:PORT` joins a Ray cluster someone else started, as the job does inside the head pod."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    start = [_bin("ray"), "start", "--head", f"--port={port}", "--num-cpus=4"]
    subprocess.run([*start, "--include-dashboard=false"], check=True, env=env, capture_output=True, timeout=120)
    try:
        yield port
    finally:
        subprocess.run([_bin("ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_train_joins_an_existing_cluster(tmp_path, ray_head):
    run = tmp_path / "run"
    # "auto" finds the cluster started on this machine, as inside the Ray head pod.
    cmd = [_bin("raytrain-eks"), "train", "--address", "auto", "--preset", "local-tiny"]
    cmd += ["--steps", "5", "--output-dir", str(run)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
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
    # The cluster outlives the job: it was not ours to stop.
    probe = "import ray; ray.init(address='auto', log_to_driver=False); print(int(ray.cluster_resources()['CPU']))"
    alive = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert alive.returncode == 0, alive.stderr[-2000:]
    assert alive.stdout.strip().splitlines()[-1] == "4"


def test_an_unreachable_cluster_is_one_clear_error(tmp_path):
    cmd = [_bin("raytrain-eks"), "train", "--address", f"127.0.0.1:{_free_port()}", "--preset", "local-tiny"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "cannot connect to the Ray cluster at 127.0.0.1:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
