"""The in-job transport gate: what it does with each verdict and basis, and on one node versus several.

``gate_decision`` is tested on reports of real analyses (fixture logs and small synthetic logs); ``check_transport``
runs as the job runs it, as a collective on a one-process gloo group reading the file ``NCCL_DEBUG_FILE`` names.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from raytrain_eks.fabric import analyze, analyze_paths
from raytrain_eks.train.fabric_gate import check_transport, gate_decision

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"


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
def one_process_group(tmp_path, monkeypatch):
    log = tmp_path / "nccl" / "%h.%p.log"
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(log))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield Path(str(log).replace("%h", socket.gethostname()).replace("%p", str(os.getpid())))
    dist.destroy_process_group()


def test_check_transport_on_a_one_node_job_passes_single_node_lines(one_process_group):
    own_log = one_process_group
    own_log.parent.mkdir(parents=True)
    own_log.write_text((FIXTURES / "single_node_nccl2.27.log").read_text())
    result, lines = check_transport("efa", rank=0, world_size=1, node="node-a")
    assert (result["verdict"], result["met"], result["action"], result["job_nodes"]) == (
        "single-node",
        True,
        "continue",
        1,
    )
    assert lines and lines[0], "rank 0 gets every rank's lines"
