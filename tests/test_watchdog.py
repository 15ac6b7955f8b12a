"""The run's watchdog (train/watchdog.py), hermetic: when it calls a run stalled (recorded beats against the median
step time and the floor), which rank it names and why (process state, stacks in or out of a collective, last
step), the collective read from py-spy's frames, the board's record of each rank, the beat's cost and sends, the
files it leaves; and py-spy itself on a real stopped process (py-spy is a dependency of the package). The whole
path (a SIGSTOPped worker in a real two-node run) is tests/test_two_host.py's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from raytrain_eks.config import load_config
from raytrain_eks.errors import ConfigError
from raytrain_eks.presets import local_tiny
from raytrain_eks.train import watchdog
from raytrain_eks.train.watchdog import (
    BeatBoard,
    RankLook,
    Stall,
    diagnose,
    inspect_ranks,
    look_from_dump,
    median_step_s,
    stalled,
    waiting_in,
    write_findings,
)

T0 = 1_800_000_000.0


def _ranks(steps: dict[int, int], step_s: float = 0.5, late: dict[int, float] | None = None) -> dict[int, dict]:
    """Two hosts' ranks that each beat steps 1..N every ``step_s`` seconds from T0 (``late``: seconds added to a
    rank's beats)."""
    late = late or {}
    return {
        rank: {
            "rank": rank,
            "node_id": f"node{rank}",
            "host": f"10.0.0.{11 + rank}",
            "hostname": f"ip-10-0-0-{11 + rank}",
            "pid": 100 + rank,
            "gpu": None,
            "beats": [[s, T0 + s * step_s + late.get(rank, 0.0)] for s in range(1, n + 1)],
        }
        for rank, n in steps.items()
    }


def test_a_run_is_stalled_only_when_no_rank_advanced_for_its_threshold():
    ranks = _ranks({0: 20, 1: 20})  # steps of 0.5 s: the threshold is max(10 x 0.5, 8) = 8 s after the last beat
    last = T0 + 20 * 0.5
    assert median_step_s(ranks) == pytest.approx(0.5)
    common = dict(world_size=2, last_step=100, factor=10, floor_s=8)
    assert stalled(ranks, now=last + 7.9, **common) is None
    stall = stalled(ranks, now=last + 8.1, **common)
    assert stall is not None and stall.threshold_s == 8 and stall.quiet_s == pytest.approx(8.1)
    # Slow steps: k x the median decides, not the floor.
    slow = _ranks({0: 20, 1: 20}, step_s=2.0)
    assert stalled(slow, now=T0 + 40 + 15, **common) is None
    assert stalled(slow, now=T0 + 40 + 21, **common).threshold_s == pytest.approx(20)
    # One rank still beating keeps the run going: the newest beat counts.
    assert stalled(_ranks({0: 20, 1: 40}), now=last + 9, **common) is None


def test_the_watch_starts_once_every_rank_stepped_and_ends_with_the_last_step():
    common = dict(world_size=2, factor=10, floor_s=1)
    assert stalled(_ranks({0: 5}), last_step=100, now=T0 + 999, **common) is None  # rank 1 never beat
    assert stalled(_ranks({0: 5, 1: 0}), last_step=100, now=T0 + 999, **common) is None
    # Both ranks did the last step: what follows (samples, the last checkpoint) is not watched.
    assert stalled(_ranks({0: 5, 1: 5}), last_step=5, now=T0 + 999, **common) is None
    assert stalled(_ranks({0: 5, 1: 4}), last_step=5, now=T0 + 999, **common) is not None


def test_step_times_skip_a_restart():
    ranks = _ranks({0: 3})
    ranks[0]["beats"] += [[2, T0 + 500.0], [3, T0 + 500.5]]  # back from a checkpoint after a long restart
    assert median_step_s(ranks) == pytest.approx(0.5)


STALL = Stall(quiet_s=12.0, threshold_s=8.0, median_step_s=0.5)
C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
LOOP = "/venv/lib/python3.11/site-packages/raytrain_eks/train/loop.py"


def _threads(*frames: tuple[str, str, int]) -> list[dict]:
    """py-spy --json's threads: one training thread with ``frames`` (innermost first), and an idle other."""
    training = {"os_thread_id": 7, "active": False, "thread_name": None, "frames": []}
    training["frames"] = [{"name": n, "filename": f, "line": line} for n, f, line in frames]
    other = {"os_thread_id": 8, "active": False, "frames": [{"name": "wait", "filename": "threading.py", "line": 1}]}
    return [other, training]


IN_ALL_REDUCE = _threads(("all_reduce", C10D, 2950), ("wrapper", "c10d_logger.py", 81), ("train_step", LOOP, 348))
COMPUTING = _threads(("forward", "/venv/.../modeling_llama.py", 300), ("train_step", LOOP, 357))


def test_the_rank_that_is_stopped_is_named_with_its_host_and_the_collective_the_other_waits_in():
    ranks = _ranks({0: 20, 1: 20})
    looks = {0: look_from_dump("S", IN_ALL_REDUCE), 1: look_from_dump("T", IN_ALL_REDUCE)}
    finding = diagnose(ranks, looks, STALL)
    assert (finding.rank, finding.host, finding.step) == (1, "10.0.0.12", 20)
    assert finding.collective == "all_reduce called from train_step (loop.py:348)"
    assert finding.message.startswith("watchdog: rank 1 on host 10.0.0.12 (ip-10-0-0-12) stopped after step 20")
    assert "its process is stopped (state T)" in finding.message
    assert "the other ranks wait in all_reduce called from train_step (loop.py:348)" in finding.message
    assert "no rank advanced for 12 s (threshold 8 s; median step 0.50 s)" in finding.message


def test_a_running_rank_outside_any_collective_is_named_when_the_others_wait():
    ranks = _ranks({0: 20, 1: 20, 2: 20})
    looks = {
        0: look_from_dump("S", IN_ALL_REDUCE),
        1: look_from_dump("R", COMPUTING),
        2: look_from_dump("S", IN_ALL_REDUCE),
    }
    finding = diagnose(ranks, looks, STALL)
    assert finding.rank == 1 and "not inside a collective while the other ranks are" in finding.reason
    assert [r["state"] for r in finding.ranks] == ["S", "R", "S"]


def test_without_other_evidence_the_rank_behind_is_named_and_else_none():
    ranks = _ranks({0: 20, 1: 19})
    looks = {r: RankLook("S") for r in ranks}  # no stacks (py-spy could not read them)
    finding = diagnose(ranks, looks, STALL)
    assert finding.rank == 1 and "its last step (19) is behind the others'" in finding.reason
    even = diagnose(
        _ranks({0: 20, 1: 20}), {0: look_from_dump("S", IN_ALL_REDUCE), 1: look_from_dump("S", IN_ALL_REDUCE)}, STALL
    )
    assert even.rank is None and even.message.startswith("watchdog: the run hangs, no rank advanced for 12 s")


def test_the_collective_is_read_from_torch_distributed_frames_only():
    assert waiting_in(IN_ALL_REDUCE[1]["frames"]) == "all_reduce called from train_step (loop.py:348)"
    assert waiting_in(COMPUTING[1]["frames"]) is None
    # A function of the same name elsewhere is not a collective: a model's own "reduce".
    assert waiting_in([{"name": "reduce", "filename": "/x/functools.py", "line": 1}]) is None
    fsdp = "/v/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"
    # HSDP's all-reduce of the gradients, inside FSDP's reduction in the backward pass (as py-spy showed it).
    frames = [
        {"name": "all_reduce", "filename": C10D, "line": 3252},
        {"name": "wrapper", "filename": "/v/torch/distributed/c10d_logger.py", "line": 83},
        {"name": "foreach_reduce", "filename": fsdp, "line": 658},
        {"name": "backward", "filename": "/v/torch/autograd/__init__.py", "line": 395},
        {"name": "train_step", "filename": LOOP, "line": 363},
    ]
    assert waiting_in(frames) == "all_reduce via foreach_reduce called from train_step (loop.py:363)"


def test_the_board_keeps_each_ranks_recent_beats_and_starts_afresh_for_a_new_process():
    board = BeatBoard()
    who = {"node_id": "n", "host": "10.0.0.11", "hostname": "h", "pid": 1, "gpu": None}
    board.beat(0, who, [(s, T0 + s) for s in range(1, watchdog.KEEP + 11)])
    beats = board.snapshot()[0]["beats"]
    assert len(beats) == watchdog.KEEP and beats[0] == [11, T0 + 11]
    board.beat(0, {**who, "pid": 2}, [(5, T0 + 900)])  # a restarted worker group: back from a checkpoint
    assert board.snapshot()[0]["beats"] == [[5, T0 + 900]] and board.snapshot()[0]["pid"] == 2


class _Board:
    """Stands for the board's actor handle: ``beat.remote(...)`` is all a rank calls (Ray's fire-and-forget)."""

    def __init__(self) -> None:
        self.sent: list[list[tuple[int, float]]] = []
        self.beat = self
        self.remote = lambda rank, who, beats: self.sent.append(list(beats))


def test_a_rank_sends_its_beats_at_most_once_a_second_and_a_beat_costs_microseconds():
    board = _Board()
    beat = watchdog._Beats(board, 0, {"pid": 1})
    t = time.perf_counter()
    for step in range(1, 10_001):
        beat(step)
    per_beat = (time.perf_counter() - t) / 10_000
    # The first step is sent at once; then whatever a second gathered goes in one call.
    assert board.sent[0] == [(1, pytest.approx(time.time(), abs=5), None)]
    assert len(board.sent) <= 1 + (time.perf_counter() - t) / watchdog.SEND_S + 1
    assert per_beat < 1e-4, f"{per_beat * 1e6:.1f} us a beat"


def test_the_beat_is_a_no_op_when_no_driver_watches(monkeypatch):
    monkeypatch.delenv(watchdog.ENV, raising=False)
    assert watchdog.heartbeat(0) is watchdog._no_beat


def test_findings_and_every_ranks_stack_are_written(tmp_path):
    ranks = _ranks({0: 20, 1: 20})
    looks = {0: look_from_dump("S", IN_ALL_REDUCE), 1: look_from_dump("T", COMPUTING)}
    finding = diagnose(ranks, looks, STALL)
    write_findings(tmp_path, finding, looks, {1: b"fr-dump"})
    saved = json.loads((tmp_path / "findings.json").read_text())
    assert saved["rank"] == 1 and saved["host"] == "10.0.0.12" and saved["message"] == finding.message
    assert "process state T" in (tmp_path / "rank1.txt").read_text()
    assert "all_reduce (" + C10D in (tmp_path / "rank0.txt").read_text()
    assert (tmp_path / "nccl_trace_rank1.pkl").read_bytes() == b"fr-dump"


_SLEEPER = "import time\ndef nap():\n    print('up', flush=True)\n    while True: time.sleep(0.05)\nnap()\n"


def test_py_spy_reads_the_stack_of_a_stopped_process_and_proc_its_state():
    proc = subprocess.Popen([sys.executable, "-c", _SLEEPER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        seen = inspect_ranks({3: proc.pid, 4: 2**22 + 7}, nccl=None)  # the second pid does not exist
        assert seen[4]["state"] == "gone"
        assert seen[3]["state"] == "T" and seen[3]["error"] is None, seen[3]
        look = look_from_dump(seen[3]["state"], seen[3]["threads"])
        assert "    nap (<string>:" in look.stack and look.collective is None
    finally:
        proc.kill()
        proc.wait()


def test_watchdog_settings_are_checked_with_the_field_named():
    with pytest.raises(ConfigError) as caught:
        load_config(preset=local_tiny(), environ={}, sets=["training.watchdog_factor=1", "training.watchdog_floor_s=0"])
    text = str(caught.value)
    assert "training.watchdog_factor = 1" in text and "greater than 1" in text, text
    assert "training.watchdog_floor_s = 0" in text, text


def test_the_workers_are_told_the_board_and_gpu_workers_keep_the_nccl_flight_recorder(monkeypatch):
    from raytrain_eks.train.worker_env import worker_environment

    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    cfg = load_config(preset=local_tiny(), environ={})
    gpu = worker_environment(cfg, "run", use_gpu=True, watchdog="raytrain-eks-watchdog-run-1")
    assert gpu[watchdog.ENV] == "raytrain-eks-watchdog-run-1"
    assert gpu["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    # Straight in /tmp: torch makes the pipe with mkfifo, in a folder that must exist.
    assert gpu["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == "/tmp/raytrain-eks-watchdog-run-1-nccl-pipe-rank"
    assert gpu["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/tmp/raytrain-eks-watchdog-run-1-nccl-trace-rank"
    cpu = worker_environment(cfg, "run", use_gpu=False, watchdog="raytrain-eks-watchdog-run-1")
    assert cpu[watchdog.ENV] and not any(name.startswith("TORCH_NCCL") for name in cpu)
    assert watchdog.ENV not in worker_environment(cfg, "run", use_gpu=True)  # training.watchdog off
