"""Deploy commands of the ``raytrain-eks`` CLI; :func:`register` adds them to the app.

raytrain-eks plan                              # the steps and the hourly cost, nothing written
raytrain-eks plan --output-dir plan-out        # plus every file deploy would apply, and plan.json
raytrain-eks plan --mode rayjob -o plan-out    # a RayJob (cluster deleted when the job ends) instead
raytrain-eks up [--plan] [--train] [-y]       # cluster, node groups, device plugins, KubeRay (resumes)
raytrain-eks submit [--mode rayjob]           # run the job in the cluster; exit 1 unless EFA carried it
raytrain-eks status | logs [--follow]         # what is deployed; the last job's output
raytrain-eks check [--exclude-bad-nodes]      # each GPU node proven in its worker pod; exit 1 naming a bad one
raytrain-eks down [-y]                        # delete everything up and submit created, newest first
raytrain-eks compare-fabric [-y]              # the job over EFA, then over TCP: the speed-up of EFA
raytrain-eks results [RUN] [--to DIR]         # the runs in the deployment's storage; fetch one's bundle

``plan`` and ``up --plan`` are pure: no AWS credentials, and none of eksctl, helm or kubectl, are needed. The
other commands remember the cluster, region and zone in ``.raytrain-eks/state.json`` of the working folder, and
check first that every program they will run is installed (:mod:`raytrain_eks.eks.programs`: eksctl, helm, and the
``aws`` or ``aws-iam-authenticator`` the kubeconfig runs for every call to the cluster), naming all missing ones.
Example::

    app = typer.Typer()
    register(app)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from rich.console import Console

from raytrain_eks import presets
from raytrain_eks.config import Config, load_config
from raytrain_eks.deploy import compare
from raytrain_eks.folders import new_folder
from raytrain_eks.health.pairs import MIN_BANDWIDTH_FRACTION
from raytrain_eks.options import ClusterPresetOpt, ConfigOpt, JsonOpt, SetOpt, StateDirOpt, YesOpt

if TYPE_CHECKING:
    from raytrain_eks.k8s.state import Deployment


class PlanMode(StrEnum):
    raycluster = "raycluster"
    rayjob = "rayjob"


def register(app: typer.Typer) -> None:
    """Add ``plan``, ``up``, ``submit``, ``check``, ``status``, ``logs``, ``down``, ``compare-fabric`` and ``results``
    to ``app``."""
    app.command()(plan)
    app.command()(up)
    app.command()(submit)
    app.command()(check)
    app.command()(status)
    app.command()(logs)
    app.command()(down)
    app.command("compare-fabric")(compare_fabric)
    app.command()(results)


KubeconfigOpt = Annotated[
    Path | None,
    typer.Option(help="cluster.target kubernetes: the cluster's kubeconfig (default: $KUBECONFIG, ~/.kube/config)."),
]
ContextOpt = Annotated[str | None, typer.Option(help="cluster.target kubernetes: the kubeconfig's context to use.")]
ModeOpt = Annotated[
    PlanMode, typer.Option(help="raycluster: a long-lived cluster the job is submitted to; rayjob: one job.")
]


OfflineOpt = Annotated[
    bool,
    typer.Option(
        "--offline",
        help="No node reaches a package index: the packages the image lacks go as wheels, built here for the "
        "image's Python, through training.storage_path (ray.offline).",
    ),
]


def plan(
    config: ConfigOpt = None,
    preset: ClusterPresetOpt = "reference",
    output_dir: Annotated[
        Path | None,
        typer.Option("--output-dir", "-o", help="Write every file deploy would apply, and plan.json, here."),
    ] = None,
    mode: ModeOpt = PlanMode.raycluster,
    sets: SetOpt = None,
    offline: OfflineOpt = False,
    state_dir: StateDirOpt = Path(".raytrain-eks"),
) -> None:
    """Show what deploy would create, apply and submit, and its cost per hour. Needs no credentials. With
    cluster.target kubernetes: what up and submit would do there, the worker pods sized from what up recorded in
    --state-dir (only read), else from ray.worker_cpu, ray.worker_memory_gib and cluster.efa_per_node."""
    from raytrain_eks.deploy.plan import Mode, write_files
    from raytrain_eks.deploy.target import target_for

    cfg = _load(config, preset, [*(sets or []), *(["ray.offline=true"] if offline else [])])
    # Only whether a token is there: its value stays in this process's environment until deploy sends it.
    hf_token = bool(os.environ.get("HF_TOKEN"))
    chosen = cast("Mode", mode.value)
    # Built before anything touches the disk; a cluster of the kubeconfig is never contacted here.
    result = target_for(cfg).plan(cfg, state_dir=state_dir, mode=chosen, hf_token=hf_token)
    written = [] if output_dir is None else write_files(result, output_dir)

    out = Console(highlight=False, soft_wrap=True)
    where = result.summary.get("where") or f"cluster {cfg.cluster.name} in {cfg.cluster.region}"
    out.print(f"[bold]Plan[/] ({result.mode}) for {where}:")
    for i, step in enumerate(result.steps, 1):
        out.print(f"{i:>2}. [bold]{step.name}[/]: {step.action}")
    for note in result.assumptions:
        out.print(f"[yellow]assumption:[/] {note}")
    cost = result.cost
    if cost["total_usd"] is None:  # a cluster of the kubeconfig without a configured price
        out.print(f"[bold]Cost per hour[/]: price unknown: {cost['unpriced']}")
    else:
        priced_as = cost.get("priced_as") or f"{cost['price_region']} on-demand"
        spread = cost.get("total_usd_range")
        within = "" if not spread else f" (spot: ${spread[0]:.2f}-{spread[1]:.2f})"
        out.print(f"[bold]Cost per hour[/] ({priced_as}): ${cost['total_usd']:.2f}{within}")
    for item in cost["items"]:
        usd = "price unknown" if item["usd_per_hour"] is None else f"${item['usd_per_hour']:.4f}"
        out.print(f"  {item['name']}: {item['count']} x {item['what']} = {usd}")
    summary = result.summary
    if summary["memory_per_gpu"]:
        out.print(summary["memory_per_gpu"]["line"], markup=False)
    if summary.get("sharding"):
        out.print(summary["sharding"]["line"], markup=False)  # the layout the estimate assumes
    if summary["memory_per_gpu"]:
        out.print(summary["memory_per_gpu"]["loss_kernel_line"], markup=False)
        if summary["memory_per_gpu"]["batch_line"]:  # training.batch_size auto, resolved
            out.print(summary["memory_per_gpu"]["batch_line"], markup=False)
        out.print(summary["memory_per_gpu"]["speed_line"], markup=False)  # a prediction only where measured
    out.print(f"[bold]Packages[/] the job adds to {cfg.ray.image}: " + summary["runtime_env"]["how"])
    out.print(f"[bold]Checkpoints[/] in {summary['checkpoints']} ({summary['checkpoint_role']})", markup=True)
    storage = summary["checkpoint_storage"]
    if storage:
        usd = storage["usd_per_month"]
        kept = f", ${usd:.2f} a month while kept" if usd is not None else f" in {storage['where']}"
        out.print(
            f"  {storage['kept_checkpoints']} kept checkpoints of a run: about {storage['gb']} GB{kept} "
            f"({storage['basis']})"
        )
    if output_dir is not None:
        names = ", ".join(str(p.relative_to(output_dir)) for p in written)
        out.print(f"Wrote {len(written)} files to {output_dir}: {names}")
    else:
        out.print("Nothing written; add --output-dir DIR for the files.")


# ------------------------------------------------------------------------------------------------------------------
# up / submit / status / logs / down: thin layers over the target (target_for) and raytrain_eks.deploy.submit
# ------------------------------------------------------------------------------------------------------------------

_out = Console(highlight=False, soft_wrap=True)


def _say(line: str) -> None:
    _out.print(line, markup=False)


def _say_to_stderr(line: str) -> None:  # progress while stdout holds only the result (--json)
    Console(stderr=True, highlight=False, soft_wrap=True).print(line, markup=False)


def _load(
    config: Path | None,
    preset: str,
    sets: list[str] | None = None,
    kubeconfig: Path | None = None,
    context: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """The configuration; ``--kubeconfig`` and ``--context`` set ``cluster.kubeconfig`` and ``cluster.context``;
    ``overrides`` are a command's own flags (below ``--set``)."""
    given = [*(sets or [])]
    if kubeconfig is not None:
        given.append(f"cluster.kubeconfig={kubeconfig}")
    if context is not None:
        given.append(f"cluster.context={context}")
    return load_config(preset=presets.choose(preset), path=config, overrides=overrides, sets=given or None)


def make_deployment(cfg: Config, state_dir: Path, say: Callable[[str], None] = _say) -> Deployment:
    """The real deployment: the official Kubernetes client on the target's kubeconfig, and the runner
    (``ClusterTarget.deployment``). ``say`` receives every progress line (a command whose stdout is JSON passes one
    that writes to stderr).

    The one place the commands build their collaborators; tests replace it with fakes.
    """
    from raytrain_eks.deploy.target import target_for
    from raytrain_eks.k8s.state import StateStore

    return target_for(cfg).deployment(cfg, StateStore(state_dir), say)


def _confirm(yes: bool) -> Callable[[str], bool]:
    def ask(question: str) -> bool:
        return yes or typer.confirm(question, default=False)

    return ask


def up(
    config: ConfigOpt = None,
    preset: ClusterPresetOpt = "reference",
    plan_only: Annotated[bool, typer.Option("--plan", help="Print every action and create nothing.")] = False,
    train: Annotated[bool, typer.Option("--train", help="Run `submit` once the infrastructure is up.")] = False,
    mode: ModeOpt = PlanMode.raycluster,
    yes: YesOpt = False,
    state_dir: StateDirOpt = Path(".raytrain-eks"),
    sets: SetOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Create (or resume) the cluster, GPU node group, device plugins and KubeRay; --train then runs the job. With
    cluster.target kubernetes: install only what the kubeconfig's cluster lacks."""
    from raytrain_eks.deploy.target import target_for

    cfg = _load(config, preset, sets, kubeconfig, context)
    target = target_for(cfg)
    if plan_only:
        for line in target.up_plan(cfg, train=train, mode=mode.value):
            _say(line)
        return
    d = make_deployment(cfg, state_dir)
    if train:  # up checks its own programs; --train runs submit's too, checked before up starts
        target.require_programs(d, "up", "submit", mode=mode.value)
    else:  # the kubeconfig's credential program (helm: when something is to install)
        target.check_own_programs(d, "up")
    target.up(d, confirm=_confirm(yes))
    if train:  # with what up remembered on the way (the checkpoint bucket it created, the nodes it found)
        _submit(dataclasses.replace(d, cfg=target.remembered(cfg, d.state)), mode, checks=target.checks_by_default)


def submit(
    config: ConfigOpt = None,
    preset: ClusterPresetOpt = "reference",
    mode: ModeOpt = PlanMode.raycluster,
    state_dir: StateDirOpt = Path(".raytrain-eks"),
    sets: SetOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    offline: OfflineOpt = False,
    skip_checks: Annotated[
        bool,
        typer.Option(
            "--skip-checks",
            help="Do not check the GPU nodes before the job (on by default where the target launches the nodes).",
        ),
    ] = False,
) -> None:
    """Run the training job in the cluster and check that EFA carried it (exit 1 if not, 2 if undecided)."""
    from raytrain_eks.deploy.target import target_for

    given = [*(sets or []), *(["ray.offline=true"] if offline else [])]
    d = make_deployment(_load(config, preset, given, kubeconfig, context), state_dir)
    target_for(d.cfg).require_programs(d, "submit", mode=mode.value)
    _submit(d, mode, checks=target_for(d.cfg).checks_by_default and not skip_checks)


def _submit(d: Deployment, mode: PlanMode, checks: bool = False) -> None:
    from raytrain_eks.deploy.submit import Mode, submit

    # The token goes from this environment into a Secret through the API: never a file, argv or log line.
    from raytrain_eks.k8s.manifests import passed_env

    hf_token, env = os.environ.get("HF_TOKEN") or None, passed_env(os.environ)  # HF_*, WANDB_*, MLFLOW_* as well
    result = submit(d, mode=cast("Mode", mode.value), hf_token=hf_token, env=env, checks=checks)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def check(
    config: ConfigOpt = None,
    preset: ClusterPresetOpt = "reference",
    exclude_bad_nodes: Annotated[
        bool,
        typer.Option(
            "--exclude-bad-nodes",
            help="Cordon each failing node (on EKS the node group also replaces its instance) before the next run.",
        ),
    ] = False,
    min_bandwidth_fraction: Annotated[
        float, typer.Option(help="Share of the line rate each pair of nodes must reach (bus bandwidth).")
    ] = MIN_BANDWIDTH_FRACTION,
    expected_gbps: Annotated[
        float | None,
        typer.Option(help="Line rate in Gbit/s (default: fabric.expected_gbps, else the nodes' instance type)."),
    ] = None,
    probe_max_bytes: Annotated[
        str, typer.Option(help="Largest all_reduce message of the pair probe (from a quarter of it).")
    ] = "1G",
    probe_iters: Annotated[int, typer.Option(help="Timed all_reduce calls per size and pair.")] = 5,
    skip_pairs: Annotated[bool, typer.Option("--skip-pairs", help="Leave out the probe between pairs.")] = False,
    json_output: JsonOpt = False,
    state_dir: StateDirOpt = Path(".raytrain-eks"),
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Check every GPU node in its Ray worker pod (GPUs, ECC, row remaps, Xids, DCGM, EFA, the driver) and the bus
    bandwidth between each pair of them (exit 1 if one fails)."""
    from raytrain_eks.deploy.checks import PairOptions, check_cluster
    from raytrain_eks.deploy.submit import _upload_package
    from raytrain_eks.deploy.target import target_for
    from raytrain_eks.fabric.probe import parse_size

    pairs = PairOptions(min_bandwidth_fraction, expected_gbps, parse_size(probe_max_bytes), probe_iters)
    cfg = _load(config, preset, None, kubeconfig, context)
    d = make_deployment(cfg, state_dir, _say_to_stderr if json_output else _say)
    target = target_for(d.cfg)
    result = check_cluster(
        d, target, exclude=exclude_bad_nodes, pairs=None if skip_pairs else pairs, upload=_upload_package
    )
    if json_output:
        typer.echo(result.to_json())
    else:
        for line in result.lines():
            _say(line)
    if not result.ok:
        raise typer.Exit(1)


def status(
    config: ConfigOpt = None,
    preset: ClusterPresetOpt = "reference",
    state_dir: StateDirOpt = Path(".raytrain-eks"),
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Show what this folder deployed, the GPU nodes' resources and the Ray pods and job."""
    from raytrain_eks.deploy.target import target_for

    cfg = _load(config, preset, None, kubeconfig, context)
    d, target = make_deployment(cfg, state_dir), target_for(cfg)
    target.check_own_programs(d, "status")
    for line in target.status(d):
        _say(line)
    from raytrain_eks.deploy.results import segment_lines_of

    for line in segment_lines_of(d):  # the last job's attempts, as its bundle records them
        _say(line)


def logs(
    config: ConfigOpt = None,
    preset: ClusterPresetOpt = "reference",
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream until the job ends.")] = False,
    state_dir: StateDirOpt = Path(".raytrain-eks"),
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Print the last submitted job's output (read inside the head pod)."""
    from raytrain_eks.deploy.submit import logs as job_logs
    from raytrain_eks.deploy.target import target_for

    d = make_deployment(_load(config, preset, None, kubeconfig, context), state_dir)
    target_for(d.cfg).require_programs(d, "logs")
    code = job_logs(d, follow=follow)
    if code:
        raise typer.Exit(code)


def down(
    config: ConfigOpt = None,
    preset: ClusterPresetOpt = "reference",
    yes: YesOpt = False,
    state_dir: StateDirOpt = Path(".raytrain-eks"),
    delete_checkpoints: Annotated[
        bool,
        typer.Option(
            "--delete-checkpoints",
            help="Also delete the checkpoint bucket up created, with every checkpoint and export in it.",
        ),
    ] = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Delete everything up and submit created (newest first), then check that nothing billable is left. The
    checkpoint bucket up created is kept while it holds anything, unless --delete-checkpoints is given. With
    cluster.target kubernetes: only what up and submit installed there; the cluster stays."""
    from raytrain_eks.deploy.results import lost_with_the_pods
    from raytrain_eks.deploy.target import target_for

    cfg = _load(config, preset, None, kubeconfig, context)
    d, target = make_deployment(cfg, state_dir), target_for(cfg)
    target.check_own_programs(d, "down")  # before the question: the kubeconfig's credential program, helm
    for line in lost_with_the_pods(d):  # before anything is deleted (and before the question)
        _say(line)
    target.down(d, confirm=_confirm(yes), delete_checkpoints=delete_checkpoints)


def compare_fabric(
    config: ConfigOpt = None,
    preset: ClusterPresetOpt = "reference",
    steps: Annotated[
        int | None,
        typer.Option(
            min=1, help="Steps of each run (default: fabric.compare_steps, BENCH_STEPS, else training.steps)."
        ),
    ] = None,
    warmup_steps: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Steps left out of the timing at the start of each run (default: fabric.compare_warmup_steps, "
            "BENCH_WARMUP_STEPS).",
        ),
    ] = None,
    min_samples: Annotated[
        int, typer.Option(min=1, help="Timed (logged) steps each run must have after the warm-up.")
    ] = compare.DEFAULT_MIN_SAMPLES,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the two runs' files and report.html overlaying them "
            "(default: runs/compare-fabric-YYYYMMDD-HHMMSS, with -2, -3... when that one exists)."
        ),
    ] = None,
    json_output: JsonOpt = False,
    yes: YesOpt = False,
    state_dir: StateDirOpt = Path(".raytrain-eks"),
    sets: SetOpt = None,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
) -> None:
    """Run the training job on EKS twice, over EFA then over TCP (NCCL_NET=Socket FI_PROVIDER=tcp), and print the
    speed-up of EFA in steps/s after warm-up.

    Each run gets a fresh RayCluster; its transport is proven from its own NCCL log before anything is compared.
    A RayCluster with a running Ray job is never touched; an idle one is replaced after one confirmation (-y skips
    it), and is recreated with the configured network environment afterwards, whatever the outcome.

    Both runs' metrics, summaries, samples and NCCL lines are copied from the head pod into --out, with
    comparison.json and one report.html overlaying the two runs' curves.

    Exit status: 0 compared, 1 refused (a job is running on the RayCluster, a run used the wrong transport, failed,
    or has too few steps).
    """
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def say(line: str) -> None:  # progress on stderr, so that stdout holds only the result (--json)
        err.print(line, markup=False)

    cfg = _load(config, preset, sets, kubeconfig, context)
    steps = steps or cfg.fabric.compare_steps
    if steps is not None:  # checked as any setting is (warmup_steps within the steps); only the two runs take it
        _load(config, preset, sets, kubeconfig, context, overrides={"training": {"steps": steps}})
    warmup_steps = cfg.fabric.compare_warmup_steps if warmup_steps is None else warmup_steps
    # The default is a name not yet taken: a comparison is never written over, even one made in the same second.
    out = out or new_folder(Path("runs"), f"compare-fabric-{datetime.now(UTC):%Y%m%d-%H%M%S}", create=False)
    compare.check_report_folder(out)  # before any run: a bad --out found after two runs would waste them
    from raytrain_eks.deploy.target import target_for

    first = make_deployment(cfg, state_dir, lambda _: None)
    target_for(first.cfg).require_programs(first, "compare-fabric")  # before the RayCluster
    from raytrain_eks.k8s.manifests import efa_per_pod

    if not efa_per_pod(first.cfg):  # a cluster whose GPU nodes have no EFA (cluster.target kubernetes)
        from raytrain_eks.errors import UserError

        raise UserError(
            "compare-fabric measures EFA against TCP, and the GPU nodes have no EFA (cluster.efa_per_node is 0, "
            "as up found them); nothing was run",
            hint="Run it on nodes with EFA interfaces (an EFA-enabled EKS node group); `raytrain-eks submit` runs the "
            "job here and says which transport NCCL used.",
        )
    # The token goes from this environment into a Secret through the API: never a file, argv or log line.
    with compare.eks_runner(
        cfg,
        lambda run_cfg: make_deployment(run_cfg, state_dir, say),
        confirm=lambda question: yes or typer.confirm(question, default=False, err=True),
        hf_token=os.environ.get("HF_TOKEN") or None,
        steps=steps,
    ) as run_job:
        result = compare.compare_fabric(run_job, warmup_steps=warmup_steps, min_samples=min_samples, say=say)
    from raytrain_eks.report.html import write_report

    report = write_report(compare.write_run_folders(result, out), out, comparison=result.render())
    typer.echo(result.to_json() if json_output else result.render())
    say(f"report: {report.resolve()}")


def results(
    run: Annotated[
        str | None,
        typer.Argument(
            help="A run to fetch: its name in the storage (as listed), or its whole location (s3://..., a folder).",
            show_default=False,
        ),
    ] = None,
    to: Annotated[Path | None, typer.Option("--to", help="Folder to fetch the run into (default: ./runs/RUN).")] = None,
    storage_path: Annotated[
        str | None,
        typer.Option(
            help="Where the runs are (default: the deployment's training.storage_path, its bucket on EKS); for "
            "ray.shared_volume, the volume's runs folder as mounted on this machine."
        ),
    ] = None,
    config: ConfigOpt = None,
    preset: ClusterPresetOpt = "reference",
    state_dir: StateDirOpt = Path(".raytrain-eks"),
    sets: SetOpt = None,
) -> None:
    """List the deployment's runs from their bundles in its storage (state, start, steps, final loss, cost); with
    RUN, fetch that run's bundle (export, metrics, summary, report, logs; not its checkpoints) into a folder, and
    write its report.html here when the run wrote none."""
    from raytrain_eks.deploy.results import fetch_run, fetched_lines, list_runs, render_runs, run_location

    storage = storage_path or _runs_storage(config, preset, sets, state_dir)
    if run is None:
        if not storage:
            raise _no_storage()
        for line in render_runs(storage, list_runs(storage)):
            _say(line)
        return
    if storage is None:
        run_location(None, run)  # a whole location needs no storage; a name without one is refused there
    for line in fetched_lines(fetch_run(storage, run, to)):
        _say(line)


def _runs_storage(config: Path | None, preset: str, sets: list[str] | None, state_dir: Path) -> str | None:
    """The deployment's ``training.storage_path``, with what ``up`` recorded in ``state_dir`` (EKS: its bucket)."""
    from raytrain_eks.deploy.target import target_for
    from raytrain_eks.k8s.state import StateStore

    cfg = _load(config, preset, sets)
    return target_for(cfg).remembered(cfg, StateStore(state_dir)).training.storage_path


def _no_storage() -> Exception:
    from raytrain_eks.errors import UserError

    return UserError(
        "no storage to list runs from: training.storage_path is not set and this folder's deployment records no "
        "checkpoint bucket",
        hint="Run it in the folder where you ran `raytrain-eks up` (its .raytrain-eks/ names the bucket), or give "
        "--storage-path s3://BUCKET/PREFIX (or a folder). A local run's results are in its run folder (runs/).",
    )
