"""Shared fixtures: one built-in model cache per test session, one embedded Ray per integration module.

And a check at the end of the session: no process the suite started may outlive it. Every process started during
the session inherits ``RAYTRAIN_EKS_TEST_SESSION`` (Ray's raylets and workers too, and processes whose parent has
died), so what is left of this session is found by that mark, and never another program's Ray on this machine.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import procs
import pytest

SESSION_MARK = "RAYTRAIN_EKS_TEST_SESSION"
LEFTOVER_GRACE_S = 20.0  # a Ray worker notices its raylet is gone within a few seconds


def pytest_sessionstart(session: pytest.Session) -> None:
    os.environ[SESSION_MARK] = f"{os.getpid()}-{secrets.token_hex(8)}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run, naming them, when processes started by this session are still running; then stop them."""
    mark = os.environ.get(SESSION_MARK)
    if not mark:
        return
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := leftover_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return
    lines = [f"  pid {p.pid}: {p.cmdline[:200]}" for p in left]
    message = f"{len(left)} process(es) started by this test session outlived it (stopped now):\n" + "\n".join(lines)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message)
    for p in left:
        p.kill()
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def leftover_processes(mark: str) -> list[procs.Proc]:
    """Living processes, this one aside, that descend from it or carry this session's mark."""
    me = os.getpid()
    found = {p.pid: p for p in procs.descendants(me)}
    for p in procs.processes():
        if p.pid != me and p.pid not in found and procs.environ_value(p.pid, SESSION_MARK) == mark:
            found[p.pid] = p
    return sorted(found.values(), key=lambda p: p.pid)


@pytest.fixture(scope="session", autouse=True)
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the built-in model once for the whole session, in a folder of its own (never ~/.cache)."""
    root = Path(os.environ.get("RAYTRAIN_EKS_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["RAYTRAIN_EKS_CACHE"] = str(root)
    return root


@pytest.fixture
def train_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``train_settings("--flag", ...)``: the training settings ``raytrain-eks train`` resolves from those flags in a
    fresh folder, stopping before anything is created (``run_training`` is not reached)."""
    from raytrain_eks.cli import main

    seen: dict[str, Any] = {}

    def stop_at_run_training(cfg: Any, **_: Any) -> None:
        seen["training"] = cfg.training
        raise SystemExit(0)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("raytrain_eks.train.launch.run_training", stop_at_run_training)

    def settings(*flags: str) -> Any:
        seen.clear()
        with pytest.raises(SystemExit) as info:
            main(["train", *flags])
        assert info.value.code == 0, f"train {' '.join(flags)} exited {info.value.code}"
        return seen["training"]

    return settings


@pytest.fixture(scope="session")
def builtin_model(builtin_cache: Path) -> str:
    from raytrain_eks.train.builtin import ensure_builtin_model

    return str(ensure_builtin_model())


@pytest.fixture(scope="session")
def tokenizer(builtin_model: str):
    from raytrain_eks.train.data import load_tokenizer

    return load_tokenizer(builtin_model)


@pytest.fixture
def cfg_for(tmp_path, monkeypatch):
    """Build a config from env.sh-style variables only (no file from the current folder, no real environment)."""
    from raytrain_eks.config import load_config

    monkeypatch.chdir(tmp_path)

    def build(**environ: str):
        return load_config(environ=environ)

    return build


@pytest.fixture
def same_second(monkeypatch):
    """``hold(module)``: that module's ``datetime.now()`` answers 2026-12-02 03:24:57 UTC every time, as when two
    things start within one second."""

    class SameSecond(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 2, 3, 24, 57, tzinfo=UTC)

    def hold(module: Any) -> None:
        monkeypatch.setattr(module, "datetime", SameSecond)

    return hold


@pytest.fixture(scope="module")
def ray_local():
    """An embedded Ray shared by one test module (startup costs 15-20 s here)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    """moto's server on a free loopback port, for the whole session (each test resets it through ``aws_env``)."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request, and a traceback for each action moto does not implement.
    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.CRITICAL)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
    werkzeug.setLevel(level)


@pytest.fixture
def aws_env(moto_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A clean moto state, dummy credentials, every AWS client pointed at moto, no config file or variables."""
    from raytrain_eks.config import ENV_VARS

    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST")).close()
    for name in [*ENV_VARS, *(n for n in os.environ if n.startswith("AWS_"))]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)  # botocore's own setting: every service, every region
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # moto answers unimplemented actions with HTTP 500: no retries
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.chdir(tmp_path)
    return moto_url
