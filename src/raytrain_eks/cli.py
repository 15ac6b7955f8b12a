"""The ``raytrain-eks`` command: a thin layer over library functions.

raytrain-eks train                 # local fine-tune of the built-in tiny model on the shipped data
raytrain-eks data --show 2         # what it trains on: counts, and the first packed blocks
raytrain-eks init                  # write a commented raytrain-eks.yaml
raytrain-eks config show           # the resolved configuration (file + environment + flags)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console

# The base of typer's usage errors (unknown option, bad value, missing argument) in every release the job's range
# admits: typer 0.29 puts TyperException above it, the 0.26 of AWS's Ray Train DLC has no such name.
from typer._click.exceptions import ClickException

from raytrain_eks import presets
from raytrain_eks.aws import commands as aws_commands
from raytrain_eks.config import DEFAULT_CONFIG_FILE, Config, load_config
from raytrain_eks.deploy import commands as deploy_commands
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.eval_command import eval_command
from raytrain_eks.fabric import commands as fabric_commands
from raytrain_eks.formats import FORMAT_NAMES
from raytrain_eks.options import AddressOpt, ConfigOpt, JsonOpt, PresetOpt, SetOpt, VerboseOpt
from raytrain_eks.report import commands as report_commands

if TYPE_CHECKING:
    from raytrain_eks.train.launch import RunResult

# Typer's rich help gives each option a table row of five narrow columns and cuts what does not fit with "…": option
# names, defaults and paths, at 80 columns. Click's plain help wraps instead, so it is the help of pipes and narrow
# terminals; rich's panels only where a terminal is wide enough for every command's panel (tests/test_help.py).
RICH_HELP_MIN_COLUMNS = 120
# Plain help as wide as the terminal up to this (click's own cap is 80, which breaks phrases a wider terminal holds).
PLAIN_HELP_MAX_COLUMNS = 120


def help_markup_mode() -> Literal["rich"] | None:
    """Typer's ``rich_markup_mode`` for this process: ``"rich"`` on a terminal at least
    :data:`RICH_HELP_MIN_COLUMNS` wide, else ``None`` (click's plain help).

    >>> help_markup_mode()  # piped, as under pytest
    """
    stdout = sys.stdout
    if stdout is None or not stdout.isatty():
        return None
    return "rich" if shutil.get_terminal_size().columns >= RICH_HELP_MIN_COLUMNS else None


class _AppGroup(typer.core.TyperGroup):
    """The app's root command: plain help, its own and every command's under it, is laid out for the terminal's
    width when the command runs (``COLUMNS``, else the terminal's), up to :data:`PLAIN_HELP_MAX_COLUMNS`."""

    # Any: typer 0.29 returns the Context of the click it bundles, which it does not export under a public name.
    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        if parent is None:  # commands' contexts take their width from this one
            columns = min(shutil.get_terminal_size().columns, PLAIN_HELP_MAX_COLUMNS)
            extra.setdefault("terminal_width", max(columns - 2, 50))  # click's own margin and floor
        return super().make_context(info_name, args, parent, **extra)


app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Fine-tune LLMs with Ray Train + FSDP on EKS (or locally).",
    rich_markup_mode=help_markup_mode(),
    cls=_AppGroup,
)
config_app = typer.Typer(no_args_is_help=True, help="Show the resolved configuration.")
app.add_typer(config_app, name="config")
deploy_commands.register(app)
aws_commands.register(app)
fabric_commands.register(app)
report_commands.register(app)
app.command("eval")(eval_command)

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


@app.command()
def train(
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    address: AddressOpt = None,
    output_dir: Annotated[Path | None, typer.Option(help="Run folder (default: runs/<time>-<model>).")] = None,
    model: Annotated[str | None, typer.Option(help="Hugging Face hub id, model folder, or builtin:tiny-qwen2.")] = None,
    data: Annotated[
        str | None,
        typer.Option(
            help="'random', builtin:sample-instructions, a .jsonl/.ndjson/.json/.parquet/.csv/.tsv/.arrow file or "
            "folder (s3:// too), or a Hugging Face dataset: hf:OWNER/NAME[:SPLIT]."
        ),
    ] = None,
    data_format: Annotated[str | None, typer.Option(help=f"Data format: {', '.join(FORMAT_NAMES)}.")] = None,
    method: Annotated[
        str | None,
        typer.Option(
            help="full (every weight trains), lora (adapters on a frozen base; --set training.lora.rank=N) or dpo "
            "(preference pairs, --data-format preference; LoRA by default, --set training.dpo.adapters=none for "
            "every weight, --set training.dpo.beta=0.2)."
        ),
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps.")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per packed sample.")] = None,
    batch_size: Annotated[
        str | None,
        typer.Option(
            help="Samples per worker per micro-batch, or auto: the largest the GPU's memory estimate admits, the "
            "step's samples kept through gradient accumulation."
        ),
    ] = None,
    learning_rate: Annotated[
        float | None,
        typer.Option(help="Peak learning rate (default: the method's, 2e-05 for full fine-tuning, 0.0002 for LoRA)."),
    ] = None,
    num_workers: Annotated[int | None, typer.Option(help="Training workers; 0 = one per GPU (2 on CPU).")] = None,
    checkpoint_every: Annotated[
        int | None, typer.Option(help="Save a checkpoint every N steps (and at the end); 0 = only at the end.")
    ] = None,
    keep_checkpoints: Annotated[int | None, typer.Option(help="Complete checkpoints kept (at least 2).")] = None,
    storage_path: Annotated[
        str | None,
        typer.Option(
            help="Where checkpoints go: s3://bucket/prefix or a folder every node shares (default: run folder)."
        ),
    ] = None,
    storage_shared: Annotated[
        bool | None,
        typer.Option(
            "--storage-shared/--no-storage-shared",
            help="Declare --storage-path a folder every node mounts (needed for a local path on several nodes).",
        ),
    ] = None,
    sharding: Annotated[
        str | None,
        typer.Option(help="auto (hsdp across nodes, fsdp on one node, none for one fp32 worker), fsdp, hsdp or none."),
    ] = None,
    reduce_precision: Annotated[
        str | None, typer.Option(help="Gradient reduction dtype across ranks: fp32 or bf16 (half the bytes).")
    ] = None,
    compile_layers: Annotated[
        bool | None,
        typer.Option(
            "--compile/--no-compile",
            help="Compile each decoder layer with torch.compile before sharding (on), or never (off); unset: "
            "training.compile, auto by default (compiled on CUDA GPUs, not on CPUs).",
        ),
    ] = None,
    eval_tasks: Annotated[
        str | None,
        typer.Option(help="lm-eval tasks scored on the exported model at the end, comma-separated (see `eval`)."),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Continue a run from its newest complete checkpoint, with its config.yaml: its run folder, or "
            "(on a machine without it) its storage folder, s3://BUCKET/PREFIX/RUN."
        ),
    ] = None,
    sets: SetOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Fine-tune a causal LM with Ray Train + FSDP2. With no arguments: a local run of the built-in tiny model."""
    from raytrain_eks.ray_session import joined_address
    from raytrain_eks.train.launch import run_training

    flags: dict[str, Any] = {
        "model_id": model,
        "data": data,
        "data_format": data_format,
        "method": method,
        "steps": steps,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "num_workers": num_workers,
        "checkpoint_every": checkpoint_every,
        "keep_checkpoints": keep_checkpoints,
        "storage_path": _storage_path(storage_path),
        "storage_shared": storage_shared,
        "sharding": sharding,
        "reduce_precision": reduce_precision,
        "compile": compile_layers,
        "output_dir": str(output_dir) if output_dir else None,
        "eval_tasks": [t.strip() for t in eval_tasks.split(",") if t.strip()] if eval_tasks else None,
    }
    address = joined_address(address, err.print)
    if resume is not None and output_dir is not None:
        raise UserError("--resume continues the run in its own folder; leave out --output-dir")
    config = config if config is not None or resume is None else _resume_config(resume)
    cfg = _train_config(flags, preset, config, address, sets)
    price, unpriced = _train_price(cfg, config, address)
    from raytrain_eks.fabric.deployment import read_deployment
    from raytrain_eks.report.segments import capacity_of

    with _Progress() as progress:
        result = run_training(
            cfg,
            address=address,
            say=progress.say,
            progress=progress,
            verbose=verbose,
            resume=resume,
            price=price,
            unpriced=unpriced,
            capacity=capacity_of(read_deployment(config), joined=address is not None),
        )
    _said_at_the_end(result, cfg.training.steps)


def _train_config(
    flags: dict[str, Any], preset: str | None, config: Path | None, address: str | None, sets: list[str] | None
) -> Config:
    """``train``'s configuration: the preset for where it runs, the file (a resumed run's copy, removed once read),
    the flags and ``--set``."""
    try:
        return load_config(
            preset=presets.choose(preset, address=address), path=config, overrides={"training": flags}, sets=sets
        )
    finally:
        if config is not None and config.parent.name.startswith(_RESUME_TMP):  # a copy of a storage folder's
            shutil.rmtree(config.parent, ignore_errors=True)


def _train_price(
    cfg: Config, config: Path | None, address: str | None
) -> tuple[Callable[[dict[str, object]], Mapping[str, object] | None] | None, str | None]:
    """How a run on a cluster is priced by its target: at the price the user configured, or (EKS) on a cluster this
    tool deployed, from the record submit puts beside the config; a local run is not priced."""
    if address is None:
        return None, None
    from raytrain_eks.deploy.target import target_for

    return target_for(cfg).price(cfg, config)


def _said_at_the_end(result: RunResult, steps: int) -> None:
    """``train``'s last lines: the segments of a resumed run, the cost, then how it ended (preempted: the exit status
    and the command that resumes it) and where its folder and bundle are."""
    from raytrain_eks.report.segments import SEGMENTS, read_segments, segment_lines

    segments = read_segments(result.run_dir / SEGMENTS)
    if len(segments) > 1:  # a resumed run: each attempt's steps, nodes, ending and cost
        for line in segment_lines(segments):
            out.print(line, markup=False, highlight=False)
    s = result.summary
    if "cost" in s:
        from raytrain_eks.report.html import cost_text

        out.print(f"cost: {cost_text(s['cost'], s.get('cost_note'))}")
    if s.get("ended") == "preempted":  # saved, not failed: the next attempt continues from its checkpoint
        from raytrain_eks.train.preemption import EXIT_CODE

        out.print(f"preempted after step {s['preempted']['step']} of {steps}: {s['preempted']['reason']}")
        out.print(f"Run folder: {result.run_dir}")
        out.print(f"Resume it (on any number of workers): raytrain-eks train --resume {result.run_dir}")
        raise typer.Exit(code=EXIT_CODE)
    mfu = "n/a on CPU" if s.get("mfu") is None else f"{100 * s['mfu']:.1f}%"
    out.print(
        f"done: {s['steps']} steps, loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}, "
        f"{s['tokens_per_s']:.0f} tokens/s, MFU {mfu}, {s['wall_s']:.0f} s"
    )
    if result.bundle:
        out.print(f"Run bundle: {result.bundle}")
    out.print(f"Run folder: {result.run_dir}")


@app.command()
def data(
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    data_path: Annotated[
        str | None,
        typer.Option("--data", help="The training data, as train takes it (default: training.data)."),
    ] = None,
    data_format: Annotated[str | None, typer.Option(help=f"Data format: {', '.join(FORMAT_NAMES)}.")] = None,
    model: Annotated[
        str | None, typer.Option(help="The model whose tokenizer (and chat template) encodes the data.")
    ] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per packed sample.")] = None,
    show: Annotated[int, typer.Option(help="Packed blocks to print, from the first.")] = 1,
    json_output: JsonOpt = False,
    sets: SetOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """What the model will be trained on: rows read, kept, malformed, truncated and dropped; tokens trained, masked
    and padding; blocks and how full they are; and the first packed blocks with the trained tokens marked. Prepared
    as train prepares it, with no cluster and no GPU."""
    from raytrain_eks.train.data.preview import preview_data, render_block

    flags = {"model_id": model, "data": data_path, "data_format": data_format, "seq_len": seq_len}
    cfg = load_config(preset=presets.choose(preset), path=config, overrides={"training": flags}, sets=sets)
    shown = preview_data(cfg, show=show, verbose=verbose, say=None if json_output else err.print)
    if json_output:
        typer.echo(json.dumps(shown.to_json(), indent=2))
        return
    out.print(shown.line, markup=False)
    c = shown.counts
    unit = "pairs" if "pairs" in c else "rows"  # preference pairs are counted as pairs (method dpo)
    out.print(
        f"tokens: {c['trained_tokens']} trained, {c['masked_tokens']} masked (prompts, each row's first), "
        f"{c['padding_tokens']} padding; {c['blocks']} blocks of {c['seq_len']}, "
        f"{100 * c['packing_efficiency']:.1f}% filled"
        + (f"; {c[f'eval_{unit}']} {unit} held out for evaluation" if c[f"eval_{unit}"] else ""),
        markup=False,
    )
    if shown.blocks:
        from raytrain_eks.train.data.encoding import encoding_tokenizer

        tokenizer = encoding_tokenizer(shown.tokenizer_path, shown.chat_template)
        marks: Literal["colour", "brackets"] = "colour" if out.is_terminal else "brackets"
        out.print("trained tokens " + ("in green" if marks == "colour" else "between [[ and ]]"), markup=False)
        for block in shown.blocks:
            out.print(render_block(block, tokenizer, marks=marks))


_RESUME_TMP = "raytrain-eks-resume-"


def _resume_config(resume: str) -> Path:
    """The config.yaml of the run ``--resume`` names: in its run folder, or (a URI) copied from its storage folder."""
    from raytrain_eks.train.storage import is_remote

    if is_remote(resume):
        import tempfile

        from raytrain_eks.train.checkpoint import read_storage_config

        config = Path(tempfile.mkdtemp(prefix=_RESUME_TMP)) / "config.yaml"
        config.write_text(read_storage_config(resume.rstrip("/")))
        return config
    config = Path(resume).expanduser() / "config.yaml"
    if not config.is_file():
        raise UserError(
            f"--resume {resume!r}: no config.yaml there, so it is not a run folder of raytrain-eks",
            hint="Give the folder printed as 'Run folder:' by the run you want to continue, or its storage folder "
            "(s3://...) from another machine.",
        )
    return config


def _storage_path(value: str | None) -> str | None:
    """``--storage-path`` as the workers need it: a URI as given, a local folder made absolute."""
    if value is None:
        return None
    if not value.strip():
        raise ConfigError(
            [
                f"training.storage_path = {value!r} (from flag --storage-path): must not be empty; leave the flag out "
                "to keep the checkpoints in the run folder"
            ]
        )
    return value if "://" in value else str(Path(value).expanduser().resolve())


class _Progress:
    """One display on the driver: what data preparation is doing (:meth:`stage`), then a bar over training steps
    fed by the workers' metric records."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=out,
            transient=False,
        )
        self._task: Any = None
        self._stage: Any = None

    def __enter__(self) -> _Progress:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.__exit__(*exc)

    def say(self, line: str) -> None:
        self._bar.console.print(line)

    def stage(self, text: str) -> None:
        if self._stage is None:
            self._stage = self._bar.add_task("data", total=None, info=text)
        self._bar.update(self._stage, info=text)

    def __call__(self, record: dict[str, Any], total: int) -> None:
        self.update(record, total)

    def update(self, record: dict[str, Any], total: int) -> None:
        if self._stage is not None:
            self._bar.remove_task(self._stage)
            self._stage = None
        if self._task is None:
            self._task = self._bar.add_task("train", total=total, info="")
        from raytrain_eks.train.records import dpo_line

        info = f"loss {record['loss']:.3f}  {record['tokens_per_s']:.0f} tok/s  lr {record['lr']:.2e}"
        if dpo := dpo_line(record):  # a preference run's reward margin and accuracy
            info = f"{info}  {dpo}"
        self._bar.update(self._task, completed=record["step"], info=info)


@app.command()
def export(
    checkpoint: Annotated[
        str, typer.Argument(help="A checkpoint_* folder or a run folder (its newest checkpoint), local or s3://.")
    ],
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the Hugging Face model into.")],
    dtype: Annotated[str, typer.Option(help="float32 (exactly the trained weights) or bfloat16.")] = "float32",
    adapter_only: Annotated[
        bool,
        typer.Option(
            "--adapter-only", help="LoRA runs: write the adapters alone, a peft adapter folder (default: merged)."
        ),
    ] = False,
    base: Annotated[
        str | None,
        typer.Option(help="LoRA runs: the base model to merge into (default: the one the run trained on)."),
    ] = None,
) -> None:
    """Gather a sharded checkpoint into a Hugging Face model folder (safetensors, config, tokenizer); a LoRA run's
    adapters merged into their base model, or alone with --adapter-only."""
    from raytrain_eks.train.export import export_hf

    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"--dtype {dtype!r} is not supported; use float32 or bfloat16")
    path = export_hf(checkpoint, out_dir, dtype=dtype, adapter_only=adapter_only, base=base)
    out.print(f"model: {path.resolve()}")


@app.command("stage-model")
def stage_model(
    model: Annotated[
        str, typer.Argument(help="A Hugging Face Hub id (Qwen/Qwen2.5-1.5B), a model folder, or builtin:tiny-qwen2.")
    ],
    to: Annotated[
        str,
        typer.Option(
            "--to", help="Where every node reads it: s3://BUCKET/PREFIX (any URI pyarrow reads) or a shared folder."
        ),
    ],
) -> None:
    """Copy a model once where every node reads it (its config, weights and tokenizer files); a job whose
    training.model_id is the printed location reads it from there, and none of its workers asks the Hub."""
    from raytrain_eks.train.staged import stage_model as stage

    uri = stage(model, to, say=lambda line: out.print(line, markup=False))
    out.print(f"model: {uri}", markup=False)
    out.print("Set training.model_id (--model) to it.", markup=False)


@app.command()
def init(
    path: Annotated[Path, typer.Argument(help="File to write.")] = Path(DEFAULT_CONFIG_FILE),
    preset: Annotated[str, typer.Option(help=f"One of: {', '.join(presets.PRESETS)}.")] = "reference",
    force: Annotated[bool, typer.Option(help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented configuration file holding every setting of every step."""
    from raytrain_eks.config_file import commented_yaml

    if path.exists() and not force:
        raise UserError(f"{path} already exists", hint="Pass --force to overwrite it, or give another path.")
    cfg = presets.choose(preset)
    path.write_text(commented_yaml(cfg))
    out.print(f"wrote {path} (preset {preset}); edit it, then run `raytrain-eks config show`")


@config_app.command("show")
def config_show(
    config: ConfigOpt = None,
    preset: PresetOpt = None,
    env: Annotated[bool, typer.Option("--env", help="Print as env.sh export lines instead of YAML.")] = False,
    sets: SetOpt = None,
) -> None:
    """Print the configuration after the file, the environment and the preset are combined and validated."""
    cfg = load_config(preset=presets.choose(preset), path=config, sets=sets)
    if env:
        from raytrain_eks.config_file import env_file_lines

        out.print("\n".join(env_file_lines(cfg)), soft_wrap=True)
    else:
        out.print(cfg.to_yaml(), end="", soft_wrap=True)
        d = cfg.derived
        out.print(
            f"# derived: world_size={d.world_size} workers_per_node={d.workers_per_node} "
            f"cluster_gpus={d.cluster_gpus} ray_gpus_per_worker_pod={d.ray_gpus_per_worker_pod}",
            soft_wrap=True,
        )
        out.print(f"# {_memory_line(cfg)}", markup=False, soft_wrap=True)
        out.print(f"# {_sharding_line(cfg)}", markup=False, soft_wrap=True)


def _sharding_line(cfg: Any) -> str:
    """``config show``'s line on how a GPU run of the configuration shards the model (the layout the memory estimate
    assumes), or why there is none: an explicit ``training.sharding`` the placement cannot give."""
    from raytrain_eks.deploy.fit import sharding_line
    from raytrain_eks.train.sharding import ShardingError

    try:
        return sharding_line(cfg)
    except ShardingError as exc:
        return f"sharding: {exc.message} (plan and up refuse this)"


def _memory_line(cfg: Any) -> str:
    """``config show``'s memory estimate for the configured GPU node type, or why there is none."""
    from raytrain_eks.deploy.fit import check_on_image
    from raytrain_eks.instances import INSTANCE_TYPES
    from raytrain_eks.train.memory import unknown_shape_note

    gpu = INSTANCE_TYPES.get(cfg.cluster.gpu_node_type)
    if gpu is None or not gpu.gpus:
        return f"memory: no estimate ({cfg.cluster.gpu_node_type} is not a GPU type this tool knows)"
    check = check_on_image(cfg, gpu)
    if check is None:
        return unknown_shape_note(cfg.training.model_id)
    return check.line if check.fits else f"{check.line} (plan and up refuse this)"


def main(argv: list[str] | None = None) -> None:
    """Console entry point: runs the app and turns every :class:`UserError` into one message and an exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        # Without standalone mode click returns a command's exit code instead of exiting with it.
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int) and code != 0:
            sys.exit(code)
    except UserError as exc:
        err.print(f"[bold red]error:[/] {exc.message}")
        if exc.hint:
            err.print(exc.hint)
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except ClickException as exc:  # usage errors: unknown option, bad value, missing argument
        show = getattr(exc, "show", None)
        if show is None:
            raise
        show()
        sys.exit(getattr(exc, "exit_code", 2))


def console() -> None:
    """The installed ``raytrain-eks`` command: :func:`main`, then the exit handlers, then the process ends without
    tearing down its modules one by one (torch, transformers and Ray's core worker: 1-2 s on a small machine).
    An error that escapes :func:`main` (a bug) ends the usual way, with its traceback."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message")
            print(exc.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()  # Ray's shutdown and every other handler still run
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
