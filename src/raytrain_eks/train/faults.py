"""Fault injection for the recovery tests: a worker kills itself with SIGKILL at a chosen point, once; or its
checkpoint writes take longer (``RAYTRAIN_EKS_SLOW_WRITE=SECONDS``), to show training going on while they run.

Inactive unless ``RAYTRAIN_EKS_FAULT`` is set, as ``POINT:STEP:RANK:ONCE_FILE``: ``step`` (before the optimizer
step STEP) or ``checkpoint`` (after this rank wrote its shards of checkpoint STEP, before they are reported).
``ONCE_FILE`` is created when the fault fires, so the restarted worker group runs through. Example::

    RAYTRAIN_EKS_FAULT=checkpoint:4:1:/tmp/fired raytrain-eks train ...
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

ENV = "RAYTRAIN_EKS_FAULT"
SLOW_WRITE_ENV = "RAYTRAIN_EKS_SLOW_WRITE"


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


def checkpoint_writer(folder: str, *, thread_count: int) -> FileSystemWriter:
    """DCP's file writer for ``folder``; with ``RAYTRAIN_EKS_SLOW_WRITE=SECONDS`` set, one that first waits that long
    (on the thread that writes the files)."""
    import torch.distributed.checkpoint as dcp

    delay = float(os.environ.get(SLOW_WRITE_ENV) or 0)
    if not delay:
        return dcp.FileSystemWriter(folder, thread_count=thread_count)

    class Slowed(dcp.FileSystemWriter):
        def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
            time.sleep(delay)
            return super().write_data(plan, planner)

    return Slowed(folder, thread_count=thread_count)
