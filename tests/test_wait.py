"""The one polling helper every deploy wait uses: returns the first ready value, says each change of state once
with the time waited and the deadline, and fails at the deadline with the caller's error or a plain one."""

from __future__ import annotations

import pytest

from raytrain_eks.errors import UserError
from raytrain_eks.k8s.wait import poll


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def states(*values):
    it = iter(values)
    return lambda: next(it)


def test_returns_the_first_ready_value_and_says_each_change_once():
    clock, said = Clock(), []
    probe = states((None, "0/2 running"), (None, "0/2 running"), (None, "1/2 running"), ("pods", "2/2 running"))
    got = poll(probe, what="Ray pods", timeout=100, clock=clock, sleep=clock.sleep, say=said.append, interval=10)
    assert got == "pods"
    assert said == [
        "Waiting for Ray pods: 0/2 running (0 s of 100 s)",
        "Waiting for Ray pods: 1/2 running (20 s of 100 s)",
    ]
    assert clock.slept == [10, 10, 10]


def test_ready_at_once_says_nothing_and_does_not_sleep():
    clock, said = Clock(), []
    assert poll(lambda: (0, "ready"), what="x", timeout=5, clock=clock, sleep=clock.sleep, say=said.append) == 0
    assert said == [] and clock.slept == []


def test_deadline_raises_the_callers_error_with_the_last_state_and_time_waited():
    clock = Clock()

    class Late(UserError):
        pass

    with pytest.raises(Late, match=r"CREATING after 30 s"):
        poll(
            lambda: (None, "CREATING"),
            what="cluster",
            timeout=30,
            clock=clock,
            sleep=clock.sleep,
            say=lambda _: None,
            interval=10,
            on_timeout=lambda last, waited: Late(f"{last} after {waited:.0f} s"),
        )
    assert clock.now == 30


def test_default_timeout_error_names_what_was_awaited_and_never_sleeps_past_the_deadline():
    clock = Clock()
    with pytest.raises(UserError) as exc:
        poll(
            lambda: (None, "1/2 running"),
            what="Ray pods",
            timeout=25,
            clock=clock,
            sleep=clock.sleep,
            say=lambda _: None,
            interval=10,
        )
    assert "Ray pods: still 1/2 running after 25 s" in exc.value.message
    assert clock.slept == [10, 10, 5]
