"""The in-job transport gate: after the first collectives, prove from NCCL's own lines which network carried them.

Each worker's NCCL writes its ``NCCL_DEBUG=INFO`` lines to a file of its own (``NCCL_DEBUG_FILE``, set by the
launcher). After step 1 every rank hands its lines to rank 0, which runs the fabric analysis of
:mod:`raytrain_eks.fabric` on all of them and decides with :func:`raytrain_eks.fabric.decision.gate_decision`; the
decision goes back to every rank. When the requirement is not met the job stops there — in its first minute —
instead of training for hours over TCP sockets; when the lines only show what NCCL selected, not what carried the
links, the gate looks once more after step 2.

Where the file lies matters: NCCL opens it with a bare ``fopen(path, "w")`` and, when that fails, logs to stdout
without a word (``ncclDebugInit`` in NCCL's src/debug.cc), and the training function cannot make a folder for it in
time (Ray Train sets up the process group before that function runs). So the file lies directly in ``/tmp``, which
exists on every worker, with the run's token in its name::

    /tmp/raytrain-eks-nccl.<token>.<host>.<pid>.log      # <host>: the host name up to its first '.'
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

from raytrain_eks.fabric import analyze
from raytrain_eks.fabric.decision import gate_decision
from raytrain_eks.fabric.nccl_lines import NCCL_LOG_DIR, NCCL_LOG_PREFIX

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def nccl_env(token: str, folder: str = NCCL_LOG_DIR) -> dict[str, str]:
    """The worker environment that makes NCCL log its set-up to one file per process (%h host, %p pid).

    The file is named after ``token`` (characters other than letters, digits, ``.``, ``_`` and ``-`` become ``-``,
    so that no ``%`` or ``/`` of it reaches NCCL's pattern) and lies directly in ``folder``: by default ``/tmp``,
    which every worker has, not this process's temporary directory (``TMPDIR`` here may name a folder the workers
    lack). Example: ``nccl_env("run-1")["NCCL_DEBUG_FILE"] == "/tmp/raytrain-eks-nccl.run-1.%h.%p.log"``.
    """
    name = f"{NCCL_LOG_PREFIX}{_UNSAFE.sub('-', token)}.%h.%p.log"
    return {"NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "INFO"), "NCCL_DEBUG_FILE": str(Path(folder, name))}


def nccl_log_path(pattern: str, hostname: str, pid: int) -> Path:
    """The file NCCL opens for ``NCCL_DEBUG_FILE`` = ``pattern`` in process ``pid`` on host ``hostname``.

    As NCCL's ``ncclDebugInit`` expands it: ``%h`` is the host name up to its first ``.`` (``getHostName(...,
    '.')``) with ``%`` and ``/`` made ``-``, ``%p`` the pid, ``%%`` one ``%``; any other ``%x`` stays as it is.
    Example: ``nccl_log_path("/tmp/n.%h.%p.log", "ip-10-0-1-5.ec2.internal", 42) == Path("/tmp/n.ip-10-0-1-5.42.log")``.
    """
    host = hostname.split(".", 1)[0].replace("%", "-").replace("/", "-")
    out: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        nxt = pattern[i + 1] if i + 1 < len(pattern) else ""
        if ch != "%":
            out.append(ch)
            i += 1
            continue
        out.append({"%": "%", "h": host, "p": str(pid)}.get(nxt, "%" + nxt))
        i += 2
    return Path("".join(out))


def own_nccl_lines() -> list[str]:
    """This process's NCCL lines, from the file ``NCCL_DEBUG_FILE`` names (none when NCCL never started)."""
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    if not pattern:
        return []
    path = nccl_log_path(pattern, socket.gethostname(), os.getpid())
    if not path.is_file():
        return []
    with path.open(errors="replace") as f:
        return [line.rstrip("\n") for line in f if "NCCL" in line]


def check_transport(
    require: str,
    *,
    rank: int,
    world_size: int,
    node: str,
    last_look: bool = False,
    require_full_efa: bool = False,
    instance_type: str | None = None,
) -> tuple[dict[str, Any], list[list[str]]]:
    """Gather every rank's NCCL lines on rank 0, decide, and share the decision (a collective).

    ``node`` names the node this rank runs on (the job's node count is the number of different names).
    ``instance_type``: the GPU nodes' type, to compare EFA's use with what it offers (None: the type aws-ofi-nccl
    logs, if any); a shortfall stops the job only with ``require_full_efa``, else the decision's note warns.
    Returns ``(result, lines_by_rank)``: ``result`` is :func:`gate_decision`'s; ``lines_by_rank`` is filled on
    rank 0 only.
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (node, own_nccl_lines()))
    box: list[Any] = [None]
    if rank == 0:
        report = analyze((line for _, lines in gathered for line in lines), instance_type=instance_type)
        job_nodes = len({n for n, _ in gathered})
        box[0] = gate_decision(
            report, require, job_nodes=job_nodes, last_look=last_look, require_full_efa=require_full_efa
        )
    dist.broadcast_object_list(box, src=0)
    return box[0], ([lines for _, lines in gathered] if rank == 0 else [])
