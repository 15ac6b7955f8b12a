"""Every helm and kubectl command line the tool builds, parsed by the real Helm 3, Helm 4 and kubectl.

The command lines are not typed here: ``up``, ``submit`` (both modes), ``status``, ``logs``, ``compare-fabric`` and
``down`` run through the deploy tests' fakes (test_deploy.py's ``World``, whose ``FakeTools`` records every argv it
is given), ``plan`` writes its folders for both modes (the commands of ``plan.json``, run from the plan folder as
it says), and the commands the tool tells the user to run (quoted in backticks in what it says and in its errors'
hints) are read from its output. Each one must:

- with ``--help`` added, exit 0 (cobra refuses an unknown flag before it prints help);
- run as built against a kubeconfig whose server is unreachable (``https://127.0.0.1:1``, a static token), fail
  only because the cluster cannot be reached, never with a usage error;
- ``helm upgrade --install``: get past the chart repository too. Found by trying it: both majors ask the cluster
  for the release's history before they look at ``--repo`` at all (``Kubernetes cluster unreachable`` in 0.1 s), so
  that run says nothing of the chart, its version or the values file. So it runs once more with Helm's memory
  storage driver (``HELM_DRIVER=memory``: no cluster for the release history) and ``--repo`` pointed at a loopback
  chart repository serving the vendored charts (packaged by ``helm package``, indexed by ``helm repo index``): Helm
  then downloads the index and the chart at ``--version``, reads the values file and loads the chart, and fails
  only where it asks the cluster for its version ("could not get server version from Kubernetes").

The files the commands name (values files, manifests) are the ones the tool wrote on the way, never made here.
"""

from __future__ import annotations

import http.server
import json
import re
import shlex
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from charts import VENDORED
from test_charts import UNREACHABLE_KUBECONFIG
from test_deploy import TOKEN, FakeRay, World
from test_fabric_compare import compare_on_eks, eks  # noqa: F401 - eks: the fixture, a World after up and submit

from raytrain_eks.config import load_config
from raytrain_eks.deploy import submit as sub
from raytrain_eks.eks import lifecycle
from raytrain_eks.eks.plan import write_plan
from raytrain_eks.errors import UserError

# What the real binaries print when the server cannot be reached (Helm 4 writes "kubernetes" in lower case).
UNREACHABLE = re.compile(r"kubernetes cluster unreachable|connection refused|was refused", re.IGNORECASE)
# What cobra, pflag and the commands print for a command line they refuse.
USAGE_ERRORS = re.compile(
    r"unknown (shorthand )?flag|unknown command|accepts \d+ arg|requires (at least|exactly)|required flag|"
    r"flag needs an argument|invalid argument|for usage|Usage:",
    re.IGNORECASE,
)
# Where helm stops with no cluster once it has the chart and the values (HELM_DRIVER=memory). Both majors ask the
# server for its version; found by trying: Helm 4 first creates a chart's crds/, and the memory driver's stand-in
# cluster client builds no object from them ("resources are empty"), so the KubeRay chart stops there.
PAST_THE_REPO = re.compile(
    r"could not get server version from Kubernetes: .*connection refused"
    r"|failed to install CRD crds/\S+: resources are empty"
)
FILE_FLAGS = ("-f", "--filename", "--values")
QUOTED = re.compile(r"`((?:helm|kubectl) [^`]+)`")


@dataclass(frozen=True)
class Command:
    """One command line the tool built: its argv, the folder it runs from, its stdin file, and where it came from."""

    argv: tuple[str, ...]
    cwd: Path
    origin: str
    stdin: Path | None = None


class Collector:
    """Gathers the helm and kubectl command lines of a World (its runner's calls, what it said) and of plans."""

    def __init__(self) -> None:
        self.commands: dict[tuple[str, ...], Command] = {}

    def add(self, argv: list[str] | tuple[str, ...], cwd: Path, origin: str, stdin: Path | None = None) -> None:
        if argv and argv[0] in ("helm", "kubectl"):
            self.commands.setdefault(tuple(argv), Command(tuple(argv), cwd, origin, stdin))

    def calls(self, world: World, cwd: Path, origin: str) -> None:
        for argv in world.tools.calls:
            self.add(argv, cwd, origin)

    def text(self, text: str, cwd: Path, origin: str) -> None:
        for quoted in QUOTED.findall(text):
            self.add(shlex.split(quoted), cwd, f"{origin} (told to the user)")

    def error(self, exc: BaseException, cwd: Path, origin: str) -> None:
        assert isinstance(exc, UserError), exc
        self.text(f"{exc.message}\n{exc.hint or ''}", cwd, origin)

    def plan(self, folder: Path, origin: str) -> None:
        plan = json.loads((folder / "plan.json").read_text())
        assert plan["commands_run_in"].startswith("the plan folder")
        for step in plan["steps"]:
            if step["command"]:
                stdin = folder / step["stdin"] if step.get("stdin") else None
                self.add(step["command"], folder, f"{origin} step {step['name']}", stdin)

    def take(self) -> list[Command]:
        out = list(self.commands.values())
        self.commands.clear()
        return out


# ------------------------------------------------------------------------------------------------------------------
# A loopback chart repository serving the vendored charts
# ------------------------------------------------------------------------------------------------------------------


class ChartRepo:
    """An HTTP chart repository on 127.0.0.1, one folder per published repository, and the paths it served. Each
    run gets URLs of its own (``/RUN/CHART/...``, the index's chart URLs relative), so what a run fetched is known
    while others run beside it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.served: list[str] = []
        repo = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(root), **kwargs)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                repo.served.append(self.path)
                super().do_GET()

            def translate_path(self, path: str) -> str:
                return super().translate_path("/" + path.lstrip("/").partition("/")[2])  # without /RUN

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def local(self, repo_url: str, run: str) -> str:
        """The loopback URL standing for a published repository, for one run."""
        (chart,) = [c for c in VENDORED if c.repo_url == repo_url]
        return f"{self.url}/{run}/{chart.name}"


@pytest.fixture(scope="module")
def chart_repo(real_tools: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartRepo]:
    root = tmp_path_factory.mktemp("chart-repo")
    repo = ChartRepo(root)
    for chart in VENDORED:
        folder = root / chart.name
        folder.mkdir()
        if chart.path.is_dir():
            done = real_tools.run(real_tools.helm3, ["package", str(chart.path), "--destination", str(folder)])
            assert done.returncode == 0, done.stderr
        else:
            shutil.copy(chart.path, folder / f"{chart.name}-{chart.version}.tgz")
        done = real_tools.run(real_tools.helm3, ["repo", "index", str(folder)])  # chart URLs relative to the repo
        assert done.returncode == 0, done.stderr
    repo.thread.start()
    yield repo
    repo.server.shutdown()
    repo.server.server_close()


# ------------------------------------------------------------------------------------------------------------------
# The checks
# ------------------------------------------------------------------------------------------------------------------


def _with_kubeconfig(argv: tuple[str, ...], kubeconfig: Path) -> list[str]:
    out = list(argv)
    if "--kubeconfig" in out:
        out[out.index("--kubeconfig") + 1] = str(kubeconfig)
    return out


def _help(argv: list[str]) -> list[str]:
    """``--help`` among the flags: before ``--`` (after it, it would be the remote command's)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    return [*argv[1:cut], "--help", *argv[cut:]]


def _said(done: Any) -> str:
    return (done.stdout + done.stderr).strip()[-600:]


def check(commands: list[Command], real_tools: Any, chart_repo: ChartRepo, home: Path) -> list[str]:
    """Every problem the real binaries find in ``commands`` (empty: none)."""
    kubeconfig = home / "unreachable-kubeconfig"
    kubeconfig.write_text(UNREACHABLE_KUBECONFIG)
    memory = home / "no-releases.yaml"
    memory.write_text("[]\n")
    env = {"KUBECONFIG": str(kubeconfig)}

    def one(i: int, cmd: Command) -> list[str]:
        problems = []
        argv = _with_kubeconfig(cmd.argv, kubeconfig)
        where = f"{shlex.join(cmd.argv)}\n    (from {cmd.origin})"
        for j, arg in enumerate(argv[:-1]):
            if arg in FILE_FLAGS and not (cmd.cwd / argv[j + 1]).is_file():
                problems.append(f"{where}: {argv[j + 1]} does not exist where it runs ({cmd.cwd})")
        stdin = cmd.stdin.read_text() if cmd.stdin else None
        binaries = real_tools.helms if argv[0] == "helm" else {"kubectl": real_tools.kubectl}
        for major, binary in binaries.items():
            done = real_tools.run(binary, _help(argv), env=env, cwd=cmd.cwd)
            if done.returncode != 0:
                problems.append(f"{where}\n    {major} --help: exit {done.returncode}: {_said(done)}")
            done = real_tools.run(binary, argv[1:], env=env, cwd=cmd.cwd, input=stdin)
            if done.returncode == 0 or not UNREACHABLE.search(done.stderr) or USAGE_ERRORS.search(done.stderr):
                problems.append(f"{where}\n    {major} against no cluster: exit {done.returncode}: {_said(done)}")
            if argv[:3] == ["helm", "upgrade", "--install"]:
                run = f"run{i}-{major}"
                problems += _through_the_repo(argv, cmd, where, major, binary, real_tools, chart_repo, run, env, memory)
        return problems

    with ThreadPoolExecutor(max_workers=4) as pool:
        found = pool.map(one, range(len(commands)), commands)
        return [problem for problems in found for problem in problems]


def _through_the_repo(
    argv: list[str],
    cmd: Command,
    where: str,
    major: str,
    binary: Path,
    real_tools: Any,
    repo: ChartRepo,
    run: str,
    env: dict[str, str],
    memory: Path,
) -> list[str]:
    local = list(argv)
    url = repo.local(local[local.index("--repo") + 1], run)
    local[local.index("--repo") + 1] = url
    chart, version = local[4], local[local.index("--version") + 1]
    mem = {**env, "HELM_DRIVER": "memory", "HELM_MEMORY_DRIVER_DATA": str(memory)}
    done = real_tools.run(binary, local[1:], env=mem, cwd=cmd.cwd)
    wanted = f"{url.removeprefix(repo.url)}/{chart}-{version}.tgz"  # the chart at --version, from --repo
    if done.returncode == 0 or wanted not in repo.served or not PAST_THE_REPO.search(done.stderr):
        return [f"{where}\n    {major} through the chart repository: exit {done.returncode}: {_said(done)}"]
    return []


# ------------------------------------------------------------------------------------------------------------------
# The test
# ------------------------------------------------------------------------------------------------------------------


def test_every_helm_and_kubectl_command_line_parses_with_the_real_binaries(
    eks: World,  # noqa: F811 - the fixture imported above
    real_tools: Any,
    chart_repo: ChartRepo,
    tmp_path: Path,
):
    home = tmp_path / "checks"
    home.mkdir()
    root = eks.store.root.parent
    found = Collector()
    # up and the first submit ran in the fixture; its logs; then compare-fabric refused (a job running), and ran.
    assert sub.logs(eks.d) == 0
    (job,) = eks.ray.jobs
    eks.ray.jobs[job] = "RUNNING"
    busy = compare_on_eks("-y")
    found.error(busy.exception, root, "compare-fabric with a job running")
    eks.ray.jobs[job] = "SUCCEEDED"
    assert compare_on_eks("--json", "-y").exit_code == 0
    found.text("\n".join(lifecycle.status(eks.d)), root, "status")
    cfg = eks.d.cfg
    eks.kube.exec_handler = FakeRay(tmp_path)  # a RayJob's pods, not compare-fabric's RayCluster
    try:
        rayjob = eks.submit(mode="rayjob", hf_token=TOKEN)
    except UserError as exc:  # the first submit's RayCluster holds the GPUs: deleted as the hint says, then again
        found.error(exc, root, "submit --mode rayjob beside a RayCluster")
        eks.kube.delete("ray.io/v1", "RayCluster", cfg.ray.cluster_name, cfg.ray.namespace)
        rayjob = eks.submit(mode="rayjob", hf_token=TOKEN)
    assert rayjob.exit_code == 0
    found.calls(eks, root, "up, submit, compare-fabric, status, logs")
    found.text(eks.said(), root, "up, submit, compare-fabric, status, logs")
    # A second deployment whose EFA chart fails once, and whose NVIDIA plugin never becomes ready.
    other = World(tmp_path / "other", load_config(environ={}, path=None))
    other.tools.fail_once["helm upgrade --install aws-efa-k8s-device-plugin"] = "Error: context deadline exceeded"
    other.tools.crash_plugins = {"nvidia-device-plugin"}
    for _ in range(2):
        with pytest.raises(UserError) as err:
            other.up()
        found.error(err.value, other.store.root.parent, "up failing")
    found.calls(other, other.store.root.parent, "up failing")
    for mode in ("raycluster", "rayjob"):
        folder = tmp_path / f"plan-{mode}"
        write_plan(eks.d.cfg, folder, mode=mode, hf_token=True)
        found.plan(folder, f"plan --mode {mode}")
    before_down = found.take()
    problems = check(before_down, real_tools, chart_repo, home)
    # down: the files above are gone with its state, so its own commands are checked after it.
    lifecycle.down(eks.d, confirm=lambda q: True)
    found.calls(eks, root, "down")
    found.text(eks.said(), root, "down")
    after_down = [c for c in found.take() if c.argv not in {b.argv for b in before_down}]
    problems += check(after_down, real_tools, chart_repo, home)
    checked = before_down + after_down
    verbs = {" ".join(c.argv[:3]) for c in checked}
    expected = {"helm upgrade --install", "helm get metadata", "kubectl apply -f", "kubectl delete daemonset"}
    assert expected <= verbs and any(v.startswith("helm uninstall") for v in verbs), sorted(verbs)
    assert any(c.argv[:2] == ("kubectl", "exec") for c in checked)
    told = [c for c in checked if "told" in c.origin]
    assert told and not [shlex.join(c.argv) for c in told if "--kubeconfig" not in c.argv], "on this folder's cluster"
    assert not problems, f"{len(problems)} of {len(checked)} command lines are refused:\n" + "\n".join(problems)


def test_the_check_reports_what_the_real_binaries_refuse(real_tools: Any, chart_repo: ChartRepo, tmp_path: Path):
    # Command lines the real binaries refuse, one way each: the check above must report every one of them.
    values = tmp_path / "values.yaml"
    values.write_text("{}\n")
    nvidia = VENDORED[0]
    install = ["helm", "upgrade", "--install", nvidia.name, nvidia.name, "--repo", nvidia.repo_url]
    refused = [
        Command(("helm", "list", "--all", "--namespace", "kube-system", "--output", "json"), tmp_path, "Helm 4"),
        Command((*install, "--version", "0.99.0", "--values", str(values)), tmp_path, "no such version"),
        Command((*install, "--version", nvidia.version, "--values", "missing.yaml"), tmp_path, "no values file"),
        Command(("kubectl", "apply", "--server-side-apply", "-f", str(values)), tmp_path, "no such flag"),
        Command(("helm", "status"), tmp_path, "no release named"),
    ]
    problems = check(refused, real_tools, chart_repo, tmp_path)
    for cmd in refused:
        assert [p for p in problems if p.startswith(shlex.join(cmd.argv))], f"not reported: {cmd.origin}"
    assert any("helm4 --help: exit 1: Error: unknown flag: --all" in p for p in problems)
