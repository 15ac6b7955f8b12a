"""Curves of one or more runs against steps, drawn with matplotlib (Agg: no display needed) into PNG files.

Example::

    paths = draw_curves([("run-a", records_a), ("run-b", records_b)], out_dir)   # {"loss": out_dir/"loss.png", ...}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# (file name, title, y label, [(record field, line style)]): one figure each, drawn when any run has the field.
FIGURES: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("loss", "Loss", "loss (nats per token)", [("loss", "-"), ("eval_loss", "--")]),
    ("eval_ppl", "Evaluation perplexity", "perplexity", [("eval_ppl", "--")]),
    ("lr", "Learning rate", "learning rate", [("lr", "-")]),
    ("grad_norm", "Gradient norm (before clipping)", "grad norm", [("grad_norm", "-")]),
    ("tokens_per_s", "Throughput", "tokens/s (all workers)", [("tokens_per_s", "-")]),
    ("step_time_s", "Step time", "seconds per step", [("step_time_s", "-")]),
    ("mfu", "Model FLOPs utilisation", "MFU", [("mfu", "-")]),
]


def _series(records: list[dict[str, Any]], field: str) -> tuple[list[int], list[float]]:
    points = {}
    for r in records:  # a resumed run repeats steps: the later record of a step wins
        value = r.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and "step" in r:
            points[int(r["step"])] = float(value)
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def can_draw() -> bool:
    """Whether matplotlib can be imported here. The cluster image may lack it: ``submit`` does not ship it (its wheels
    are compiled and pull four more packages the DLC lacks), so a run there writes no report and ``raytrain-eks
    results`` draws it where the run is fetched, from its ``metrics.jsonl``."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def load_plotting() -> None:
    """Import matplotlib for :func:`draw_curves` (file output only): about a second on a small machine, which a
    caller can spend on a thread beside other work."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def draw_curves(runs: list[tuple[str, list[dict[str, Any]]]], out_dir: Path) -> dict[str, Path]:
    """One PNG per figure of :data:`FIGURES` that has data; ``runs`` is ``[(label, metric records)]``."""
    load_plotting()
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, title, ylabel, fields in FIGURES:
        lines = []
        for i, (label, records) in enumerate(runs):
            for field, style in fields:
                steps, values = _series(records, field)
                if steps:
                    suffix = "" if len(fields) == 1 else f" {'eval' if field.startswith('eval') else 'train'}"
                    lines.append(
                        (steps, values, f"{label}{suffix}" if len(runs) > 1 else suffix.strip() or label, i, style)
                    )
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        for steps, values, label, color, style in lines:
            ax.plot(steps, values, style, marker="o" if len(steps) < 30 else None, ms=3, color=f"C{color}", label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written[name] = path
    return written


RANK_STEPS_TITLE = "Own work per rank (optimizer step)"


def draw_rank_steps(runs: list[tuple[str, list[dict[str, Any]]]], out_dir: Path) -> Path | None:
    """One PNG of each rank's own time per step (``rank_steps.jsonl``'s rows: ``{"step", "own_s": [per rank]}``), a
    line per rank: a straggler's line stands above the others. ``None`` when no run has such rows."""
    lines = []
    for label, rows in runs:
        ranks = max((len(r.get("own_s") or []) for r in rows), default=0)
        for rank in range(ranks):
            points = [(int(r["step"]), float(r["own_s"][rank])) for r in rows if len(r.get("own_s") or []) > rank]
            name = f"rank {rank}" if len(runs) == 1 else f"{label} rank {rank}"
            lines.append(([s for s, _ in points], [t * 1e3 for _, t in points], name))
    if not lines:
        return None
    load_plotting()
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    for steps, values, name in lines:
        ax.plot(steps, values, "-", marker="o" if len(steps) < 30 else None, ms=3, label=name)
    ax.set_title(RANK_STEPS_TITLE)
    ax.set_xlabel("step")
    ax.set_ylabel("milliseconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "rank_steps.png"
    fig.savefig(path)
    plt.close(fig)
    return path
