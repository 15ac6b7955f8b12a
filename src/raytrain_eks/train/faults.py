"""Fault injection for the recovery tests: a worker kills itself with SIGKILL at a chosen point, once.

Inactive unless ``RAYTRAIN_EKS_FAULT`` is set, as ``POINT:STEP:RANK:ONCE_FILE``: ``step`` (before the optimizer
step STEP) or ``checkpoint`` (after this rank wrote its shards of checkpoint STEP, before they are reported).
``ONCE_FILE`` is created when the fault fires, so the restarted worker group runs through. Example::

    RAYTRAIN_EKS_FAULT=checkpoint:4:1:/tmp/fired raytrain-eks train ...
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "RAYTRAIN_EKS_FAULT"


def maybe_die(point: str, *, step: int, rank: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    want_point, want_step, want_rank, once = spec.split(":", 3)
    if (want_point, int(want_step), int(want_rank)) != (point, step, rank):
        return
    marker = Path(once)
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
