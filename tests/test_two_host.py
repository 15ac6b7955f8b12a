"""The two-host tier: a real two-node Ray cluster in network namespaces on this machine (see tests/twohost.py).

Each host has its own private ``/tmp`` (Ray's session folder, run folders); what they share goes through moto's
S3 server on host 0's address. Covers: a ``train --address`` run with ``s3://`` storage places its ranks on both
hosts and completes (placement proven from each host's own Ray Train logs), ``--resume`` continues it from S3 on
the host with the run folder, then on the other host (no run folder there) from the S3 storage folder, which also
exports the model from S3; a local storage folder not declared shared is refused with one message before anything
starts; the bandwidth probe reports ranks on two nodes and a bandwidth figure, and with one host's link capped by
``tc`` it reports the lower figure and a ``degraded`` verdict against the configured line rate, and ``check``'s pair
probe, run as the head pod's job of a fake Kubernetes cluster whose head pod is host 0 and whose two worker pods are
the two hosts, names that pair with its figure, exits 1 and with ``--exclude-bad-nodes`` cordons both of its nodes (one
pair cannot tell which end is slow); a run whose worker
on host 1 is killed (SIGKILL), and then loses host 1 itself (replaced by a fresh host with an empty disk), ends with
the losses and the weights of the same run without faults; in a run whose worker on host 1 is first held to a
tenth of a CPU (a cgroup), then stopped (SIGSTOP), the first makes it a straggler named with its host, the second
makes the watchdog name it and end the run. That run without faults is the one the placement and
resume test checks and continues: one cluster and one such run for the module (each training costs a Ray Train
start on the cluster). Needs root and iproute2; skipped otherwise, with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file
from test_deploy import World
from test_health import UNKNOWN_CUDA_IMAGE
from twohost import BUCKET, HOST_IPS, TwoHostCluster, WorkerRecord, requirement_missing, tool
from typer.testing import CliRunner

from raytrain_eks.config import load_config
from raytrain_eks.deploy import commands as deploy_commands
from raytrain_eks.k8s.cluster import ExecResult
from raytrain_eks.report.segments import SEGMENTS, read_segments

_MISSING = requirement_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

CAP = "100mbit"
EXPECTED_GBPS = 0.6  # the configured line rate: well below the veth's 1.5-6 Gbit/s here, six times the cap
PROBE_SIZES = ["--min-bytes", "1M", "--max-bytes", "4M", "--iters", "3", "--warmup", "1"]


STORAGE = f"s3://{BUCKET}/runs"
# Every step logged, a checkpoint every 4 steps: the runs without and with faults are compared step by step.
FAULTS_CONFIG = "training:\n  log_every: 1\n  checkpoint_every: 4\n"
FAULT_STEPS = 16


@pytest.fixture(scope="module")
def cluster(two_hosts: TwoHostCluster) -> TwoHostCluster:
    return two_hosts


def _train_cmd(cluster) -> list[str]:
    return [tool("raytrain-eks"), "train", "--address", cluster.address, "--preset", "local-tiny"]


@dataclass(frozen=True)
class SteadyRun:
    """The run without faults, as it was when it ended: its output, summary, metric records and weights, the Ray
    Train workers its hosts' logs show, and whether host 1 or host 0's run folder held any of its files."""

    output: str
    summary: dict
    records: list[dict]
    weights: dict[str, torch.Tensor]
    workers: list[WorkerRecord]
    run_folder_on_host_1: bool
    checkpoints_in_run_folder: bool


@pytest.fixture(scope="module")
def steady_run(cluster, builtin_model) -> SteadyRun:
    """``train --address`` across both hosts, ``s3://`` storage, :data:`FAULTS_CONFIG`: one run for the module.

    The placement and resume test checks it and then continues it; the fault test compares a faulty run with it.
    What both read is taken here, when the run ends: later tests continue its folder (on host 0) and replace host 1.
    """
    cluster.host_path(0, "/tmp/work/faults.yaml").write_text(FAULTS_CONFIG)
    before = {w.job_id for w in cluster.train_workers()}
    cmd = [*_train_cmd(cluster), "--config", "/tmp/work/faults.yaml", "--steps", str(FAULT_STEPS)]
    proc = cluster.run([*cmd, "--storage-path", STORAGE, "--output-dir", "steady"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = cluster.host_path(0, "/tmp/work/steady")
    return SteadyRun(
        output=proc.stdout + proc.stderr,
        summary=json.loads((run / "summary.json").read_text()),
        records=_records(run / "metrics.jsonl"),
        weights=load_file(run / "model" / "model.safetensors"),
        workers=[w for w in cluster.train_workers() if w.job_id not in before],
        run_folder_on_host_1=cluster.host_path(1, "/tmp/work/steady").exists(),
        checkpoints_in_run_folder=(run / "ray").exists(),
    )


def test_teardown_removes_namespaces_and_processes_even_after_an_error(network_namespaces):
    c = network_namespaces(start_ray=False)
    with pytest.raises(RuntimeError, match="boom"), c:
        sleeper = subprocess.Popen(["ip", "netns", "exec", c.host_ns[1], "sleep", "600"])
        # The hosts reach each other over the bridge, and only through it.
        proc = c.run([sys.executable, "-c", _CONNECT % (HOST_IPS[1], 22)], host=0, timeout=30)
        assert proc.stdout.strip() == "refused", proc.stderr
        raise RuntimeError("boom")
    assert sleeper.wait(timeout=30) != 0
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(ns in names for ns in (*c.host_ns, c.bridge_ns))


# Connects to HOST:PORT: "refused" means the host answered (nothing listens there), "unreachable" means no route.
_CONNECT = """
import socket
try:
    socket.create_connection((%r, %d), timeout=5)
except ConnectionRefusedError:
    print("refused")
except OSError:
    print("unreachable")
"""


def test_train_places_ranks_on_both_hosts_and_resumes_from_s3_on_either_host(cluster, steady_run):
    summary = steady_run.summary
    assert summary["steps"] == FAULT_STEPS and summary["world_size"] == 2 and summary["nodes"] == 2
    assert summary["sharding"] == "hsdp"  # auto: one rank on each of two nodes, replicated across them
    assert "sharding: hsdp: 2 nodes x 1 rank," in steady_run.output
    # The two newest checkpoints are kept (training.keep_checkpoints), both in S3.
    assert summary["checkpoints"] == [f"{STORAGE}/steady/ray/checkpoint_{s:08d}" for s in (12, 16)]
    # Host 1 wrote its shard to S3 only: nothing of the run is on its own disk, nor in host 0's run folder.
    assert not steady_run.run_folder_on_host_1 and not steady_run.checkpoints_in_run_folder

    workers = steady_run.workers
    # Each host's own Ray logs show one of the two ranks (which one is Ray's choice), each on its own node.
    assert sorted(w.host for w in workers) == [0, 1]
    assert sorted((w.world_rank, w.node_rank) for w in workers) == [(0, 0), (1, 1)]
    assert workers[0].node_id != workers[1].node_id

    # The run folder's config.yaml names the S3 storage: the resume reads the checkpoint from there.
    cmd, storage = _train_cmd(cluster), STORAGE
    run = cluster.host_path(0, "/tmp/work/steady")
    proc = cluster.run([*cmd, "--resume", "/tmp/work/steady", "--steps", "18"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"from {storage}/steady/ray/checkpoint_00000016" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["resumed_from_step"], summary["steps"]) == (16, 18)
    assert (run / "model" / "model.safetensors").is_file()

    # Host 1 has no run folder: it continues the run from the S3 storage folder (the run's config.yaml is there),
    # in a run folder of its own, the checkpoints still going to S3.
    proc = cluster.run([*cmd, "--resume", f"{storage}/steady", "--steps", "20"], host=1, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"from {storage}/steady/ray/checkpoint_00000018" in proc.stdout
    elsewhere = cluster.host_path(1, "/tmp/work/runs/steady")
    summary = json.loads((elsewhere / "summary.json").read_text())
    assert (summary["resumed_from_step"], summary["steps"]) == (18, 20)
    assert summary["checkpoints"][-1] == f"{storage}/steady/ray/checkpoint_00000020"

    # And exports the newest checkpoint straight from the S3 storage folder.
    out = "/tmp/work/exported"
    proc = cluster.run([tool("raytrain-eks"), "export", f"{storage}/steady", out], host=1, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    exported = load_file(cluster.host_path(1, out) / "model.safetensors")
    at_end = load_file(elsewhere / "model" / "model.safetensors")
    assert exported.keys() == at_end.keys() and all(torch.equal(exported[k], at_end[k]) for k in at_end)
    marker = json.loads((cluster.host_path(1, out) / ".raytrain-eks-export").read_text())
    assert marker["checkpoint"] == f"{storage}/steady/ray/checkpoint_00000020"


def test_local_storage_on_two_hosts_is_refused_before_anything_starts(cluster):
    cmd = [*_train_cmd(cluster), "--storage-path", "/tmp/work/store", "--output-dir", "refused"]
    proc = cluster.run(cmd, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    assert "training.storage_path = '/tmp/work/store'" in err and "span 2 nodes" in err, err
    assert "s3://BUCKET/PREFIX" in err and "training.storage_shared: true" in err and "Traceback" not in err
    assert not cluster.host_path(0, "/tmp/work/refused").exists()
    assert not cluster.host_path(0, "/tmp/work/store").exists()


def _probe(cluster, config) -> dict:
    cmd = [tool("raytrain-eks"), "probe", "--address", cluster.address, "--config", config, "--json"]
    proc = cluster.run([*cmd, *PROBE_SIZES], timeout=300)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert proc.returncode == (0 if report["verdict"] == "healthy" else 1)
    return report


class HeadOnHost0:
    """The fake cluster's head pod is host 0: the pair probe's job (``ray job submit ... -- python3 -m raytrain_eks.cli
    probe --pairs --address auto ...``) runs its entrypoint there, as Ray's job supervisor runs an entrypoint on the
    head node of its cluster, and what it prints comes back as ``ray job submit``'s output (it tails the job's logs).
    The entrypoint runs as this environment's console script, joined to the cluster's address. Every other command
    goes to the fake's Ray pods (FakeRay: the node checks' recordings, the package upload)."""

    def __init__(self, cluster: TwoHostCluster, world: World) -> None:
        self.cluster, self.world = cluster, world

    def __call__(self, ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:3] != ["ray", "job", "submit"] or "--pairs" not in argv:
            return self.world.ray(ns, pod, argv, stdin)
        entry = argv[argv.index("--") + 1 :]
        assert entry[:4] == ["python3", "-m", "raytrain_eks.cli", "probe"], entry
        cmd = [tool("raytrain-eks"), *entry[3:]]
        cmd[cmd.index("auto")] = self.cluster.address
        proc = self.cluster.run(cmd, timeout=300)
        return ExecResult(proc.returncode, proc.stdout, proc.stderr)


def _fake_cluster_on_the_hosts(cluster: TwoHostCluster, tmp_path: Path) -> tuple[World, list[str]]:
    """The deploy tests' world after ``up`` and ``submit``, its two worker pods at the two hosts' addresses (a Ray
    node goes by its pod's IP); the image one whose CUDA is not known here, so the fake nodes' recorded driver passes.
    Returns the world and the worker pods' node names, in host order."""
    world = World(tmp_path, load_config(environ={}, path=None, sets=[f"ray.image={UNKNOWN_CUDA_IMAGE}"]))
    world.up()
    assert world.submit().exit_code == 0
    cfg = world.d.cfg
    workers = world.kube.pods(cfg.ray.namespace, {"ray.io/cluster": cfg.ray.cluster_name, "ray.io/node-type": "worker"})
    workers = sorted(workers, key=lambda p: p.name)
    for pod, ip in zip(workers, cluster.ips, strict=True):
        world.kube.set_pod_ip(pod.namespace, pod.name, ip)
    world.kube.exec_handler = HeadOnHost0(cluster, world)
    return world, [str(p.node_name) for p in workers]


def _check(world: World, monkeypatch: pytest.MonkeyPatch, *args: str):
    monkeypatch.setattr(deploy_commands, "make_deployment", lambda cfg, state_dir, *say: world.d)
    app = typer.Typer()
    deploy_commands.register(app)
    return CliRunner().invoke(app, ["check", *args])


def test_probe_measures_the_link_and_sees_a_cap(cluster, tmp_path, aws_env, monkeypatch):
    config = "/tmp/work/probe.yaml"  # on host 0, where the probe's driver runs
    cluster.host_path(0, config).write_text(f"fabric:\n  expected_gbps: {EXPECTED_GBPS}\n")

    free = _probe(cluster, config)
    assert free["num_nodes"] == 2 and free["world_size"] == 2 and free["backend"] == "gloo"
    # One rank on each host (which one gets rank 0 is Ray's choice).
    assert sorted(free["nodes"]) == sorted(cluster.ips) and sorted(free["nodes"].values()) == [[0], [1]]
    assert sorted((r["rank"], r["node_rank"]) for r in free["ranks"]) == [(0, 0), (1, 1)]
    assert {r["op"] for r in free["results"]} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert (free["expected_gbps"], free["expected_source"]) == (EXPECTED_GBPS, "fabric.expected_gbps")
    assert free["verdict"] == "healthy", free["reason"]

    with cluster.capped(1, CAP):
        capped = _probe(cluster, config)
    assert capped["num_nodes"] == 2
    assert capped["verdict"] == "degraded", capped["reason"]
    assert capped["best_busbw_gbps"] <= 0.1 * 1.1, "busbw cannot beat the 100 Mbit/s cap (10% slack)"
    assert capped["best_busbw_gbps"] < free["best_busbw_gbps"] / 3

    # check's pair probe over the same capped link, from a (fake) Kubernetes cluster whose pods are the two hosts.
    world, nodes = _fake_cluster_on_the_hosts(cluster, tmp_path)
    sizes = ["--probe-max-bytes", "4M", "--probe-iters", "3", "--expected-gbps", str(EXPECTED_GBPS)]
    started = time.monotonic()
    with cluster.capped(1, CAP):
        checked = _check(world, monkeypatch, *sizes, "--exclude-bad-nodes")
    check_s = time.monotonic() - started
    assert checked.exit_code == 1, checked.output
    assert f"pairs: bus bandwidth against the line rate {EXPECTED_GBPS:g} Gbit/s (--expected-gbps)" in checked.output
    (pair,) = [line.strip() for line in checked.output.splitlines() if line.startswith(f"  {nodes[0]} - {nodes[1]}: ")]
    busbw = float(pair.split(": ")[1].split(" Gbit/s")[0])
    assert busbw <= 0.1 * 1.1 and pair.endswith("(below 50%)"), pair
    assert f"check: failing nodes: {nodes[0]}, {nodes[1]}" in checked.output
    for node in nodes:  # two nodes, one slow pair: both are named, both cordoned
        assert world.kube.get("v1", "Node", node)["spec"].get("unschedulable") is True
        assert f"cordoned node {node}" in checked.output
    # Print the figures (pytest -s shows them): the benchmark reports the same with more sizes.
    print(f"\nprobe busbw: {free['best_busbw_gbps']:.3f} Gbit/s free, {capped['best_busbw_gbps']:.3f} capped at {CAP}")
    print(f"check, capped: {pair} ({check_s:.1f} s)")


def _records(path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return records


def _wait_for(proc, metrics, done, what: str, timeout: float = 400) -> list[dict]:
    """Wait until ``done(records)`` holds for the run's metric records; fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = _records(metrics)
        if done(records):
            return records
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}")
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout:.0f} s")


def test_a_killed_worker_and_a_lost_node_end_as_an_uninterrupted_run(cluster, steady_run, tmp_path):
    """SIGKILL of the training worker on host 1, then the loss of host 1 itself (a fresh host with an empty disk
    takes its place): the run goes back to its last checkpoint in S3 each time and ends exactly where the same run
    without faults (:func:`steady_run`) ends."""
    steady = steady_run.records
    assert [r["step"] for r in steady] == list(range(1, FAULT_STEPS + 1))
    cmd = [*_train_cmd(cluster), "--config", "/tmp/work/faults.yaml", "--steps", str(FAULT_STEPS)]
    cmd += ["--storage-path", STORAGE]

    before = {w.job_id for w in cluster.train_workers()}
    run = cluster.popen([*cmd, "--output-dir", "faulty"], log=tmp_path / "faulty.log")
    try:
        metrics = cluster.host_path(0, "/tmp/work/faulty/metrics.jsonl")
        # Checkpoint 4 is written before step 5 runs: kill host 1's worker once step 5 is logged.
        seen = _wait_for(run, metrics, lambda rs: any(r["step"] >= 5 for r in rs), "step 5")
        assert cluster.kill_train_workers(1), "no Ray Train worker process found on host 1"
        killed_at = len(seen)
        # Back from checkpoint 4 and past checkpoint 8: then host 1 is lost, disk and all, and replaced.
        seen = _wait_for(
            run, metrics, lambda rs: any(r["step"] >= 9 for r in rs[killed_at:]), "step 9 after the worker kill"
        )
        cluster.replace_host(1)
        lost_at = len(seen)
        assert run.wait(timeout=600) == 0, (tmp_path / "faulty.log").read_text()[-4000:]
    finally:
        if run.poll() is None:
            run.kill()
    output = (tmp_path / "faulty.log").read_text()
    records = _records(metrics)
    steps = [r["step"] for r in records]
    # The run went back twice: after the kill and after the loss of the node, each time to a checkpoint.
    backs = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert len(backs) == 2 and backs[0] >= killed_at - 1 and backs[1] >= lost_at - 1, steps
    assert all(steps[i] - 1 in (0, 4, 8, 12) for i in backs), steps
    # Step by step, the last record of each step equals the run without faults.
    last = {r["step"]: r for r in records}
    assert sorted(last) == list(range(1, FAULT_STEPS + 1))
    for want in steady:
        got = last[want["step"]]
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), (want["step"], got["loss"], want["loss"])
    summary = json.loads(cluster.host_path(0, "/tmp/work/faulty/summary.json").read_text())
    assert summary["resumed_from_step"] in (4, 8, 12) and summary["steps"] == FAULT_STEPS
    # The final weights are bit for bit those of the run without faults.
    faulty = load_file(cluster.host_path(0, "/tmp/work/faulty/model/model.safetensors"))
    steady_weights = steady_run.weights
    assert faulty.keys() == steady_weights.keys()
    assert all(torch.equal(faulty[k], steady_weights[k]) for k in steady_weights)
    # The last attempt ran one rank on the new host (its own Ray logs say so).
    workers = [w for w in cluster.train_workers() if w.job_id not in before]
    assert any(w.host == 1 for w in workers), (workers, output[-2000:])


# Every step logged; no checkpoint before the end; the watchdog acts after max(10 x the median step, 10 s).
WATCHDOG_CONFIG = "training:\n  log_every: 1\n  checkpoint_every: 0\n  watchdog_factor: 10\n  watchdog_floor_s: 10\n"
CPU_SHARE = 0.1  # of one CPU, for the worker on host 1 while it is capped: below the optimizer step's own CPU time


@contextlib.contextmanager
def _cpu_capped(pids: list[int], share: float):
    """The processes ``pids`` in a CPU cgroup of their own, limited to ``share`` of a CPU (cgroup v2's ``cpu.max``
    or v1's CFS quota); back in the root cgroup after. Skips the test where neither can be written."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    root = Path("/sys/fs/cgroup") if v2.is_file() else Path("/sys/fs/cgroup/cpu")
    group = root / f"rtek-slow-{os.getpid()}"
    try:
        group.mkdir()
        # A 10 ms period (not the default 100 ms): the capped process runs in slices of 1 ms, so a 10 ms piece of work
        # takes about 100 ms every time, instead of 10 ms when it starts as the quota refills.
        period = 10_000
        if v2.is_file():
            (group / "cpu.max").write_text(f"{int(share * period)} {period}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(int(share * period)))
    except OSError as exc:
        pytest.skip(f"cannot make a CPU cgroup here ({exc}): the straggler check needs cgroup v1 or v2, writable")
    try:
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            group.rmdir()


def test_a_slowed_rank_is_named_a_straggler_and_a_stopped_one_ends_the_run(cluster, tmp_path):
    """One run, two faults on host 1's worker. Its CPU capped (a cgroup) after step 3: it is named a straggler, with
    host 1, within 20 steps. Then SIGSTOP: the other rank waits in a collective for it; the watchdog names the
    stopped rank and host 1 within three times its threshold, keeps both ranks' stacks in the run folder, and the
    run ends with its message, long before the collective's own timeout."""
    cluster.host_path(0, "/tmp/work/watchdog.yaml").write_text(WATCHDOG_CONFIG)
    cmd = [*_train_cmd(cluster), "--config", "/tmp/work/watchdog.yaml", "--steps", "400", "--storage-path", STORAGE]
    log = tmp_path / "hung.log"
    run = cluster.popen([*cmd, "--output-dir", "hung"], log=log)
    folder = cluster.host_path(0, "/tmp/work/hung")
    try:
        capped_at = _wait_for(run, folder / "metrics.jsonl", lambda rs: any(r["step"] >= 3 for r in rs), "step 3")
        # SIGCONT changes nothing of a running process: the call finds host 1's worker processes.
        with _cpu_capped(cluster.kill_train_workers(1, signal.SIGCONT), CPU_SHARE):
            named = _wait_for(
                run, folder / "metrics.jsonl", lambda rs: any(r.get("stragglers") for r in rs), "a straggler's record"
            )
        assert cluster.kill_train_workers(1, signal.SIGSTOP), "no Ray Train worker process found on host 1"
        stopped_at = time.monotonic()
        while not (folder / "watchdog" / "findings.json").exists() and run.poll() is None:
            time.sleep(0.2)
        named_after = time.monotonic() - stopped_at
        assert run.wait(timeout=120) == 1, log.read_text()[-4000:]
        ended_after = time.monotonic() - stopped_at
    finally:
        cluster.kill_train_workers(1)  # the stopped one too (SIGKILL ends a stopped process), when the run left it
        if run.poll() is None:
            run.kill()
    output = log.read_text()
    finding = json.loads((folder / "watchdog" / "findings.json").read_text())
    host_1 = next(r for r in finding["ranks"] if r["host"] == cluster.ips[1])

    # The straggler: host 1's rank, named in a line, in the next logged step's record, within 20 steps of the cap.
    assert f"straggler: rank {host_1['rank']} on host {cluster.ips[1]}" in output, output[-3000:]
    named = next(r for r in named if r.get("stragglers"))
    assert [(s["rank"], s["host"]) for s in named["stragglers"]] == [(host_1["rank"], cluster.ips[1])]
    assert named["step"] - capped_at[-1]["step"] <= 20, (named["step"], capped_at[-1]["step"])
    rows = _records(folder / "rank_steps.jsonl")
    assert rows and all(len(row["own_s"]) == 2 for row in rows)

    # The hang: host 1's rank, named by its stopped process, with the collective the other waits in.
    assert (finding["rank"], finding["host"]) == (host_1["rank"], cluster.ips[1]), finding
    assert "its process is stopped (state T)" in finding["reason"]
    assert named_after <= 3 * finding["threshold_s"], (named_after, finding["threshold_s"])
    assert finding["collective"], finding
    message = f"watchdog: rank {finding['rank']} on host {cluster.ips[1]}"
    assert message in output and f"the other ranks wait in {finding['collective']}" in output, output[-3000:]
    assert "Traceback" not in output
    stacks = {p.name: p.read_text() for p in (folder / "watchdog").glob("rank*.txt")}
    assert sorted(stacks) == ["rank0.txt", "rank1.txt"], sorted(stacks)
    assert "process state T" in stacks[f"rank{finding['rank']}.txt"]
    assert all("raytrain_eks/train/loop.py:" in text for text in stacks.values()), stacks  # inside the loop
    # The attempt is a failed segment of the run: its two workers on the cluster's hosts, ended by the watchdog.
    (segment,) = read_segments(folder / SEGMENTS)
    assert (segment.ended, segment.world_size, segment.first_step) == ("failed", 2, 0), segment
    assert segment.reason.startswith("watchdog: rank") and set(cluster.ips) <= set(segment.hosts), segment
    assert segment.last_step >= named["step"] and segment.capacity == "cluster (capacity not recorded)"
    threshold = finding["threshold_s"]
    print(f"\n{named['stragglers'][0]} at step {named['step']}, capped after step {capped_at[-1]['step']}")
    print(f"{finding['message']}\nnamed {named_after:.1f} s after SIGSTOP (threshold {threshold:.0f} s), run over")
    print(f"{ended_after:.1f} s after it; the stacks:\n" + "\n".join(stacks[name] for name in sorted(stacks)))
