"""EFA versus TCP: the same job run twice, each run's transport proven from its own NCCL log, then steps/s compared.

Run A uses the configuration's network environment (EFA through aws-ofi-nccl) with ``fabric.require = "efa"``;
run B adds ``NCCL_NET=Socket FI_PROVIDER=tcp`` with ``fabric.require = "any"`` so the in-job transport gate lets it
train. A's verdict must be ``efa`` (checked before B is started, so no hour is spent on B when A already proves
nothing) and B's must be ``socket``; otherwise the comparison is refused, naming which run used what. Two runs over
the same transport are never compared.

Throughput is taken from the per-step metric records (``metrics.jsonl``): a record's ``step_time_s`` is the wall
time of that one optimizer step (forward, backward, the gradient reduction over the fabric, the optimizer step and a
device sync), sampled every ``log_every`` steps. Records with ``step <= warmup_steps`` are skipped (NCCL connection
setup, allocator and compiler warm-up), and steps/s is the number of sampled steps over the sum of their step times
(that is, 1 / mean step time). Record timestamps are not used: checkpoint saves and log flushes between samples
would count against whichever run happened to checkpoint more. Example::

    result = compare_fabric(run_job, warmup_steps=10)   # run_job(RunSpec) -> RunOutput
    print(result.render())                              # ... Speed-up EFA / TCP: 2.62x

On EKS :func:`eks_runner` supplies ``run_job``: a fresh RayCluster with the run's worker environment and a job
submitted through :func:`raytrain_eks.deploy.submit.submit`, whose metrics (and the run folder's summary, config,
samples and NCCL lines, for :func:`write_run_folders` and the overlaid report) are read back from the head pod. It
refuses to touch a RayCluster that a job is running on, asks once before replacing an idle one, and on every way
out (success, refusal, error, Ctrl-C) puts back a RayCluster with the configured environment, so that the next
``submit`` does not reuse pods that run B forced onto TCP sockets::

    with eks_runner(cfg, deployment, confirm=lambda question: True) as run_job:
        result = compare_fabric(run_job)
"""

from __future__ import annotations

import contextlib
import json
import shlex
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_eks.errors import RunFolderError, UserError
from raytrain_eks.fabric.nccl_log import analyze
from raytrain_eks.fabric.nccl_report import TransportReport

if TYPE_CHECKING:
    from raytrain_eks.config import Config
    from raytrain_eks.k8s.state import Deployment

TCP_ENV = {"NCCL_NET": "Socket", "FI_PROVIDER": "tcp"}
"""What run B adds to the workers' environment: NCCL's own TCP socket transport, libfabric's tcp provider."""

DEFAULT_WARMUP_STEPS = 10
DEFAULT_MIN_SAMPLES = 3
_SUCCEEDED = "SUCCEEDED"


class ComparisonRefused(UserError):
    """The two runs cannot be compared: a run's transport is not the one it stands for, or too few steps."""

    exit_code = 1


@dataclass(frozen=True)
class RunSpec:
    """One run of the comparison: its label, the environment overrides on top of ``network.env``, and the
    ``fabric.require`` the job runs with."""

    key: str
    label: str
    fabric: str
    env: Mapping[str, str]
    require: str

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items()) or "the configured network.env"
        return f"run {self.key} ({self.label}: {env})"


EFA_RUN = RunSpec("A", "EFA", "efa", {}, "efa")
TCP_RUN = RunSpec("B", "TCP", "socket", TCP_ENV, "any")


@dataclass
class RunOutput:
    """What one run left behind: its per-step metric records, its NCCL lines (or their report), the job's final
    status, where it ran (a submission id or run folder), and the other files of its run folder that the report
    shows (``summary.json``, ``config.yaml``, ``samples.jsonl``, ``nccl/rank*.log``: name -> text)."""

    records: Sequence[Mapping[str, Any]]
    nccl: TransportReport | Iterable[str]
    status: str = _SUCCEEDED
    source: str = ""
    files: Mapping[str, str] = field(default_factory=dict)


RunJob = Callable[[RunSpec], RunOutput]
"""Runs the job once as ``RunSpec`` says (environment overrides and ``fabric.require``) and returns its output."""


def config_for(cfg: Config, spec: RunSpec, *, steps: int | None = None) -> Config:
    """A copy of ``cfg`` for one run: ``network.env`` with the run's overrides, ``fabric.require`` set, and
    ``training.steps`` when ``steps`` is given (checked by the caller); ``cfg`` is not changed. Example:
    ``config_for(cfg, TCP_RUN).network.env["NCCL_NET"] == "Socket"``."""
    network = cfg.network.model_copy(update={"env": {**cfg.network.env, **spec.env}})
    fabric = cfg.fabric.model_copy(update={"require": spec.require})
    training = cfg.training if steps is None else cfg.training.model_copy(update={"steps": steps})
    return cfg.model_copy(update={"network": network, "fabric": fabric, "training": training})


# ----------------------------------------------------------------------------------------------------------------
# Throughput after warm-up
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Throughput:
    """Steps/s of one run after warm-up, from the sampled steps' ``step_time_s``."""

    steps_per_s: float
    samples: int
    first_step: int
    last_step: int
    median_step_time_s: float
    tokens_per_step: float | None = None


def throughput(
    records: Iterable[Mapping[str, Any]], *, warmup_steps: int, min_samples: int = DEFAULT_MIN_SAMPLES, what: str
) -> Throughput:
    """Steps/s over the records with ``step > warmup_steps`` (see the module docstring for the formula).

    A step logged twice (a resumed run keeps every attempt's records) counts once, with its last record. Raises
    :class:`ComparisonRefused` naming ``what`` when fewer than ``min_samples`` timed steps are left. Example::

        throughput([{"step": 20, "step_time_s": 0.5}, ...], warmup_steps=10, what="run A").steps_per_s
    """
    by_step: dict[int, Mapping[str, Any]] = {}
    for r in records:
        if isinstance(r.get("step"), int) and isinstance(r.get("step_time_s"), int | float) and r["step_time_s"] > 0:
            by_step[r["step"]] = r
    kept = [by_step[s] for s in sorted(by_step) if s > warmup_steps]
    if len(kept) < max(1, min_samples):
        raise ComparisonRefused(
            f"{what} has {len(kept)} timed step(s) after a warm-up of {warmup_steps} steps "
            f"({len(by_step)} in all); at least {max(1, min_samples)} are needed",
            hint="Run more steps (training.steps), log more often (training.log_every), or lower --warmup-steps "
            "or --min-samples.",
        )
    times = [float(r["step_time_s"]) for r in kept]
    per_step = {r["tokens"] / r["step"] for r in kept if isinstance(r.get("tokens"), int | float) and r["step"]}
    return Throughput(
        steps_per_s=len(times) / sum(times),
        samples=len(times),
        first_step=int(kept[0]["step"]),
        last_step=int(kept[-1]["step"]),
        median_step_time_s=statistics.median(times),
        tokens_per_step=per_step.pop() if len(per_step) == 1 else None,
    )


# ----------------------------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One run as compared: what it was, the transport its NCCL log shows, and its throughput."""

    key: str
    label: str
    env: dict[str, str]
    require: str
    verdict: str
    reason: str
    source: str
    status: str
    throughput: Throughput
    world_size: int | None = None
    hosts: list[str] = field(default_factory=list)
    # What the run folder held, for write_run_folders; not part of the result's JSON.
    records: list[dict[str, object]] = field(default_factory=list, repr=False)
    files: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def folder_name(self) -> str:
        """The name of this run's folder beside the comparison's report: ``A-EFA``, ``B-TCP``."""
        return f"{self.key}-{self.label}"


@dataclass
class Comparison:
    """The result: both runs and the speed-up of A (EFA) over B (TCP) in steps/s after warm-up. Example::

    print(result.render()); result.to_json(); result.speedup
    """

    efa: RunResult
    tcp: RunResult
    warmup_steps: int
    speedup: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        for run in ("efa", "tcp"):
            del d[run]["records"], d[run]["files"]
        d["method"] = "steps/s = sampled steps / sum(step_time_s) over records with step > warmup_steps"
        return d

    def to_json(self) -> str:
        """Indented JSON: ``efa``, ``tcp`` (each with verdict, throughput, ...), ``warmup_steps``, ``speedup``."""
        return json.dumps(self.to_dict(), indent=2)

    def render(self) -> str:
        """A readable summary: one line per run, the speed-up, notes."""
        lines = [
            f"EFA vs TCP: the same job twice, steps/s after {self.warmup_steps} warm-up steps "
            "(from each logged step's step_time_s)",
        ]
        for r in (self.efa, self.tcp):
            t = r.throughput
            env = " ".join(f"{k}={v}" for k, v in r.env.items()) or "network.env as configured"
            lines += [
                f"  run {r.key} {r.label:<4} {t.steps_per_s:8.3f} steps/s   median step {t.median_step_time_s:.3f} s, "
                f"{t.samples} steps sampled ({t.first_step}..{t.last_step})",
                f"             transport {r.verdict} ({env}; fabric.require={r.require})"
                + (f"; {r.source}" if r.source else ""),
            ]
        lines.append(f"Speed-up EFA / TCP: {self.speedup:.2f}x")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def compare_fabric(
    run_job: RunJob,
    *,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    say: Callable[[str], None] = lambda _: None,
) -> Comparison:
    """Run A (EFA) then B (TCP) through ``run_job``, prove each run's transport, and compare steps/s.

    A's transport is checked before B is started. Raises :class:`ComparisonRefused` when a run's NCCL log does not
    show the transport it stands for, a job did not succeed, the two runs are not the same job (world size or
    tokens per step differ), or too few steps are left after warm-up.
    """
    if warmup_steps < 0:
        raise UserError(f"--warmup-steps {warmup_steps} must be 0 or more")
    say(f"Starting {EFA_RUN.describe()}")
    efa = _checked(EFA_RUN, run_job(EFA_RUN), warmup_steps, min_samples)
    say(f"{EFA_RUN.describe()}: transport {efa.verdict}, {efa.throughput.steps_per_s:.3f} steps/s")
    say(f"Starting {TCP_RUN.describe()}")
    tcp = _checked(TCP_RUN, run_job(TCP_RUN), warmup_steps, min_samples, other=efa)
    say(f"{TCP_RUN.describe()}: transport {tcp.verdict}, {tcp.throughput.steps_per_s:.3f} steps/s")
    return Comparison(
        efa=efa,
        tcp=tcp,
        warmup_steps=warmup_steps,
        speedup=efa.throughput.steps_per_s / tcp.throughput.steps_per_s,
        notes=_same_job_notes(efa, tcp),
    )


def _checked(
    spec: RunSpec, out: RunOutput, warmup_steps: int, min_samples: int, *, other: RunResult | None = None
) -> RunResult:
    report = out.nccl if isinstance(out.nccl, TransportReport) else analyze(out.nccl, source=f"run {spec.key}")
    what = spec.describe()
    if report.verdict != spec.fabric:
        raise ComparisonRefused(_wrong_transport(spec, report.verdict, report.reason, other), hint=_hint(spec))
    if report.basis != "proven":  # a run's own NCCL lines hold connection lines; without them nothing is measured
        raise ComparisonRefused(
            f"{what}: its NCCL lines do not prove the transport ({report.verdict} was only selected: {report.reason})",
            hint="Pass the run's whole NCCL_DEBUG=INFO output, with its connection ('via NET/...') lines.",
        )
    if out.status != _SUCCEEDED:
        raise ComparisonRefused(
            f"{what} ended {out.status}{f' ({out.source})' if out.source else ''}; only finished runs are compared",
            hint="`raytrain-eks logs` shows the job's output.",
        )
    return RunResult(
        key=spec.key,
        label=spec.label,
        env=dict(spec.env),
        require=spec.require,
        verdict=report.verdict,
        reason=report.reason,
        source=out.source,
        status=out.status,
        throughput=throughput(out.records, warmup_steps=warmup_steps, min_samples=min_samples, what=what),
        world_size=report.world_size,
        hosts=list(report.hosts),
        records=[dict(r) for r in out.records],
        files=dict(out.files),
    )


def check_report_folder(out_dir: Path) -> None:
    """Refuse an ``out_dir`` that is a file or already holds a comparison (nothing is overwritten)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunFolderError(f"--out {str(out_dir)!r} is a file", hint="Give --out a folder, new or empty.")
    if (out_dir / "comparison.json").exists():
        raise RunFolderError(
            f"--out {str(out_dir)!r} already holds a comparison (comparison.json); it is not overwritten",
            hint="Give --out another folder, or leave it out for a new one under runs/.",
        )


def write_run_folders(result: Comparison, out_dir: Path) -> list[Path]:
    """Both runs as local run folders under ``out_dir`` (``A-EFA/``, ``B-TCP/``: ``metrics.jsonl`` and the files
    read back with it) and ``comparison.json``; returns the two folders, for the overlaid report. A file name that
    would leave its folder is skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    folders = []
    for run in (result.efa, result.tcp):
        folder = out_dir / run.folder_name
        folder.mkdir(exist_ok=True)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run.records))
        for name, text in run.files.items():
            target = (folder / name).resolve()
            if name == "metrics.jsonl" or not target.is_relative_to(folder.resolve()):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        folders.append(folder)
    (out_dir / "comparison.json").write_text(result.to_json() + "\n")
    return folders


def _wrong_transport(spec: RunSpec, verdict: str, reason: str, other: RunResult | None) -> str:
    head = f"{spec.describe()} used {verdict}, not {spec.fabric}"
    if other is not None and other.verdict == verdict:
        head += (
            f", the same transport as run {other.key} ({other.label}); two runs over one transport are never compared"
        )
    elif other is not None:
        head += f" (run {other.key} used {other.verdict})"
    return f"{head}: {reason}"


def _hint(spec: RunSpec) -> str:
    if spec.fabric == "efa":
        return (
            "Fix EFA first (`raytrain-eks verify-transport` on the run's logs shows why NCCL did not use it): every "
            "worker pod must request vpc.amazonaws.com/efa and set FI_PROVIDER=efa and NCCL_NET_PLUGIN=ofi."
        )
    return (
        "NCCL did not take the TCP socket transport for traffic between nodes; check that the workers run on at "
        "least two nodes and that NCCL_NET=Socket reached their environment."
    )


def _same_job_notes(efa: RunResult, tcp: RunResult) -> list[str]:
    problems = []
    if efa.world_size and tcp.world_size and efa.world_size != tcp.world_size:
        problems.append(f"world size {efa.world_size} (run A) vs {tcp.world_size} (run B)")
    a, b = efa.throughput.tokens_per_step, tcp.throughput.tokens_per_step
    if a and b and a != b:
        problems.append(f"tokens per step {a:g} (run A) vs {b:g} (run B)")
    if problems:
        raise ComparisonRefused(
            "the two runs are not the same job: " + "; ".join(problems),
            hint="Run the comparison again without changing the configuration between the runs.",
        )
    notes = []
    if len(efa.hosts) != len(tcp.hosts):
        notes.append(f"NCCL logged {len(efa.hosts)} host(s) in run A and {len(tcp.hosts)} in run B")
    return notes


# ----------------------------------------------------------------------------------------------------------------
# On EKS
# ----------------------------------------------------------------------------------------------------------------


class ClusterBusy(UserError):
    """A job is running on the RayCluster that the comparison would delete: nothing was changed."""

    exit_code = 1


_ACTIVE = ("PENDING", "RUNNING")

# Runs in the head pod: one JSON line per Ray job (submitted jobs and plain drivers), from the dashboard inside it.
_RAY_JOBS = """\
import json, sys
from ray.job_submission import JobSubmissionClient
for job in JobSubmissionClient(sys.argv[1]).list_jobs():
    status, kind = (getattr(x, "value", x) for x in (job.status, job.type))
    line = {"id": job.submission_id or job.job_id, "type": kind, "status": status, "entrypoint": job.entrypoint or ""}
    print(json.dumps(line))
"""


def ray_jobs(d: Deployment) -> list[dict[str, str]]:
    """The Ray jobs of ``d``'s RayCluster as its head pod lists them (``id``, ``type``, ``status``, ``entrypoint``);
    empty when no head pod runs (then no job can). Example: ``[{"id": "raytrain-...", "status": "RUNNING", ...}]``."""
    from raytrain_eks.deploy.submit import head_exec, is_running, ray_pods
    from raytrain_eks.k8s.job import DASHBOARD
    from raytrain_eks.k8s.manifests import IMAGE_PYTHON

    ns, name = d.cfg.ray.namespace, d.cfg.ray.cluster_name
    heads, _ = ray_pods(d, ns, name)
    if not heads or not is_running(heads[0]):
        return []
    res = head_exec(d, heads[0], [IMAGE_PYTHON, "-c", _RAY_JOBS, DASHBOARD])
    if not res.ok:
        raise UserError(
            f"cannot tell whether a job is running on RayCluster {ns}/{name}: listing its Ray jobs in "
            f"{heads[0].name} failed (exit {res.returncode}): {(res.stderr or res.stdout).strip()[-400:]}",
            hint="Nothing was deleted. `raytrain-eks status` shows the Ray pods; run compare-fabric again once the "
            "head pod answers.",
        )
    jobs = []
    for line in res.stdout.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            job = json.loads(line)
            if isinstance(job, dict) and "status" in job:
                jobs.append({k: str(v) for k, v in job.items()})
    return jobs


def _claim_raycluster(d: Deployment, confirm: Callable[[str], bool]) -> bool:
    """Before anything is deleted: refuse when a job is running on the RayCluster, else ask once. Returns whether
    the RayCluster exists."""
    from raytrain_eks.deploy.submit import ray_pods
    from raytrain_eks.k8s.job import DASHBOARD
    from raytrain_eks.k8s.state import Cancelled

    ns, name = d.cfg.ray.namespace, d.cfg.ray.cluster_name
    if d.kube.get("ray.io/v1", "RayCluster", name, ns) is None:
        return False
    busy = [j for j in ray_jobs(d) if j["status"] in _ACTIVE]
    if busy:
        job = busy[0]
        entry = job.get("entrypoint", "")
        what = f"job {job['id']} is {job['status']} on it" + (f" ({entry[:120]})" if entry else "")
        if len(busy) > 1:
            what += f", and {len(busy) - 1} more"
        (head, *_), _ = ray_pods(d, ns, name)  # a job runs, so ray_jobs found the head pod
        stop = ["kubectl", *d.kube_flags(), "-n", ns, "exec", head.name, "-c", "ray-head", "--"]
        stop += ["ray", "job", "stop", "--address", DASHBOARD, job["id"]]
        raise ClusterBusy(
            f"RayCluster {ns}/{name} is in use: {what}. compare-fabric deletes the RayCluster, which would kill "
            "the job; nothing was deleted",
            hint="Wait until the job ends (`raytrain-eks logs --follow` follows the last job submitted from this "
            f"folder), or stop it: `{shlex.join(stop)}`; then run compare-fabric again.",
        )
    question = (
        f"compare-fabric deletes RayCluster {ns}/{name} (no Ray job is running on it) and runs the job on fresh "
        "pods twice, over EFA then over TCP; afterwards the RayCluster is recreated with the configured network "
        "environment. Continue?"
    )
    if not confirm(question):
        raise Cancelled("cancelled: nothing was deleted")
    return True


def restore_raycluster(d: Deployment, *, hf_token: bool) -> None:
    """Replace the RayCluster with the one ``submit`` would apply for ``d.cfg`` (the configured network environment
    and ``fabric.require``): delete the last run's cluster, wait for its pods to go, then apply the namespace, the
    job's ConfigMap and the RayCluster, as :func:`raytrain_eks.deploy.submit.submit` does. Its new pods start on
    their own.
    """
    from raytrain_eks.deploy.submit import apply_job_config, apply_namespace, apply_raycluster, restart_raycluster

    cfg = d.cfg
    ns, name = cfg.ray.namespace, cfg.ray.cluster_name
    try:
        restart_raycluster(d)
        apply_namespace(d)
        apply_job_config(d, None)  # the token's Secret, when there is one, is still there from the runs
        apply_raycluster(d, hf_token=hf_token)
    except UserError as exc:
        delete = ["kubectl", *d.kube_flags(), "-n", ns, "delete", "raycluster", name]
        raise UserError(
            f"could not restore RayCluster {ns}/{name} after the comparison: {exc}; it may still run with the last "
            "run's environment (NCCL over TCP sockets)",
            hint=f"Delete it (`{shlex.join(delete)}`); the next `raytrain-eks submit` creates it from the "
            "configuration.",
        ) from exc
    d.say(
        f"Restored RayCluster {ns}/{name} with the configured network environment (fabric.require = "
        f"{cfg.fabric.require}); its pods are starting, `raytrain-eks status` shows them"
    )


@contextlib.contextmanager
def eks_runner(
    cfg: Config,
    deployment: Callable[[Config], Deployment],
    *,
    confirm: Callable[[str], bool],
    hf_token: str | None = None,
    steps: int | None = None,
) -> Iterator[RunJob]:
    """``run_job`` for EKS, as a context manager: for each run, a Deployment on :func:`config_for`'s copy of ``cfg``
    (the RayCluster's worker env carries the overrides; ``steps``, when given, is each run's ``training.steps``), a
    fresh RayCluster (pods keep the env they started with, and
    their Ray session logs must hold this run's NCCL lines only), :func:`raytrain_eks.deploy.submit.submit`, and the
    run's ``metrics.jsonl`` read back from the head pod.

    On entry, a RayCluster with a PENDING or RUNNING Ray job raises :class:`ClusterBusy`, and an idle one is only
    replaced when ``confirm`` says yes. Once a run has deleted the RayCluster, every exit restores it with ``cfg``
    (:func:`restore_raycluster`); when the comparison itself failed, a failed restore is reported through the
    Deployment's ``say`` and the comparison's error is the one raised. ``deployment`` is called afresh for every use,
    so each one reads the current state file.
    """
    from raytrain_eks.deploy.submit import read_metrics, read_run_files, restart_raycluster, submit

    existed = _claim_raycluster(deployment(cfg), confirm)
    touched = False

    def run(spec: RunSpec) -> RunOutput:
        nonlocal touched
        d = deployment(config_for(cfg, spec, steps=steps))
        touched = True
        restart_raycluster(d)
        result = submit(d, mode="raycluster", hf_token=hf_token)
        if result.run_dir is None and result.job_status == "SUCCEEDED":
            raise UserError(
                f"the log of {spec.describe()} (job {result.submission_id}) never named its run folder "
                "('Run folder: ...'), so its metrics cannot be read",
                hint="`raytrain-eks logs` shows the job's output.",
            )
        records = read_metrics(d, result.run_dir) if result.run_dir else []
        return RunOutput(
            records=records,
            nccl=result.report if result.report is not None else [],
            status=result.job_status,
            source=f"job {result.submission_id}" + (f", run folder {result.run_dir}" if result.run_dir else ""),
            files=read_run_files(d, result.run_dir) if result.run_dir else {},
        )

    def restore(*, failing: bool) -> None:
        if not touched:  # nothing was deleted
            return
        d = deployment(cfg)
        if not existed and d.kube.get("ray.io/v1", "RayCluster", d.cfg.ray.cluster_name, d.cfg.ray.namespace) is None:
            return  # there was none before and no run left one
        try:
            restore_raycluster(d, hf_token=bool(hf_token))
        except UserError as exc:
            if not failing:
                raise
            d.say(f"error: {exc.message}")  # the comparison's own error is the one raised
            if exc.hint:
                d.say(exc.hint)

    try:
        yield run
    except BaseException:
        restore(failing=True)
        raise
    restore(failing=False)
