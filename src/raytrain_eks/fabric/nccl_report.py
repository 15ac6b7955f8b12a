"""The transport report: the verdict ``verify-transport`` gives, why, and what the log said per rank.

:mod:`raytrain_eks.fabric.nccl_lines` reads the lines, :mod:`raytrain_eks.fabric.nccl_verdict` decides, and this
module holds the result and renders it. Example::

    report.verdict, report.meets("efa"), report.to_json(), print(report.render(require="efa"))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

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
class NodeUsage:
    """One node's use of the fabric: ranks on it, EFA interfaces the plugin found, its NIC groups, the NET devices
    its connection lines use, inter-node NET links with and without GPUDirect RDMA, and NCCL's coll channels."""

    host: str
    ranks: int
    efa_found: int | None
    nic_groups: int | None
    net_devices: list[int]
    net_links: int
    gdr_links: int
    coll_channels: int | None


@dataclass
class UsageFinding:
    """A shortfall in how the fabric was used: its kind, one sentence, and the log lines that show it."""

    kind: str
    message: str
    lines: list[LineRef] = field(default_factory=list)


@dataclass
class FabricUsage:
    """What the job used of the fabric its instance type offers (filled by ``nccl_usage.assess_usage``).

    ``findings`` is empty when the fabric was used in full, or when nothing could be compared (``notes`` says why).
    """

    instance_type: str | None = None
    efa_offered: int | None = None
    gdr_supported: bool | None = None
    expected_net_devices: int | None = None
    nodes: list[NodeUsage] = field(default_factory=list)
    findings: list[UsageFinding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def compared(self) -> bool:
        """Whether the instance type was known and there were nodes to compare with it."""
        return self.efa_offered is not None and bool(self.nodes)

    @property
    def full(self) -> bool | None:
        """True: compared, connection lines logged, and no shortfall; False: a shortfall; None: cannot tell."""
        if self.findings:
            return False
        if not self.compared or not any(u.net_links for u in self.nodes):
            return None
        return True

    def render(self, max_nodes: int = 16) -> list[str]:
        """The report's "Fabric use" section, as lines."""
        offer = "type not known"
        if self.instance_type and self.efa_offered is not None:
            gdr = "GPUDirect RDMA" if self.gdr_supported else "no GPUDirect RDMA"
            offer = f"{self.instance_type}: {self.efa_offered} EFA interface(s), {gdr}"
        if self.expected_net_devices:
            offer += f"; {self.expected_net_devices} NET device(s) expected per node"
        full = self.full
        status = "no shortfall seen" if self.compared else "not compared"
        if full is not None:
            status = "full" if full else "SHORTFALL"
        lines = [f"Fabric use:     {status} ({offer})"]
        rows = [("host", "ranks", "efa found", "nic groups", "net devices", "gdr links", "channels")]
        for u in self.nodes[:max_nodes]:
            rows.append(
                (
                    u.host,
                    str(u.ranks),
                    _opt(u.efa_found),
                    _opt(u.nic_groups),
                    ",".join(map(str, u.net_devices)) or "-",
                    f"{u.gdr_links}/{u.net_links}" if u.net_links else "-",
                    _opt(u.coll_channels),
                )
            )
        if len(rows) > 1:
            widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
            lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        for f in self.findings:
            lines.append(f"  SHORTFALL {f.kind}: {f.message}")
            lines += [f"    {ref}" for ref in f.lines]
        lines += [f"  - {n}" for n in self.notes]
        return lines


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
    usage: FabricUsage = field(default_factory=FabricUsage)

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

    def to_dict(self, require: str | None = None) -> dict[str, object]:
        """Plain data for JSON; with ``require`` it also says whether the requirement is met."""
        d = asdict(self)
        if require is not None:
            d["require"] = require
            d["meets"] = self.meets(require)
            d["exit_code"] = self.exit_code(require)
        d["usage"]["full"] = self.usage.full
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
        if self.usage.nodes or self.usage.notes:
            lines += ["", *self.usage.render()]
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


def _opt(n: int | None) -> str:
    return "?" if n is None else str(n)


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
