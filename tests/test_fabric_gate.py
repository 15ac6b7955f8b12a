"""The in-job transport gate: what it does with each verdict and basis, and on one node versus several.

``gate_decision`` is tested on reports of real analyses (fixture logs, real Ray logs among them, and small synthetic
logs); ``check_transport`` runs as the job runs it, as a collective on a one-process gloo group reading the file
that NCCL, given the job's own ``nccl_env``, writes (NCCL's file handling reproduced by :func:`nccl_debug_init`).
"""

from __future__ import annotations

import fnmatch
import io
import os
import socket
import tempfile
from pathlib import Path
from typing import TextIO

import pytest
import torch.distributed as dist

from raytrain_eks.deploy.submit import POD_NCCL_LOGS
from raytrain_eks.fabric import analyze, analyze_paths
from raytrain_eks.fabric.decision import gate_decision
from raytrain_eks.train.fabric_gate import check_transport, nccl_env, nccl_log_path, own_nccl_lines

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"
REAL = FIXTURES / "real"
DOTTED_HOST = "ip-10-0-1-5.ec2.internal"  # an EC2 host name: NCCL's %h is its part before the first '.'


def nccl_debug_init(stdout: TextIO) -> TextIO:
    """Where NCCL writes its debug lines once ``ncclDebugInit`` has read ``NCCL_DEBUG_FILE`` from the environment.

    As NVIDIA/nccl src/debug.cc does it at v2.30.7-1 (commit 73cf112295c33aee2b895f329f592f2a9b4b0f97; the same in
    v2.18.5-1 to v2.27.3-1 but for the '-' replacement):
    - line 194 ``getHostNameForLog(hostname, 1024, '.')``: ``gethostname()`` cut at its first ``.``
      (src/misc/utils.cc lines 73-82), with ``%`` and ``/`` made ``-`` (debug.cc lines 113-129);
    - lines 206-235: ``%h`` becomes that host name, ``%p`` the pid, ``%%`` one ``%``; any other ``%x`` is echoed;
    - line 237 ``fopen(debugFn, "w")``: no folder is created; when it fails, ``ncclDebugFile`` stays ``stdout``
      (line 37) and nothing says so.
    """
    pattern = os.environ["NCCL_DEBUG_FILE"]
    host = socket.gethostname().split(".")[0].replace("%", "-").replace("/", "-")
    path, chars = "", iter(pattern)
    for ch in chars:
        if ch != "%":
            path += ch
            continue
        nxt = next(chars, "")
        path += {"%": "%", "h": host, "p": str(os.getpid())}.get(nxt, "%" + nxt)
    try:
        return open(path, "w")  # noqa: SIM115 - NCCL keeps its debug file open for the life of the process
    except OSError:
        return stdout


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A worker as the job sets it up: its /tmp (this test's own folder standing in for it),
    a host name with dots, and the environment ``nccl_env`` gives it. Nothing else is created."""
    monkeypatch.setattr(socket, "gethostname", lambda: DOTTED_HOST)
    for name, value in nccl_env("run-20260101-120000-4242", folder=str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    return tmp_path


def nccl_logs(lines: list[str]) -> str:
    """Start "NCCL" in this process as the worker's NCCL would and log ``lines``; returns what went to stdout."""
    stdout = io.StringIO()
    log = nccl_debug_init(stdout)
    for line in lines:
        log.write(line + "\n")
    if log is not stdout:
        log.close()
    return stdout.getvalue()


def test_nccl_writes_its_lines_where_the_gate_reads_them(worker: Path):
    lines = (FIXTURES / "single_node_nccl2.27.log").read_text().splitlines()
    assert nccl_logs(lines) == "", "NCCL could not open the file NCCL_DEBUG_FILE names and logged to stdout"
    assert own_nccl_lines() == [line for line in lines if "NCCL" in line]
    (written,) = worker.iterdir()
    assert written.name == f"raytrain-eks-nccl.run-20260101-120000-4242.ip-10-0-1-5.{os.getpid()}.log"


def test_characters_nccl_would_expand_never_reach_its_pattern(tmp_path: Path):
    pattern = nccl_env("100%/done %h", folder=str(tmp_path))["NCCL_DEBUG_FILE"]
    assert Path(pattern).parent == tmp_path
    assert Path(pattern).name == "raytrain-eks-nccl.100--done--h.%h.%p.log"


def test_the_workers_nccl_file_is_in_tmp_whatever_temporary_directory_the_driver_has(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """The driver sets the workers' NCCL_DEBUG_FILE: a TMPDIR of its own (a laptop's, a CI runner's) must not reach
    the workers, which lack that folder (NCCL would log to stdout unseen), nor hide the files from `submit`'s read."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    assert tempfile.gettempdir() == str(tmp_path)
    pattern = nccl_env("run-1")["NCCL_DEBUG_FILE"]
    assert pattern == "/tmp/raytrain-eks-nccl.run-1.%h.%p.log"
    assert fnmatch.fnmatch(nccl_log_path(pattern, DOTTED_HOST, 7).as_posix(), POD_NCCL_LOGS)


def two_hosts(*, channels: bool, net: str = "Libfabric", provider: str = "efa") -> list[str]:
    lines = []
    for host, pid, rank, peer in (("node-a", 1, 0, 1), ("node-b", 2, 1, 0)):
        p = f"{host}:{pid}:{pid} [0] NCCL INFO "
        lines += [p + f"NET/OFI Selected provider is {provider}, fabric is {provider} (found 1 nics)"]
        lines += [p + f"Using network {net}"]
        lines += [p + f"comm 0x{pid} rank {rank} nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0"]
        if channels:
            lines += [p + f"Channel 00/0 : {rank}[0] -> {peer}[0] [send] via NET/{net}/0"]
    return lines


def test_single_node_meets_any_requirement_when_the_job_has_one_node():
    report = analyze_paths([FIXTURES / "single_node_nccl2.27.log"])
    assert report.verdict == "single-node" and not report.meets("efa")
    d = gate_decision(report, "efa", job_nodes=1, last_look=False)
    assert (d["met"], d["action"]) == (True, "continue")
    assert "no inter-node link existed" in d["note"] and "no inter-node link existed" in d["report"]


def test_single_node_logs_of_a_multi_node_job_do_not_pass():
    report = analyze_paths([FIXTURES / "single_node_nccl2.27.log"])
    d = gate_decision(report, "efa", job_nodes=2, last_look=False)
    assert (d["met"], d["action"]) == (False, "stop") and "spans 2 nodes" in d["note"]


def test_proven_evidence_lets_a_multi_node_run_continue():
    d = gate_decision(analyze(two_hosts(channels=True)), "efa", job_nodes=2, last_look=False)
    assert (d["verdict"], d["basis"], d["met"], d["action"]) == ("efa", "proven", True, "continue")


def test_selected_only_evidence_looks_again_then_stops():
    report = analyze(two_hosts(channels=False))
    assert (report.verdict, report.basis) == ("efa", "selected")
    first = gate_decision(report, "efa", job_nodes=2, last_look=False)
    assert (first["met"], first["action"]) == (None, "look-again")
    last = gate_decision(report, "efa", job_nodes=2, last_look=True)
    assert (last["met"], last["action"]) == (False, "stop") and "still do not prove" in last["note"]
    assert "basis: selected" in last["report"]


@pytest.mark.parametrize(
    ("lines", "verdict"),
    [(two_hosts(channels=False, net="Socket", provider="tcp"), "socket"), (["node-a:1:1 [0] hello"], "inconclusive")],
)
def test_not_met_or_undecided_stops_at_the_first_look(lines, verdict):
    d = gate_decision(analyze(lines), "efa", job_nodes=2, last_look=False)
    assert (d["verdict"], d["met"], d["action"]) == (verdict, False, "stop")


@pytest.fixture
def one_process_group(worker: Path, tmp_path_factory: pytest.TempPathFactory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield worker
    dist.destroy_process_group()


def test_check_transport_on_a_one_node_job_passes_single_node_lines(one_process_group):
    assert nccl_logs((FIXTURES / "single_node_nccl2.27.log").read_text().splitlines()) == ""
    result, lines = check_transport("efa", rank=0, world_size=1, node="node-a")
    assert (result["verdict"], result["met"], result["action"], result["job_nodes"]) == (
        "single-node",
        True,
        "continue",
        1,
    )
    assert lines and lines[0], "rank 0 gets every rank's lines"


# -- real Ray logs: one worker's lines stand for the others ------------------------------------------------------


def test_gate_stops_a_ray_train_job_whose_workers_fell_back_to_sockets():
    # Rank 0 logged the two-node communicator; the workers' 'Using network Socket' came folded by Ray into one's.
    report = analyze_paths([REAL / "ofi386_ray_train_socket_folded.log"])
    d = gate_decision(report, "efa", job_nodes=2, last_look=False)
    assert (d["verdict"], d["basis"], d["met"], d["action"]) == ("socket", "selected", False, "stop")
    assert "'socket' (selected), not 'efa'" in d["note"]


def test_gate_on_ib_selected_for_a_two_node_communicator_looks_again_then_stops():
    report = analyze_paths([REAL / "llmk8s_ray_ib_selected_folded.log"])
    first = gate_decision(report, "ib", job_nodes=2, last_look=False)
    assert (first["verdict"], first["basis"], first["met"], first["action"]) == ("ib", "selected", None, "look-again")
    last = gate_decision(report, "ib", job_nodes=2, last_look=True)
    assert (last["met"], last["action"]) == (False, "stop") and "still do not prove" in last["note"]
    assert gate_decision(report, "efa", job_nodes=2, last_look=False)["action"] == "stop"
    assert gate_decision(report, "any", job_nodes=2, last_look=True)["met"] is True


def test_check_transport_warns_of_efa_used_short_and_stops_on_it_when_full_use_is_required(one_process_group):
    # A real p4d log (aws-ofi-nccl#64): every inter-node link on one EFA device, without GPUDirect RDMA.
    assert nccl_logs((REAL / "ofi64_p4d_one_efa_no_gdr_nccl2.7.8.log").read_text().splitlines()) == ""
    warned, _ = check_transport("efa", rank=0, world_size=1, node="node-a", instance_type="p4d.24xlarge")
    assert (warned["met"], warned["action"]) == (True, "continue") and "warning: EFA is used short" in warned["note"]
    stopped, _ = check_transport(
        "efa", rank=0, world_size=1, node="node-a", instance_type="p4d.24xlarge", require_full_efa=True
    )
    assert (stopped["met"], stopped["action"], stopped["usage_full"]) == (False, "stop", False)
    assert "SHORTFALL gdr-off" in stopped["report"]
