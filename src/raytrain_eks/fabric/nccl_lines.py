"""Reading NCCL logs: files, folders, .gz and stdin with flat memory, line prefixes, and the per-line state machine.

Lines may carry prefixes added by Ray, Kubernetes, mpirun, CloudWatch or timestamps, colour codes, and the
interleaved output of many ranks. :class:`NcclLineReader` turns them into per-process, per-communicator state
(networks selected, plugin lines, connections); :mod:`raytrain_eks.fabric.nccl_verdict` decides from that state.
Memory depends on the job's topology (processes, communicators, connections), never on the size of the log.
Example::

    reader = NcclLineReader()
    for line in iter_log_lines(["worker-0.out"]):
        reader.feed(line.text, line.source, line.lineno)
"""

from __future__ import annotations

import gzip
import os
import re
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NamedTuple

from raytrain_eks.errors import UserError
from raytrain_eks.fabric.nccl_report import LineRef, PluginInfo
from raytrain_eks.fabric.nccl_usage import ProcUsage

# How the training job names each worker's NCCL debug file (NCCL_DEBUG_FILE):
# "raytrain-eks-nccl.<token>.<host>.<pid>.log", directly in the worker's /tmp (its own disk: workers
# may not share the run folder). Not in a folder of its own: NCCL opens the file with a bare fopen and logs to stdout
# when that fails, and nothing creates a folder before NCCL starts.
NCCL_LOG_PREFIX = "raytrain-eks-nccl."
# Where those files lie: /tmp, which every Linux worker has, whatever TMPDIR the driver that sets NCCL_DEBUG_FILE
# has (a driver's own temporary directory may not exist on the workers, and NCCL would then log to stdout unseen).
NCCL_LOG_DIR = "/tmp"

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
    *(str(d).encode() for d in range(1, 10)),  # "8 coll channels, ..."
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
# Ray's driver prints the first of the lines that several workers print alike and folds the rest into one later copy
# of it, " [repeated 15x across cluster]": one worker's line then stands for that many more.
_REPEATED = re.compile(r"\s*\[repeated (\d+)x across cluster\]")
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
    # What this process said about the networks NCCL could select, for logs without connection lines: the
    # aws-ofi-nccl plugin failed; IB/RoCE devices were found; no IB device was (so only Socket was left).
    ofi_failed: bool = False
    ib_devices: bool = False
    ib_absent: bool = False
    # Other workers whose identical network lines Ray folded into this process's ("repeated Nx across cluster").
    folded: int = 0
    usage: ProcUsage = field(default_factory=ProcUsage)  # EFA devices, GDR and channels, for nccl_usage


class NcclLineReader:
    """Streaming state machine over NCCL log lines: :meth:`feed` each line, then :meth:`close` once.

    It only collects (processes, communicators, connections, plugin lines); the verdict is decided by
    :class:`raytrain_eks.fabric.nccl_verdict.NcclLogAnalyzer`, which adds ``finish()``. Example::

        reader = NcclLineReader()
        for line in iter_log_lines(["worker-0.out"]):
            reader.feed(line.text, line.source, line.lineno)
        reader.close()
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
        self._folded = 0  # "[repeated Nx across cluster]" of the record being read
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
        self._folded = 0
        if msg.endswith("]") and "repeated" in msg:
            folded = _REPEATED.search(msg)
            if folded:
                self._folded = int(folded.group(1))
                msg = msg[: folded.start()] + msg[folded.end() :]
        if msg.endswith("|"):
            msg = msg.rstrip(" |")
        sp = msg.find(" ")
        word = (msg if sp < 0 else msg[:sp]).rstrip(":")
        handler = self._handlers.get(word)
        if handler is None and level != "WARN":
            if word.isdecimal() and "coll channels" in msg:
                handler = self._on_counts
            elif "- Init " not in msg:
                return  # the common case: an INFO line that says nothing about transports
            else:
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
        if label.startswith("NET/"):
            self._procs[ctx.proc].usage.read_conn(m.group(6), gdr, ref)

    def _on_counts(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        self._procs[ctx.proc].usage.read_counts(msg, ref)

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
            self._procs[ctx.proc].usage.read_counts(msg, ref)

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
                proc.folded = max(proc.folded, self._folded)
                self._keep("network:" + name, ref)
                return

    def _on_ofi(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        body = msg[7:].strip()
        proc = self._procs[ctx.proc]
        m = _OFI_PROVIDER.search(body)
        if m:
            provider = m.group(1).strip()[:40]
            proc.provider = provider
            proc.folded = max(proc.folded, self._folded)
            if provider in self._providers or len(self._providers) < 8:
                self._providers[provider] += 1
            p = self._plugin
            if m.group(2) and m.group(2) not in p.fabrics and len(p.fabrics) < 8:
                p.fabrics.append(m.group(2))
            if m.group(3):
                p.nics = max(p.nics or 0, int(m.group(3)))
            self._keep("provider:" + _provider_family(provider), ref)
            proc.usage.read_ofi(body, m.group(3), ref)
            return
        proc.usage.read_ofi(body, None, ref)
        m = _OFI_VERSION.search(body)
        if m:
            self._plugin.ofi_version = self._plugin.ofi_version or m.group(1)
            return
        if "disabling GDR" in body or "GDR not supported" in body:
            self._plugin.gdr_disabled = True
        if level == "WARN" or "No eligible providers" in body or "initialization failed" in body:
            proc.ofi_failed = True
            proc.folded = max(proc.folded, self._folded)
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
        if msg.startswith("Failed to open libibverbs"):  # 2.18+: no verbs library, so no IB device either
            self._procs[ctx.proc].ib_absent = True
            self._keep("ib-no-device", ref)
        elif msg.startswith("Failed to initialize") and "NET plugin" in msg:
            # 2.27+: "Failed to initialize NET plugin IB" (no IB device), "... NET plugin Libfabric" (the plugin
            # failed), "Failed to initialize any NET plugin".
            name = msg.rsplit("NET plugin", 1)[1].strip()
            family = _name_family(name)
            proc = self._procs[ctx.proc]
            if family == "ib":
                proc.ib_absent = True
                self._keep("ib-no-device", ref)
            else:
                proc.ofi_failed = proc.ofi_failed or family == "ofi"
                self._failure(msg, ref)
        elif msg.startswith("Initialized NET plugin "):
            proc = self._procs[ctx.proc]
            if len(proc.initialized) < 8:
                proc.initialized.add(msg[len("Initialized NET plugin ") :].strip()[:40])

    def _on_ib(self, ctx: _Ctx, msg: str, level: str, ref: Callable[[], LineRef]) -> None:
        if "No device found" in msg:
            self._procs[ctx.proc].ib_absent = True
            self._procs[ctx.proc].folded = max(self._procs[ctx.proc].folded, self._folded)
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
                self._procs[ctx.proc].ib_devices = True
                self._keep("ib-using", ref)
        elif "Failed to open libibverbs" in msg:
            self._procs[ctx.proc].ib_absent = True
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

    def close(self) -> None:
        """File what is still pending at the end of the input (a log may end during a communicator's setup)."""
        for proc in self._procs.values():
            for ctx in proc.ctxs.values():
                if ctx.open is not None:
                    self._join(ctx, ctx.open)  # the log ends during setup: the rank is still known
                self._flush(ctx, ctx.open or ctx.last)
