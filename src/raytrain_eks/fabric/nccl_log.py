"""Which network NCCL used between nodes, read from its ``NCCL_DEBUG=INFO`` (or ``TRACE``) log.

A job that should use EFA still "works" when NCCL silently falls back to TCP sockets, only slower. This module
reads NCCL's own log (any release from 2.4 to 2.30, aws-ofi-nccl 1.1 to 1.21), finds every peer connection
(``Channel 00/0 : 3[0] -> 4[0] [send] via NET/Libfabric/0/GDRDMA``), decides which ones cross nodes, and gives one
verdict: ``efa``, ``ib``, ``socket``, ``single-node`` or ``inconclusive``, with the lines that decided it.

Lines may carry prefixes added by Ray, Kubernetes, mpirun, CloudWatch or timestamps, colour codes, and the
interleaved output of many ranks. Reading is streaming: memory depends on the job's topology (processes,
communicators, connections), never on the size of the log. Example::

    report = analyze_paths(["/tmp/ray/session_latest/logs"])
    print(report.render(require="efa"))
    sys.exit(report.exit_code("efa"))        # 0 EFA, 1 something else, 2 inconclusive

    analyze(["node-a:12:12 [0] NCCL INFO Using network Socket", ...]).verdict
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import BinaryIO

from raytrain_eks.fabric.nccl_lines import ReadStats, iter_log_lines
from raytrain_eks.fabric.nccl_report import (
    TransportReport,
)
from raytrain_eks.fabric.nccl_verdict import NcclLogAnalyzer


def analyze(lines: Iterable[str], *, source: str = "<input>", instance_type: str | None = None) -> TransportReport:
    """Analyze NCCL log lines given as strings (one per item, newline optional) and return the report.

    ``instance_type`` (the GPU nodes' EC2 type) lets the report compare the fabric's use with what the type offers.

    Example::

        report = analyze(open("worker-0.out", encoding="utf-8", errors="replace"))
        report.verdict
    """
    a = NcclLogAnalyzer()
    for n, line in enumerate(lines, 1):
        a.feed(line, source, n)
    return a.finish(instance_type)


def analyze_paths(
    paths: Sequence[str | os.PathLike[str]],
    *,
    stdin: BinaryIO | None = None,
    progress: Callable[[int], None] | None = None,
    instance_type: str | None = None,
) -> TransportReport:
    """Analyze log files, folders (recursively) and stdin (``-`` or no path) with flat memory.

    Example::

        report = analyze_paths(["/tmp/ray/session_latest/logs"])
        report.verdict, report.stats["bytes"]

    ``progress`` is called with the bytes read so far. Raises :class:`LogInputError` for a path that does not
    exist or cannot be read.
    """
    stats = ReadStats()
    a = NcclLogAnalyzer()
    feed = a.feed
    for line in iter_log_lines(paths, stdin=stdin, stats=stats, progress=progress, relevant_only=True):
        feed(line.text, line.source, line.lineno)
    report = a.finish(instance_type)
    report.stats.update(files=stats.files, bytes=stats.bytes, lines=stats.lines)
    report.notes[:0] = stats.notes
    if stats.files == 0:
        report.notes.append("no readable text files were found")
    return report
