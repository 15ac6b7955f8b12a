"""`train --address HOST:PORT` joins a Ray cluster someone else started, as the job does inside the head pod; and
the suite's own Ray, with that cluster running, never joins it."""

from __future__ import annotations

import ast
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
from typing import NamedTuple

import procs
import pytest
import ray.util

pytestmark = pytest.mark.usefixtures("starts_ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} must be installed"
    return found


class RayHead(NamedTuple):
    env: dict[str, str]  # for its clients: RAY_ADDRESS names it
    temp_root: Path  # its temp dir is temp_root/ray


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head of this module's own, stopped with everything it started, and no other Ray on this machine.

    ``ray start --block`` in a session of its own stops its node on SIGTERM; what is left in that session is
    killed. (``ray stop`` would stop every Ray on the machine.) Its temp dir is its own, ``ROOT/ray``, so only the
    clients given ``RAY_ADDRESS`` find it, or those whose default temp dir it is (``RAY_TMPDIR=ROOT``: its
    ``ray_current_cluster`` file is there, as ``/tmp/ray``'s is for a cluster started with the defaults);
    ``--address auto`` reads that variable first, as it reads the head pod's address file.
    """
    port = _free_port()
    # Short: Ray's socket paths must fit 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rtj-", dir="/tmp")) / "ray"
    temp_dir.mkdir()
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
        yield RayHead(client_env, temp_dir.parent)
    finally:
        _stop_session(proc)
        log.close()
        shutil.rmtree(temp_dir.parent, ignore_errors=True)


def _wait_for_head(proc: subprocess.Popen[bytes], env: dict[str, str], temp_dir: Path) -> None:
    # Joins on purpose: the head started above, named by the RAY_ADDRESS of ``env``.
    probe = (
        "import os, ray; ray.init(address=os.environ['RAY_ADDRESS'], log_to_driver=False); "
        "print(int(ray.cluster_resources()['CPU']))"
    )
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
    if proc.poll() is None:  # a few seconds to stop its node; whatever is left in its session is killed below
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    for p in procs.processes():
        if p.sid == proc.pid:  # it was started in a session of its own: only its processes are in it
            p.kill()
    proc.wait(timeout=10)


def test_train_joins_an_existing_cluster(tmp_path, ray_head):
    run = tmp_path / "run"
    # "auto" finds the cluster started on this machine, as inside the Ray head pod.
    cmd = [_bin("raytrain-eks"), "train", "--address", "auto", "--preset", "local-tiny"]
    cmd += ["--steps", "5", "--output-dir", str(run)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ray_head.env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"Run folder: {run.resolve()}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["world_size"] == 2 and summary["nodes"] == 1  # one Ray node here
    # A Ray cluster this tool did not deploy: no deployment record from `submit` beside a configuration, so nothing
    # is priced from the preset's instance types; the summary, the terminal and the report say why.
    assert summary["cost"] is None and summary["cost_note"].startswith("no deployment record")
    assert summary["cost_note"].endswith("set cluster.usd_per_hour (or cluster.usd_per_node_hour) to price runs on it")
    assert "cost: not known: no deployment record" in proc.stdout
    assert "not known: no deployment record" in (run / "report.html").read_text()
    assert "$9.55/h" not in proc.stdout + (run / "report.html").read_text()
    # The cluster outlives the job: it was not ours to stop.
    probe = "import ray; ray.init(address='auto', log_to_driver=False); print(int(ray.cluster_resources()['CPU']))"
    alive = subprocess.run([sys.executable, "-c", probe], env=ray_head.env, capture_output=True, text=True, timeout=120)
    assert alive.returncode == 0, alive.stderr[-2000:]
    assert alive.stdout.strip().splitlines()[-1] == "4"


def test_an_unreachable_cluster_is_one_clear_error(tmp_path):
    cmd = [_bin("raytrain-eks"), "train", "--address", f"127.0.0.1:{_free_port()}", "--preset", "local-tiny"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "cannot connect to the Ray cluster at 127.0.0.1:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


# A throw-away suite with this suite's conftest.py, run while another Ray runs on this machine (RAY_ADDRESS names
# it, and it is the newest cluster in the default temp dir). The shared Ray fixture must start a Ray of its own.
# The local run path asks Ray for the same ("local", recorded here rather than started: one Ray start less), and
# the fixture's real start shows what "local" gets with that cluster there. A Ray Data call before any ray.init()
# (Ray's auto-init) must join nothing.
OWN_RAY_SUITE = """
import contextlib
import os

import ray

from raytrain_eks import ray_session

FOREIGN = os.environ["FOREIGN_RAY_ADDRESS"]


def test_the_local_run_path_asks_for_a_ray_of_its_own(monkeypatch):
    assert "RAY_ADDRESS" not in os.environ
    asked = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: asked.append(kwargs))
    monkeypatch.setattr(ray_session, "_start_resource_coordinator", lambda: None)
    monkeypatch.setattr(ray_session, "_import_train_modules", lambda: None)
    ray_session.init_ray(None, num_workers=2, verbose=False)
    assert [kwargs["address"] for kwargs in asked] == ["local"]


def test_ray_data_before_any_ray_init_joins_no_cluster():
    # Ray Data's first task runs Ray's auto-init (a bare ray.init()), which would join the foreign cluster.
    import ray.data

    with contextlib.suppress(ray.exceptions.RaySystemError):  # "Ray has not been started yet"
        ray.data.range(1).take(1)
    joined = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    ray.shutdown()
    assert joined is None, f"Ray Data's auto-init joined {joined} (the foreign cluster: {joined == FOREIGN})"


def test_the_shared_fixture_starts_its_own_ray(ray_local):
    assert ray_local.get_runtime_context().gcs_address != FOREIGN
    assert ray_local.cluster_resources()["CPU"] == 4
"""


def test_the_suites_ray_never_joins_a_cluster_it_did_not_start(tmp_path, ray_head):
    for name in ("conftest.py", "procs.py", "tiers.py"):
        shutil.copy(Path(__file__).with_name(name), tmp_path / name)
    (tmp_path / "test_own_ray.py").write_text(OWN_RAY_SUITE)
    foreign = ray_head.env["RAY_ADDRESS"]
    env = {**ray_head.env, "FOREIGN_RAY_ADDRESS": foreign, "RAY_TMPDIR": str(ray_head.temp_root)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_own_ray.py"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout


def test_every_ray_init_names_its_address():
    """A bare ``ray.init()`` joins whatever Ray runs on the machine: every call in the suite, the package and the
    benchmarks says which (``"local"``: a new one of its own)."""
    here = Path(__file__).parent
    files = sorted(here.glob("*.py")) + sorted((here.parent / "src" / "raytrain_eks").rglob("*.py"))
    files += sorted((here.parent / "benchmarks").glob("*.py"))
    bare = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "init"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "ray"
                and not any(k.arg == "address" for k in node.keywords)
            ):
                bare.append(f"{path.name}:{node.lineno}")
    assert bare == []
