"""Interruption notices: the watch against a stand-in of the instance metadata service on the loopback (IMDSv2's
token handshake, the documented notice shapes), SIGTERM as a notice, the ranks' agreement, the summary's line, and
the global batch kept when a run resumes on another number of workers. No request goes to the link-local address.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from metadata_standin import ACTION, REBALANCE, MetadataStandIn

from raytrain_eks.train.preemption import (
    DEFAULT_ENDPOINT,
    Notice,
    NoticeWatch,
    StepAgreement,
    keep_global_batch,
    metadata_endpoint,
    preempted_line,
    running_on_ec2,
)

NOTICE = {"action": "terminate", "time": "2026-12-07T22:40:00Z"}


def wait_for(watch: NoticeWatch, seconds: float = 3.0) -> Notice | None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if watch.current() is not None:
            return watch.current()
        time.sleep(0.01)
    return None


def test_watch_sees_the_spot_notice_through_imdsv2():
    with MetadataStandIn() as imds:
        watch = NoticeWatch.start(0.02, endpoint=imds.url, sigterm=False)
        assert watch is not None and watch.polls_metadata
        try:
            time.sleep(0.1)
            assert watch.current() is None  # 404: no notice yet
            imds.action = NOTICE
            notice = wait_for(watch)
        finally:
            watch.close()
    assert notice is not None
    assert (notice.kind, notice.action, notice.deadline) == ("interruption", "terminate", NOTICE["time"])
    assert notice.stops
    assert "spot interruption notice (terminate at 2026-12-07T22:40:00Z)" in notice.reason()
    # the token first, then every GET with it: none refused
    assert imds.requests[0][:2] == ("PUT", "/latest/api/token")
    assert all(status != 401 for method, _, status in imds.requests if method == "GET")
    assert imds.count(REBALANCE) >= 1


def test_an_expired_token_is_renewed():
    with MetadataStandIn() as imds:
        watch = NoticeWatch.start(0.02, endpoint=imds.url, sigterm=False)
        assert watch is not None
        try:
            imds.expire_next = True
            imds.action = NOTICE
            assert wait_for(watch) is not None
        finally:
            watch.close()
    assert [m for m, _, _ in imds.requests].count("PUT") >= 2  # asked again after the 401


def test_no_watch_where_nothing_answers():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    assert NoticeWatch.start(0.02, endpoint=f"http://127.0.0.1:{port}", sigterm=False) is None
    assert time.monotonic() - started < 2.0  # the probe's short timeout, not a hang at the run's start


def test_endpoint_comes_from_the_sdk_variable_and_the_link_local_only_on_ec2(tmp_path: Path):
    assert metadata_endpoint({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://10.0.0.5:1338/"}) == "http://10.0.0.5:1338"
    assert metadata_endpoint({}, on_ec2=False) is None
    assert metadata_endpoint({}, on_ec2=True) == DEFAULT_ENDPOINT
    off = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:1"}
    assert metadata_endpoint(off, on_ec2=True) is None
    dmi = tmp_path / "devices/virtual/dmi/id"
    dmi.mkdir(parents=True)
    (dmi / "sys_vendor").write_text("QEMU\n")
    assert not running_on_ec2(tmp_path)
    (dmi / "sys_vendor").write_text("Amazon EC2\n")
    assert running_on_ec2(tmp_path)


def test_sigterm_becomes_a_notice_and_the_process_goes_on():
    before = signal.getsignal(signal.SIGTERM)
    watch = NoticeWatch(None, poll_s=1.0)
    try:
        assert watch.install_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)
        notice = wait_for(watch)
    finally:
        watch.close()
    assert signal.getsignal(signal.SIGTERM) is before  # put back once the run is over
    assert notice is not None and notice.kind == "sigterm" and notice.stops
    assert "SIGTERM" in notice.reason()


def test_sigterm_handler_is_not_installed_off_the_main_thread():
    """As in a Ray Train worker, whose loop runs on a thread of its own: no handler, and no error."""
    installed: list[bool] = []
    thread = threading.Thread(target=lambda: installed.append(NoticeWatch(None, 1.0).install_sigterm()))
    thread.start()
    thread.join()
    assert installed == [False]


def test_one_rank_stops_after_the_step_that_saw_the_notice():
    watch = NoticeWatch(None, poll_s=1.0)
    agree = StepAgreement(watch, world_size=1, on_rebalance="checkpoint")
    assert agree(1) is None
    watch.record(Notice("interruption", time.time(), action="terminate", deadline=NOTICE["time"]))
    decision = agree(2)
    assert decision is not None and decision.stop and decision.step == 2


@pytest.mark.parametrize(("setting", "checkpoints"), [("checkpoint", [2]), ("ignore", [])])
def test_a_rebalance_recommendation_checkpoints_once_or_is_ignored(setting: str, checkpoints: list[int]):
    watch = NoticeWatch(None, poll_s=1.0)
    agree = StepAgreement(watch, world_size=1, on_rebalance=setting)
    saved = []
    for step in range(1, 6):
        if step == 2:
            watch.record(Notice("rebalance", time.time(), deadline="2026-12-07T22:30:00Z"))
            watch.record(Notice("rebalance", time.time(), deadline="2026-12-07T22:30:00Z"))  # polled again: same
        decision = agree(step)
        if decision is not None:
            assert not decision.stop
            saved.append(step)
    assert saved == checkpoints


def test_a_notice_served_to_the_watch_reaches_the_agreement():
    with MetadataStandIn() as imds:
        imds.rebalance = {"noticeTime": "2026-12-07T22:30:00Z"}
        watch = NoticeWatch.start(0.02, endpoint=imds.url, sigterm=False)
        agree = StepAgreement(watch, world_size=1, on_rebalance="checkpoint")
        try:
            first = agree(1)  # the first poll is done before start() returns
            imds.action = NOTICE
            assert wait_for_stop(watch)
            second = agree(2)
        finally:
            agree.close()
    assert first is not None and not first.stop and "rebalance recommendation" in first.notice.reason()
    assert second is not None and second.stop


def wait_for_stop(watch: NoticeWatch) -> bool:
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        notice = watch.current()
        if notice is not None and notice.stops:
            return True
        time.sleep(0.01)
    return False


def test_the_line_says_how_the_save_compares_with_the_deadline():
    summary = {
        "checkpoint_done_s": [0.4, 2.5],
        "preempted": {"step": 7, "reason": "spot interruption notice (terminate at T)", "seconds_left": 95.2},
    }
    assert preempted_line(summary) == (
        "preempted after step 7: spot interruption notice (terminate at T); checkpoint 7 written in 2.5 s, "
        "95 s before the notice's deadline"
    )
    summary["preempted"]["seconds_left"] = -3.0
    assert "3 s AFTER the notice's deadline" in preempted_line(summary)
    assert Notice("interruption", 0.0, deadline="2026-12-07T22:40:00Z").seconds_left(now=1796683170.0) == 30.0


@pytest.mark.parametrize(
    ("micro", "accum", "saved", "world", "expected", "says"),
    [
        (4, 1, 2, 1, 2, "grad_accum_steps 1 -> 2 keeps the global batch of 8 samples"),
        (4, 2, 1, 2, 1, "grad_accum_steps 2 -> 1 keeps the global batch of 8 samples"),
        (4, 1, 2, 2, 1, None),
        (4, 1, 2, 3, 1, "not a multiple of 3 x batch_size 4, so it becomes 12 samples per step"),
        ("auto", 1, 2, 1, 1, "batch_size auto is decided on the workers"),
        (4, 1, None, 1, 1, None),
    ],
)
def test_the_global_batch_is_kept_on_another_number_of_workers(micro, accum, saved, world, expected, says):
    got, line = keep_global_batch(micro, accum, saved_world=saved, world=world)
    assert got == expected
    if says is None:
        assert line is None
    else:
        assert line is not None and says in line, line


def test_the_stand_in_serves_the_notice_only_from_the_nth_look():
    """What the run test relies on: the first looks find nothing, the later ones the notice."""
    with MetadataStandIn(notice_after=2) as imds:
        imds.action = NOTICE
        watch = NoticeWatch.start(0.02, endpoint=imds.url, sigterm=False)
        assert watch is not None
        try:
            assert watch.current() is None  # the first look, made before start() returned
            assert wait_for(watch) is not None
        finally:
            watch.close()
    assert imds.count(ACTION) >= 2


def test_the_runs_stop_time_is_a_notice_that_stops_it_once_reached():
    from datetime import UTC, datetime, timedelta

    from raytrain_eks.config import TrainingConfig

    soon = datetime.now(UTC) + timedelta(seconds=0.3)
    watch = NoticeWatch.start(0.02, sigterm=False, stop_at=soon)  # no metadata service: the stop time alone
    assert watch is not None and not watch.polls_metadata
    try:
        assert watch.current() is None  # not yet
        notice = wait_for(watch)
        assert notice is not None and notice.kind == "deadline" and notice.stops
        assert notice.deadline == soon.isoformat() and "training.stop_at" in notice.reason()
    finally:
        watch.close()
    # A time written without a zone is UTC.
    naive = TrainingConfig(stop_at="2026-12-08T10:00:00").stop_at
    assert naive == datetime(2026, 12, 8, 10, tzinfo=UTC)
