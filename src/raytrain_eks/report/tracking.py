"""Metric records sent to experiment trackers as they arrive on the driver.

TensorBoard event files are always written, into ``RUN_DIR/tensorboard`` (``tensorboard --logdir runs/``).
MLflow is used when ``MLFLOW_TRACKING_URI`` is set and ``mlflow`` is installed (``pip install
raytrain-eks[mlflow]``): one MLflow run per training run, with the configuration as parameters and the summary
as final metrics. Weights & Biases is used when ``wandb`` is installed (``pip install raytrain-eks[wandb]``) and
one of its usual variables asks for it (``WANDB_PROJECT``, ``WANDB_API_KEY``, or ``WANDB_MODE`` online or
offline; ``WANDB_MODE=disabled`` turns it off): one W&B run per training run, named after the run folder, with the
configuration as its config, the records as its history and the summary as its summary. Its files go to
``WANDB_DIR``, or ``RUN_DIR/wandb``. Example::

    tracker = Tracker(run_dir, cfg)
    tracker.log({"step": 10, "loss": 2.3, "lr": 1e-4})
    tracker.close(); tracker.finish(summary)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from wandb import Run

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


class RunSettings(Protocol):
    """What the tracker reads of the run's configuration (``raytrain_eks.config.Config``): its YAML, and its settings
    as JSON values (the ``training`` section goes to MLflow's parameters and W&B's config)."""

    def to_yaml(self) -> str: ...

    def model_dump(self, *, mode: str) -> Mapping[str, object]: ...


def _flat(prefix: str, value: object, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = str(value)[:500]


class Tracker:
    """TensorBoard always; MLflow and Weights & Biases too when each is configured and installed."""

    def __init__(self, run_dir: Path, cfg: RunSettings) -> None:
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(logdir=str(run_dir / TENSORBOARD_DIR), flush_secs=10)
        self._tb.add_text("config", "```\n" + cfg.to_yaml() + "\n```", 0)
        self._mlflow: ModuleType | None = None  # mlflow itself: its run is the module's current one
        if os.environ.get("MLFLOW_TRACKING_URI"):
            self._mlflow = _start_mlflow(run_dir, cfg)
        self._wandb: Run | None = _start_wandb(run_dir, cfg) if wandb_wanted(os.environ) else None

    def log(self, record: Mapping[str, object]) -> None:
        step = record["step"]
        assert isinstance(step, int), f"a metric record's step is a number, not {step!r}"
        values = {tag: float(v) for k, tag in _TAGS.items() if isinstance(v := record.get(k), (int, float))}
        for tag, value in values.items():
            self._tb.add_scalar(tag, value, step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({t.replace("/", "_"): v for t, v in values.items()}, step=step)
        if self._wandb is not None and values:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        """Flush and close the event file (training is over; nothing more is logged per step)."""
        self._tb.close()

    def finish(self, summary: Mapping[str, object]) -> None:
        """End the MLflow run with the summary's numbers as final metrics, and the W&B run with them as its
        summary."""
        numbers = {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._mlflow is not None:
            self._mlflow.log_metrics({f"summary_{k}": v for k, v in numbers.items()})
            self._mlflow.end_run()
            self._mlflow = None
        if self._wandb is not None:
            import wandb

            self._wandb.summary.update({f"summary/{k}": v for k, v in numbers.items()})
            self._wandb.finish()
            self._wandb = None
            if wandb.run is None:  # no other W&B run in this process: its service process (wandb-core) ends too
                wandb.teardown()


WANDB_VARIABLES = ("WANDB_PROJECT", "WANDB_API_KEY")  # either one asks for a W&B run (so does WANDB_MODE)


def wandb_wanted(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for Weights & Biases: ``WANDB_MODE`` online or offline, or a project or an API
    key set (and ``WANDB_MODE`` not ``disabled``)."""
    mode = environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("disabled", "off"):
        return False
    return mode in ("online", "offline", "dryrun", "run") or any(environ.get(name) for name in WANDB_VARIABLES)


def _start_wandb(run_dir: Path, cfg: RunSettings) -> Run | None:
    try:
        import wandb
    except ImportError:
        log.warning("WANDB_* asks for Weights & Biases but wandb is not installed: pip install 'raytrain-eks[wandb]'")
        return None
    folder = os.environ.get("WANDB_DIR") or str(run_dir)  # wandb makes its own wandb/ folder inside
    Path(folder).mkdir(parents=True, exist_ok=True)
    training = cfg.model_dump(mode="json")["training"]  # a section of settings: a mapping
    try:
        return wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "raytrain-eks",
            name=run_dir.name,
            dir=folder,
            config=dict(training) if isinstance(training, Mapping) else None,
            settings=wandb.Settings(console="off", quiet=True),
        )
    except Exception as exc:  # no API key, no route to W&B: the run is not lost for its tracker
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning(
            "Weights & Biases did not start (%s); the run goes on without it (WANDB_MODE=offline keeps "
            "its records locally)",
            first,
        )
        return None


def _start_mlflow(run_dir: Path, cfg: RunSettings) -> ModuleType | None:
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
