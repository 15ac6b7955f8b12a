"""How the job's packages beyond the image reach the cluster (:func:`choose`), and ``submit --offline``'s wheelhouse.

The image is asked which of the job's requirements it has in range, and for its Python, platform tags and
markers: from the running Ray head pod (``--mode raycluster``), else, before any Ray object (``--offline``, and
``--mode rayjob``, whose runtime_env is fixed when the RayJob is applied), from what an earlier submit remembered
of this image (the state, per image), else from a short-lived pod of the image placed as the workers are
(:func:`image_pod`, deleted again). :mod:`raytrain_eks.k8s.wheelhouse` downloads here the wheels of what it lacks
for that Python. Pure-Python wheels travel unpacked beside the package as ``py_modules`` (:class:`JobPackages`
``shipped``: into the head pod through exec, or a RayJob's packages ConfigMap), so the runtime_env has no ``pip``
and Ray copies none of the image's virtualenv. Otherwise pip installs them; under ``--offline`` from a wheelhouse
stored beside the checkpoints: on ``s3://`` the Ray objects get the init container that copies it
(:meth:`Wheels.into`) and pods of an earlier RayCluster, made without it, copy it through exec (:func:`copy_into`);
on the shared volume it is written through the pod asked, and pip reads it there. A requirement without a wheel
stops ``--offline`` with nothing applied but the namespace. Example::

    check(d)                                              # --offline: storage the pods read, before anything
    wanted = job_requirements(job_extras(d.cfg.training))  # the job's packages (lm-eval too with eval_tasks)
    packages = prepare(d, wanted, head=None, mode="rayjob")  # pip, its wheelhouse, or py_modules
    doc = packages.wheels.into(raycluster_doc, cfg)       # --offline with pip; then, once the pods run:
    copy_into(d, [head, *workers], packages.wheels)       # idempotent; nothing to do on the volume
    modules = ship_into_head(d, head, packages.shipped)   # raycluster: the unpacked wheels' py_modules entries
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s import wheelhouse as wh
from raytrain_eks.k8s.cluster import ExecResult, Pod, image_never_pulls
from raytrain_eks.k8s.job import (
    IMAGE_VERSIONS,
    MAX_SHIPPED,
    head_packages_dir,
    packages_archive,
    packages_config_map,
    requirement_name,
    shipped_modules,
    unpack_argv,
    what_the_image_has,
)
from raytrain_eks.k8s.runner import CommandError
from raytrain_eks.k8s.state import Deployment, object_item

REMEMBERED = "offline_image"  # state key: {"image", "python": the IMAGE_PLATFORM report, "versions": name -> version}
COPY_TIMEOUT_S = 1800
EXEC_TIMEOUT_S = 120


def check(d: Deployment) -> None:
    """What ``--offline`` needs before anything is applied: storage the pods read through a URI."""
    wh.storage_location(d.cfg)


def _flag(d: Deployment) -> str:
    """What a message about asking the image starts with: the flag that asked for it, if any."""
    return "--offline: " if d.cfg.ray.offline else ""


def _remembered(d: Deployment) -> dict[str, Any] | None:
    found = d.state.get(REMEMBERED)
    return found if isinstance(found, dict) and found.get("image") == d.cfg.ray.image else None


def _container(pod: Pod) -> str | None:
    """The container to exec in: the Ray head's by name; the probe pod has one."""
    return "ray-head" if pod.labels.get("ray.io/node-type") == "head" else None


def ask_pod(d: Deployment, pod: Pod, script: str, *args: str) -> tuple[dict[str, Any] | None, str]:
    """What ``script`` (run by the pod's python3 with ``args``) printed as a JSON object, or ``None`` and what it
    said instead."""
    argv = [m.IMAGE_PYTHON, "-c", script, *args]
    res = d.kube.exec(pod.namespace, pod.name, argv, timeout=EXEC_TIMEOUT_S, container=_container(pod))
    try:
        found = json.loads(res.stdout) if res.ok else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return None, (res.stderr or res.stdout).strip()
    return found, ""


def ask_image(d: Deployment, pod: Pod) -> wh.ImagePython:
    """The image's python3 in ``pod``: its version, ABI, platform tags and markers (remembered for this image)."""
    found, said = ask_pod(d, pod, wh.IMAGE_PLATFORM)
    if found is None:
        raise UserError(
            f"{_flag(d)}cannot read the image's Python and platform in {pod.name}: {said[-300:]}. Nothing was applied",
            hint="Asking the image needs a CPython image whose python3 imports packaging (Ray's images do)"
            + ("; or submit without --offline." if d.cfg.ray.offline else "."),
        )
    image = wh.ImagePython.from_probe(found)
    old = _remembered(d) or {}
    d.state.update(**{REMEMBERED: {"image": d.cfg.ray.image, "python": found, "versions": old.get("versions", {})}})
    return image


def _asker(d: Deployment, pod: Pod | None) -> Callable[[list[str]], dict[str, str | None]]:
    """The image's installed version of each name: asked of ``pod``'s python3 (and remembered), else from what was
    remembered (a name never asked counts as not installed: its wheel goes in, which is safe)."""

    def installed(names: list[str]) -> dict[str, str | None]:
        record = _remembered(d) or {"image": d.cfg.ray.image, "versions": {}}
        known: dict[str, str | None] = dict(record.get("versions", {}))
        if pod is None:
            return {n: known.get(n) for n in names}
        found, said = ask_pod(d, pod, IMAGE_VERSIONS, *names)
        if found is None:
            raise UserError(f"{_flag(d)}cannot ask the image which packages it has: {said[:300]}")
        known.update(found)
        d.state.update(**{REMEMBERED: {**record, "versions": known}})
        return {n: found.get(n) for n in names}

    return installed


class ProbeNotRunning(UserError):
    """The image's probe pod did not run in time; the message holds its state and events."""


@contextmanager
def image_pod(d: Deployment) -> Iterator[Pod]:
    """A pod of the Ray image (:func:`raytrain_eks.k8s.wheelhouse.probe_pod`), running, to be asked; it is deleted
    (and forgotten by the state) when the block ends, whatever happened in it."""
    doc = wh.probe_pod(d.cfg)
    ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    item = object_item(doc)
    d.state.record(item)  # `down` deletes it should this submit be cut off before the end of the block
    d.kube.apply(doc)
    d.say(
        f"Started pod {ns}/{name} (the image {d.cfg.ray.image}, on a node the Ray workers use) to read the image's "
        "Python, platform and packages before any Ray object is applied"
    )

    def running() -> tuple[Pod | None, str]:
        found = [p for p in d.kube.pods(ns, doc["metadata"]["labels"]) if p.name == name]
        if found and found[0].phase == "Running":
            return found[0], "running"
        if found and found[0].phase in ("Failed", "Succeeded"):  # its one process ended: it never will run
            ended = found[0].ended or "gave no status"
            raise not_running(f"ended {found[0].phase} instead of waiting (its container {ended})")
        if found and found[0].waiting_reason:
            why = image_never_pulls(found[0], d.kube.pod_events(ns, name))
            if why:
                raise not_running(f"will not start: {why}")
        return None, (found[0].waiting_reason or found[0].phase) if found else "not created"

    def not_running(why: str) -> ProbeNotRunning:
        events = [e for e in d.kube.pod_events(ns, name) if e.type == "Warning"] or d.kube.pod_events(ns, name)
        shown = "\n".join(f"  {e}" for e in events[-5:]) or "  (no events)"
        return ProbeNotRunning(
            f"{_flag(d)}the pod {ns}/{name} of the image {why}:\n{shown}\nNothing else was applied; the pod is deleted",
            hint="Fix what the events say (FailedScheduling: no node the workers select has room for a 100m/256Mi "
            "pod; ImagePullBackOff: the image name, or the nodes' route to its registry; an ended pod: the image "
            f"has no {m.IMAGE_PYTHON}), then submit again.",
        )

    try:
        deadline = d.cfg.ray.job_start_deadline_s
        yield d.wait(
            running,
            what=f"pod {name}",
            timeout=deadline,
            on_timeout=lambda _, waited: not_running(f"did not run within {waited:.0f} s"),
        )
    finally:
        d.kube.delete("v1", "Pod", name, ns)
        d.state.forget(item)
        d.say(f"Deleted pod {ns}/{name}")


@dataclass(frozen=True)
class Wheels:
    """A wheelhouse where the Ray pods find it: ``folder`` is ``s3://.../DIGEST`` (each pod copies it into its own
    emptyDir first) or a folder of the shared volume every Ray pod mounts (read there directly)."""

    house: wh.Wheelhouse
    folder: str
    on_volume: bool

    def pip_options(self) -> list[str]:
        return wh.pip_options(self.house.digest, self.folder if self.on_volume else None)

    def into(self, doc: dict[str, Any], cfg: Config) -> dict[str, Any]:
        """``doc`` (a RayCluster or RayJob) with what its pods need to find the wheels: the init container that
        copies them, or nothing when they are on the shared volume."""
        return doc if self.on_volume else wh.with_wheels(doc, cfg, self.folder, self.house.digest)


@dataclass(frozen=True)
class JobPackages:
    """How the job's packages beyond the image reach the cluster: ``pip`` installs these (empty: the runtime_env has
    no ``pip`` entry), from ``wheels`` when ``--offline`` built them; ``shipped``: pure-Python wheels unpacked, each
    top-level entry one more ``py_modules`` entry beside the package."""

    pip: list[str]
    shipped: wh.Unpacked | None = None
    wheels: Wheels | None = None

    def pip_options(self) -> list[str] | None:
        return self.wheels.pip_options() if self.wheels is not None else None


def prepare(d: Deployment, wanted: list[str], *, head: Pod | None, mode: str) -> JobPackages:
    """Before the Ray objects are applied (``--offline``, and ``--mode rayjob``, whose runtime_env is fixed then):
    which of ``wanted`` the image lacks and how they reach it (:func:`choose`; under ``--offline`` a wheelhouse
    pip installs from is built and stored when they cannot travel unpacked). The image is asked through ``head``
    (a Ray head pod already running), else what an earlier submit remembered of it serves when it covers every name
    (and nothing goes onto the shared volume), else :func:`image_pod` is; a wheelhouse for the shared volume is
    written through that pod."""
    from packaging.utils import canonicalize_name

    names = {r: str(canonicalize_name(requirement_name(r))) for r in wanted}
    record = _remembered(d)
    onto_volume = d.cfg.ray.offline and wh.on_volume(d.cfg)
    covered = bool(record and record.get("python") and set(names.values()) <= set(record.get("versions", {})))
    if head is None and record and covered and not onto_volume:
        d.say(f"The image {d.cfg.ray.image} as an earlier submit read it")
        python = wh.ImagePython.from_probe(record["python"])
        return choose(d, names, lambda: python, _asker(d, None), None, mode=mode)
    with nullcontext(head) if head is not None else image_pod(d) as pod:
        return choose(d, names, lambda: ask_image(d, pod), _asker(d, pod), pod, mode=mode)


def for_running_head(d: Deployment, head: Pod, wanted: list[str]) -> JobPackages:
    """:func:`choose` for ``--mode raycluster`` without ``--offline``, once the head pod runs: its python3 is asked,
    and what it cannot answer leaves the packages to pip."""
    from packaging.utils import canonicalize_name

    names = {r: str(canonicalize_name(requirement_name(r))) for r in wanted}
    return choose(d, names, lambda: ask_image(d, head), _asker(d, head), head, mode="raycluster")


def choose(
    d: Deployment,
    names: dict[str, str],
    image: Callable[[], wh.ImagePython],
    asker: Callable[[list[str]], dict[str, str | None]],
    pod: Pod | None,
    *,
    mode: str,
) -> JobPackages:
    """How the requirements the image lacks reach the cluster. ``names``: each requirement's canonical project
    name; ``image``: the image's Python, asked only when wheels are needed; ``pod``: one that mounts the shared
    volume (where ``--offline``'s wheels go when the storage is there).

    Their wheels for the image's Python (the requirements and each dependency the image does not meet in range,
    :func:`~raytrain_eks.k8s.wheelhouse.build_wheelhouse`) travel unpacked as ``py_modules`` when every one is pure
    Python (:func:`~raytrain_eks.k8s.wheelhouse.unpack_pure`) and, for a RayJob, they fit a ConfigMap: then no
    ``pip`` entry, and Ray copies none of the image's virtualenv. Otherwise pip installs them (after that copy), from
    the wheelhouse under ``--offline``, from the nodes' index without it. Without ``--offline`` nothing is downloaded
    when the image lacks more than :data:`~raytrain_eks.k8s.job.MAX_SHIPPED` (a plain Ray image lacks compiled ones,
    tokenizers among them), and a download that fails here leaves them to the nodes' pip."""
    offline = d.cfg.ray.offline
    try:
        found = asker(sorted(set(names.values())))
    except UserError as exc:
        if offline:
            raise
        d.say(f"Could not ask the image which packages it has ({exc.message[:200]}): pip installs all of them")
        return JobPackages(list(names))
    left, has = what_the_image_has(list(names), {requirement_name(r): found.get(c) for r, c in names.items()})
    if not left:
        d.say(f"{has}; the job adds nothing to it")
        return JobPackages([])
    pip = f"{has}; pip installs {', '.join(left)} (Ray first copies the image's Python on every node)"
    if not offline and len(left) > MAX_SHIPPED:
        d.say(f"{pip}: {len(left)} packages, more than the {MAX_SHIPPED} that are tried as unpacked wheels")
        return JobPackages(left)
    with tempfile.TemporaryDirectory(prefix="raytrain-eks-wheels-") as tmp:
        try:
            python = image()
            d.say(f"{'--offline: ' if offline else ''}the image's {python.describe()}")
            house = wh.build_wheelhouse(left, python, Path(tmp), installed=asker)
        except UserError as exc:
            if offline:
                raise
            d.say(f"{pip}: their wheels could not be downloaded here ({exc.message})")
            return JobPackages(left)
        for line in house.lines():
            d.say(line)
        shipped = wh.unpack_pure(house)
        why = shipped if isinstance(shipped, str) else _too_large(d, shipped, mode)
        if why is None and isinstance(shipped, wh.Unpacked):
            d.say(
                f"{has}; {', '.join(left)} {'travels' if len(left) == 1 else 'travel'} unpacked beside the package "
                f"({shipped.describe()}; py_modules): no pip, so no node copies the image's Python"
            )
            return JobPackages([], shipped=shipped)
        if not offline:
            d.say(f"{pip}: {why}")
            return JobPackages(left)
        d.say(f"{has}; the wheelhouse holds {', '.join(left)} and what they need, for pip: {why}")
        return JobPackages(left, wheels=_store(d, house, pod))


def _too_large(d: Deployment, shipped: wh.Unpacked, mode: str) -> str | None:
    """Why ``shipped`` cannot go into a RayJob's packages ConfigMap (None: it fits, or the mode needs none)."""
    if mode != "rayjob":
        return None
    try:
        packages_config_map(d.cfg, shipped)
    except UserError as exc:
        return exc.message
    return None


def _store(d: Deployment, house: wh.Wheelhouse, pod: Pod | None) -> Wheels:
    """``--offline``'s wheelhouse where the Ray pods find it: uploaded to ``s3://``, or written through ``pod`` onto
    the shared volume."""
    location = wh.storage_location(d.cfg)
    if not wh.on_volume(d.cfg):
        return Wheels(house, wh.upload(house, location, d.say), on_volume=False)
    if pod is None:  # prepare() asks through a pod whenever the storage is on the volume
        raise AssertionError("a wheelhouse for the shared volume needs a pod that mounts it")
    through = pod

    def run(argv: list[str], stdin: str | None) -> ExecResult:
        return d.kube.exec(
            through.namespace,
            through.name,
            argv,
            timeout=COPY_TIMEOUT_S,
            stdin=stdin,
            container=_container(through),
        )

    return Wheels(house, wh.write_through(house, location, run, d.say), on_volume=True)


def ship_into_head(d: Deployment, head: Pod, shipped: wh.Unpacked) -> list[str]:
    """The unpacked wheels into the head pod (:func:`~raytrain_eks.k8s.job.head_packages_dir`, once: a folder whose
    last file is there is complete, as the unpack writes in order); returns their py_modules entries."""
    dest = head_packages_dir(shipped)
    last = max(shipped.files)
    have = ["test", "-f", f"{dest}/{last}"]
    if not d.kube.exec(head.namespace, head.name, have, timeout=EXEC_TIMEOUT_S, container=_container(head)).ok:
        d.say(f"Copying {shipped.describe()} into the head pod")
        argv = unpack_argv(dest)
        res = d.kube.exec(
            head.namespace,
            head.name,
            argv,
            timeout=COPY_TIMEOUT_S,
            stdin=packages_archive(shipped),
            container=_container(head),
        )
        if not res.ok:
            raise CommandError([*argv[:2], "<unpack>", dest], res.returncode, res.stderr or res.stdout)
    return shipped_modules(dest, shipped)


def copy_into(d: Deployment, pods: list[Pod], wheels: Wheels) -> None:
    """The wheelhouse into every running Ray pod that lacks it (made by an earlier RayCluster, before the init
    container); a pod whose init container copied it says so at once. Nothing to do when it is on the volume."""
    if wheels.on_volume:
        return
    source = wheels.folder
    argv = wh.copy_argv(source, wheels.house.digest)
    for pod in pods:
        res = d.kube.exec(pod.namespace, pod.name, argv, timeout=COPY_TIMEOUT_S, container=_container(pod))
        if not res.ok:
            raise CommandError(
                [*argv[:2], "<copy the wheelhouse>", *argv[3:]],
                res.returncode,
                res.stderr or res.stdout,
                hint=f"The pod {pod.name} could not copy the wheelhouse from {source}: check that its service "
                "account may read there.",
            )
        d.say(f"{pod.name}: {(res.stdout.strip().splitlines() or ['wheelhouse copied'])[-1]}")
