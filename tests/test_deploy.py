"""The step logic of ``up``, ``submit``, ``status``, ``logs`` and ``down``, against fakes; fast and hermetic.

Kubernetes is FakeKube (fake_kube.py) (stateful: nodes, DaemonSets that make nodes advertise
resources, KubeRay creating pods from the RayCluster's own templates, a scheduler recording ``FailedScheduling``).
eksctl and helm are :class:`FakeTools`, a recording runner whose commands change a small simulated AWS (cluster,
node groups per zone, Helm releases) and the fake cluster the way the real tools would; ``down``'s boto3 look for
leftovers goes to moto's server. Inside the pods, :class:`FakeRay` answers ``ray job`` commands, and the scripts
the steps run in the pods (unpacking the package, collecting NCCL lines) really run, against temporary folders and
the NCCL fixtures. Covered: the order of ``up``, the next zone after a launch failure, resuming after a failure,
device plugins proven on every node, ``up --plan`` creating nothing, allocatable missing -> fail fast with the fix,
Pending pods -> events shown on timeout, the runtime_env and the token kept out of argv and logs, EFA missing from
NCCL's lines -> non-zero exit, RayJob mode, ``down`` in reverse order and twice, leftovers, status, logs, and the
runner's errors."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import jsonschema
import pytest
import typer
import yaml
from fake_kube import FakeKube, parse_quantity
from typer.testing import CliRunner

from raytrain_eks.config import Config, load_config
from raytrain_eks.eks import addons, lifecycle, nodegroups, runner, state
from raytrain_eks.eks import commands as deploy_commands
from raytrain_eks.eks import submit as sub
from raytrain_eks.eks.addons import NodesNotReady
from raytrain_eks.eks.plan import write_plan
from raytrain_eks.eks.runner import CommandError, Completed, MissingToolError
from raytrain_eks.eks.state import Cancelled, Deployment, StateStore, apply_state
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import job as shipping
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.cluster import Event, ExecResult, _exec_returncode

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"
SCHEMAS = Path(__file__).parent / "schemas"  # copies of the upstream schemas, see schemas/README.md
ZONES = ["us-east-1a", "us-east-1b", "us-east-1c"]
TOKEN = "hf_SECRETtoken1234567890"
ALLOCATABLE = {"g6.12xlarge": {"cpu": "47", "memory": "185Gi"}, "m7i.xlarge": {"cpu": "3920m", "memory": "14Gi"}}
CAPACITY_ERROR = (
    "Error: waiting for CloudFormation stack: ResourceNotReady: failed waiting for successful resource state\n"
    "Nodegroup gpu-efa failed to stabilize: [{{Code: AsgInstanceLaunchFailures, Message: Could not launch On-Demand "
    "Instances. InsufficientInstanceCapacity - We currently do not have sufficient g6.12xlarge capacity in the "
    "Availability Zone you requested ({az}).}}]"
)


# ------------------------------------------------------------------------------------------------------------------
# Fakes of the world outside Kubernetes (eksctl, helm, aws) and of Ray inside the pods
# ------------------------------------------------------------------------------------------------------------------


class FakeTools:
    """A recording :class:`~raytrain_eks.eks.runner.Runner` simulating eksctl and helm.

    ``no_capacity``: zones where the GPU instances cannot launch. ``fail_once``: argv prefix (joined) -> stderr of
    one failure. ``crash_plugins``: releases whose DaemonSet pods never become ready. ``missing``: tools not
    installed.
    """

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube
        self.calls: list[list[str]] = []
        self.cluster: dict[str, Any] | None = None
        self.nodegroups: dict[str, dict[str, Any]] = {}
        self.releases: dict[tuple[str, str], dict[str, str]] = {}
        self.no_capacity: set[str] = set()
        self.fail_once: dict[str, str] = {}
        self.crash_plugins: set[str] = set()
        self.missing: set[str] = set()

    def require(self, name: str) -> str:
        if name in self.missing:
            raise MissingToolError(name)
        return f"/usr/local/bin/{name}"

    def commands(self, *prefix: str) -> list[list[str]]:
        return [c for c in self.calls if c[: len(prefix)] == list(prefix)]

    def __call__(
        self,
        argv: Any,
        *,
        timeout: float,
        input: str | None = None,
        check: bool = True,
        hint: str | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> Completed:
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), "argv must be a list of strings"
        assert timeout > 0
        self.require(argv[0])
        self.calls.append(list(argv))
        joined = " ".join(argv)
        for prefix, stderr in list(self.fail_once.items()):
            if joined.startswith(prefix):
                del self.fail_once[prefix]
                return self._done(argv, 1, "", stderr, check, hint)
        code, out, err = self._dispatch(argv)
        return self._done(argv, code, out, err, check, hint)

    def _done(self, argv: list[str], code: int, out: str, err: str, check: bool, hint: str | None) -> Completed:
        if check and code:
            raise CommandError(argv, code, err, hint=hint)
        return Completed(tuple(argv), code, out, err)

    @staticmethod
    def _opt(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    def _dispatch(self, argv: list[str]) -> tuple[int, str, str]:
        verb = tuple(argv[:3])
        if verb == ("eksctl", "get", "cluster"):
            if self.cluster is None:
                return (
                    1,
                    "",
                    f"Error: ResourceNotFoundException: No cluster found for name: {self._opt(argv, '--name')}.",
                )
            return 0, json.dumps([{"Name": self.cluster["name"], "Status": "ACTIVE"}]), ""
        if verb == ("eksctl", "create", "cluster"):
            doc = yaml.safe_load(Path(self._opt(argv, "-f")).read_text())
            assert doc["managedNodeGroups"] == [], "the cluster is created without node groups"
            self.cluster = {"name": doc["metadata"]["name"], "azs": doc["availabilityZones"]}
            return 0, "", "[✔]  EKS cluster ready\n"
        if verb == ("eksctl", "utils", "write-kubeconfig"):
            Path(self._opt(argv, "--kubeconfig")).write_text("apiVersion: v1\nkind: Config\n")
            return 0, "", ""
        if verb == ("eksctl", "get", "nodegroup"):
            if self.cluster is None:
                name = self._opt(argv, "--cluster")
                return 1, "", f"Error: ResourceNotFoundException: No cluster found for name: {name}."
            return 0, json.dumps([{"Name": n, "Status": g["status"]} for n, g in self.nodegroups.items()]), ""
        if verb == ("eksctl", "create", "nodegroup"):
            return self._create_nodegroup(yaml.safe_load(Path(self._opt(argv, "-f")).read_text()))
        if verb == ("eksctl", "scale", "nodegroup"):
            name, nodes = self._opt(argv, "--name"), int(self._opt(argv, "--nodes"))
            self.kube.remove_nodes({"alpha.eksctl.io/nodegroup-name": name})
            self._add_nodes(name, nodes)
            return 0, "", ""
        if verb == ("eksctl", "delete", "nodegroup"):
            name = self._opt(argv, "--name")
            self.nodegroups.pop(name, None)
            self.kube.remove_nodes({"alpha.eksctl.io/nodegroup-name": name})
            return 0, "", ""
        if verb == ("eksctl", "delete", "cluster"):
            self.cluster, self.nodegroups, self.releases = None, {}, {}
            self.kube.remove_nodes({})
            return 0, "", ""
        if argv[:2] == ["helm", "list"]:
            ns, name = self._opt(argv, "--namespace"), self._opt(argv, "--filter").strip("^$")
            rel = self.releases.get((ns, name))
            return 0, json.dumps([{"name": name, "namespace": ns, **rel}] if rel else []), ""
        if argv[:3] == ["helm", "upgrade", "--install"]:
            return self._helm_install(argv)
        if argv[:2] == ["helm", "uninstall"]:
            ns, name = self._opt(argv, "--namespace"), argv[2]
            self.releases.pop((ns, name), None)
            self.kube.remove_daemon_set(ns, name)
            return 0, f'release "{name}" uninstalled\n', ""
        raise AssertionError(f"unexpected command: {shlex.join(argv)}")

    def _create_nodegroup(self, doc: dict[str, Any]) -> tuple[int, str, str]:
        (group,) = doc["managedNodeGroups"]
        name = group["name"]
        az = (group.get("availabilityZones") or doc["availabilityZones"])[0]
        assert az in self.cluster["azs"], "a node group's zone must have a subnet of the cluster"
        if group.get("efaEnabled") and az in self.no_capacity:
            self.nodegroups[name] = {"status": "CREATE_FAILED", "az": az}
            return 1, "", CAPACITY_ERROR.format(az=az)
        self.nodegroups[name] = {"status": "ACTIVE", "az": az, "group": group}
        self._add_nodes(name, group["desiredCapacity"])
        if group.get("efaEnabled"):  # eksctl applies its own EFA plugin; `up` must remove it (infra-facts §1)
            self.kube.add_daemon_set(
                "kube-system",
                "aws-efa-k8s-device-plugin-daemonset",
                node_selector={"role": "gpu-worker"},
                advertises={m.EFA_RESOURCE: "1"},
            )
        return 0, "", ""

    def _add_nodes(self, name: str, count: int) -> None:
        group, az = self.nodegroups[name]["group"], self.nodegroups[name]["az"]
        for i in range(count):
            labels = {
                **group["labels"],
                "alpha.eksctl.io/nodegroup-name": name,
                "eks.amazonaws.com/nodegroup": name,
                "topology.kubernetes.io/zone": az,
                "node.kubernetes.io/instance-type": group["instanceType"],
            }
            self.kube.add_node(f"ip-{name}-{i}", labels=labels, allocatable=ALLOCATABLE[group["instanceType"]])

    def _helm_install(self, argv: list[str]) -> tuple[int, str, str]:
        name, chart = argv[3], argv[4]
        ns, version = self._opt(argv, "--namespace"), self._opt(argv, "--version")
        assert Path(self._opt(argv, "--values")).is_file(), "the values file is written before helm runs"
        assert Path(self._opt(argv, "--kubeconfig")).is_file(), "helm uses this folder's kubeconfig"
        self.releases[(ns, name)] = {"status": "deployed", "chart": f"{chart}-{version}"}
        labels = {"app.kubernetes.io/instance": name}
        crash = name in self.crash_plugins
        if name == "nvidia-device-plugin":
            self.kube.add_daemon_set(
                ns, name, labels=labels, node_selector={"nvidia.com/gpu.present": "true"},
                advertises={m.GPU_RESOURCE: "4"}, crash=crash,
            )  # fmt: skip
        elif name == "aws-efa-k8s-device-plugin":
            self.kube.add_daemon_set(
                ns, name, labels=labels, node_selector={"role": "gpu-worker"}, advertises={m.EFA_RESOURCE: "1"},
                crash=crash,
            )  # fmt: skip
        elif name == "kuberay-operator":
            self.kube.add_pod(
                ns, "kuberay-operator-7d9f", labels={"app.kubernetes.io/instance": name}, node="ip-system-0"
            )
            crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition"}
            self.kube.apply({**crd, "metadata": {"name": "rayclusters.ray.io"}})
        self.kube.tick()
        return 0, f'Release "{name}" has been upgraded. Happy Helming!\n', ""


# The end of what `ray job submit` (Ray 2.60) prints when the dashboard found no job agent within its 10 s.
AGENT_BUSY = """  File ".../ray/dashboard/modules/dashboard_sdk.py", line 305, in _raise_error
    raise RuntimeError(
RuntimeError: Request failed with status code 500: No available agent to submit job, please try again later..
"""


class FakeRay:
    """Answers the commands the steps run inside the Ray pods.

    ``worker_logs``: the NCCL fixture folder (or file) each worker's Ray session logs hold, by worker index.
    ``outcome``: the final status of a submitted job. ``efa``: whether ``fi_info -p efa`` finds the provider.
    """

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.jobs: dict[str, str] = {}
        self.submitted: list[list[str]] = []
        self.outcome = "SUCCEEDED"
        self.efa = True
        self.worker_logs: list[Path] = [
            FIXTURES / "ray_session_logs" / "node-0",
            FIXTURES / "ray_session_logs" / "node-1",
        ]
        self.unpacked: Path | None = None
        # The first ``agent_busy`` submits get the dashboard's 500 while its job agent is not ready; with
        # ``agent_took_it`` the agent took the job all the same (the dashboard stopped waiting for its answer).
        self.agent_busy = 0
        self.agent_took_it = False

    def __call__(self, ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:3] == ["ray", "job", "submit"]:
            self.submitted.append(argv)
            sid = argv[argv.index("--submission-id") + 1]
            if sid in self.jobs:
                return ExecResult(1, "", f"RuntimeError: Request failed with status code 400: Job {sid} exists.\n")
            if len(self.submitted) <= self.agent_busy:
                if self.agent_took_it:
                    self.jobs[sid] = "RUNNING"
                return ExecResult(1, "", AGENT_BUSY)
            self.jobs[sid] = "RUNNING"
            return ExecResult(0, f"Job '{sid}' submitted successfully\n")
        if argv[:3] == ["ray", "job", "logs"]:
            sid = argv[-1]
            if "--follow" in argv:
                self.jobs[sid] = self.outcome
            return ExecResult(0, "step 10 loss 2.31\nstep 20 loss 1.87\n")
        if argv[:3] == ["ray", "job", "status"]:
            # As Ray's job CLI prints it: the status while pending or running, a sentence once the job has ended.
            sid = argv[-1]
            if sid not in self.jobs:
                return ExecResult(1, "", f"RuntimeError: Request failed with status code 404: no job {sid}.\n")
            status = self.jobs[sid]
            ended = {"SUCCEEDED": "succeeded", "FAILED": "failed", "STOPPED": "was stopped"}
            if status in ended:
                return ExecResult(0, f"-----\nJob '{sid}' {ended[status]}\n-----\n")
            return ExecResult(0, f"Status for job '{sid}': {status}\n")
        if argv[:1] == ["test"]:
            local = self.tmp / "head" / argv[-1].lstrip("/")
            return ExecResult(0 if local.is_file() else 1, "")
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] == shipping._UNPACK:
            dest = self.tmp / "head" / argv[3].lstrip("/")
            self.unpacked = dest
            return run_script(argv[2], [str(dest)], stdin)
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] == sub._NCCL_LINES:
            index = int(pod.rsplit("-", 1)[1])
            source = self.worker_logs[index]
            if source.is_file():  # a single log file: stands in for the whole session folder
                folder = self.tmp / f"logs-{index}"
                folder.mkdir(exist_ok=True)
                (folder / "worker-1.out").write_text(source.read_text())
                source = folder
            return run_script(argv[2], [str(source)])
        if argv[1:] == ["-p", "efa"]:
            if self.efa:
                return ExecResult(0, "provider: efa\n    fabric: efa\n    domain: rdmap0s31-rdm\n")
            return ExecResult(61, "", "fi_getinfo: -61 (No data available)\n")
        if argv == ["nvidia-smi"]:
            return ExecResult(0, "| NVIDIA-SMI 570.172.08   Driver Version: 570.172.08   CUDA Version: 13.0 |\n")
        raise AssertionError(f"unexpected exec in {pod}: {argv[:3]}")


def run_script(code: str, args: list[str], stdin: str | None = None) -> ExecResult:
    """Run a ``python -c`` script the steps send into a pod, here and in-process (a subprocess costs 0.2 s)."""
    out = io.StringIO()
    saved = sys.argv, sys.stdin
    sys.argv, sys.stdin = ["-c", *args], io.StringIO(stdin or "")
    code_ = 0
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<pod>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        code_ = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv, sys.stdin = saved
    return ExecResult(code_, out.getvalue())


class World:
    """One deployment against the fakes: ``d`` (the Deployment), ``kube``, ``tools``, ``ray`` and ``lines`` said."""

    def __init__(self, tmp: Path, cfg: Config) -> None:
        self.kube = FakeKube()
        self.tools = FakeTools(self.kube)
        self.ray = FakeRay(tmp)
        self.kube.exec_handler = self.ray
        self.lines: list[str] = []
        self.store = StateStore(tmp / ".raytrain-eks")
        self.d = Deployment(
            cfg=cfg,
            kube=self.kube,
            run=self.tools,
            state=self.store,
            say=self.lines.append,
            sleep=self.kube.sleep,
            clock=self.kube.monotonic,
            require_tool=self.tools.require,
        )

    def up(self, **kw: Any) -> lifecycle.UpResult:
        kw.setdefault("offered_zones", lambda: nodegroups.Placement(list(ZONES)))
        return lifecycle.up(self.d, confirm=lambda q: True, **kw)

    def submit(self, **kw: Any) -> sub.SubmitResult:
        """Submit as the commands do: with what ``up`` remembered applied (the checkpoint bucket among it)."""
        return sub.submit(dataclasses.replace(self.d, cfg=apply_state(self.d.cfg, self.store)), **kw)

    def said(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def cfg() -> Config:
    return load_config(environ={}, path=None)


@pytest.fixture
def world(tmp_path: Path, cfg: Config, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    """A deployment whose AWS reads (what ``down`` leaves behind) go to moto's server, never to an account."""
    monkeypatch.chdir(tmp_path)  # no raytrain-eks.yaml of the repository is read
    return World(tmp_path, cfg)


@pytest.fixture
def ready(world: World) -> World:
    world.up()
    world.lines.clear()
    return world


# ------------------------------------------------------------------------------------------------------------------
# runner
# ------------------------------------------------------------------------------------------------------------------


def test_runner_runs_an_argv_list_and_captures_output():
    lines: list[str] = []
    done = runner.run(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
        timeout=30,
        on_output=lines.append,
    )
    assert done.ok and done.stdout == "out\n" and done.stderr == "err\n"
    assert sorted(lines) == ["err", "out"]
    assert (
        runner.run([sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1])"], timeout=30, input="abc").stdout
        == "cba\n"
    )
    with pytest.raises(TypeError):
        runner.run("echo hi", timeout=5)  # type: ignore[arg-type]


def test_runner_failure_names_command_status_stderr_and_next_step():
    script = "import sys; print('\\n'.join(f'line {i}' for i in range(40)), file=sys.stderr); sys.exit(3)"
    with pytest.raises(CommandError) as err:
        runner.run([sys.executable, "-c", script], timeout=30, hint="Do the next thing.")
    e = err.value
    assert e.returncode == 3 and e.argv[0] == sys.executable and isinstance(e, UserError)
    assert e.stderr_tail.splitlines() == [f"line {i}" for i in range(20, 40)]
    assert "failed with exit status 3" in e.message and "line 39" in e.message and e.hint == "Do the next thing."
    assert runner.run([sys.executable, "-c", "raise SystemExit(4)"], timeout=30, check=False).returncode == 4


def test_runner_timeout_stops_the_command():
    with pytest.raises(CommandError) as err:
        runner.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert err.value.timed_out and "timed out after" in err.value.message


@pytest.mark.parametrize("tool", ["eksctl", "helm", "kubectl"])
def test_missing_tool_is_named_with_how_to_install_it(tool: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MissingToolError) as err:
        runner.require_tool(tool)
    assert f"`{tool}` is not installed" in str(err.value) and "Install" in (err.value.hint or "")
    with pytest.raises(MissingToolError):
        runner.run([tool, "version"], timeout=5)


# ------------------------------------------------------------------------------------------------------------------
# up
# ------------------------------------------------------------------------------------------------------------------


def test_up_creates_cluster_node_groups_plugins_and_kuberay_in_order(world: World):
    result = world.up()
    t = world.tools
    verbs = [" ".join(c[:3]) for c in t.calls if c[1] in ("create", "upgrade", "utils")]
    assert verbs == [
        "eksctl create cluster",
        "eksctl utils write-kubeconfig",
        "eksctl create nodegroup",
        "eksctl create nodegroup",
        "helm upgrade --install",
        "helm upgrade --install",
        "helm upgrade --install",
    ]
    assert [c[3] for c in t.commands("helm", "upgrade")] == [
        "nvidia-device-plugin",
        "aws-efa-k8s-device-plugin",
        "kuberay-operator",
    ]
    # eksctl's own EFA plugin is gone: only the pinned charts advertise devices.
    assert [ds.name for ds in world.kube.daemon_sets("kube-system")] == [
        "nvidia-device-plugin",
        "aws-efa-k8s-device-plugin",
    ]
    nodes = world.kube.nodes({"role": "gpu-worker"})
    assert result.gpu_nodes == [n.name for n in nodes] and len(nodes) == 2
    assert all(n.allocatable[m.GPU_RESOURCE] == "4" and n.allocatable[m.EFA_RESOURCE] == "1" for n in nodes)
    # The region and zone are remembered for later commands; everything created is listed for down.
    state = json.loads(world.store.path.read_text())
    assert (state["region"], state["gpu_az"], state["phase"]) == ("us-east-1", "us-east-1a", "up")
    assert [i["type"] for i in state["created"]] == [
        "bucket",
        "cluster",
        "nodegroup",
        "nodegroup",
        "helm",
        "helm",
        "helm",
    ]
    assert t.cluster["azs"] == ZONES
    gpu_file = yaml.safe_load((world.store.root / "eksctl-nodegroup-gpu-efa.yaml").read_text())
    assert gpu_file["managedNodeGroups"][0]["availabilityZones"] == ["us-east-1a"]
    assert all("--install-nvidia-plugin=false" in c for c in t.commands("eksctl", "create", "nodegroup"))
    assert "Ready: cluster ray-train-eks" in world.said()


def test_up_tries_the_next_zone_and_says_why_the_launch_failed(world: World):
    world.tools.no_capacity = {"us-east-1a"}
    result = world.up()
    assert result.gpu_az == "us-east-1b"
    said = world.said()
    assert "g6.12xlarge could not launch in us-east-1a" in said and "InsufficientInstanceCapacity" in said
    assert "Removing the failed node group gpu-efa; trying us-east-1b next" in said
    # The failed group is deleted before the next zone is tried.
    t = world.tools
    idx = [
        i
        for i, c in enumerate(t.calls)
        if c[:3] in (["eksctl", "create", "nodegroup"], ["eksctl", "delete", "nodegroup"])
    ]
    kinds = [(t.calls[i][1], Path(t.calls[i][4]).name if t.calls[i][1] == "create" else t.calls[i][-2]) for i in idx]
    assert kinds == [
        ("create", "eksctl-nodegroup-system.yaml"),
        ("create", "eksctl-nodegroup-gpu-efa.yaml"),
        ("delete", "gpu-efa"),
        ("create", "eksctl-nodegroup-gpu-efa.yaml"),
    ]
    assert {n.zone for n in world.kube.nodes({"role": "gpu-worker"})} == {"us-east-1b"}
    assert world.store.get("gpu_az") == "us-east-1b"
    assert "us-east-1a" in world.store.get("zone_failures")


def test_up_fails_with_every_zone_reason_when_none_can_launch(world: World):
    world.tools.no_capacity = set(ZONES)
    with pytest.raises(UserError) as err:
        world.up()
    assert all(z in err.value.message for z in ZONES) and "Capacity Reservation" in (err.value.hint or "")
    assert len(world.tools.commands("eksctl", "delete", "nodegroup")) == 3
    # The cluster stays recorded, so down still deletes it.
    assert [i["type"] for i in world.store.created] == ["bucket", "cluster", "nodegroup"]


def test_rerunning_up_after_a_failure_resumes(world: World):
    world.tools.fail_once["helm upgrade --install aws-efa-k8s-device-plugin"] = "Error: context deadline exceeded"
    with pytest.raises(CommandError) as err:
        world.up()
    assert "context deadline exceeded" in err.value.message and "raytrain-eks up" in (err.value.hint or "")
    first = len(world.tools.calls)
    world.up()
    again = world.tools.calls[first:]
    assert not [c for c in again if c[1] == "create"], "nothing is created twice"
    assert [c[3] for c in again if c[:2] == ["helm", "upgrade"]] == ["aws-efa-k8s-device-plugin", "kuberay-operator"]
    assert "Helm release nvidia-device-plugin (nvidia-device-plugin 0.20.0) is installed" in world.said()
    assert len(world.store.created) == 7


def test_rerun_removes_a_failed_node_group_first(world: World):
    world.tools.fail_once["eksctl create nodegroup"] = "Error: AccessDenied: not authorized to perform iam:PassRole"
    with pytest.raises(CommandError):
        world.up()  # the system group: not a launch failure, so no zone hopping
    world.tools.nodegroups["system"] = {"status": "CREATE_FAILED", "az": "us-east-1a"}
    world.up()
    deletes = world.tools.commands("eksctl", "delete", "nodegroup")
    assert [c[-2] for c in deletes] == ["system"] and "is CREATE_FAILED" in world.said()


def test_up_does_not_trust_helm_device_plugins_must_be_ready_on_every_node(world: World):
    world.tools.crash_plugins = {"aws-efa-k8s-device-plugin"}
    with pytest.raises(NodesNotReady) as err:
        world.up()
    text = str(err.value)
    assert "vpc.amazonaws.com/efa=0, a worker pod needs 1" in text and "CrashLoopBackOff" in text
    assert "raytrain-eks up" in (err.value.hint or "")
    assert world.kube.time >= addons.GPU_READY_TIMEOUT_S  # it waited (in simulated time) before giving up


def test_up_asks_once_and_creates_nothing_when_declined(world: World):
    questions: list[str] = []
    with pytest.raises(Cancelled):
        lifecycle.up(
            world.d, confirm=lambda q: questions.append(q) or False, offered_zones=lambda: nodegroups.Placement(ZONES)
        )
    assert len(questions) == 1 and "$9.55 per hour" in questions[0]
    assert world.tools.calls == [] and world.store.created == []


def test_up_needs_a_zone_source(world: World):
    with pytest.raises(UserError) as err:
        world.up(offered_zones=None)
    assert "GPU_AZ" in (err.value.hint or "") and world.tools.calls == []


def test_pinned_zone_is_the_only_one_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str):
    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1c"}, path=None))
    w.tools.no_capacity = {"us-east-1c"}
    with pytest.raises(UserError, match="us-east-1c"):
        w.up()
    assert w.tools.cluster["azs"] == ["us-east-1c", "us-east-1a"]
    assert len(w.tools.commands("eksctl", "create", "nodegroup")) == 2  # system + the one GPU zone


def test_up_launches_into_the_reservation_the_capacity_check_found(world: World):
    placement = nodegroups.Placement(["us-east-1b", "us-east-1a"], {"us-east-1b": "cr-0123456789abcdef0"})
    result = world.up(offered_zones=lambda: placement)
    assert result.gpu_az == "us-east-1b"
    doc = yaml.safe_load((world.store.root / "eksctl-nodegroup-gpu-efa.yaml").read_text())
    schema = json.loads((SCHEMAS / "eksctl" / "clusterconfig.v1alpha5.schema.json").read_text())
    assert not list(jsonschema.validators.validator_for(schema)(schema).iter_errors(doc))
    (gpu,) = doc["managedNodeGroups"]
    assert gpu["capacityReservation"] == {
        "capacityReservationTarget": {"capacityReservationID": "cr-0123456789abcdef0"}
    }
    assert gpu["availabilityZones"] == ["us-east-1b"] and "placement" not in gpu
    system = yaml.safe_load((world.store.root / "eksctl-nodegroup-system.yaml").read_text())["managedNodeGroups"][0]
    assert "capacityReservation" not in system, "the system node is not in the GPU reservation"
    assert "in us-east-1b, into capacity reservation cr-0123456789abcdef0" in world.said()


def test_a_configured_zone_is_checked_before_anything_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from raytrain_eks.aws.capacity import CapacityError

    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1c"}, path=None))

    def quota_short() -> nodegroups.Placement:
        raise CapacityError("quota short in us-east-1: 2 x g6.12xlarge need 96 vCPUs ...")

    with pytest.raises(CapacityError, match="quota short"):
        w.up(offered_zones=quota_short)
    with pytest.raises(
        UserError, match="cannot go to us-east-1c now; the capacity check finds room only in us-east-1a"
    ):
        w.up(offered_zones=lambda: nodegroups.Placement(["us-east-1a"]))
    assert w.tools.calls == [] and w.store.created == []


def test_the_clusters_second_zone_also_offers_the_gpu_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str
):
    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1c"}, path=None))
    w.up(offered_zones=lambda: nodegroups.Placement(["us-east-1c"], offered=["us-east-1b", "us-east-1c"]))
    assert w.tools.cluster["azs"] == ["us-east-1c", "us-east-1b"], "not the alphabetical default us-east-1a"


def test_a_pinned_zone_keeps_the_configured_availability_zones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str
):
    monkeypatch.chdir(tmp_path)
    azs = ["us-east-1a", "us-east-1b", "us-east-1c"]
    cfg = load_config(environ={}, path=None, overrides={"cluster": {"gpu_az": "us-east-1b", "availability_zones": azs}})
    w = World(tmp_path, cfg)
    result = w.up(offered_zones=lambda: nodegroups.Placement(["us-east-1b"], offered=["us-east-1b", "us-east-1d"]))
    assert result.gpu_az == "us-east-1b"
    assert w.tools.cluster["azs"] == ["us-east-1b", "us-east-1a", "us-east-1c"], "the configured zones, as plan shows"


def test_missing_eksctl_stops_up_before_anything(world: World):
    world.tools.missing = {"eksctl"}
    with pytest.raises(MissingToolError, match="eksctl"):
        world.up()
    assert world.tools.calls == []


def test_up_plan_prints_every_action_and_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)

    def forbidden(*a: Any, **k: Any) -> None:
        raise AssertionError("up --plan must not build a deployment")

    monkeypatch.setattr(deploy_commands, "make_deployment", forbidden)
    app = typer.Typer()
    deploy_commands.register(app)
    result = CliRunner().invoke(app, ["up", "--plan", "--train"])
    assert result.exit_code == 0, result.output
    for name in ("create-cluster", "nodegroup-gpu", "helm-kuberay-operator", "check-gpu-nodes"):
        assert name in result.output
    assert "$ eksctl create cluster -f .raytrain-eks/eksctl-cluster.yaml" in result.output
    assert "about $9.55 per hour" in result.output
    assert not (tmp_path / ".raytrain-eks").exists()


def test_up_train_runs_the_job_with_its_checkpoints_in_the_bucket_up_created(
    world: World, monkeypatch: pytest.MonkeyPatch
):
    # The command builds its deployment before up creates the bucket; the job it then submits must still keep its
    # checkpoints there (node-local storage across two GPU nodes is refused before any job is submitted).
    def make_deployment(cfg: Config, state_dir: Path, say: Callable[[str], None] | None = None) -> Deployment:
        world.d = dataclasses.replace(world.d, cfg=deploy_commands.remembered_config(cfg, world.store, world.d.say))
        return world.d

    monkeypatch.setattr(deploy_commands, "make_deployment", make_deployment)
    monkeypatch.setattr(nodegroups, "placement_zones", lambda cfg: nodegroups.Placement(list(ZONES)))
    app = typer.Typer()
    deploy_commands.register(app)
    result = CliRunner().invoke(app, ["up", "--train", "-y"])
    assert result.exit_code == 0, f"{result.output}\n{world.said()}\n{result.exception!r}"
    bucket = world.store.get("bucket")
    assert bucket and len(world.ray.submitted) == 1
    cfg = world.d.cfg
    job = world.kube.get("v1", "ConfigMap", cfg.ray.cluster_name + "-config", cfg.ray.namespace)
    assert yaml.safe_load(job["data"]["raytrain-eks.yaml"])["training"]["storage_path"] == f"s3://{bucket}/runs"


def test_submit_refuses_node_local_checkpoints_across_nodes_before_anything(ready: World):
    calls = (len(ready.kube.applied), len(ready.kube.exec_calls))
    local = ready.d.cfg.model_copy(
        update={"training": ready.d.cfg.training.model_copy(update={"storage_path": "/home/ray/ckpt"})}
    )
    with pytest.raises(UserError, match="storage_path = '/home/ray/ckpt'.*span 2 nodes") as err:
        sub.submit(dataclasses.replace(ready.d, cfg=local))
    assert err.value.exit_code == 2 and "s3://BUCKET/PREFIX" in str(err.value)
    assert (len(ready.kube.applied), len(ready.kube.exec_calls)) == calls and ready.ray.submitted == []


def test_up_plan_shows_the_helm_commands_up_runs(world: World):
    world.up()
    ran = [
        shlex.join(c).replace(f"{world.store.root}/", ".raytrain-eks/") for c in world.tools.commands("helm", "upgrade")
    ]
    planned = [shlex.join(a.argv or []) for a in lifecycle.planned_actions(world.d.cfg) if a.name.startswith("helm-")]
    assert len(ran) == 3 and ran == planned


# ------------------------------------------------------------------------------------------------------------------
# submit
# ------------------------------------------------------------------------------------------------------------------


def test_submit_waits_for_the_job_agent_of_a_head_that_has_just_started(ready: World):
    ready.ray.agent_busy = 2
    start = ready.kube.time
    result = ready.submit(hf_token=TOKEN)
    assert result.exit_code == 0 and result.job_status == "SUCCEEDED"
    # The same submission three times, five seconds apart, and one job.
    ids = [argv[argv.index("--submission-id") + 1] for argv in ready.ray.submitted]
    assert len(ids) == 3 and set(ids) == {result.submission_id} and list(ready.ray.jobs) == ids[:1]
    assert ready.said().count("job agent in ray-train-head-0 is not ready yet; submitting again in 5 s") == 2
    assert ready.kube.time - start >= 2 * sub.AGENT_RETRY_S


def test_submit_does_not_submit_twice_a_job_the_busy_agent_took(ready: World):
    ready.ray.agent_busy, ready.ray.agent_took_it = 1, True
    result = ready.submit(hf_token=TOKEN)
    assert result.exit_code == 0 and result.job_status == "SUCCEEDED"
    assert len(ready.ray.submitted) == 1 and list(ready.ray.jobs) == [result.submission_id]
    assert "not ready yet" not in ready.said()


def test_submit_gives_up_when_the_job_agent_never_comes(ready: World):
    ready.ray.agent_busy = 10**6
    with pytest.raises(CommandError) as err:
        ready.submit(hf_token=TOKEN)
    assert "No available agent to submit job" in err.value.message
    assert f"still not ready after {sub.AGENT_WAIT_S:.0f} s" in (err.value.hint or "")
    tries = sub.AGENT_WAIT_S / sub.AGENT_RETRY_S  # one every 5 s for 3 minutes, then no more
    assert tries <= len(ready.ray.submitted) <= tries + 2
    assert not ready.ray.jobs


def test_submit_does_not_retry_other_errors(ready: World):
    real = ready.ray.__call__

    def refuse(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:3] == ["ray", "job", "submit"]:
            ready.ray.submitted.append(argv)
            return ExecResult(1, "", "RuntimeError: Request failed with status code 400: runtime_env is invalid\n")
        return real(ns, pod, argv, stdin)

    ready.kube.exec_handler = refuse
    with pytest.raises(CommandError) as err:
        ready.submit(hf_token=TOKEN)
    assert "runtime_env is invalid" in err.value.message and len(ready.ray.submitted) == 1
    assert "not ready" not in (err.value.hint or "")


def test_submit_runs_the_job_from_the_head_pod_and_checks_efa(ready: World):
    result = ready.submit(hf_token=TOKEN)
    assert result.exit_code == 0 and result.job_status == "SUCCEEDED"
    assert result.report is not None and result.report.verdict == "efa" and result.efa_provider is True
    assert result.versions == {"driver": "570.172.08", "cuda": "13.0"}
    # Submitted through exec in the head pod, to the dashboard on the pod's own loopback.
    (argv,) = ready.ray.submitted
    head_calls = [c for c in ready.kube.exec_calls if c[2][:3] == ["ray", "job", "submit"]]
    assert head_calls[0][1] == "ray-train-head-0"
    assert argv[argv.index("--address") + 1] == "http://127.0.0.1:8265"
    assert argv[argv.index("--") + 1 :] == [
        "python3",
        "-m",
        "raytrain_eks.cli",
        "train",
        "--address",
        "auto",
        "--config",
        "/etc/raytrain-eks/raytrain-eks.yaml",
    ]
    env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    names = [p.split("=")[0].split(">")[0].split("[")[0] for p in env["pip"]]
    assert "transformers" in names and "torch" not in names and "ray" not in names and "kubernetes" not in names
    (module,) = env["py_modules"]
    assert module.startswith(shipping.HEAD_CODE_ROOT) and module.endswith("/raytrain_eks")
    # The package really arrived in the "head pod" (the unpack script ran on its stdin).
    assert ready.ray.unpacked is not None and (ready.ray.unpacked / "raytrain_eks" / "__init__.py").is_file()
    assert (ready.ray.unpacked / "raytrain_eks" / "resources" / "sample_instructions.jsonl").is_file()
    # Logs were streamed; NCCL lines were read in every worker pod.
    assert "step 20 loss 1.87" in ready.said()
    nccl = [c[1] for c in ready.kube.exec_calls if c[2][:2] == [m.IMAGE_PYTHON, "-c"] and c[2][2] == sub._NCCL_LINES]
    assert nccl == ["ray-train-gpu-workers-worker-0", "ray-train-gpu-workers-worker-1"]
    assert "OK: the job succeeded" in ready.said()


def test_the_token_reaches_only_the_secret(ready: World):
    ready.submit(hf_token=TOKEN)
    secrets = [o for o in ready.kube.applied if o["kind"] == "Secret"]
    assert secrets and secrets[0]["stringData"][m.HF_TOKEN_KEY] == TOKEN
    elsewhere = [o for o in ready.kube.applied if o["kind"] != "Secret"]
    assert TOKEN not in json.dumps(elsewhere)
    assert TOKEN not in json.dumps([c[2] for c in ready.kube.exec_calls]) + json.dumps(ready.tools.calls)
    assert TOKEN not in ready.said() and TOKEN not in ready.store.path.read_text()
    raycluster = next(o for o in ready.kube.applied if o["kind"] == "RayCluster")
    assert (
        m.hf_token_env(ready.d.cfg)
        in raycluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    )


def test_submit_fails_fast_with_the_fix_when_a_node_lacks_efa(ready: World):
    node = ready.kube.nodes({"role": "gpu-worker"})[1].name
    ready.kube.set_allocatable(node, m.EFA_RESOURCE, None)
    before = ready.kube.time
    with pytest.raises(NodesNotReady) as err:
        ready.submit()
    assert f"node {node} advertises vpc.amazonaws.com/efa=0, a worker pod needs 1" in str(err.value)
    assert "raytrain-eks up" in (err.value.hint or "")
    assert ready.kube.time == before, "no waiting"
    assert not ready.kube.objects("RayCluster") and not ready.kube.exec_calls


def test_submit_fails_fast_when_a_node_has_too_few_gpus(ready: World):
    node = ready.kube.nodes({"role": "gpu-worker"})[0].name
    ready.kube.set_allocatable(node, m.GPU_RESOURCE, "2")
    with pytest.raises(NodesNotReady, match="nvidia.com/gpu=2, a worker pod needs 4"):
        ready.submit()


def test_pending_pods_time_out_with_the_events_that_explain_them(ready: World):
    for node in ready.kube.nodes({"role": "gpu-worker"}):
        ready.kube.set_allocatable(node.name, "cpu", "32")  # the worker pod requests 40
    with pytest.raises(sub.PodsNotReady) as err:
        ready.submit()
    text = str(err.value)
    assert "ray-train-gpu-workers-worker-0: Pending" in text
    assert "Warning FailedScheduling: 0/3 nodes are available:" in text and "Insufficient cpu" in text
    assert "ray-train-head-0: Running" in text
    assert "FailedScheduling" in (err.value.hint or "")
    assert ready.kube.time >= ready.d.cfg.ray.job_start_deadline_s
    assert "workers 0/2 running" in ready.said()  # progress while waiting


def test_image_pull_errors_are_shown_on_timeout(ready: World):
    ready.kube.image_pull_error = 'Failed to pull image "public.ecr.aws/...": not found'
    with pytest.raises(sub.PodsNotReady) as err:
        ready.submit()
    assert "ImagePullBackOff" in str(err.value) and "Failed to pull image" in str(err.value)


def test_efa_missing_from_the_nccl_lines_gives_a_non_zero_exit(ready: World):
    log = FIXTURES / "socket_fallback_nccl2.27_kubectl.log"
    ready.ray.worker_logs = [log, log]
    result = ready.submit()
    assert result.job_status == "SUCCEEDED" and result.report is not None and result.report.verdict == "socket"
    assert result.exit_code == 1
    assert "does not meet fabric.require = efa" in ready.said()


def test_no_nccl_lines_is_inconclusive_exit_2(ready: World, tmp_path: Path):
    empty = tmp_path / "empty-logs"
    empty.mkdir()
    ready.ray.worker_logs = [empty, empty]
    assert ready.submit().exit_code == 2


def test_fi_info_without_efa_fails_the_run(ready: World):
    ready.ray.efa = False
    result = ready.submit()
    assert result.exit_code == 1 and result.efa_provider is False
    assert "fi_getinfo: -61" in ready.said()


def test_a_failed_job_fails_the_run(ready: World):
    ready.ray.outcome = "FAILED"
    result = ready.submit()
    assert result.exit_code == 1 and "the job ended FAILED" in ready.said()


def test_resubmitting_follows_a_job_still_running_instead_of_submitting_twice(ready: World):
    ready.ray.outcome = "RUNNING"  # the log stream ends (a dropped connection) while the job runs
    ready.d.cfg = ready.d.cfg.model_copy(update={"ray": ready.d.cfg.ray.model_copy(update={"job_deadline_s": 60})})
    first = ready.submit()
    assert first.job_status == "RUNNING" and first.exit_code == 1
    ready.ray.outcome = "SUCCEEDED"
    second = ready.submit()
    assert len(ready.ray.submitted) == 1 and second.submission_id == first.submission_id
    assert second.exit_code == 0 and "following it instead of submitting again" in ready.said()


def test_a_broken_log_stream_is_followed_again(ready: World):
    from raytrain_eks.k8s.cluster import KubeApiError

    answer, broken = ready.kube.exec_handler, []

    def breaks_once(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult | None:
        if argv[:3] == ["ray", "job", "logs"] and not broken:
            broken.append(argv)
            raise KubeApiError(f"Kubernetes API: exec in {ns}/{pod} failed: the connection broke (reset)")
        return answer(ns, pod, argv, stdin)

    ready.kube.exec_handler = breaks_once
    result = ready.submit()
    assert broken and result.exit_code == 0 and result.job_status == "SUCCEEDED"
    said = ready.said()
    assert "The log stream broke: Kubernetes API: exec in default/ray-train-head-0 failed" in said
    assert "following it again" in said and "step 20 loss 1.87" in said
    assert len(ready.ray.submitted) == 1, "followed again, not submitted again"


def test_package_is_uploaded_once(ready: World):
    ready.submit()
    ready.submit()
    unpacks = [c for c in ready.kube.exec_calls if c[2][:2] == [m.IMAGE_PYTHON, "-c"] and c[2][2] == shipping._UNPACK]
    assert len(unpacks) == 1 and len(ready.ray.submitted) == 2


def test_rayjob_mode_renders_a_rayjob_that_ships_the_code(ready: World):
    result = ready.submit(mode="rayjob")
    assert result.exit_code == 0
    (job,) = ready.kube.objects("RayJob")
    schema = json.loads((SCHEMAS / "kuberay" / "rayjob.v1.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate({k: v for k, v in job.items() if k != "status"})
    spec = job["spec"]
    assert shlex.split(spec["entrypoint"]) == m.train_argv()
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert env["py_modules"] == [f"{shipping.SUBMITTER_CODE_DIR}/raytrain_eks"] and env["pip"]
    submitter = spec["submitterPodTemplate"]["spec"]
    assert submitter["containers"][0]["volumeMounts"][0]["mountPath"] == shipping.SUBMITTER_CODE_DIR
    code = next(o for o in ready.kube.objects("ConfigMap") if o["metadata"]["name"] == "ray-train-code")
    assert len(json.dumps(code["data"]).encode()) < 1 << 20, "a ConfigMap holds at most 1 MiB"
    items = submitter["volumes"][0]["configMap"]["items"]
    assert {"key": "raytrain_eks____init__.py", "path": "raytrain_eks/__init__.py"} in items
    assert not ready.ray.submitted, "KubeRay's submitter submits a RayJob, not raytrain-eks"
    assert ready.store.get("job")["id"] == "ray-train-job"


def _after_dashdash(argv: list[str]) -> list[str]:
    return argv[argv.index("--") + 1 :]


def test_the_plans_submit_commands_are_what_submit_runs_in_the_head_pod(ready: World, tmp_path: Path):
    # What `plan -o DIR` writes for --mode raycluster, run as written, must be what `submit` does: unpack the same
    # package into the same folder, then `ray job submit` with the same runtime_env and entrypoint.
    plan, _ = write_plan(ready.d.cfg, tmp_path / "plan-out")
    steps = {s.name: s for s in plan.steps}
    ready.submit()
    (_, pod, unpack, stdin), *_ = [c for c in ready.kube.exec_calls if c[2][:2] == [m.IMAGE_PYTHON, "-c"]]
    assert pod == "ray-train-head-0"
    assert _after_dashdash(steps["upload-package"].command) == unpack
    assert (tmp_path / "plan-out" / steps["upload-package"].stdin).read_text() == stdin
    (sent,) = ready.ray.submitted
    planned = _after_dashdash(steps["submit"].command)
    # submit names its job and returns at once (it follows the logs itself); everything else is the same argv.
    sid = sent.index("--submission-id")
    assert [a for i, a in enumerate(sent) if i not in (sid, sid + 1) and a != "--no-wait"] == planned
    env = json.loads(planned[planned.index("--runtime-env-json") + 1])
    assert env["pip"] and env["py_modules"] == [f"{unpack[-1]}/raytrain_eks"]
    assert _after_dashdash(planned) == m.train_argv()


def test_the_plans_rayjob_is_the_one_submit_applies(ready: World, tmp_path: Path):
    out = tmp_path / "plan-out"
    write_plan(ready.d.cfg, out, mode="rayjob")
    assert ready.submit(mode="rayjob").exit_code == 0
    (applied,) = [o for o in ready.kube.applied if o["kind"] == "RayJob"]
    (planned,) = yaml.safe_load_all((out / "rayjob.yaml").read_text())
    assert planned == applied
    assert yaml.safe_load(planned["spec"]["runtimeEnvYAML"])["py_modules"] == [
        f"{shipping.SUBMITTER_CODE_DIR}/raytrain_eks"
    ]
    code = next(o for o in ready.kube.applied if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "ray-train-code")
    assert list(yaml.safe_load_all((out / "code-configmap.yaml").read_text())) == [code]


def test_rayjob_scales_the_gpu_group_to_zero_after_the_job_and_back_for_the_next(ready: World):
    assert ready.submit(mode="rayjob").exit_code == 0
    scale = ready.tools.commands("eksctl", "scale", "nodegroup")
    assert [c[c.index("--nodes") + 1] for c in scale] == ["0"]
    assert not ready.kube.nodes({"role": "gpu-worker"}), "no GPU instance left billing after the RayJob"
    assert "scaling GPU node group gpu-efa to 0" in ready.said()
    ready.kube.set_status("ray.io/v1", "RayJob", "ray-train", "default", {"jobDeploymentStatus": "Complete"})
    assert ready.submit(mode="rayjob").exit_code == 0
    scale = ready.tools.commands("eksctl", "scale", "nodegroup")
    assert [c[c.index("--nodes") + 1] for c in scale] == ["0", "2", "0"]
    ready.up()  # `up` too brings the group back to its size
    assert len(ready.kube.nodes({"role": "gpu-worker"})) == 2
    assert ready.store.get("gpu_scaled_to") == 2


def test_finished_rayjob_is_replaced_on_resubmit(ready: World):
    ready.submit(mode="rayjob")
    ready.kube.set_status("ray.io/v1", "RayJob", "ray-train", "default", {"jobDeploymentStatus": "Complete"})
    ready.submit(mode="rayjob")
    assert ("ray.io/v1", "RayJob", "ray-train", "default") in ready.kube.deleted


def test_image_missing_requirements_are_the_pinned_deps_minus_the_image():
    reqs = shipping.image_missing_requirements()
    assert "transformers==5.23.0" in reqs and "pydantic==2.14.3" in reqs
    assert not [r for r in reqs if r.startswith(("torch", "ray", "pyarrow", "kubernetes", "boto3", "s3fs"))]


# ------------------------------------------------------------------------------------------------------------------
# down, status, logs
# ------------------------------------------------------------------------------------------------------------------


def test_down_deletes_everything_in_reverse_order_and_twice_is_safe(ready: World):
    ready.submit(hf_token=TOKEN)
    created = ready.store.created
    first = len(ready.tools.calls)
    questions: list[str] = []
    result = lifecycle.down(ready.d, confirm=lambda q: questions.append(q) or True)
    assert len(questions) == 1 and "RayCluster default/ray-train" in questions[0]
    assert len(result.deleted) == len(created) and result.leftovers == []
    kinds = [k for (_, k, _, _) in ready.kube.deleted if k != "DaemonSet"]
    assert kinds == ["RayCluster", "ConfigMap", "Secret"]
    tools = [shlex.join(c[:4]) for c in ready.tools.calls[first:] if c[1] in ("uninstall", "delete")]
    assert tools == [
        "helm uninstall kuberay-operator --namespace",
        "helm uninstall aws-efa-k8s-device-plugin --namespace",
        "helm uninstall nvidia-device-plugin --namespace",
        "eksctl delete nodegroup --cluster",
        "eksctl delete nodegroup --cluster",
        "eksctl delete cluster --name",
    ]
    assert [c[-2] for c in ready.tools.commands("eksctl", "delete", "nodegroup")] == ["gpu-efa", "system"]
    assert "Nothing billable is left from this deployment." in ready.said()
    assert ready.tools.cluster is None and not ready.kube.nodes()
    assert not ready.store.path.exists() and not ready.store.kubeconfig.exists()
    # The second down: nothing recorded, nothing run.
    calls = len(ready.tools.calls)
    again = lifecycle.down(StateDeployment(ready), confirm=lambda q: pytest.fail("no question when nothing is left"))
    assert again.deleted == [] and len(ready.tools.calls) == calls
    assert "Nothing to delete" in ready.said()


def StateDeployment(w: World) -> Deployment:  # noqa: N802 - reads like a constructor in the test
    """A fresh Deployment on the same folder, as a new `raytrain-eks down` process would build."""
    w.d.state = StateStore(w.store.root)
    return w.d


def test_down_resumes_after_a_failure(ready: World):
    ready.tools.fail_once["eksctl delete cluster"] = "Error: DELETE_FAILED: eksctl-ray-train-eks-cluster"
    with pytest.raises(CommandError):
        lifecycle.down(ready.d, confirm=lambda q: True)
    assert [i["type"] for i in ready.store.created] == ["bucket", "cluster"]
    lifecycle.down(ready.d, confirm=lambda q: True)
    assert len(ready.tools.commands("eksctl", "delete", "cluster")) == 2
    assert len(ready.tools.commands("eksctl", "delete", "nodegroup")) == 2, "node groups are not deleted twice"


def _leave_behind(cluster: str) -> dict[str, str]:
    """In moto: a NAT gateway and its Elastic IP tagged as eksctl's VPC stack tags them, and a managed node's
    instance tagged as EKS tags it, all of ``cluster``."""
    ec2 = boto3.client("ec2", region_name="us-east-1")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24", AvailabilityZone="us-east-1a")["Subnet"]
    eksctl_tags = [{"Key": "alpha.eksctl.io/cluster-name", "Value": cluster}]
    eip = ec2.allocate_address(Domain="vpc", TagSpecifications=[{"ResourceType": "elastic-ip", "Tags": eksctl_tags}])[
        "AllocationId"
    ]
    nat = ec2.create_nat_gateway(
        SubnetId=subnet["SubnetId"],
        AllocationId=eip,
        TagSpecifications=[{"ResourceType": "natgateway", "Tags": eksctl_tags}],
    )["NatGateway"]["NatGatewayId"]
    node = ec2.run_instances(
        ImageId="ami-12c6146b",
        InstanceType="m7i.xlarge",
        MinCount=1,
        MaxCount=1,
        SubnetId=subnet["SubnetId"],
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "eks:cluster-name", "Value": cluster}]}],
    )["Instances"][0]["InstanceId"]
    return {"nat": nat, "eip": eip, "instance": node}


def test_down_reports_what_still_costs_money_and_checks_again(ready: World):
    mine, other = _leave_behind("ray-train-eks"), _leave_behind("someone-elses-cluster")
    with pytest.raises(UserError) as err:
        lifecycle.down(ready.d, confirm=lambda q: True)
    message = err.value.message
    assert f"NAT gateway {mine['nat']}: `aws ec2 delete-nat-gateway --region us-east-1 --nat-gateway-id" in message
    assert f"Elastic IP {mine['eip']}: `aws ec2 release-address" in message
    assert f"instance {mine['instance']}: `aws ec2 terminate-instances" in message
    assert not any(i in message for i in other.values()), "another cluster's resources are not ours to report"
    assert ready.store.get("leftovers") and ready.tools.cluster is None
    # The user deletes them; the next down finds nothing more to delete, looks again, and forgets the deployment.
    ec2 = boto3.client("ec2", region_name="us-east-1")
    ec2.delete_nat_gateway(NatGatewayId=mine["nat"])
    ec2.release_address(AllocationId=mine["eip"])
    ec2.terminate_instances(InstanceIds=[mine["instance"]])
    again = lifecycle.down(StateDeployment(ready), confirm=lambda q: pytest.fail("nothing is left to confirm"))
    assert again.leftovers == [] and not ready.store.path.exists()
    assert "Nothing billable is left from this deployment." in ready.said()


def test_a_second_down_without_aws_credentials_keeps_the_leftovers_it_cannot_check(
    ready: World, monkeypatch: pytest.MonkeyPatch
):
    mine = _leave_behind("ray-train-eks")
    with pytest.raises(UserError):
        lifecycle.down(ready.d, confirm=lambda q: True)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    with pytest.raises(UserError) as err:
        lifecycle.down(StateDeployment(ready), confirm=lambda q: pytest.fail("nothing is left to confirm"))
    assert "AWS could not be asked now whether they are gone" in err.value.message and mine["nat"] in err.value.message
    assert "Could not check for leftover NAT gateways" in ready.said()
    assert ready.store.path.exists() and ready.store.get("leftovers"), "the record of what still costs money is kept"


def test_down_without_aws_credentials_says_it_could_not_check(ready: World, monkeypatch: pytest.MonkeyPatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    result = lifecycle.down(ready.d, confirm=lambda q: True)
    assert result.leftovers is None and ready.tools.cluster is None
    assert "Could not check for leftover NAT gateways, Elastic IPs or instances: no AWS credentials" in ready.said()
    bucket = ready.store.get("bucket")
    assert f"Kept s3://{bucket}: could not look into it (no AWS credentials found)" in ready.said()
    assert [i["type"] for i in ready.store.created] == ["bucket"], "remembered for a later down"


def test_down_keeps_every_record_when_eksctl_fails_with_another_not_found(ready: World):
    # A missing AWS profile is "not found" too, but says nothing about the cluster: it is not taken as deleted.
    ready.tools.fail_once["eksctl get cluster"] = "Error: failed to get shared config profile, dev: not found"
    created = list(ready.store.created)
    with pytest.raises(CommandError, match="profile, dev: not found"):
        lifecycle.down(ready.d, confirm=lambda q: True)
    assert ready.store.created == created and ready.tools.cluster is not None
    assert not ready.tools.commands("eksctl", "delete")


def _answer(w: World, prefix: list[str], stdout: str) -> None:
    """Make the next commands starting with ``prefix`` succeed with ``stdout`` (another eksctl release's output)."""
    real = w.d.run

    def run(argv: Any, **kw: Any) -> Completed:
        if list(argv[: len(prefix)]) == prefix:
            w.tools.calls.append(list(argv))
            return Completed(tuple(argv), 0, stdout, "")
        return real(argv, **kw)

    w.d.run = run


@pytest.mark.parametrize(
    ("prefix", "stdout", "what"),
    [
        (["eksctl", "get", "cluster"], json.dumps([{"Name": "ray-train-eks"}]), "gave no Status"),
        (["eksctl", "get", "cluster"], "ray-train-eks  ACTIVE", "printed no JSON list"),
        (["eksctl", "get", "nodegroup"], json.dumps([{"Name": "gpu-efa"}]), "gave no Status"),
    ],
)
def test_an_answer_without_a_status_is_unknown_not_active(ready: World, prefix, stdout, what):
    eks_items = [i for i in ready.store.created if i["type"] in ("cluster", "nodegroup")]
    _answer(ready, prefix, stdout)
    with pytest.raises(state.UnreadableAnswer, match=what) as err:
        lifecycle.down(ready.d, confirm=lambda q: True)
    assert "nothing recorded was forgotten" in err.value.message
    kept = [i for i in ready.store.created if i["type"] in ("cluster", "nodegroup")]
    assert kept == eks_items and len(kept) == 3, "the record of the cluster and its node groups is kept"
    assert not ready.tools.commands("eksctl", "delete")
    with pytest.raises(state.UnreadableAnswer):
        lifecycle.status(ready.d)


def test_down_leaves_a_cluster_it_did_not_create(world: World):
    world.tools.cluster = {"name": "ray-train-eks", "azs": ZONES}
    world.up()
    assert "was not created from this folder" in world.said()
    lifecycle.down(world.d, confirm=lambda q: True)
    assert not world.tools.commands("eksctl", "delete", "cluster") and world.tools.cluster is not None


def test_declining_down_deletes_nothing(ready: World):
    with pytest.raises(Cancelled):
        lifecycle.down(ready.d, confirm=lambda q: False)
    assert len(ready.store.created) == 7 and ready.tools.cluster is not None


def test_status_shows_nodes_pods_and_job(ready: World):
    ready.submit()
    text = "\n".join(lifecycle.status(ready.d))
    assert "Cluster ray-train-eks in us-east-1, GPU zone us-east-1a" in text and "EKS cluster: ACTIVE" in text
    assert "Node group gpu-efa: ACTIVE" in text and "nvidia.com/gpu=4 vpc.amazonaws.com/efa=1 Ready" in text
    assert "Ray pod ray-train-head-0: Running Ready" in text and "SUCCEEDED" in text


def test_a_namespace_of_its_own_is_created_first_and_deleted_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str
):
    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={"NAMESPACE": "training"}, path=None))
    w.up()
    assert w.submit().exit_code == 0
    objects = [i for i in w.store.created if i["type"] == "object"]
    assert [o["kind"] for o in objects] == ["Namespace", "ConfigMap", "RayCluster"]
    assert all(o["namespace"] == "training" for o in objects[1:]) and objects[0]["namespace"] is None
    lifecycle.down(w.d, confirm=lambda q: True)
    assert [k for (_, k, _, _) in w.kube.deleted if k != "DaemonSet"] == ["RayCluster", "ConfigMap", "Namespace"]


def test_status_without_a_deployment(world: World):
    assert "Nothing deployed from this folder" in lifecycle.status(world.d)[0]


def test_logs_come_from_inside_the_head_pod(ready: World):
    with pytest.raises(UserError, match="no job was submitted"):
        sub.logs(ready.d)
    ready.submit()
    out: list[str] = []
    assert sub.logs(ready.d, follow=True, on_output=out.append) == 0
    assert "step 10 loss 2.31" in out
    assert ready.kube.exec_calls[-1][2][:4] == ["ray", "job", "logs", "--address"]


def test_logs_and_metrics_of_a_job_whose_head_pod_is_gone_say_so(ready: World):
    ready.submit()
    ready.kube.delete("ray.io/v1", "RayCluster", "ray-train", "default")  # its pods go with it
    with pytest.raises(UserError, match="the head pod of ray-train is not running, so the job's logs are gone"):
        sub.logs(ready.d)
    with pytest.raises(UserError, match="so the job's metrics are gone with it") as err:
        sub.read_metrics(ready.d, "/tmp/raytrain-eks/runs/x")
    assert "raytrain-eks status" in (err.value.hint or "")


def test_later_commands_use_the_remembered_region_and_zone(ready: World, cfg: Config):
    moved = load_config(environ={"REGION": "us-west-2"}, path=None)
    again = state.apply_state(moved, StateStore(ready.store.root))
    assert (again.cluster.region, again.cluster.gpu_az) == ("us-east-1", "us-east-1a")
    assert state.apply_state(cfg, StateStore(ready.store.root / "elsewhere")) is cfg


def test_up_refuses_a_folder_that_belongs_to_another_cluster(ready: World):
    other = load_config(environ={"CLUSTER_NAME": "other"}, path=None)
    ready.d.cfg = other
    with pytest.raises(UserError, match="belongs to cluster ray-train-eks"):
        ready.up()


# ------------------------------------------------------------------------------------------------------------------
# CLI wiring
# ------------------------------------------------------------------------------------------------------------------


def test_cli_submit_exit_code_and_down_twice(ready: World, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(deploy_commands, "make_deployment", lambda cfg, state_dir, *say: StateDeployment(ready))
    log = FIXTURES / "socket_fallback_nccl2.27_kubectl.log"
    ready.ray.worker_logs = [log, log]
    app = typer.Typer()
    deploy_commands.register(app)
    cli = CliRunner()
    assert cli.invoke(app, ["submit"]).exit_code == 1
    assert cli.invoke(app, ["down", "-y"]).exit_code == 0
    second = cli.invoke(app, ["down"])  # no -y: nothing to confirm when nothing is left
    assert second.exit_code == 0
    assert "Nothing to delete" in ready.said()


@pytest.mark.parametrize(("assume_yes", "asked"), [("1", False), ("", True), ("0", True)])
def test_assume_yes_of_env_sh_answers_downs_question(ready: World, monkeypatch, assume_yes, asked):
    monkeypatch.setattr(deploy_commands, "make_deployment", lambda cfg, state_dir, *say: StateDeployment(ready))
    app = typer.Typer()
    deploy_commands.register(app)
    result = CliRunner().invoke(app, ["down"], input="n\n", env={"ASSUME_YES": assume_yes})
    assert ("Continue?" in result.output) is asked
    assert (ready.tools.cluster is None) is not asked, "deleted only when ASSUME_YES=1 answered for the user"


# ------------------------------------------------------------------------------------------------------------------
# Small pieces
# ------------------------------------------------------------------------------------------------------------------


def test_exec_status_channel_parsing():
    assert _exec_returncode("") == 0
    assert _exec_returncode('{"status": "Success"}') == 0
    failure = {"status": "Failure", "details": {"causes": [{"reason": "ExitCode", "message": "3"}]}}
    assert _exec_returncode(json.dumps(failure)) == 3
    missing = {"status": "Failure", "message": 'exec: "fi_info": executable file not found in $PATH'}
    assert _exec_returncode(json.dumps(missing)) == 127


def test_kubernetes_api_is_lazy_and_names_a_bad_kubeconfig(tmp_path: Path):
    from raytrain_eks.k8s.cluster import KubeApiError, KubernetesApi

    api = KubernetesApi(tmp_path / "no-such-kubeconfig")  # building it before the cluster exists is fine
    with pytest.raises(KubeApiError) as err:
        api.nodes()
    assert "no-such-kubeconfig" in err.value.message and "raytrain-eks up" in (err.value.hint or "")


def test_quantities_and_events():
    assert parse_quantity("500m") == 0.5 and parse_quantity("2Gi") == 2 * 2**30 and parse_quantity(4) == 4
    with pytest.raises(ValueError):
        parse_quantity("lots")
    assert str(Event("Warning", "FailedScheduling", "0/3 nodes", 4)) == "Warning FailedScheduling: 0/3 nodes (x4)"


def test_launch_failure_reason_is_the_line_that_says_why():
    text = CAPACITY_ERROR.format(az="us-east-1a")
    assert nodegroups.launch_failure(text).startswith("Nodegroup gpu-efa failed to stabilize")
    assert nodegroups.launch_failure("Error: AccessDenied") is None


# -- the checkpoint bucket ---------------------------------------------------------------------------------------


def test_up_creates_a_private_encrypted_bucket_the_ray_pods_may_use(world: World):
    world.up()
    bucket = world.store.get("bucket")
    s3 = boto3.client("s3", region_name="us-east-1")
    block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert all(block.values()) and len(block) == 4
    rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    tags = {t["Key"]: t["Value"] for t in s3.get_bucket_tagging(Bucket=bucket)["TagSet"]}
    assert tags == {"created-by": "raytrain-eks", "raytrain-eks/cluster": "ray-train-eks"}
    # The cluster's eksctl config gives the Ray pods' service account a role limited to that bucket, and validates.
    doc = yaml.safe_load((world.store.root / "eksctl-cluster.yaml").read_text())
    (account,) = doc["iam"]["serviceAccounts"]
    assert account["metadata"] == {"name": m.RAY_SERVICE_ACCOUNT, "namespace": world.d.cfg.ray.namespace}
    resources = {r for st in account["attachPolicy"]["Statement"] for r in st["Resource"]}
    assert resources == {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"}
    schema = json.loads((SCHEMAS / "eksctl" / "clusterconfig.v1alpha5.schema.json").read_text())
    assert not list(jsonschema.validators.validator_for(schema)(schema).iter_errors(doc))
    # Later commands put the checkpoints there, and the Ray pods run as that service account.
    cfg = state.apply_state(load_config(environ={}, path=None), StateStore(world.store.root))
    assert cfg.training.storage_path == f"s3://{bucket}/runs"
    assert {t["spec"]["serviceAccountName"] for t in m.pod_templates(m.raycluster(cfg))} == {m.RAY_SERVICE_ACCOUNT}
    # Running up again finds the same bucket.
    world.up()
    assert world.store.get("bucket") == bucket and [i["type"] for i in world.store.created].count("bucket") == 1


def test_a_configured_bucket_is_used_as_it_is_and_never_deleted(tmp_path: Path, aws_env: str):
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="team-checkpoints")
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1a", "CHECKPOINT_BUCKET": "team-checkpoints"}))
    w.up()
    assert w.store.get("bucket") == "team-checkpoints" and "bucket" not in [i["type"] for i in w.store.created]
    lifecycle.down(w.d, confirm=lambda q: True, delete_checkpoints=True)
    assert boto3.client("s3", region_name="us-east-1").head_bucket(Bucket="team-checkpoints")


def test_a_configured_bucket_that_does_not_exist_stops_up_before_the_cluster(tmp_path: Path, aws_env: str):
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1a", "CHECKPOINT_BUCKET": "no-such-bucket-here"}))
    with pytest.raises(UserError, match="cluster.checkpoint_bucket = 'no-such-bucket-here': no such bucket"):
        w.up()
    assert not w.tools.commands("eksctl", "create")


def test_down_keeps_a_bucket_that_holds_checkpoints_until_asked(ready: World):
    bucket = ready.store.get("bucket")
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.put_object(Bucket=bucket, Key="runs/run-1/checkpoint_000050/model.pt", Body=b"weights")
    questions: list[str] = []
    result = lifecycle.down(ready.d, confirm=lambda q: questions.append(q) or True)
    assert ready.tools.cluster is None, "everything else is deleted"
    assert f"Keep: Kept s3://{bucket} (1 objects" in questions[0]
    assert result.kept and "raytrain-eks down --delete-checkpoints" in result.kept[0]
    assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] == 1, "nothing a job wrote is lost"
    assert StateStore(ready.store.root).created == [{"type": "bucket", "name": bucket}]
    # A plain down again keeps it and asks nothing; --delete-checkpoints deletes it.
    again = lifecycle.down(StateDeployment(ready), confirm=lambda q: pytest.fail("nothing to confirm"))
    assert again.kept and not again.deleted
    gone = lifecycle.down(StateDeployment(ready), confirm=lambda q: True, delete_checkpoints=True)
    assert gone.deleted == [f"S3 bucket {bucket} (checkpoints and exports)"]
    assert bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert not (ready.store.root / "state.json").exists()


def test_down_deletes_an_empty_bucket_it_created(ready: World):
    bucket = ready.store.get("bucket")
    result = lifecycle.down(ready.d, confirm=lambda q: True)
    assert f"S3 bucket {bucket} (checkpoints and exports)" in result.deleted and not result.kept
    assert bucket not in [b["Name"] for b in boto3.client("s3", region_name="us-east-1").list_buckets()["Buckets"]]
