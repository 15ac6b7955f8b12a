"""The collective bandwidth probe: how fast all_reduce, all_gather and reduce_scatter really run between the nodes.

A ``TorchTrainer`` starts one worker per GPU (NCCL) or two CPU workers (gloo), exactly where training would put
them, and times each collective over a range of message sizes. Bandwidth is computed as nccl-tests does it
(``doc/PERFORMANCE.md`` there): for ``S`` bytes in ``t`` seconds on ``n`` ranks,

- algorithm bandwidth ``algbw = S / t``;
- bus bandwidth ``busbw = algbw * 2(n-1)/n`` for all_reduce and ``algbw * (n-1)/n`` for all_gather and
  reduce_scatter, where ``S`` is the size of the whole gathered output (all_gather) or of the whole input
  (reduce_scatter), and ``t`` is the mean time of one call, averaged over the ranks.

busbw is comparable across collectives and rank counts: it approaches the bandwidth of the slowest link, here
the inter-node fabric. The verdict compares the best large-message busbw with the expected line rate (the
``fabric.expected_gbps`` setting, else the network rate of the GPU nodes' instance type when the cluster's deployment
record gives it, e.g. 40 Gbit/s for g6.12xlarge)::

    report = run_probe(load_config(preset=reference()), ProbeSpec(), address="auto")
    print(report.render())
    sys.exit(report.exit_code)      # 0 healthy, 1 degraded, 2 undecided (single node, or no line rate known)

The pure parts (:func:`message_sizes`, :func:`bus_factor`, :func:`summarize`, :func:`judge`,
:func:`expected_line_rate`) need no Ray and no torch.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.instances import INSTANCE_TYPES

OPS = ("all_reduce", "all_gather", "reduce_scatter")
"""The collectives the probe times, in the order it runs them."""

VERDICTS = ("healthy", "degraded", "single-node", "unknown")
"""``healthy``/``degraded``: busbw against the line rate; ``single-node``: no traffic crossed nodes, so the
fabric was never measured; ``unknown``: no expected line rate (pass ``--expected-gbps``)."""

HEALTHY_RATIO = 0.5
"""busbw at or above this fraction of the line rate is healthy.

Healthy EFA clusters reach roughly 70-95% of the line rate in nccl-tests' inter-node busbw; a fallback from EFA to
TCP sockets, a missing EFA device in one pod or a throttled link lands far below half (on p4d/p5 below 10%).
Half leaves room for the protocol overhead of smaller instances without hiding a real fallback."""

LARGE_MESSAGE_BYTES = 64 << 20
"""Messages from this size up count as large: below it latency, not the link, limits the bandwidth. When the
largest measured size is smaller (short CPU runs), the largest measured size counts as large."""

DEFAULT_MIN_BYTES = 1 << 20
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_ITERS = 20
DEFAULT_WARMUP = 5
ELEMENT_BYTES = 4  # float32, nccl-tests' default data type

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


class ProbeError(UserError):
    """The probe could not run or could not measure (bad sizes, too few workers, a failed collective)."""

    exit_code = 2


# --------------------------------------------------------------------------------------------------------------
# Pure computation
# --------------------------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from ``"64M"``, ``"1GiB"``, ``"512k"`` or ``"4096"`` (binary units, like nccl-tests' ``-b``/``-e``).

    Example: ``parse_size("1G") == 1 << 30``.
    """
    m = _SIZE.match(text)
    if not m:
        raise ProbeError(f"size {text!r} is not understood", hint="Use bytes or a K/M/G suffix, e.g. 1M or 1GiB.")
    number, unit = float(m.group(1)), m.group(2).lower()
    value = int(number * (1 << (10 * " kmgt".index(unit or " "))))
    if value <= 0:
        raise ProbeError(f"size {text!r} must be positive")
    return value


def format_size(nbytes: int) -> str:
    """``1048576`` -> ``"1 MiB"``; sizes that are no whole unit keep their bytes: ``"1000 B"``."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """``min_bytes``, then times ``factor`` up to ``max_bytes`` (included when reached exactly, as nccl-tests).

    Example: ``message_sizes(1 << 20, 4 << 20) == [1 << 20, 2 << 20, 4 << 20]``.
    """
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ProbeError(
            f"message sizes {min_bytes}..{max_bytes} bytes are not a range",
            hint="--min-bytes must be positive and at most --max-bytes.",
        )
    if factor < 2:
        raise ProbeError(f"size factor {factor} must be at least 2")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def op_elements(op: str, nbytes: int, world: int) -> tuple[int, int]:
    """(elements each rank sends in, bytes the measurement counts) for a message of ``nbytes``.

    all_reduce reduces ``nbytes`` on every rank; all_gather gathers ``nbytes`` in total (``nbytes / n`` from each
    rank); reduce_scatter reduces an input of ``nbytes``, leaving ``nbytes / n`` on each rank. The size is rounded
    down to whole float32 elements per rank, and the rounded size is what is counted.
    """
    _check_op(op)
    if op == "all_reduce":
        count = nbytes // ELEMENT_BYTES
        return count, count * ELEMENT_BYTES
    per_rank = nbytes // (ELEMENT_BYTES * world)
    return per_rank, per_rank * world * ELEMENT_BYTES


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw for ``op`` on ``world`` ranks: ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` otherwise.

    Example: ``bus_factor("all_reduce", 8) == 1.75``.
    """
    _check_op(op)
    if world < 1:
        raise ValueError(f"world size {world} must be at least 1")
    share = (world - 1) / world
    return 2 * share if op == "all_reduce" else share


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes per second: ``nbytes / seconds``."""
    if seconds <= 0:
        raise ValueError(f"time {seconds} must be positive")
    return nbytes / seconds


def busbw(op: str, nbytes: int, seconds: float, world: int) -> float:
    """Bus bandwidth in bytes per second, as nccl-tests reports it."""
    return algbw(nbytes, seconds) * bus_factor(op, world)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ProbeError(f"collective {op!r} is not one the probe runs", hint=f"Choose from: {', '.join(OPS)}.")


@dataclass(frozen=True)
class Measurement:
    """One collective at one size: mean seconds per call (averaged over ranks) and the two bandwidths in B/s."""

    op: str
    bytes: int
    seconds: float
    algbw: float
    busbw: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "bytes": self.bytes,
            "time_us": round(self.seconds * 1e6, 3),
            "algbw_GBps": round(self.algbw / 1e9, 6),
            "busbw_GBps": round(self.busbw / 1e9, 6),
        }


def summarize(
    ops: Sequence[str], sizes: Sequence[int], rank_times: Sequence[Mapping[str, Sequence[float]]]
) -> list[Measurement]:
    """Turn each rank's seconds per call into :class:`Measurement` rows (ops in order, sizes ascending).

    ``rank_times[r][op][i]`` is rank ``r``'s mean seconds per call of ``op`` at ``sizes[i]``. Like nccl-tests'
    default (``-a 1``), the time of a row is the mean over ranks. Example::

        summarize(["all_reduce"], [1 << 20], [{"all_reduce": [0.001]}, {"all_reduce": [0.003]}])[0].seconds  # 0.002
    """
    world = len(rank_times)
    if world == 0:
        raise ProbeError("no rank reported any time")
    rows = []
    for op in ops:
        for i, size in enumerate(sizes):
            _, counted = op_elements(op, size, world)
            if counted == 0:
                continue
            seconds = statistics.fmean(times[op][i] for times in rank_times)
            rows.append(Measurement(op, counted, seconds, algbw(counted, seconds), busbw(op, counted, seconds, world)))
    return rows


@dataclass(frozen=True)
class Verdict:
    """The judgement: ``verdict`` (one of :data:`VERDICTS`), the figures behind it, and one line of reason.

    Rates in Gbit/s (like EC2's network figures); ``ratio`` is best busbw / expected line rate.
    """

    verdict: str
    reason: str
    best_busbw_gbps: float | None
    expected_gbps: float | None
    expected_source: str | None
    ratio: float | None
    healthy_ratio: float
    large_message_bytes: int | None

    @property
    def exit_code(self) -> int:
        return {"healthy": 0, "degraded": 1}.get(self.verdict, 2)


def judge(
    rows: Sequence[Measurement],
    *,
    nodes: int,
    expected_gbps: float | None,
    expected_source: str | None = None,
    healthy_ratio: float = HEALTHY_RATIO,
) -> Verdict:
    """Compare the best large-message busbw (any collective) with the expected line rate.

    Large messages are those of at least :data:`LARGE_MESSAGE_BYTES`, or the largest measured size when every size
    is smaller. Example: a best busbw of 30 Gbit/s against 40 expected is ``healthy`` (75% >= 50%).
    """
    if not rows:
        raise ProbeError("no measurement to judge", hint="Widen --min-bytes/--max-bytes.")
    large = min(LARGE_MESSAGE_BYTES, max(r.bytes for r in rows))
    best = max(r.busbw for r in rows if r.bytes >= large) * 8 / 1e9
    common: dict[str, Any] = {
        "best_busbw_gbps": best,
        "expected_gbps": expected_gbps,
        "expected_source": expected_source,
        "healthy_ratio": healthy_ratio,
        "large_message_bytes": large,
    }
    if nodes < 2:
        reason = "every rank ran on one node, so no traffic crossed the fabric; run with workers on at least two nodes"
        return Verdict("single-node", reason, ratio=None, **common)
    if not expected_gbps:
        reason = (
            "no expected line rate: the nodes' instance type is known only on a cluster this tool deployed and "
            "submitted to; pass --expected-gbps or set fabric.expected_gbps"
        )
        return Verdict("unknown", reason, ratio=None, **common)
    ratio = best / expected_gbps
    verdict = "healthy" if ratio >= healthy_ratio else "degraded"
    relation = ">=" if verdict == "healthy" else "<"
    reason = (
        f"best busbw at >= {format_size(large)}: {best:.3g} Gbit/s = {100 * ratio:.0f}% of the expected "
        f"{expected_gbps:g} Gbit/s ({expected_source}), {relation} {100 * healthy_ratio:.0f}%"
    )
    return Verdict(verdict, reason, ratio=ratio, **common)


def expected_line_rate(
    cfg: Config, override: float | None = None, deployed: Mapping[str, Any] | None = None
) -> tuple[float | None, str | None]:
    """(Gbit/s, where it came from): ``override``, else ``fabric.expected_gbps``, else the network rate of the GPU
    nodes' instance type when it is known: from ``deployed``, the deployment record ``submit`` gave the job
    (:mod:`raytrain_eks.fabric.deployment`). The configuration's instance type says nothing of the nodes of a Ray
    cluster this tool did not deploy, so it is never assumed; ``(None, None)`` then.

    Example: ``expected_line_rate(reference(), deployed={"gpu_node_type": "g6.12xlarge", ...}) == (40, "g6.12xlarge
    network rate")``.
    """
    if override is not None:
        if override <= 0:
            raise ProbeError(f"--expected-gbps {override} must be positive")
        return override, "--expected-gbps"
    if cfg.fabric.expected_gbps is not None:
        return cfg.fabric.expected_gbps, "fabric.expected_gbps"
    it = INSTANCE_TYPES.get(str(deployed.get("gpu_node_type"))) if deployed else None
    if it is None:
        return None, None
    return it.network_gbps, f"{it.name} network rate"


# --------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeSpec:
    """What to measure: collectives, message sizes in bytes (doubling), timed and warm-up calls per size."""

    ops: tuple[str, ...] = OPS
    min_bytes: int = DEFAULT_MIN_BYTES
    max_bytes: int = DEFAULT_MAX_BYTES
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP

    def __post_init__(self) -> None:
        for op in self.ops:
            _check_op(op)
        if not self.ops:
            raise ProbeError("no collective to run", hint=f"Choose from: {', '.join(OPS)}.")
        if self.iters < 1 or self.warmup < 0:
            raise ProbeError(f"--iters {self.iters} must be at least 1 and --warmup {self.warmup} at least 0")
        message_sizes(self.min_bytes, self.max_bytes)

    @property
    def sizes(self) -> list[int]:
        return message_sizes(self.min_bytes, self.max_bytes)


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank ran: its ranks, the Ray node (id and IP) and the device."""

    rank: int
    local_rank: int
    node_rank: int
    node_ip: str
    node_id: str
    device: str


@dataclass
class ProbeReport:
    """What the probe measured, where the ranks ran, and the verdict. :meth:`render` and :meth:`to_json` show it."""

    backend: str
    placements: list[RankPlacement]
    rows: list[Measurement]
    verdict: Verdict
    spec: ProbeSpec
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.placements)

    @property
    def nodes(self) -> dict[str, list[int]]:
        """Node IP -> the ranks on it, in node-rank order."""
        by_node: dict[str, list[int]] = {}
        for p in sorted(self.placements, key=lambda p: (p.node_rank, p.rank)):
            by_node.setdefault(p.node_ip, []).append(p.rank)
        return by_node

    @property
    def num_nodes(self) -> int:
        """Distinct Ray nodes (by node id) that ran a rank."""
        return len({p.node_id for p in self.placements})

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self.verdict),  # verdict, reason, best_busbw_gbps, expected_gbps, ...
            "backend": self.backend,
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "nodes": self.nodes,
            "ranks": [asdict(p) for p in self.placements],
            "spec": {**asdict(self.spec), "ops": list(self.spec.ops)},
            "results": [r.to_dict() for r in self.rows],
            "wall_s": round(self.wall_s, 3),
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def render(self) -> str:
        v = self.verdict
        lines = [
            f"collective bandwidth: {v.verdict.upper()}",
            f"  {v.reason}",
            "",
            f"{self.world_size} ranks on {self.num_nodes} node(s), {self.backend}, {self.spec.iters} timed calls "
            f"per size after {self.spec.warmup} warm-up",
        ]
        lines += [f"  node {ip}: rank(s) {', '.join(map(str, ranks))}" for ip, ranks in self.nodes.items()]
        lines += ["", f"{'collective':<15}{'size':>10}{'time (us)':>14}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"]
        for r in self.rows:
            size, us = format_size(r.bytes), r.seconds * 1e6
            lines.append(f"{r.op:<15}{size:>10}{us:>14.1f}{r.algbw / 1e9:>14.3f}{r.busbw / 1e9:>14.3f}")
        if self.notes:
            lines += ["", "Notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Running it on Ray Train
# --------------------------------------------------------------------------------------------------------------


def run_probe(
    cfg: Config,
    spec: ProbeSpec,
    *,
    address: str | None = None,
    num_workers: int | None = None,
    expected_gbps: float | None = None,
    healthy_ratio: float = HEALTHY_RATIO,
    say: Callable[[str], None] = lambda _line: None,
    verbose: bool = False,
    deployed: Mapping[str, Any] | None = None,
) -> ProbeReport:
    """Run the probe on Ray Train and judge it; raise a :class:`UserError` when it cannot run.

    ``address``: join a cluster (``"auto"`` or ``HOST:PORT``), else start Ray on this machine. ``num_workers``:
    ranks (default ``training.num_workers``; 0 = one per GPU in the cluster, else 2 CPU workers), placed as
    training places them. ``deployed``: the deployment record of the cluster (its nodes' instance type gives the
    expected line rate, see :func:`expected_line_rate`).
    """
    import ray

    from raytrain_eks.ray_session import LOCAL_CPU_WORKERS, init_ray, resolve_num_workers

    t_start = time.perf_counter()
    line_rate, source = expected_line_rate(cfg, expected_gbps, deployed)
    requested = cfg.training.num_workers if num_workers is None else num_workers
    init_ray(address, requested or LOCAL_CPU_WORKERS, verbose)
    workers, use_gpu = resolve_num_workers(requested, int(ray.cluster_resources().get("GPU", 0)))
    if workers < 2:
        raise ProbeError(f"the probe needs at least 2 workers, not {workers}", hint="Pass --num-workers 2 or more.")
    backend = "nccl" if use_gpu else "gloo"
    say(f"ray: {workers} {'GPU' if use_gpu else 'CPU'} workers ({backend}), sizes {_sizes_text(spec)}")

    gathered = _measure(spec, workers, use_gpu)
    return build_report(
        gathered,
        spec,
        expected_gbps=line_rate,
        expected_source=source,
        healthy_ratio=healthy_ratio,
        wall_s=time.perf_counter() - t_start,
    )


def _measure(
    spec: ProbeSpec, workers: int, use_gpu: bool, label_selector: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    """One Ray Train run of :func:`_probe_worker` on ``workers`` ranks; what rank 0 gathered. ``label_selector``:
    each rank's Ray node labels (the pair probe pins each rank to its node by ``ray.io/node-id``)."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Queue

    from raytrain_eks.ray_session import fit_keeping_sigint, worker_error

    queue = Queue(actor_options={"num_cpus": 0})
    storage = tempfile.mkdtemp(prefix="raytrain-eks-probe-")
    trainer = TorchTrainer(
        _probe_worker,
        train_loop_config={
            "ops": list(spec.ops),
            "sizes": spec.sizes,
            "iters": spec.iters,
            "warmup": spec.warmup,
            "queue": queue,
        },
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=use_gpu, label_selector=label_selector),
        run_config=ray.train.RunConfig(
            name="probe", storage_path=storage, failure_config=ray.train.FailureConfig(max_failures=0)
        ),
    )
    try:
        fit_keeping_sigint(trainer)
        gathered: dict[str, Any] = queue.get(timeout=60)
    except Exception as exc:
        raise ProbeError(f"the bandwidth probe failed: {worker_error(exc)}") from None
    finally:
        ray.kill(queue.actor)
        shutil.rmtree(storage, ignore_errors=True)
    return gathered


def build_report(
    gathered: Mapping[str, Any],
    spec: ProbeSpec,
    *,
    expected_gbps: float | None,
    expected_source: str | None,
    healthy_ratio: float = HEALTHY_RATIO,
    wall_s: float = 0.0,
) -> ProbeReport:
    """The report from what rank 0 gathered: ``{"backend": ..., "ranks": [{"placement": {...}, "times": {...}}]}``."""
    ranks = sorted(gathered["ranks"], key=lambda r: r["placement"]["rank"])
    placements = [RankPlacement(**r["placement"]) for r in ranks]
    rows = summarize(spec.ops, spec.sizes, [r["times"] for r in ranks])
    nodes = len({p.node_id for p in placements})
    verdict = judge(
        rows, nodes=nodes, expected_gbps=expected_gbps, expected_source=expected_source, healthy_ratio=healthy_ratio
    )
    notes = []
    if max(spec.sizes) < LARGE_MESSAGE_BYTES:
        notes.append(
            f"the largest message ({format_size(max(spec.sizes))}) is below {format_size(LARGE_MESSAGE_BYTES)}: "
            "latency may hold the bandwidth down; use --max-bytes 1G for a fabric check"
        )
    return ProbeReport(gathered["backend"], placements, rows, verdict, spec, wall_s=wall_s, notes=notes)


# --------------------------------------------------------------------------------------------------------------
# Each pair of nodes
# --------------------------------------------------------------------------------------------------------------

NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its node id (Ray's ``RAY_NODE_ID_KEY``): a rank's label selector on it
places the rank on that node."""


@dataclass(frozen=True)
class ProbeNode:
    """A Ray node the pair probe may use: its id, IP and the ranks it takes (its GPUs, or 1 CPU rank)."""

    node_id: str
    ip: str
    ranks: int


@dataclass
class PairsReport:
    """The probe run between each pair of nodes: per pair, its report (``None`` with the error when it could not
    run). :meth:`to_dict` gives each pair's nodes (IPs), best large-message busbw and verdict."""

    nodes: list[ProbeNode]
    pairs: list[tuple[tuple[str, str], ProbeReport | None, str | None]]
    backend: str

    @property
    def exit_code(self) -> int:
        """1 when a pair is degraded or failed, 2 when none was judged (no line rate, or fewer than 2 nodes)."""
        reports = [r for _, r, _ in self.pairs]
        if any(r is None or r.verdict.verdict == "degraded" for r in reports):
            return 1
        return 0 if reports and all(r is not None and r.verdict.verdict == "healthy" for r in reports) else 2

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "nodes": [asdict(n) for n in self.nodes],
            "pairs": [
                {
                    "nodes": list(ips),
                    "best_busbw_gbps": None if r is None else r.verdict.best_busbw_gbps,
                    "verdict": "failed" if r is None else r.verdict.verdict,
                    "reason": error if r is None else r.verdict.reason,
                    "ranks": 0 if r is None else r.world_size,
                }
                for ips, r, error in self.pairs
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def render(self) -> str:
        lines = [f"collective bandwidth between each pair of {len(self.nodes)} nodes ({self.backend})"]
        for (a, b), report, error in self.pairs:
            said = f"FAILED: {error}" if report is None else f"{report.verdict.verdict}: {report.verdict.reason}"
            lines.append(f"  {a} - {b}: {said}")
        return "\n".join(lines)


def probe_nodes(ray_nodes: Sequence[Mapping[str, Any]], use_gpu: bool) -> list[ProbeNode]:
    """The alive nodes of ``ray.nodes()`` the pair probe uses: those with GPUs (as many ranks as the node with the
    fewest has) when ``use_gpu``, else those with a CPU to give (one rank each), in IP order."""
    key = "GPU" if use_gpu else "CPU"
    found = [n for n in ray_nodes if n.get("Alive") and n.get("Resources", {}).get(key, 0) >= 1]
    ranks = min((int(n["Resources"][key]) for n in found), default=0) if use_gpu else 1
    nodes = [ProbeNode(str(n["NodeID"]), str(n["NodeManagerAddress"]), ranks) for n in found]
    return sorted(nodes, key=lambda n: (tuple(int(x) if x.isdigit() else 0 for x in n.ip.split(".")), n.node_id))


def run_pair_probes(
    cfg: Config,
    spec: ProbeSpec,
    *,
    address: str | None = None,
    expected_gbps: float | None = None,
    healthy_ratio: float = HEALTHY_RATIO,
    say: Callable[[str], None] = lambda _line: None,
    verbose: bool = False,
    deployed: Mapping[str, Any] | None = None,
) -> PairsReport:
    """The probe between each pair of nodes in turn, each rank pinned to its node (a label selector on
    :data:`NODE_ID_LABEL`): on GPU nodes every GPU of both nodes, so the pair's figure is the fabric between them as a
    training run uses it. A pair whose probe fails is kept with its error. Example::

        report = run_pair_probes(cfg, ProbeSpec(ops=("all_reduce",)), address="auto")
        [(ips, r.verdict.best_busbw_gbps) for ips, r, _ in report.pairs if r]
    """
    import itertools

    import ray

    from raytrain_eks.ray_session import init_ray

    line_rate, source = expected_line_rate(cfg, expected_gbps, deployed)
    init_ray(address, 2, verbose)
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    nodes = probe_nodes(ray.nodes(), use_gpu)
    backend = "nccl" if use_gpu else "gloo"
    pairs: list[tuple[tuple[str, str], ProbeReport | None, str | None]] = []
    for a, b in itertools.combinations(nodes, 2):
        say(f"probe: {a.ip} - {b.ip} ({a.ranks} + {b.ranks} {'GPU' if use_gpu else 'CPU'} ranks, {backend})")
        selector = [{NODE_ID_LABEL: a.node_id}] * a.ranks + [{NODE_ID_LABEL: b.node_id}] * b.ranks
        start = time.perf_counter()
        try:
            gathered = _measure(spec, a.ranks + b.ranks, use_gpu, selector)
        except ProbeError as exc:
            pairs.append(((a.ip, b.ip), None, exc.message))
            continue
        report = build_report(
            gathered,
            spec,
            expected_gbps=line_rate,
            expected_source=source,
            healthy_ratio=healthy_ratio,
            wall_s=time.perf_counter() - start,
        )
        pairs.append(((a.ip, b.ip), report, None))
    return PairsReport(nodes, pairs, backend)


def _sizes_text(spec: ProbeSpec) -> str:
    return f"{format_size(spec.min_bytes)}..{format_size(spec.max_bytes)}"


def _probe_worker(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker: time each collective at each size, then gather everything to rank 0."""
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cuda":  # NCCL's object collectives use the current device
        torch.cuda.set_device(device)
    placement = {
        "rank": rank,
        "local_rank": ctx.get_local_rank(),
        "node_rank": ctx.get_node_rank(),
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "device": str(device),
    }
    times: dict[str, list[float]] = {}
    for op in config["ops"]:
        times[op] = [
            _time_collective(op, size, world, device, config["iters"], config["warmup"], torch, dist)
            for size in config["sizes"]
        ]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"placement": placement, "times": times})
    if rank == 0:
        config["queue"].put({"backend": dist.get_backend(), "ranks": gathered})
    dist.barrier()


def _time_collective(op: str, size: int, world: int, device: Any, iters: int, warmup: int, torch: Any, dist: Any):
    """Mean seconds of one call of ``op`` on a message of ``size`` bytes (0.0 when the size rounds to nothing)."""
    count, _ = op_elements(op, size, world)
    if count == 0:
        return 0.0
    if op == "all_reduce":
        buf = torch.zeros(count, dtype=torch.float32, device=device)  # zeros: repeated sums never overflow

        def call() -> None:
            dist.all_reduce(buf)
    elif op == "all_gather":
        send = torch.ones(count, dtype=torch.float32, device=device)
        recv = torch.empty(count * world, dtype=torch.float32, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def call() -> None:
            gather(recv, send)
    else:
        send = torch.zeros(count * world, dtype=torch.float32, device=device)
        recv = torch.empty(count, dtype=torch.float32, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def call() -> None:
            scatter(recv, send)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        call()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    return (time.perf_counter() - start) / iters
