"""The GPU node checks (``raytrain_eks.health``) and ``raytrain-eks check``.

The parsers read public recordings of each tool (fixtures/recorded/, sources in SOURCES.md), healthy and failing.
``check`` and ``submit``'s gate run against the deploy tests' world (FakeKube, FakeRay answering in the worker pods
with those recordings through ``gpu_node_tools.GpuNodeTools``): a node whose pod answers as the failing recordings do is
named with its evidence, the command exits 1, and ``--exclude-bad-nodes`` cordons it; on the image whose CUDA this tool
knows (13.0), the recorded 535 driver fails both nodes. The pair probe's job in the head pod is answered with what
``probe --pairs --json`` prints (built by the probe's own report classes); the two-host tier runs it for real. Which
node slow pairs blame is judged on three nodes here. The EKS node group's replacement of a failing node's instance
runs against moto's Auto Scaling.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import boto3
import pytest
import typer
from test_deploy import RECORDED, World, run_script
from typer.testing import CliRunner

from raytrain_eks.config import load_config
from raytrain_eks.deploy import checks
from raytrain_eks.deploy import commands as deploy_commands
from raytrain_eks.eks.replace import instance_of, replace_instance
from raytrain_eks.errors import UserError
from raytrain_eks.fabric.probe import PairsReport, ProbeNode, ProbeSpec, build_report
from raytrain_eks.folders import NODE_CHECKS, NODE_CHECKS_ENV, keep_node_checks
from raytrain_eks.health import parsers
from raytrain_eks.health.node import Expectation, Finding, NodeHealth, check_node
from raytrain_eks.health.pairs import PairFigure, judge_pairs
from raytrain_eks.k8s.cluster import ExecResult
from raytrain_eks.k8s.state import apply_state

# An image tag this tool does not know the contents of (a floating tag): its CUDA, so the driver it needs, is unknown
# and the driver is not judged, so these tests see the other checks alone. The default image (CUDA 13.0) is the
# driver test's.
UNKNOWN_CUDA_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda"
RUN_DIR = "/tmp/raytrain-eks/runs/20261208-000000-tiny"  # the job's run folder in the head pod


@pytest.fixture
def ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    """The deploy tests' world after ``up``: the EKS cluster, its two GPU nodes and plugins, in the fakes; the head
    pod's pair probe answered by :class:`PairProbeJob`."""
    world = World(tmp_path, load_config(environ={}, path=None, sets=[f"ray.image={UNKNOWN_CUDA_IMAGE}"]))
    world.up()
    world.probe = PairProbeJob(world)
    world.kube.exec_handler = world.probe
    return world


class PairProbeJob:
    """The head pod's answer to ``check``'s pair probe job (``checks.pair_probe_argv``): what ``ray job submit``
    prints around the job's logs (ray/dashboard/modules/job/cli.py: "Job '...' submitted successfully", "Tailing logs
    until the job exits (disable with --no-wait):", "Job '...' succeeded"), the logs being ``probe --pairs --json``'s
    report, built by the probe's own classes from ranks timed at ``gbps`` between each pair of worker pods (by IP,
    given to the pods here). Every other command goes to FakeRay."""

    def __init__(self, world: World, gbps: float = 35.0) -> None:
        self.world, self.gbps = world, gbps
        self.slow: dict[frozenset[str], float] = {}  # Gbit/s of a pair of IPs, where not ``gbps``
        self.runs = 0

    def __call__(self, ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:3] == ["ray", "job", "submit"] and "--pairs" in argv:
            return self.answer(argv)
        if argv[:3] == ["python3", "-c", checks._WRITE]:  # the gate's checks into the run folder: the head's disk here
            return run_script(argv[2], [str(self.world.ray.tmp / "head" / argv[3].lstrip("/"))], stdin)
        found = self.world.ray(ns, pod, argv, stdin)
        if argv[:3] == ["ray", "job", "logs"]:  # what `train` prints first and last (train/launch.py)
            return ExecResult(found.returncode, f"Run folder: {RUN_DIR}\n{found.stdout}", found.stderr)
        return found

    def ips(self) -> list[str]:
        workers = _workers(self.world)
        for i, p in enumerate(workers):
            self.world.kube.set_pod_ip(p.namespace, p.name, f"10.0.1.{11 + i}")
        return [f"10.0.1.{11 + i}" for i in range(len(workers))]

    def answer(self, argv: list[str]) -> ExecResult:
        self.runs += 1
        value = dict(zip(argv, argv[1:], strict=False))
        spec = ProbeSpec(("all_reduce",), int(value["--min-bytes"]), int(value["--max-bytes"]), int(value["--iters"]))
        nodes = [ProbeNode(f"node-{ip}", ip, 1) for ip in self.ips()]
        pairs: list[Any] = []
        for i, a in enumerate(nodes):
            for b in nodes[i + 1 :]:
                gbps = self.slow.get(frozenset((a.ip, b.ip)), self.gbps)  # two ranks: busbw = algbw
                times = {"all_reduce": [size / (gbps * 1e9 / 8) for size in spec.sizes]}
                ranks = [
                    {
                        "placement": dict(
                            rank=r, local_rank=0, node_rank=r, node_ip=n.ip, node_id=n.node_id, device="cuda:0"
                        ),
                        "times": times,
                    }  # fmt: skip
                    for r, n in enumerate((a, b))
                ]
                report = build_report(
                    {"backend": "nccl", "ranks": ranks}, spec, expected_gbps=None, expected_source=None
                )
                pairs.append(((a.ip, b.ip), report, None))
        logs = PairsReport(nodes, pairs, "nccl").to_json()
        job = "raysubmit_pairs"
        said = f"Job '{job}' submitted successfully\nTailing logs until the job exits (disable with --no-wait):\n"
        return ExecResult(0, f"{said}{logs}\n{'-' * 40}\nJob '{job}' succeeded\n{'-' * 40}\n")


def _read(name: str) -> str:
    return (RECORDED / name).read_text()


# -- parsers on the recordings -------------------------------------------------------------------------------------


def test_gpu_table_reads_every_gpu_and_its_uncorrectable_ecc_count():
    healthy = parsers.gpu_table(_read("nvidia_smi_4xl4.txt"))
    assert [(g.index, g.name, g.bus_id, g.uncorrected_ecc) for g in healthy] == [
        (0, "NVIDIA L4", "00000000:38:00.0", 0),
        (1, "NVIDIA L4", "00000000:3A:00.0", 0),
        (2, "NVIDIA L4", "00000000:3C:00.0", 0),
        (3, "NVIDIA L4", "00000000:3E:00.0", 0),
    ]
    assert parsers.driver_version(_read("nvidia_smi_4xl4.txt")) == "535.183.01"
    failing = parsers.gpu_table(_read("nvidia_smi_ecc_uncorrected.txt"))
    assert [(g.index, g.bus_id, g.uncorrected_ecc) for g in failing] == [
        (0, "00000000:54:00.0", 0),
        (1, "00000000:55:00.0", 2),
    ]
    assert [g.index for g in parsers.gpu_table(_read("nvidia_smi.txt"))] == [0]  # the A10G of the older recording


def test_remapped_rows_are_read_by_their_header():
    rows = parsers.remapped_rows(_read("nvidia_smi_remapped_rows.txt"))
    assert [(r.gpu, r.uncorrectable, r.pending, r.failure) for r in rows][:2] == [
        ("GPU-a895322e-...", 0, False, False),
        ("GPU-455e672a-...", 1, False, False),  # remapped after the reset: nothing pending, nothing failed
    ]
    assert len(rows) == 4
    assert parsers.remapped_rows('Field "remapped_rows.pending" is not a valid field to query.\n') == []


def test_xids_of_a_kernel_log():
    found = parsers.xids(_read("kernel_xid_dbe.txt"))
    assert [x.code for x in found] == [48, 171, 48, 63, 154]
    assert found[0].pci == "PCI:0000:55:00" and found[0].text.startswith("An uncorrectable double bit error (DBE)")


def test_dcgm_diag_results_with_the_lines_under_a_failure():
    assert [(r.test, r.result) for r in parsers.dcgm_diag(_read("dcgmi_diag_pass.txt"))] == [
        ("software", "Pass"),
        ("memory", "Pass"),
        ("pcie", "Pass"),
    ]
    (failed,) = parsers.dcgm_diag(_read("dcgmi_diag_pcie_fail.txt"))
    assert failed.test == "pcie" and failed.result == "Fail"
    assert failed.detail[0] == "There was an internal error during the test:" and "Rerun diagnos" in failed.detail[-2]


def test_efa_devices_counts_each_device_once():
    assert parsers.efa_devices(_read("fi_info_efa.txt")) == ["rdmap0s6"]  # its -rdm and -dgrm entries: one device
    assert len(parsers.efa_devices(_read("fi_info_efa_rdm_p4de.txt"))) == 4  # a p4de.24xlarge's 4 EFA interfaces
    assert parsers.efa_devices(_read("fi_info_no_efa.txt")) == []


# -- one node ------------------------------------------------------------------------------------------------------


def _node_answering(answers: dict[str, ExecResult]) -> Any:
    def run(argv: list[str]) -> ExecResult:
        return answers.get(argv[0] if argv[0] != "nvidia-smi" or len(argv) == 1 else "remap", ExecResult(127, ""))

    return run


def test_a_node_with_a_double_bit_error_fails_with_the_evidence():
    run = _node_answering(
        {
            "nvidia-smi": ExecResult(0, _read("nvidia_smi_ecc_uncorrected.txt")),
            "remap": ExecResult(0, _read("nvidia_smi_remapped_rows.txt")),
            "dmesg": ExecResult(0, _read("kernel_xid_dbe.txt")),
            "dcgmi": ExecResult(0, _read("dcgmi_diag_pcie_fail.txt")),
            "fi_info": ExecResult(0, _read("fi_info_efa_rdm_p4de.txt")),
        }
    )
    health = check_node("gpu-node-a", "worker-0", run, Expectation(gpus=2, efa=4))
    assert not health.ok
    failed = {f.check: f.evidence for f in health.failures()}
    assert set(failed) == {"ecc", "xid", "dcgm diag"}
    assert failed["ecc"] == "GPU 1 (00000000:55:00.0): 2 volatile uncorrectable ECC errors"
    assert failed["xid"].startswith("Xid 48 on PCI:0000:55:00: An uncorrectable double bit error")
    assert "Xid 154" in failed["xid"] and "Xid 63" not in failed["xid"]  # 63: reported by the remapper query
    assert failed["dcgm diag"].startswith("pcie Fail: There was an internal error")


def test_a_healthy_node_passes_and_says_what_it_could_not_check():
    run = _node_answering(
        {
            "nvidia-smi": ExecResult(0, _read("nvidia_smi_4xl4.txt")),
            "remap": ExecResult(0, _read("nvidia_smi_remapped_rows.txt")),
            "dmesg": ExecResult(1, "", "dmesg: read kernel buffer failed: Operation not permitted\n"),
            "fi_info": ExecResult(0, _read("fi_info_efa.txt")),
        }
    )
    health = check_node("n", "p", run, Expectation(gpus=4, efa=1))
    assert health.ok
    verdicts = {f.check: f.ok for f in health.findings}
    assert verdicts == {
        "gpus": True,
        "ecc": True,
        "driver": None,  # no image CUDA given: the driver is shown, not judged
        "row remap": True,
        "xid": None,
        "dcgm diag": None,
        "efa": True,
    }


def test_a_driver_older_than_the_images_cuda_needs_fails():
    run = _node_answering({"nvidia-smi": ExecResult(0, _read("nvidia_smi_4xl4.txt"))})  # driver 535.183.01
    health = check_node("n", "p", run, Expectation(gpus=4, efa=0, min_driver=(580, 0), image_cuda="13.0"))
    failed = {f.check: f.evidence for f in health.failures()}
    assert failed == {"driver": "535.183.01, CUDA 13.0 of the image needs 580 or later"}


def test_fewer_efa_devices_or_gpus_than_the_pod_asked_for_fail():
    run = _node_answering(
        {
            "nvidia-smi": ExecResult(0, _read("nvidia_smi.txt")),
            "fi_info": ExecResult(0, _read("fi_info_efa.txt")),
        }
    )
    failed = {f.check: f.evidence for f in check_node("n", "p", run, Expectation(gpus=4, efa=4)).failures()}
    assert failed == {"gpus": "1 of 4 GPUs seen (driver 535.230.02)", "efa": "1 of 4 EFA devices (rdmap0s6)"}


# -- the command against the fake cluster ---------------------------------------------------------------------------


def _workers(w: World) -> list[Any]:
    cfg_ = w.d.cfg
    pods = w.kube.pods(cfg_.ray.namespace, {"ray.io/cluster": cfg_.ray.cluster_name, "ray.io/node-type": "worker"})
    return sorted(pods, key=lambda p: p.node_name or "")


def _cli(w: World, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    monkeypatch.setattr(deploy_commands, "make_deployment", lambda cfg, state_dir, *say: w.d)
    app = typer.Typer()
    deploy_commands.register(app)
    return CliRunner().invoke(app, list(args))


def test_check_names_the_bad_node_exits_1_and_excludes_it(ready: World, monkeypatch: pytest.MonkeyPatch):
    assert ready.submit().exit_code == 0  # the RayCluster and its worker pods, one per GPU node
    ready.probe.ips()  # the pods' addresses, which their Ray nodes go by
    good, bad = _workers(ready)
    passed = _cli(ready, monkeypatch, "check")
    assert passed.exit_code == 0, passed.output
    # The pair of nodes, named by node, against the g6.12xlarge's 40 Gbit/s (its nodes' instance-type label).
    assert "pairs: bus bandwidth against the line rate 40 Gbit/s (g6.12xlarge network rate), at least 50%" in (
        passed.output
    )
    assert f"{good.node_name} - {bad.node_name}: 35 Gbit/s = 88% of 40 Gbit/s (at least 50%)" in passed.output
    ready.ray.node_tools.break_pod(bad.name)

    result = _cli(ready, monkeypatch, "check")
    assert result.exit_code == 1
    assert f"{bad.node_name} (pod {bad.name}): FAILED" in result.output
    assert f"{good.node_name} (pod {good.name}): healthy" in result.output
    assert "ecc: FAIL - GPU 1 (00000000:55:00.0): 2 volatile uncorrectable ECC errors" in result.output
    assert f"check: failing nodes: {bad.node_name}" in result.output
    assert not ready.kube.patched  # nothing done without --exclude-bad-nodes

    excluded = _cli(ready, monkeypatch, "check", "--exclude-bad-nodes")
    assert excluded.exit_code == 1
    assert ready.kube.get("v1", "Node", bad.node_name)["spec"].get("unschedulable") is True
    assert "unschedulable" not in ready.kube.get("v1", "Node", good.node_name)["spec"]
    # The fake's EKS nodes carry no spec.providerID: cordoned, and said so rather than a replacement claimed.
    assert f"cordoned node {bad.node_name}" in excluded.output and "cordoned, not replaced" in excluded.output
    # Its worker pod is deleted, and KubeRay's new one is not placed on the cordoned node (the other node is full).
    assert f"deleted worker pod {bad.name}" in excluded.output
    ready.kube.tick()
    (again,) = [p for p in _workers(ready) if p.name == bad.name]
    assert again.node_name is None and again.phase == "Pending"


def test_check_names_each_node_whose_driver_the_images_cuda_cannot_use(ready: World, monkeypatch: pytest.MonkeyPatch):
    assert ready.submit().exit_code == 0
    ready.d = dataclasses.replace(ready.d, cfg=load_config(environ={}, path=None))  # the default image: CUDA 13.0
    assert _cli(ready, monkeypatch, "check", "--skip-pairs").exit_code == 0  # driver 580.126.09 runs it
    ready.ray.node_tools.old_driver = True  # nodes of an older GPU AMI: driver 535.183.01
    result = _cli(ready, monkeypatch, "check", "--skip-pairs")
    assert result.exit_code == 1 and ready.probe.runs == 0
    nodes = [p.node_name for p in _workers(ready)]
    assert result.output.count("driver: FAIL - 535.183.01, CUDA 13.0 of the image needs 580 or later") == 2
    assert f"check: failing nodes: {', '.join(nodes)}" in result.output


def test_slow_pairs_name_the_node_they_share_or_none():
    a, b, c = "node-a", "node-b", "node-c"
    one_bad = judge_pairs(
        [PairFigure((a, b), 3.0), PairFigure((a, c), 2.5), PairFigure((b, c), 36.0)], expected_gbps=40, source="t"
    )
    assert not one_bad.ok and one_bad.suspects == [a]
    assert "  node-a - node-c: 2.5 Gbit/s = 6% of 40 Gbit/s (below 50%)" in one_bad.lines()
    path = judge_pairs(
        [PairFigure((a, b), 3.0), PairFigure((a, c), 36.0), PairFigure((b, c), 36.0)], expected_gbps=40, source="t"
    )
    assert not path.ok and path.suspects == []  # a and b each have a good pair: the path between them is named
    two = judge_pairs([PairFigure((a, b), None, "the collective failed")], expected_gbps=40, source="t")
    assert two.suspects == [a, b] and "  node-a - node-b: not measured (the collective failed)" in two.lines()
    unknown = judge_pairs([PairFigure((a, b), 3.0)], expected_gbps=None, source=None)
    assert unknown.ok and "pass --expected-gbps" in "\n".join(unknown.lines())
    # Two nodes, one failing a check of its own: the slow pair is put down to it, the other node is not named.
    slow = judge_pairs([PairFigure((a, b), 3.0)], expected_gbps=40, source="t")
    nodes = [
        NodeHealth(a, "p-a", (Finding("efa", True, "1 of 1"),)),
        NodeHealth(b, "p-b", (Finding("efa", False, "0"),)),
    ]
    assert checks.ClusterHealth(nodes, pairs=slow).bad_nodes == [b]
    assert checks.ClusterHealth(nodes[:1], pairs=slow).bad_nodes == [a, b]


def test_a_share_of_the_line_rate_above_one_is_refused_before_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    world = World(tmp_path, load_config(environ={}, path=None))
    result = _cli(world, monkeypatch, "check", "--min-bandwidth-fraction", "1.5")
    assert isinstance(result.exception, UserError)
    assert result.exception.message == "--min-bandwidth-fraction 1.5 is not a share of the line rate"
    assert not world.kube.exec_calls


def test_check_without_running_workers_says_how_to_start_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    result = _cli(World(tmp_path, load_config(environ={}, path=None)), monkeypatch, "check")
    assert isinstance(result.exception, UserError)  # main() prints it with its hint and exits 1
    assert "no Ray worker pod of RayCluster default/ray-train is running" in result.exception.message
    assert "raytrain-eks submit" in (result.exception.hint or "")


def test_submit_gate_refuses_a_slow_pair_and_keeps_the_checks_in_the_run_folder(ready: World):
    ready.probe.slow[frozenset(("10.0.1.11", "10.0.1.12"))] = 3.2  # the addresses PairProbeJob gives the two pods
    with pytest.raises(UserError, match="GPU node checks failed, the job was not submitted") as err:
        ready.submit(checks=True)
    nodes = [p.node_name for p in _workers(ready)]
    assert f"{nodes[0]} - {nodes[1]}: 3.2 Gbit/s = 8% of 40 Gbit/s (below 50%)" in err.value.message
    assert not ready.ray.submitted

    ready.probe.slow.clear()
    result = ready.submit(checks=True)
    assert result.exit_code == 0 and result.run_dir == RUN_DIR and len(ready.ray.submitted) == 1
    # The checks are left in the head pod for the job, which is told where by its runtime_env: its driver keeps them
    # in the run folder before it trains (keep_node_checks), so its report and bundle have them.
    (argv,) = ready.ray.submitted
    env_vars = json.loads(argv[argv.index("--runtime-env-json") + 1])["env_vars"]
    handed = ready.ray.tmp / "head" / env_vars[NODE_CHECKS_ENV].lstrip("/")
    kept = json.loads(handed.read_text())
    assert kept["ok"] is True and [n["node"] for n in kept["nodes"]] == nodes
    assert [(p["nodes"], p["busbw_gbps"]) for p in kept["pairs"]["pairs"]] == [(nodes, 35.0)]
    run_dir = ready.ray.tmp / "run"  # the job's run folder, as its driver names it
    assert keep_node_checks(run_dir, {NODE_CHECKS_ENV: str(handed)})
    assert json.loads((run_dir / NODE_CHECKS).read_text()) == kept
    assert not keep_node_checks(run_dir, {})  # a job submitted without the gate keeps none


def test_submit_gate_stops_before_the_job_and_skip_checks_runs_it(ready: World, monkeypatch: pytest.MonkeyPatch):
    ready.ray.node_tools.break_pod("ray-train-gpu-workers-worker-1")
    with pytest.raises(UserError, match="GPU node checks failed, the job was not submitted") as err:
        ready.submit(checks=True)
    assert "Xid 48" in err.value.message and not ready.ray.submitted
    assert "--exclude-bad-nodes" in (err.value.hint or "")
    ready.d = dataclasses.replace(ready.d, cfg=apply_state(ready.d.cfg, ready.store))  # the bucket up created
    refused = _cli(ready, monkeypatch, "submit")  # on EKS the checks are on by default
    assert isinstance(refused.exception, UserError) and "GPU node checks failed" in refused.exception.message
    assert not ready.ray.submitted
    result = _cli(ready, monkeypatch, "submit", "--skip-checks")
    assert result.exit_code == 0 and len(ready.ray.submitted) == 1


# -- the EKS node group replaces the instance -----------------------------------------------------------------------


def test_instance_of_reads_the_aws_provider_id():
    assert instance_of("aws:///us-west-2a/i-0123456789abcdef0") == "i-0123456789abcdef0"
    assert instance_of("gce://project/zone/name") is None


def test_replace_instance_terminates_it_in_its_group_keeping_capacity(tmp_path: Path, aws_env: str):
    world = World(tmp_path, load_config(environ={}, path=None))
    region = world.d.cfg.cluster.region
    ec2, asg = boto3.client("ec2", region), boto3.client("autoscaling", region)
    ec2.create_launch_template(LaunchTemplateName="gpu", LaunchTemplateData={"ImageId": "ami-12c6146b"})
    zone = ec2.describe_availability_zones()["AvailabilityZones"][0]["ZoneName"]
    asg.create_auto_scaling_group(
        AutoScalingGroupName="gpu-nodes",
        LaunchTemplate={"LaunchTemplateName": "gpu"},
        MinSize=2,
        MaxSize=2,
        DesiredCapacity=2,
        AvailabilityZones=[zone],
    )
    before = [i["InstanceId"] for i in asg.describe_auto_scaling_groups()["AutoScalingGroups"][0]["Instances"]]
    world.kube.add_node("bad-node", labels={}, allocatable={}, provider_id=f"aws:///{zone}/{before[0]}")

    said = replace_instance(world.d, "bad-node")

    assert said.startswith(f"asked the node group to replace instance {before[0]} of node bad-node")
    group = asg.describe_auto_scaling_groups()["AutoScalingGroups"][0]
    after = [i["InstanceId"] for i in group["Instances"]]
    assert group["DesiredCapacity"] == 2 and len(after) == 2 and before[0] not in after and before[1] in after


def test_cordon_says_when_the_node_is_gone(tmp_path: Path):
    world = World(tmp_path, load_config(environ={}, path=None))
    assert checks.cordon(world.d, "no-such-node") == "node no-such-node was not found to cordon (already gone?)"


def test_recordings_are_listed_in_sources():
    sources = (Path(RECORDED) / "SOURCES.md").read_text()
    for name in (
        "nvidia_smi_4xl4.txt",
        "nvidia_smi_ecc_uncorrected.txt",
        "nvidia_smi_remapped_rows.txt",
        "kernel_xid_dbe.txt",
        "dcgmi_diag_pass.txt",
        "dcgmi_diag_pcie_fail.txt",
    ):
        assert f"`{name}`" in sources, name
