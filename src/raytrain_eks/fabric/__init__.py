"""The network fabric between GPU nodes: what NCCL chose and whether EFA carries the inter-node traffic.

Example::

    from raytrain_eks.fabric import analyze_paths

    report = analyze_paths(["/tmp/ray/session_latest/logs"])
    report.verdict  # "efa", "ib", "socket", "single-node" or "inconclusive"
    report.basis    # "proven" (connection lines), "selected" (the network NCCL chose) or "none"
"""

from __future__ import annotations

from raytrain_eks.fabric.nccl_lines import LogInputError, iter_log_lines
from raytrain_eks.fabric.nccl_log import analyze, analyze_paths
from raytrain_eks.fabric.nccl_report import (
    BASES,
    REQUIREMENTS,
    VERDICTS,
    LineRef,
    PluginInfo,
    RankDetail,
    TransportReport,
)
from raytrain_eks.fabric.nccl_verdict import NcclLogAnalyzer

__all__ = [
    "BASES",
    "REQUIREMENTS",
    "VERDICTS",
    "LineRef",
    "LogInputError",
    "NcclLogAnalyzer",
    "PluginInfo",
    "RankDetail",
    "TransportReport",
    "analyze",
    "analyze_paths",
    "iter_log_lines",
]
