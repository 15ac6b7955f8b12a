"""Transport verdicts on real NCCL output, and the rules for logs that hold only what NCCL selected.

tests/fixtures/nccl/real/ holds excerpts of NCCL output published in public issue threads (each file names its
page in its header); expected.tsv gives the verdict and basis each one must get. Most of them have no connection
lines: the log was cut, or only set-up lines were pasted. The synthetic tests below pin each rule for such logs:
the selected network decides (``basis`` ``selected``), connection lines always win (``proven``), one node needs
proof, and ``inconclusive`` is left for logs that say nothing about the network.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from raytrain_eks.fabric import BASES, analyze, analyze_paths

REAL = Path(__file__).parent / "fixtures" / "nccl" / "real"


def _rows() -> list[dict[str, str]]:
    with (REAL / "expected.tsv").open(newline="") as f:
        header = f.readline().lstrip("# ").rstrip("\n").split("\t")
        return list(csv.DictReader(f, fieldnames=header, delimiter="\t"))


ROWS = _rows()


def test_every_real_fixture_has_one_row_and_names_its_source():
    names = [r["file"] for r in ROWS]
    assert len(names) == len(set(names)) >= 20
    assert sorted(names) == sorted(p.name for p in REAL.glob("*.log"))
    for row in ROWS:
        head = (REAL / row["file"]).read_text().splitlines()[:3]
        assert head[0] == f"# source: {row['source']}" and row["source"].startswith("https://")


@pytest.mark.parametrize("row", ROWS, ids=[r["file"] for r in ROWS])
def test_real_log_verdict_and_basis(row):
    report = analyze_paths([REAL / row["file"]])
    assert (report.verdict, report.basis) == (row["verdict"], row["basis"]), report.render()
    assert report.nccl_version == (None if row["logged_version"] == "-" else row["logged_version"])
    assert report.basis in BASES and report.reason
    if report.verdict != "inconclusive":
        assert report.evidence, "a verdict comes with the lines that decided it"
    if report.verdict == "socket":
        assert (report.exit_code("efa"), report.exit_code("ib")) == (1, 1)
    if report.basis == "selected" and report.verdict in ("efa", "ib"):
        assert report.exit_code(report.verdict) == 0 and "no connection line confirmed it" in report.reason


def _grep_check(text: str) -> str | None:
    """The kind of check a shell script does: grep two lines. None when it finds neither."""
    if "Using network Socket" in text or "NET/OFI Only EFA provider is supported" in text:
        return "not efa"
    if "Selected Provider is efa" in text.replace("provider", "Provider"):
        return "efa"
    return None


@pytest.mark.parametrize("row", ROWS, ids=[r["file"] for r in ROWS])
def test_never_less_decisive_than_a_grep_and_never_claims_efa_over_sockets(row):
    text = (REAL / row["file"]).read_text()
    report = analyze_paths([REAL / row["file"]])
    grep = _grep_check(text)
    if grep is not None:
        assert report.verdict != "inconclusive"
        if report.verdict != "single-node":
            assert (report.verdict == "efa") == (grep == "efa"), report.render()
    if "Using network Socket" in text or "via NET/Socket" in text:
        assert not report.meets("efa")


# -- the rules, on small synthetic logs --------------------------------------------------------------------------


def proc(host: str, pid: int, *msgs: str, dev: int = 0) -> list[str]:
    return [f"{host}:{pid}:{pid} [{dev}] NCCL INFO {m}" for m in msgs]


def test_socket_selected_by_one_host_fails_efa_and_ib():
    report = analyze(proc("node-a", 10, "NET/IB : No device found.", "Using network Socket"))
    assert (report.verdict, report.basis) == ("socket", "selected")
    assert report.exit_code("efa") == report.exit_code("ib") == 1 and report.exit_code("any") == 0


@pytest.mark.parametrize(
    "lines",
    [
        ["node-a:1:1 [0] ofi_init:700 NCCL WARN NET/OFI Only EFA provider is supported", *proc("node-a", 1, "x")],
        proc("node-a", 1, "NET/OFI No eligible providers were found"),
        proc("node-a", 1, "Failed to initialize NET plugin Libfabric"),
        proc("node-a", 1, "Failed to initialize NET plugin IB", "NET/Socket : Using [0]eth0:10.0.0.1<0>"),
        proc("node-a", 1, "Failed to open libibverbs.so[.1]"),
    ],
    ids=["only-efa-provider", "no-eligible-providers", "ofi-init-failed", "ib-init-failed", "no-libibverbs"],
)
def test_plugin_failure_or_missing_ib_means_sockets(lines):
    report = analyze(lines)
    assert (report.verdict, report.basis) == ("socket", "selected"), report.render()


def test_efa_provider_selected_is_efa_with_the_basis_said():
    report = analyze(
        proc("node-a", 1, "NET/OFI Selected provider is efa, fabric is efa (found 4 nics)", "Using network Libfabric")
        + proc("node-b", 2, "NET/OFI Selected provider is efa, fabric is efa (found 4 nics)")
    )
    assert (report.verdict, report.basis, report.exit_code("efa")) == ("efa", "selected", 0)
    assert "basis: selected" in report.render("efa")


def test_a_provider_that_failed_afterwards_is_not_efa():
    report = analyze(
        proc("node-a", 1, "NET/OFI Selected provider is efa, fabric is efa (found 4 nics)")
        + ["node-a:1:1 [0] nccl_net_ofi_init:155 NCCL WARN NET/OFI Initializing plugin failed"]
        + proc("node-a", 1, "NET/IB : No device found.")
    )
    assert (report.verdict, report.basis) == ("socket", "selected")


def test_ib_devices_after_a_failed_plugin_are_ib():
    lines = proc("node-a", 1, "NET/OFI Selected Provider is verbs;ofi_rxm (found 58 nics)")
    lines += ["node-a:1:1 [0] nccl_net_ofi_init:155 NCCL WARN NET/OFI Initializing plugin failed"]
    lines += proc("node-a", 1, "NET/IB : Using [0]mlx5_0:1/RoCE [RO]; OOB eth0:10.0.0.1<0>")
    assert (analyze(lines).verdict, analyze(lines).basis) == ("ib", "selected")


def test_the_weakest_choice_decides_and_is_named():
    lines = proc("node-a", 11, "NET/OFI Selected provider is efa, fabric is efa (found 4 nics)")
    lines += proc("node-a", 11, "Using network Libfabric") + proc("node-b", 22, "Using network Socket")
    report = analyze(lines)
    assert (report.verdict, report.basis) == ("socket", "selected")
    assert "node-b pid 22" in report.reason and "node-a pid 11" in report.reason


def test_socket_on_a_communicator_nccl_calls_one_node_is_single_node():
    lines = proc("box", 1, "Using network Socket", "comm 0x1 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0")
    report = analyze(lines)
    assert (report.verdict, report.basis) == ("single-node", "proven") and "nNodes 1" in report.reason


def test_links_inside_each_of_two_hosts_do_not_prove_one_node():
    lines = proc("node-a", 1, "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read")
    lines += proc("node-b", 2, "Channel 00/0 : 2[0] -> 3[1] via P2P/CUMEM/read")
    assert analyze(lines).verdict == "inconclusive"
    assert analyze(lines[:1]).verdict == "single-node", "one host with only intra-node links is one node"
    with_socket = [*lines, *proc("node-a", 1, "Using network Socket")]
    assert (analyze(with_socket).verdict, analyze(with_socket).basis) == ("socket", "selected")


def test_connection_lines_win_over_what_another_process_selected():
    lines = []
    for host, pid, rank, peer in (("node-a", 1, 0, 1), ("node-b", 2, 1, 0)):
        lines += proc(host, pid, f"comm 0x{pid} rank {rank} nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0")
        lines += proc(host, pid, f"Channel 00/0 : {rank}[0] -> {peer}[0] [send] via NET/Libfabric/0")
        lines += proc(host, pid, "NET/OFI Selected provider is efa, fabric is efa (found 1 nics)")
    lines += proc("node-c", 3, "Using network Socket")  # a process whose links were not logged
    report = analyze(lines)
    assert (report.verdict, report.basis) == ("efa", "proven")


def test_inconclusive_says_which_lines_are_missing_and_how_to_get_them():
    report = analyze(proc("node-a", 1, "Bootstrap : Using eth0:10.0.0.1<0>", "cudaDriverVersion 12040"))
    assert (report.verdict, report.basis) == ("inconclusive", "none")
    assert "Using network" in report.reason and "via NET/" in report.reason
    assert "NCCL_DEBUG_SUBSYS=INIT,NET" in report.render("efa")


def test_what_other_processes_of_the_job_selected_decides_for_the_one_that_logged_the_nodes():
    # Real Ray Train output: rank 0 logged 'nNodes 2' but no network of its own; the workers' fallback to sockets
    # came as one worker's lines that Ray's driver printed for all of them ('repeated 15x across cluster').
    report = analyze_paths([REAL / "ofi386_ray_train_socket_folded.log"])
    assert (report.verdict, report.basis) == ("socket", "selected"), report.render()
    assert "pid 954" in report.reason and "15 more worker(s)" in report.reason
    assert "job's other processes" in report.reason


def test_efa_selected_by_another_process_of_a_two_node_job_is_efa_selected():
    lines = proc("node-a", 1, "comm 0x1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0")
    lines += [
        f"(RayTrainWorker pid=2, ip=10.0.0.2) node-b:2:2 [0] NCCL INFO {m} [repeated 1x across cluster]"
        for m in ("NET/OFI Selected provider is efa, fabric is efa (found 4 nics)", "Using network Libfabric")
    ]
    report = analyze(lines)
    assert (report.verdict, report.basis) == ("efa", "selected"), report.render()
    assert analyze(lines[:1]).verdict == "inconclusive", "with no process's selection there is nothing to go on"


def test_the_processes_that_logged_the_nodes_decide_when_they_selected():
    lines = proc(
        "node-a", 1, "Using network Libfabric", "NET/OFI Selected provider is efa, fabric is efa (found 4 nics)"
    )
    lines += proc("node-a", 1, "comm 0x1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0")
    lines += proc("node-c", 3, "Using network Socket")  # a process not in that communicator
    assert (analyze(lines).verdict, analyze(lines).basis) == ("efa", "selected")
