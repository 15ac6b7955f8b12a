"""The transport report: the verdict ``verify-transport`` gives, why, and what the log said per rank.

:mod:`raytrain_eks.fabric.nccl_lines` reads the lines, :mod:`raytrain_eks.fabric.nccl_verdict` decides, and this
module holds the result and renders it. Example::

    report.verdict, report.meets("efa"), report.to_json(), print(report.render(require="efa"))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from raytrain_eks.errors import UserError

VERDICTS = ("efa", "ib", "socket", "single-node", "inconclusive")
"""Every verdict :func:`analyze` can give, best fabric first."""

REQUIREMENTS = ("efa", "ib", "any")
"""What ``--require`` accepts: ``any`` is met by every conclusive verdict (report only)."""

BASES = ("proven", "selected", "none")
"""What a verdict rests on: ``proven`` by connection lines (``via NET/...`` links between hosts, or every link
inside one host, or NCCL's ``nNodes 1``); ``selected`` by the network NCCL chose (``Using network``, the OFI
provider, IB devices found, or a plugin failure and NCCL's fall-back) with no connection line to confirm it;
``none`` for ``inconclusive``."""


# --------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineRef:
    """One log line kept as evidence: where it was (file and 1-based line number) and its text."""

    source: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.text}"


@dataclass
class PluginInfo:
    """The NET plugin side: what NCCL loaded, what the aws-ofi-nccl plugin said, and what failed.

    ``networks`` counts, per name, the processes that printed ``Using network <name>`` (NCCL's selected plugin).
    """

    networks: dict[str, int] = field(default_factory=dict)
    external: list[str] = field(default_factory=list)
    internal: bool = False
    ofi_version: str | None = None
    providers: list[str] = field(default_factory=list)
    fabrics: list[str] = field(default_factory=list)
    nics: int | None = None
    gdr_disabled: bool = False
    failures: list[str] = field(default_factory=list)


@dataclass
class RankDetail:
    """One NCCL process and device: where it ran, its rank, and the connections it logged."""

    host: str | None
    pid: str | None
    cuda_dev: int | None
    rank: int | None
    nranks: int | None
    communicators: int
    nccl_version: str | None
    network: str | None
    provider: str | None
    inter_node: dict[str, int]
    intra_node: dict[str, int]
    warnings: int


@dataclass
class TransportReport:
    """The result of :func:`analyze`: the verdict, why, and what the log said per rank.

    ``inter_node`` and ``intra_node`` count distinct connection lines per transport label (``NET/Libfabric``,
    ``P2P/CUMEM``, ``SHM``, ...); a line seen twice (a log folder holds both a worker's own file and the driver's
    copy) counts once. Example::

        report.verdict, report.meets("efa"), report.to_json()
    """

    verdict: str
    reason: str
    basis: str = "none"
    nccl_version: str | None = None
    nccl_versions: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    world_size: int | None = None
    ranks: list[RankDetail] = field(default_factory=list)
    inter_node: dict[str, int] = field(default_factory=dict)
    inter_node_gdrdma: int = 0
    intra_node: dict[str, int] = field(default_factory=dict)
    plugin: PluginInfo = field(default_factory=PluginInfo)
    ib_devices: list[str] = field(default_factory=list)
    socket_interfaces: list[str] = field(default_factory=list)
    evidence: list[LineRef] = field(default_factory=list)
    warnings: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    def meets(self, require: str) -> bool:
        """Whether the verdict satisfies ``require`` (``efa``, ``ib`` or ``any``); inconclusive never does."""
        _check_require(require)
        if self.verdict == "inconclusive":
            return False
        return require == "any" or self.verdict == require

    def exit_code(self, require: str) -> int:
        """The process status for ``verify-transport``: 0 met, 1 not met, 2 inconclusive."""
        if self.verdict == "inconclusive":
            _check_require(require)
            return 2
        return 0 if self.meets(require) else 1

    def to_dict(self, require: str | None = None) -> dict[str, Any]:
        """Plain data for JSON; with ``require`` it also says whether the requirement is met."""
        d = asdict(self)
        if require is not None:
            d["require"] = require
            d["meets"] = self.meets(require)
            d["exit_code"] = self.exit_code(require)
        return d

    def to_json(self, require: str | None = None) -> str:
        """The report as indented JSON (keys: verdict, reason, nccl_version, ranks, hosts, inter_node, ...)."""
        return json.dumps(self.to_dict(require), indent=2)

    def render(self, require: str | None = None, *, max_ranks: int = 64) -> str:
        """A readable report: verdict and reason, fabric summary, per-rank table, evidence, warnings, notes."""
        lines = [f"NCCL transport: {_VERDICT_TITLES[self.verdict]}", f"  {self.reason}"]
        lines.append(f"  basis: {self.basis} ({_BASIS_TITLES[self.basis]})")
        if require is not None:
            status = "met" if self.meets(require) else ("undecided" if self.verdict == "inconclusive" else "NOT met")
            lines.append(f"  requirement --require {require}: {status}")
            if status != "met":
                lines.append(f"  next: {_NEXT_STEPS[self.verdict]}")
        lines.append("")
        versions = ", ".join(self.nccl_versions) if self.nccl_versions else "not logged"
        lines.append(f"NCCL version:   {versions}")
        size = f"world size {self.world_size}, " if self.world_size else ""
        lines.append(f"Ranks / hosts:  {size}{len(self.ranks)} rank(s) logged on {len(self.hosts)} host(s)")
        if self.hosts:
            lines.append(f"Hosts:          {', '.join(self.hosts[:16])}{' ...' if len(self.hosts) > 16 else ''}")
        lines.append(f"Net plugin:     {_plugin_summary(self.plugin)}")
        if self.plugin.failures:
            lines.append("Plugin errors:  " + "\n                ".join(self.plugin.failures[:5]))
        if self.ib_devices:
            lines.append(f"IB devices:     {', '.join(self.ib_devices)}")
        if self.socket_interfaces:
            lines.append(f"Socket ifaces:  {', '.join(self.socket_interfaces)}")
        gdr = f" (GDRDMA on {self.inter_node_gdrdma})" if self.inter_node else ""
        lines.append(f"Inter-node:     {_counts(self.inter_node) or 'none'}{gdr}")
        lines.append(f"Intra-node:     {_counts(self.intra_node) or 'none'}")
        if self.ranks:
            lines += ["", "Per rank:", *_rank_table(self.ranks[:max_ranks])]
            if len(self.ranks) > max_ranks:
                lines.append(f"  ... {len(self.ranks) - max_ranks} more (see --json)")
        if self.evidence:
            lines += ["", "Evidence:"] + [f"  {e}" for e in self.evidence]
        if self.warnings:
            lines += ["", "NCCL warnings:"] + [f"  {n}x {w}" for w, n in list(self.warnings.items())[:10]]
        if self.notes:
            lines += ["", "Notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


_VERDICT_TITLES = {
    "efa": "EFA (inter-node traffic uses EFA through aws-ofi-nccl)",
    "ib": "InfiniBand/RoCE (inter-node traffic uses NCCL's IB verbs transport)",
    "socket": "SOCKET (inter-node traffic falls back to TCP sockets)",
    "single-node": "single node (no traffic crosses nodes)",
    "inconclusive": "inconclusive (not enough evidence in the log)",
}


_BASIS_TITLES = {
    "proven": "connection lines show which links crossed hosts, and over which network",
    "selected": "no connection line confirmed it; it follows from the network NCCL selected",
    "none": "no line shows or selects a network",
}

_NEXT_STEPS = {
    "efa": "the inter-node traffic uses EFA; pass --require efa (or any) for this cluster",
    "ib": "NCCL used its own IB verbs transport, not aws-ofi-nccl; on AWS set NCCL_NET_PLUGIN=ofi and check that "
    "the plugin loads",
    "socket": "check that every worker pod requests vpc.amazonaws.com/efa and sets FI_PROVIDER=efa and "
    "NCCL_NET_PLUGIN=ofi, and read the plugin errors and evidence below",
    "single-node": "no traffic crossed nodes, so the fabric was never used; run with workers on at least two nodes",
    "inconclusive": "run the job with NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=INIT,NET (or unset, for all) and "
    "pass every worker's whole log (for example a copy of /tmp/ray/session_latest/logs from each node)",
}


def _check_require(require: str) -> None:
    if require not in REQUIREMENTS:
        raise UserError(f"--require {require!r} is not known", hint=f"Choose one of: {', '.join(REQUIREMENTS)}.")


def _counts(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items())


def _plugin_summary(p: PluginInfo) -> str:
    parts = []
    if p.networks:
        parts.append(
            "Using network " + ", ".join(f"{k} ({v} process{'es' if v > 1 else ''})" for k, v in p.networks.items())
        )
    if p.external:
        parts.append("loaded " + ", ".join(p.external))
    elif p.internal:
        parts.append("no external plugin (internal IB/Socket)")
    ofi = []
    if p.ofi_version:
        ofi.append(f"aws-ofi-nccl {p.ofi_version}")
    if p.providers:
        ofi.append("provider " + "/".join(p.providers))
    if p.fabrics:
        ofi.append("fabric " + "/".join(p.fabrics))
    if p.nics is not None:
        ofi.append(f"{p.nics} NIC(s)")
    if p.gdr_disabled:
        ofi.append("GDR disabled by the plugin")
    if ofi:
        parts.append(", ".join(ofi))
    return "; ".join(parts) or "not logged"


def _rank_table(ranks: Sequence[RankDetail]) -> list[str]:
    rows = [("rank", "host", "pid", "dev", "network", "inter-node", "intra-node")]
    for r in ranks:
        rank = "?" if r.rank is None else f"{r.rank}/{r.nranks}"
        net = r.network or "-"
        if r.provider:
            net += f" ({r.provider})"
        rows.append(
            (
                rank,
                r.host or "?",
                r.pid or "?",
                "?" if r.cuda_dev is None else str(r.cuda_dev),
                net,
                _counts(r.inter_node) or "-",
                _counts(r.intra_node) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
