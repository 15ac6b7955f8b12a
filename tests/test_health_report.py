"""The report's cluster health section: from a run folder holding ``health/check.json`` (``raytrain-eks check --json``,
written here by the check's own ``ClusterHealth``), ``rank_steps.jsonl`` and ``watchdog/findings.json``, the page shows
each node's checks with their evidence, the bus bandwidth matrix of the pairs with the slow pair marked, the
straggler chart and the watchdog's finding."""

from __future__ import annotations

import json
from pathlib import Path

from raytrain_eks.deploy.checks import ClusterHealth
from raytrain_eks.health.node import Finding, NodeHealth
from raytrain_eks.health.pairs import PairFigure, judge_pairs
from raytrain_eks.report.html import write_report


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 2.0 - s / 10, "step_time_s": 0.5} for s in range(1, 7)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_the_report_shows_the_node_checks_the_bandwidth_matrix_stragglers_and_the_watchdog(tmp_path: Path):
    run = _run_folder(tmp_path)
    nodes = [
        NodeHealth("ip-10-0-1-5", "worker-0", (Finding("gpus", True, "4 of 4 GPUs seen (driver 580.65.06)"),)),
        NodeHealth("ip-10-0-1-6", "worker-1", (Finding("efa", False, "0 of 1 EFA devices: fi_getinfo: -61"),)),
    ]
    pairs = judge_pairs([PairFigure(("ip-10-0-1-5", "ip-10-0-1-6"), 2.1)], expected_gbps=40, source="g6.12xlarge")
    (run / "health").mkdir()
    (run / "health" / "check.json").write_text(ClusterHealth(nodes, pairs=pairs).to_json())
    (run / "rank_steps.jsonl").write_text(
        "".join(json.dumps({"step": s, "own_s": [0.2, 0.9]}) + "\n" for s in range(1, 7))
    )
    (run / "watchdog").mkdir()
    message = "watchdog: rank 1 on host 10.0.1.6 stopped after step 6: its process is stopped (state T)"
    (run / "watchdog" / "findings.json").write_text(json.dumps({"rank": 1, "message": message}))

    page = write_report([run], tmp_path / "report").read_text()

    health = page[page.index("<h2>Cluster health</h2>") :]
    # The slow pair is put down to the node that failed a check of its own, not to its other end.
    assert "run: node checks (failing: ip-10-0-1-6)</h3>" in health
    assert "<td>ip-10-0-1-6</td><td>FAILED</td><td>efa</td><td>FAIL</td><td>0 of 1 EFA devices" in health
    assert "<td>ip-10-0-1-5</td><td>healthy</td><td>gpus</td><td>ok</td>" in health
    assert "against 40 Gbit/s (g6.12xlarge), at least 50%" in health
    assert "<b>2.1 Gbit/s (5%): FAIL</b>" in health
    assert 'alt="Own work per rank (optimizer step)" src="data:image/png;base64,' in health
    assert message in health
