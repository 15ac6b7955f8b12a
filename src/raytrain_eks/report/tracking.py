"""Metric records sent to experiment trackers as they arrive on the driver.

TensorBoard event files are always written, into ``RUN_DIR/tensorboard`` (``tensorboard --logdir runs/``).
MLflow is used when ``MLFLOW_TRACKING_URI`` is set and ``mlflow`` is installed (``pip install
raytrain-eks[mlflow]``): one MLflow run per training run, with the configuration as parameters and the summary
as final metrics. Example::

    tracker = Tracker(run_dir, cfg)
    tracker.log({"step": 10, "loss": 2.3, "lr": 1e-4})
    tracker.close(); tracker.finish(summary)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"
# The record fields sent as scalars, and the tag each gets (train/, eval/ and perf/ group them in TensorBoard).
_TAGS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/perplexity",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "mfu": "perf/mfu",
}
log = logging.getLogger(__name__)


def _flat(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = str(value)[:500]


class Tracker:
    """TensorBoard always; MLflow too when it is configured and installed."""

    def __init__(self, run_dir: Path, cfg: Any) -> None:
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(logdir=str(run_dir / TENSORBOARD_DIR), flush_secs=10)
        self._tb.add_text("config", "```\n" + cfg.to_yaml() + "\n```", 0)
        self._mlflow: Any = None
        if os.environ.get("MLFLOW_TRACKING_URI"):
            self._mlflow = _start_mlflow(run_dir, cfg)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        values = {tag: float(record[k]) for k, tag in _TAGS.items() if isinstance(record.get(k), (int, float))}
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({t.replace("/", "_"): v for t, v in values.items()}, step=step)

    def close(self) -> None:
        """Flush and close the event file (training is over; nothing more is logged per step)."""
        self._tb.close()

    def finish(self, summary: dict[str, Any]) -> None:
        """End the MLflow run with the summary's numbers as final metrics."""
        if self._mlflow is None:
            return
        numbers = {
            f"summary_{k}": float(v)
            for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self._mlflow.log_metrics(numbers)
        self._mlflow.end_run()
        self._mlflow = None


def _start_mlflow(run_dir: Path, cfg: Any) -> Any:
    try:
        import mlflow
    except ImportError:
        log.warning("MLFLOW_TRACKING_URI is set but mlflow is not installed: pip install 'raytrain-eks[mlflow]'")
        return None
    mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "raytrain-eks"))
    mlflow.start_run(run_name=run_dir.name)
    params: dict[str, str] = {}
    _flat("", cfg.model_dump(mode="json")["training"], params)
    mlflow.log_params(params)
    mlflow.set_tag("run_dir", str(run_dir))
    return mlflow
