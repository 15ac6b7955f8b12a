"""Straggler detection (train/stragglers.py), hermetic, on recorded per-rank step times: which rank is named, after
how many steps, once per slow stretch; the margin and the noise floor; each step's times as written for the report;
and the optimizer step's clock on a real AdamW step."""

from __future__ import annotations

import json

import pytest
import torch

from raytrain_eks.train.stragglers import MIN_GAP_S, StepClock, append_rank_steps, find_stragglers

T0 = 1_800_000_000.0


def _ranks(own: dict[int, list[float]], first_step: int = 1) -> dict[int, dict]:
    """Ranks whose optimizer step took ``own[rank][i]`` seconds at step ``first_step + i``."""
    return {
        rank: {
            "rank": rank,
            "host": f"10.0.0.{11 + rank}",
            "hostname": f"ip-10-0-0-{11 + rank}",
            "gpu": None,
            "pid": 100 + rank,
            "beats": [[first_step + i, T0 + i, t] for i, t in enumerate(times)],
        }
        for rank, times in own.items()
    }


FAST, SLOW = 0.020, 0.060  # seconds of a rank's optimizer step


def test_a_rank_slow_for_the_set_number_of_steps_is_named_with_its_host_once():
    named: set[int] = set()
    four = _ranks({0: [FAST] * 4, 1: [SLOW] * 4, 2: [FAST] * 4, 3: [FAST] * 4})
    assert find_stragglers(four, margin=1.3, steps=5, named=named) == []  # four slow steps: not yet
    five = _ranks({0: [FAST] * 5, 1: [SLOW] * 5, 2: [FAST] * 5, 3: [FAST] * 5})
    (found,) = find_stragglers(five, margin=1.3, steps=5, named=named)
    assert (found.rank, found.host, found.first_step, found.last_step) == (1, "10.0.0.12", 1, 5)
    assert found.ratio == pytest.approx(3.0)
    assert found.line() == (
        "straggler: rank 1 on host 10.0.0.12 (ip-10-0-0-12) took 3.0x the median of ranks for its own work in steps "
        "1-5 (optimizer step 60.0 ms against 20.0 ms)"
    )
    # Still slow: not named again; fast again, then slow for five more steps: a new stretch, named again.
    assert find_stragglers(_ranks({0: [FAST] * 6, 1: [SLOW] * 6}), margin=1.3, steps=5, named=named) == []
    back = _ranks({0: [FAST] * 7, 1: [SLOW] * 6 + [FAST]})
    assert find_stragglers(back, margin=1.3, steps=5, named=named) == [] and named == set()
    again = _ranks({0: [FAST] * 12, 1: [SLOW] * 6 + [FAST] + [SLOW] * 5})
    assert [s.first_step for s in find_stragglers(again, margin=1.3, steps=5, named=named)] == [8]


def test_a_rank_is_not_named_within_the_margin_under_the_noise_floor_or_across_a_gap():
    named: set[int] = set()
    within = _ranks({0: [FAST] * 5, 1: [FAST * 1.25] * 5, 2: [FAST] * 5})
    assert find_stragglers(within, margin=1.3, steps=5, named=named) == []
    tiny = 0.0005  # LoRA's optimizer step on a few adapters: 3x slower is still under MIN_GAP_S
    assert 3 * tiny - tiny < MIN_GAP_S
    assert (
        find_stragglers(_ranks({0: [tiny] * 5, 1: [3 * tiny] * 5, 2: [tiny] * 5}), margin=1.3, steps=5, named=named)
        == []
    )
    # A restart between step 3 and step 10: the five newest steps all ranks have are not in a row.
    gap = _ranks({0: [FAST] * 3, 1: [SLOW] * 3})
    later = _ranks({0: [FAST] * 2, 1: [SLOW] * 2}, first_step=10)
    for rank in gap:
        gap[rank]["beats"] += later[rank]["beats"]
    assert find_stragglers(gap, margin=1.3, steps=5, named=named) == []


def test_steps_missing_on_a_rank_are_left_out_and_each_step_is_written_once(tmp_path):
    ranks = _ranks({0: [FAST] * 6, 1: [SLOW] * 4})
    path = tmp_path / "rank_steps.jsonl"
    assert append_rank_steps(path, ranks, 0) == 4
    assert append_rank_steps(path, ranks, 4) == 4  # nothing new
    more = _ranks({0: [FAST] * 6, 1: [SLOW] * 6})
    assert append_rank_steps(path, more, 4) == 6
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[0]["own_s"] == [FAST, SLOW]


def test_the_clock_times_a_real_optimizer_step():
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    clock = StepClock(optimizer, torch.device("cpu"))
    assert clock.take() is None
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    first = clock.take()
    assert first is not None and 0 < first < 1.0
    assert clock.take() == first  # the newest until the next step


def test_the_report_shows_each_ranks_own_time_the_stragglers_and_the_watchdogs_finding(tmp_path):
    from raytrain_eks.report.html import write_report

    run = tmp_path / "run"
    (run / "watchdog").mkdir(parents=True)
    straggler = {"rank": 1, "host": "10.0.0.12", "first_step": 1, "last_step": 5, "ratio": 3.0}
    records = [{"step": s, "loss": 2.0, "step_time_s": 0.5} for s in range(1, 7)]
    records[4]["stragglers"] = [straggler]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "rank_steps.jsonl").write_text(
        "".join(json.dumps({"step": s, "own_s": [FAST, SLOW]}) + "\n" for s in range(1, 7))
    )
    message = "watchdog: rank 1 on host 10.0.0.12 stopped after step 6: its process is stopped (state T)"
    (run / "watchdog" / "findings.json").write_text(json.dumps({"rank": 1, "message": message}))
    page = write_report([run], tmp_path / "report").read_text()
    assert "straggler rank 1 on 10.0.0.12, steps 1-5, 3.0x the median" in page
    assert message in page
    assert 'alt="Own work per rank (optimizer step)" src="data:image/png;base64,' in page
    assert (tmp_path / "report" / "plots" / "rank_steps.png").stat().st_size > 1000
