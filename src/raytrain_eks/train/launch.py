"""The driver side of a training run: run folder, Ray, data preparation, ``TorchTrainer``, live metrics.

Without an address it starts an embedded Ray on this machine; with ``address="auto"`` or ``HOST:PORT`` it joins
a running cluster (how it runs inside the head pod on EKS). Example::

    result = run_training(load_config(preset=local_tiny()), address=None)
    result.run_dir / "summary.json"
"""

from __future__ import annotations

import gc
import json
import os
import re
import secrets
import shutil
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_eks.config import BUILTIN_DATA, Config, check_sharding_for_nodes, check_storage_for_nodes
from raytrain_eks.errors import DataError, TrainingError, UserError
from raytrain_eks.folders import keep_node_checks, new_folder
from raytrain_eks.ray_session import (
    LOCAL_CPU_WORKERS,
    LocalRayStart,
    init_ray,
    resolve_num_workers,
    worker_error,
    worker_host_addresses,
    worker_hosts,
)
from raytrain_eks.report.segments import SegmentStart, append_segment, capacity_of, failed_cost
from raytrain_eks.train.bundle import RunBundle, bundle_note
from raytrain_eks.train.collect import DONE, Collected, Progress, collect
from raytrain_eks.train.preemption import PREEMPTED, Notice, keep_global_batch, preempted_line
from raytrain_eks.train.records import WorkerFailure, WorkerJob
from raytrain_eks.train.staged import is_staged_location
from raytrain_eks.train.stragglers import Straggler
from raytrain_eks.train.watchdog import Finding, start_board
from raytrain_eks.train.worker_env import worker_environment

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue

    from raytrain_eks.report.tracking import Tracker
    from raytrain_eks.train.data.pipeline import PackedSet, PreparedData
    from raytrain_eks.train.watchdog import Watchdog

ERROR_LOG = "error.log"  # in the run folder: the full tracebacks behind a failure's one-line message


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    records: list[dict[str, object]]
    bundle: str | None = None  # the run's bundle in its storage (training.storage_path), see train/bundle.py


def new_run_dir(cfg: Config, root: Path = Path("runs")) -> Path:
    """``runs/<UTC time>-<model name>`` (``-2``, ``-3``... when taken), created now; an explicit
    ``training.output_dir`` is used as given."""
    if cfg.training.output_dir:
        path = Path(cfg.training.output_dir).expanduser()
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise UserError(
                f"--output-dir {str(path)!r} already exists and is not " + ("empty" if path.is_dir() else "a folder"),
                hint="Pick a new folder (or leave --output-dir out for a fresh one under runs/).",
            )
    else:
        slug = re.sub(r"[^A-Za-z0-9.-]+", "-", cfg.training.model_id.split("/")[-1].split(":")[-1]).strip("-")
        path = root / f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{slug}"
    try:
        if cfg.training.output_dir:
            path.mkdir(parents=True, exist_ok=True)
        else:  # a second run started in the same second gets its own folder (-2), never a share of this one
            path = new_folder(root, path.name)
    except OSError as exc:  # a file where a parent folder should be, no permission
        raise UserError(
            f"cannot create the run folder {str(path)!r}: {exc.strerror or exc}",
            hint="Pick a folder you can write to with --output-dir (or run from one, for runs/).",
        ) from None
    return path.resolve()


def _resume_source(resume: Path | str | None, cfg: Config, runs_root: Path) -> tuple[Path | None, str | Path | None]:
    """(the run folder to continue in, where its checkpoints are) for ``--resume``, or ``(None, None)``.

    ``resume`` is a run folder (its checkpoints: the run's storage when set, else the folder itself), or the run's
    storage folder as a URI (``STORAGE_PATH/RUN``, for a machine without the run folder): the run then continues in
    ``runs_root/RUN`` here, its checkpoints still going to that storage folder.
    """
    from raytrain_eks.train.checkpoint import checkpoint_root, storage_root
    from raytrain_eks.train.storage import is_remote

    if resume is None:
        return None, None
    storage = cfg.training.storage_path
    if is_remote(resume):
        text = str(resume).rstrip("/")
        name = text.rsplit("/", 1)[-1]
        expected = storage_root(Path(name), storage) if storage else None
        if expected != text:
            raise UserError(
                f"--resume {text!r}: the run's configuration puts its checkpoints in "
                f"{expected or 'the run folder'!r} (training.storage_path = {storage!r}), not there",
                hint="Give the storage folder the run wrote (training.storage_path followed by the run's name), "
                "with its own config.yaml (leave out --config and --storage-path).",
            )
        return (runs_root / name).expanduser().resolve(), text
    run_dir = Path(resume).expanduser().resolve()
    return run_dir, (checkpoint_root(run_dir, storage) if storage else run_dir)


def data_source(cfg: Config) -> str:
    if cfg.training.data == BUILTIN_DATA:
        from raytrain_eks.train.builtin import sample_data_path

        return str(sample_data_path())
    return cfg.training.data


def with_chat_template_text(cfg: Config) -> Config:
    """``cfg`` with ``training.chat_template`` as Jinja text: a template named by its file travels as its text, so
    the workers, the run's config.yaml, a resume on another machine and a job on a cluster (``submit`` ships the
    configuration this returns) need no copy of the file. Text given as such is kept as it is; a file that cannot be
    read is a :class:`~raytrain_eks.errors.DataError`. Example: ``with_chat_template_text(cfg).training.chat_template``
    starts ``{%`` for a ``chat.jinja`` that does."""
    from raytrain_eks.train.data.encoding import chat_template_text

    template = chat_template_text(cfg.training.chat_template)
    if template == cfg.training.chat_template:
        return cfg
    return cfg.model_copy(update={"training": cfg.training.model_copy(update={"chat_template": template})})


def run_training(
    cfg: Config,
    *,
    address: str | None = None,
    runs_root: Path = Path("runs"),
    say: Callable[[str], None] = print,
    progress: Progress | None = None,
    verbose: bool = False,
    resume: Path | str | None = None,
    price: Callable[[dict[str, Any]], Mapping[str, object] | None] | None = None,
    unpriced: str | None = None,
    capacity: str | None = None,
) -> RunResult:
    """Train with Ray Train as configured and write the run folder; raise a :class:`UserError` on failure.

    ``say`` prints one-line status messages; ``progress`` (optional) is called as ``progress(record, total_steps)``
    for every metric record as it arrives, and told what data preparation is doing with ``progress.stage(text)`` when
    it has that method. ``resume`` is an earlier run folder to continue, from its newest
    complete checkpoint, to ``cfg.training.steps``, or that run's storage folder as a URI (see
    :func:`_resume_source`). ``price``, given the finished summary, returns what the run cost
    (or ``None``); it goes into ``summary.json`` and the report as ``cost``. ``unpriced`` (without ``price``) says
    why the run cannot be priced: ``cost`` is then null and ``cost_note`` says why.

    With ``training.storage_path`` set, the run folder is also kept, as the run goes, in the run's storage folder
    beside its checkpoints (its bundle, :mod:`raytrain_eks.train.bundle`), whether the run finishes or fails.

    Each attempt (this one, and every ``resume`` of the run) adds its segment to ``segments.jsonl``
    (:mod:`raytrain_eks.report.segments`): ``capacity`` names where its nodes came from (default: ``local`` for a run
    on this machine).
    """
    import ray

    from raytrain_eks.train.checkpoint import (
        check_compatible,
        checkpoint_step,
        resolve_checkpoint,
        write_storage_config,
    )
    from raytrain_eks.train.data.sources import list_data_files
    from raytrain_eks.train.lora import check_lora
    from raytrain_eks.train.loss import check_loss_kernel
    from raytrain_eks.train.model import check_attention
    from raytrain_eks.train.model_source import check_model, resolve_model_path

    t_start = time.perf_counter()
    lines: list[str] = []  # every line said, for the bundle's train.log
    say = _keeping(say, lines)
    cfg = with_chat_template_text(cfg)
    training = cfg.training
    # Everything that can be checked before anything is created or started is checked first: the quick checks, then
    # the model's config and tokenizer, which load torch and transformers (seconds on one core of a small machine),
    # while a local Ray starts on the other core.
    model_path = resolve_model_path(training.model_id)
    data_files = None if training.uses_random_data else list_data_files(data_source(cfg))
    eval_files = list_data_files(training.eval_data, option="training.eval_data") if training.eval_data else None
    resume_dir, resume_root = _resume_source(resume, cfg, runs_root)
    resume_from: str | None = None
    attempt = SegmentStart(
        capacity=capacity or capacity_of(None, joined=address is not None),
        world_size=training.num_workers or LOCAL_CPU_WORKERS,
    )
    ray_was_running = ray.is_initialized()
    local_ray = None
    bundle: RunBundle | None = None
    if address is None:  # a local run has one node
        check_sharding_for_nodes(training, 1, training.num_workers or LOCAL_CPU_WORKERS, counted="a local run")
        if resume_root is not None:  # before Ray starts: a run folder without a checkpoint stops here
            resume_from = resolve_checkpoint(resume_root)
        if not ray_was_running:
            local_ray = LocalRayStart(training.num_workers or LOCAL_CPU_WORKERS, verbose)
    try:
        if not verbose:  # no library progress bars or logs: the driver shows its own display
            from raytrain_eks.train.loop import quiet_libraries

            quiet_libraries()
        model_config = check_model(model_path)
        check_attention(training.attention, training.precision, model_config, local=address is None)
        check_loss_kernel(training.loss_kernel, local=address is None)
        if training.eval_tasks:  # a task name lm-eval does not know stops the run now, not after the training
            from raytrain_eks.evaluation.harness import check_task_names, task_manager

            check_task_names(list(training.eval_tasks), task_manager(list(training.eval_tasks), []))
        lora = check_lora(model_config, training.adapters) if training.adapters is not None else None
        if address:
            # Joining a cluster: its nodes decide whether the checkpoints need storage every node reaches, and where
            # the ranks can be placed. (_train_in's own init_ray then finds Ray initialised and leaves it as it is.)
            init_ray(address, training.num_workers or LOCAL_CPU_WORKERS, verbose)
            counted = "alive nodes of the Ray cluster that can host a training worker"
            check_storage_for_nodes(training, worker_hosts(), counted=counted)
            check_sharding_for_nodes(training, worker_hosts(), training.num_workers or None, counted=counted)
            attempt.hosts = worker_host_addresses()
        if resume_dir is not None and resume_root is not None:
            run_dir = resume_dir
            resume_from = resume_from or resolve_checkpoint(resume_root)  # a cluster's storage: read once joined
            check_compatible(resume_from, model_config, lora=lora)
            attempt.resumed_from = checkpoint_step(resume_from)
            run_dir.mkdir(parents=True, exist_ok=True)  # a run continued on a machine that does not have its folder
            say(f"resuming {run_dir} from {resume_from}")
        else:
            run_dir = new_run_dir(cfg, runs_root)
            say(f"run folder: {run_dir}")
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        keep_node_checks(run_dir)
        try:
            write_storage_config(run_dir, training.storage_path, cfg.to_yaml())
            bundle = RunBundle.start(run_dir, training.storage_path, total_steps=training.steps, lines=lines, warn=say)
            if local_ray is not None:
                local_ray.wait()
            return _train_in(
                run_dir,
                cfg,
                address=address,
                say=say,
                progress=progress,
                verbose=verbose,
                model_path=model_path,
                data_files=data_files,
                eval_files=eval_files,
                resume_from=resume_from,
                t_start=t_start,
                price=price,
                unpriced=unpriced,
                trained=local_ray.stop_soon if local_ray is not None else None,
                bundle=bundle,
                attempt=attempt,
            )
        except Exception as exc:
            logged = _logged(exc, run_dir)
            if (run_dir / "metrics.jsonl").exists():  # the attempt reached training: it is one of the run's segments
                message = getattr(logged, "message", str(logged))
                append_segment(run_dir, attempt.failed(message, run_dir, failed_cost(price, attempt)))
            if bundle is not None:  # the evidence outlives this machine: the run folder's logs point into it
                bundle.fail(getattr(logged, "message", str(logged)))
                if isinstance(logged, UserError):
                    logged.extend(f"(run bundle: {bundle.location})")
            if resume_dir is None and not training.storage_path and _remove_if_unused(run_dir, logged):
                say(f"run folder {run_dir} removed: nothing was trained")
            if logged is exc:
                raise
            raise logged from None
    finally:
        if bundle is not None:  # interrupted: marked stopped, with what the run folder holds
            bundle.close()
        # A Ray this run started (or joined) is this run's to stop: its workers and controller go with it, whether
        # the run was refused before anything started, failed, or finished.
        if local_ray is not None:
            local_ray.stop()
        elif not ray_was_running and ray.is_initialized():
            ray.shutdown()


@dataclass
class _RayData:
    """The data sets the workers read and the prepared data behind them: references into Ray's object store, let go
    (:meth:`release`) before a local Ray stops."""

    datasets: dict[str, PackedSet] = field(default_factory=dict)
    prepared: PreparedData | None = None

    def release(self) -> None:
        self.datasets, self.prepared = {}, None


@dataclass(frozen=True)
class _PreparedRun:
    """A run ready for its workers: its configuration (resized for a resume), where it writes, its Ray workers, the
    data they read, the sample prompts (as a person reads them, as the model gets them) and the tracker."""

    run_dir: Path
    cfg: Config
    model_path: str
    resume_from: str | None  # the checkpoint it continues from
    num_workers: int
    use_gpu: bool
    root: str  # the checkpoints' folder (training.storage_path's, or the run folder's)
    board_name: str | None  # the watchdog's board, by the name the workers look it up with
    worker_env: dict[str, str]
    prompts: tuple[list[str], list[str]]
    tracker: Tracker
    data: _RayData
    data_counts: dict[str, object] | None  # what the data held and how it packed (summary.json's data_counts)


def _train_in(
    run_dir: Path,
    cfg: Config,
    *,
    address: str | None,
    say: Callable[[str], None],
    progress: Progress | None,
    verbose: bool,
    model_path: str,
    data_files: tuple[list[str], str] | None,
    eval_files: tuple[list[str], str] | None,
    resume_from: str | None,
    t_start: float,
    price: Callable[[dict[str, Any]], Mapping[str, object] | None] | None,
    unpriced: str | None = None,
    trained: Callable[[], None] | None = None,
    bundle: RunBundle | None = None,
    attempt: SegmentStart | None = None,
) -> RunResult:
    """Everything of :func:`run_training` after the run folder exists: Ray, data, the trainer, the summary.

    ``trained`` (optional) is called once the trainer has returned and Ray is needed no more (a local Ray then shuts
    down while the export and the report are written). ``bundle``: told of every logged step, and finished with the
    whole run folder at the end."""
    run = _prepared_run(
        run_dir,
        cfg,
        address=address,
        say=say,
        progress=progress,
        verbose=verbose,
        model_path=model_path,
        data_files=data_files,
        eval_files=eval_files,
        resume_from=resume_from,
        bundle=bundle,
    )
    if attempt is not None:  # its workers as counted on the cluster (training.num_workers 0: every GPU)
        attempt.world_size = run.num_workers
    heard, error = _trained(run, say=say, progress=progress, bundle=bundle, trained=trained)
    return _finished(
        run, heard, error, t_start=t_start, say=say, price=price, unpriced=unpriced, bundle=bundle, attempt=attempt
    )


def _finished(
    run: _PreparedRun,
    heard: Collected,
    error: BaseException | None,
    *,
    t_start: float,
    say: Callable[[str], None],
    price: Callable[[dict[str, Any]], Mapping[str, object] | None] | None,
    unpriced: str | None,
    bundle: RunBundle | None,
    attempt: SegmentStart | None = None,
) -> RunResult:
    """The run after its trainer: the summary (:func:`_summarised`) priced and written, its segment added, the
    tracker finished, the report written and the bundle finished."""
    from raytrain_eks.report.plots import can_draw, load_plotting

    # The report's plotting library loads on a thread while the model is exported (both take a second or two).
    if can_draw():
        threading.Thread(target=load_plotting, name="import-plotting", daemon=True).start()
    run.tracker.close()
    run_dir = run.run_dir
    summary = _summarised(
        run_dir,
        run.cfg,
        heard,
        error,
        root=run.root,
        model_path=run.model_path,
        data_counts=run.data_counts,
        t_start=t_start,
        say=say,
    )
    if price is not None:
        summary["cost"] = price(summary)
    elif unpriced is not None:
        summary["cost"], summary["cost_note"] = None, unpriced
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if attempt is not None:  # before the report and the bundle, which show and keep it
        append_segment(run_dir, attempt.ended(summary))
    run.tracker.finish(summary)
    say(report_line(run_dir))
    if bundle is not None and bundle.finish(summary):  # else its warning said what is missing
        say(bundle_note(bundle.location))
    return RunResult(
        run_dir=run_dir, summary=summary, records=heard.records, bundle=bundle.location if bundle is not None else None
    )


def _prepared_run(
    run_dir: Path,
    cfg: Config,
    *,
    address: str | None,
    say: Callable[[str], None],
    progress: Progress | None,
    verbose: bool,
    model_path: str,
    data_files: tuple[list[str], str] | None,
    eval_files: tuple[list[str], str] | None,
    resume_from: str | None,
    bundle: RunBundle | None,
) -> _PreparedRun:
    """Ray (started or joined), the workers counted, the configuration resized for them on a resume, the data
    prepared, the checkpoints' folder, the workers' environment, the sample prompts and the tracker."""
    import ray

    from raytrain_eks.report.tracking import Tracker
    from raytrain_eks.train.checkpoint import checkpoint_root, forget_ray_snapshot

    training = cfg.training
    init_ray(address, training.num_workers or LOCAL_CPU_WORKERS, verbose)
    num_workers, use_gpu = resolve_num_workers(training.num_workers, int(ray.cluster_resources().get("GPU", 0)))
    say(f"ray: {num_workers} {'GPU' if use_gpu else 'CPU'} workers, model {training.model_id}")
    if resume_from is not None:  # on another number of workers: the same global batch, through accumulation
        cfg = _resized(cfg, run_dir, resume_from, num_workers, say)
        training = cfg.training
    if bundle is not None:  # the workers run under this driver's Ray job: their output joins the bundle's syncs
        bundle.follow_workers(ray.get_runtime_context().get_job_id())

    data, data_counts = _prepared_data(cfg, model_path, data_files, eval_files, num_workers, progress, say)

    root = checkpoint_root(run_dir, training.storage_path)
    if resume_from is not None:
        # The earlier attempt's Ray Train list names checkpoints pruned since: a new trainer over it would refuse.
        forget_ray_snapshot(root)
    # Named per run (a resume in the same process and Ray is another run): the workers look it up by this name.
    board_name = None
    if training.watchdog:
        board_name = f"raytrain-eks-watchdog-{run_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"
    worker_env = worker_environment(cfg, f"{run_dir.name}-{os.getpid()}", use_gpu=use_gpu, watchdog=board_name)

    return _PreparedRun(
        run_dir=run_dir,
        cfg=cfg,
        model_path=model_path,
        resume_from=resume_from,
        num_workers=num_workers,
        use_gpu=use_gpu,
        root=root,
        board_name=board_name,
        worker_env=worker_env,
        prompts=_prompts(cfg, model_path, data_files),
        tracker=Tracker(run_dir, cfg),
        data=data,
        data_counts=data_counts,
    )


def _trained(
    run: _PreparedRun,
    *,
    say: Callable[[str], None],
    progress: Progress | None,
    bundle: RunBundle | None,
    trained: Callable[[], None] | None,
) -> tuple[Collected, BaseException | None]:
    """The trainer run on a thread while the driver collects what the workers send
    (:func:`~raytrain_eks.train.collect.collect`): what was heard, and the trainer's error (``None`` when it returned).
    A :class:`TrainingError` when the watchdog finds the ranks hung. Every reference into Ray is let go before
    ``trained`` is called."""
    import ray

    queue = _driver_queue()
    board = start_board(run.board_name) if run.board_name else None  # before the workers, which look it up by name
    trainer = _trainer(run, queue)
    outcome: dict[str, object] = {}
    abandoned = threading.Event()  # the run ended without this thread (hung ranks): Ray may go before fit returns
    thread = _fit_thread(trainer, queue, outcome, abandoned)
    watchdog = _start_watchdog(board, run, queue.put, say)
    heard = collect(
        queue,
        run.run_dir,
        run.cfg.training.steps,
        say=say,
        tracker=run.tracker,
        bundle=bundle,
        progress=progress,
        prompts=run.prompts[0],
    )
    if watchdog is not None:
        watchdog.stop()
    if board is not None:  # its name goes with it, whatever the run's end
        ray.kill(board)
    if heard.hung is not None:  # the ranks wait in a collective that never ends: the run ends here, not at its timeout
        abandoned.set()
        if bundle is not None:
            bundle.last_worker_logs()
        raise TrainingError(
            heard.hung.message,
            hint=f"Stacks of every rank: {run.run_dir / 'watchdog'}; resume with --resume {run.run_dir}",
        )
    thread.join()
    if bundle is not None:  # the ranks' output as they left it, finished or failed, before a local Ray goes
        bundle.last_worker_logs()
    queue.shutdown(force=True)
    error = outcome.get("error")
    if trained is not None:
        # Ray begins to stop on another thread: first every object reference and actor handle of this run goes, while
        # Ray still answers. One dropped later (by the collector, on any thread) reaches a core worker that has shut
        # down, and Ray ends the whole process there with status 1 and no message.
        del queue, trainer, board, watchdog
        run.data.release()
        outcome.pop("result", None)
        gc.collect()
        trained()
    return heard, error if isinstance(error, BaseException) else None


def _driver_queue() -> Queue:
    """The metric records' queue, on the driver's node with no CPU of its own (a cluster's head offers none): a worker
    node that is lost and replaced mid-run takes none of the run's driver-side state with it."""
    import ray
    from ray.util.queue import Queue
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return Queue(actor_options={"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)})


def _fit_thread(
    trainer: TorchTrainer, queue: Queue, outcome: dict[str, object], abandoned: threading.Event
) -> threading.Thread:
    """``trainer.fit()`` started on a thread: its result or error goes into ``outcome``, then the end of the messages
    into ``queue``. Once ``abandoned`` is set (the driver no longer waits), a queue gone with Ray is no error."""

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc
        finally:
            try:
                queue.put(DONE)  # wakes the driver's blocking get: no polling while training runs
            except Exception:
                if not abandoned.is_set():  # nobody waits for this thread any more, and its queue went with Ray
                    raise

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    return thread


def _prompts(cfg: Config, model_path: str, data_files: tuple[list[str], str] | None) -> tuple[list[str], list[str]]:
    """The sample prompts: as a person reads them, and as the model gets them."""
    from raytrain_eks.train.data.encoding import encoding_tokenizer
    from raytrain_eks.train.prompts import sample_prompts

    training = cfg.training
    return sample_prompts(
        training.sample_prompts,
        data_files,
        training.data_format,
        training.text_field,
        encoding_tokenizer(model_path, training.chat_template),
        columns=training.columns or None,
        csv_delimiter=training.csv_delimiter,
    )


def _trainer(run: _PreparedRun, queue: Queue) -> TorchTrainer:
    """The run's ``TorchTrainer``: its workers send their messages to ``queue``."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_eks.train.checkpoint import RAY_DIR, storage_root

    training = run.cfg.training
    return TorchTrainer(
        _worker_entry,
        train_loop_config={
            "job": WorkerJob(
                training=training.model_dump(mode="json"),
                # A staged model: each worker reads its own node's copy (the driver's folder is on its own node).
                model_path=training.model_id if is_staged_location(training.model_id) else run.model_path,
                metrics_queue=queue,
                checkpoint_root=run.root,
                resume_from=run.resume_from,
                fabric_require=run.cfg.fabric.require,
                fabric_require_full_efa=run.cfg.fabric.require_full_efa,
                fabric_instance_type=run.cfg.cluster.gpu_node_type,
                datasets=run.data.datasets,
                sample_prompts=run.prompts[1],
            )
        },
        torch_config=TorchConfig(backend="nccl" if run.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=run.num_workers, use_gpu=run.use_gpu),
        run_config=ray.train.RunConfig(
            name=RAY_DIR,
            storage_path=storage_root(run.run_dir, training.storage_path),
            failure_config=ray.train.FailureConfig(max_failures=training.max_failures),
            worker_runtime_env={"env_vars": run.worker_env},  # Ray Train v2's RunConfig (ray.train picks v2 at import)
        ),
    )


def _prepared_data(
    cfg: Config,
    model_path: str,
    data_files: tuple[list[str], str] | None,
    eval_files: tuple[list[str], str] | None,
    num_workers: int,
    progress: Progress | None,
    say: Callable[[str], None],
) -> tuple[_RayData, dict[str, object] | None]:
    """The packed data sets the workers read (none for random token ids) with the prepared data behind them, and its
    counts (``summary.json``'s ``data_counts``)."""
    from raytrain_eks.train.data.pipeline import prepare_for, train_datasets

    training = cfg.training
    data = _RayData()
    data_counts: dict[str, object] | None = None  # what the data held and how it packed (summary.json's data_counts)
    if not training.uses_random_data:
        prepared = prepare_for(
            training,
            model_path,
            data=data_source(cfg),
            listed=data_files,
            min_blocks=num_workers * training.micro_batch * training.grad_accum_steps,
            eval_fraction=training.effective_eval_fraction,
            stage=getattr(progress, "stage", None),
        )
        say(prepared.describe(training.data, training.seq_len))
        data_counts = prepared.counts()
        stage = getattr(progress, "stage", None)
        if stage is not None:
            stage("ready; starting the training workers")
        # Every rank reads all of the (small) held-out set and keeps its share: splitting would drop a remainder.
        data = _RayData(
            train_datasets(prepared.dataset, _eval_dataset(cfg, prepared, eval_files, model_path, say)), prepared
        )
    else:
        say(f"data: random token ids, {training.seq_len} tokens per sample")

    return data, data_counts


def _summarised(
    run_dir: Path,
    cfg: Config,
    heard: Collected,
    error: BaseException | None,
    *,
    root: str,
    model_path: str,
    data_counts: dict[str, object] | None,
    t_start: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The run's summary once training is over, its model exported (unless a notice ended it); a
    :class:`TrainingError` when the workers failed, sent no summary, or the transport was not the one required."""
    from raytrain_eks.evaluation.run import evaluate_run
    from raytrain_eks.train.checkpoint import latest_complete, list_checkpoints
    from raytrain_eks.train.export import export_hf

    training, summary = cfg.training, heard.summary
    if error is not None:
        failed = TrainingError(f"training failed: {worker_error(error)}", hint=f"Run folder: {run_dir}")
        failed.details = "\n".join(heard.tracebacks)  # Ray keeps only a snippet of them
        raise failed from error
    if not summary:
        raise TrainingError("training finished without a summary from rank 0", hint=f"Run folder: {run_dir}")
    fabric = summary.get("fabric") or {}
    if fabric.get("met") is False:
        summary["wall_s"] = time.perf_counter() - t_start
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        raise TrainingError(
            f"stopped after step {summary.get('steps')}: the inter-node transport is {fabric['verdict']!r} "
            f"({fabric.get('basis')}), but fabric.require is {fabric['require']!r}: {fabric.get('note')} "
            f"(report above; NCCL lines in {run_dir / 'nccl'})",
            hint="Fix the network (EFA device plugin, vpc.amazonaws.com/efa requests, FI_PROVIDER=efa, "
            "NCCL_NET_PLUGIN=ofi), or set fabric.require to 'any' to train over whatever NCCL picks.",
        )
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary["first_loss"] = history[0]["loss"] if history else summary.get("first_loss")
    summary["checkpoints"] = [p for _, p, ok in list_checkpoints(root) if ok]
    preempted = summary.setdefault("ended", "finished") == PREEMPTED  # a notice ended it: saved, not failed
    if preempted:
        summary["preempted"]["seconds_left"] = _seconds_left(summary)
        say(preempted_line(summary))
    if training.export and not preempted:
        final = latest_complete(root)
        if final is None:
            raise TrainingError(
                "training finished but left no complete checkpoint to export", hint=f"Run folder: {run_dir}"
            )
        # A LoRA run's export merges the adapters into the base it trained on (model_path: already here).
        summary["model_dir"] = str(export_hf(final, run_dir / "model", base=model_path))
        say(f"model: {summary['model_dir']} (Hugging Face format)")
        if eval_tasks := training.eval_tasks:  # --eval-tasks: RUN/eval.json before report, bundle
            workers = int(summary.get("world_size") or 1)  # a cluster job scores on as many GPUs as it trained on
            summary["eval"] = evaluate_run(run_dir, list(eval_tasks), workers=workers, say=say)["tasks"]
    summary["wall_s"] = time.perf_counter() - t_start
    summary["model_id"] = training.model_id
    summary["data"] = training.data
    summary["data_counts"] = data_counts
    summary["packing_efficiency"] = data_counts["packing_efficiency"] if data_counts else None
    summary["stragglers"] = heard.stragglers
    return summary


def report_line(run_dir: Path) -> str:
    """Write the run's ``report.html`` and return the line saying where it is; on an image without matplotlib (which
    ``submit`` does not ship: :func:`~raytrain_eks.report.plots.can_draw`) write none, and say where it is drawn."""
    from raytrain_eks.report.html import write_report
    from raytrain_eks.report.plots import can_draw

    if not can_draw():
        return (
            "report: not written here (this Python has no matplotlib, which draws its plots): `raytrain-eks results "
            f"{run_dir.name}` writes it from the run's metrics where it fetches the run; `raytrain-eks report` does "
            f"on a copy of {run_dir}"
        )
    return f"report: {write_report([run_dir], run_dir)}"


def _start_watchdog(
    board: ActorHandle | None,
    run: _PreparedRun,
    found: Callable[[Finding | Straggler], None],
    say: Callable[[str], None],
) -> Watchdog | None:
    """The run's :class:`~raytrain_eks.train.watchdog.Watchdog`, started (``None`` with ``training.watchdog`` off)."""
    from raytrain_eks.train.watchdog import Watchdog, WatchSettings

    if board is None:
        return None
    training = run.cfg.training
    settings = WatchSettings(
        world_size=run.num_workers,
        last_step=training.steps,
        factor=training.watchdog_factor,
        floor_s=training.watchdog_floor_s,
        nccl=run.board_name if run.use_gpu else None,
        straggler_margin=training.straggler_margin,
        straggler_steps=training.straggler_steps,
    )
    return Watchdog(board, settings, run.run_dir, found, say).start()


def _eval_dataset(
    cfg: Config,
    prepared: PreparedData,
    eval_files: tuple[list[str], str] | None,
    model_path: str,
    say: Callable[[str], None],
) -> object:
    """The packed held-out data: the rows held out of the training data, or ``training.eval_data`` (``eval_files``,
    its listing); ``None`` without either."""
    from raytrain_eks.train.data.pipeline import prepare_for

    training = cfg.training
    if prepared.eval_dataset is not None:
        say(f"eval: {prepared.eval_rows} rows held out (seed {training.seed}), every {training.eval_every} steps")
        return prepared.eval_dataset
    if not training.eval_data:
        return None
    held = prepare_for(
        training, model_path, data=training.eval_data, listed=eval_files, option="training.eval_data", min_blocks=1
    )
    say("eval " + held.describe(training.eval_data, training.seq_len).removeprefix("data: "))
    return held.dataset


def _worker_entry(config: dict[str, WorkerJob]) -> None:
    """The loop as Ray Train runs it, sending a failing worker's whole traceback to the driver first."""
    from raytrain_eks.train.loop import ray_worker_entry

    job = config["job"]
    try:
        ray_worker_entry(job)
    except Exception:
        if job.metrics_queue is not None:
            import ray.train

            rank = ray.train.get_context().get_world_rank()
            job.metrics_queue.put(WorkerFailure(rank=rank, traceback=traceback.format_exc()))
        raise


def _resized(cfg: Config, run_dir: Path, resume_from: str, world: int, say: Callable[[str], None]) -> Config:
    """``cfg`` with the ``grad_accum_steps`` that keeps the checkpoint's global batch on ``world`` workers
    (:func:`~raytrain_eks.train.preemption.keep_global_batch`), written to the run's config.yaml (and its storage
    copy) so that a later resume starts from it."""
    from raytrain_eks.train.checkpoint import saved_world_size, write_storage_config

    training = cfg.training
    accum, line = keep_global_batch(
        training.batch_size, training.grad_accum_steps, saved_world=saved_world_size(resume_from), world=world
    )
    if line:
        say(line)
    if accum == training.grad_accum_steps:
        return cfg
    cfg = cfg.model_copy(update={"training": training.model_copy(update={"grad_accum_steps": accum})})
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    write_storage_config(run_dir, training.storage_path, cfg.to_yaml())
    return cfg


def _seconds_left(summary: dict[str, Any]) -> float | None:
    """Seconds from now (the run's end) to the deadline of the notice that ended it (``None``: it named none)."""
    notice = summary["preempted"]["notice"]
    return Notice(notice["kind"], seen=notice["seen"], deadline=notice["deadline"]).seconds_left()


def _keeping(say: Callable[[str], None], lines: list[str]) -> Callable[[str], None]:
    """``say`` that also appends each line to ``lines``."""

    def said(line: str) -> None:
        lines.append(line)
        say(line)

    return said


def _remove_if_unused(run_dir: Path, error: Exception) -> bool:
    """Remove the new run folder of a run its data stopped before anything was trained, when the folder holds nothing
    but the copy of the configuration (no log the message points to): a bad data set leaves no empty run behind.
    Returns whether it was removed."""
    if not isinstance(error, DataError) or {p.name for p in run_dir.iterdir()} != {"config.yaml"}:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return not run_dir.exists()


def _logged(exc: Exception, run_dir: Path) -> Exception:
    """Append the full story of ``exc`` (tracebacks, the workers' included) to ``RUN_DIR/error.log``.

    Returns the exception to raise: ``exc`` itself, its one-line message now naming the log, when it is a
    :class:`UserError`; a :class:`TrainingError` of one line for anything unexpected. A :class:`UserError` that
    says all there is to say (no exception behind it) is returned as it is and nothing is written.
    """
    behind = (exc.__cause__ or exc.__context__) if isinstance(exc, UserError) else exc
    if behind is None:
        return exc
    log = run_dir / ERROR_LOG
    headline = exc.message if isinstance(exc, UserError) else f"unexpected error: {_last_line(exc)}"
    with log.open("a") as f:
        f.write(f"=== {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC: {headline}\n")
        f.write(error_report(behind))
        details = getattr(exc, "details", None)
        if details:
            f.write("\nThe workers' own tracebacks:\n" + details)
        if behind is not exc:  # where the one-line message itself was raised
            f.write("\nReported as:\n" + "".join(traceback.format_exception(exc, chain=False)))
        f.write("\n")
    note = f"(full traceback: {log})"
    if isinstance(exc, UserError):
        exc.extend(note)
        return exc
    return TrainingError(f"{headline} {note}", hint=f"Run folder: {run_dir}")


def error_report(exc: BaseException) -> str:
    """``exc``'s traceback with its causes, then each failed Ray Train worker's own (they carry the remote one)."""
    parts = ["".join(traceback.format_exception(exc))]
    failures = getattr(exc, "worker_failures", None) or {}
    for rank, failure in sorted(failures.items()):
        parts.append(f"--- worker rank {rank} ---\n" + "".join(traceback.format_exception(failure)))
    return "\n".join(parts)


def _last_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__
