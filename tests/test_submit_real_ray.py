"""``submit`` and ``logs`` against a real Ray: the commands they run in the pods run for real on this machine.

Kubernetes stays FakeKube (fake_kube.py) (GPU nodes, device plugins, KubeRay's pods Running, set up
by the fake ``up`` of ``test_deploy``), but its ``exec`` runs the argv here as a subprocess: every "pod" is this
machine. A Ray head of this module's own (dashboard and job server, its own ``--temp-dir`` and ports) plays the head
pod's Ray; the constants naming places in the pods point at this test's folders. What is checked is what a user sees:
the package unpacked by the real unpack script, ``ray job submit`` with the real runtime_env, the training log
streamed by ``ray job logs --follow``, SUCCEEDED read from the real ``ray job status``, the job importing the shipped
copy through ``py_modules``, the NCCL script over real session logs (none on CPU: inconclusive, said so), ``fi_info``
missing, and ``logs`` afterwards.
"""

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
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube
from test_deploy import ZONES, FakeTools

from raytrain_eks.config import Config, load_config
from raytrain_eks.deploy import submit as sub
from raytrain_eks.eks import lifecycle, nodegroups
from raytrain_eks.eks.pricing import check_deployable, cost_per_hour
from raytrain_eks.fabric.nccl_lines import NCCL_LOG_PREFIX
from raytrain_eks.k8s import job as shipping
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.cluster import ExecResult
from raytrain_eks.k8s.state import Deployment, StateStore
from raytrain_eks.presets import local_tiny

pytestmark = pytest.mark.usefixtures("starts_ray")

VENV_BIN = str(Path(sys.executable).parent)
STEPS = 4
STOP_GRACE_S = 5  # a graceful stop of Ray takes about 30 s here after a Ray Train job; nothing in it needs keeping
# Printed by the shipped copy's __init__ only: the job's log then shows which copy of raytrain_eks it imported.
MARKER = "raytrain_eks shipped copy imported from"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_environment() -> dict[str, str]:
    """The environment of the commands run "in the pods" and of the Ray head: this venv first on PATH (``python``
    and ``ray`` as in the image), no RAY_ADDRESS of the caller's, and token auth decided explicitly: Ray 2.60's
    ``ray start`` turns it on by itself when ~/.ray/auth_token exists (an earlier ``ray.init()`` writes one),
    while the ``ray job`` CLI does not, and every ``ray job`` command would then fail with 401."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    return env


@dataclass
class RayHead:
    temp_dir: Path
    dashboard: str

    @property
    def session_logs(self) -> Path:
        return self.temp_dir / "session_latest" / "logs"


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _session_members(sid: int) -> list[int]:
    """Every process of the session ``sid`` (Linux /proc): Ray puts some actors in process groups of their own."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    members.append(int(entry))
            except OSError:
                continue
    return members


def _stop_ray_head(proc: subprocess.Popen[bytes]) -> None:
    """Stop this module's Ray and nothing else (``ray stop`` would stop every Ray on this machine, other test runs'
    included). ``ray start --block`` stops what it started on SIGTERM; whatever is left of its session (it was
    started in a session of its own, so only its processes are in it) is killed after a short grace."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE_S)
    for pid in _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    proc.wait(timeout=10)


def _start_head(temp_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``ray start --head`` on free ports in ``temp_dir``; returns once its dashboard and job server answer."""
    dash_port = _free_port()
    gcs_port = _free_port()
    argv = [
        f"{VENV_BIN}/ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}", "--include-dashboard=true", "--num-cpus=2",
        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
        "--disable-usage-stats", f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    with (temp_dir / "ray-start.out").open("ab") as out:
        # The built-in model's cache (RAYTRAIN_EKS_CACHE, set by conftest) reaches the job through this environment.
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=pod_environment(), start_new_session=True
        )
    dashboard = f"http://127.0.0.1:{dash_port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            pytest.fail(f"ray start exited {proc.returncode}:\n{(temp_dir / 'ray-start.out').read_text()[-3000:]}")
        try:
            _get_json(f"{dashboard}/api/version")
            _get_json(f"{dashboard}/api/jobs/")  # the job server is a module of its own: wait for it too
            return proc, dashboard
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"the dashboard at {dashboard} did not answer within 90 s")
            time.sleep(0.5)


def _job_agent_takes_jobs(dashboard: str, timeout: float) -> bool:
    """Whether the head's job agent accepts a job within ``timeout`` s: a one-command job submitted through the
    dashboard's REST API and waited for (the dashboard answers "No available agent" until its agent registers)."""
    body = json.dumps({"entrypoint": "true", "submission_id": f"agent-probe-{os.getpid()}-{time.time_ns()}"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            f"{dashboard}/api/jobs/", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                submission = json.loads(resp.read())["submission_id"]
        except urllib.error.HTTPError as exc:
            if "No available agent" not in exc.read().decode(errors="replace"):
                raise
            time.sleep(1.0)
            continue
        while time.monotonic() < deadline:
            if _get_json(f"{dashboard}/api/jobs/{submission}")["status"] in {"SUCCEEDED", "FAILED", "STOPPED"}:
                return True
            time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def ray_head(builtin_model: str) -> Iterator[RayHead]:
    """A Ray head with the dashboard on loopback, in a temp dir of its own (short: Ray's socket paths must fit 107
    bytes). Its address file is written there, not in /tmp/ray, so ``ray.init()`` and ``address="auto"`` of other
    tests never find it, and it uses only free ports (the client server and agent ports are fixed by default).
    It is handed over once its job agent has taken a job: on a loaded machine the agent can fail to come up (the
    dashboard then answers "No available agent" for good), and the head is started once more; a second failure
    fails the test with Ray's own output."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rtr-", dir="/tmp"))
    proc = None
    try:
        for attempt in (1, 2):
            proc, dashboard = _start_head(temp_dir)
            if _job_agent_takes_jobs(dashboard, timeout=120):
                break
            _stop_ray_head(proc)
            proc = None
            if attempt == 2:
                pytest.fail(
                    "the Ray head's job agent took no job within 120 s, twice:\n"
                    + (temp_dir / "ray-start.out").read_text()[-3000:]
                )
        yield RayHead(temp_dir, dashboard)
    finally:
        if proc is not None:
            _stop_ray_head(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


class LocalPods(FakeKube):
    """FakeKube whose ``exec`` runs the command on this machine, and whose job ConfigMap is "mounted" at
    ``config_dir`` when it is applied (as the head pod's volume would show it)."""

    def __init__(self, env: dict[str, str], config_dir: Path, config_map: str) -> None:
        super().__init__()
        self.env = env
        self.config_dir = config_dir
        self.config_map = config_map

    def apply(self, obj: Any) -> None:
        super().apply(obj)
        if obj.get("kind") == "ConfigMap" and obj["metadata"]["name"] == self.config_map:
            self.config_dir.mkdir(parents=True, exist_ok=True)
            for key, text in obj["data"].items():
                (self.config_dir / key).write_text(text)

    def exec(
        self,
        namespace: str,
        pod: str,
        argv: Sequence[str],
        *,
        timeout: float,
        stdin: str | None = None,
        container: str | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> ExecResult:
        if not any(p.name == pod and p.phase == "Running" for p in self.pods(namespace)):
            raise ValueError(f"exec: pod {namespace}/{pod} is not running")
        args = list(argv)
        self.exec_calls.append((namespace, pod, args, stdin))
        return run_here(args, timeout=timeout, stdin=stdin, env=self.env, on_output=on_output)


def run_here(
    argv: list[str], *, timeout: float, stdin: str | None, env: dict[str, str], on_output: Callable[[str], None] | None
) -> ExecResult:
    """Run ``argv`` (no shell) as a pod's exec would: stdout lines to ``on_output`` as they come, a missing program
    is exit status 127, and past ``timeout`` the command is stopped and 124 returned (as KubernetesApi.exec does)."""
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
    except FileNotFoundError:
        return ExecResult(127, "", f'exec: "{argv[0]}": executable file not found in $PATH')
    out: list[str] = []
    err: list[str] = []

    def pump_out() -> None:
        for line in proc.stdout:
            out.append(line)
            if on_output is not None:
                on_output(line.rstrip("\n"))

    readers = [
        threading.Thread(target=pump_out, daemon=True),
        threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True),
    ]
    for t in readers:
        t.start()
    if stdin is not None:
        try:
            proc.stdin.write(stdin)
            proc.stdin.close()
        except BrokenPipeError:
            pass
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = 124
        err.append(f"\nstopped after {timeout:.0f} s")
    for t in readers:
        t.join(timeout=10)
    return ExecResult(code, "".join(out), "".join(err))


def tiny_config(run_dir: Path) -> Config:
    """The reference cluster with local_tiny's training: the built-in model and data, a few steps on CPU."""
    training = {"steps": STEPS, "log_every": 2, "num_workers": 1, "checkpoint_every": 0, "export": False}
    return load_config(
        preset=local_tiny(),
        path=None,
        environ={},
        overrides={"training": {**training, "output_dir": str(run_dir)}, "ray": {"job_deadline_s": 300}},
    )


def test_submit_runs_the_job_on_a_real_ray_and_reports_what_it_saw(
    ray_head: RayHead, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str
):
    monkeypatch.chdir(tmp_path)  # no raytrain-eks.yaml of the repository is read
    cfg = tiny_config(tmp_path / "run")
    assert cfg.fabric.require == "any" and cfg.training.model_id == "builtin:tiny-qwen2"

    # The places in the pods, moved to this test's own folders and its Ray.
    head_code = tmp_path / "head-code"
    nccl_files = str(tmp_path / f"{NCCL_LOG_PREFIX}*.log")  # the transport gate's NCCL_DEBUG_FILE files: none on CPU
    monkeypatch.setattr(sub, "DASHBOARD", ray_head.dashboard)
    monkeypatch.setattr(shipping, "DASHBOARD", ray_head.dashboard)
    monkeypatch.setattr(shipping, "HEAD_CODE_ROOT", str(head_code))
    monkeypatch.setattr(sub, "RAY_SESSION_LOGS", str(ray_head.session_logs))
    monkeypatch.setattr(sub, "POD_NCCL_LOGS", nccl_files)
    monkeypatch.setattr(m, "CONFIG_DIR", str(tmp_path / "etc"))
    monkeypatch.setattr(shipping, "image_missing_requirements", list)  # no network: this venv has every package
    # The copy the job gets says so when imported; the package installed here (editable) does not.
    real_files = shipping.package_files

    def marked_files() -> dict[str, str]:
        files = dict(real_files())
        files["raytrain_eks/__init__.py"] += f"\nprint({MARKER!r}, __file__, flush=True)\n"
        return files

    monkeypatch.setattr(sub, "package_files", marked_files)

    kube = LocalPods(pod_environment(), tmp_path / "etc", m.config_map_name(cfg))
    tools = FakeTools(kube)
    lines: list[str] = []
    d = Deployment(
        cfg=cfg,
        kube=kube,
        run=tools,
        state=StateStore(tmp_path / ".raytrain-eks"),
        say=lines.append,
        sleep=kube.sleep,
        clock=kube.monotonic,
        require_tool=tools.require,
    )
    lifecycle.up(d, confirm=lambda q: True, offered_zones=lambda: nodegroups.Placement(ZONES))
    lines.clear()

    result = sub.submit(d, mode="raycluster")
    said = "\n".join(lines)

    # The job ran to the end, and SUCCEEDED came from the real `ray job status` output.
    assert result.job_status == "SUCCEEDED", said[-4000:]
    status_calls = [c for c in kube.exec_calls if c[2][:3] == ["ray", "job", "status"]]
    assert status_calls and all(c[1] == "ray-train-head-0" for c in status_calls)
    assert f"Job {result.submission_id}: SUCCEEDED" in result.summary

    # The package was unpacked by the real script into HEAD_CODE_ROOT and named in the runtime_env.
    unpacks = [c for c in kube.exec_calls if c[2][:3] == [m.IMAGE_PYTHON, "-c", shipping._UNPACK]]
    assert len(unpacks) == 1 and unpacks[0][3], "the tar travelled on the exec's stdin"
    (submit_argv,) = [c[2] for c in kube.exec_calls if c[2][:3] == ["ray", "job", "submit"]]
    env = json.loads(submit_argv[submit_argv.index("--runtime-env-json") + 1])
    (module,) = env["py_modules"]
    assert Path(module).parent.parent == head_code and (Path(module) / "train" / "loop.py").is_file()
    assert (Path(module) / "__init__.py").read_text() == marked_files()["raytrain_eks/__init__.py"]

    # The training log was streamed as it came, with the run folder, and the run folder holds the finished run.
    run_dir = tmp_path / "run"
    assert result.run_dir == str(run_dir.resolve())
    assert f"done: {STEPS} steps" in said
    # Followed once: the end of the stream and `ray job status` agreed that the job had ended.
    assert lines.count(f"Run folder: {run_dir.resolve()}") == 1, said[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 1
    # `up` recorded this cluster in the state, so submit put its deployment record beside the job's configuration and
    # the run is priced at the cluster's hourly cost, as `up` quoted it.
    hourly = cost_per_hour(cfg, *check_deployable(cfg))["total_usd"]
    assert summary["cost"]["usd_per_hour"] == hourly and summary["cost"]["cluster"] == cfg.cluster.name
    assert summary["cost"]["usd"] == pytest.approx(hourly * summary["wall_s"] / 3600, abs=1e-4)
    assert f"cost: ${summary['cost']['usd']:.2f} at ${hourly:.2f}/h" in said

    # The job imported the shipped copy: Ray's py_modules copy of it, in this Ray's session, not the editable one.
    imported = [ln.split(MARKER, 1)[1].strip() for ln in lines if MARKER in ln]
    assert imported, said[-3000:]
    assert all(
        Path(p).is_relative_to(ray_head.temp_dir) and "/runtime_resources/py_modules_files/" in p for p in imported
    ), imported
    job = _get_json(f"{ray_head.dashboard}/api/jobs/{result.submission_id}")
    assert job["status"] == "SUCCEEDED"
    assert job["runtime_env"]["py_modules"][0].startswith("gcs://_ray_pkg_")

    # The NCCL script read the real session logs of the "worker pods" (this Ray's): gloo on CPU leaves no NCCL
    # lines, so the verdict is inconclusive and the exit code says so instead of claiming a fabric.
    nccl_calls = [c for c in kube.exec_calls if c[2][:3] == [m.IMAGE_PYTHON, "-c", sub._NCCL_LINES]]
    assert [c[1] for c in nccl_calls] == ["ray-train-gpu-workers-worker-0", "ray-train-gpu-workers-worker-1"]
    assert nccl_calls[0][2][3:] == [str(ray_head.session_logs), nccl_files]
    assert (ray_head.session_logs / f"job-driver-{result.submission_id}.log").is_file()
    assert result.report is not None and result.report.verdict == "inconclusive"
    assert "no NCCL set-up lines found" in result.report.reason
    assert result.exit_code == 2
    assert "FAILED: NCCL's inter-node transport does not meet fabric.require = any" in result.summary

    # fi_info is not installed here: reported as missing from the image, not as a failure of EFA itself.
    assert result.efa_provider is False
    if shutil.which("fi_info", path=pod_environment()["PATH"]) is None:
        assert any("fi_info is not in the image" in s for s in result.summary), result.summary

    # `logs` afterwards: the job's whole log, through the real `ray job logs`.
    out: list[str] = []
    assert sub.logs(d, on_output=out.append) == 0
    assert f"Run folder: {run_dir.resolve()}" in out
    assert kube.exec_calls[-1][2][:4] == ["ray", "job", "logs", "--address"]
