"""Whether a job used the fabric its nodes offer: EFA devices found and used, GPUDirect RDMA, channels, per node.

Real public logs (tests/fixtures/nccl/real/, each citing its page) carry the cases that were found: two p4d hosts
over all four EFA devices with GPUDirect RDMA (aws-ofi-nccl#65), the same hosts over one device without it and with
two channels (aws-ofi-nccl#64), a p5en whose plugin found its 16 NICs (nccl#1597) and a p4d whose plugin found 4
(aws-ofi-nccl#715). No public log was found of pods that see fewer EFA interfaces than their type has, nor of a
g-type run: those two rules are pinned on lines written in the real formats. Then the in-job gate's warning and
``fabric.require_full_efa``, and ``verify-transport --instance-type`` / ``--require-full-efa``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from raytrain_eks.config import FabricConfig
from raytrain_eks.fabric import analyze, analyze_paths
from raytrain_eks.fabric.decision import gate_decision
from raytrain_eks.fabric.nccl_usage import FINDING_KINDS
from raytrain_eks.instances import UnknownInstanceTypeError, instance_type

REAL = Path(__file__).parent / "fixtures" / "nccl" / "real"
ALL_FOUR = REAL / "ofi65_p4d_four_efa_gdr_nccl2.7.8.log"
ONE_NO_GDR = REAL / "ofi64_p4d_one_efa_no_gdr_nccl2.7.8.log"


def test_p4d_over_all_four_efa_devices_with_gdr_is_full_use():
    report = analyze_paths([ALL_FOUR])
    usage = report.usage
    assert usage.instance_type == "p4d.24xlarge", "the plugin's 'Running on P4d platform' names the type"
    assert (usage.efa_offered, usage.gdr_supported, usage.full, usage.findings) == (4, True, True, [])
    assert sorted({d for n in usage.nodes for d in n.net_devices}) == [0, 1, 2, 3]
    assert all(n.gdr_links == n.net_links > 0 for n in usage.nodes)
    assert "Fabric use:     full (p4d.24xlarge: 4 EFA interface(s), GPUDirect RDMA" in report.render("efa")


def test_p4d_over_one_device_without_gdr_names_each_shortfall_with_its_lines():
    report = analyze_paths([ONE_NO_GDR], instance_type="p4d.24xlarge")
    assert (report.verdict, report.basis, report.exit_code("efa")) == ("efa", "proven", 0), "the transport is EFA"
    by_kind = {f.kind: f for f in report.usage.findings}
    assert list(by_kind) == ["net-devices", "gdr-off", "channels"] and set(by_kind) <= set(FINDING_KINDS)
    assert (
        "use 1 NET device(s) (0)" in by_kind["net-devices"].message
        and "spread over 4" in by_kind["net-devices"].message
    )
    assert all("via NET/AWS Libfabric/0" in r.text for r in by_kind["net-devices"].lines)
    assert "4 of 4 inter-node NET connection line(s) lack /GDRDMA" in by_kind["gdr-off"].message
    assert by_kind["gdr-off"].lines and all("GDRDMA" not in r.text for r in by_kind["gdr-off"].lines)
    assert "2 coll channel(s)" in by_kind["channels"].message
    assert (
        by_kind["channels"].lines[0].text.endswith("NCCL INFO 2 coll channels, 2 p2p channels, 1 p2p channels per peer")
    )
    text = report.render("efa")
    assert "Fabric use:     SHORTFALL" in text and "SHORTFALL gdr-off:" in text and "ofi64_p4d" in text
    data = json.loads(report.to_json("efa"))
    assert data["usage"]["full"] is False and [f["kind"] for f in data["usage"]["findings"]] == list(by_kind)


def test_without_an_instance_type_nothing_is_compared_and_the_report_says_how_to_give_one():
    usage = analyze_paths([ONE_NO_GDR]).usage  # the old plugin's excerpt names no platform
    assert (usage.instance_type, usage.findings, usage.full) == (None, [], None)
    assert any("--instance-type" in n for n in usage.notes)
    assert [n.net_devices for n in usage.nodes] == [[0], [0]], "what was used is still shown per node"


def test_p5en_plugin_that_found_all_sixteen_nics_is_no_shortfall_but_unproven_without_connection_lines():
    usage = analyze_paths([REAL / "nccl1597_p5en_efa_selected.log"], instance_type="p5en.48xlarge").usage
    assert usage.findings == [] and usage.full is None
    assert max(n.efa_found or 0 for n in usage.nodes) == 16 and max(n.nic_groups or 0 for n in usage.nodes) == 4
    assert any("no inter-node connection line" in n for n in usage.notes)


def test_p4d_plugin_that_found_its_four_nics_is_no_shortfall():
    usage = analyze_paths([REAL / "ofi715_sagemaker_efa_selected.log"], instance_type="p4d.24xlarge").usage
    assert usage.findings == [] and {n.efa_found for n in usage.nodes} == {4}


def proc(host: str, pid: int, *msgs: str, dev: int = 0) -> list[str]:
    return [f"{host}:{pid}:{pid} [{dev}] NCCL INFO {m}" for m in msgs]


def two_nodes(found: int, via: str) -> list[str]:
    lines: list[str] = []
    for host, pid, rank, peer in (("node-a", 1, 0, 1), ("node-b", 2, 1, 0)):
        lines += proc(host, pid, f"NET/OFI Selected provider is efa, fabric is efa (found {found} nics)")
        lines += proc(host, pid, f"comm 0x{pid} rank {rank} nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0")
        lines += proc(host, pid, f"Channel 00/0 : {rank}[0] -> {peer}[0] [send] via {via}")
    return lines


def test_pods_that_see_four_of_a_p5s_thirty_two_efa_interfaces_are_named():
    report = analyze(two_nodes(4, "NET/Libfabric/0/GDRDMA"), instance_type="p5.48xlarge")
    (finding,) = report.usage.findings
    assert finding.kind == "efa-found" and "found 4 of the 32 EFA interfaces a p5.48xlarge has" in finding.message
    assert "vpc.amazonaws.com/efa: 32" in finding.message and "node-a" in finding.message
    assert finding.lines and all("(found 4 nics)" in r.text for r in finding.lines)
    assert not analyze(two_nodes(32, "NET/Libfabric/0/GDRDMA"), instance_type="p5.48xlarge").usage.findings


def test_a_g_type_with_its_one_efa_interface_and_no_gdr_is_full_use():
    usage = analyze(two_nodes(1, "NET/Libfabric/0"), instance_type="g6.12xlarge").usage
    assert (usage.efa_offered, usage.gdr_supported, usage.expected_net_devices) == (1, False, 1)
    assert usage.findings == [] and usage.full is True
    assert any("does not offer GPUDirect RDMA" in n for n in usage.notes)


def test_usage_is_compared_only_when_efa_carries_the_links():
    usage = analyze(two_nodes(1, "NET/Socket/0"), instance_type="p4d.24xlarge").usage
    assert usage.findings == [] and usage.notes == [
        "EFA does not carry the inter-node links, so how fully it is used was not compared"
    ]


def test_gpudirect_rdma_facts_follow_the_plugins_platform_table():
    assert [instance_type(t).gpudirect_rdma for t in ("p4d.24xlarge", "p5.48xlarge", "p5en.48xlarge")] == [True] * 3
    assert [instance_type(t).gpudirect_rdma for t in ("g6.12xlarge", "g5.48xlarge", "p5.4xlarge")] == [False] * 3
    assert [instance_type(t).efa_interfaces for t in ("p5.48xlarge", "p5en.48xlarge", "p4d.24xlarge")] == [32, 16, 4]


# -- the in-job gate and the command -------------------------------------------------------------------------------


def test_the_gate_warns_of_a_shortfall_and_stops_on_it_only_when_full_use_is_required():
    report = analyze_paths([ONE_NO_GDR], instance_type="p4d.24xlarge")
    warned = gate_decision(report, "efa", job_nodes=2, last_look=False)
    assert (warned["met"], warned["action"]) == (True, "continue")
    assert (
        "warning: EFA is used short of what the instance type offers (net-devices, gdr-off, channels)" in warned["note"]
    )
    assert warned["usage_full"] is False and len(warned["usage_findings"]) == 3
    assert "SHORTFALL gdr-off" in warned["report"]
    stopped = gate_decision(report, "efa", job_nodes=2, last_look=False, require_full_efa=True)
    assert (stopped["met"], stopped["action"]) == (False, "stop") and "fabric.require_full_efa" in stopped["note"]
    full = gate_decision(analyze_paths([ALL_FOUR]), "efa", job_nodes=2, last_look=False, require_full_efa=True)
    assert (full["met"], full["usage_full"], full["usage_findings"]) == (True, True, [])


def test_full_use_is_off_by_default_in_the_configuration():
    assert FabricConfig().require_full_efa is False and FabricConfig(require_full_efa=True).require_full_efa is True


@pytest.fixture
def cli(fabric_cli: typer.Typer) -> typer.Typer:
    return fabric_cli


def test_command_reports_the_shortfall_and_fails_only_when_asked(cli):
    args = ["verify-transport", str(ONE_NO_GDR), "--instance-type", "p4d.24xlarge"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0 and "SHORTFALL net-devices" in result.output
    result = CliRunner().invoke(cli, [*args, "--require-full-efa", "--json"])
    assert result.exit_code == 1 and json.loads(result.output)["usage"]["full"] is False
    assert CliRunner().invoke(cli, ["verify-transport", str(ALL_FOUR), "--require-full-efa"]).exit_code == 0


def test_command_refuses_an_unknown_instance_type_before_reading(cli):
    result = CliRunner().invoke(cli, ["verify-transport", str(ALL_FOUR), "--instance-type", "p9.huge"])
    assert isinstance(result.exception, UnknownInstanceTypeError) and "'p9.huge'" in str(result.exception)


def test_the_reports_fabric_section_names_the_shortfall(tmp_path):
    from run_folders import write_run

    from raytrain_eks.report.html import _fabric, load_run  # the section alone: the whole page also draws 7 plots

    decision = gate_decision(
        analyze_paths([ONE_NO_GDR], instance_type="p4d.24xlarge"), "efa", job_nodes=2, last_look=True
    )
    run = write_run(tmp_path / "run", fabric=decision)
    page = _fabric([load_run(run)])
    assert "<b>usage_full</b>: False" in page and "gdr-off: 4 of 4 inter-node NET connection line(s) lack" in page
    assert "SHORTFALL net-devices" in page
