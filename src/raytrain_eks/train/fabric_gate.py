"""The in-job transport gate: after the first collectives, prove from NCCL's own lines which network carried them.

Each worker's NCCL writes its ``NCCL_DEBUG=INFO`` lines to a file of its own (``NCCL_DEBUG_FILE``, set by the
launcher). After step 1 every rank hands its lines to rank 0, which runs the fabric analysis of
:mod:`raytrain_eks.fabric` on all of them; the decision goes back to every rank. When the requirement is not
met the job stops there — in its first minute — instead of training for hours over TCP sockets; when the lines
only show what NCCL selected, not what carried the links, the gate looks once more after step 2.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from raytrain_eks.fabric import TransportReport, analyze
from raytrain_eks.fabric.nccl_lines import NCCL_LOG_FOLDER


def nccl_log_dir(token: str) -> Path:
    """A folder on each worker's own disk for NCCL's debug files (workers may not share the run folder)."""
    return Path(tempfile.gettempdir()) / NCCL_LOG_FOLDER / token


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


def gate_decision(report: TransportReport, require: str, *, job_nodes: int, last_look: bool) -> dict[str, Any]:
    """What the gate does with one look at the job's NCCL lines: ``continue``, ``look-again`` or ``stop``.

    A job on one node sends nothing between nodes, so ``single-node`` meets any requirement there. A job on
    several nodes continues only on ``proven`` evidence that meets ``require`` (its own logs hold connection
    lines); evidence that is only ``selected`` makes the gate look again after the next step, and stop if that
    last look still cannot prove it. A verdict that does not meet ``require``, or none, stops the run at once.
    Example::

        gate_decision(analyze(lines), "efa", job_nodes=2, last_look=False)["action"]  # "look-again"
    """
    result = {"require": require, "verdict": report.verdict, "basis": report.basis, "job_nodes": job_nodes}
    if job_nodes <= 1 and report.verdict == "single-node":
        met, action = True, "continue"
        note = "the job runs on one node: no inter-node link existed, so any fabric requirement is met"
    elif report.verdict == "single-node":
        met, action = False, "stop"
        note = f"the job spans {job_nodes} nodes, but NCCL's lines show no link between them"
    elif report.verdict == "inconclusive":
        met, action, note = False, "stop", "NCCL's lines do not show which network it selected or used"
    elif not report.meets(require):
        met, action = False, "stop"
        note = f"the transport is {report.verdict!r} ({report.basis}), not {require!r}"
    elif report.basis == "proven":
        met, action, note = True, "continue", f"connection lines prove the {report.verdict!r} transport"
    elif last_look:
        met, action = False, "stop"
        note = f"after a second look, NCCL's lines still do not prove that {require!r} carries the inter-node links"
    else:
        met, action = None, "look-again"
        note = "no connection line proves the transport yet: looking again after the next step"
    text = report.render(require)
    return {**result, "met": met, "action": action, "note": note, "report": f"{text}\n\nTransport gate: {note}"}


def check_transport(
    require: str, *, rank: int, world_size: int, node: str, last_look: bool = False
) -> tuple[dict[str, Any], list[list[str]]]:
    """Gather every rank's NCCL lines on rank 0, decide, and share the decision (a collective).

    ``node`` names the node this rank runs on (the job's node count is the number of different names).
    Returns ``(result, lines_by_rank)``: ``result`` is :func:`gate_decision`'s; ``lines_by_rank`` is filled on
    rank 0 only.
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (node, own_nccl_lines()))
    box: list[Any] = [None]
    if rank == 0:
        report = analyze(line for _, lines in gathered for line in lines)
        job_nodes = len({n for n, _ in gathered})
        box[0] = gate_decision(report, require, job_nodes=job_nodes, last_look=last_look)
    dist.broadcast_object_list(box, src=0)
    return box[0], ([lines for _, lines in gathered] if rank == 0 else [])
