"""The EFA-versus-TCP comparison (``raytrain_eks.deploy.compare`` and ``raytrain-eks compare-fabric``); fast, hermetic.

The logic runs against an injected ``run_job`` that answers with the NCCL fixtures (an EFA job's log for run A, a
TCP-socket fallback's log for run B) and synthetic metric records. Covered: the speed-up after warm-up (and that
warm-up steps and a resumed run's repeated steps do not count), each run's configuration (env overrides, the
in-job gate off for TCP, the input config untouched), refusal when both runs use the same transport, when run A is
not EFA (run B then never starts), when a job failed, when the runs are not the same job, when too few steps are
left after warm-up, the JSON output, and the EKS command end to end through the fakes of ``test_deploy``
(FakeKube, the recording tools runner, Ray answering inside the pods): two fresh RayClusters, the second with the
TCP environment in its worker template, and the metrics read back from the head pod; a RayCluster with a running
Ray job left alone, the confirmation (and ``-y``), and the RayCluster put back with the configured environment
after the comparison, after a run fails and after Ctrl-C; both runs' files kept locally with one report.html
overlaying them, and an ``--out`` that would overwrite a comparison refused before anything is touched.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from test_deploy import FIXTURES, FakeRay, World, run_script
from typer.testing import CliRunner

from raytrain_eks.config import Config, load_config
from raytrain_eks.deploy import commands as deploy_commands
from raytrain_eks.deploy import compare as cmp
from raytrain_eks.deploy import submit as eks_submit
from raytrain_eks.deploy.compare import (
    EFA_RUN,
    TCP_ENV,
    TCP_RUN,
    ClusterBusy,
    ComparisonRefused,
    RunOutput,
    RunSpec,
    compare_fabric,
    config_for,
    throughput,
)
from raytrain_eks.errors import UserError
from raytrain_eks.fabric.nccl_log import analyze_paths
from raytrain_eks.k8s.cluster import ExecResult
from raytrain_eks.k8s.manifests import IMAGE_PYTHON
from raytrain_eks.k8s.runner import CommandError
from raytrain_eks.k8s.state import Cancelled, remembered_config

EFA_LOG = FIXTURES / "efa_2node_nccl2.29_ray.log"
TCP_LOG = FIXTURES / "socket_fallback_nccl2.27_kubectl.log"
TOKENS_PER_STEP = 8 * 2 * 1024


def records(step_s: float, *, steps: int = 100, log_every: int = 10, first_s: float = 9.0) -> list[dict[str, Any]]:
    """Metric records as the training loop logs them: step 1, then every ``log_every`` steps; step 1 is slow."""
    logged = [1, *range(log_every, steps + 1, log_every)]
    return [
        {
            "step": s,
            "loss": 2.0,
            "tokens": s * TOKENS_PER_STEP,
            "tokens_per_s": TOKENS_PER_STEP / step_s,
            "step_time_s": first_s if s == 1 else step_s,
        }
        for s in logged
    ]


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


class Jobs:
    """A ``run_job`` answering each run from a table keyed by the run's key; remembers the specs it got."""

    def __init__(self, **outputs: RunOutput) -> None:
        self.outputs = outputs
        self.specs: list[RunSpec] = []

    def __call__(self, spec: RunSpec) -> RunOutput:
        self.specs.append(spec)
        return self.outputs[spec.key]


def good_jobs() -> Jobs:
    return Jobs(
        A=RunOutput(records(0.5), lines(EFA_LOG), source="job a"),
        B=RunOutput(records(1.25), lines(TCP_LOG), source="job b"),
    )


# ------------------------------------------------------------------------------------------------------------------
# The logic
# ------------------------------------------------------------------------------------------------------------------


def test_speedup_is_steps_per_s_after_warmup_efa_over_tcp():
    jobs = good_jobs()
    result = compare_fabric(jobs, warmup_steps=10)
    assert [s.key for s in jobs.specs] == ["A", "B"]
    assert result.efa.verdict == "efa" and result.tcp.verdict == "socket"
    # Steps 20..100 are timed (step 1's 9 s and step 10 are warm-up).
    assert result.efa.throughput.samples == 9 and result.efa.throughput.first_step == 20
    assert result.efa.throughput.steps_per_s == pytest.approx(2.0)
    assert result.tcp.throughput.steps_per_s == pytest.approx(0.8)
    assert result.speedup == pytest.approx(2.5)
    text = result.render()
    assert "Speed-up EFA / TCP: 2.50x" in text
    assert "transport efa" in text and "transport socket" in text and "NCCL_NET=Socket FI_PROVIDER=tcp" in text


def test_warmup_decides_which_steps_count():
    recs = records(0.5)
    recs[2]["step_time_s"] = 3.0  # step 20 slow: counted with warm-up 10, skipped with warm-up 20
    with_slow = throughput(recs, warmup_steps=10, what="run A")
    without = throughput(recs, warmup_steps=20, what="run A")
    assert with_slow.steps_per_s == pytest.approx(9 / (3.0 + 8 * 0.5))
    assert without.steps_per_s == pytest.approx(2.0) and without.samples == 8
    everything = throughput(recs, warmup_steps=0, what="run A")
    assert everything.samples == 11 and everything.first_step == 1


def test_a_resumed_runs_repeated_steps_count_once():
    recs = records(0.5) + [{"step": 100, "step_time_s": 0.5, "tokens": 100 * TOKENS_PER_STEP, "resumed_from_step": 90}]
    t = throughput(recs, warmup_steps=10, what="run A")
    assert t.samples == 9 and t.tokens_per_step == TOKENS_PER_STEP


def test_each_run_gets_its_environment_and_gate_and_the_config_is_untouched():
    cfg = load_config(environ={}, path=None)
    before = cfg.model_dump()
    a, b = config_for(cfg, EFA_RUN), config_for(cfg, TCP_RUN)
    assert a.network.env == cfg.network.env and a.fabric.require == "efa"
    assert b.network.env == {**cfg.network.env, **TCP_ENV} and b.fabric.require == "any"
    assert b.network.env["FI_PROVIDER"] == "tcp" and b.training == cfg.training
    assert cfg.model_dump() == before


def test_refused_when_both_runs_use_the_same_transport():
    jobs = Jobs(A=RunOutput(records(0.5), lines(EFA_LOG)), B=RunOutput(records(0.5), lines(EFA_LOG)))
    with pytest.raises(ComparisonRefused) as err:
        compare_fabric(jobs)
    msg = str(err.value)
    assert "run B (TCP: NCCL_NET=Socket FI_PROVIDER=tcp) used efa, not socket" in msg
    assert "same transport as run A (EFA)" in msg and "never compared" in msg


def test_refused_when_run_a_is_not_efa_and_run_b_never_starts():
    jobs = Jobs(A=RunOutput(records(0.5), lines(TCP_LOG)), B=RunOutput(records(1.0), lines(TCP_LOG)))
    with pytest.raises(ComparisonRefused) as err:
        compare_fabric(jobs)
    assert "run A (EFA: the configured network.env) used socket, not efa" in str(err.value)
    assert "vpc.amazonaws.com/efa" in str(err.value)  # the hint says what to fix
    assert [s.key for s in jobs.specs] == ["A"]


@pytest.mark.parametrize("fixture", ["single_node_nccl2.27.log", "truncated_before_connections.log"])
def test_refused_when_run_b_proves_nothing(fixture: str):
    report = analyze_paths([FIXTURES / fixture])  # a TransportReport is accepted as well as lines
    jobs = Jobs(A=RunOutput(records(0.5), lines(EFA_LOG)), B=RunOutput(records(1.0), report))
    # single-node: the wrong transport; the truncated log: sockets selected, but no connection line proves it.
    wrong = rf"used {report.verdict}, not socket \(run A used efa\)"
    with pytest.raises(ComparisonRefused, match=rf"run B .* ({wrong}|do not prove the transport)"):
        compare_fabric(jobs)


def test_refused_when_a_job_failed():
    jobs = good_jobs()
    jobs.outputs["B"] = dataclasses.replace(jobs.outputs["B"], status="FAILED", source="job b")
    with pytest.raises(ComparisonRefused, match=r"run B .* ended FAILED \(job b\)"):
        compare_fabric(jobs)


def test_refused_when_too_few_steps_after_warmup():
    jobs = Jobs(A=RunOutput(records(0.5, steps=30), lines(EFA_LOG)), B=RunOutput(records(1.0), lines(TCP_LOG)))
    with pytest.raises(ComparisonRefused) as err:
        compare_fabric(jobs, warmup_steps=10, min_samples=3)
    assert "run A (EFA" in str(err.value) and "has 2 timed step(s) after a warm-up of 10 steps" in str(err.value)
    assert err.value.hint and "--warmup-steps" in err.value.hint
    assert compare_fabric(jobs, warmup_steps=10, min_samples=2).efa.throughput.samples == 2


def test_refused_when_the_runs_are_not_the_same_job():
    other = [dict(r, tokens=r["step"] * TOKENS_PER_STEP * 2) for r in records(1.0)]
    jobs = Jobs(A=RunOutput(records(0.5), lines(EFA_LOG)), B=RunOutput(other, lines(TCP_LOG)))
    with pytest.raises(ComparisonRefused, match="not the same job: tokens per step 16384 .run A. vs 32768"):
        compare_fabric(jobs)


def test_negative_warmup_is_a_user_error():
    with pytest.raises(UserError, match="--warmup-steps -1"):
        compare_fabric(good_jobs(), warmup_steps=-1)


def test_json_output():
    data = json.loads(compare_fabric(good_jobs(), warmup_steps=10).to_json())
    assert data["speedup"] == pytest.approx(2.5) and data["warmup_steps"] == 10
    assert data["efa"]["verdict"] == "efa" and data["efa"]["env"] == {} and data["efa"]["require"] == "efa"
    assert data["tcp"]["verdict"] == "socket" and data["tcp"]["env"] == TCP_ENV and data["tcp"]["require"] == "any"
    assert data["tcp"]["throughput"]["steps_per_s"] == pytest.approx(0.8)
    assert data["tcp"]["throughput"]["samples"] == 9 and data["tcp"]["source"] == "job b"
    assert data["efa"]["world_size"] == 8 and "step_time_s" in data["method"]


# ------------------------------------------------------------------------------------------------------------------
# On EKS, through the fakes
# ------------------------------------------------------------------------------------------------------------------


def worker_env(rc: dict[str, Any]) -> dict[str, str | None]:
    """The environment in a RayCluster's worker pod template."""
    (group,) = rc["spec"]["workerGroupSpecs"]
    return {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}


class EnvAwareRay(FakeRay):
    """:class:`FakeRay` whose workers log what NCCL would choose from the RayCluster's worker env (Socket when
    ``NCCL_NET=Socket``, else EFA), whose job prints its run folder, and whose head pod holds ``metrics.jsonl``.
    The job-listing script runs for real against a Ray job client that answers from ``jobs``. ``fail_tcp``: what
    submitting the TCP run does instead (an exception to raise)."""

    def __init__(self, tmp: Path, world: World) -> None:
        super().__init__(tmp)
        self.world = world
        self.step_s = {"efa": 0.5, "socket": 1.25}
        self.fail_tcp: BaseException | None = None

    def _fabric(self, ns: str) -> str:
        rc = self.world.kube.get("ray.io/v1", "RayCluster", self.world.d.cfg.ray.cluster_name, ns)
        return "socket" if worker_env(rc).get("NCCL_NET") == "Socket" else "efa"

    def list_jobs(self) -> list[Any]:
        """What Ray's ``JobSubmissionClient.list_jobs`` would return for the jobs submitted so far."""
        from ray.job_submission import JobDetails, JobStatus, JobType

        return [
            JobDetails(type=JobType.SUBMISSION, submission_id=sid, status=JobStatus(status), entrypoint="python -m x")
            for sid, status in self.jobs.items()
        ]

    def __call__(self, ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:2] == [IMAGE_PYTHON, "-c"] and argv[2] == cmp._RAY_JOBS:
            return run_script(argv[2], argv[3:])
        if argv[:2] == [IMAGE_PYTHON, "-c"] and argv[2] == eks_submit._READ_RUN_FILES:
            return run_script(argv[2], [str(self.tmp / "head" / argv[3].lstrip("/")), *argv[4:]])
        fabric = self._fabric(ns)
        if fabric == "socket" and self.fail_tcp is not None and argv[:3] == ["ray", "job", "submit"]:
            raise self.fail_tcp
        self.worker_logs = [EFA_LOG, EFA_LOG] if fabric == "efa" else [TCP_LOG, TCP_LOG]
        if argv[:3] == ["ray", "job", "logs"]:
            super().__call__(ns, pod, argv, stdin)
            run_dir = f"/home/ray/runs/{argv[-1]}"
            metrics = self.tmp / "head" / run_dir.lstrip("/") / "metrics.jsonl"
            metrics.parent.mkdir(parents=True, exist_ok=True)
            metrics.write_text("".join(json.dumps(r) + "\n" for r in records(self.step_s[fabric])))
            # What else the job leaves in its run folder, as the training run writes it.
            summary = {"steps": 100, "final_loss": 1.87, "world_size": 8, "fabric": {"verdict": fabric}}
            (metrics.parent / "summary.json").write_text(json.dumps(summary))
            (metrics.parent / "config.yaml").write_text(f"fabric:\n  require: {fabric}\n")
            sample = {"prompt": "What is EFA?", "completion": f"answered over {fabric}", "tokens": 3}
            (metrics.parent / "samples.jsonl").write_text(json.dumps(sample) + "\n")
            (metrics.parent / "nccl").mkdir(exist_ok=True)
            (metrics.parent / "nccl" / "rank0.log").write_text("\n".join(lines(self.worker_logs[0])[:5]) + "\n")
            return ExecResult(0, f"run folder: {run_dir}\nstep 100 loss 1.87\nRun folder: {run_dir}\n")
        if argv[:1] == ["cat"]:
            local = self.tmp / "head" / argv[1].lstrip("/")
            return ExecResult(0, local.read_text()) if local.is_file() else ExecResult(1, "", "No such file\n")
        return super().__call__(ns, pod, argv, stdin)


@pytest.fixture
def eks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> Iterator[World]:
    monkeypatch.chdir(tmp_path)  # no raytrain-eks.yaml of the repository is read
    monkeypatch.delenv("HF_TOKEN", raising=False)
    world = World(tmp_path, load_config(environ={}, path=None))
    world.ray = fake_ray = EnvAwareRay(tmp_path, world)
    world.kube.exec_handler = world.ray
    import ray.job_submission as job_submission

    class Client:  # the dashboard inside the head pod, as the job-listing script sees it
        def __init__(self, address: str) -> None:
            assert address == "http://127.0.0.1:8265"

        def list_jobs(self) -> list[Any]:
            return fake_ray.list_jobs()

    monkeypatch.setattr(job_submission, "JobSubmissionClient", Client)
    world.up()
    world.submit()  # a RayCluster from an earlier job is running (with the EFA env)
    world.lines.clear()

    def make_deployment(cfg: Config, state_dir: Path, say: Callable[[str], None] | None = None) -> Any:
        # The real remembering (and its notice, to ``say``); the fakes of the cluster behind it.
        say = say or world.d.say
        world.d = dataclasses.replace(world.d, cfg=remembered_config(cfg, world.store, say))
        return dataclasses.replace(world.d, say=say)

    monkeypatch.setattr(deploy_commands, "make_deployment", make_deployment)
    yield world


def compare_on_eks(*args: str, input: str | None = None) -> Any:
    app = typer.Typer()
    deploy_commands.register(app)
    return CliRunner().invoke(app, ["compare-fabric", *args], input=input)


def raycluster(world: World) -> dict[str, Any] | None:
    cfg = world.d.cfg
    return world.kube.get("ray.io/v1", "RayCluster", cfg.ray.cluster_name, cfg.ray.namespace)


def job_config(world: World) -> str:
    cfg = world.d.cfg
    return world.kube.get("v1", "ConfigMap", cfg.ray.cluster_name + "-config", cfg.ray.namespace)["data"][
        "raytrain-eks.yaml"
    ]


def assert_restored_to_the_configuration(world: World, output: str) -> None:
    """What the next ``submit`` finds: a RayCluster whose workers get the configured EFA environment, not run B's
    TCP overrides, and a job configuration that requires EFA; and the user was told."""
    env = worker_env(raycluster(world))
    assert "NCCL_NET" not in env and env["FI_PROVIDER"] == "efa"
    assert "require: efa" in job_config(world)
    ns, name = world.d.cfg.ray.namespace, world.d.cfg.ray.cluster_name
    assert f"Restored RayCluster {ns}/{name} with the configured network environment" in output
    world.kube.sleep(60)  # its pods come up, and the next submit runs over EFA on them
    assert world.submit().report.verdict == "efa"


def test_compare_fabric_on_eks_through_the_fakes(eks: World):
    deleted_before = len(eks.kube.deleted)
    out = compare_on_eks("--json", "--warmup-steps", "10", "-y")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["efa"]["verdict"] == "efa" and data["tcp"]["verdict"] == "socket"
    assert data["speedup"] == pytest.approx(2.5)
    assert data["efa"]["source"].startswith("job raytrain-") and "run folder /home/ray/runs/" in data["tcp"]["source"]
    # Each run on a fresh RayCluster, the second one's worker template carrying the TCP environment; then the
    # RayCluster is replaced once more, with the configured one.
    rc_deletes = [x for x in eks.kube.deleted[deleted_before:] if x[1] == "RayCluster"]
    assert len(rc_deletes) == 3
    envs = [worker_env(o) for o in eks.kube.applied if o["kind"] == "RayCluster"][-3:]
    assert "NCCL_NET" not in envs[0] and envs[0]["FI_PROVIDER"] == "efa"
    assert envs[1]["NCCL_NET"] == "Socket" and envs[1]["FI_PROVIDER"] == "tcp"
    assert envs[2] == envs[0]
    # The TCP job's own config (mounted ConfigMap) turns the in-job gate off; the EFA job's keeps it on.
    maps = [o for o in eks.kube.applied if o["kind"] == "ConfigMap" and "raytrain-eks.yaml" in o.get("data", {})]
    assert "require: efa" in maps[-3]["data"]["raytrain-eks.yaml"]
    assert "require: any" in maps[-2]["data"]["raytrain-eks.yaml"]
    # Metrics came from the head pod; two jobs were submitted after the earlier one.
    cats = [c for c in eks.kube.exec_calls if c[2][:1] == ["cat"]]
    assert len(cats) == 2 and all(c[1].endswith("head-0") for c in cats)
    assert len(eks.ray.submitted) == 3


def test_compare_fabric_takes_set_as_the_other_commands_do_and_checks_it_before_any_run(eks: World):
    applied = len(eks.kube.applied)
    out = compare_on_eks("--set", "training.learning_rate=-1", "-y")
    assert out.exit_code != 0 and "training.learning_rate = -1 (from --set" in str(out.exception)
    assert len(eks.kube.applied) == applied and not eks.ray.submitted[1:]  # nothing run, nothing applied


def test_compare_fabric_json_through_the_console_entry_is_only_json(eks: World, capsys, monkeypatch):
    # The folder remembers zone us-east-1a and the configuration names none: the notice that says so, and every
    # progress line, go to stderr; stdout is the JSON alone. ASSUME_YES=1 answers the confirmation, as -y does.
    from raytrain_eks.cli import main

    monkeypatch.setenv("ASSUME_YES", "1")
    monkeypatch.setenv("BENCH_WARMUP_STEPS", "20")
    main(["compare-fabric", "--json"])
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["speedup"] == pytest.approx(2.5) and data["warmup_steps"] == 20
    assert "Using cluster ray-train-eks in us-east-1 (zone us-east-1a) as remembered" in err
    assert "Restored RayCluster" in err


def test_bench_steps_sets_the_steps_of_each_run(eks: World, monkeypatch):
    monkeypatch.setenv("BENCH_STEPS", "120")
    out = compare_on_eks("--json", "-y")
    assert out.exit_code == 0, out.output
    maps = [o for o in eks.kube.applied if o["kind"] == "ConfigMap" and "raytrain-eks.yaml" in o.get("data", {})]
    steps = [yaml.safe_load(c["data"]["raytrain-eks.yaml"])["training"]["steps"] for c in maps[-3:]]
    assert steps == [120, 120, 100], "both runs take BENCH_STEPS; the restored RayCluster keeps the configuration"
    assert compare_on_eks("--json", "-y", "--steps", "110").exit_code == 0
    maps = [o for o in eks.kube.applied if o["kind"] == "ConfigMap" and "raytrain-eks.yaml" in o.get("data", {})]
    assert yaml.safe_load(maps[-2]["data"]["raytrain-eks.yaml"])["training"]["steps"] == 110


def test_compare_fabric_leaves_the_raycluster_with_the_configured_environment(eks: World):
    out = compare_on_eks("-y")
    assert out.exit_code == 0, out.output
    assert "Speed-up EFA / TCP: 2.50x" in out.stdout
    assert_restored_to_the_configuration(eks, out.stderr)


@pytest.mark.parametrize(
    "failure",
    [
        CommandError(["ray", "job", "submit"], 1, "connection refused"),
        KeyboardInterrupt(),
    ],
    ids=["run-B-fails", "ctrl-c-in-run-B"],
)
def test_compare_fabric_restores_the_raycluster_when_run_b_fails(eks: World, failure: BaseException):
    eks.ray.fail_tcp = failure
    out = compare_on_eks("-y")
    assert out.exit_code != 0
    if isinstance(failure, CommandError):
        assert out.exception is failure  # the run's own error reaches the user, not one from the clean-up
    assert "Speed-up" not in out.stdout
    assert len(eks.ray.submitted) == 2  # run B never started its job
    assert_restored_to_the_configuration(eks, out.stderr)


def test_compare_fabric_leaves_a_raycluster_with_a_running_job_alone(eks: World):
    (earlier,) = eks.ray.jobs
    eks.ray.jobs[earlier] = "RUNNING"  # someone's training on the RayCluster
    pods_before = {p.name for p in eks.kube.pods(eks.d.cfg.ray.namespace)}
    deleted_before = len(eks.kube.deleted)
    out = compare_on_eks("-y")  # not even with --yes
    assert isinstance(out.exception, ClusterBusy) and out.exit_code == 1
    msg = str(out.exception)
    assert f"job {earlier} is RUNNING" in msg and "nothing was deleted" in msg
    assert "raytrain-eks logs --follow" in msg and f"ray job stop --address http://127.0.0.1:8265 {earlier}" in msg
    assert raycluster(eks) is not None and eks.kube.deleted[deleted_before:] == []
    assert {p.name for p in eks.kube.pods(eks.d.cfg.ray.namespace)} == pods_before
    assert len(eks.ray.submitted) == 1 and eks.ray.jobs[earlier] == "RUNNING"


def test_compare_fabric_asks_before_replacing_an_idle_raycluster(eks: World):
    deleted_before = len(eks.kube.deleted)
    out = compare_on_eks(input="n\n")
    assert isinstance(out.exception, Cancelled) and "nothing was deleted" in str(out.exception)
    assert "no Ray job is running on it" in out.stderr and "Continue?" in out.stderr
    assert raycluster(eks) is not None and eks.kube.deleted[deleted_before:] == []
    assert len(eks.ray.submitted) == 1

    out = compare_on_eks("--json", input="y\n")
    assert out.exit_code == 0, out.output
    # The question went to stderr; CliRunner echoes the typed answer onto stdout, as a terminal would show it.
    echoed, _, result = out.stdout.partition("\n")
    assert echoed.strip() == "y" and json.loads(result)["speedup"] == pytest.approx(2.5)


def test_compare_fabric_on_eks_refuses_when_efa_is_missing(eks: World):
    eks.ray._fabric = lambda ns: "socket"  # type: ignore[method-assign]  # NCCL falls back whatever the env says
    out = compare_on_eks("-y")
    assert isinstance(out.exception, ComparisonRefused) and "run A (EFA" in str(out.exception)
    assert len(eks.ray.submitted) == 2  # run B was never submitted


@pytest.mark.parametrize("bad", [["--warmup-steps", "-1"], ["--min-samples", "0"]])
def test_bad_numbers_are_refused_before_the_cluster_is_touched(eks: World, bad: list[str]):
    before = raycluster(eks)
    calls = len(eks.kube.deleted)
    result = compare_on_eks("-y", *bad)
    assert result.exit_code == 2 and bad[0] in result.output
    assert raycluster(eks) == before and len(eks.kube.deleted) == calls, "nothing deleted or replaced"


def test_compare_fabric_keeps_both_runs_and_writes_one_report_overlaying_them(eks: World, tmp_path: Path):
    out = compare_on_eks("-y", "--warmup-steps", "10", "--out", str(tmp_path / "cmp"))
    assert out.exit_code == 0, out.output
    folder = tmp_path / "cmp"
    assert f"report: {(folder / 'report.html').resolve()}" in out.stderr
    # Each run's folder holds what its run folder in the head pod held: the metrics and the files the report shows.
    for name, fabric, step_s in (("A-EFA", "efa", 0.5), ("B-TCP", "socket", 1.25)):
        run = folder / name
        kept = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert kept == records(step_s)
        assert json.loads((run / "summary.json").read_text())["fabric"]["verdict"] == fabric
        assert f"require: {fabric}" in (run / "config.yaml").read_text()
        assert f"answered over {fabric}" in (run / "samples.jsonl").read_text()
        assert "NCCL" in (run / "nccl" / "rank0.log").read_text()
    assert json.loads((folder / "comparison.json").read_text())["speedup"] == pytest.approx(2.5)
    page = (folder / "report.html").read_text()
    # One page over both runs: the comparison's verdict, a column per run, both runs' samples and NCCL evidence.
    assert "<h2>Comparison</h2>" in page and "Speed-up EFA / TCP: 2.50x" in page
    assert "<th>A-EFA</th><th>B-TCP</th>" in page
    assert "answered over efa" in page and "answered over socket" in page
    assert page.count("rank0: NCCL lines") == 2
    assert page.count("data:image/png;base64,") >= 3


def test_an_out_folder_holding_a_comparison_is_refused_before_the_cluster_is_touched(eks: World, tmp_path: Path):
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "comparison.json").write_text("{}")
    (tmp_path / "a-file").write_text("x")
    before, calls = raycluster(eks), len(eks.kube.deleted)
    for out_dir, why in (("cmp", "already holds a comparison"), ("a-file", "is a file")):
        result = compare_on_eks("-y", "--out", str(tmp_path / out_dir))
        assert isinstance(result.exception, UserError) and result.exception.exit_code == 2, result.output
        assert why in str(result.exception) and "--out" in str(result.exception)
    assert (tmp_path / "cmp" / "comparison.json").read_text() == "{}"
    assert raycluster(eks) == before and len(eks.kube.deleted) == calls and len(eks.ray.submitted) == 1


def test_comparisons_made_in_the_same_second_each_get_their_own_default_folder(eks: World, tmp_path, same_second):
    same_second(deploy_commands)
    runs, stem = tmp_path / "runs", "compare-fabric-20261202-032457"
    first = compare_on_eks("-y")
    assert first.exit_code == 0, first.output
    kept = (runs / stem / "comparison.json").stat()
    second = compare_on_eks("-y")  # before: refused, the default folder already holding the first comparison
    assert second.exit_code == 0, second.output
    assert sorted(p.name for p in runs.iterdir()) == [stem, f"{stem}-2"]
    assert f"report: {(runs / f'{stem}-2' / 'report.html').resolve()}" in second.stderr
    assert json.loads((runs / f"{stem}-2" / "comparison.json").read_text())["speedup"] == pytest.approx(2.5)
    now = (runs / stem / "comparison.json").stat()
    assert (now.st_ino, now.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns), "the first comparison is not rewritten"
