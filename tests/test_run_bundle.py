"""A run's bundle in its storage (train/bundle.py) and what reads it: ``raytrain-eks results``, the end of ``submit``
and the warning of ``down``.

Hermetic: the bundle of a run folder kept in a local storage folder as the run goes (its sync thread on a short
period), and in moto's S3 where ``up`` put the deployment's bucket; ``submit`` against the deploy tests' fakes
(FakeKube's KubeRay, FakeRay in the pods) on both targets. The bundles of real Ray runs, a failed one fetched and its
report opened in Chromium, are in test_s3_storage.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from charts import crds, vendored
from test_deploy import World, run_script
from test_kubernetes_target import CONTEXT, Cluster
from typer.testing import CliRunner

from raytrain_eks.cli import main
from raytrain_eks.config import load_config
from raytrain_eks.deploy import commands as deploy_commands
from raytrain_eks.deploy import results
from raytrain_eks.deploy import submit as sub
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.cluster import ExecResult
from raytrain_eks.train import bundle as bundle_module
from raytrain_eks.train.bundle import RunBundle

RUN = "20261207-120000-Qwen2.5-1.5B-Instruct"
RECORDS = [{"step": 1, "loss": 2.5, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_s": 900.0, "step_time_s": 0.5}]


def _wait_for(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f} s")
        time.sleep(0.05)


def test_the_bundle_gets_the_metrics_as_the_run_goes_and_its_evidence_when_it_fails(tmp_path: Path):
    run_dir, store = tmp_path / "runs" / "r1", tmp_path / "store"
    run_dir.mkdir(parents=True)
    lines = ["run folder: ..."]
    bundle = RunBundle.start(run_dir, str(store), total_steps=10, lines=lines, every_s=0.05)
    assert bundle is not None and bundle.location == str(store / "r1")
    try:
        (listed,) = results.list_runs(str(store))
        assert (listed.name, listed.state, listed.steps, listed.total_steps) == ("r1", "running", None, 10)
        # A logged step: the driver appends it to metrics.jsonl; the sync thread uploads it, no end of run needed.
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(RECORDS[0]) + "\n")
        bundle.step(RECORDS[0])
        lines.append("precision: bf16")

        def synced() -> bool:
            held = store / "r1" / "metrics.jsonl"
            return held.is_file() and held.read_text() == (run_dir / "metrics.jsonl").read_text()

        _wait_for(synced, "metrics.jsonl reached the bundle")
        _wait_for(lambda: "precision: bf16" in (store / "r1" / "train.log").read_text(), "train.log reached it")
        (listed,) = results.list_runs(str(store))
        assert (listed.state, listed.steps, listed.final_loss) == ("running", 1, 2.5)
        (run_dir / "error.log").write_text("=== training failed: rank 0: boom\nTraceback ...\n")
        assert bundle.fail("training failed: rank 0: boom")
    finally:
        bundle.close()
    assert (store / "r1" / "error.log").read_text() == (run_dir / "error.log").read_text()
    (listed,) = results.list_runs(str(store))
    assert (listed.state, listed.note) == ("failed", "training failed: rank 0: boom")
    # A run folder without storage (a local run) has no bundle and changes nothing.
    assert RunBundle.start(run_dir, None) is None


def test_a_running_bundle_not_heard_from_is_unknown_and_an_interrupted_one_stopped(tmp_path, monkeypatch):
    run_dir = tmp_path / "r2"
    run_dir.mkdir()
    bundle = RunBundle.start(run_dir, str(tmp_path / "store"), every_s=60)
    assert bundle is not None
    monkeypatch.setattr(results, "stale_after_s", lambda: -1.0)  # its driver lost without a word, long ago
    (listed,) = results.list_runs(str(tmp_path / "store"))
    assert listed.state == "unknown" and listed.note.startswith("said running, last heard "), listed
    bundle.close()  # the driver interrupted (Ctrl-C): what it has, marked stopped
    (listed,) = results.list_runs(str(tmp_path / "store"))
    assert listed.state == "stopped"


def test_storage_that_cannot_be_written_warns_once_and_the_run_goes_on(tmp_path: Path):
    (tmp_path / "a-file").write_text("")
    run_dir = tmp_path / "r3"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    warned: list[str] = []
    bundle = RunBundle.start(run_dir, str(tmp_path / "a-file" / "runs"), warn=warned.append, every_s=60)
    assert bundle is not None
    assert bundle.finish({"steps": 1}) is False
    first, last = warned  # once while the run goes, and once at its end
    assert first.startswith(f"run bundle: cannot write {tmp_path}/a-file/runs/r3/") and str(run_dir) in first, first
    assert last.startswith(f"run bundle: 3 file(s) of the run could not be written to {tmp_path}/a-file/runs/r3 ")
    assert f"the run folder {run_dir} keeps everything" in last, last


def test_a_nodes_worker_logs_of_the_run_go_to_the_bundle_each_cut_to_its_tail(tmp_path: Path, monkeypatch):
    # A node's Ray session log folder: the run's job's worker files, another job's, one from before the run, and
    # one too long to keep whole. (Real runs' logs, copied by Ray tasks: test_s3_storage.py.)
    logs, store = tmp_path / "session" / "logs", tmp_path / "store" / "r1"
    logs.mkdir(parents=True)
    monkeypatch.setattr(bundle_module, "_this_node", lambda: (logs, "host-1a2b3c4d"))
    ours = [f"worker-{'ab' * 28}-01000000-4242.out", f"worker-{'ab' * 28}-01000000-4242.err"]
    (logs / ours[0]).write_text(":job_id:01000000\n:actor_name:RayTrainWorker\n")
    (logs / ours[1]).write_text("Setting up process group for: env:// [rank=0, world_size=2]\n")
    (logs / f"worker-{'cd' * 28}-02000000-4343.err").write_text("another job's worker\n")
    (logs / "raylet.err").write_text("not a worker's\n")
    old = logs / f"worker-{'ef' * 28}-01000000-4444.out"
    old.write_text("a run before this one\n")
    os.utime(old, (time.time() - 600, time.time() - 600))
    long = logs / f"worker-{'01' * 28}-01000000-4545.err"
    long.write_text("".join(f"line {i:06d}\n" for i in range(200_000)))  # 2.6 MB

    sent, problem = bundle_module._copy_node_logs(str(store), "01000000", time.time() - 60, {}, keep=1 << 20)
    assert problem is None
    copied = {p.name: p for p in (store / "logs" / "host-1a2b3c4d").iterdir()}
    assert sorted(copied) == sorted([*ours, long.name]) == sorted(sent)
    assert copied[ours[1]].read_text() == (logs / ours[1]).read_text()
    note, first, *_, last = copied[long.name].read_text().splitlines()
    assert note.startswith("[raytrain-eks: the first ") and "the last 1 MiB of each worker log" in note, note
    assert first.startswith("line ") and len(first) == len("line 000000") and last == "line 199999"
    assert copied[long.name].stat().st_size < (1 << 20) + len(note) + 1
    # A later sync copies only what changed since.
    copied[ours[1]].unlink()
    with (logs / ours[0]).open("a") as f:
        f.write("step 2\n")
    again, _ = bundle_module._copy_node_logs(str(store), "01000000", time.time() - 60, sent, keep=1 << 20)
    assert not copied[ours[1]].exists() and copied[ours[0]].read_text().endswith("step 2\n")
    assert again[ours[0]] != sent[ours[0]]


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["results", *args])
    assert info.value.code == 1
    return " ".join(capsys.readouterr().err.split())


def test_results_names_what_is_wrong(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.yaml").write_text("{}\n")
    err = _refused(capsys, "--config", str(tmp_path / "empty.yaml"))
    assert "no storage to list runs from: training.storage_path is not set" in err and "--storage-path" in err, err
    err = _refused(capsys, "--storage-path", str(tmp_path / "nowhere"))
    assert f"the runs' storage {tmp_path / 'nowhere'} is not a folder on this machine" in err, err
    store = tmp_path / "store"
    store.mkdir()
    err = _refused(capsys, "gone", "--storage-path", str(store))
    assert f"no run 'gone' at {store}/gone" in err and "`raytrain-eks results` lists the runs" in err, err
    err = _refused(capsys, "a/b", "--storage-path", str(store))
    assert "'a/b' is not a run's name" in err, err
    run_dir = tmp_path / "r4"
    run_dir.mkdir()
    bundle = RunBundle.start(run_dir, str(store), every_s=60)
    assert bundle is not None
    bundle.close()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    err = _refused(capsys, "r4", "--storage-path", str(store), "--to", str(tmp_path / "busy"))
    assert "--to" in err and "is not empty and holds no fetched run" in err, err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    # A run that logged no step is fetched without a report, and says so.
    main(["results", "r4", "--storage-path", str(store)])
    out = " ".join(capsys.readouterr().out.split())
    assert "(stopped) into runs/r4" in out and "No report: the run logged no step" in out, out


# -- submit and down against the fake cluster ------------------------------------------------------------------


def _job_names_its_run(kube: Any, run_dir: str, *extra: str) -> list[bool]:
    """The fake job's log ends as ``train``'s does, naming its run folder (and ``extra`` lines); the head pod's
    ``run_dir`` is read by the real script (the folder stands for the pod's). Returns, per read of the run folder,
    whether the job's RayCluster still existed then."""
    inner = kube.exec_handler
    reads: list[bool] = []

    def handler(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:3] == ["ray", "job", "logs"]:
            said = inner(ns, pod, argv, stdin)
            tail = "".join(f"{line}\n" for line in extra) + f"Run folder: {run_dir}\n"
            return ExecResult(said.returncode, said.stdout + tail, said.stderr)
        if argv[:3] == [m.IMAGE_PYTHON, "-c", sub._READ_RUN_FILES]:
            reads.append(bool(kube.pods(ns, {"ray.io/node-type": "head"})))
            return run_script(argv[2], argv[3:])
        return inner(ns, pod, argv, stdin)

    kube.exec_handler = handler
    return reads


@pytest.fixture
def ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    """An EKS deployment ``up`` made against the fakes: its bucket in moto's S3 holds the runs."""
    monkeypatch.chdir(tmp_path)
    world = World(tmp_path, load_config(environ={}, path=None))
    world.up()
    world.lines.clear()
    return world


def test_a_rayjob_submit_ends_saying_where_the_runs_bundle_is(ready: World):
    _job_names_its_run(ready.kube, f"/home/ray/runs/{RUN}")
    result = ready.submit(mode="rayjob")
    assert result.exit_code == 0, ready.said()
    bucket = ready.store.get("bucket")
    bundle = f"s3://{bucket}/runs/{RUN}"
    assert result.bundle == bundle and result.run_dir == f"/home/ray/runs/{RUN}"
    # The last lines, after the RayJob's cluster is gone and the GPU group scaled to 0: where the results are now.
    said = ready.said()
    assert said.index("Deleted RayCluster") < said.index("scaling GPU node group") < said.index("Run bundle:")
    assert ready.lines[-2].startswith(f"Run bundle: {bundle} (the export, metrics, summary, report and logs; ")
    assert ready.lines[-1].startswith(f"  fetch it: raytrain-eks results {bundle}")
    assert result.summary[-2:] == ready.lines[-2:]
    job = ready.store.get("job")
    assert (job["run_dir"], job["bundle"]) == (f"/home/ray/runs/{RUN}", bundle)


def test_a_bundle_line_of_the_job_is_where_submit_says_it_is_and_results_lists_the_deployments_runs(
    ready: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    bucket = ready.store.get("bucket")
    elsewhere = f"s3://{bucket}/team/{RUN}"  # the job's own storage, as its log said
    _job_names_its_run(ready.kube, f"/home/ray/runs/{RUN}", f"run bundle: {elsewhere} (`raytrain-eks results` ...)")
    result = ready.submit()
    assert result.bundle == elsewhere and f"Run bundle: {elsewhere} " in ready.said()
    # `results` here reads the deployment's storage from the state up left: the bucket's runs/ prefix.
    run_dir = tmp_path / "pod-runs" / RUN
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    bundle = RunBundle.start(run_dir, f"s3://{bucket}/runs", total_steps=5, every_s=60)
    assert bundle is not None
    bundle.step(RECORDS[0])
    assert bundle.finish({"steps": 5, "final_loss": 1.25, "cost": {"usd": 0.42}})
    main(["results"])
    out = capsys.readouterr().out
    assert f"Runs in s3://{bucket}/runs:" in out, out
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith(RUN)]
    assert row[:2] == [RUN, "finished"] and row[4:] == ["5/5", "1.2500", "$0.42"], out
    # And `down` says, before it deletes anything, that the run's results stay in storage.
    ready.lines.clear()
    lines = _down(ready.d, ready.lines)
    assert f"The last run's results stay in its bundle {elsewhere}" in lines[0]


def _down(d: Any, lines: list[str], *, yes: bool = True) -> list[str]:
    """``raytrain-eks down`` through the CLI on the deployment ``d``; its lines and the deletions' in order."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deploy_commands, "make_deployment", lambda cfg, state_dir, *say: d)
        mp.setattr(deploy_commands, "_say", lines.append)
        app = typer.Typer()
        deploy_commands.register(app)
        done = CliRunner().invoke(app, ["down", *(["-y"] if yes else [])], input=None if yes else "n\n")
    assert done.exit_code == (0 if yes else 1), done.output
    return lines


@pytest.fixture
def one_node(tmp_path: Path, real_tools: Any, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """A kubernetes target of one GPU node and no storage path: the run folder lives only in the head pod."""
    monkeypatch.chdir(tmp_path)
    c = Cluster(tmp_path, real_tools, "cluster.gpu_node_count=1", storage=None)
    # The same settings in the folder's file, for the commands run through the CLI.
    cluster = {"target": "kubernetes", "kubeconfig": str(c.kubeconfig), "context": CONTEXT, "gpu_node_count": 1}
    (tmp_path / "raytrain-eks.yaml").write_text(yaml.safe_dump({"cluster": cluster}))
    c.kube.add_node("gpu-0", labels={}, allocatable={"cpu": "11", "memory": "80Gi", m.GPU_RESOURCE: "4"})
    c.kube.add_node("cpu-0", labels={}, allocatable={"cpu": "7910m", "memory": "29Gi"})
    c.kube.ray_job_status = c.ray.jobs.get  # what a RayJob's dashboard tells the KubeRay fake
    for crd in crds(vendored("kuberay-operator")):  # KubeRay 1.7.0's own CRDs, installed earlier
        c.kube.put(crd)
    c.target.up(c.d(), confirm=c.ask())
    c.lines.clear()
    return c


def _pod_run_folder(tmp_path: Path) -> Path:
    """What the job left in the head pod's run folder, as this test's stand-in for that pod's disk."""
    run_dir = tmp_path / "head-pod" / "runs" / RUN
    (run_dir / "nccl").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({**RECORDS[0], "step": s}) + "\n" for s in (1, 2)))
    (run_dir / "config.yaml").write_text("training:\n  steps: 2\n")
    (run_dir / "summary.json").write_text(json.dumps({"steps": 2, "first_loss": 2.5, "final_loss": 2.5}))
    (run_dir / "nccl" / "rank00000.log").write_text("NCCL INFO Using network Socket\n")
    return run_dir


def test_without_storage_a_rayjob_keeps_its_run_folders_files_here_before_its_pods_go(one_node: Cluster, tmp_path):
    run_dir = _pod_run_folder(tmp_path)
    reads = _job_names_its_run(one_node.kube, str(run_dir))
    result = sub.submit(one_node.d(), mode="rayjob")
    assert result.exit_code == 0, one_node.said()
    assert result.bundle is None and reads == [True], "read while the RayJob's pods were there"
    kept = Path(result.kept or "")
    assert kept == Path("runs") / RUN
    for name in ("metrics.jsonl", "config.yaml", "summary.json", "nccl/rank00000.log"):
        assert (kept / name).read_text() == (run_dir / name).read_text(), name
    assert (kept / "report.html").is_file()  # written here from the metrics
    assert one_node.lines[-1].startswith(f"Run folder {run_dir} went with the RayJob's pods")
    assert f"are here: {kept}" in one_node.lines[-1] and "set training.storage_path" in one_node.lines[-1]


def test_without_storage_down_says_the_head_pods_run_folder_goes_before_deleting_it(one_node: Cluster, tmp_path):
    run_dir = _pod_run_folder(tmp_path)
    _job_names_its_run(one_node.kube, str(run_dir))
    result = sub.submit(one_node.d())
    assert result.exit_code == 0 and result.bundle is None, one_node.said()
    (head,) = one_node.kube.pods("default", {"ray.io/node-type": "head"})
    assert one_node.lines[-1] == (
        f"Run folder {run_dir} is only in the head pod {head.name} (training.storage_path is not set, so the run has "
        "no bundle in storage): `raytrain-eks down` deletes it with the pod"
    )
    one_node.lines.clear()
    # Declined: said, and nothing deleted.
    lines = _down(one_node.d(), one_node.lines, yes=False)
    assert lines[0].startswith(f"Lost with the head pod {head.name}: the last job's run folder {run_dir}")
    copy = f"kubectl --kubeconfig {one_node.kubeconfig} --context nowhere -n default cp -c ray-head"
    assert lines[1] == f"  to keep it, copy it here first: {copy} {head.name}:{run_dir} runs/{RUN}", lines
    assert not one_node.kube.deleted
    one_node.lines.clear()
    lines = _down(one_node.d(), one_node.lines)
    assert lines[0].startswith(f"Lost with the head pod {head.name}") and one_node.kube.deleted, lines
    deleting = next(i for i, line in enumerate(lines) if "RayCluster" in line and "Delet" in line)
    assert deleting > 1, lines
