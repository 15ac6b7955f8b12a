"""A run's segments: each attempt (first start, every resume) as one line of ``segments.jsonl``, read back by
``status`` from the run's bundle in storage (moto's S3) and shown with the steps, nodes, capacity, ending and cost.

The summaries below have the fields and shapes ``train/loop.py``'s ``run_summary`` and ``preempted_summary`` write
(a real preempted and resumed run's segments are checked in tests/test_preemption_run.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import boto3

from raytrain_eks.deploy.results import segment_lines_of
from raytrain_eks.folders import new_folder
from raytrain_eks.report.segments import (
    FAILED,
    FINISHED,
    LOCAL,
    PREEMPTED,
    SEGMENTS,
    append_segment,
    capacity_of,
    parse_segments,
    read_segments,
    segment_lines,
    segment_of,
)
from raytrain_eks.train.bundle import RunBundle

SPOT_NOTICE = {
    "step": 7,
    "reason": "spot interruption notice (terminate at 2026-12-07T10:40:00Z)",
    "notice": {"kind": "interruption", "action": "terminate", "deadline": "2026-12-07T10:40:00Z", "seen": 1.0},
}


def _summary(**fields: object) -> dict[str, object]:
    return {"steps": 12, "world_size": 2, "nodes": 2, "resumed_from_step": None, "wall_s": 300.0, **fields}


def test_a_preempted_then_resumed_run_reads_as_two_segments_with_their_costs(tmp_path: Path):
    first = segment_of(
        _summary(steps=7, ended=PREEMPTED, preempted=SPOT_NOTICE, cost={"usd": 1.25}),
        started="2026-12-07T10:00:03Z",
        capacity="spot",
        hosts=["10.0.1.5", "10.0.1.6"],
        world_size=2,
    )
    second = segment_of(
        _summary(resumed_from_step=7, world_size=1, nodes=1, cost={"usd": 0.5}),
        started="2026-12-07T10:45:00Z",
        capacity="on-demand",
        hosts=["10.0.1.9"],
        world_size=1,
    )
    append_segment(tmp_path, first)
    append_segment(tmp_path, second)
    segments = read_segments(tmp_path / SEGMENTS)
    assert [(s.first_step, s.last_step, s.world_size, s.ended) for s in segments] == [
        (0, 7, 2, PREEMPTED),
        (7, 12, 1, FINISHED),
    ]
    lines = segment_lines(segments)
    assert lines[0].startswith("segment 1: steps 0-7, 2 workers on 2 nodes (spot: 10.0.1.5, 10.0.1.6), 2026-12-07 10")
    assert "preempted (spot reclaim: spot interruption notice (terminate at 2026-12-07T10:40:00Z)), $1.25" in lines[0]
    assert lines[1].startswith("segment 2: steps 7-12, 1 worker on 1 node (on-demand: 10.0.1.9)")
    assert lines[1].endswith("finished, $0.50")
    assert lines[2] == "segments: 2, $1.75 in all"


def test_a_capacity_blocks_drain_time_and_a_failure_say_why_they_ended():
    block = {**SPOT_NOTICE, "reason": "the run's stop time", "notice": {"kind": "deadline", "seen": 1.0}}
    ended = segment_of(_summary(ended=PREEMPTED, preempted=block), started="t", capacity="capacity-block", world_size=2)
    assert (ended.ended, ended.reason) == (PREEMPTED, "capacity block ending: the run's stop time")
    failed = segment_of(
        None,
        started="t",
        capacity=LOCAL,
        world_size=2,
        resumed_from=4,
        failure="training failed: RuntimeError: CUDA error\nTraceback ...",
        last_step=9,
    )
    assert (failed.first_step, failed.last_step, failed.ended, failed.reason) == (
        4,
        9,
        FAILED,
        "training failed: RuntimeError: CUDA error",
    )
    assert segment_lines([failed])[0].endswith("failed (training failed: RuntimeError: CUDA error)")  # not priced
    assert "segments:" not in "\n".join(segment_lines([failed, ended]))  # nothing priced: no total


def test_a_line_cut_short_is_left_out_and_the_capacity_comes_from_the_deployment_record():
    whole = json.dumps(segment_of(_summary(), started="t", capacity=LOCAL, world_size=2).to_json())
    assert len(parse_segments(whole + "\n" + whole[:40])) == 1
    assert capacity_of(None, joined=False) == LOCAL
    assert capacity_of({"gpu_capacity": "spot"}, joined=True) == "spot"
    assert capacity_of({"gpu_capacity": None}, joined=True) == "cluster (capacity not recorded)"


def test_status_reads_the_segments_from_the_runs_bundle_in_s3(tmp_path: Path, moto_url: str, aws_env: str):
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="runs-bucket")
    run_dir = new_folder(tmp_path, "20261207-100003-qwen")  # as train names and makes a run folder
    bundle = RunBundle.start(run_dir, "s3://runs-bucket/runs", total_steps=12, lines=[], warn=print, every_s=60)
    assert bundle is not None
    append_segment(run_dir, segment_of(_summary(), started="2026-12-07T10:00:03Z", capacity="spot", world_size=2))
    assert bundle.finish(_summary())
    job = {"run_dir": f"/home/ray/runs/{run_dir.name}", "bundle": bundle.location}
    d = SimpleNamespace(state={"job": job})
    lines = segment_lines_of(d)  # type: ignore[arg-type]  # status reads only the state's job
    assert lines[0] == f"Run {run_dir.name}:"
    assert lines[1].startswith("  segment 1: steps 0-12, 2 workers on 2 nodes (spot)") and "finished" in lines[1]
    # a resume on another machine continues the same file: the bundle's lines come back into a new run folder
    elsewhere = new_folder(tmp_path / "other", run_dir.name)
    again = RunBundle.start(elsewhere, "s3://runs-bucket/runs", total_steps=12, lines=[], warn=print, every_s=60)
    assert again is not None
    again.close()
    assert len(read_segments(elsewhere / SEGMENTS)) == 1
    assert segment_lines_of(SimpleNamespace(state={"job": {}})) == []  # type: ignore[arg-type]  # no job yet
