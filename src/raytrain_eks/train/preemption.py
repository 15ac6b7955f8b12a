"""Interruption notices: a node about to go becomes a checkpoint, and the run ends ``preempted`` instead of failing.

Each worker watches its own node (:class:`NoticeWatch`): a daemon thread polls the EC2 instance metadata service
every ``training.notice_poll_s`` seconds (AWS recommends every 5 s) for

- the spot interruption notice, ``GET /latest/meta-data/spot/instance-action``: 404 while there is none, then
  ``{"action": "terminate" | "stop" | "hibernate", "time": "2026-12-07T22:40:00Z"}``, about two minutes before the
  ``time`` it names (AWS EC2 user guide, "Spot Instance interruption notices",
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html);
- the rebalance recommendation, ``GET /latest/meta-data/events/recommendations/rebalance``: 404, then
  ``{"noticeTime": "..."}`` (same guide, "EC2 instance rebalance recommendations"),

with IMDSv2's session token: ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``, then every
``GET`` with ``X-aws-ec2-metadata-token`` (same guide, "Use the Instance Metadata Service to access instance metadata /
Use IMDSv2"). The service is the one ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` names, as AWS's SDKs read it, else the
link-local address; the watch starts only where the token request answers within :data:`PROBE_S` (off the cloud it
does not). A SIGTERM to the process (a node drain) is a notice too, where this process may install the handler.

The ranks agree at step boundaries (:class:`StepAgreement`): each rank's flag (0 nothing, 1 rebalance, 2 stop) goes
into an all-reduce (max) over a gloo group of its own, started after a step and read after the next, so no step waits
for it; every rank reads the same value after the same step and acts alike: 1 saves a checkpoint, 2 saves one and
ends the run (``summary["ended"] = "preempted"``).

Example::

    watch = NoticeWatch.start(poll_s=5.0)             # None off EC2 (and no endpoint given)
    agree = StepAgreement(watch, world_size=2, on_rebalance="checkpoint")
    decision = agree(step)                            # after each step: None, or what every rank does now
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup, Work

ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
DISABLED_ENV = "AWS_EC2_METADATA_DISABLED"
DEFAULT_ENDPOINT = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_S = 21600  # the longest AWS allows; refreshed well before
ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
PROBE_S = 0.5  # the metadata service answers a node's own request in milliseconds; off EC2 nothing answers
REQUEST_S = 2.0
PREEMPTED = "preempted"  # summary["ended"] of a run a notice ended
NOTHING, REBALANCE, STOP = 0, 1, 2
EXIT_CODE = 75  # the CLI's status for a preempted run: sysexits' EX_TEMPFAIL, "try again later" (--resume)


@dataclass(frozen=True)
class Notice:
    """What a rank was told: ``kind`` ``interruption`` (spot, ``action`` says what EC2 does), ``rebalance`` or
    ``sigterm``; ``deadline`` the time the notice names (``None``: not said); ``seen`` when this rank saw it."""

    kind: str
    seen: float
    action: str | None = None
    deadline: str | None = None

    @property
    def stops(self) -> bool:
        return self.kind != "rebalance"

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds from ``now`` to the notice's deadline (``None`` without one)."""
        if not self.deadline:
            return None
        try:
            at = datetime.fromisoformat(self.deadline.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
        return at - (time.time() if now is None else now)

    def reason(self) -> str:
        if self.kind == "interruption":
            return f"spot interruption notice ({self.action or 'terminate'} at {self.deadline or 'an unknown time'})"
        if self.kind == "rebalance":
            return f"rebalance recommendation ({self.deadline or 'no time given'})"
        if self.kind == "remote":  # the agreement's answer on a rank whose own node was told nothing
            return "another rank's node was told to stop"
        if self.kind == "deadline":
            return f"the run's stop time (training.stop_at {self.deadline}: a Capacity Block's drain time on EKS)"
        return "SIGTERM (the node is being drained)"

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "action": self.action, "deadline": self.deadline, "seen": self.seen}


def metadata_endpoint(environ: Mapping[str, str] | None = None, *, on_ec2: bool | None = None) -> str | None:
    """The metadata service's base URL: ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (as AWS's SDKs read it), else the
    link-local address where this machine is an EC2 instance (:func:`running_on_ec2`); ``None`` where there is none to
    ask, or where ``AWS_EC2_METADATA_DISABLED`` is ``true`` (botocore's switch, honoured alike)."""
    env = os.environ if environ is None else environ
    if env.get(DISABLED_ENV, "").strip().lower() == "true":
        return None
    if env.get(ENDPOINT_ENV):
        return env[ENDPOINT_ENV].rstrip("/")
    return DEFAULT_ENDPOINT if (running_on_ec2() if on_ec2 is None else on_ec2) else None


def running_on_ec2(sys_root: Path = Path("/sys")) -> bool:
    """Whether this machine says it is an EC2 instance, read from its firmware's identity (no request): the DMI
    vendor ``Amazon EC2`` of Nitro instances, or a Xen instance's hypervisor UUID starting ``ec2`` (AWS EC2 user
    guide, "Detect whether a host is an EC2 instance"). A container sees its node's."""
    for name in ("devices/virtual/dmi/id/sys_vendor", "devices/virtual/dmi/id/board_vendor"):
        with contextlib.suppress(OSError):
            if (sys_root / name).read_text().strip() == "Amazon EC2":
                return True
    with contextlib.suppress(OSError):
        return (sys_root / "hypervisor/uuid").read_text().strip().lower().startswith("ec2")
    return False


class MetadataClient:
    """IMDSv2 requests to ``endpoint``: a session token first, then GETs that carry it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._token: str | None = None
        self._token_at = 0.0

    def token(self, timeout: float = REQUEST_S) -> str:
        if self._token is None or time.monotonic() - self._token_at > TOKEN_TTL_S / 2:
            request = urllib.request.Request(
                self.endpoint + TOKEN_PATH,
                method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
            )
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                self._token, self._token_at = answer.read().decode().strip(), time.monotonic()
        return self._token

    def get_json(self, path: str) -> dict[str, str] | None:
        """The JSON at ``path``, or ``None`` on 404 (nothing announced). A 401 (the token expired) renews it once."""
        for attempt in (0, 1):
            request = urllib.request.Request(self.endpoint + path, headers={"X-aws-ec2-metadata-token": self.token()})
            try:
                with urllib.request.urlopen(request, timeout=REQUEST_S) as answer:
                    body = json.loads(answer.read().decode() or "{}")
                    return body if isinstance(body, dict) else None
            except urllib.error.HTTPError as error:
                if error.code == 404:
                    return None
                if error.code == 401 and attempt == 0:
                    self._token = None
                    continue
                raise
        return None


class NoticeWatch:
    """This process's notices: the metadata service's (polled on a daemon thread) and SIGTERM's. :meth:`current`
    returns the one to act on: a stopping notice before a rebalance recommendation."""

    def __init__(self, client: MetadataClient | None, poll_s: float, stop_at: datetime | None = None) -> None:
        self._client, self._poll_s, self._stop_at = client, poll_s, stop_at
        self._lock = threading.RLock()  # reentrant: the SIGTERM handler runs on the main thread, maybe inside current()
        self._stop: Notice | None = None
        self._rebalance: Notice | None = None
        self._rebalance_seen: set[str] = set()
        self.last_rebalance: Notice | None = None  # the recommendation last acted on
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.sigterm = False  # whether the SIGTERM handler is installed
        # the handler it replaced, put back by close()
        self._before: Callable[[int, FrameType | None], object] | int | None = None

    @classmethod
    def start(
        cls, poll_s: float, *, endpoint: str | None = None, sigterm: bool = True, stop_at: datetime | None = None
    ) -> NoticeWatch | None:
        """A started watch: the metadata thread where there is a service to ask (:func:`metadata_endpoint`) and it
        answers a token request within :data:`PROBE_S`, or a ``stop_at`` time to stop by (checked on the same
        thread), and the SIGTERM handler where this thread may install one (``sigterm``); ``None`` when none."""
        where = endpoint or metadata_endpoint()
        client = MetadataClient(where) if where else None
        try:
            if client is not None:
                client.token(timeout=PROBE_S)
        except (OSError, ValueError):  # nothing answers, or it refuses: no metadata watch here
            client = None
        watch = cls(client, poll_s, stop_at)
        if sigterm:
            watch.sigterm = watch.install_sigterm()
        if client is None and not watch.sigterm and stop_at is None:
            return None
        if client is not None or stop_at is not None:
            with contextlib.suppress(OSError, ValueError):  # a notice already out is seen before the first step
                watch.poll_once()
            watch._thread = threading.Thread(target=watch._run, name="interruption-notices", daemon=True)
            watch._thread.start()
        return watch

    @property
    def polls_metadata(self) -> bool:
        return self._client is not None

    def install_sigterm(self) -> bool:
        """Record SIGTERM as a notice instead of ending the process (the run ends itself once it has saved).
        Only the main thread may install a handler: Ray Train runs the loop on a thread of its own, and Ray's
        worker keeps its own handler there (it exits the process), so under Ray this returns ``False``."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._before = signal.signal(signal.SIGTERM, self._on_sigterm)
        return True

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.record(Notice("sigterm", seen=time.time()))

    def record(self, notice: Notice) -> None:
        """Keep ``notice``: the first stopping one wins; a rebalance recommendation counts once per notice time."""
        with self._lock:
            if notice.stops:
                self._stop = self._stop or notice
            elif notice.deadline not in self._rebalance_seen:
                self._rebalance_seen.add(notice.deadline or "")
                self._rebalance = notice

    def current(self) -> Notice | None:
        with self._lock:
            return self._stop or self._rebalance

    def acted(self) -> None:
        """The rebalance recommendation was acted on (a checkpoint): it is not acted on again."""
        with self._lock:
            self.last_rebalance, self._rebalance = self._rebalance or self.last_rebalance, None

    def poll_once(self) -> None:
        if self._stop_at is not None and time.time() >= self._stop_at.timestamp():
            self.record(Notice("deadline", time.time(), deadline=self._stop_at.isoformat()))
        if self._client is None:
            return
        action = self._client.get_json(ACTION_PATH)
        if action:
            self.record(Notice("interruption", time.time(), action=action.get("action"), deadline=action.get("time")))
        rebalance = self._client.get_json(REBALANCE_PATH)
        if rebalance:
            self.record(Notice("rebalance", time.time(), deadline=rebalance.get("noticeTime")))

    def _run(self) -> None:
        while not self._done.wait(self._poll_s):
            with contextlib.suppress(OSError, ValueError):  # a lost answer: the next poll asks again
                self.poll_once()

    def close(self) -> None:
        """Stop polling; the SIGTERM handler this watch replaced is back (the run is over, saved)."""
        self._done.set()
        if self._before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._before)
            self._before = None


@dataclass(frozen=True)
class Decision:
    """What every rank does after ``step``: save a checkpoint, and (``stop``) end the run, for ``notice``."""

    step: int
    stop: bool
    notice: Notice


class StepAgreement:
    """The ranks' agreement on a notice, one step late: after step N each rank starts an all-reduce (max) of its flag
    over a gloo group of its own and reads the one started after step N-1, which is long done, so no step waits.
    Every rank reads the same value after the same step. With one rank (or no watch) no collective is made."""

    def __init__(
        self, watch: NoticeWatch | None, *, world_size: int, on_rebalance: str, device: torch.device | None = None
    ) -> None:
        self._watch, self._on_rebalance = watch, on_rebalance
        self._group: ProcessGroup | None = None
        self._pending: tuple[Work, torch.Tensor] | None = None
        if world_size > 1:
            import torch
            import torch.distributed as dist

            # Once, on the default group: whether any rank watches (then every rank takes part, watching or not).
            anyone = torch.tensor([0 if watch is None else 1], device=device)
            dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
            if int(anyone):
                self._group = dist.new_group(backend="gloo")
                self._watch = watch or NoticeWatch(None, poll_s=0.0)  # a rank told nothing itself

    def _flag(self) -> int:
        notice = self._watch.current() if self._watch is not None else None
        if notice is None:
            return NOTHING
        if notice.stops:
            return STOP
        return REBALANCE if self._on_rebalance == "checkpoint" else NOTHING

    def __call__(self, step: int) -> Decision | None:
        if self._watch is None:
            return None
        agreed = self._flag() if self._group is None else self._exchange()
        if agreed == NOTHING:
            return None
        if agreed == REBALANCE:
            self._watch.acted()
            notice = self._watch.last_rebalance or Notice("rebalance", seen=time.time())
        else:
            mine = self._watch.current()
            notice = mine if mine is not None and mine.stops else Notice("remote", seen=time.time())
        return Decision(step=step, stop=agreed == STOP, notice=notice)

    def _exchange(self) -> int:
        import torch
        import torch.distributed as dist

        agreed = NOTHING
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = int(flag)
            if agreed == REBALANCE and self._watch is not None:  # acted on now: not posted again
                self._watch.acted()
        flag = torch.tensor([self._flag()], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return agreed

    def close(self) -> None:
        if self._pending is not None:  # every rank posted the same number of all-reduces: wait for the last
            self._pending[0].wait()
            self._pending = None
        if self._watch is not None:
            self._watch.close()


def preempted_summary(decision: Decision, saved_s: float) -> dict[str, object]:
    """The summary's ``preempted`` fields: why, after which step, and how long the save took against the notice."""
    notice = decision.notice
    return {
        "ended": PREEMPTED,
        "preempted": {
            "reason": notice.reason(),
            "step": decision.step,
            "notice": notice.to_json(),
            "checkpoint_s": saved_s,
            "seconds_left": notice.seconds_left(),
        },
    }


def preempted_line(summary: dict[str, Any]) -> str:
    """The driver's line for a run a notice ended: why, after which step, how long its checkpoint took to be complete
    and how that compares with the notice's deadline (``seconds_left`` at the run's end)."""
    ended = summary["preempted"]
    done = (summary.get("checkpoint_done_s") or [None])[-1]
    took = f"written in {done:.1f} s" if done is not None else "written"
    line = f"preempted after step {ended['step']}: {ended['reason']}; checkpoint {ended['step']} {took}"
    left = ended.get("seconds_left")
    if left is not None:
        line += (
            f", {left:.0f} s before the notice's deadline"
            if left >= 0
            else f", {-left:.0f} s AFTER the notice's deadline (a shorter checkpoint_every leaves less to save)"
        )
    return line


def keep_global_batch(
    micro_batch: int | str, grad_accum_steps: int, *, saved_world: int | None, world: int
) -> tuple[int, str | None]:
    """The ``grad_accum_steps`` that keeps a resumed run's global batch (ranks x micro-batch x accumulation) when it
    resumes on ``world`` ranks a checkpoint ``saved_world`` ranks wrote, and a line for the user when anything
    changes (``None`` when nothing does). Example: ``keep_global_batch(4, 1, saved_world=2, world=1)`` is
    ``(2, "resuming on 1 worker ...")``."""
    if saved_world is None or saved_world == world:
        return grad_accum_steps, None
    if micro_batch == "auto":
        return grad_accum_steps, (
            f"resuming on {world} workers a checkpoint of {saved_world}: batch_size auto is decided on the workers, "
            "so the global batch follows it (set batch_size to keep it exactly)"
        )
    samples = saved_world * int(micro_batch) * grad_accum_steps
    if samples % (world * int(micro_batch)):
        now = world * int(micro_batch) * grad_accum_steps
        return grad_accum_steps, (
            f"resuming on {world} workers a checkpoint of {saved_world}: its global batch of {samples} samples is "
            f"not a multiple of {world} x batch_size {micro_batch}, so it becomes {now} samples per step (choose a "
            "num_workers that divides it to keep it)"
        )
    accum = samples // (world * int(micro_batch))
    return accum, (
        f"resuming on {world} workers a checkpoint of {saved_world}: grad_accum_steps {grad_accum_steps} -> {accum} "
        f"keeps the global batch of {samples} samples per step"
    )
