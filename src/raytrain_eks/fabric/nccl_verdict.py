"""Deciding which network carried NCCL's inter-node traffic, from the state :class:`NcclLineReader` collected.

Example::

    a = NcclLogAnalyzer()
    for line in iter_log_lines(["worker-0.out", "worker-1.out"]):
        a.feed(line.text, line.source, line.lineno)
    report = a.finish()
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from raytrain_eks.fabric import nccl_lines
from raytrain_eks.fabric.nccl_lines import (
    _INTRA_PREFIXES,
    CommKey,
    ConnKey,
    NcclLineReader,
    ProcKey,
    _name_family,
    _Proc,
    _provider_family,
)
from raytrain_eks.fabric.nccl_report import LineRef, RankDetail, TransportReport, _counts
from raytrain_eks.fabric.nccl_usage import NodeLinks, assess_usage

# Network families from weakest to strongest, for "the weakest choice decides".
_WEAKNESS = ("socket", "other", "ib", "efa")


class NcclLogAnalyzer(NcclLineReader):
    """Streaming state machine over NCCL log lines; :meth:`feed` each line, then :meth:`finish` once.

    Example::

        a = NcclLogAnalyzer()
        for line in iter_log_lines(["worker-0.out", "worker-1.out"]):
            a.feed(line.text, line.source, line.lineno)
        report = a.finish()
    """

    def finish(self, instance_type: str | None = None) -> TransportReport:
        """Decide the verdict from everything fed so far and build the report.

        ``instance_type``: the GPU nodes' EC2 type, to compare the fabric's use with what it offers (EFA devices,
        GPUDirect RDMA); without it, the type aws-ofi-nccl logs (``Running on <type> platform``) is used if any.
        """
        self.close()
        return _Decision(self).report(instance_type)


class _Decision:
    """Turns the analyzer's state into a :class:`TransportReport` (kept apart so feeding stays lean)."""

    def __init__(self, a: NcclLogAnalyzer) -> None:
        self.a = a
        self.notes: list[str] = []
        self.nodes = self._nodes()
        global_providers = {_provider_family(p) for p in a._providers}
        self.global_provider = global_providers.pop() if len(global_providers) == 1 else None
        self.assumed_provider = False

    def _nodes(self) -> dict[ProcKey, str | None]:
        # One node per hostname, unless processes with the same hostname report disjoint sets of addresses (two
        # machines both called "ubuntu"): then the address tells them apart. Without a hostname, the address is
        # the node.
        groups: dict[str, list[tuple[set[str], list[ProcKey]]]] = {}
        nodes: dict[ProcKey, str | None] = {}
        for key, proc in self.a._procs.items():
            ips = proc.ips | proc.ray_ips
            if not proc.host:
                nodes[key] = min(ips, default=None)
                continue
            nodes[key] = proc.host
            if not ips:
                continue
            merged, keys = set(ips), [key]
            kept = []
            for group_ips, group_keys in groups.get(proc.host, []):
                if group_ips & merged:
                    merged |= group_ips
                    keys += group_keys
                else:
                    kept.append((group_ips, group_keys))
            groups[proc.host] = [*kept, (merged, keys)]
        for host, host_groups in groups.items():
            if len(host_groups) > 1:
                for group_ips, group_keys in host_groups:
                    for key in group_keys:
                        nodes[key] = f"{host} ({min(group_ips)})"
        return nodes

    def family(self, label: str, proc: ProcKey) -> str:
        if label.startswith("CollNet/"):
            fam = _name_family(label[8:])
            return "ib" if fam in ("ofi", "other") else fam  # CollNet is SHARP-style in-network reduction
        if label == "P2P/MNNVL":
            return "nvlink"
        if not label.startswith("NET/"):
            return "other"
        fam = _name_family(label[4:])
        if fam != "ofi":
            return fam
        provider = self.a._procs[proc].provider
        if provider:
            return _provider_family(provider)
        if self.global_provider:
            return self.global_provider
        # aws-ofi-nccl on AWS only runs on the efa provider unless told otherwise; say that it was assumed.
        self.assumed_provider = True
        return "efa"

    def scope(self, proc: ProcKey, comm: CommKey | None, ck: ConnKey) -> str:
        """``inter`` (peer on another node), ``intra``, or ``inter?`` (a NET link whose peer's node is unknown)."""
        label = ck[5]
        if label.startswith(_INTRA_PREFIXES) and label != "P2P/MNNVL":
            return "intra"
        if label.startswith("CollNet/"):
            return "inter"
        peer = ck[2] if ck[4] == "receive" else ck[3]
        mine = self.nodes.get(proc)
        if comm is not None:
            peers = self.a._members.get(comm, {}).get(peer)
            if peers and mine is not None:
                peer_nodes = {self.nodes.get(p) for p in peers}
                if None not in peer_nodes:
                    if mine not in peer_nodes:
                        return "inter"
                    if peer_nodes == {mine}:
                        return "intra"
            if self.a._comm_nnodes.get(comm) == 1:
                return "intra"
        return "inter?" if label.startswith("NET/") else "intra"

    def report(self, instance_type: str | None = None) -> TransportReport:
        a = self.a
        inter: Counter[str] = Counter()
        intra: Counter[str] = Counter()
        families: Counter[str] = Counter()
        gdr = presumed = net_same_node = 0
        per_ctx_inter: dict[tuple[ProcKey, int], Counter[str]] = {}
        per_ctx_intra: dict[tuple[ProcKey, int], Counter[str]] = {}
        net_links: Counter[ProcKey] = Counter()
        gdr_links: Counter[ProcKey] = Counter()
        deciding: dict[str, list[tuple[ProcKey, LineRef]]] = {}
        intra_examples: list[LineRef] = []
        for (proc, dev, comm, ck), example in a._conns.items():
            label = ck[5]
            scope = self.scope(proc, comm, ck)
            if scope == "intra":
                intra[label] += 1
                per_ctx_intra.setdefault((proc, dev), Counter())[label] += 1
                net_same_node += label.startswith("NET/")
                if example is not None and len(intra_examples) < 3:
                    intra_examples.append(example)
                continue
            presumed += scope == "inter?"
            inter[label] += 1
            gdr += ck[6]
            if label.startswith("NET/"):
                net_links[proc] += 1
                gdr_links[proc] += ck[6]
            per_ctx_inter.setdefault((proc, dev), Counter())[label] += 1
            fam = self.family(label, proc)
            families[fam] += 1
            if example is not None:
                deciding.setdefault(fam, []).append((proc, example))

        verdict, basis, reason, evidence = self._verdict(families, inter, intra, deciding, intra_examples)
        if presumed:
            self.notes.append(
                f"{presumed} NET connection line(s) could not be placed on a host (no communicator or host line); "
                "they were counted as inter-node, since NET is NCCL's inter-node transport"
            )
        if net_same_node:
            self.notes.append(
                f"{net_same_node} NET connection line(s) join ranks on the same host (NET used inside a node)"
            )
        if self.assumed_provider and verdict == "efa":
            self.notes.append("aws-ofi-nccl did not log its libfabric provider; efa was assumed (its default on AWS)")
        initialized = {n for p in a._procs.values() for n in p.initialized}
        if any(_name_family(n) == "ofi" for n in initialized) and verdict in ("ib", "socket"):
            self.notes.append(
                "the aws-ofi-nccl plugin initialized but NCCL did not use it for inter-node traffic "
                "(an initialized plugin is not necessarily the one in use)"
            )
        if a._dropped:
            self.notes.append(
                f"{a._dropped} connection line(s) beyond the first {nccl_lines._MAX_CONNECTIONS} were not tracked"
            )
        report = self._build(verdict, basis, reason, evidence, inter, intra, gdr, per_ctx_inter, per_ctx_intra)
        report.usage = assess_usage(self._node_links(net_links, gdr_links), instance_type, efa_verdict=verdict == "efa")
        return report

    def _node_links(self, net_links: Counter[ProcKey], gdr_links: Counter[ProcKey]) -> list[NodeLinks]:
        """Each node's processes, ranks (devices that logged a rank) and inter-node NET links, for assess_usage."""
        by_node: dict[str, list[ProcKey]] = {}
        for key in self.a._procs:
            by_node.setdefault(self.nodes.get(key) or "?", []).append(key)
        out = []
        for node, keys in sorted(by_node.items()):
            procs = [self.a._procs[k] for k in keys]
            ranks = sum(1 for p in procs for c in p.ctxs.values() if c.ranks or c.dev >= 0)
            links = sum(net_links[k] for k in keys)
            out.append(NodeLinks(node, [p.usage for p in procs], ranks, links, sum(gdr_links[k] for k in keys)))
        return out

    def _verdict(
        self,
        families: Counter[str],
        inter: Counter[str],
        intra: Counter[str],
        deciding: dict[str, list[tuple[ProcKey, LineRef]]],
        intra_examples: list[LineRef],
    ) -> tuple[str, str, str, list[LineRef]]:
        """(verdict, basis, reason, evidence): connection lines first, then one-node proof, then NCCL's choice."""
        a = self.a
        hosts = {n for n in self.nodes.values() if n}
        multi_comms = [k for k, n in a._comm_nnodes.items() if n > 1] + [
            k for k, m in a._members.items() if len({self.nodes.get(p) for ps in m.values() for p in ps} - {None}) > 1
        ]
        if families:
            total = sum(inter.values())
            links = f"{total} inter-node connection line(s) ({_counts(dict(inter))})"
            on_hosts = f" between {len(hosts)} hosts" if len(hosts) > 1 else ""
            if families["socket"]:
                verdict = "socket"
                reason = f"{families['socket']} of {links}{on_hosts} use TCP sockets"
                if families["socket"] < total:
                    reason += "; NCCL fell back to sockets on part of the job"
                support = ["network:Socket", "provider:socket", "ib-no-device"]
                support += ["failure"]
            elif set(families) == {"efa"}:
                verdict, reason = "efa", f"all {links}{on_hosts} use aws-ofi-nccl with the efa provider"
                support = ["provider:efa", "network:Libfabric", "network:AWS Libfabric"]
            elif set(families) == {"ib"}:
                verdict, reason = "ib", f"all {links}{on_hosts} use InfiniBand/RoCE verbs"
                support = ["ib-using", "network:IB", "provider:ib"]
            elif set(families) == {"efa", "ib"}:
                verdict = "inconclusive"
                reason = f"{links} mix EFA and InfiniBand: analyse the logs of one job at a time"
                support = []
            else:
                verdict = "inconclusive"
                unknown = ", ".join(sorted(f for f in families if f not in ("efa", "ib")))
                reason = f"{links}{on_hosts} use a transport this tool cannot classify ({unknown})"
                support = []
            fam = verdict if verdict in ("efa", "ib", "socket") else None
            lines = _spread(deciding.get(fam, []) if fam else [r for v in deciding.values() for r in v], 6)
            basis = "proven" if fam else "none"
            return verdict, basis, reason, _sorted_refs(lines + self._support(support))
        one_node = [n == 1 for n in a._comm_nnodes.values()]
        # One node is proven by connection lines that all stay inside one host, or by NCCL's own "nNodes 1"; with
        # several hosts in the log, every communicator must say nNodes 1 (links seen inside each host prove nothing
        # about the links that were not logged).
        if not multi_comms and (intra or any(one_node)) and (len(hosts) <= 1 or (one_node and all(one_node))):
            where = f" on host {next(iter(hosts))}" if len(hosts) == 1 else ""
            what = f"{sum(intra.values())} connection line(s) ({_counts(dict(intra))})" if intra else "communicators"
            reason = f"all {what}{where} stay inside one node; no rank talks to another host"
            if any(one_node) and not intra:
                reason = f"NCCL reports every communicator{where} as one node (nNodes 1); no rank talks to another host"
            return "single-node", "proven", reason, _sorted_refs(intra_examples + self._support(["nnodes=1"]))
        selected = self._from_selected_network(multi_comms)
        if selected is not None:
            return selected
        if not a._nccl_lines:
            return "inconclusive", "none", "no NCCL set-up lines found: was the job run with NCCL_DEBUG=INFO?", []
        reason = (
            "the log holds none of the lines that show or select the network: no connection line "
            "('Channel 00/0 : 0[0] -> 1[0] [send] via NET/...'), no 'Using network <name>', no "
            "'NET/OFI Selected provider is ...', no 'NET/IB : Using [0]<device>' and no 'NET/IB : No device found' "
            "(it may end before NCCL chose its network, or NCCL_DEBUG_SUBSYS filtered them out)"
        )
        if len(hosts) > 1 and intra:
            reason += f"; the connection lines logged stay inside each of {len(hosts)} hosts, which proves nothing"
        return "inconclusive", "none", reason, _sorted_refs(self._support(["failure"]))

    def _choice(self, proc: _Proc) -> tuple[str, str] | None:
        """The network family this process selected and why, from its set-up lines; None when it did not say."""
        if proc.networks:
            fams = {self._network_family(name, proc) for name in proc.networks}
            fam = min(fams, key=_WEAKNESS.index)
            return fam, "Using network " + ", ".join(sorted(proc.networks))
        if proc.provider and not proc.ofi_failed:
            return _provider_family(proc.provider), f"NET/OFI selected provider {proc.provider}"
        if proc.ib_devices:
            return "ib", "NET/IB found IB/RoCE devices"
        if proc.ofi_failed:
            return "socket", "the aws-ofi-nccl plugin failed" + (
                " and no IB device was found" if proc.ib_absent else ""
            )
        if proc.ib_absent:
            return "socket", "no IB device was found, which leaves NCCL's Socket network"
        return None

    def _network_family(self, name: str, proc: _Proc) -> str:
        fam = _name_family(name)
        if fam != "ofi":
            return fam
        prov = proc.provider or self.global_provider
        if prov:
            return _provider_family(prov)
        self.assumed_provider = True
        return "efa"

    def _from_selected_network(self, multi_comms: list[CommKey]) -> tuple[str, str, str, list[LineRef]] | None:
        # With no connection line, each process's own choice decides what any inter-node link of it would use: a
        # communicator's inter-node traffic goes over the one network NCCL selected for it. The weakest choice
        # decides, so that one process on sockets is never hidden by others on EFA.
        a = self.a
        members = {p for k in multi_comms for ps in a._members.get(k, {}).values() for p in ps}
        choices = self._choices(members or a._procs)
        for_the_job = False
        if members and not choices:
            # The processes that logged the multi-node communicator said nothing of their network here, but other
            # processes of the same job did: Ray's driver folds the lines that workers print alike into one worker's
            # ("[repeated 15x across cluster]"), and a cut log keeps some processes' set-up only. What the job's
            # processes selected is then what its inter-node links used (the weakest choice still decides).
            choices = self._choices(a._procs)
            for_the_job = bool(choices)
        if not choices:
            if multi_comms:
                reason = (
                    "a communicator spans several nodes, but no line says which network NCCL selected for it "
                    "(no 'Using network <name>', NET/OFI provider or NET/IB line)"
                )
                return "inconclusive", "none", reason, _sorted_refs(self._support(["nnodes>1"]))
            return None
        support = ["nnodes>1"] + [f"network:{n}" for p in a._procs.values() for n in p.networks]
        scope = " for a communicator that spans nodes" if multi_comms else ""
        base = f"no per-connection lines were logged, so the network NCCL selected{scope} decides"
        if for_the_job:
            base = (
                "no per-connection lines were logged, and the processes that logged a communicator spanning nodes "
                "selected no network in this log, so what the job's other processes selected decides"
            )
        fams = set(choices)
        if "socket" in fams:
            why = choices["socket"][0][1]
            reason = f"{base}: {self._who(choices['socket'])} selected sockets ({why})"
            if len(fams) > 1:
                others = "; ".join(f"{f} on {self._who(v)}" for f, v in sorted(choices.items()) if f != "socket")
                reason += f", the weakest choice, while {others}"
            return "socket", "selected", reason, _sorted_refs(self._support([*support, "failure", "ib-no-device"]))
        if fams in ({"efa"}, {"ib"}):
            fam = next(iter(fams))
            title = {"efa": "aws-ofi-nccl with the efa provider", "ib": "NCCL's IB verbs network (IB/RoCE)"}[fam]
            reason = f"{base}: {self._who(choices[fam])} selected {title}; no connection line confirmed it"
            support += ["provider:efa", "network:Libfabric", "network:AWS Libfabric"] if fam == "efa" else ["ib-using"]
            return fam, "selected", reason, _sorted_refs(self._support(support))
        mixed = "; ".join(f"{f} on {self._who(v)}" for f, v in sorted(choices.items()))
        if fams == {"efa", "ib"}:
            reason = f"{base}, and the processes disagree ({mixed}): analyse the logs of one job at a time"
        else:
            reason = f"{base}, but it is a network this tool cannot classify ({mixed})"
        return "inconclusive", "none", reason, _sorted_refs(self._support(support))

    def _choices(self, keys: Iterable[ProcKey]) -> dict[str, list[tuple[ProcKey, str]]]:
        """The processes ``keys`` by the network family each selected (those that said nothing are left out)."""
        choices: dict[str, list[tuple[ProcKey, str]]] = {}
        for key in keys:
            choice = self._choice(self.a._procs[key])
            if choice is not None:
                choices.setdefault(choice[0], []).append((key, choice[1]))
        return choices

    def _who(self, procs: list[tuple[ProcKey, str]], n: int = 4) -> str:
        names = [f"{self.nodes.get(k) or '?'} pid {k[1] or '?'}" for k, _ in procs[:n]]
        more = f" and {len(procs) - n} more" if len(procs) > n else ""
        folded = max((self.a._procs[k].folded for k, _ in procs), default=0)
        ray = f"; Ray folded the same lines of {folded} more worker(s) into theirs" if folded else ""
        return f"{len(procs)} process(es) ({', '.join(names)}{more}{ray})"

    def _support(self, kinds: Sequence[str]) -> list[LineRef]:
        out: list[LineRef] = []
        for kind in kinds:
            if kind == "failure":
                out += list(self.a._failures.values())[:3]
            else:
                out += self.a._refs.get(kind, [])[:2]
        return out

    def _build(
        self,
        verdict: str,
        basis: str,
        reason: str,
        evidence: list[LineRef],
        inter: Counter[str],
        intra: Counter[str],
        gdr: int,
        per_ctx_inter: dict[tuple[ProcKey, int], Counter[str]],
        per_ctx_intra: dict[tuple[ProcKey, int], Counter[str]],
    ) -> TransportReport:
        a = self.a
        by_pid: dict[str, list[_Proc]] = {}
        for proc in a._procs.values():
            by_pid.setdefault(proc.pid, []).append(proc)
        for (pid, ip), version in a._ray_pid_version.items():
            for proc in by_pid.get(pid, []):
                if ip is None or ip in proc.ray_ips or ip in proc.ips:
                    proc.version = proc.version or version
        if len(a._versions) == 1:  # one build in the whole log: the bare version line speaks for every process
            only = next(iter(a._versions))
            for proc in a._procs.values():
                proc.version = proc.version or only
        ranks: list[RankDetail] = []
        for pkey, proc in a._procs.items():
            for dev, ctx in proc.ctxs.items():
                ci = per_ctx_inter.get((pkey, dev), Counter())
                cn = per_ctx_intra.get((pkey, dev), Counter())
                if not (ctx.ranks or ci or cn or proc.networks or proc.provider):
                    continue
                # The rank shown is the one in this device's largest communicator (the world, usually).
                best = max(ctx.ranks, key=lambda r: (r[1], -r[0]), default=None)
                ranks.append(
                    RankDetail(
                        host=self.nodes.get(pkey),
                        pid=proc.pid or None,
                        cuda_dev=dev if dev >= 0 else None,
                        rank=best[0] if best else None,
                        nranks=best[1] if best else None,
                        communicators=len({r[2] for r in ctx.ranks}),
                        nccl_version=proc.version,
                        network=proc.networks.most_common(1)[0][0] if proc.networks else None,
                        provider=proc.provider,
                        inter_node=dict(sorted(ci.items())),
                        intra_node=dict(sorted(cn.items())),
                        warnings=proc.warnings,
                    )
                )
        ranks.sort(key=lambda r: (r.rank is None, r.rank or 0, r.host or "", r.pid or "", r.cuda_dev or 0))
        versions = sorted(a._versions, key=_version_key)
        if len(versions) > 1:
            self.notes.append(f"several NCCL builds in one log: {', '.join(versions)}")
        plugin = a._plugin
        plugin.networks = dict(Counter(n for p in a._procs.values() for n in p.networks).most_common())
        plugin.providers = [p for p, _ in a._providers.most_common()]
        plugin.failures = list(a._failures)
        return TransportReport(
            verdict=verdict,
            reason=reason,
            basis=basis,
            nccl_version=", ".join(versions) if versions else None,
            nccl_versions=versions,
            hosts=sorted({r.host for r in ranks if r.host}),
            world_size=max(a._comm_nranks.values(), default=None),
            ranks=ranks,
            inter_node=dict(inter.most_common()),
            inter_node_gdrdma=gdr,
            intra_node=dict(intra.most_common()),
            plugin=plugin,
            ib_devices=list(a._ib_devices),
            socket_interfaces=list(a._ifaces),
            evidence=evidence,
            warnings=dict(a._warnings.most_common(20)),
            notes=self.notes,
            stats={
                "lines": a._lines,
                "analyzed_lines": a._nccl_lines,
                "records": a._records,
                "connections": len(a._conns),
            },
        )


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _spread(items: list[tuple[ProcKey, LineRef]], n: int) -> list[LineRef]:
    """Up to ``n`` example lines, one per process first, so that evidence shows several hosts."""
    seen: set[ProcKey] = set()
    first: list[LineRef] = []
    rest: list[LineRef] = []
    for proc, ref in items:
        (rest if proc in seen else first).append(ref)
        seen.add(proc)
    return (first + rest)[:n]


def _sorted_refs(refs: list[LineRef]) -> list[LineRef]:
    return sorted(dict.fromkeys(refs), key=lambda r: (r.source, r.line, r.text))
