"""Whether a job used the fabric its nodes offer, from NCCL's own lines: EFA devices, GPUDirect RDMA, channels.

The transport verdict says which network carried the inter-node links; this module says whether it was used as the
instance type allows. :class:`ProcUsage` gathers, per process, what aws-ofi-nccl found (``NET/OFI Selected provider
is efa ... (found 4 nics)``, its ``NIC group`` lines, ``Running on <type> platform``), which NET devices NCCL's
connection lines use (``via NET/Libfabric/3/GDRDMA`` is device 3, GPUDirect RDMA on) and NCCL's channels (``8 coll
channels``); :func:`assess_usage` compares them, node by node, with the type's facts in :mod:`raytrain_eks.instances`.
Each shortfall is a named :class:`UsageFinding` that quotes the lines that show it. Example::

    usage = assess_usage([NodeLinks("node-a", [proc_usage], ranks=8, net_links=16, gdr_links=0)], "p4d.24xlarge")
    [f.kind for f in usage.findings]  # ["net-devices", "gdr-off"] for a run over one EFA device without GDR
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from raytrain_eks.fabric.nccl_report import FabricUsage, LineRef, NodeUsage, UsageFinding
from raytrain_eks.instances import INSTANCE_TYPES, InstanceType

FINDING_KINDS = ("efa-found", "net-devices", "gdr-off", "channels")
"""Every shortfall :func:`assess_usage` can name: fewer EFA interfaces found than the type has, fewer NET devices
used than found, GPUDirect RDMA off where the type supports it, fewer channels than NET devices to spread them on."""

_PLATFORM = re.compile(r"Running on (\S+?) platform")
_NIC_GROUP = re.compile(r"NIC group (\d+) device #(\d+)")
_NET_DEVICE = re.compile(r"NET/[^/]+/(\d+)")
_COLL_CHANNELS = re.compile(r"(\d+) coll channels")
_LOCAL_RANKS = re.compile(r"localRanks (\d+)")
_MAX_REFS = 3  # example lines kept per kind, per process
_MAX_DEVICES = 64


@dataclass
class ProcUsage:
    """What one process's lines say about how it uses the fabric (filled line by line by the reader)."""

    nics: int | None = None
    platform: str | None = None
    groups: set[tuple[int, int]] = field(default_factory=set)
    net_devices: dict[int, LineRef | None] = field(default_factory=dict)
    coll_channels: int | None = None
    local_ranks: int | None = None
    refs: dict[str, list[LineRef]] = field(default_factory=dict)

    def keep(self, kind: str, ref: Callable[[], LineRef]) -> LineRef | None:
        refs = self.refs.setdefault(kind, [])
        if len(refs) >= _MAX_REFS:
            return None
        refs.append(ref())
        return refs[-1]

    def read_ofi(self, body: str, nics: str | None, ref: Callable[[], LineRef]) -> None:
        """A ``NET/OFI`` message (``body`` without the prefix); ``nics`` is the provider line's NIC count."""
        if nics is not None:
            self.nics = max(self.nics or 0, int(nics))
            self.keep("nics", ref)
        elif "NIC group" in body:
            m = _NIC_GROUP.search(body)
            if m and len(self.groups) < _MAX_DEVICES:
                self.groups.add((int(m.group(1)), int(m.group(2))))
                self.keep("groups", ref)
        elif "Running on" in body:
            m = _PLATFORM.search(body)
            if m:
                self.platform = m.group(1)
                self.keep("platform", ref)
        elif "disabling GDR" in body or "GDR not supported" in body:
            self.keep("gdr-disabled", ref)

    def read_conn(self, via: str, gdr: bool, ref: Callable[[], LineRef]) -> None:
        """A connection line's text after ``via`` that starts with ``NET/``."""
        m = _NET_DEVICE.match(via.strip())
        if m:
            dev = int(m.group(1))
            if dev not in self.net_devices and len(self.net_devices) < _MAX_DEVICES:
                self.net_devices[dev] = self.keep(f"device:{dev}", ref)
        if not gdr:
            self.keep("no-gdr", ref)

    def read_counts(self, msg: str, ref: Callable[[], LineRef]) -> None:
        """``8 coll channels, ...`` or the ``localRanks`` of a 2.20+ communicator line."""
        m = _COLL_CHANNELS.match(msg)
        if m:
            self.coll_channels = max(self.coll_channels or 0, int(m.group(1)))
            self.keep("channels", ref)
            return
        m = _LOCAL_RANKS.search(msg)
        if m:
            self.local_ranks = max(self.local_ranks or 0, int(m.group(1)))


@dataclass
class NodeLinks:
    """One node's processes and its inter-node NET connection lines (counted once each), as the verdict placed them."""

    host: str
    procs: list[ProcUsage]
    ranks: int
    net_links: int
    gdr_links: int


def resolve_instance_type(given: str | None, procs: Sequence[ProcUsage]) -> tuple[InstanceType | None, list[str]]:
    """The type to compare with: the one given, else the one aws-ofi-nccl logged; with notes on what was decided.

    The plugin names its platform as the instance type (``Running on p4d.24xlarge platform``) or, up to about
    1.3, its family (``Running on P4d platform``): a family that one known type starts with stands for that type.
    """
    logged = sorted({p.platform for p in procs if p.platform})
    from_log = [t for t in (_known(name) for name in logged) if t is not None]
    notes: list[str] = []
    if given is not None:
        it = INSTANCE_TYPES.get(given)
        if it is None:
            return None, [f"instance type {given!r} is not in the table of instance facts: nothing to compare with"]
        if from_log and from_log[0].name != given:
            notes.append(f"aws-ofi-nccl logged the platform {logged[0]!r}, but {given} was given; {given} is used")
        return it, notes
    if from_log:
        return from_log[0], [f"instance type {from_log[0].name}: aws-ofi-nccl logged 'Running on {logged[0]} platform'"]
    return None, ["no instance type given and none logged: pass --instance-type to compare with what the type offers"]


def _known(platform: str) -> InstanceType | None:
    name = platform.lower()
    if name in INSTANCE_TYPES:
        return INSTANCE_TYPES[name]
    family = [it for n, it in INSTANCE_TYPES.items() if n.startswith(name + ".")]
    return family[0] if len(family) == 1 else None


def assess_usage(nodes: Sequence[NodeLinks], instance_type: str | None, *, efa_verdict: bool = True) -> FabricUsage:
    """Compare what each node used with what its instance type offers; a shortfall becomes a finding.

    ``efa_verdict``: whether EFA carries the inter-node links (otherwise the transport itself is the finding and
    nothing here is compared). Example: ``assess_usage(nodes, "p5.48xlarge").findings`` names a run whose plugin
    found 4 of the 32 EFA interfaces.
    """
    procs = [p for n in nodes for p in n.procs]
    it, notes = resolve_instance_type(instance_type, procs)
    usage = FabricUsage(
        instance_type=it.name if it else instance_type,
        efa_offered=it.efa_interfaces if it else None,
        gdr_supported=it.gpudirect_rdma if it else None,
        nodes=[_node_usage(n) for n in nodes],
        notes=notes,
    )
    if not efa_verdict:
        usage.notes = ["EFA does not carry the inter-node links, so how fully it is used was not compared"]
        return usage
    if it is None:
        return usage
    if not any(n.net_links for n in nodes):
        usage.notes.append(
            "no inter-node connection line was logged, so which NET devices and whether GPUDirect RDMA "
            "carried the links is not known"
        )
    found = [u.efa_found for u in usage.nodes if u.efa_found is not None]
    usage.expected_net_devices = _expected_devices(it, usage.nodes, min(found, default=None))
    for check in (_check_found, _check_devices, _check_gdr, _check_channels):
        finding = check(it, usage, procs)
        if finding is not None:
            usage.findings.append(finding)
    return usage


def _node_usage(n: NodeLinks) -> NodeUsage:
    found = [p.nics for p in n.procs if p.nics is not None]
    groups = {g for p in n.procs for g, _ in p.groups}
    channels = [p.coll_channels for p in n.procs if p.coll_channels is not None]
    local = max((p.local_ranks for p in n.procs if p.local_ranks), default=None)
    return NodeUsage(
        host=n.host,
        ranks=max(n.ranks, local or 0),
        efa_found=max(found) if found else None,
        nic_groups=len(groups) or None,
        net_devices=sorted({d for p in n.procs for d in p.net_devices}),
        net_links=n.net_links,
        gdr_links=n.gdr_links,
        coll_channels=max(channels) if channels else None,
    )


def _expected_devices(it: InstanceType, nodes: list[NodeUsage], found: int | None) -> int:
    """NET devices NCCL should spread a node's ranks over: one per GPU at most (aws-ofi-nccl groups the NICs of one
    GPU into one device where a GPU has several), in proportion to the GPUs the node's ranks use."""
    groups = max((u.nic_groups or 0 for u in nodes), default=0)
    available = groups or min(found if found is not None else it.efa_interfaces, it.gpus or 1)
    ranks = max((u.ranks for u in nodes), default=0) or it.gpus
    return max(1, math.ceil(available * min(ranks, it.gpus or ranks) / (it.gpus or ranks)))


def _refs(procs: Sequence[ProcUsage], kind: str, n: int = 3) -> list[LineRef]:
    return [r for p in procs for r in p.refs.get(kind, [])][:n]


def _check_found(it: InstanceType, usage: FabricUsage, procs: Sequence[ProcUsage]) -> UsageFinding | None:
    short = [u for u in usage.nodes if u.efa_found is not None and u.efa_found < it.efa_interfaces]
    if not short:
        return None
    fewest = min(u.efa_found or 0 for u in short)
    hosts = ", ".join(u.host for u in short[:4]) + (" ..." if len(short) > 4 else "")
    lines = [r for p in procs if p.nics is not None and p.nics < it.efa_interfaces for r in p.refs.get("nics", [])]
    return UsageFinding(
        "efa-found",
        f"aws-ofi-nccl found {fewest} of the {it.efa_interfaces} EFA interfaces a {it.name} has (on {hosts}): the "
        f"worker pods see part of the fabric; each should request vpc.amazonaws.com/efa: {it.efa_interfaces}",
        lines[:3],
    )


def _check_devices(it: InstanceType, usage: FabricUsage, procs: Sequence[ProcUsage]) -> UsageFinding | None:
    # A log that folds or cuts lines shows part of each node's links, and NCCL numbers the NET devices of nodes of
    # one type alike: the devices the whole job's lines use stand for each node's.
    used = sorted({d for u in usage.nodes for d in u.net_devices})
    expected = usage.expected_net_devices or 0
    if not used or len(used) >= expected:
        return None
    lines = [r for p in procs for dev in sorted(p.net_devices) if (r := p.net_devices[dev]) is not None]
    return UsageFinding(
        "net-devices",
        f"NCCL's connection lines use {len(used)} NET device(s) ({', '.join(map(str, used))}) where the ranks of a "
        f"{it.name} node should spread over {expected}: the inter-node traffic shares "
        f"{'one EFA device' if len(used) == 1 else 'fewer EFA devices'} (check the topology NCCL was given, "
        "NCCL_TOPO_FILE or the plugin's own, and NCCL_NET_DEVICES)",
        lines[:3],
    )


def _check_gdr(it: InstanceType, usage: FabricUsage, procs: Sequence[ProcUsage]) -> UsageFinding | None:
    if not it.gpudirect_rdma:
        usage.notes.append(f"{it.name} does not offer GPUDirect RDMA over EFA: links without /GDRDMA are expected")
        return None
    net = sum(u.net_links for u in usage.nodes)
    gdr = sum(u.gdr_links for u in usage.nodes)
    disabled = _refs(procs, "gdr-disabled", 2)
    if net and gdr == net and not disabled:
        return None
    if not net and not disabled:
        return None
    what = f"{net - gdr} of {net} inter-node NET connection line(s) lack /GDRDMA" if net else "the plugin disabled GDR"
    return UsageFinding(
        "gdr-off",
        f"{what} on {it.name}, which supports GPUDirect RDMA: that data is staged through host memory (check that "
        "FI_EFA_USE_DEVICE_RDMA is not 0, that the NVIDIA driver exports dma-buf or nvidia-peermem is loaded, and "
        "NCCL_NET_GDR_LEVEL)",
        (disabled + _refs(procs, "no-gdr"))[:3],
    )


def _check_channels(it: InstanceType, usage: FabricUsage, procs: Sequence[ProcUsage]) -> UsageFinding | None:
    # Each ring channel crosses a node boundary once per direction, so a rank's ring traffic leaves its node over at
    # most as many NET devices as there are channels.
    channels = [u.coll_channels for u in usage.nodes if u.coll_channels is not None]
    expected = usage.expected_net_devices or 0
    if not channels or min(channels) >= expected:
        return None
    return UsageFinding(
        "channels",
        f"NCCL built {min(channels)} coll channel(s) where a {it.name} node has {expected} NET devices to spread "
        "them on: some EFA devices carry no ring traffic (NCCL_MIN_NCHANNELS raises the count)",
        _refs(procs, "channels"),
    )
