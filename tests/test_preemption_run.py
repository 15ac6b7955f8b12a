"""A real local run (two Ray Train workers, the built-in model) told mid-run by a stand-in of the instance metadata
service (tests/metadata_standin.py, on the loopback) that its spot instance goes: it saves a checkpoint, ends
``preempted`` with the CLI's own exit status and resume line, spending no Ray Train retry (``max_failures`` 0);
resumed on one worker, it trains the same samples to the same losses as a run that was never interrupted.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from metadata_standin import MetadataStandIn

from raytrain_eks.cli import main
from raytrain_eks.report.segments import SEGMENTS, read_segments
from raytrain_eks.train.checkpoint import MARKER, latest_complete, list_checkpoints, load_trainer_state
from raytrain_eks.train.preemption import ENDPOINT_ENV, EXIT_CODE

STEPS = 12
FLAGS = ["--steps", str(STEPS), "--seq-len", "64", "--batch-size", "4", "--checkpoint-every", "0", "--num-workers", "2"]
SETS = ["training.log_every=1", "training.max_failures=0", "training.export=false", "training.notice_poll_s=0.05"]


def train(*args: str) -> int:
    try:
        main(["train", *args, *[a for s in SETS for a in ("--set", s)]])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def losses(run: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines]
    assert len(steps) == len(set(steps)), f"a step trained twice: {steps}"
    return {r["step"]: r["loss"] for r in lines}


@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    assert train(*FLAGS, "--output-dir", str(run)) == 0
    return run


def test_notice_checkpoints_ends_preempted_and_resumes_on_one_worker(
    ray_local, reference, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    with MetadataStandIn(notice_after=6) as imds:  # the first looks find nothing: the notice comes mid-run
        deadline = (datetime.now(UTC) + timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%SZ")  # as EC2 gives it
        imds.action = {"action": "terminate", "time": deadline}
        monkeypatch.setenv(ENDPOINT_ENV, imds.url)
        monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)  # the suite turns the service off
        code = train(*FLAGS, "--output-dir", str(run))
    monkeypatch.delenv(ENDPOINT_ENV)
    said = capsys.readouterr().out
    assert code == EXIT_CODE, said
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ended"] == "preempted"
    step = summary["preempted"]["step"]
    assert 1 < step < STEPS, step
    assert f"spot interruption notice (terminate at {deadline})" in summary["preempted"]["reason"]
    assert 0 < summary["preempted"]["seconds_left"] < 600  # saved before the deadline (ten minutes: a slow start)
    assert f"raytrain-eks train --resume {run}" in said
    assert f"checkpoint {step} written in " in said and "s before the notice's deadline" in said, said
    # its checkpoint is complete, at the step it stopped after; nothing trained twice (no retry) or after it
    assert [s for s, _, ok in list_checkpoints(run / "ray") if ok] == [step]
    assert json.loads((Path(latest_complete(run / "ray")) / MARKER).read_text())["world_size"] == 2
    assert sorted(losses(run)) == list(range(1, step + 1))
    assert not (run / "model").exists()  # not exported: the run is not over

    assert train("--resume", str(run), "--num-workers", "1") == 0
    said = capsys.readouterr().out
    assert "grad_accum_steps 1 -> 2 keeps the global batch of 8 samples" in said, said
    done = json.loads((run / "summary.json").read_text())
    assert done["steps"] == STEPS and done["resumed_from_step"] == step and done["world_size"] == 1
    expected, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert got[s] == pytest.approx(expected[s], rel=1e-4), s
    # every sample once: the same data position as the uninterrupted run's at the end
    end = load_trainer_state(Path(latest_complete(run / "ray")), 0)["data"]
    assert end == load_trainer_state(Path(latest_complete(reference / "ray")), 0)["data"]
    # the run's two segments: the preempted one on two workers, the resumed one on one, as `train` printed them
    first, second = read_segments(run / SEGMENTS)
    assert (first.first_step, first.last_step, first.world_size, first.ended) == (0, step, 2, "preempted")
    assert first.reason.startswith("spot reclaim: spot interruption notice") and first.capacity == "local"
    assert (second.first_step, second.last_step, second.world_size, second.ended) == (step, STEPS, 1, "finished")
    assert f"segment 1: steps 0-{step}, 2 workers on 1 node (local)" in said, said
    assert f"segment 2: steps {step}-{STEPS}, 1 worker on 1 node (local)" in said
    assert "<h2>Segments</h2>" in (run / "report.html").read_text()
