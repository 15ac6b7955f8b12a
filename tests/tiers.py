"""The suite's tiers, each named by what its tests start, and a watch that holds every test to its tier.

A test's tier comes from the fixtures it uses (:data:`TIER_OF_FIXTURE`), never from a hand-written mark: a test
that uses ``ray_local`` or ``starts_ray`` starts Ray and is ``integration``; ``starts_process_group`` (torchrun, or
processes spawned for a torch.distributed group), ``distributed``; ``two_hosts``, ``twohost``; ``browser``,
``browser``. Others name what makes a test slow without starting any of those (``moto_url``: ``cloud``; ``real_tools``,
``pip_reads``: ``tools``; ``builds_models``, ``fake_group``: ``models``; ``starts_programs``: ``programs``). A test
with none of them is ``fast``. While the suite runs, :class:`ProcessWatch` looks at the processes
each test starts (Ray's raylet and GCS server, torchrun, spawned Python processes, Chromium),
and a test that starts one its fixtures do not declare fails, naming the process and the fixture it needs, so the
fast tier cannot quietly grow a test that starts Ray.

Example::

    python -m pytest                      # the fast tier: no Ray, no torchrun, no browser, no two-host world
    python -m pytest --tier all           # every tier (the README's test command)
    python -m pytest --tier integration   # one tier
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field

import procs

TIERS = ("fast", "models", "programs", "cloud", "tools", "integration", "distributed", "twohost", "browser")

TIER_OF_FIXTURE = {
    "builds_models": "models",  # builds many real model classes, or sizes a full-size model under FSDP's tracker
    "fake_group": "models",
    "starts_programs": "programs",  # the suite itself or a benchmark script, in a process of their own
    "moto_url": "cloud",  # AWS through boto3 against moto's server, and the fake EKS world on top of it
    "real_tools": "tools",  # real helm and kubectl
    "pip_reads": "tools",  # real pip against a local package index
    "ray_local": "integration",  # a module's shared embedded Ray
    "starts_ray": "integration",  # the code under test starts a Ray of its own (a local run, the CLI)
    "starts_process_group": "distributed",  # torchrun, or processes spawned for a torch.distributed group
    "two_hosts": "twohost",
    "network_namespaces": "twohost",  # the two hosts' namespaces alone
    "browser": "browser",
}

# What each tier may start: the kinds of process :class:`ProcessWatch` tells apart. The two-host world's hosts run
# Ray (started by `ray start` inside each network namespace).
ALLOWED_KINDS = {
    "fast": frozenset(),
    "models": frozenset(),
    "programs": frozenset(),
    "cloud": frozenset(),
    "tools": frozenset(),
    "integration": frozenset({"Ray"}),
    "distributed": frozenset({"torchrun", "spawned processes"}),
    "twohost": frozenset({"Ray"}),
    "browser": frozenset({"a browser"}),
}

# Ray's raylet and GCS server run for as long as its session; torchrun's launcher for as long as its job; Chromium
# and its driver for as long as the test's browser.
_KINDS = (
    ("Ray", re.compile(r"(^|/)(raylet|gcs_server)( |$)")),
    ("torchrun", re.compile(r"(^|/)torchrun( |$)|torch\.distributed\.run( |$)")),
    # multiprocessing's spawn start method (torch.multiprocessing.spawn and start_processes use it)
    ("spawned processes", re.compile(r"from multiprocessing\.spawn import spawn_main")),
    ("a browser", re.compile(r"(^|/)(chromium|chromium-browser|chromedriver|chrome)( |$)")),
)

FIXTURE_FOR_KIND = {
    "Ray": "starts_ray (or ray_local)",
    "torchrun": "starts_process_group",
    "spawned processes": "starts_process_group",
    "a browser": "browser",
}


def tiers_of(fixturenames: list[str]) -> set[str]:
    """The tiers a test is in, from the fixtures it uses (those it requests, their own, and ``usefixtures``)."""
    found = {TIER_OF_FIXTURE[name] for name in fixturenames if name in TIER_OF_FIXTURE}
    return found or {"fast"}


def selected(option: str) -> set[str]:
    """``--tier`` as a set of tiers: ``all``, or names separated by commas."""
    names = {part.strip() for part in option.split(",") if part.strip()}
    if "all" in names:
        return set(TIERS)
    unknown = names - set(TIERS)
    if unknown:
        raise ValueError(f"--tier {option!r}: unknown tier(s) {sorted(unknown)}; the tiers: all, {', '.join(TIERS)}")
    return names


def kind_of(cmdline: str) -> str | None:
    """The kind of process a command line is (Ray's and the browser's by their program, torchrun also as ``python
    -m torch.distributed.run`` or ``python .../torchrun``), or ``None``."""
    program = cmdline.split(" ", 1)[0]
    for kind, pattern in _KINDS:
        if pattern.search(program if kind in ("Ray", "a browser") else cmdline):
            return kind
    return None


@dataclass
class ProcessWatch:
    """A thread that, every ``every_s``, looks at the processes started since it last looked and records, for each
    one of a kind :func:`kind_of` knows, the test it was started during (the test mark in its environment)."""

    mark_name: str
    every_s: float = 0.25
    seen: dict[str, dict[str, str]] = field(default_factory=dict)  # test id -> {kind: "pid N: command"}
    _known: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._known = {int(e) for e in os.listdir("/proc") if e.isdigit()}
        threading.Thread(target=self._run, name="tier-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.look()

    def look(self) -> None:
        """One look now (also called when a test ends, so what is still running then is never missed)."""
        with self._lock:
            now = {int(e) for e in os.listdir("/proc") if e.isdigit()}
            for pid in now - self._known:
                p = procs.read(pid)
                kind = kind_of(p.cmdline) if p is not None else None
                if kind is None:
                    continue
                test = procs.environ_value(pid, self.mark_name)
                if test:
                    self.seen.setdefault(test, {}).setdefault(kind, f"pid {pid}: {p.cmdline[:160]}")
            self._known = now

    def started_during(self, test: str) -> dict[str, str]:
        self.look()
        with self._lock:
            return dict(self.seen.get(test, {}))


def out_of_tier(started: dict[str, str], tiers: set[str]) -> str | None:
    """The message for a test that started what its tiers do not allow, or ``None``."""
    allowed = frozenset().union(*(ALLOWED_KINDS[t] for t in tiers))
    extra = {kind: what for kind, what in started.items() if kind not in allowed}
    if not extra:
        return None
    lines = [f"  {kind} ({what}): use the fixture {FIXTURE_FOR_KIND[kind]}" for kind, what in sorted(extra.items())]
    return (
        f"this test is in the {'/'.join(sorted(tiers))} tier but started "
        + ", ".join(sorted(extra))
        + " (the tier comes from the fixtures a test uses; tests/tiers.py):\n"
        + "\n".join(lines)
    )


def wait_gone(test: str, watch: ProcessWatch, kind: str, grace_s: float = 30.0) -> list[str]:
    """The processes of ``kind`` started during ``test`` still running after ``grace_s`` (none, normally)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [
            f"pid {p.pid}: {p.cmdline[:160]}"
            for p in procs.processes()
            if kind_of(p.cmdline) == kind and procs.environ_value(p.pid, watch.mark_name) == test
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
