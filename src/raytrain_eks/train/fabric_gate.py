"""The in-job transport gate: after the first collectives, prove from NCCL's own lines which network carried them.

Each worker's NCCL writes its ``NCCL_DEBUG=INFO`` lines to a file of its own (``NCCL_DEBUG_FILE``, set by the
launcher). After step 1 every rank hands its lines to rank 0, which runs the fabric analysis of
:mod:`raytrain_eks.fabric` on all of them; the verdict goes back to every rank. When the requirement is not
met the job stops there — in its first minute — instead of training for hours over TCP sockets.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from raytrain_eks.fabric import analyze


def nccl_log_dir(token: str) -> Path:
    """A folder on each worker's own disk for NCCL's debug files (workers may not share the run folder)."""
    return Path(tempfile.gettempdir()) / "raytrain-eks-nccl" / token


def nccl_env(token: str) -> dict[str, str]:
    """The worker environment that makes NCCL log its set-up to one file per process (%h host, %p pid)."""
    return {"NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "INFO"), "NCCL_DEBUG_FILE": f"{nccl_log_dir(token)}/%h.%p.log"}


def own_nccl_lines() -> list[str]:
    """This process's NCCL lines, from the file ``NCCL_DEBUG_FILE`` names (none when NCCL never started)."""
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    if not pattern:
        return []
    path = Path(pattern.replace("%h", socket.gethostname()).replace("%p", str(os.getpid())))
    if not path.is_file():
        return []
    with path.open(errors="replace") as f:
        return [line.rstrip("\n") for line in f if "NCCL" in line]


def check_transport(require: str, *, rank: int, world_size: int) -> tuple[dict[str, Any], list[list[str]]]:
    """Gather every rank's NCCL lines on rank 0, decide, and share the decision (a collective).

    Returns ``(result, lines_by_rank)``: ``result`` has ``require``, ``verdict``, ``met`` and the readable
    ``report``; ``lines_by_rank`` is filled on rank 0 only.
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, own_nccl_lines())
    box: list[Any] = [None]
    if rank == 0:
        report = analyze(line for lines in gathered for line in lines)
        box[0] = {
            "require": require,
            "verdict": report.verdict,
            "met": report.meets(require),
            "report": report.render(require),
        }
    dist.broadcast_object_list(box, src=0)
    return box[0], (gathered if rank == 0 else [])
