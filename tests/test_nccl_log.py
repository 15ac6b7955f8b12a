"""NCCL log analysis and ``verify-transport``: every verdict, old and new NCCL formats, prefixes, interleaving,
truncated and garbage input, streaming over files, folders, .gz and stdin, and the command's exit codes.

Fixtures in tests/fixtures/nccl/ are synthetic logs written from shared/reference/nccl-log-formats.md (see the
README there). Memory and throughput on multi-GB logs are measured by benchmarks/bench_nccl_log.py, not here.
"""

from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from raytrain_eks.errors import UserError
from raytrain_eks.fabric import nccl_lines
from raytrain_eks.fabric.commands import Require
from raytrain_eks.fabric.nccl_lines import LogInputError, iter_log_lines
from raytrain_eks.fabric.nccl_log import analyze, analyze_paths
from raytrain_eks.fabric.nccl_report import REQUIREMENTS, VERDICTS, TransportReport
from raytrain_eks.fabric.nccl_verdict import NcclLogAnalyzer

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"


def fixture(name: str) -> TransportReport:
    return analyze_paths([FIXTURES / name])


def two_node_log(
    *, net: str = "Libfabric", provider: str | None = "efa", nnodes_line: bool = True, channels: bool = True
) -> list[str]:
    """A small NCCL 2.2x log: 4 ranks, 2 per host, one ring whose 1->2 and 3->0 hops cross hosts."""
    hosts = {0: ("node-a", "10.0.0.1"), 1: ("node-b", "10.0.0.2")}
    out = []
    for r in range(4):
        host, ip = hosts[r // 2]
        p = f"{host}:{100 + r}:{200 + r} [{r % 2}] NCCL INFO "
        out += [p + "NCCL version 2.29.7+cuda13.0", p + f"Bootstrap: Using eth0:{ip}<0>"]
        if provider:
            out.append(p + f"NET/OFI Selected provider is {provider}, fabric is {provider} (found 1 nics)")
        out.append(p + f"Using network {net}")
        out.append(p + f"ncclCommInitRank comm 0x{r}f rank {r} nranks 4 cudaDev {r % 2} commId 0xabc - Init START")
        if nnodes_line:
            out.append(p + f"comm 0x{r}f rank {r} nRanks 4 nNodes 2 localRanks 2 localRank {r % 2} MNNVL 0")
        if channels:
            nxt, prv = (r + 1) % 4, (r - 1) % 4
            if r % 2 == 0:
                out.append(p + f"Channel 00/0 : {prv}[1] -> {r}[0] [receive] via NET/{net}/0")
                out.append(p + f"Channel 00/0 : {r}[0] -> {nxt}[1] via P2P/CUMEM/read")
            else:
                out.append(p + f"Channel 00/0 : {r}[1] -> {nxt}[0] [send] via NET/{net}/0")
        out.append(p + f"ncclCommInitRank comm 0x{r}f rank {r} nranks 4 cudaDev {r % 2} commId 0xabc - Init COMPLETE")
    return out


# -- every verdict, from the fixtures ------------------------------------------------------------------------------

FIXTURE_CASES = [
    # file, verdict, NCCL version, hosts, inter-node transports
    ("efa_2node_nccl2.29_ray.log", "efa", "2.29.7", 2, {"NET/Libfabric": 8}),
    ("efa_2node_nccl2.10_old.log", "efa", "2.10.3", 2, {"NET/AWS Libfabric": 8}),
    ("ib_2node_nccl2.21_mpirun.log", "ib", "2.21.5", 2, {"NET/IB": 12}),
    ("socket_fallback_nccl2.27_kubectl.log", "socket", "2.27.3", 2, {"NET/Socket": 8}),
    ("socket_nccl2.7_twin_hostnames.log", "socket", "2.7.8", 2, {"NET/Socket": 8}),
    ("mixed_fallback_cloudwatch.log", "socket", "2.18.3", 2, {"NET/AWS Libfabric": 2, "NET/Socket": 2}),
    ("single_node_nccl2.27.log", "single-node", "2.27.3", 1, {}),
    ("truncated_mid_connections.log", "efa", "2.10.3", 1, {"NET/AWS Libfabric": 3}),
    # Cut before any connection line, but every process that got that far selected Socket after the plugin failed.
    ("truncated_before_connections.log", "socket", "2.27.3", 2, {}),
    ("garbage.log", "inconclusive", None, 0, {}),
    ("ray_session_logs", "efa", "2.29.7", 2, {"NET/Libfabric": 8}),
]


@pytest.mark.parametrize(
    ("name", "verdict", "version", "hosts", "inter"), FIXTURE_CASES, ids=[c[0] for c in FIXTURE_CASES]
)
def test_fixture_verdicts(name, verdict, version, hosts, inter):
    report = fixture(name)
    assert report.verdict == verdict, report.render()
    assert report.nccl_version == version
    assert len(report.hosts) == hosts
    assert report.inter_node == inter
    assert report.reason
    if verdict != "inconclusive" or name.startswith("truncated"):
        assert report.evidence, "a verdict comes with the lines that decided it"


def test_efa_new_format_reads_plugin_ranks_and_deciding_lines():
    report = fixture("efa_2node_nccl2.29_ray.log")
    p = report.plugin
    assert (p.ofi_version, p.providers, p.fabrics, p.nics) == ("1.16.2", ["efa"], ["efa"], 1)
    assert p.external == ["Libfabric"] and p.networks == {"Libfabric": 8} and p.gdr_disabled
    assert report.world_size == 8 and report.intra_node == {"P2P/CUMEM": 8, "SHM": 4}
    assert [(r.rank, r.nranks, r.cuda_dev) for r in report.ranks] == [(i, 8, i % 4) for i in range(8)]
    assert {r.host for r in report.ranks[:4]} == {"raytrain-gpu-worker-7xk2p"}
    assert [r.pid for r in report.ranks] == ["412", "413", "414", "415", "398", "399", "400", "401"]
    assert report.ranks[3].inter_node == {"NET/Libfabric": 2} and report.ranks[1].inter_node == {}
    assert all(r.nccl_version == "2.29.7" and r.provider == "efa" for r in report.ranks)
    texts = [e.text for e in report.evidence]
    assert any("[send] via NET/Libfabric/0" in t for t in texts)
    assert any("Selected provider is efa" in t for t in texts)
    assert all("\x1b" not in t for t in texts), "colour codes are stripped"
    assert all(e.source.endswith("efa_2node_nccl2.29_ray.log") and e.line > 0 for e in report.evidence)


def test_efa_old_format_counts_gdrdma_and_bare_version():
    report = fixture("efa_2node_nccl2.10_old.log")
    assert report.inter_node_gdrdma == 8
    assert report.intra_node == {"P2P/IPC": 12}
    assert report.plugin.ofi_version == "1.6.0" and report.plugin.nics == 4
    assert all(r.nccl_version == "2.10.3" for r in report.ranks), "the one bare version line covers every process"


def test_ib_reads_devices_pxn_runtime_p2p_and_trace_lines():
    report = fixture("ib_2node_nccl2.21_mpirun.log")
    assert report.ib_devices == ["mlx5_0:1/IB", "mlx5_1:1/IB"]
    assert report.inter_node_gdrdma == 12
    assert report.plugin.internal and report.plugin.failures  # dlerror of the missing libnccl-net.so
    assert report.meets("ib") and not report.meets("efa")


def test_socket_fallback_names_the_plugin_failure():
    report = fixture("socket_fallback_nccl2.27_kubectl.log")
    assert any("initialization failed" in f for f in report.plugin.failures)
    assert report.ib_devices == [], "'NET/IB : Using [RO]; OOB ...' lists no device"
    assert report.socket_interfaces == ["eth0:10.0.4.93", "eth0:10.0.4.51"]
    assert report.warnings["NET/OFI aws-ofi-nccl initialization failed"] == 8
    texts = " ".join(e.text for e in report.evidence)
    assert "via NET/Socket/0" in texts and "NCCL WARN" in texts and "Using network Socket" in texts


def test_twin_hostnames_are_told_apart_by_address():
    report = fixture("socket_nccl2.7_twin_hostnames.log")
    assert report.hosts == ["ubuntu (192.168.7.10)", "ubuntu (192.168.7.11)"]


def test_single_node_ignores_using_network_without_net_connections():
    report = fixture("single_node_nccl2.27.log")
    assert report.plugin.networks == {"Libfabric": 4}
    assert report.intra_node == {"SHM": 4, "P2P/CUMEM": 4}


def test_ray_folder_reads_gz_skips_binary_and_counts_duplicates_once():
    report = fixture("ray_session_logs")
    single = fixture("efa_2node_nccl2.29_ray.log")
    assert report.inter_node == single.inter_node and report.intra_node == single.intra_node
    assert "Socket" not in report.plugin.networks, "dashboard_agent.log holds NUL bytes: skipped"
    assert any(e.source.endswith(".gz") for e in report.evidence) or report.ranks[7].inter_node
    gz = [ln for ln in iter_log_lines([FIXTURES / "ray_session_logs"]) if ln.source.endswith(".out.gz")]
    assert len(gz) == 25 and all("NCCL" in ln.text for ln in gz), "the .gz worker log is decompressed and read"
    assert report.stats["files"] == 13


# -- verdict logic and requirements ----------------------------------------------------------------------------------


EXIT_CODES = [
    ("efa", {"efa": 0, "ib": 1, "any": 0}),
    ("ib", {"efa": 1, "ib": 0, "any": 0}),
    ("socket", {"efa": 1, "ib": 1, "any": 0}),
    ("single-node", {"efa": 1, "ib": 1, "any": 0}),
    ("inconclusive", {"efa": 2, "ib": 2, "any": 2}),
]


@pytest.mark.parametrize(("verdict", "codes"), EXIT_CODES)
def test_exit_codes_per_verdict_and_requirement(verdict, codes):
    report = TransportReport(verdict=verdict, reason="r")
    assert {req: report.exit_code(req) for req in REQUIREMENTS} == codes
    assert set(VERDICTS) >= {verdict}


def test_exit_codes_cover_every_verdict_and_the_command_offers_every_requirement():
    assert [verdict for verdict, _ in EXIT_CODES] == list(VERDICTS)
    assert [r.value for r in Require] == list(REQUIREMENTS), "--require's choices are REQUIREMENTS"


def test_unknown_requirement_is_a_user_error():
    with pytest.raises(UserError, match="--require"):
        TransportReport(verdict="efa", reason="r").meets("tcp")


@pytest.mark.parametrize(
    ("provider", "verdict"),
    [("efa", "efa"), ("tcp;ofi_rxm", "socket"), ("sockets", "socket"), ("verbs;ofi_rxm", "ib"), (None, "efa")],
)
def test_libfabric_verdict_follows_the_provider(provider, verdict):
    report = analyze(two_node_log(provider=provider))
    assert report.verdict == verdict
    assert report.hosts == ["node-a", "node-b"] and report.inter_node == {"NET/Libfabric": 4}
    if provider is None:
        assert any("efa was assumed" in n for n in report.notes)


@pytest.mark.parametrize(("net", "verdict"), [("IB", "ib"), ("IBext_v8", "ib"), ("Socket", "socket")])
def test_internal_and_vendor_networks(net, verdict):
    assert analyze(two_node_log(net=net, provider=None)).verdict == verdict


def test_unknown_network_is_inconclusive():
    report = analyze(two_node_log(net="Warpdrive", provider=None))
    assert report.verdict == "inconclusive" and "Warpdrive" in str(report.inter_node)


def test_without_connection_lines_the_selected_network_of_a_multi_node_comm_decides():
    assert analyze(two_node_log(channels=False)).verdict == "efa"
    assert analyze(two_node_log(net="Socket", provider=None, channels=False)).verdict == "socket"
    report = analyze(two_node_log(channels=False, nnodes_line=False))
    assert report.verdict == "efa", "ranks of one communicator on two hosts also show it spans nodes"
    assert "no per-connection lines" in report.reason


def test_net_between_ranks_on_one_host_is_not_inter_node():
    # (19) in the reference: with P2P/SHM disabled, ranks on one host talk via NET/Socket.
    lines = []
    for r in range(2):
        p = f"box:{10 + r}:{10 + r} [{r}] NCCL INFO "
        lines += [
            p + f"comm 0x{r}a rank {r} nRanks 2 nNodes 1 localRanks 2 localRank {r} MNNVL 0",
            p + f"Channel 00/0 : {r}[{r}] -> {1 - r}[{1 - r}] [send] via NET/Socket/0",
            p + f"ncclCommInitRank comm 0x{r}a rank {r} nranks 2 cudaDev {r} busId 0 commId 0x5 - Init COMPLETE",
        ]
    report = analyze(lines)
    assert report.verdict == "single-node" and report.intra_node == {"NET/Socket": 2}
    assert any("same host" in n for n in report.notes)


def test_plugin_initialized_but_unused_is_noted():
    # (07) in the reference: the plugin initializes, fails later, and NCCL moves on to IB.
    lines = [ln.replace("Using network Libfabric", "Using network IB") for ln in two_node_log(net="IB", provider=None)]
    lines.insert(0, "node-a:100:200 [0] NCCL INFO Initialized NET plugin AWS Libfabric")
    report = analyze(lines)
    assert report.verdict == "ib" and any("did not use it" in n for n in report.notes)


def test_efa_and_ib_in_one_log_is_inconclusive():
    ib = [ln.replace("node-", "ibnode-").replace("0xabc", "0xdef") for ln in two_node_log(net="IB", provider=None)]
    report = analyze(two_node_log() + ib)
    assert report.verdict == "inconclusive" and "one job at a time" in report.reason


def test_mixed_nccl_builds_are_reported():
    lines = two_node_log()
    lines[0] = lines[0].replace("2.29.7", "2.21.5")
    report = analyze(lines)
    assert report.nccl_versions == ["2.21.5", "2.29.7"] and any("several NCCL builds" in n for n in report.notes)


@pytest.mark.parametrize(
    ("line", "label", "verdict"),
    [
        ("Ring 00 : 7 -> 8 [receive] via NET/AWS Libfabric/0", "NET/AWS Libfabric", "efa"),  # 2.4
        ("Ring 00 : 15[41000] -> 0[1b000] [receive] via NET/IB/0", "NET/IB", "ib"),  # 2.5-2.6
        ("Channel 00 : 1[101d0] -> 8[101c0] [send] via NET/AWS Libfabric/1/GDRDMA", "NET/AWS Libfabric", "efa"),
        ("Channel 00/1 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA/Shared", "NET/IB", "ib"),
        ("Channel 00/0 : 9[1] -> 0[0] [send] via NET/IB/0(8)/GDRDMA", "NET/IB", "ib"),  # PXN
        ("Channel 00/0 : 3[0] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA(PCI)", "NET/Libfabric", "efa"),
        ("Channel 09/0 : 33[1] -> 41[1] [send] via NET/IBext_v8/4", "NET/IBext_v8", "ib"),
        ("Channel 00/0 : 0[0] -> 1[1] [send] via NET/OFI/0 comm 0x2083dd50 nRanks 02", "NET/OFI", "efa"),  # RCCL
        ("CollNet 00/0 : 0 [send] via COLLNET/IBext/0/GDRDMA", "CollNet/IBext", "ib"),
        ("Coll 00 : 0 [send] via COLLNET/SHARP/0", "CollNet/SHARP", "ib"),
    ],
)
def test_connection_line_formats_of_every_release(line, label, verdict):
    report = analyze([f"h:1:1 [0] NCCL INFO {line}"])
    assert report.inter_node == {label: 1} and report.verdict == verdict


@pytest.mark.parametrize(
    ("via", "label"),
    [
        ("P2P/IPC/read", "P2P/IPC"),
        ("P2P/IPC", "P2P/IPC"),
        ("P2P/CUMEM/read", "P2P/CUMEM"),
        ("P2P/CUMEM/CE", "P2P/CUMEM"),
        ("P2P/direct pointer/read", "P2P/direct"),
        ("P2P/indirect/1[2]", "P2P/indirect"),
        ("direct shared memory", "SHM"),
        ("SHM/direct/direct", "SHM"),
        ("SHM/CE/direct", "SHM"),
        ("SHM/direct", "SHM"),
        ("NVLS", "NVLS"),
    ],
)
def test_intra_node_transports(via, label):
    report = analyze([f"h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via {via}"])
    assert report.intra_node == {label: 1} and report.verdict == "single-node"


# -- prefixes, interleaving, joined and split lines --------------------------------------------------------------

PREFIXES = {
    "none": "{}",
    "ray": "(RayTrainWorker pid=123, ip=10.0.0.1) {}",
    "ray-ansi": "\x1b[36m(RayTrainWorker pid=123, ip=10.0.0.1)\x1b[0m {} [repeated 3x across cluster]",
    "kubectl": "[pod/worker-0/ray-worker] 2026-01-02T03:04:05.123456789Z {}",
    "cloudwatch": "  | 2024-11-28T07:42:11.528Z | {}",
    "mpirun-tag": "[1,0]<stdout>:{}",
    "mpirun-timestamp": "Wed Sep  6 17:26:52 2023[1,7]<stdout>:{}",
    "nccl-timestamp": "[2025-12-28 16:04:25] {}",
    "syslog": "Mar  2 10:14:03 ip-10-0-0-1 python[123]: {}",
    "crlf": "{}\r",
}


@pytest.mark.parametrize("prefix", PREFIXES.values(), ids=PREFIXES.keys())
def test_prefixes_do_not_change_the_result(prefix):
    report = analyze(prefix.format(line) for line in two_node_log())
    assert report.verdict == "efa" and report.hosts == ["node-a", "node-b"]
    assert report.inter_node == {"NET/Libfabric": 4} and report.intra_node == {"P2P/CUMEM": 2}
    assert [r.rank for r in report.ranks] == [0, 1, 2, 3]


def test_interleaved_order_does_not_change_the_result():
    lines = two_node_log()
    random.Random(7).shuffle(lines)  # worse than real interleaving: even one rank's own order is lost
    report = analyze(lines)
    assert report.verdict == "efa" and report.inter_node == {"NET/Libfabric": 4}


def test_two_records_on_one_line_are_both_read():
    a = "node-a:1:1 [0] NCCL INFO Using network Socket"
    b = "node-b:2:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [send] via NET/Socket/0"
    report = analyze([f"{a} | {a}", a[:30] + "(RayTrainWorker pid=2, ip=10.0.0.2) " + b, a[30:]])
    assert report.plugin.networks == {"Socket": 1}
    assert report.inter_node == {"NET/Socket": 1} and report.verdict == "socket"


def test_hostless_lines_still_decide():
    # (20) in the reference: a pasted log without hostnames.
    lines = [
        " [0] NCCL INFO NCCL version 2.5.7+cuda10.0",
        " [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE ; OOB br0:10.137.141.16<0>",
        " [0] NCCL INFO Ring 00 : 15[41000] -> 0[1b000] [receive] via NET/IB/0",
        " [0] NCCL INFO comm 0x7f rank 0 nranks 16 cudaDev 0 busId 1b000 - Init COMPLETE",
    ]
    report = analyze(lines)
    assert report.verdict == "ib" and report.ib_devices == ["mlx5_0:1/RoCE"] and report.nccl_version == "2.5.7"


# -- truncated and garbage input: a verdict or a clear error, never a crash ---------------------------------------


def test_random_bytes_never_crash(tmp_path):
    rng = random.Random(1234)
    pieces = [b"NCCL INFO ", b"NCCL WARN ", b"Channel 00/0 : ", b" -> ", b" via NET/", b"[send]", b"comm 0x", b"\n"]
    data = bytearray()
    for _ in range(3000):
        data += rng.randbytes(rng.randint(0, 40)) + rng.choice(pieces)
    path = tmp_path / "noise.bin"
    path.write_bytes(bytes(data))
    report = analyze_paths([path])
    assert report.verdict in VERDICTS
    json.loads(report.to_json("efa"))
    assert report.render("efa")


def test_every_prefix_of_a_log_gives_a_verdict():
    lines = two_node_log()
    for n in range(len(lines) + 1):
        report = analyze(lines[:n])
        assert report.verdict in VERDICTS
    assert analyze([]).verdict == "inconclusive"
    assert "NCCL_DEBUG=INFO" in analyze(["hello", "world"]).reason


def test_truncated_gzip_keeps_what_was_read(tmp_path):
    data = gzip.compress("\n".join(two_node_log()).encode() * 50)
    path = tmp_path / "worker.out.gz"
    path.write_bytes(data[: len(data) // 2])
    report = analyze_paths([path])
    assert report.verdict == "efa"
    assert any("ends early" in n for n in report.notes)


# -- reading: streaming, line numbers, folders, stdin, bad paths ---------------------------------------------------


def test_line_numbers_survive_chunk_boundaries_and_long_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(nccl_lines, "_CHUNK", 64)
    monkeypatch.setattr(nccl_lines, "_MAX_LINE", 256)
    text = ["filler"] * 5 + ["x" * 1000] + ["h:1:1 [0] NCCL INFO Using network Socket"] + ["y" * 300 + "NCCL"]
    path = tmp_path / "a.log"
    path.write_text("\n".join(text) + "\n")
    got = [(ln.lineno, ln.text) for ln in iter_log_lines([path])]
    assert got[0] == (7, "h:1:1 [0] NCCL INFO Using network Socket")
    assert len(got) == 2 and got[1][0] == 8


def test_iter_log_lines_only_yields_nccl_lines_and_counts_bytes(tmp_path):
    path = tmp_path / "a.log"
    path.write_text("one\ntwo NCCL\r\nthree\n")
    stats = nccl_lines.ReadStats()
    assert [ln.text for ln in iter_log_lines([path], stats=stats)] == ["two NCCL\r"]
    assert (stats.files, stats.bytes, stats.lines) == (1, 20, 3)


def test_stdin_and_dash(tmp_path):
    data = "\n".join(two_node_log()).encode()
    assert analyze_paths([], stdin=io.BytesIO(data)).verdict == "efa"
    assert analyze_paths(["-"], stdin=io.BytesIO(data)).verdict == "efa"


def test_progress_reports_bytes_read():
    seen: list[int] = []
    report = analyze_paths([FIXTURES / "ib_2node_nccl2.21_mpirun.log"], progress=seen.append)
    assert seen and seen[-1] == report.stats["bytes"] == (FIXTURES / "ib_2node_nccl2.21_mpirun.log").stat().st_size


def test_bad_paths_are_user_errors(tmp_path):
    with pytest.raises(LogInputError, match="no such file or folder") as err:
        analyze_paths([tmp_path / "missing.log"])
    assert err.value.hint and err.value.exit_code == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogInputError, match="holds no files"):
        analyze_paths([tmp_path / "empty"])


@pytest.mark.parametrize("name", [c[0] for c in FIXTURE_CASES if not c[0].endswith("logs")])
def test_skipping_irrelevant_lines_unread_changes_nothing(name):
    # analyze_paths skips, before decoding, the NCCL lines the analyzer ignores; analyze() sees every line.
    with open(FIXTURES / name, encoding="utf-8", errors="replace", newline="") as f:
        everything = analyze(f, source=str(FIXTURES / name))
    skipped = fixture(name)
    for key in ("verdict", "reason", "hosts", "ranks", "inter_node", "intra_node", "plugin", "evidence", "warnings"):
        assert getattr(skipped, key) == getattr(everything, key), key


def test_relevant_words_cover_every_handler():
    for word in NcclLogAnalyzer()._handlers:
        assert word.encode().startswith(nccl_lines._RELEVANT_WORDS), word


def test_state_stays_bounded_when_the_same_job_repeats():
    a = NcclLogAnalyzer()
    block = two_node_log()
    for line in block:
        a.feed(line)
    size = (len(a._conns), len(a._procs), len(a._refs))
    for _ in range(300):
        for line in block:
            a.feed(line)
    assert (len(a._conns), len(a._procs), len(a._refs)) == size
    assert a.finish().verdict == "efa"


def test_state_is_bounded_for_adversarial_input(monkeypatch):
    monkeypatch.setattr(nccl_lines, "_MAX_PROCS", 5)
    monkeypatch.setattr(nccl_lines, "_MAX_COMMS", 5)
    monkeypatch.setattr(nccl_lines, "_MAX_CONNECTIONS", 50)
    a = NcclLogAnalyzer()
    for i in range(500):
        p = f"host{i}:{i}:{i} [{i % 7}] NCCL INFO "
        a.feed(p + f"Channel {i % 100:02d}/0 : {i}[0] -> {i + 1}[0] [send] via NET/Net{i}/0")
        a.feed(p + f"comm 0x{i:x} rank 0 nranks 2 cudaDev 0 commId 0x{i:x} - Init COMPLETE")
        a.feed(p + f"Using network Net{i}")
        a.feed(p.replace("INFO", "WARN") + f"warning number {i}")
    report = a.finish()
    assert len(a._procs) <= 6 and len(a._members) <= 5 and len(a._conns) <= 50
    assert len(report.warnings) <= nccl_lines._MAX_DISTINCT and report.verdict in VERDICTS
    assert any("were not tracked" in n for n in report.notes)


# -- the command ---------------------------------------------------------------------------------------------------


@pytest.fixture
def cli(fabric_cli: typer.Typer) -> typer.Typer:
    return fabric_cli


@pytest.mark.parametrize(
    ("name", "args", "code"),
    [
        ("efa_2node_nccl2.29_ray.log", [], 0),
        ("socket_fallback_nccl2.27_kubectl.log", [], 1),
        ("single_node_nccl2.27.log", [], 1),
        ("truncated_before_connections.log", [], 1),
        ("garbage.log", [], 2),
        ("ib_2node_nccl2.21_mpirun.log", ["--require", "ib"], 0),
        ("efa_2node_nccl2.29_ray.log", ["--require", "ib"], 1),
        ("socket_fallback_nccl2.27_kubectl.log", ["--require", "any"], 0),
        ("garbage.log", ["--require", "any"], 2),
    ],
)
def test_command_exit_codes(cli, name, args, code):
    result = CliRunner().invoke(cli, ["verify-transport", str(FIXTURES / name), *args])
    assert result.exit_code == code, result.output
    assert result.output.startswith("NCCL transport:")


def test_command_json(cli):
    result = CliRunner().invoke(cli, ["verify-transport", "--json", str(FIXTURES / "ray_session_logs")])
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert {"verdict", "basis", "nccl_version", "ranks", "hosts", "inter_node", "plugin", "evidence"} <= set(data)
    assert (data["verdict"], data["basis"], data["require"], data["meets"]) == ("efa", "proven", "efa", True)
    assert data["inter_node"] == {"NET/Libfabric": 8} and len(data["ranks"]) == 8
    assert {"source", "line", "text"} == set(data["evidence"][0])


def test_command_reads_stdin_and_several_paths(cli):
    log = (FIXTURES / "socket_nccl2.7_twin_hostnames.log").read_text()
    result = CliRunner().invoke(cli, ["verify-transport"], input=log)
    assert result.exit_code == 1 and "SOCKET" in result.output and "NOT met" in result.output
    both = [str(FIXTURES / "efa_2node_nccl2.10_old.log"), "-"]
    result = CliRunner().invoke(cli, ["verify-transport", *both], input=log)
    assert result.exit_code == 1, "a socket link anywhere fails the EFA requirement"


def test_command_bad_path_is_a_user_error(cli, tmp_path):
    result = CliRunner().invoke(cli, ["verify-transport", str(tmp_path / "nope")])
    assert isinstance(result.exception, LogInputError) and "no such file" in str(result.exception)
