"""``submit`` and ``logs``: run the training job on the deployed cluster and prove which fabric carried it.

:func:`submit`: the GPU nodes are checked first (allocatable ``nvidia.com/gpu`` and ``vpc.amazonaws.com/efa`` on
every one: a missing resource fails at once, with its fix, instead of leaving pods Pending); then the namespace,
the Hugging Face token Secret (only when a token is given; its value goes to the API and nowhere else), the
job's ConfigMap and the RayCluster (or RayJob) rendered from the configuration. The pods are waited for with
progress, and on timeout the error shows the events that explain it. The job is submitted from inside the head
pod (``ray job submit`` through exec: the dashboard port never leaves the cluster) with a ``runtime_env`` that
installs what the image lacks and ships this package's code; its logs are streamed. Afterwards every worker's
NCCL lines, read from Ray's session logs inside the pods (``kubectl logs`` does not have them), go through
:mod:`raytrain_eks.fabric.nccl_log`, ``fi_info -p efa`` is run on a worker, and the result's exit code is non-zero
unless the job succeeded over the required fabric. Example::

    result = submit(d, mode="raycluster", hf_token=os.environ.get("HF_TOKEN"))
    print("\\n".join(result.summary)); sys.exit(result.exit_code)
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from raytrain_eks.config import BUILTIN_MODEL, Config
from raytrain_eks.deploy import offline as offline_wheels
from raytrain_eks.deploy.checks import before_job, hand_over_health
from raytrain_eks.deploy.fit import fit_on_image
from raytrain_eks.deploy.results import run_bundle, where_the_run_is
from raytrain_eks.deploy.target import target_for
from raytrain_eks.errors import UserError
from raytrain_eks.fabric.decision import gate_decision
from raytrain_eks.fabric.deployment import DEPLOYMENT_RECORD
from raytrain_eks.fabric.nccl_lines import NCCL_LOG_DIR, NCCL_LOG_PREFIX
from raytrain_eks.fabric.nccl_report import TransportReport
from raytrain_eks.fabric.nccl_verdict import NcclLogAnalyzer
from raytrain_eks.folders import new_folder
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import NodesNotReady, gpu_node_problems
from raytrain_eks.k8s.cluster import ExecResult, KubeApiError, Pod, image_never_pulls
from raytrain_eks.k8s.job import (
    DASHBOARD,
    code_config_map,
    head_code_dir,
    job_extras,
    job_requirements,
    package_archive,
    package_files,
    packages_config_map,
    ray_job_submit_argv,
    rayjob_manifest,
    unpack_argv,
)
from raytrain_eks.k8s.runner import CommandError
from raytrain_eks.k8s.state import Deployment, object_item
from raytrain_eks.k8s.wait import POLL_S
from raytrain_eks.train.data.sources import HF_PREFIX
from raytrain_eks.train.launch import with_chat_template_text
from raytrain_eks.train.memory import check_lora_targets
from raytrain_eks.train.staged import is_staged_location

Mode = Literal["raycluster", "rayjob"]

RAY_SESSION_LOGS = f"{m.RAY_LOG_DIR}/session_latest/logs"
# The transport gate's NCCL_DEBUG_FILE files as the worker pods have them.
POD_NCCL_LOGS = f"{NCCL_LOG_DIR}/{NCCL_LOG_PREFIX}*.log"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
EXEC_TIMEOUT_S = 120

# Runs in a worker pod: print every line holding "NCCL" of the given paths, each a folder (read whole) or a glob
# pattern of files, rotated .gz files too: Ray's session logs, and the per-process NCCL_DEBUG_FILE files of the
# training job's transport gate.
_NCCL_LINES = """\
import glob, gzip, os, sys
paths = []
for arg in sys.argv[1:]:
    for found in sorted(glob.glob(arg)):
        if os.path.isdir(found):
            for folder, _, files in sorted(os.walk(found)):
                paths += [os.path.join(folder, name) for name in sorted(files)]
        else:
            paths.append(found)
for path in paths:
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for line in f:
                if "NCCL" in line:
                    sys.stdout.write(line if line.endswith("\\n") else line + "\\n")
    except (OSError, EOFError):
        continue
"""


class PodsNotReady(UserError):
    """The Ray pods did not start in time; the message holds each pod's state and its events."""


@dataclass
class SubmitResult:
    """What happened: the job's final status, the transport verdict, ``fi_info``, and the process exit code."""

    submission_id: str
    job_status: str
    report: TransportReport | None
    efa_provider: bool | None
    versions: dict[str, str] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)
    exit_code: int = 0
    run_dir: str | None = None  # the run folder in the head pod, as the job's log said ("Run folder: ...")
    bundle: str | None = None  # the run's bundle in its storage (training.storage_path), which outlives the pods
    kept: str | None = None  # without a bundle, after a RayJob: the local folder its run folder's small files went to


# ----------------------------------------------------------------------------------------------------------------
# Pods
# ----------------------------------------------------------------------------------------------------------------


def ray_pods(d: Deployment, ns: str, cluster: str) -> tuple[list[Pod], list[Pod]]:
    pods = d.kube.pods(ns, {"ray.io/cluster": cluster})
    heads = [p for p in pods if p.labels.get("ray.io/node-type") == "head"]
    workers = [p for p in pods if p.labels.get("ray.io/node-type") == "worker"]
    return heads, workers


def is_running(p: Pod) -> bool:
    return p.phase == "Running" and p.ready


def wait_for_ray_pods(d: Deployment, ns: str, cluster: str, timeout: float) -> tuple[Pod, list[Pod]]:
    """Wait until the head and every worker pod run; on timeout raise :class:`PodsNotReady` with their events, and
    at once when a pod's image never pulls (:func:`raytrain_eks.k8s.cluster.image_never_pulls`: the GPU nodes would
    bill for the whole deadline otherwise)."""
    want = d.cfg.cluster.gpu_node_count
    seen: list[Pod] = []

    def probe() -> tuple[tuple[Pod, list[Pod]] | None, str]:
        heads, workers = ray_pods(d, ns, cluster)
        seen[:] = heads + workers
        up_workers = [w for w in workers if is_running(w)]
        if heads and is_running(heads[0]) and len(up_workers) >= want:
            return (heads[0], up_workers), "running"
        for pod in seen:
            why = image_never_pulls(pod, d.kube.pod_events(ns, pod.name)) if pod.waiting_reason else None
            if why:
                first = f"the Ray pod {pod.name} will not start: {why}. Not waiting for the deadline:"
                raise PodsNotReady(_pods_report(d, ns, seen, want, first), hint=_IMAGE_HINT)
        head_state = (heads[0].waiting_reason or heads[0].phase) if heads else "not created"
        return None, f"head {head_state}, workers {len(up_workers)}/{want} running"

    def late(_: str, waited: float) -> PodsNotReady:
        first = f"the Ray pods were not all running after {timeout:.0f} s (want 1 head and {want} workers):"
        return PodsNotReady(_pods_report(d, ns, seen, want, first), hint=_PODS_HINT)

    head, up_workers = d.wait(probe, what="Ray pods", timeout=timeout, on_timeout=late)
    d.say(f"Ray pods running: head {head.name}, {len(up_workers)} workers")
    return head, up_workers


_PODS_HINT = (
    "Fix what the events say (FailedScheduling: the nodes lack a resource the pod requests; ImagePullBackOff: the "
    "image or the NAT gateway), then run `raytrain-eks submit` again. `raytrain-eks down` stops the billing."
)


_IMAGE_HINT = (
    "Set ray.image to an image the registry has (in the config file, or `DLC_IMAGE`; the AWS Deep Learning "
    "Containers' tags are listed at https://github.com/aws/deep-learning-containers/blob/master/available_images.md), "
    "then run `raytrain-eks submit` again. `raytrain-eks down` stops the billing."
)


def _pods_report(d: Deployment, ns: str, pods: list[Pod], want: int, first: str) -> str:
    lines = [first]
    if not pods:
        lines.append("  no Ray pod was created: is the KubeRay operator running? (`raytrain-eks status`)")
    for pod in pods:
        state = pod.waiting_reason or pod.phase
        lines.append(f"  {pod.name}: {state}{' on ' + pod.node_name if pod.node_name else ''}")
        if is_running(pod):
            continue
        events = d.kube.pod_events(ns, pod.name)
        shown = [e for e in events if e.type == "Warning"] or events
        lines += [f"    {e}" for e in shown[-5:]] or ["    (no events)"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Ray job commands, run inside the head pod
# ----------------------------------------------------------------------------------------------------------------


def head_exec(d: Deployment, head: Pod, argv: list[str], *, timeout: float = EXEC_TIMEOUT_S, **kw: Any) -> ExecResult:
    return d.kube.exec(head.namespace, head.name, argv, timeout=timeout, container="ray-head", **kw)


# What `ray job status` prints (Ray 2.x, dashboard/modules/job/cli.py): "Status for job 'ID': RUNNING" while a job
# is pending or running, but "Job 'ID' succeeded", "Job 'ID' failed" or "Job 'ID' was stopped" once it has ended.
_ENDED = {"succeeded": "SUCCEEDED", "failed": "FAILED", "was stopped": "STOPPED"}


def job_status(d: Deployment, head: Pod, submission_id: str) -> str:
    """``PENDING``, ``RUNNING``, ``SUCCEEDED``, ``FAILED``, ``STOPPED`` or ``UNKNOWN``."""
    res = head_exec(d, head, ["ray", "job", "status", "--address", DASHBOARD, submission_id])
    text = res.stdout + res.stderr
    ended = re.search(r"Job '[^']*' (succeeded|failed|was stopped)\b", text)
    if ended:
        return _ENDED[ended.group(1)]
    match = re.search(r"Status for job '[^']*': (\w+)", text) or re.search(
        r"\b(PENDING|RUNNING|SUCCEEDED|FAILED|STOPPED)\b", text
    )
    return match.group(1).upper() if match else "UNKNOWN"


def _upload_package(d: Deployment, head: Pod) -> str:
    files = package_files()
    dest = head_code_dir(files)
    if head_exec(d, head, ["test", "-f", f"{dest}/raytrain_eks/__init__.py"]).ok:
        return dest
    d.say(f"Copying the raytrain_eks package ({len(files)} files) into the head pod")
    argv = unpack_argv(dest)
    res = head_exec(d, head, argv, stdin=package_archive(files))
    if not res.ok:
        raise CommandError([*argv[:2], "<unpack>", dest], res.returncode, res.stderr or res.stdout)
    return dest


# What Ray's dashboard answers (HTTP 500) when the head's job agent has not registered yet, or did not take the job
# within the dashboard's own 10 s: a head that has just started, or a busy one. Ray asks the caller to try again.
AGENT_NOT_READY = "No available agent to submit job"
AGENT_WAIT_S = 180.0  # how long submit keeps trying while the agent is not ready
AGENT_RETRY_S = 5.0


def image_lacks(d: Deployment, head: Pod) -> offline_wheels.JobPackages:
    """How what the job needs beyond the image reaches it: :func:`~raytrain_eks.k8s.job.job_requirements` less what
    the head pod's image already has in range (asked of its python3), as unpacked wheels in ``py_modules`` when they
    can travel so, else for pip (:func:`~raytrain_eks.deploy.offline.choose`); pip installs all of them when the image
    cannot be asked."""
    return offline_wheels.for_running_head(d, head, job_requirements(job_extras(d.cfg.training)))


def submit_job(
    d: Deployment,
    head: Pod,
    code_dir: str,
    *,
    packages: offline_wheels.JobPackages | None = None,
    env_vars: dict[str, str] | None = None,
) -> str:
    """``ray job submit --no-wait`` in the head pod; returns the submission id. ``packages``: how the runtime_env
    brings what the image lacks (``None``: what :func:`image_lacks` finds); unpacked wheels are copied into the head
    pod first, and named in ``py_modules``. ``env_vars``: the job's environment (the node checks it keeps).

    While the dashboard says its job agent is not ready, the same submission is tried again every
    :data:`AGENT_RETRY_S` for up to :data:`AGENT_WAIT_S`; a try that reached the agent after all (its status is
    known) is not submitted twice."""
    submission_id = time.strftime("raytrain-%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(2)
    if packages is None:
        packages = image_lacks(d, head)
    modules = offline_wheels.ship_into_head(d, head, packages.shipped) if packages.shipped else []
    argv = ray_job_submit_argv(
        code_dir,
        submission_id=submission_id,
        wait=False,
        pip=packages.pip,
        pip_options=packages.pip_options(),
        modules=modules,
        env_vars=env_vars,
    )
    start = d.clock()
    while True:
        res = head_exec(d, head, argv)
        if res.ok:
            break
        not_ready = AGENT_NOT_READY in res.stderr + res.stdout
        if not_ready and job_status(d, head, submission_id) != "UNKNOWN":
            break  # the dashboard gave up waiting, but the agent took the job
        if not not_ready or d.clock() - start >= AGENT_WAIT_S:
            waited = f" (Ray's job agent was still not ready after {AGENT_WAIT_S:.0f} s)" if not_ready else ""
            raise CommandError(
                argv[:4] + ["..."],
                res.returncode,
                res.stderr or res.stdout,
                hint=f"Read the error above{waited}, fix it and submit again.",
            )
        d.say(f"Ray's job agent in {head.name} is not ready yet; submitting again in {AGENT_RETRY_S:.0f} s")
        d.sleep(AGENT_RETRY_S)
    d.say(f"Submitted job {submission_id} from inside {head.name} (the dashboard stays inside the cluster)")
    return submission_id


def follow_job(
    d: Deployment,
    head: Pod,
    submission_id: str,
    *,
    timeout: float,
    on_output: Callable[[str], None] | None = None,
) -> str:
    """Stream the job's logs (to ``on_output``, default ``d.say``) until it ends (following again if the stream
    drops or breaks); return its final status. A job that ended after its stream was cut (the deadline, a broken
    connection) has the rest of its log shown once it has ended."""
    out = on_output or d.say
    shown: list[str] = []  # the current stream's lines

    def show(line: str) -> None:
        shown.append(line)
        out(line)

    start = d.clock()
    while True:
        left = max(timeout - (d.clock() - start), 1.0)
        argv = ["ray", "job", "logs", "--address", DASHBOARD, "--follow", submission_id]
        shown.clear()  # each `--follow` starts at the log's first line
        whole = False
        try:
            whole = head_exec(d, head, argv, timeout=left, on_output=show).ok  # 124 past the deadline
        except KubeApiError as exc:  # the exec connection broke; the status read next says whether to go on
            d.say(f"The log stream broke: {exc.message}")
        status = job_status(d, head, submission_id)
        if status in TERMINAL:
            if not whole:
                _show_rest_of_log(d, head, submission_id, len(shown), out)
            return status
        if d.clock() - start >= timeout:
            return status
        d.say(f"The log stream ended while the job is {status}; following it again")
        d.sleep(POLL_S)


def _show_rest_of_log(d: Deployment, head: Pod, submission_id: str, shown: int, out: Callable[[str], None]) -> None:
    """The lines of the ended job's log after the first ``shown`` (those its cut stream showed)."""
    try:
        res = head_exec(d, head, ["ray", "job", "logs", "--address", DASHBOARD, submission_id])
        said = (res.stderr or res.stdout).strip().splitlines()
        why = None if res.ok else said[-1] if said else f"exit {res.returncode}"
    except KubeApiError as exc:
        why = exc.message
    if why is not None:
        d.say(f"The rest of the job's log could not be read ({why}); `raytrain-eks logs` shows it")
        return
    for line in res.stdout.splitlines()[shown:]:
        out(line)


# ----------------------------------------------------------------------------------------------------------------
# After the job: which fabric carried it
# ----------------------------------------------------------------------------------------------------------------


def collect_transport(d: Deployment, workers: list[Pod]) -> TransportReport:
    """NCCL's lines from every worker pod's Ray session logs, analyzed together (one source per pod)."""
    analyzer = NcclLogAnalyzer()
    for pod in workers:
        res = d.kube.exec(
            pod.namespace,
            pod.name,
            [m.IMAGE_PYTHON, "-c", _NCCL_LINES, RAY_SESSION_LOGS, POD_NCCL_LOGS],
            timeout=EXEC_TIMEOUT_S * 5,
        )
        for n, line in enumerate(res.stdout.splitlines(), 1):
            analyzer.feed(line, pod.name, n)
    return analyzer.finish()


def check_efa_provider(d: Deployment, worker: Pod) -> tuple[bool, str]:
    """``fi_info -p efa`` on a worker: does libfabric see the EFA device? Returns (ok, what it said)."""
    for exe in ("fi_info", "/opt/amazon/efa/bin/fi_info"):
        res = d.kube.exec(worker.namespace, worker.name, [exe, "-p", "efa"], timeout=EXEC_TIMEOUT_S)
        if res.returncode == 127:
            continue
        ok = res.ok and "provider: efa" in res.stdout
        said = next((ln.strip() for ln in (res.stdout + res.stderr).splitlines() if ln.strip()), "no output")
        return ok, said
    return False, "fi_info is not in the image (neither on PATH nor in /opt/amazon/efa/bin)"


def gpu_versions(d: Deployment, worker: Pod) -> dict[str, str]:
    """Driver and CUDA versions ``nvidia-smi`` reports on a worker (empty when it cannot run)."""
    res = d.kube.exec(worker.namespace, worker.name, ["nvidia-smi"], timeout=EXEC_TIMEOUT_S)
    found = {}
    for key, pattern in (("driver", r"Driver Version:\s*([\d.]+)"), ("cuda", r"CUDA Version:\s*([\d.]+)")):
        match = re.search(pattern, res.stdout)
        if match:
            found[key] = match.group(1)
    return found


# ----------------------------------------------------------------------------------------------------------------
# submit
# ----------------------------------------------------------------------------------------------------------------


def job_config(cfg: Config) -> Config:
    """The configuration the job's ConfigMap carries, checked for what the job would otherwise find only once nodes
    and pods exist (``submit`` and ``plan`` call it before anything else): LoRA layers the model does not have
    (:func:`~raytrain_eks.train.memory.check_lora_targets`), under ``--offline`` a model or data only the Hub has
    (:func:`refuse_hub_when_offline`), and a ``training.chat_template`` file, whose text takes its place (the head
    pod has no copy of the file; a file that cannot be read stops here). Example:
    ``job_config(cfg).training.chat_template`` is the Jinja text of the file the config names."""
    check_lora_targets(cfg)
    refuse_hub_when_offline(cfg)
    return with_chat_template_text(cfg)


def _from_hub(model_id: str) -> bool:
    """Whether the job would download ``model_id`` from the Hugging Face Hub: not a staged location
    (``stage-model``'s URI), not the built-in model and not a folder (such as one of ``ray.shared_volume``)."""
    return not (is_staged_location(model_id) or model_id == BUILTIN_MODEL or model_id.startswith((".", "/", "~")))


def _hub_dataset(data: str | None) -> bool:
    """Whether ``data`` is a Hugging Face dataset the job would download (``hf:OWNER/NAME``, not ``hf:./FOLDER``)."""
    if not data or not data.startswith(HF_PREFIX):
        return False
    return not data[len(HF_PREFIX) :].startswith(("/", "./", "../", "~"))  # as hf_data_files tells a local folder


def refuse_hub_when_offline(cfg: Config) -> None:
    """Under ``--offline`` (``ray.offline``) no worker asks the Hugging Face Hub: a Hub model id, or ``hf:`` data
    or evaluation data, is one :class:`UserError` naming each, before anything is applied."""
    if not cfg.ray.offline:
        return
    t = cfg.training
    found = [f"training.model_id {t.model_id!r} is a Hub model"] if _from_hub(t.model_id) else []
    found += [
        f"{name} {value!r} is a Hub dataset"
        for name, value in (("training.data", t.data), ("training.eval_data", t.eval_data))
        if _hub_dataset(value)
    ]
    if not found:
        return
    raise UserError(
        f"--offline: the job's nodes do not download from the Hugging Face Hub, but {'; '.join(found)}. Nothing was "
        "applied",
        hint="Copy the model once where every node reads it: `raytrain-eks stage-model MODEL --to s3://BUCKET/models` "
        "(or a folder of ray.shared_volume), then set training.model_id to the location it prints; put a dataset's "
        "files there too (JSONL or Parquet) and set training.data to them. Or submit without --offline.",
    )


def _apply(d: Deployment, obj: dict[str, Any], what: str) -> None:
    d.state.record(object_item(obj))
    d.kube.apply(obj)
    d.say(f"Applied {what}")


def _wait_rayjob_cluster(d: Deployment, timeout: float) -> tuple[str, str]:
    """The RayCluster name and the Ray job id that the KubeRay operator gives a RayJob."""
    ns, name = d.cfg.ray.namespace, d.cfg.ray.cluster_name

    def probe() -> tuple[tuple[str, str] | None, str]:
        st = (d.kube.get("ray.io/v1", "RayJob", name, ns) or {}).get("status", {})
        if st.get("rayClusterName") and st.get("jobId"):
            return (st["rayClusterName"], st["jobId"]), "has its RayCluster"
        return None, f"RayJob {ns}/{name} {st.get('jobDeploymentStatus') or 'created'}, no RayCluster yet"

    return d.wait(
        probe,
        what=f"the RayCluster of RayJob {ns}/{name}",
        timeout=timeout,
        on_timeout=lambda _, waited: PodsNotReady(
            f"RayJob {ns}/{name} has no RayCluster after {timeout:.0f} s", hint="Is the KubeRay operator running?"
        ),
    )


def refuse_raycluster_holding_gpus(d: Deployment) -> None:
    """Before a RayJob: a UserError when this deployment's RayCluster (``submit --mode raycluster``) exists. Its
    worker pods hold every GPU of the node group, so the RayJob's own RayCluster would sit Pending until its
    start deadline. Nothing is deleted: a job may be running on it."""
    ns, name = d.cfg.ray.namespace, d.cfg.ray.cluster_name
    if d.kube.get("ray.io/v1", "RayCluster", name, ns) is None:
        return
    _, workers = ray_pods(d, ns, name)
    on_nodes = sum(1 for w in workers if w.node_name)
    delete = ["kubectl", *d.kube_flags(), "-n", ns, "delete", "raycluster", name]
    raise UserError(
        f"RayCluster {ns}/{name} (of `submit --mode raycluster`) still holds the GPU nodes ({on_nodes} of its "
        f"{len(workers)} worker pods placed): the RayJob's own RayCluster would wait for their GPUs until its start "
        f"deadline ({d.cfg.ray.job_start_deadline_s:.0f} s). Nothing was applied",
        hint=f"Delete that RayCluster first (a Ray job running on it stops with it): `{shlex.join(delete)}`; then run "
        "`raytrain-eks submit --mode rayjob` again. Or keep it and run `raytrain-eks submit` (--mode raycluster).",
    )


def apply_namespace(d: Deployment) -> None:
    """The job's namespace, unless it is ``default``: the first object a job needs (before the image's probe pod of
    ``submit --offline`` and :func:`apply_job_config`)."""
    if d.cfg.ray.namespace != "default":
        _apply(d, m.namespace(d.cfg), f"namespace {d.cfg.ray.namespace}")


def apply_job_config(d: Deployment, hf_token: str | None, env: dict[str, str] | None = None) -> None:
    """What every job of ``d.cfg`` needs in its namespace (:func:`apply_namespace`) first: the Hugging Face token's
    Secret (when a token is given) and the ConfigMap with the job's configuration, beside it the deployment record
    when the state says ``up`` made this cluster (what prices the run and tells the probe its nodes)."""
    cfg = d.cfg
    ns = cfg.ray.namespace
    if hf_token:
        _apply(d, m.hf_token_secret(cfg, hf_token), f"Secret {ns}/{cfg.ray.hf_token_secret} (the Hugging Face token)")
    if env:  # names only are said: the values go to the API and nowhere else
        what = f"Secret {ns}/{m.job_env_secret_name(cfg)} (passed to the job: {', '.join(env)})"
        _apply(d, m.job_env_secret(cfg, env), what)
    config_map = m.job_config_map(cfg)
    record = target_for(cfg).deployment_record(cfg, d.state)
    if record is not None:
        config_map["data"][DEPLOYMENT_RECORD] = json.dumps(record, indent=2) + "\n"
    _apply(d, config_map, f"ConfigMap {ns}/{m.config_map_name(cfg)} (the job's configuration)")


def apply_raycluster(d: Deployment, *, hf_token: bool, wheels: offline_wheels.Wheels | None = None) -> None:
    """The RayCluster rendered from ``d.cfg`` (``hf_token``: its pods read the token from the Secret; ``wheels``:
    where its pods find ``submit --offline``'s wheelhouse)."""
    cfg = d.cfg
    doc = m.raycluster(cfg, hf_token=hf_token)
    if wheels is not None:
        doc = wheels.into(doc, cfg)
    _apply(d, doc, f"RayCluster {cfg.ray.namespace}/{cfg.ray.cluster_name}")


def _running_head(d: Deployment) -> Pod | None:
    heads, _ = ray_pods(d, d.cfg.ray.namespace, d.cfg.ray.cluster_name)
    return heads[0] if heads and is_running(heads[0]) else None


def submit(
    d: Deployment,
    *,
    mode: Mode = "raycluster",
    hf_token: str | None = None,
    env: dict[str, str] | None = None,
    checks: bool = False,
) -> SubmitResult:
    """Apply the Ray objects, run the job from inside the head pod, stream its logs and judge the fabric.

    Resumes: a job of this folder still running is followed instead of submitted twice; a finished RayJob is
    replaced. A RayJob is refused while this deployment's RayCluster holds the GPU nodes, and its own RayCluster is
    deleted once the evidence in its pods is read (then the GPU node group is scaled to 0). ``hf_token`` goes into
    a Secret through the API only. Returns the result; its ``exit_code`` is 0 only when the job succeeded, NCCL's
    log meets ``fabric.require``, and (for ``efa``) ``fi_info`` sees EFA. ``checks``: prove each GPU node in its
    worker pod before a RayCluster's job (:func:`~raytrain_eks.deploy.checks.before_job`; the ``submit`` command
    turns it on where the target's ``checks_by_default`` says, unless ``--skip-checks``).
    """
    cfg = d.cfg = job_config(d.cfg)  # the ConfigMap carries it; a problem the job would meet stops here
    ns = cfg.ray.namespace
    target = target_for(cfg)
    gpu = target.gpu_type(d)
    if gpu is None:
        d.say("The GPU nodes' type is not known: the memory estimate is left out (a run that does not fit fails)")
    else:
        cfg, memory = fit_on_image(cfg, gpu)  # before any pod: DoesNotFit, or activation checkpointing switched on
        if memory is not None:
            d.say(memory.line)
            d.cfg = cfg  # the job's ConfigMap carries what the estimate decided
    deadline = target.run_deadline(d)
    if deadline is not None and (cfg.training.stop_at is None or deadline < cfg.training.stop_at):
        cfg = d.cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"stop_at": deadline})})
        d.say(f"the run checkpoints and stops by {deadline:%Y-%m-%d %H:%M} UTC (training.stop_at), before its nodes go")
    cfg.check_cluster_storage()  # checkpoints every node reaches, before any node is scaled or job submitted
    offline = cfg.ray.offline
    if offline:
        offline_wheels.check(d)  # storage the pods read
    if mode == "rayjob":
        refuse_raycluster_holding_gpus(d)  # the RayJob's own cluster would wait for GPUs that one holds
    target.before_pods(d)  # the pods' service account (on EKS its IAM role's grants on the bucket), before any pod
    target.before_job(d)
    _, problems = gpu_node_problems(d, target.gpu_node_spec(d))
    if problems:
        raise NodesNotReady(problems)  # at once: pods would only sit Pending
    apply_namespace(d)
    packages = None  # None: the head pod's image is asked once it runs (raycluster, not --offline)
    health = None  # the gate's checks, kept in the run folder
    if offline or mode == "rayjob":  # the image asked before any Ray object; --offline: a wheel missing stops here
        running = _running_head(d) if mode == "raycluster" else None
        packages = offline_wheels.prepare(d, job_requirements(job_extras(cfg.training)), head=running, mode=mode)
    wheels = packages.wheels if packages is not None else None

    apply_job_config(d, hf_token, env)

    previous = d.state.get("job") or {}
    rayjob_id = None  # the Ray job id KubeRay gives a RayJob
    if mode == "raycluster":
        apply_raycluster(d, hf_token=bool(hf_token), wheels=wheels)
        cluster = cfg.ray.cluster_name
    else:
        old = d.kube.get("ray.io/v1", "RayJob", cfg.ray.cluster_name, ns)
        if old and old.get("status", {}).get("jobDeploymentStatus") in ("Complete", "Failed"):
            d.say(f"RayJob {ns}/{cfg.ray.cluster_name} has finished: replacing it")
            d.kube.delete("ray.io/v1", "RayJob", cfg.ray.cluster_name, ns)
            previous = {}
        code_map, items = code_config_map(cfg, package_files())
        _apply(d, code_map, f"ConfigMap {ns}/{code_map['metadata']['name']} (the raytrain_eks package)")
        shipped = None
        if packages is not None and packages.shipped is not None:
            packages_map, _ = packages_config_map(cfg, packages.shipped)
            _apply(d, packages_map, f"ConfigMap {ns}/{packages_map['metadata']['name']} (the packages it ships)")
            shipped = (packages_map, packages.shipped)
        pip = packages.pip if packages is not None else None
        options = packages.pip_options() if packages is not None else None
        doc = rayjob_manifest(
            cfg, hf_token=bool(hf_token), code_map=code_map, items=items, pip=pip, pip_options=options, packages=shipped
        )
        if wheels is not None:
            doc = wheels.into(doc, cfg)
        _apply(d, doc, f"RayJob {ns}/{cfg.ray.cluster_name}")
        try:  # from here on its cluster starts and bills whether or not submit is there to follow it
            cluster, rayjob_id = _wait_rayjob_cluster(d, cfg.ray.job_start_deadline_s)
            head, workers = wait_for_ray_pods(d, ns, cluster, cfg.ray.job_start_deadline_s)
        except KeyboardInterrupt:
            raise stop_rayjob(d, rayjob_id, None, target.after_rayjob) from None
    if mode == "raycluster":
        head, workers = wait_for_ray_pods(d, ns, cluster, cfg.ray.job_start_deadline_s)
        if wheels is not None:  # pods made before the init container was in the template
            offline_wheels.copy_into(d, [head, *workers], wheels)
        if checks:  # a RayJob's job starts with its cluster: only `check` proves those nodes
            health = before_job(d, target, workers, upload=_upload_package)

    run_dirs: list[str] = []
    bundles: list[str] = []

    def echo(line: str) -> None:
        d.say(line)
        for pattern, found in ((_RUN_FOLDER, run_dirs), (_RUN_BUNDLE, bundles)):
            match = pattern.search(line)
            if match:
                found.append(match.group(1).strip())

    submission_id = None
    try:
        if previous.get("mode") == mode and previous.get("id") and previous.get("raycluster") == cluster:
            status = job_status(d, head, previous["id"])
            if status in ("PENDING", "RUNNING"):
                submission_id = previous["id"]
                d.say(
                    f"Job {submission_id} from an earlier submit is {status}: following it instead of submitting again"
                )
        if submission_id is None:
            code_dir = _upload_package(d, head) if rayjob_id is None else ""
            handed = hand_over_health(d, head, health) if health is not None else None  # raycluster's gate only
            submission_id = rayjob_id or submit_job(d, head, code_dir, packages=packages, env_vars=handed)
        d.state.update(
            job={"id": submission_id, "mode": mode, "namespace": ns, "raycluster": cluster, "status": "RUNNING"}
        )
        final = follow_job(d, head, submission_id, timeout=cfg.ray.job_deadline_s, on_output=echo)
    except KeyboardInterrupt:
        if mode != "rayjob":  # the job goes on in the RayCluster; `raytrain-eks logs --follow` follows it again
            raise
        job = submission_id or rayjob_id
        raise stop_rayjob(d, job, run_dirs[-1] if run_dirs else None, target.after_rayjob) from None
    d.state.update(job={**d.state.get("job"), "status": final})
    result = _judge(d, submission_id, final, workers)
    result.run_dir = run_dirs[-1] if run_dirs else None
    result.bundle = bundles[-1] if bundles else run_bundle(cfg, result.run_dir)
    d.state.update(job={**d.state.get("job"), "run_dir": result.run_dir, "bundle": result.bundle})  # for `down`
    if mode == "rayjob":
        if result.bundle is None and result.run_dir:  # no storage: what can be read goes here before the pods go
            result.kept = keep_run_files(d, result.run_dir)
            d.state.update(job={**d.state.get("job"), "kept": result.kept})  # status reads its segments there
        # The evidence above was read from the RayJob's pods: only now may its cluster go (KubeRay's own deletion,
        # ttlSecondsAfterFinished after the job ended, is the backstop for when submit is not there).
        if d.kube.delete("ray.io/v1", "RayCluster", cluster, ns):
            d.say(f"Deleted RayCluster {ns}/{cluster} of the RayJob (its pods' evidence is read)")
        target.after_rayjob(d)
    for line in where_the_run_is(result.bundle, result.run_dir, kept=result.kept, mode=mode, head=head.name):
        d.say(line)
        result.summary.append(line)
    return result


_RUN_FOLDER = re.compile(r"^\s*Run folder: (/\S.*)$", re.IGNORECASE)  # printed by `train` (first and last line)
# Printed by `train` once its bundle is whole (train/bundle.py).
_RUN_BUNDLE = re.compile(r"^\s*run bundle: (\S+)", re.IGNORECASE)


# What a RayJob without storage leaves here from its run folder: its small files, each cut at _RUN_FILE_LIMIT.
KEPT_FILES = ("metrics.jsonl", "summary.json", "config.yaml", "samples.jsonl", "error.log", "segments.jsonl")


def keep_run_files(d: Deployment, run_dir: str) -> str | None:
    """Copy the small files of the head pod's run folder ``run_dir`` into ``runs/<name>`` here (``-2``... when
    taken), with its report written from them; the folder, or ``None`` when nothing could be read."""
    try:
        found = read_run_files(d, run_dir, KEPT_FILES)
    except UserError:  # the head pod is gone already: nothing left to read
        return None
    if not found:
        return None
    folder = new_folder(Path("runs"), PurePosixPath(run_dir).name)
    for name, text in found.items():
        target = (folder / name).resolve()
        if target.is_relative_to(folder.resolve()):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
    if "metrics.jsonl" in found:
        from raytrain_eks.errors import RunFolderError
        from raytrain_eks.report.html import write_report

        with contextlib.suppress(RunFolderError):  # no step logged: the files are kept without a report
            write_report([folder], folder)
    return str(folder)


class RayJobStopped(UserError):
    """Ctrl-C while ``submit`` followed a RayJob: the RayJob, and so the job, is deleted (:func:`stop_rayjob`)."""

    exit_code = 130  # as any Ctrl-C: 128 + SIGINT


def stop_rayjob(
    d: Deployment, submission_id: str | None, run_dir: str | None, let_go: Callable[[Deployment], None]
) -> RayJobStopped:
    """Ctrl-C while a RayJob runs: stop it and what it bills, and return the error that says so. KubeRay deletes a
    RayJob's cluster (``shutdownAfterJobFinishes``) only once its job has ended, so a RayJob left running keeps its
    pods, and on EKS the GPU node group at its size, until the next ``submit`` or ``down``. A run without storage
    has its small files copied here first (:func:`keep_run_files`); then the RayJob is deleted, its RayCluster and
    pods with it, and ``let_go`` (the target's ``after_rayjob``: on EKS the GPU group scaled to 0) runs.
    ``submission_id`` is ``None`` before KubeRay has given the RayJob its job."""
    ns, name = d.cfg.ray.namespace, d.cfg.ray.cluster_name
    job = f"job {submission_id}" if submission_id else "the RayJob's job (not started yet)"
    d.say(f"Ctrl-C: stopping {job}: deleting RayJob {ns}/{name}, its RayCluster and pods with it")
    try:
        kept = keep_run_files(d, run_dir) if run_dir and run_bundle(d.cfg, run_dir) is None else None
        d.kube.delete("ray.io/v1", "RayJob", name, ns)
    except KeyboardInterrupt:
        delete = ["kubectl", *d.kube_flags(), "-n", ns, "delete", "rayjob", name]
        return RayJobStopped(
            f"stopped by Ctrl-C twice, before RayJob {ns}/{name} was deleted: {job} may still run, "
            "and its GPU nodes with it",
            hint=f"Delete it with `{shlex.join(delete)}`. The GPU nodes stay until a next `raytrain-eks submit --mode "
            "rayjob` ends (it lets them go) or `raytrain-eks down` removes the deployment.",
        )
    d.state.update(job={**(d.state.get("job") or {}), "status": "STOPPED"})
    let_go(d)
    return RayJobStopped(
        f"stopped by Ctrl-C: {job} is stopped, its RayJob {ns}/{name} deleted with its RayCluster and "
        "pods, so nothing of it runs or holds GPU nodes any more"
        + (f"; its run's files are in {kept}" if kept else ""),
        hint="Run `raytrain-eks submit --mode rayjob` to start the job again.",
    )


def _judge(d: Deployment, submission_id: str, final: str, workers: list[Pod]) -> SubmitResult:
    require = d.cfg.fabric.require
    job_nodes = d.cfg.derived.worker_nodes  # the GPU nodes the job's ranks span
    report = collect_transport(d, workers) if workers else None
    efa_ok, efa_said = check_efa_provider(d, workers[0]) if workers else (False, "no worker pod")
    versions = gpu_versions(d, workers[0]) if workers else {}

    summary = [f"Job {submission_id}: {final}"]
    # The job has ended: this is the last look, and the in-job gate's rule decides (a job on several nodes meets
    # efa or ib only on proven evidence).
    decision = None if report is None else gate_decision(report, require, job_nodes=job_nodes, last_look=True)
    if report is not None and decision is not None:
        rendered = report.render(require)
        path = d.state.write_file(f"transport-{submission_id}.json", report.to_json(require) + "\n")
        if decision["met"]:
            summary += [rendered.splitlines()[0], f"  full report: {path}"]
        else:  # the evidence, plugin errors and notes are what the user needs to fix it
            summary += [*rendered.splitlines(), f"full report: {path}"]
    summary.append(
        f"fi_info -p efa on {workers[0].name if workers else '-'}: {'EFA found' if efa_ok else 'no EFA'} ({efa_said})"
    )
    if versions:
        summary.append(f"GPU driver {versions.get('driver', '?')}, CUDA {versions.get('cuda', '?')} (nvidia-smi)")

    code = 0
    if final != "SUCCEEDED":
        code = 1
        summary.append(f"FAILED: the job ended {final}; `raytrain-eks logs` shows its output")
    elif decision is not None and not decision["met"]:
        code = 2 if report is not None and report.verdict == "inconclusive" else 1
        summary.append(f"FAILED: NCCL's inter-node transport does not meet fabric.require = {require}")
        summary.append(f"  {decision['note']}")
    elif require == "efa" and not efa_ok:
        code = 1
        summary.append("FAILED: libfabric does not see an EFA device on the worker (fi_info -p efa)")
    else:
        summary.append(f"OK: the job succeeded and the fabric requirement ({require}) is met")
    for line in summary:
        d.say(line)
    return SubmitResult(submission_id, final, report, efa_ok if workers else None, versions, summary, code)


def restart_raycluster(d: Deployment) -> None:
    """Delete the RayCluster and wait until its pods are gone, so that the next :func:`submit` starts fresh pods.

    KubeRay does not restart running pods when their template changes: a new worker environment (``network.env``)
    only takes effect in new pods, and new pods' Ray session logs hold only the next job's NCCL lines.
    """
    ns, name = d.cfg.ray.namespace, d.cfg.ray.cluster_name
    if not d.kube.delete("ray.io/v1", "RayCluster", name, ns):
        return
    d.say(f"Deleted RayCluster {ns}/{name}; waiting for its pods to go")
    deadline = d.cfg.ray.job_start_deadline_s

    def probe() -> tuple[bool | None, str]:
        pods = d.kube.pods(ns, {"ray.io/cluster": name})
        if not d.kube.get("ray.io/v1", "RayCluster", name, ns) and not pods:
            return True, "gone"
        return None, f"{len(pods)} pods left"

    d.wait(
        probe,
        what=f"RayCluster {ns}/{name} to go",
        timeout=deadline,
        on_timeout=lambda _, waited: PodsNotReady(
            f"RayCluster {ns}/{name} and its pods were still there {deadline:.0f} s after it was deleted",
            hint="`raytrain-eks status` shows the pods; `kubectl describe` them to see what holds them.",
        ),
    )


def _last_job_head(d: Deployment, what: str) -> Pod:
    """The running head pod of the last submitted job's RayCluster; a UserError when it is gone (``what``, the job's
    logs or metrics, with it)."""
    job = d.state.get("job") or {}
    cluster = job.get("raycluster", d.cfg.ray.cluster_name)
    heads, _ = ray_pods(d, job.get("namespace", d.cfg.ray.namespace), cluster)
    if not heads or not is_running(heads[0]):
        raise UserError(
            f"the head pod of {cluster} is not running, so the job's {what} are gone with it",
            hint="`raytrain-eks status` shows the pods.",
        )
    return heads[0]


def read_metrics(d: Deployment, run_dir: str) -> list[dict[str, object]]:
    """The job's ``metrics.jsonl`` records, read in the head pod of the last submitted job (``run_dir`` is the run
    folder the job's log named). Lines that are not JSON objects are skipped."""
    argv = ["cat", f"{run_dir.rstrip('/')}/metrics.jsonl"]
    res = head_exec(d, _last_job_head(d, "metrics"), argv)
    if not res.ok:
        raise CommandError(argv, res.returncode, res.stderr or res.stdout, hint="Was the run folder removed?")
    records = []
    for line in res.stdout.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


# What a report is drawn from, besides metrics.jsonl: read whole, each at most _RUN_FILE_LIMIT bytes.
RUN_FILES = ("summary.json", "config.yaml", "samples.jsonl")
_RUN_FILE_LIMIT = 4 << 20
_READ_RUN_FILES = """\
import glob, json, os, sys
folder, limit, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
found = {}
for name in names + sorted(os.path.relpath(p, folder) for p in glob.glob(os.path.join(folder, "nccl", "rank*.log"))):
    path = os.path.join(folder, name)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            found[name] = f.read(limit).decode("utf-8", "replace")
print(json.dumps(found))
"""


def read_run_files(d: Deployment, run_dir: str, names: tuple[str, ...] = RUN_FILES) -> dict[str, str]:
    """The small files of the last job's run folder in the head pod, by name relative to it: ``names`` (default
    ``summary.json``, ``config.yaml``, ``samples.jsonl``) and ``nccl/rank*.log`` where they exist (each cut at 4 MiB).
    Empty when they cannot be read: the caller still has the metrics, so this never fails a command."""
    argv = [m.IMAGE_PYTHON, "-c", _READ_RUN_FILES, run_dir.rstrip("/"), str(_RUN_FILE_LIMIT), *names]
    res = head_exec(d, _last_job_head(d, "run files"), argv)
    try:
        found = json.loads(res.stdout) if res.ok else {}
    except json.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


# ----------------------------------------------------------------------------------------------------------------
# logs
# ----------------------------------------------------------------------------------------------------------------


def logs(d: Deployment, *, follow: bool = False, on_output: Callable[[str], None] | None = None) -> int:
    """Print the last job's logs (from inside the head pod); ``follow`` streams until it ends. Returns the exit
    status of ``ray job logs``."""
    job = d.state.get("job") or {}
    if not job.get("id"):
        raise UserError("no job was submitted from this folder", hint="Run `raytrain-eks submit` first.")
    argv = ["ray", "job", "logs", "--address", DASHBOARD, *(["--follow"] if follow else []), job["id"]]
    timeout = d.cfg.ray.job_deadline_s if follow else EXEC_TIMEOUT_S
    res = head_exec(d, _last_job_head(d, "logs"), argv, timeout=timeout, on_output=on_output or d.say)
    return res.returncode
