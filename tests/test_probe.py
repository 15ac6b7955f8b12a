"""The collective bandwidth probe: nccl-tests' bandwidth formulas, message sizes, the verdict against the line
rate, the report, and the ``probe`` command's options and exit codes — all without Ray — plus one integration
run of the probe on an embedded Ray (one node, gloo). The two-node runs, with and without a capped link, are in
test_two_host.py.
"""

from __future__ import annotations

import json
import signal

import pytest
import typer
from typer.testing import CliRunner

from raytrain_eks import presets
from raytrain_eks.config import load_config
from raytrain_eks.eks.pricing import deployment_record
from raytrain_eks.fabric import commands, probe
from raytrain_eks.fabric.probe import (
    HEALTHY_RATIO,
    LARGE_MESSAGE_BYTES,
    Measurement,
    ProbeError,
    ProbeReport,
    ProbeSpec,
    algbw,
    build_report,
    bus_factor,
    busbw,
    expected_line_rate,
    format_size,
    judge,
    message_sizes,
    op_elements,
    parse_size,
    summarize,
)
from raytrain_eks.instances import INSTANCE_TYPES
from raytrain_eks.k8s.state import StateStore

MiB = 1 << 20


# -- sizes ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("1M", MiB),
        ("1MiB", MiB),
        ("1mb", MiB),
        ("512k", 512 << 10),
        ("1G", 1 << 30),
        ("0.5M", MiB // 2),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "M", "1X", "-1M", "0"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(ProbeError):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (MiB, 1 << 30, 3 << 10, 1000)] == ["1 MiB", "1 GiB", "3 KiB", "1000 B"]


def test_message_sizes_double_from_min_to_max_like_nccl_tests():
    assert message_sizes(MiB, 4 * MiB) == [MiB, 2 * MiB, 4 * MiB]
    assert message_sizes(MiB, 5 * MiB) == [MiB, 2 * MiB, 4 * MiB], "max is included only when reached"
    assert len(message_sizes(MiB, 1 << 30)) == 11, "the default 1 MiB .. 1 GiB"
    assert message_sizes(MiB, MiB) == [MiB]
    with pytest.raises(ProbeError, match="not a range"):
        message_sizes(2 * MiB, MiB)


def test_op_elements_round_to_whole_floats_per_rank():
    assert op_elements("all_reduce", MiB, 3) == (MiB // 4, MiB)
    # all_gather / reduce_scatter: the size is the whole gathered output / the whole input, split over ranks.
    per_rank = MiB // (4 * 3)
    assert op_elements("all_gather", MiB, 3) == (per_rank, per_rank * 3 * 4)
    assert op_elements("reduce_scatter", MiB, 4) == (MiB // 16, MiB)
    assert op_elements("all_gather", 7, 2) == (0, 0)


# -- nccl-tests' formulas ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "world", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 8, 1.75),
        ("all_reduce", 16, 1.875),
        ("all_gather", 2, 0.5),
        ("all_gather", 8, 0.875),
        ("reduce_scatter", 8, 0.875),
        ("all_reduce", 1, 0.0),
    ],
)
def test_bus_factor(op, world, factor):
    assert bus_factor(op, world) == pytest.approx(factor)


def test_algbw_and_busbw():
    # 1 GiB all_reduce in 0.1 s on 8 ranks: algbw 10.74 GB/s, busbw x 2*7/8.
    assert algbw(1 << 30, 0.1) == pytest.approx(10.737418e9)
    assert busbw("all_reduce", 1 << 30, 0.1, 8) == pytest.approx(10.737418e9 * 1.75)
    assert busbw("all_gather", 1 << 30, 0.1, 8) == pytest.approx(10.737418e9 * 0.875)
    with pytest.raises(ValueError):
        algbw(MiB, 0)


def test_unknown_collective_is_refused():
    with pytest.raises(ProbeError, match="broadcast"):
        bus_factor("broadcast", 2)
    with pytest.raises(ProbeError, match="broadcast"):
        ProbeSpec(ops=("broadcast",))


def test_summarize_averages_the_ranks_times_like_nccl_tests():
    times = [
        {"all_reduce": [0.001, 0.010], "all_gather": [0.002, 0.004]},
        {"all_reduce": [0.003, 0.010], "all_gather": [0.002, 0.004]},
    ]
    rows = summarize(["all_reduce", "all_gather"], [MiB, 8 * MiB], times)
    assert [(r.op, r.bytes) for r in rows] == [
        ("all_reduce", MiB),
        ("all_reduce", 8 * MiB),
        ("all_gather", MiB),
        ("all_gather", 8 * MiB),
    ]
    first = rows[0]
    assert first.seconds == pytest.approx(0.002)
    assert first.algbw == pytest.approx(MiB / 0.002)
    assert first.busbw == pytest.approx(MiB / 0.002 * 1.0)  # 2(n-1)/n = 1 on two ranks
    assert rows[3].busbw == pytest.approx(8 * MiB / 0.004 * 0.5)
    assert first.to_dict() == {
        "op": "all_reduce",
        "bytes": MiB,
        "time_us": 2000.0,
        "algbw_GBps": round(MiB / 0.002 / 1e9, 6),
        "busbw_GBps": round(MiB / 0.002 / 1e9, 6),
    }


def test_summarize_skips_sizes_too_small_to_split():
    rows = summarize(["all_gather"], [4, MiB], [{"all_gather": [0.0, 0.001]}, {"all_gather": [0.0, 0.001]}])
    assert [r.bytes for r in rows] == [MiB]


# -- the verdict ---------------------------------------------------------------------------------------------------


def _row(nbytes: int, busbw_gbps: float, op: str = "all_reduce") -> Measurement:
    bw = busbw_gbps * 1e9 / 8
    return Measurement(op, nbytes, nbytes / bw, bw, bw)


def test_judge_healthy_and_degraded_against_the_line_rate():
    rows = [_row(MiB, 5), _row(256 * MiB, 30), _row(1 << 30, 32, "all_gather")]
    ok = judge(rows, nodes=2, expected_gbps=40, expected_source="g6.12xlarge network rate")
    assert (ok.verdict, ok.exit_code) == ("healthy", 0)
    assert ok.best_busbw_gbps == pytest.approx(32) and ok.ratio == pytest.approx(0.8)
    assert "80% of the expected 40 Gbit/s (g6.12xlarge network rate)" in ok.reason
    bad = judge([_row(1 << 30, 12)], nodes=2, expected_gbps=40)
    assert (bad.verdict, bad.exit_code) == ("degraded", 1)
    assert bad.ratio == pytest.approx(0.3) and "< 50%" in bad.reason


def test_judge_threshold_is_inclusive_and_configurable():
    rows = [_row(1 << 30, 20)]
    assert judge(rows, nodes=2, expected_gbps=40).verdict == "healthy"  # exactly HEALTHY_RATIO
    assert HEALTHY_RATIO == 0.5
    assert judge(rows, nodes=2, expected_gbps=40, healthy_ratio=0.6).verdict == "degraded"


def test_judge_uses_large_messages_only():
    # A small message cannot make a slow fabric look healthy (latency-bound sizes are ignored).
    rows = [_row(MiB, 39), _row(LARGE_MESSAGE_BYTES, 4), _row(1 << 30, 5)]
    v = judge(rows, nodes=2, expected_gbps=40)
    assert v.best_busbw_gbps == pytest.approx(5) and v.verdict == "degraded"
    assert v.large_message_bytes == LARGE_MESSAGE_BYTES
    # When every size is small (a short CPU run), the largest measured size counts.
    small = judge([_row(MiB, 9), _row(4 * MiB, 2)], nodes=2, expected_gbps=1)
    assert small.large_message_bytes == 4 * MiB and small.best_busbw_gbps == pytest.approx(2)


def test_judge_cannot_decide_on_one_node_or_without_a_line_rate():
    rows = [_row(1 << 30, 300)]
    single = judge(rows, nodes=1, expected_gbps=40)
    assert (single.verdict, single.exit_code, single.ratio) == ("single-node", 2, None)
    unknown = judge(rows, nodes=2, expected_gbps=None)
    assert (unknown.verdict, unknown.exit_code) == ("unknown", 2) and "--expected-gbps" in unknown.reason
    with pytest.raises(ProbeError):
        judge([], nodes=2, expected_gbps=40)


def deployed(cfg, tmp_path) -> dict:
    """The deployment record submit gives the job of a cluster that ``up`` recorded in its state."""
    state = StateStore(tmp_path / ".raytrain-eks")
    state.update(cluster=cfg.cluster.name, region=cfg.cluster.region)
    record = deployment_record(cfg, state)
    assert record is not None
    return record


@pytest.mark.parametrize(
    ("instance", "gbps"),
    [("g6.12xlarge", 40), ("g5.48xlarge", 100), ("g6.48xlarge", 100), ("p4d.24xlarge", 400), ("p5.48xlarge", 3200)],
)
def test_expected_line_rate_from_the_deployed_nodes_instance_type(instance, gbps, tmp_path):
    gpus = INSTANCE_TYPES[instance].gpus
    overrides = {"cluster": {"gpu_node_type": instance, "gpus_per_node": gpus}}
    cfg = load_config(preset=presets.reference(), path=None, environ={}, overrides=overrides)
    assert expected_line_rate(cfg, deployed=deployed(cfg, tmp_path)) == (gbps, f"{instance} network rate")


def test_the_configured_instance_type_is_not_taken_for_the_nodes_of_an_unknown_cluster():
    # A Ray cluster joined with --address: the configuration's (default) g6.12xlarge says nothing of its nodes.
    cfg = load_config(preset=presets.reference(), path=None, environ={})
    assert expected_line_rate(cfg) == (None, None)


def test_expected_line_rate_flag_beats_config_beats_instance(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("fabric:\n  expected_gbps: 25\n")
    cfg = load_config(preset=presets.reference(), path=path, environ={})
    assert expected_line_rate(cfg) == (25, "fabric.expected_gbps")
    assert expected_line_rate(cfg, 7.5) == (7.5, "--expected-gbps")
    with pytest.raises(ProbeError):
        expected_line_rate(cfg, 0)


def test_expected_line_rate_of_an_unknown_instance_type_is_none(tmp_path):
    cfg = load_config(preset=presets.reference(), path=None, environ={})
    record = {**deployed(cfg, tmp_path), "gpu_node_type": "x9.huge"}
    assert expected_line_rate(cfg, deployed=record) == (None, None)


# -- the report ----------------------------------------------------------------------------------------------------


def _gathered(seconds: float, nodes: tuple[str, str] = ("n0", "n1")) -> dict:
    spec = ProbeSpec(ops=("all_reduce", "all_gather"), min_bytes=MiB, max_bytes=2 * MiB)
    ranks = []
    for rank, node in enumerate(nodes):
        placement = {
            "rank": rank,
            "local_rank": 0,
            "node_rank": rank if nodes[0] != nodes[1] else 0,
            "node_ip": f"10.0.0.{1 + int(node[-1])}",
            "node_id": node,
            "device": "cpu",
        }
        times = {op: [seconds * (i + 1) for i in range(len(spec.sizes))] for op in spec.ops}
        ranks.append({"placement": placement, "times": times})
    return {"backend": "gloo", "ranks": ranks[::-1]}, spec


def test_build_report_render_and_json():
    gathered, spec = _gathered(0.001)
    report = build_report(gathered, spec, expected_gbps=10, expected_source="--expected-gbps")
    assert isinstance(report, ProbeReport)
    assert report.world_size == 2 and report.nodes == {"10.0.0.1": [0], "10.0.0.2": [1]}
    assert [p.rank for p in report.placements] == [0, 1]
    # 2 MiB in 2 ms on two ranks: all_reduce busbw = 1.049 GB/s = 8.39 Gbit/s, 84% of 10.
    assert report.verdict.verdict == "healthy" and report.verdict.best_busbw_gbps == pytest.approx(8.388608)
    text = report.render()
    assert text.startswith("collective bandwidth: HEALTHY")
    assert "2 ranks on 2 node(s), gloo" in text and "node 10.0.0.2: rank(s) 1" in text
    assert "all_reduce          2 MiB        2000.0         1.049         1.049" in text
    assert "below 64 MiB" in text, "a short run says that latency may hold the figure down"
    data = json.loads(report.to_json())
    assert list(data)[:9] == [
        "verdict",
        "reason",
        "best_busbw_gbps",
        "expected_gbps",
        "expected_source",
        "ratio",
        "healthy_ratio",
        "large_message_bytes",
        "backend",
    ], "the verdict's figures lead the JSON, under these names"
    assert (data["verdict"], data["num_nodes"], data["world_size"], data["backend"]) == ("healthy", 2, 2, "gloo")
    assert data["expected_gbps"] == 10 and data["ranks"][1]["node_ip"] == "10.0.0.2"
    assert len(data["results"]) == 4 and data["spec"]["ops"] == ["all_reduce", "all_gather"]


def test_build_report_single_node():
    gathered, spec = _gathered(0.001, nodes=("n0", "n0"))
    report = build_report(gathered, spec, expected_gbps=10, expected_source="x")
    assert report.verdict.verdict == "single-node" and report.exit_code == 2


def test_spec_validation():
    with pytest.raises(ProbeError, match="iters"):
        ProbeSpec(iters=0)
    with pytest.raises(ProbeError):
        ProbeSpec(ops=())
    assert ProbeSpec().sizes[0] == MiB and ProbeSpec().sizes[-1] == 1 << 30


# -- the command ---------------------------------------------------------------------------------------------------


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """A root group, so that the command is addressed by name as under raytrain-eks."""

    commands.register(app)
    return app


@pytest.fixture
def fake_probe(monkeypatch):
    """Replaces the Ray part with a canned measurement; records the arguments the command passed."""
    calls = []

    def run(cfg, spec, **kwargs):
        calls.append({"cfg": cfg, "spec": spec, **kwargs})
        gathered, measured = _gathered(0.001)
        line_rate, source = expected_line_rate(cfg, kwargs["expected_gbps"], kwargs["deployed"])
        return build_report(
            gathered,
            measured,
            expected_gbps=line_rate,
            expected_source=source,
            healthy_ratio=kwargs["healthy_ratio"],
        )

    monkeypatch.setattr(commands, "run_probe", run)
    return calls


def test_command_passes_options_and_exits_by_verdict(cli, fake_probe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["probe", "--address", "10.0.0.1:6379", "--min-bytes", "1M", "--max-bytes", "2M", "--iters", "3"]
    result = CliRunner().invoke(cli, [*args, "--ops", "all_reduce,all_gather", "--expected-gbps", "10"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("collective bandwidth: HEALTHY")
    call = fake_probe[-1]
    assert call["spec"] == ProbeSpec(ops=("all_reduce", "all_gather"), min_bytes=MiB, max_bytes=2 * MiB, iters=3)
    assert call["address"] == "10.0.0.1:6379" and call["expected_gbps"] == 10
    assert call["cfg"].cluster.gpu_node_type == "g6.12xlarge", "--address defaults to the reference preset"
    # No deployment record: the joined cluster's nodes are not known, so no line rate is assumed from the preset's
    # g6.12xlarge; the verdict is undecided (exit 2) and says how to give one.
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 2 and fake_probe[-1]["deployed"] is None
    data = json.loads(result.output)
    assert data["verdict"] == "unknown" and data["expected_gbps"] is None and "--expected-gbps" in data["reason"]


def test_command_reads_the_expectation_from_the_config(cli, fake_probe, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("fabric:\n  expected_gbps: 100\n")
    result = CliRunner().invoke(cli, ["probe", "--config", str(path), "--json", "--healthy-ratio", "0.05"])
    data = json.loads(result.output)
    assert result.exit_code == 0 and (data["expected_gbps"], data["verdict"]) == (100, "healthy")
    assert fake_probe[-1]["healthy_ratio"] == 0.05


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-bytes", "lots"], "not understood"),
        (["--min-bytes", "4M", "--max-bytes", "1M"], "not a range"),
        (["--ops", "all_reduce,broadcast"], "broadcast"),
        (["--healthy-ratio", "1.5"], "--healthy-ratio"),
        (["--preset", "nope"], "--preset"),
    ],
)
def test_command_refuses_bad_options(cli, fake_probe, args, message):
    result = CliRunner().invoke(cli, ["probe", *args])
    assert result.exception is not None and message in str(result.exception)
    assert not fake_probe, "nothing runs before the options are checked"


# -- on an embedded Ray --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("starts_ray")
def test_probe_on_an_embedded_ray(ray_local):
    spec = ProbeSpec(min_bytes=256 << 10, max_bytes=MiB, iters=2, warmup=1)
    cfg = load_config(preset=presets.local_tiny(), path=None, environ={})
    before = signal.getsignal(signal.SIGINT)
    report = probe.run_probe(cfg, spec, num_workers=2, expected_gbps=1)
    assert signal.getsignal(signal.SIGINT) is before, "Ctrl-C stops this process again once the probe is done"
    assert report.backend == "gloo" and report.world_size == 2
    assert len(report.nodes) == 1 and report.verdict.verdict == "single-node" and report.exit_code == 2
    assert [(r.op, r.bytes) for r in report.rows][:3] == [
        ("all_reduce", 256 << 10),
        ("all_reduce", 512 << 10),
        ("all_reduce", MiB),
    ]
    assert len(report.rows) == 9 and all(r.busbw > 0 and r.seconds > 0 for r in report.rows)
