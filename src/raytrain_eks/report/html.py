"""``report.html``: one self-contained page (plots embedded as data URIs) about one run, or several overlaid.

Everything comes from the run folders: ``metrics.jsonl`` (the curves), ``summary.json`` (totals, evaluation,
checkpoints, cost, the fabric verdict), ``config.yaml``, ``samples.jsonl`` and ``nccl/`` (the evidence behind the
verdict); in a run's bundle fetched by ``raytrain-eks results``, ``run.json`` (how the run ended). Example::

    write_report([Path("runs/a"), Path("runs/b")], Path("report"))   # report/report.html, report/plots/*.png
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any

from raytrain_eks.errors import RunFolderError
from raytrain_eks.folders import EVAL_RESULTS, NODE_CHECKS
from raytrain_eks.report.plots import FIGURES, RANK_STEPS_TITLE, draw_curves, draw_rank_steps

REPORT_FILE = "report.html"
PLOTS_DIR = "plots"
_NCCL_LINES_SHOWN = 20


@dataclass
class Run:
    """What a run folder holds, read once."""

    path: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)
    config: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)
    nccl: dict[str, list[str]] = field(default_factory=dict)
    outcome: str = ""  # how the run ended, from a bundle's run.json ("failed: ..."); empty without one

    @property
    def label(self) -> str:
        return self.path.name


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise RunFolderError(
                f"{path}: line {number} is not JSON", hint="Was the file cut short? Remove the broken line."
            ) from None
        if isinstance(item, dict):
            out.append(item)
    return out


def load_run(path: Path) -> Run:
    """Read a run folder; a :class:`UserError` when it is not one or has no metrics yet."""
    if not path.is_dir():
        raise RunFolderError(
            f"{str(path)!r} is not a folder", hint="Give run folders, such as runs/20260101-120000-tiny-qwen2."
        )
    metrics = path / "metrics.jsonl"
    if not metrics.is_file() and not (path / "config.yaml").is_file():
        raise RunFolderError(
            f"{str(path)!r} is not a run folder of raytrain-eks (no metrics.jsonl, no config.yaml)",
            hint="Give the folder printed as 'Run folder:' by `raytrain-eks train`.",
        )
    records = [r for r in _jsonl(metrics) if "step" in r] if metrics.is_file() else []
    if not records:
        raise RunFolderError(
            f"{str(path)!r} has no metrics yet (metrics.jsonl is missing or empty)",
            hint="The run wrote no step record: it failed before its first step, or is still starting.",
        )
    run = Run(path=path, records=records)
    summary_file = path / "summary.json"
    if summary_file.is_file():
        try:
            summary = json.loads(summary_file.read_text(errors="replace"))
        except json.JSONDecodeError:
            summary = None
        if not isinstance(summary, dict):
            raise RunFolderError(f"{summary_file}: not a JSON object", hint="Was the run stopped while writing it?")
        run.summary = summary
    else:  # stopped before its summary (a failed run): its totals as far as its metrics go
        run.summary = {"steps": records[-1]["step"], "first_loss": records[0].get("loss")}
        run.summary["final_loss"] = records[-1].get("loss")
    state = _json_object(path / "run.json")
    if state.get("state"):
        run.outcome = str(state["state"]) + (f": {state['error']}" if state.get("error") else "")
    if (path / "config.yaml").is_file():
        run.config = (path / "config.yaml").read_text(errors="replace")
    if (path / "samples.jsonl").is_file():
        run.samples = _jsonl(path / "samples.jsonl")
    for log in sorted((path / "nccl").glob("rank*.log")) if (path / "nccl").is_dir() else []:
        run.nccl[log.stem] = log.read_text(errors="replace").splitlines()[:_NCCL_LINES_SHOWN]
    return run


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when there is none (no file, not JSON, not an object)."""
    try:
        found = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _num(value: Any, fmt: str = "{:.4g}") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return escape(str(value))
    return fmt.format(value)


def _parameters(summary: dict[str, Any]) -> str:
    """``trainable / total (share)``, e.g. ``155,648 / 1,075,328 (14.5%)``; a summary without them gives —."""
    total, trainable = summary.get("parameters"), summary.get("trainable_parameters")
    if not isinstance(total, int) or not total:
        return "—"
    if not isinstance(trainable, int):
        return f"{total:,}"
    return f"{trainable:,} / {total:,} ({100 * trainable / total:.1f}%)"


def _checkpoint_time(summary: dict[str, Any]) -> str:
    """``1.20 s, 4.5%``: seconds per save and the share of the training loop they took; — without them."""
    per, share = summary.get("checkpoint_s_per_save"), summary.get("checkpoint_share")
    if not isinstance(per, (int, float)) or not isinstance(share, (int, float)):
        return "—"
    return f"{per:.2f} s, {100 * share:.1f}%"


def _overview(runs: list[Run]) -> str:
    rows = [
        ("steps", lambda s: _num(s.get("steps"), "{}")),
        ("first → final training loss", lambda s: f"{_num(s.get('first_loss'))} → {_num(s.get('final_loss'))}"),
        ("final evaluation loss", lambda s: _num(s.get("eval_loss"))),
        ("final evaluation perplexity", lambda s: _num(s.get("eval_ppl"))),
        ("tokens trained", lambda s: _num(s.get("tokens"), "{:,}")),
        ("tokens/s", lambda s: _num(s.get("tokens_per_s"), "{:,.0f}")),
        ("step time (median, s)", lambda s: _num(s.get("step_time_s"))),
        ("MFU", lambda s: "—" if s.get("mfu") is None else f"{100 * s['mfu']:.1f}%"),
        ("workers × device", lambda s: f"{_num(s.get('world_size'), '{}')} × {escape(str(s.get('device', '—')))}"),
        ("precision", lambda s: escape(str(s.get("precision", "—")))),
        ("method", lambda s: escape(str(s.get("method", "full")))),
        ("trainable / total parameters", _parameters),
        ("wall time (s)", lambda s: _num(s.get("wall_s"), "{:,.0f}")),
        ("cost", lambda s: escape(cost_text(s.get("cost"), s.get("cost_note")))),
        ("checkpoints", lambda s: escape(", ".join(map(str, s.get("checkpoints") or [])) or "—")),
        ("checkpoint time (s per save, share of the loop)", _checkpoint_time),
        ("exported model", lambda s: escape(str(s.get("model_dir") or "—"))),
    ]
    if any(r.summary.get("dpo") for r in runs):  # method dpo: its last logged step's reward margin and accuracy
        rows[2:2] = [
            ("DPO reward margin (last step)", lambda s: _num((s.get("dpo") or {}).get("rewards/margins"), "{:.3f}")),
            ("DPO accuracy (last step)", lambda s: _num((s.get("dpo") or {}).get("rewards/accuracies"), "{:.0%}")),
        ]
    head = "".join(f"<th>{escape(r.label)}</th>" for r in runs)
    body = "".join(
        f"<tr><th>{escape(name)}</th>" + "".join(f"<td>{fn(r.summary)}</td>" for r in runs) + "</tr>"
        for name, fn in rows
    )
    outcome = (  # how each run ended, when a bundle says so (a failed run has no summary to show it)
        "<tr><th>outcome</th>" + "".join(f"<td>{escape(r.outcome or '—')}</td>" for r in runs) + "</tr>"
        if any(r.outcome for r in runs)
        else ""
    )
    return f"<table><tr><th></th>{head}</tr>{outcome}{body}</table>"


def cost_text(cost: dict[str, Any] | None, note: str | None = None) -> str:
    """A summary's ``cost`` in words, as the report and ``train`` print it; without one, ``note`` (the summary's
    ``cost_note``) says why. Example: ``$1.59 at $9.55/h; $0.05 per million tokens``."""
    if not cost:
        return (
            f"not known: {note}"
            if note
            else "— (known for runs on a cluster this tool deployed, or at a configured cluster.usd_per_hour or "
            "usd_per_node_hour)"
        )
    per_million = cost.get("usd_per_million_tokens")  # None when the attempt trained no token
    configured = " (cluster.usd_per_hour)" if cost.get("source") == "configured" else ""
    if cost.get("usd_per_node_hour") is not None:  # a per-node price: the nodes the run used
        configured = f" ({cost['nodes']} GPU node(s) x ${cost['usd_per_node_hour']:.2f}, cluster.usd_per_node_hour)"
    return f"${cost['usd']:.2f} at ${cost['usd_per_hour']:.2f}/h{configured}; " + (
        "no token trained" if per_million is None else f"${per_million:.2f} per million tokens"
    )


def _fabric(runs: list[Run]) -> str:
    parts = []
    for run in runs:
        fabric = run.summary.get("fabric") or {}
        if not fabric.get("verdict") and not run.nccl:
            continue
        facts = "".join(
            f"<li><b>{escape(k)}</b>: {escape('; '.join(map(str, v)) if isinstance(v, list) else str(v))}</li>"
            for k, v in fabric.items()
            if k != "report" and v not in (None, "", [])
        )
        evidence = "".join(
            f"<details><summary>{escape(rank)}: NCCL lines</summary><pre>{escape(chr(10).join(lines))}</pre></details>"
            for rank, lines in run.nccl.items()
        )
        report = f"<pre>{escape(fabric['report'])}</pre>" if fabric.get("report") else ""
        parts.append(f"<h3>{escape(run.label)}</h3><ul>{facts}</ul>{report}{evidence}")
    return "".join(parts) or "<p>No fabric check in these runs (local runs and fabric.require = any skip it).</p>"


def _samples(runs: list[Run]) -> str:
    parts = []
    for run in runs:
        if not run.samples:
            continue
        rows = "".join(
            f"<tr><td><pre>{escape(str(s.get('prompt', '')))}</pre></td>"
            f"<td><pre>{escape(str(s.get('completion', '')))}</pre></td></tr>"
            for s in run.samples
        )
        parts.append(
            f"<h3>{escape(run.label)}</h3><table><tr><th>prompt</th><th>greedy completion</th></tr>{rows}</table>"
        )
    return "".join(parts) or "<p>No samples (training.sample_tokens = 0, or random token ids).</p>"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
pre { margin: 0; white-space: pre-wrap; font-size: 0.85em; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(480px, 1fr)); gap: 0 1em; }
"""


_RANK_STEPS = "rank_steps.jsonl"  # each rank's own time per step (train/stragglers.py)
_FINDINGS = "watchdog/findings.json"  # what the watchdog found when the run hung (train/watchdog.py)


def _watch(runs: list[Run]) -> str:
    """The stragglers named and the watchdog's finding, run by run; nothing when there are none."""
    items = []
    for run in runs:
        for s in run.summary.get("stragglers") or [r for rec in run.records for r in rec.get("stragglers") or []]:
            items.append(
                f"<li>{escape(run.label)}: straggler rank {escape(str(s.get('rank')))} on {escape(str(s.get('host')))}"
                f", steps {s.get('first_step')}-{s.get('last_step')}, {_num(s.get('ratio'), '{:.1f}')}x the median</li>"
            )
        finding = _json_object(run.path / _FINDINGS)
        if finding.get("message"):
            items.append(f"<li>{escape(run.label)}: {escape(str(finding['message']))}</li>")
    return f"<h3>Stragglers and watchdog</h3><ul>{''.join(items)}</ul>" if items else ""


def _node_checks(check: dict[str, Any]) -> str:
    """One row per check of each node: the node, its verdict, the check and its evidence."""
    marks = {True: "ok", False: "FAIL", None: "not checked"}
    rows = []
    for node in check.get("nodes") or []:
        verdict = "FAILED" if any(f.get("ok") is False for f in node.get("findings") or []) else "healthy"
        for f in node.get("findings") or []:
            rows.append(
                f"<tr><td>{escape(str(node.get('node')))}</td><td>{verdict}</td><td>{escape(str(f.get('check')))}</td>"
                f"<td>{marks.get(f.get('ok'), '?')}</td><td>{escape(str(f.get('evidence')))}</td></tr>"
            )
    head = "<tr><th>node</th><th>verdict</th><th>check</th><th>result</th><th>evidence</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>" if rows else ""


def _bandwidth_matrix(pairs: dict[str, Any]) -> str:
    """The pair probe's bus bandwidth between each pair of nodes, in Gbit/s and as a share of the line rate."""
    found = pairs.get("pairs") or []
    nodes = list(dict.fromkeys(n for p in found for n in p.get("nodes") or []))
    if not nodes:
        return f"<p>{escape(str(pairs.get('error') or 'No pair was measured.'))}</p>"
    rate = pairs.get("expected_gbps")
    cells: dict[tuple[str, str], str] = {}
    for p in found:
        a, b = p["nodes"]
        gbps = p.get("busbw_gbps")
        text = escape(str(p.get("error") or "not measured")) if gbps is None else f"{gbps:.3g} Gbit/s"
        if gbps is not None and rate:
            text += f" ({100 * gbps / rate:.0f}%)"
        cells[(a, b)] = cells[(b, a)] = text if p.get("ok", True) else f"<b>{text}: FAIL</b>"
    head = "".join(f"<th>{escape(n)}</th>" for n in nodes)
    body = "".join(
        f"<tr><th>{escape(a)}</th>" + "".join(f"<td>{cells.get((a, b), '—')}</td>" for b in nodes) + "</tr>"
        for a in nodes
    )
    against = (
        f"against {rate:g} Gbit/s ({escape(str(pairs.get('expected_source')))}), at least "
        f"{100 * float(pairs.get('min_fraction') or 0):.0f}%"
        if rate
        else "no line rate known"
    )
    return f"<p>Bus bandwidth between each pair of nodes, {against}.</p><table><tr><th></th>{head}</tr>{body}</table>"


def _health(runs: list[Run], rank_chart: str) -> str:
    """The checks of the run's nodes and the bandwidth between each pair (``health/check.json``), each rank's step
    times (the straggler chart) and the stragglers and watchdog's finding; nothing when a run has none of them."""
    parts = []
    for run in runs:
        check = _json_object(run.path / NODE_CHECKS)
        if not check:
            continue
        verdict = "every GPU node passed" if check.get("ok") else f"failing: {', '.join(check.get('bad_nodes') or [])}"
        matrix = _bandwidth_matrix(check["pairs"]) if check.get("pairs") else ""
        excluded = "".join(f"<li>{escape(str(line))}</li>" for line in check.get("excluded") or [])
        parts.append(
            f"<h3>{escape(run.label)}: node checks ({escape(verdict or 'no verdict')})</h3>{_node_checks(check)}"
            f"{matrix}{f'<ul>{excluded}</ul>' if excluded else ''}"
        )
    watch = _watch(runs)
    if not parts and not rank_chart and not watch:
        return ""
    return f"<h2>Cluster health</h2>{''.join(parts)}{rank_chart}{watch}"


def _evaluation(runs: list[Run]) -> str:
    """The lm-eval results of each run that has an ``eval.json``: task, metric, value ± stderr, examples; nothing
    when none has."""
    rows = []
    for run in runs:
        for task, found in (_json_object(run.path / EVAL_RESULTS).get("tasks") or {}).items():
            for metric, figures in (found.get("metrics") or {}).items():
                stderr = figures.get("stderr")
                spread = "" if stderr is None else f" ± {_num(stderr, '{:.4f}')}"
                value = _num(figures.get("value"), "{:.4f}") + spread
                rows.append(
                    f"<tr><td>{escape(run.label)}</td><td>{escape(task)}</td><td>{escape(metric)}</td>"
                    f"<td>{value}</td><td>{_num(found.get('n'), '{}')}</td></tr>"
                )
    head = "<tr><th>run</th><th>task</th><th>metric</th><th>value ± stderr</th><th>examples</th></tr>"
    return f"<h2>Evaluation</h2><table>{head}{''.join(rows)}</table>" if rows else ""


def _segments(runs: list[Run]) -> str:
    """Each run's attempts (:mod:`raytrain_eks.report.segments`): steps, workers and nodes, capacity, how each ended
    and what it cost; nothing when no run has ``segments.jsonl``."""
    from raytrain_eks.report.segments import SEGMENTS, read_segments

    rows = []
    for run in runs:
        for n, seg in enumerate(read_segments(run.path / SEGMENTS), 1):
            where = f"{seg.capacity}: {', '.join(seg.hosts)}" if seg.hosts else seg.capacity
            ended = f"{seg.ended} ({seg.reason})" if seg.reason else seg.ended
            cost = "" if seg.cost_usd is None else f"${seg.cost_usd:.2f}"
            rows.append(
                f"<tr><td>{escape(run.label)}</td><td>{n}</td><td>{seg.first_step}-{seg.last_step}</td>"
                f"<td>{seg.world_size} on {seg.nodes} node(s)</td><td>{escape(where)}</td>"
                f"<td>{escape(seg.started)} to {escape(seg.ended_at)}</td><td>{escape(ended)}</td><td>{cost}</td></tr>"
            )
    head = (
        "<tr><th>run</th><th>segment</th><th>steps</th><th>workers</th><th>capacity</th><th>time (UTC)</th>"
        "<th>ended</th><th>cost</th></tr>"
    )
    return f"<h2>Segments</h2><table>{head}{''.join(rows)}</table>" if rows else ""


def write_report(run_dirs: list[Path], out_dir: Path, *, comparison: str | None = None) -> Path:
    """Write ``out_dir/report.html`` (and ``out_dir/plots/*.png``) for ``run_dirs``; return the page's path.

    ``comparison``: a verdict over the runs as a whole (``compare-fabric``'s summary), shown before the overview."""
    if not run_dirs:
        raise RunFolderError("no run folder given", hint="raytrain-eks report RUN_DIR [RUN_DIR ...]")
    if out_dir.exists() and not out_dir.is_dir():
        raise RunFolderError(
            f"{str(out_dir)!r} is a file, not a folder for the report", hint="Give --out a folder (new or existing)."
        )
    runs = [load_run(Path(p)) for p in run_dirs]
    pngs = draw_curves([(r.label, r.records) for r in runs], out_dir / PLOTS_DIR)
    titles = {name: title for name, title, _, _ in FIGURES}
    by_rank = [(r.label, _jsonl(r.path / _RANK_STEPS)) for r in runs if (r.path / _RANK_STEPS).is_file()]
    rank_png = draw_rank_steps(by_rank, out_dir / PLOTS_DIR)
    rank_chart = (  # the straggler chart goes with the cluster's health
        f'<figure><img alt="{escape(RANK_STEPS_TITLE)}" src="data:image/png;base64,'
        f'{base64.b64encode(rank_png.read_bytes()).decode()}"></figure>'
        if rank_png is not None
        else ""
    )
    images = "".join(
        f'<figure><img alt="{escape(titles[name])}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}"></figure>'
        for name, path in pngs.items()
    )
    configs = "".join(
        f"<details><summary>{escape(r.label)}: config.yaml</summary><pre>{escape(r.config)}</pre></details>"
        for r in runs
        if r.config
    )
    names = ", ".join(escape(r.label) for r in runs)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>raytrain-eks report: {names}</title>
<link rel="icon" href="data:,"><style>{_STYLE}</style></head>
<body>
<h1>raytrain-eks report</h1>
<p>{len(runs)} run{"s" if len(runs) > 1 else ""}: {names}. Written {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.</p>
{f"<h2>Comparison</h2><pre>{escape(comparison)}</pre>" if comparison else ""}
<h2>Overview</h2>{_overview(runs)}
<h2>Curves</h2><div class="plots">{images}</div>
{_segments(runs)}
{_evaluation(runs)}
{_health(runs, rank_chart)}
<h2>Samples</h2>{_samples(runs)}
<h2>Fabric</h2>{_fabric(runs)}
<h2>Configuration</h2>{configs or "<p>No config.yaml.</p>"}
</body></html>
"""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_FILE
    path.write_text(page)
    return path
