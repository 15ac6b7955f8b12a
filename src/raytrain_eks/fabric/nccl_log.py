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

import gzip
import json
import os
import re
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from raytrain_eks.errors import UserError

VERDICTS = ("efa", "ib", "socket", "single-node", "inconclusive")
"""Every verdict :func:`analyze` can give, best fabric first."""

REQUIREMENTS = ("efa", "ib", "any")
"""What ``--require`` accepts: ``any`` is met by every conclusive verdict (report only)."""

# Reading: 4 MiB chunks keep the per-call overhead low; a "line" longer than 1 MiB (binary data, a log without
# newlines) is cut so memory stays bounded whatever the input.
_CHUNK = 4 << 20
_MAX_LINE = 1 << 20
_SNIFF = 8192
_GZIP_MAGIC = b"\x1f\x8b"

# Bounds on what is kept in memory, so that garbage or adversarial input cannot grow it without limit. A real
# job stays far below them (1024 ranks x 32 channels x a few peers is about 100k connections).
_MAX_CONNECTIONS = 500_000
_MAX_EXAMPLES = 12  # example lines kept per transport label
_MAX_KIND_REFS = 3  # example lines kept per kind of supporting evidence
_MAX_DISTINCT = 64  # labels, warnings, network names, ...
_MAX_TEXT = 400  # characters of a line kept as evidence
_MAX_PROCS = 100_000  # processes (host, pid); beyond it, lines count towards one catch-all process
_MAX_COMMS = 100_000  # communicators whose membership is tracked
_MAX_DEVS = 64  # devices per process


class LogInputError(UserError):
    """A log path that cannot be read: missing, unreadable, or an empty folder."""

    exit_code = 2


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


_NEXT_STEPS = {
    "efa": "the inter-node traffic uses EFA; pass --require efa (or any) for this cluster",
    "ib": "NCCL used its own IB verbs transport, not aws-ofi-nccl; on AWS set NCCL_NET_PLUGIN=ofi and check that "
    "the plugin loads",
    "socket": "check that every worker pod requests vpc.amazonaws.com/efa and sets FI_PROVIDER=efa and "
    "NCCL_NET_PLUGIN=ofi, and read the plugin errors and evidence below",
    "single-node": "no traffic crossed nodes, so the fabric was never used; run with workers on at least two nodes",
    "inconclusive": "run the job with NCCL_DEBUG=INFO and pass every worker's log (for example a copy of "
    "/tmp/ray/session_latest/logs from each node)",
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


# --------------------------------------------------------------------------------------------------------------
# Reading files, folders and stdin with flat memory
# --------------------------------------------------------------------------------------------------------------


class LogLine(NamedTuple):
    """One line of input that mentions NCCL: its file, 1-based line number and text."""

    source: str
    lineno: int
    text: str


@dataclass
class ReadStats:
    """What :func:`iter_log_lines` read: files, bytes, lines, and notes about files it skipped or cut short."""

    files: int = 0
    bytes: int = 0
    lines: int = 0
    notes: list[str] = field(default_factory=list)
    progress: Callable[[int], None] | None = None


def iter_log_lines(
    paths: Sequence[str | os.PathLike[str]],
    *,
    stdin: BinaryIO | None = None,
    stats: ReadStats | None = None,
    progress: Callable[[int], None] | None = None,
    relevant_only: bool = False,
) -> Iterator[LogLine]:
    """Yield the lines that mention ``NCCL`` from files, folders (recursively) and stdin (``-`` or no path).

    Only those lines can carry anything the analyzer reads, and skipping the rest in bulk is what makes multi-GB
    logs fast. Memory stays flat: input is read in 4 MiB chunks. ``.gz`` files are read transparently; binary
    files met inside folders are skipped. Every path is checked before anything is read. Example::

        for line in iter_log_lines(["logs/", "-"], stdin=sys.stdin.buffer):
            ...

    ``progress`` is called with the total bytes read so far after each chunk. With ``relevant_only``, lines whose
    NCCL messages the analyzer ignores anyway (per-collective ``AllReduce: opCount ...`` lines, tuning tables) are
    skipped before they are decoded, which makes NCCL-heavy logs several times faster to read. Raises
    :class:`LogInputError` for a missing or unreadable path or a folder without files.
    """
    stats = stats if stats is not None else ReadStats()
    stats.progress = progress
    inputs = _resolve_inputs(paths)
    for item in inputs:
        if isinstance(item, str):  # "-"
            stream = stdin if stdin is not None else sys.stdin.buffer
            stats.files += 1
            yield from _scan_stream(stream, "<stdin>", stats, relevant_only)
        elif item.is_dir():
            for f in _walk_files(item):
                yield from _scan_file(f, stats, relevant_only, in_folder=True)
        else:
            yield from _scan_file(item, stats, relevant_only, in_folder=False)


def _resolve_inputs(paths: Sequence[str | os.PathLike[str]]) -> list[Path | str]:
    hint = "Give NCCL log files or folders (for example a copy of /tmp/ray/session_latest/logs), or '-' for stdin."
    if not paths:
        return ["-"]
    out: list[Path | str] = []
    for raw in paths:
        if str(raw) == "-":
            out.append("-")
            continue
        p = Path(raw)
        if not p.exists():
            raise LogInputError(f"{p}: no such file or folder", hint=hint)
        if p.is_dir():
            if not os.access(p, os.R_OK | os.X_OK):
                raise LogInputError(f"{p}: folder is not readable", hint="Check its permissions.")
            if next(_walk_files(p), None) is None:
                raise LogInputError(f"{p}: folder holds no files", hint=hint)
        elif not os.access(p, os.R_OK):
            raise LogInputError(f"{p}: file is not readable", hint="Check its permissions.")
        out.append(p)
    return out


def _walk_files(top: Path) -> Iterator[Path]:
    # Sorted, so that evidence and line order are the same on every run; symlinked folders are not followed
    # (a Ray session folder links "session_latest" to itself).
    for root, dirs, files in os.walk(top, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            p = Path(root, name)
            if p.is_file():
                yield p


def _scan_file(path: Path, stats: ReadStats, relevant_only: bool, *, in_folder: bool) -> Iterator[LogLine]:
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed below; the generator may be abandoned midway
    except OSError as exc:
        if not in_folder:
            raise LogInputError(f"{path}: cannot be read ({exc.strerror})", hint="Check the path.") from exc
        stats.notes.append(f"skipped {path}: {exc.strerror}")
        return
    with raw:
        head = raw.read(_SNIFF)
        raw.seek(0)
        stream: BinaryIO = raw
        if head.startswith(_GZIP_MAGIC):
            stream = gzip.GzipFile(fileobj=raw)  # type: ignore[assignment]
        elif in_folder and b"\0" in head:
            return  # binary files in a log folder (core dumps, .so, images) cannot hold NCCL's text output
        stats.files += 1
        yield from _scan_stream(stream, str(path), stats, relevant_only)


def _scan_stream(stream: BinaryIO, source: str, stats: ReadStats, relevant_only: bool) -> Iterator[LogLine]:
    buf = b""
    newlines_before = 0  # newlines before buf[0], to give each line its number
    # GzipFile.read(n) drops everything it decompressed when the stream turns out truncated; read1 hands data
    # over piece by piece, so a cut .gz still yields all but its last piece.
    read = stream.read1 if isinstance(stream, gzip.GzipFile) else stream.read
    try:
        while True:
            chunk = read(_CHUNK)
            if not chunk:
                break
            stats.bytes += len(chunk)
            if stats.progress is not None:
                stats.progress(stats.bytes)
            buf = buf + chunk if buf else chunk
            end = buf.rfind(b"\n") + 1
            if end == 0:
                if len(buf) <= _MAX_LINE:
                    continue  # wait for the end of this line
                end = len(buf)  # no newline in 1 MiB: cut it rather than grow without bound
            yield from _scan_block(buf, end, source, newlines_before, relevant_only)
            n = buf.count(b"\n", 0, end)
            newlines_before += n
            stats.lines += n
            buf = buf[end:]
    except (OSError, EOFError, zlib.error) as exc:
        # A truncated .gz or a read error midway: keep what was read, and say so.
        stats.notes.append(f"{source}: input ends early after {stats.bytes} bytes ({exc})")
    if buf:
        stats.lines += 1
        yield from _scan_block(buf, len(buf), source, newlines_before, relevant_only)


def _scan_block(buf: bytes, end: int, source: str, newlines_before: int, relevant_only: bool) -> Iterator[LogLine]:
    # Jump from one "NCCL" to the next with bytes.find (C speed) instead of looping over every line in Python.
    pos = buf.find(b"NCCL", 0, end)
    line_start_prev = 0
    lineno = newlines_before
    while pos != -1:
        ls = buf.rfind(b"\n", 0, pos) + 1
        le = buf.find(b"\n", pos, end)
        if le == -1:
            le = end
        if relevant_only and not _relevant(buf, ls, pos, le):
            pos = buf.find(b"NCCL", le, end)
            continue
        lineno += buf.count(b"\n", line_start_prev, ls)
        line_start_prev = ls
        yield LogLine(source, lineno + 1, buf[ls:le].decode("utf-8", "replace"))
        pos = buf.find(b"NCCL", le, end)


# First words of the INFO/TRACE messages the analyzer reads (a prefix of each of its handlers' words); every other
# INFO line can be skipped unread. tests/test_nccl_log.py checks that the two lists agree.
_RELEVANT_WORDS = (
    b"Channel",
    b"Ring",
    b"Coll",
    b"comm",
    b"NCCL",
    b"Using",
    b"NET/",
    b"Bootstrap",
    b"Initialized",
    b"Failed",
)


def _relevant(buf: bytes, ls: int, pos: int, le: int) -> bool:
    """Whether the line buf[ls:le], with "NCCL" at pos, holds a record the analyzer reads."""
    while pos != -1:
        after = pos + 4
        if buf.startswith((b" WARN", b" version"), after):
            return True
        if buf.startswith((b" INFO ", b" TRACE "), after) and buf.startswith(
            _RELEVANT_WORDS, buf.find(b" ", after + 1) + 1
        ):
            return True
        pos = buf.find(b"NCCL", after, le)
    return buf.find(b"- Init ", ls, le) != -1  # "<func> comm 0x... rank ... - Init COMPLETE"


# --------------------------------------------------------------------------------------------------------------
# Line grammar (see shared/reference/nccl-log-formats.md for every format and the release that prints it)
# --------------------------------------------------------------------------------------------------------------

_MARK = re.compile(r"NCCL (INFO|WARN|TRACE) ")
# "<host>:<pid>:<tid> [<cudaDev>]"; the host part is missing in some pasted logs (" [0] NCCL INFO ...").
_HOST_PID = re.compile(r"([^\s:\[\]()<>|,=]+):(\d+):(\d+) \Z")
_RAY = re.compile(r"\((?:[^()\s]+ )?pid=(\d+)(?:, ip=([^)\s,]+))?[^)]*\)")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\]")
_HEX = re.compile(r"0x[0-9a-fA-F]+")

_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)(\S*)")
_CONN = re.compile(
    r"(?:Channel|Ring) (\d+)(?:/(\d+))? : (\d+)(?:\[[0-9a-fA-F]+\])? -> (\d+)(?:\[[0-9a-fA-F]+\])?"
    r"(?: \[(send|receive)\])? via (.+)"
)
_COLLNET = re.compile(r"Coll(?:Net)? (\d+)(?:/(\d+))? : (\d+) \[(send|receive)\] via (.+)")
_NET_VIA = re.compile(r"NET/(.+?)/\d+")
_INIT = re.compile(r"comm (0x[0-9a-fA-F]+) rank (\d+) nranks (\d+) cudaDev (-?\d+)(.*?) - Init (START|COMPLETE)")
_COMM_ID = re.compile(r"commId (0x[0-9a-fA-F]+)")
_NNODES = re.compile(r"comm (0x[0-9a-fA-F]+) rank (\d+) nRanks (\d+) nNodes (\d+)")
_OFI_PROVIDER = re.compile(
    r"Selected [Pp]rovider is ([^,(]+?)(?:, fabric is ([^,(\s]+))?(?: \(found (\d+) nics?\))?\s*$"
)
_OFI_VERSION = re.compile(r"(?:Using|Initializing) aws-ofi-nccl (\S+)")
_PLUGIN_LOADED = re.compile(r"Loaded (?:net|NET) plugin (.+?) \(v\d+\)")
_IB_USING = re.compile(r"Using(.*?)\s*;\s*OOB ([^:\s]+):([^<\s]+)")
_IB_DEV = re.compile(r"\[\d+\]([^\s\[\]]+)")
_IFACE = re.compile(r"\[\d+\]([^:\s]+):([^<\s]+)")
_BOOTSTRAP = re.compile(r"Using (?:\[\d+\])?([^:\s\[]+):([^<\s]+)")

# Transport label -> what it can tell: P2P/SHM/NVLS never leave a node; NET and CollNet are the network.
_INTRA_PREFIXES = ("P2P/", "SHM", "NVLS")


def _header(text: str, lo: int, hi: int) -> tuple[int, str, str, int] | None:
    """The last ``<host>:<pid>:<tid> [<cudaDev>]`` in text[lo:hi] as (start, host, pid, cudaDev); host may be absent.

    Found from the right with str.rfind rather than a regex scan from the left: this runs for every line read.
    """
    j = text.rfind("[", lo, hi)
    while j != -1:
        k = text.find("]", j + 1, hi)
        digits = text[j + 1 : k] if k != -1 else ""
        if digits.isdecimal() and digits.isascii():
            # A hostname has at most 63 characters, pid and tid at most 10 digits each.
            m = _HOST_PID.search(text, max(lo, j - 90), j) if j > lo and text[j - 1] == " " else None
            if m:
                return m.start(), m.group(1), m.group(2), int(digits)
            return j, "", "", int(digits)
        j = text.rfind("[", lo, j)
    return None


def _parse_prefix(prefix: str) -> tuple[str, str, int, str | None]:
    """(host, pid, cudaDev, Ray node address) from what precedes ``NCCL INFO``; "" / -1 / None where absent."""
    host = pid = ""
    dev = -1
    header = _header(prefix, 0, len(prefix))
    if header:
        _, host, pid, dev = header
    ray_ip = None
    if "pid=" in prefix:
        ray = _RAY.search(prefix)
        if ray:
            pid = pid or ray.group(1)
            ray_ip = ray.group(2)
    return host, pid, dev, ray_ip


def _transport(via: str) -> tuple[str, bool]:
    """Normalise the text after ``via``: ``NET/AWS Libfabric/1/GDRDMA`` -> (``NET/AWS Libfabric``, True)."""
    via = via.strip()
    cut = via.find(" comm 0x")  # RCCL appends " comm 0x... nRanks 02"
    if cut > 0:
        via = via[:cut]
    gdr = "/GDRDMA" in via
    if via.startswith("NET/"):
        m = _NET_VIA.match(via)
        name = m.group(1) if m else via[4:].split("/")[0]
        return "NET/" + name[:40], gdr
    if via.startswith("COLLNET/"):
        return "CollNet/" + via[8:].split("/")[0][:40], gdr
    if via.startswith("P2P/"):
        return "P2P/" + via[4:].split("/")[0].split(" ")[0][:20], False
    if via.startswith(("SHM", "direct shared memory")):
        return "SHM", False
    if via.startswith("NVLS"):
        return "NVLS", False
    return (via.split("/")[0].split(" ")[0][:20] or "?"), gdr


def _name_family(name: str) -> str:
    """Family of a NET plugin name: ``socket``, ``ib``, ``ofi`` (decided by the libfabric provider) or ``other``."""
    n = name.lower()
    if "socket" in n:
        return "socket"
    if n.startswith("ib") or n in ("sharp", "rdma"):
        return "ib"
    if "libfabric" in n or "ofi" in n:
        return "ofi"
    return "other"


def _provider_family(provider: str) -> str:
    p = provider.strip().lower()
    first = p.split(";")[0]
    if first.startswith("efa"):
        return "efa"
    if "verbs" in p:
        return "ib"
    if first in ("tcp", "sockets", "udp", "shm"):
        return "socket"
    return "other"


# --------------------------------------------------------------------------------------------------------------
# The analyzer
# --------------------------------------------------------------------------------------------------------------

ProcKey = tuple[str, str]  # (hostname, pid), as the NCCL prefix gives them
ConnKey = tuple[int, int, int, int, str, str, bool]  # channel, connIndex, from, to, direction, label, gdr
CommKey = tuple[str, str | int]  # ("id", commId) from 2.18, else ("n", nranks)


@dataclass
class _Comm:
    ptr: str
    rank: int
    nranks: int
    key: CommKey
    nnodes: int | None = None


@dataclass
class _Ctx:
    """One device of one process: the unit whose lines follow each other during a communicator's setup."""

    proc: ProcKey
    dev: int
    open: _Comm | None = None  # between "Init START" (or the nNodes line) and "Init COMPLETE"
    last: _Comm | None = None  # the last communicator completed
    pending: dict[ConnKey, LineRef | None] = field(default_factory=dict)
    ranks: set[tuple[int, int, CommKey]] = field(default_factory=set)


@dataclass
class _Proc:
    host: str
    pid: str
    ctxs: dict[int, _Ctx] = field(default_factory=dict)
    ips: set[str] = field(default_factory=set)  # bootstrap / OOB addresses
    ray_ips: set[str] = field(default_factory=set)
    version: str | None = None
    networks: Counter[str] = field(default_factory=Counter)
    provider: str | None = None
    warnings: int = 0
    initialized: set[str] = field(default_factory=set)


class NcclLogAnalyzer:
    """Streaming state machine over NCCL log lines; :meth:`feed` each line, then :meth:`finish` once.

    Example::

        a = NcclLogAnalyzer()
        for line in iter_log_lines(["worker-0.out", "worker-1.out"]):
            a.feed(line.text, line.source, line.lineno)
        report = a.finish()
    """

    def __init__(self) -> None:
        self._procs: dict[ProcKey, _Proc] = {}
        self._members: dict[CommKey, dict[int, set[ProcKey]]] = {}
        self._comm_nnodes: dict[CommKey, int] = {}
        self._comm_nranks: dict[CommKey, int] = {}
        self._conns: dict[tuple[ProcKey, int, CommKey | None, ConnKey], LineRef | None] = {}
        self._dropped = 0
        self._examples: Counter[str] = Counter()
        self._refs: dict[str, list[LineRef]] = {}
        self._versions: Counter[str] = Counter()
        self._ray_pid_version: dict[tuple[str, str | None], str] = {}
        self._plugin = PluginInfo()
        self._failures: dict[str, LineRef] = {}
        self._warnings: Counter[str] = Counter()
        self._providers: Counter[str] = Counter()
        self._ib_devices: dict[str, None] = {}
        self._ifaces: dict[str, None] = {}
        self._prefixes: dict[str, tuple[str, str, int, str | None]] = {}
        self._lines = 0
        self._nccl_lines = 0
        self._records = 0
        self._handlers: dict[str, Callable[[_Ctx, str, str, Callable[[], LineRef]], None]] = {
            "Channel": self._on_conn,
            "Ring": self._on_conn,
            "CollNet": self._on_collnet,
            "Coll": self._on_collnet,
            "comm": self._on_comm,
            "NCCL": self._on_version,
            "Using": self._on_using,
            "NET/OFI": self._on_ofi,
            "NET/Plugin": self._on_plugin,
            "NET/IB": self._on_ib,
            "NET/Socket": self._on_socket,
            "NET/FastSocket": self._on_socket,
            "Bootstrap": self._on_bootstrap,
            "Initialized": self._on_plugin_misc,
            "Failed": self._on_plugin_misc,
        }

    # -- input ---------------------------------------------------------------------------------------------------

    def feed(self, text: str, source: str = "<input>", lineno: int = 0) -> None:
        """Read one line (with or without its newline); lines that do not mention NCCL cost one substring test."""
        self._lines += 1
        if "NCCL" not in text:
            return
        self._nccl_lines += 1
        if "\x1b" in text:
            text = _ANSI.sub("", text)
        if "\r" in text:  # progress bars rewrite a line with \r; each part is a line of its own
            for part in text.split("\r"):
                if "NCCL" in part:
                    self._feed_line(part, source, lineno)
            return
        self._feed_line(text, source, lineno)

    def _feed_line(self, text: str, source: str, lineno: int) -> None:
        marks = list(_MARK.finditer(text))
        if not marks:
            if "NCCL version" in text:
                self._bare_version(text)
            return
        start = 0
        for i, m in enumerate(marks):
            end = len(text)
            if i + 1 < len(marks):
                # Two records on one line (interleaved writers, CloudWatch " | " joins): this message ends where
                # the next record's "<host>:<pid>:<tid> [<dev>]" begins.
                nxt = marks[i + 1].start()
                header = _header(text, m.end(), nxt)
                end = header[0] if header else nxt
            self._record(m.group(1), text[start : m.start()], text[m.end() : end], text, source, lineno)
            start = end

    def _record(self, level: str, prefix: str, msg: str, raw: str, source: str, lineno: int) -> None:
        msg = msg.strip()
        if msg.endswith("]") and "repeated" in msg:
            msg = _REPEATED.sub("", msg)
        if msg.endswith("|"):
            msg = msg.rstrip(" |")
        sp = msg.find(" ")
        word = (msg if sp < 0 else msg[:sp]).rstrip(":")
        handler = self._handlers.get(word)
        if handler is None and level != "WARN":
            if "- Init " not in msg:
                return  # the common case: an INFO line that says nothing about transports
            handler = self._on_comm
        self._records += 1
        ctx = self._ctx(prefix)

        def ref() -> LineRef:
            return LineRef(source, lineno, raw.strip()[:_MAX_TEXT])

        if level == "WARN":
            self._on_warn(ctx, msg)
        if handler is not None:
            handler(ctx, msg, level, ref)

    def _ctx(self, prefix: str) -> _Ctx:
        # The same prefix comes back on every line of a process and thread (unless a timestamp changes it), so the
        # parsed prefix is cached; the cache is dropped whenever it fills, to keep memory bounded.
        parsed = self._prefixes.get(prefix)
        if parsed is None:
            parsed = _parse_prefix(prefix)
            if len(prefix) <= 256:
                if len(self._prefixes) >= 4096:
                    self._prefixes.clear()
                self._prefixes[prefix] = parsed
        host, pid, dev, ray_ip = parsed
        key = (host, pid)
        proc = self._procs.get(key)
        if proc is None:
            if len(self._procs) >= _MAX_PROCS:
                key = ("", "")
            proc = self._procs.get(key) or self._procs.setdefault(key, _Proc(*key))
        if ray_ip and len(proc.ray_ips) < 4:
            proc.ray_ips.add(ray_ip)
        ctx = proc.ctxs.get(dev)
        if ctx is None:
            if len(proc.ctxs) >= _MAX_DEVS:
                dev = -1
            ctx = proc.ctxs.get(dev) or proc.ctxs.setdefault(dev, _Ctx(key, dev))
        return ctx

    def _keep(self, kind: str, ref: Callable[[], LineRef]) -> None:
        refs = self._refs.get(kind)
        if refs is None:
            if len(self._refs) >= 4 * _MAX_DISTINCT:
                return
            refs = self._refs[kind] = []
        if len(refs) < _MAX_KIND_REFS:
            refs.append(ref())

    # -- handlers ------------------------------------------------------------------------------------------------

    def _on_conn(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        m = _CONN.match(msg)
        if not m:
            return  # ring order ("Channel 00/02 :    0   1") and other Channel lines
        label, gdr = _transport(m.group(6))
        ck = (int(m.group(1)), int(m.group(2) or 0), int(m.group(3)), int(m.group(4)), m.group(5) or "", label, gdr)
        self._add_conn(ctx, ck, label, ref)

    def _on_collnet(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        m = _COLLNET.match(msg)
        if m:
            label, gdr = _transport(m.group(5))
            ck = (int(m.group(1)), int(m.group(2) or 0), int(m.group(3)), -1, m.group(4), label, gdr)
            self._add_conn(ctx, ck, label, ref)

    def _add_conn(self, ctx: _Ctx, ck: ConnKey, label: str, ref: Callable[[], LineRef]) -> None:
        if ck in ctx.pending:
            return
        example = None
        if self._examples[label] < _MAX_EXAMPLES and len(self._examples) < _MAX_DISTINCT:
            self._examples[label] += 1
            example = ref()
        ctx.pending[ck] = example
        if len(ctx.pending) > 4096:  # a process that never logs its communicator: don't let pending grow
            self._flush(ctx, ctx.open or ctx.last)

    def _on_comm(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        m = _INIT.search(msg)
        if m:
            cid = _COMM_ID.search(m.group(5))
            nranks = int(m.group(3))
            if not 0 <= int(m.group(2)) < nranks:
                return  # not a line NCCL wrote
            key: CommKey = ("id", cid.group(1)) if cid else ("n", nranks)
            comm = _Comm(m.group(1), int(m.group(2)), nranks, key)
            if m.group(6) == "START":
                self._flush(ctx, ctx.last)
                ctx.open = comm
            else:
                if ctx.open is not None and ctx.open.ptr == comm.ptr:
                    comm.nnodes = ctx.open.nnodes
                self._flush(ctx, comm)
                ctx.last, ctx.open = comm, None
            self._join(ctx, comm)
            return
        m = _NNODES.search(msg)
        if m and 0 <= int(m.group(2)) < int(m.group(3)) and int(m.group(4)) > 0:
            nnodes = int(m.group(4))
            if ctx.open is not None and ctx.open.ptr == m.group(1):
                ctx.open.nnodes = nnodes
            else:
                self._flush(ctx, ctx.last)
                ctx.open = _Comm(m.group(1), int(m.group(2)), int(m.group(3)), ("n", int(m.group(3))), nnodes)
            self._join(ctx, ctx.open)
            self._keep("nnodes>1" if nnodes > 1 else "nnodes=1", ref)

    def _join(self, ctx: _Ctx, comm: _Comm) -> None:
        if comm.key not in self._members and len(self._members) >= _MAX_COMMS:
            return
        members = self._members.setdefault(comm.key, {})
        members.setdefault(comm.rank, set()).add(ctx.proc)
        self._comm_nranks[comm.key] = comm.nranks
        if comm.nnodes is not None:
            self._comm_nnodes[comm.key] = max(comm.nnodes, self._comm_nnodes.get(comm.key, 0))
        if len(ctx.ranks) < _MAX_DISTINCT:
            ctx.ranks.add((comm.rank, comm.nranks, comm.key))

    def _flush(self, ctx: _Ctx, comm: _Comm | None) -> None:
        """File the connections seen since the last boundary under the communicator they belong to."""
        if not ctx.pending:
            return
        for ck, example in ctx.pending.items():
            printer = ck[3] if ck[4] == "receive" else ck[2]
            # Connections made at run time (p2p, connIndex 1) may belong to an earlier communicator: the rank that
            # printed the line tells which.
            owner = comm
            if owner is not None and owner.rank != printer:
                owner = ctx.last if ctx.last is not None and ctx.last.rank == printer else None
            gk = (ctx.proc, ctx.dev, owner.key if owner else None, ck)
            if gk in self._conns:
                continue
            if len(self._conns) >= _MAX_CONNECTIONS:
                self._dropped += 1
                continue
            self._conns[gk] = example
        ctx.pending.clear()

    def _on_version(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        m = _VERSION.match(msg)
        if m:
            self._procs[ctx.proc].version = m.group(1)
            self._add_version(m.group(1))

    def _bare_version(self, text: str) -> None:
        # Up to 2.21 the version is a bare printf line: no NCCL prefix, at most a Ray prefix naming the pid.
        m = _VERSION.search(text)
        if not m:
            return
        self._add_version(m.group(1))
        if "pid=" in text:
            ray = _RAY.search(text)
            if ray and len(self._ray_pid_version) < _MAX_PROCS:
                self._ray_pid_version[(ray.group(1), ray.group(2))] = m.group(1)

    def _add_version(self, version: str) -> None:
        if version in self._versions or len(self._versions) < _MAX_DISTINCT:
            self._versions[version] += 1

    def _on_using(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        for lead in ("Using network ", "Using internal Network "):
            if msg.startswith(lead):
                name = msg[len(lead) :].strip()[:40]
                proc = self._procs[ctx.proc]
                if name in proc.networks or len(proc.networks) < 8:
                    proc.networks[name] += 1
                self._keep("network:" + name, ref)
                return

    def _on_ofi(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        body = msg[7:].strip()
        proc = self._procs[ctx.proc]
        m = _OFI_PROVIDER.search(body)
        if m:
            provider = m.group(1).strip()[:40]
            proc.provider = provider
            if provider in self._providers or len(self._providers) < 8:
                self._providers[provider] += 1
            p = self._plugin
            if m.group(2) and m.group(2) not in p.fabrics and len(p.fabrics) < 8:
                p.fabrics.append(m.group(2))
            if m.group(3):
                p.nics = max(p.nics or 0, int(m.group(3)))
            self._keep("provider:" + _provider_family(provider), ref)
            return
        m = _OFI_VERSION.search(body)
        if m:
            self._plugin.ofi_version = self._plugin.ofi_version or m.group(1)
            return
        if "disabling GDR" in body or "GDR not supported" in body:
            self._plugin.gdr_disabled = True
        if level == "WARN" or "No eligible providers" in body or "initialization failed" in body:
            self._failure(msg, ref)

    def _on_plugin(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        if "CollNet" in msg:
            return  # "Failed to find ncclCollNetPlugin_v4 symbol": only CollNet is missing, the plugin is fine
        m = _PLUGIN_LOADED.search(msg)
        if m:
            name = m.group(1).strip()[:40]
            if name not in self._plugin.external and len(self._plugin.external) < 8:
                self._plugin.external.append(name)
            return
        if "dlerror" in msg or "returned" in msg:
            self._failure(msg, ref)
        if "No plugin found" in msg or "internal" in msg or "Could not find" in msg:
            self._plugin.internal = True

    def _on_plugin_misc(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        if msg.startswith("Failed to initialize") and "NET plugin" in msg:
            self._failure(msg, ref)
        elif msg.startswith("Initialized NET plugin "):
            proc = self._procs[ctx.proc]
            if len(proc.initialized) < 8:
                proc.initialized.add(msg[len("Initialized NET plugin ") :].strip()[:40])

    def _on_ib(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        if "No device found" in msg:
            self._keep("ib-no-device", ref)
            return
        m = _IB_USING.search(msg)
        if m:
            devices = _IB_DEV.findall(m.group(1))
            for d in devices:
                if d not in self._ib_devices and len(self._ib_devices) < _MAX_DISTINCT:
                    self._ib_devices[d] = None
            self._add_ip(ctx, m.group(3))
            if devices:
                self._keep("ib-using", ref)
        elif "Failed to open libibverbs" in msg:
            self._keep("ib-no-device", ref)

    def _on_socket(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        for iface, ip in _IFACE.findall(msg):
            name = f"{iface}:{ip}"
            if name not in self._ifaces and len(self._ifaces) < _MAX_DISTINCT:
                self._ifaces[name] = None
            self._add_ip(ctx, ip)

    def _on_bootstrap(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        m = _BOOTSTRAP.search(msg)
        if m:
            self._add_ip(ctx, m.group(2))

    def _add_ip(self, ctx: _Ctx, ip: str) -> None:
        proc = self._procs[ctx.proc]
        if len(proc.ips) < 4:
            proc.ips.add(ip)

    def _on_warn(self, ctx: _Ctx, msg: str) -> None:
        proc = self._procs[ctx.proc]
        proc.warnings += 1
        key = _HEX.sub("0x…", msg)[:200]
        if key in self._warnings or len(self._warnings) < _MAX_DISTINCT:
            self._warnings[key] += 1

    def _failure(self, msg: str, ref: Callable[[], LineRef]) -> None:
        key = _HEX.sub("0x…", msg)[:200]
        if key not in self._failures and len(self._failures) < 20:
            self._failures[key] = ref()

    # -- verdict -------------------------------------------------------------------------------------------------

    def finish(self) -> TransportReport:
        """Decide the verdict from everything fed so far and build the report."""
        for proc in self._procs.values():
            for ctx in proc.ctxs.values():
                if ctx.open is not None:
                    self._join(ctx, ctx.open)  # the log ends during setup: the rank is still known
                self._flush(ctx, ctx.open or ctx.last)
        return _Decision(self).report()


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

    def report(self) -> TransportReport:
        a = self.a
        inter: Counter[str] = Counter()
        intra: Counter[str] = Counter()
        families: Counter[str] = Counter()
        gdr = presumed = net_same_node = 0
        per_ctx_inter: dict[tuple[ProcKey, int], Counter[str]] = {}
        per_ctx_intra: dict[tuple[ProcKey, int], Counter[str]] = {}
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
            per_ctx_inter.setdefault((proc, dev), Counter())[label] += 1
            fam = self.family(label, proc)
            families[fam] += 1
            if example is not None:
                deciding.setdefault(fam, []).append((proc, example))

        verdict, reason, evidence = self._verdict(families, inter, intra, deciding, intra_examples)
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
            self.notes.append(f"{a._dropped} connection line(s) beyond the first {_MAX_CONNECTIONS} were not tracked")
        return self._build(verdict, reason, evidence, inter, intra, gdr, per_ctx_inter, per_ctx_intra)

    def _verdict(
        self,
        families: Counter[str],
        inter: Counter[str],
        intra: Counter[str],
        deciding: dict[str, list[tuple[ProcKey, LineRef]]],
        intra_examples: list[LineRef],
    ) -> tuple[str, str, list[LineRef]]:
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
            return verdict, reason, _sorted_refs(lines + self._support(support))
        if multi_comms:
            return self._from_selected_network(multi_comms)
        if intra or any(n == 1 for n in a._comm_nnodes.values()):
            where = f" on host {next(iter(hosts))}" if len(hosts) == 1 else ""
            what = f"{sum(intra.values())} connection line(s) ({_counts(dict(intra))})" if intra else "communicators"
            reason = f"all {what}{where} stay inside one node; no rank talks to another host"
            return "single-node", reason, _sorted_refs(intra_examples + self._support(["nnodes=1"]))
        if not a._nccl_lines:
            return "inconclusive", "no NCCL set-up lines found: was the job run with NCCL_DEBUG=INFO?", []
        networks = sorted({n for p in a._procs.values() for n in p.networks})
        said = f"; NCCL selected network {', '.join(networks)}" if networks else ""
        reason = (
            "the log holds no connection or communicator lines (it may end before NCCL connected its peers, "
            f"or NCCL_DEBUG was below INFO){said}"
        )
        return "inconclusive", reason, _sorted_refs(self._support([f"network:{n}" for n in networks] + ["failure"]))

    def _from_selected_network(self, multi_comms: list[CommKey]) -> tuple[str, str, list[LineRef]]:
        # Rule of thumb: a communicator that spans nodes must send its inter-node traffic over the one network
        # NCCL selected for it. Good enough when the per-connection lines were not logged (or cut off).
        a = self.a
        members = {p for k in multi_comms for ps in a._members.get(k, {}).values() for p in ps}
        fams: Counter[str] = Counter()
        for p in members or a._procs:
            for name in a._procs[p].networks:
                fam = _name_family(name)
                if fam == "ofi":
                    prov = a._procs[p].provider
                    fam = _provider_family(prov) if prov else (self.global_provider or "efa")
                fams[fam] += 1
        base = "no per-connection lines were logged, but a communicator spans several nodes"
        support = ["nnodes>1"] + [f"network:{n}" for p in a._procs.values() for n in p.networks]
        if fams["socket"]:
            return "socket", f"{base} and NCCL selected Socket on some ranks", _sorted_refs(self._support(support))
        if set(fams) in ({"efa"}, {"ib"}):
            fam = next(iter(fams))
            title = {"efa": "aws-ofi-nccl (efa provider)", "ib": "IB"}[fam]
            support += ["provider:efa"] if fam == "efa" else ["ib-using"]
            return fam, f"{base} and NCCL selected {title}", _sorted_refs(self._support(support))
        return "inconclusive", f"{base}; the network NCCL selected is unknown", _sorted_refs(self._support(support))

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


# --------------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------------


def analyze(lines: Iterable[str], *, source: str = "<input>") -> TransportReport:
    """Analyze NCCL log lines given as strings (one per item, newline optional) and return the report.

    Example::

        report = analyze(open("worker-0.out", encoding="utf-8", errors="replace"))
        report.verdict
    """
    a = NcclLogAnalyzer()
    for n, line in enumerate(lines, 1):
        a.feed(line, source, n)
    return a.finish()


def analyze_paths(
    paths: Sequence[str | os.PathLike[str]],
    *,
    stdin: BinaryIO | None = None,
    progress: Callable[[int], None] | None = None,
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
    report = a.finish()
    report.stats.update(files=stats.files, bytes=stats.bytes, lines=stats.lines)
    report.notes[:0] = stats.notes
    if stats.files == 0:
        report.notes.append("no readable text files were found")
    return report
