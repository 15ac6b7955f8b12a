"""``raytrain-eks results``: a deployment's runs as their bundles in its storage tell them, and one run's bundle
fetched into a folder of this machine (its report rendered here when the run could not render one).

A run's bundle is its storage folder ``STORAGE_PATH/RUN`` (:mod:`raytrain_eks.train.bundle`): ``run.json`` says its
state, and the run folder's files lie beside its checkpoints (``ray/``, never fetched). Example::

    for run in list_runs("s3://bucket/runs"):
        print(run.name, run.state, run.steps, run.final_loss)
    fetched = fetch_run("s3://bucket/runs", "20260101-120000-tiny-qwen2", Path("runs/20260101-120000-tiny-qwen2"))
"""

from __future__ import annotations

import json
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.k8s.cluster import KubeApiError
from raytrain_eks.train.bundle import COPY_CHUNK, COPY_FILES, METRICS, RUN_STATE, age_s, stale_after_s
from raytrain_eks.train.checkpoint import RAY_DIR, RUN_CONFIG, storage_root
from raytrain_eks.train.storage import filesystem, is_remote, join

if TYPE_CHECKING:
    from raytrain_eks.k8s.state import Deployment

REPORT = "report.html"
# Written into every folder a bundle is fetched into, naming where from: only such a folder may be fetched into
# again (the same run, later: a running run's newer metrics), never one holding anything else.
FETCHED_MARKER = ".raytrain-eks-results"


@dataclass(frozen=True)
class RunListing:
    """One run of a storage folder, as its bundle says."""

    name: str
    location: str
    state: str  # finished, failed, stopped, running, or unknown (no run.json, or a running one not heard from)
    started: str | None
    steps: int | None
    total_steps: int | None
    final_loss: float | None
    cost_usd: float | None
    note: str = ""


@dataclass(frozen=True)
class Fetched:
    """What :func:`fetch_run` copied: from where, into where, how much, and the report (``rendered``: made here)."""

    location: str
    into: Path
    files: int
    bytes: int
    state: str
    report: Path | None
    rendered: bool


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _storage_error(storage: str, exc: BaseException) -> UserError:
    return UserError(
        f"cannot read the runs' storage {storage}: {_first_line(exc)}",
        hint="Check the bucket or folder name (training.storage_path, or --storage-path) and that this machine may "
        "read it (credentials, role, network).",
    )


def _read_text(fs: Any, path: str) -> str | None:
    try:
        with fs.open_input_stream(path) as f:
            return str(f.read().decode(errors="replace"))
    except OSError:
        return None


def _read_json(fs: Any, path: str) -> dict[str, Any] | None:
    text = _read_text(fs, path)
    try:
        found = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _check_storage(storage: str) -> tuple[Any, str]:
    """The storage's file system and base path; a :class:`UserError` when a local folder is not on this machine."""
    from pyarrow import fs as pafs

    try:
        fs, base = filesystem(storage)
        kind = fs.get_file_info(base).type
    except (OSError, ValueError) as exc:
        raise _storage_error(storage, exc) from None
    if not is_remote(storage) and kind != pafs.FileType.Directory:
        raise UserError(
            f"the runs' storage {storage} is not a folder on this machine",
            hint="A folder of ray.shared_volume is a path inside the pods: mount that volume here and give its runs "
            "folder with --storage-path. A local run keeps its results in its run folder (runs/ where it ran).",
        )
    return fs, base


def _listing(fs: Any, storage: str, name: str, mtime: Any) -> RunListing | None:
    from pyarrow import fs as pafs

    base = filesystem(join(storage, name))[1]
    state_info, config_info = fs.get_file_info([f"{base}/{RUN_STATE}", f"{base}/{RUN_CONFIG}"])
    location = join(storage, name)
    if state_info.type != pafs.FileType.File:
        if config_info.type != pafs.FileType.File:
            return None  # not a run's folder (a staged model, a wheelhouse)
        when = config_info.mtime or mtime
        started = f"{when:%Y-%m-%dT%H:%M:%SZ}" if isinstance(when, datetime) else None
        return RunListing(name, location, "unknown", started, None, None, None, None, "no run.json (no bundle)")
    state = _read_json(fs, f"{base}/{RUN_STATE}") or {}
    said = str(state.get("state") or "unknown")
    note = ""
    if said == "running":
        age = age_s(state.get("updated"))
        if age is None or age > stale_after_s():
            said, note = "unknown", f"said running, last heard {state.get('updated') or 'never'}"
    elif said == "failed" and state.get("error"):
        note = str(state["error"])
    cost = state.get("cost") if isinstance(state.get("cost"), dict) else None
    return RunListing(
        name=name,
        location=location,
        state=said,
        started=state.get("started"),
        steps=state.get("steps"),
        total_steps=state.get("total_steps"),
        final_loss=state.get("final_loss"),
        cost_usd=cost.get("usd") if cost else None,
        note=note,
    )


def list_runs(storage: str) -> list[RunListing]:
    """Every run with a folder in ``storage`` (``training.storage_path``: ``s3://...`` or a folder), oldest first."""
    from pyarrow import fs as pafs

    fs, base = _check_storage(storage)
    try:
        children = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except (OSError, ValueError) as exc:
        raise _storage_error(storage, exc) from None
    runs = []
    for child in children:
        name = child.path.rstrip("/").rsplit("/", 1)[-1]
        if child.type != pafs.FileType.Directory or name.startswith("."):
            continue
        try:
            found = _listing(fs, storage, name, child.mtime)
        except OSError as exc:
            raise _storage_error(storage, exc) from None
        if found is not None:
            runs.append(found)
    return sorted(runs, key=lambda r: (r.started or "", r.name))


def render_runs(storage: str, runs: list[RunListing]) -> list[str]:
    """The listing as lines for the terminal."""
    if not runs:
        return [f"No runs in {storage} yet."]
    rows = [("RUN", "STATE", "STARTED (UTC)", "STEPS", "FINAL LOSS", "COST", "")]
    for r in runs:
        steps = "-" if r.steps is None else f"{r.steps}" + (f"/{r.total_steps}" if r.total_steps else "")
        loss = "-" if r.final_loss is None else f"{r.final_loss:.4f}"
        cost = "-" if r.cost_usd is None else f"${r.cost_usd:.2f}"
        started = (r.started or "-").replace("T", " ").rstrip("Z")
        rows.append((r.name, r.state, started, steps, loss, cost, r.note))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    lines = [f"Runs in {storage}:"]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + f"  {row[6]}")
    lines = [line.rstrip() for line in lines]
    lines.append("`raytrain-eks results RUN` fetches a run's bundle into ./runs/RUN (`--to DIR` elsewhere).")
    return lines


def run_location(storage: str | None, run: str) -> str:
    """Where run ``run`` lies: a location given whole (``s3://...``, a path), else ``storage``'s folder of that
    name."""
    if is_remote(run) or run.startswith(("/", "./", "~")):
        return run.rstrip("/") if is_remote(run) else str(Path(run).expanduser().resolve())
    if not storage:
        raise UserError(
            f"no storage to look for run {run!r} in",
            hint="Give --storage-path (s3://BUCKET/PREFIX or a folder), or the run's whole location.",
        )
    if "/" in run or run in (".", ".."):
        raise UserError(
            f"{run!r} is not a run's name", hint="Give a name `raytrain-eks results` lists, or the run's location."
        )
    return join(storage, run)


def _check_into(into: Path, location: str) -> None:
    if into.exists() and not into.is_dir():
        raise UserError(f"--to {str(into)!r} is a file", hint="Give a folder (new, empty, or an earlier fetch).")
    if not into.is_dir() or not any(into.iterdir()):
        return
    marker = into / FETCHED_MARKER
    if not marker.is_file():
        raise UserError(
            f"--to {str(into)!r} is not empty and holds no fetched run",
            hint="Give a new or empty folder with --to; a folder a run was fetched into before is updated in place.",
        )
    then = marker.read_text().strip()
    if then != location:
        raise UserError(
            f"--to {str(into)!r} holds the run fetched from {then}, not {location}",
            hint="Give another folder with --to.",
        )


def fetch_run(storage: str | None, run: str, into: Path | None = None) -> Fetched:
    """Copy the bundle of ``run`` (a name in ``storage``, or a whole location) into ``into`` (default
    ``./runs/<name>``), checkpoints left out; the folder is then a run folder (``raytrain-eks report``, ``export``
    read it). When the bundle has no ``report.html`` (the run failed, or stopped, before writing one) and has metrics,
    the report is written here from them. A :class:`UserError` names what is wrong: no such run, an unreadable
    storage, a folder that holds something else."""
    from pyarrow import fs as pafs

    location = run_location(storage, run)
    name = location.rstrip("/").rsplit("/", 1)[-1]
    into = Path("runs") / name if into is None else into
    try:
        fs, base = filesystem(location)
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except (OSError, ValueError) as exc:
        raise _storage_error(location, exc) from None
    files = {}
    for info in infos:
        rel = info.path[len(base) :].lstrip("/")
        if info.type == pafs.FileType.File and rel.split("/")[0] != RAY_DIR:
            files[rel] = info
    if RUN_STATE not in files and RUN_CONFIG not in files:
        raise UserError(
            f"no run {name!r} at {location} (neither {RUN_STATE} nor {RUN_CONFIG} is there)",
            hint="`raytrain-eks results` lists the runs of the deployment's storage; give one of those names.",
        )
    _check_into(into, location)
    into.mkdir(parents=True, exist_ok=True)

    def copy(rel: str) -> int:
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(f"{base}/{rel}") as src, target.open("wb") as dst:
            done = 0
            while chunk := src.read(COPY_CHUNK):
                dst.write(chunk)
                done += len(chunk)
        return done

    try:
        with ThreadPoolExecutor(max_workers=COPY_FILES) as pool:
            total = sum(pool.map(copy, sorted(files)))
    except OSError as exc:
        raise UserError(
            f"cannot copy {location} into {into}: {_first_line(exc)}",
            hint=f"Check that this machine may read that storage and has room in {into}; fetching again resumes.",
        ) from None
    (into / FETCHED_MARKER).write_text(location + "\n")
    state = (_read_json(fs, f"{base}/{RUN_STATE}") or {}).get("state", "unknown") if RUN_STATE in files else "unknown"
    report, rendered = (into / REPORT if REPORT in files else None), False
    if report is None and _has_steps(into / METRICS):
        from raytrain_eks.report.html import write_report

        report, rendered = write_report([into], into), True
    return Fetched(location, into, len(files), total, str(state), report, rendered)


def _has_steps(metrics: Path) -> bool:
    if not metrics.is_file():
        return False
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            if "step" in json.loads(line):
                return True
        except (ValueError, TypeError):
            continue
    return False


def fetched_lines(fetched: Fetched) -> list[str]:
    """What ``results RUN`` prints once the bundle is here."""
    lines = [
        f"Fetched {fetched.location} ({fetched.state}) into {fetched.into}: {fetched.files} files, "
        f"{fetched.bytes / 1e6:.1f} MB (checkpoints left in storage)"
    ]
    if fetched.report is None:
        lines.append("No report: the run logged no step (error.log says why, when it failed).")
    elif fetched.rendered:
        lines.append(f"report: {fetched.report.resolve()} (written here from the fetched metrics: the run wrote none)")
    else:
        lines.append(f"report: {fetched.report.resolve()}")
    return lines


def run_bundle(cfg: Config, run_dir: str | None) -> str | None:
    """Where the run whose folder (in the head pod) is ``run_dir`` keeps its bundle: its storage folder; ``None``
    without ``training.storage_path`` (or without a run folder)."""
    if not run_dir or not cfg.training.storage_path:
        return None
    return storage_root(Path(run_dir), cfg.training.storage_path)


def where_the_run_is(bundle: str | None, run_dir: str | None, *, kept: str | None, mode: str, head: str) -> list[str]:
    """The last lines of ``submit``: where the run's results are now, and the command that fetches them. ``kept``:
    the folder here that a RayJob's run folder's small files went to, when it had no bundle."""
    if bundle is not None:
        on_volume = "" if is_remote(bundle) else " (on the Ray pods' volume: fetch it where that volume is mounted)"
        return [
            f"Run bundle: {bundle} (the export, metrics, summary, report and logs; the checkpoints in "
            f"{join(bundle, RAY_DIR)}){on_volume}",
            f"  fetch it: raytrain-eks results {bundle}   (`raytrain-eks results` lists every run)",
        ]
    if run_dir is None:
        return []
    if mode == "raycluster":
        return [
            f"Run folder {run_dir} is only in the head pod {head} (training.storage_path is not set, so the run has no "
            "bundle in storage): `raytrain-eks down` deletes it with the pod"
        ]
    if kept is not None:
        return [
            f"Run folder {run_dir} went with the RayJob's pods (training.storage_path is not set); its metrics, "
            f"summary, configuration, samples, error log and NCCL lines are here: {kept}. The export and the "
            "checkpoints were only in the pods: set training.storage_path to keep them"
        ]
    return [f"Run folder {run_dir} went with the RayJob's pods, unread (training.storage_path is not set)"]


def segment_lines_of(d: Deployment) -> list[str]:
    """``status``'s lines on the last job's run: its segments (each attempt's steps, nodes, capacity, why it ended and
    cost) as its bundle in storage records them, or as the folder a RayJob's files were kept in here does; nothing
    when neither is readable (no job yet, no storage, or a run that ended no attempt)."""
    from raytrain_eks.report.segments import SEGMENTS, parse_segments, segment_lines

    job = d.state.get("job") or {}
    bundle, kept = job.get("bundle"), job.get("kept")
    text = None
    if bundle:
        try:
            text = _read_text(*filesystem(join(bundle, SEGMENTS)))
        except (OSError, ValueError):  # a location pyarrow cannot open
            text = None
    elif kept and (Path(kept) / SEGMENTS).is_file():
        text = (Path(kept) / SEGMENTS).read_text(errors="replace")
    segments = parse_segments(text) if text else []
    if not segments:
        return []
    name = PurePosixPath(str(job.get("run_dir") or bundle or kept)).name
    return [f"Run {name}:", *(f"  {line}" for line in segment_lines(segments))]


def lost_with_the_pods(d: Deployment) -> list[str]:
    """What ``down`` would lose of the runs, as lines for the user before it deletes anything: the last job's run
    folder in the head pod of this deployment's RayCluster when that run has no bundle in storage (with the command
    that copies it out first); where the run has a bundle, that it stays. Empty when no job ran here."""
    job = d.state.get("job") or {}
    run_dir, bundle = job.get("run_dir"), job.get("bundle")
    if job.get("mode") != "raycluster" or not run_dir:
        return []  # a RayJob's run folder went with its pods when submit ended (its bundle, or what submit kept)
    if bundle:
        return [f"The last run's results stay in its bundle {bundle} (`raytrain-eks results` lists the runs there)."]
    ns, cluster = job.get("namespace", d.cfg.ray.namespace), job.get("raycluster", d.cfg.ray.cluster_name)
    ours = any(i.get("kind") == "RayCluster" and i.get("name") == cluster for i in d.state.created)
    if not ours:
        return []
    try:
        heads = [p for p in d.kube.pods(ns, {"ray.io/cluster": cluster}) if p.labels.get("ray.io/node-type") == "head"]
    except KubeApiError as exc:
        return [
            f"Lost with the RayCluster {ns}/{cluster}, if its head pod still runs: the last job's run folder {run_dir} "
            f"(training.storage_path was not set, so the run has no bundle in storage; the pods could not be listed: "
            f"{exc.message})"
        ]
    if not heads:
        return []
    name = PurePosixPath(run_dir).name
    copy = ["kubectl", *d.kube_flags(), "-n", ns, "cp", "-c", "ray-head", f"{heads[0].name}:{run_dir}", f"runs/{name}"]
    return [
        f"Lost with the head pod {heads[0].name}: the last job's run folder {run_dir} (its model export, metrics, "
        "summary, report and logs; training.storage_path was not set, so the run has no bundle in storage)",
        f"  to keep it, copy it here first: {shlex.join(copy)}",
    ]
