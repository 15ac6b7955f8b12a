"""The bandwidth between each pair of GPU nodes against the expected line rate, and which node the slow pairs point
at. The figures come from the collective probe run on each pair (:func:`raytrain_eks.fabric.probe.run_pair_probes`);
the judging here needs neither Ray nor a cluster. Example::

    check = judge_pairs([PairFigure(("10.0.1.5", "10.0.1.6"), 3.1, None)], expected_gbps=40, source="g6.12xlarge")
    check.failing[0].line(40)   # '10.0.1.5 - 10.0.1.6: 3.1 Gbit/s = 8% of 40 Gbit/s (below 50%)'
    check.suspects              # ['10.0.1.5', '10.0.1.6']: with two nodes, one pair cannot tell which end is slow

Which node a slow pair blames: a node is named when every pair it is in falls short (three or more nodes: the one
bad node's pairs all fail while the pairs of the others pass). A slow pair whose nodes each have a good pair names no
node: the path between them is at fault, not either node, and no node is excluded for it. With two nodes there is one
pair, so both of its nodes are named: any run over these two nodes crosses that link.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_BANDWIDTH_FRACTION = 0.5
"""The default ``--min-bandwidth-fraction``: the probe's own healthy ratio
(:data:`raytrain_eks.fabric.probe.HEALTHY_RATIO`). Healthy EFA pairs reach about 70-95% of the line rate in
nccl-tests' inter-node bus bandwidth; a fall back to TCP or a missing EFA device lands far below half."""


@dataclass(frozen=True)
class PairFigure:
    """One pair of nodes (by Ray node IP) and the best large-message bus bandwidth measured between them, in Gbit/s;
    ``None`` with ``error`` when the probe could not measure the pair."""

    nodes: tuple[str, str]
    busbw_gbps: float | None
    error: str | None = None

    def line(self, expected_gbps: float | None, fraction: float = MIN_BANDWIDTH_FRACTION) -> str:
        pair = f"{self.nodes[0]} - {self.nodes[1]}"
        if self.busbw_gbps is None:
            return f"{pair}: not measured ({self.error or 'no figure'})"
        if not expected_gbps:
            return f"{pair}: {self.busbw_gbps:.3g} Gbit/s"
        share = self.busbw_gbps / expected_gbps
        below = "below" if share < fraction else "at least"
        return (
            f"{pair}: {self.busbw_gbps:.3g} Gbit/s = {100 * share:.0f}% of {expected_gbps:g} Gbit/s "
            f"({below} {100 * fraction:.0f}%)"
        )


@dataclass
class PairCheck:
    """Every pair's figure, the line rate they were held against (``None``: unknown, nothing judged), the pairs
    below ``fraction`` of it and the nodes those point at (:func:`suspects`); ``error`` when the probe did not run."""

    figures: list[PairFigure]
    expected_gbps: float | None
    source: str | None
    fraction: float = MIN_BANDWIDTH_FRACTION
    failing: list[PairFigure] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)
    note: str | None = None
    error: str | None = None  # the probe could not run at all: the check fails, naming no node

    @property
    def ok(self) -> bool:
        return not self.failing and self.error is None

    def lines(self) -> list[str]:
        rate = f"{self.expected_gbps:g} Gbit/s ({self.source})" if self.expected_gbps else "unknown"
        head = f"pairs: bus bandwidth against the line rate {rate}, at least {100 * self.fraction:.0f}%"
        lines = [head, *(f"  {f.line(self.expected_gbps, self.fraction)}" for f in self.figures)]
        for said in (self.note, self.error):
            if said:
                lines.append(f"  {said}")
        if self.failing and not self.suspects:
            lines.append("  no node is in every slow pair: the path between them is at fault, no node is named")
        return lines

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "expected_gbps": self.expected_gbps,
            "expected_source": self.source,
            "min_fraction": self.fraction,
            "pairs": [
                {"nodes": list(f.nodes), "busbw_gbps": f.busbw_gbps, "error": f.error, "ok": f not in self.failing}
                for f in self.figures
            ],
            "suspects": self.suspects,
            "note": self.note,
            "error": self.error,
        }


def judge_pairs(
    figures: Sequence[PairFigure],
    *,
    expected_gbps: float | None,
    source: str | None,
    fraction: float = MIN_BANDWIDTH_FRACTION,
) -> PairCheck:
    """Hold each pair's bus bandwidth against ``fraction`` of ``expected_gbps``; a pair the probe could not measure
    fails too. Without a line rate the figures are shown and nothing fails."""
    check = PairCheck(list(figures), expected_gbps, source, fraction)
    if not expected_gbps:
        check.note = (
            "no expected line rate (the nodes' instance type is not known here): pass --expected-gbps or set "
            "fabric.expected_gbps"
        )
        check.failing = [f for f in figures if f.busbw_gbps is None]
    else:
        check.failing = [f for f in figures if f.busbw_gbps is None or f.busbw_gbps < fraction * expected_gbps]
    check.suspects = suspects(figures, check.failing)
    return check


def suspects(figures: Sequence[PairFigure], failing: Sequence[PairFigure]) -> list[str]:
    """The nodes every one of whose pairs failed, in the order they first appear (see the module's rule)."""
    if not failing:
        return []
    nodes = list(dict.fromkeys(n for f in figures for n in f.nodes))
    return [n for n in nodes if all(f in failing for f in figures if n in f.nodes)]
