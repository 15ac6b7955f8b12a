"""``submit --offline`` on the cluster: ask the image, build and upload the wheelhouse, all before any Ray object.

The image's Python, platform tags and installed packages are read from its own python3 before the RayCluster or
RayJob is applied, so a requirement without a wheel for it stops the submit with nothing applied but the namespace:
from this deployment's Ray head pod when it already runs, else from what an earlier submit remembered of this image
(the state, per image), else from a short-lived pod of the image placed as the workers are (:func:`image_pod`,
deleted again). :mod:`raytrain_eks.k8s.wheelhouse` builds the wheels here and stores them beside the checkpoints:
on ``s3://`` the Ray objects get the init container that copies them (:meth:`Wheels.into`) and pods of an earlier
RayCluster, made without it, copy them through exec (:func:`copy_into`); on the shared volume they are written
through the pod asked, and pip reads them there. Example::

    check(d)                                              # storage the pods read, before anything is applied
    left, wheels = prepare(d, job_requirements(), head=None)   # what runtime_env installs; where its wheels are
    doc = wheels.into(raycluster_doc, cfg)                # then, once the pods run:
    copy_into(d, [head, *workers], wheels)                # idempotent; nothing to do on the volume
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
from raytrain_eks.k8s.cluster import Pod, image_never_pulls
from raytrain_eks.k8s.job import IMAGE_VERSIONS, requirement_name, what_the_image_has
from raytrain_eks.k8s.runner import CommandError
from raytrain_eks.k8s.state import Deployment, object_item

REMEMBERED = "offline_image"  # state key: {"image", "python": the IMAGE_PLATFORM report, "versions": name -> version}
COPY_TIMEOUT_S = 1800
EXEC_TIMEOUT_S = 120


def check(d: Deployment) -> None:
    """What ``--offline`` needs before anything is applied: storage the pods read through a URI."""
    wh.storage_location(d.cfg)


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
            f"--offline: cannot read the image's Python and platform in {pod.name}: {said[-300:]}. Nothing was applied",
            hint="--offline needs a CPython image whose python3 imports packaging (Ray's images do); or submit "
            "without --offline.",
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
            raise UserError(f"--offline: cannot ask the image which packages it has: {said[:300]}")
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
            f"--offline: the pod {ns}/{name} of the image {why}:\n{shown}\nNothing else was applied; the pod is "
            "deleted",
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


def prepare(d: Deployment, wanted: list[str], *, head: Pod | None) -> tuple[list[str], Wheels | None]:
    """Before the Ray objects are applied: which of ``wanted`` the image lacks, and their wheelhouse (built and
    stored; ``None``: nothing to install). The image is asked through ``head`` (a Ray head pod already running),
    else what an earlier submit remembered of it serves when it covers every name (and the wheels go to ``s3://``),
    else :func:`image_pod` is; a wheelhouse for the shared volume is written through that pod."""
    from packaging.utils import canonicalize_name

    names = {r: str(canonicalize_name(requirement_name(r))) for r in wanted}
    record = _remembered(d)
    if head is None and record and set(names.values()) <= set(record.get("versions", {})) and not wh.on_volume(d.cfg):
        d.say(f"--offline: the image {d.cfg.ray.image} as an earlier submit read it")
        return _left_and_house(d, wh.ImagePython.from_probe(record["python"]), names, _asker(d, None), None)
    with nullcontext(head) if head is not None else image_pod(d) as pod:
        return _left_and_house(d, ask_image(d, pod), names, _asker(d, pod), pod)


def _left_and_house(
    d: Deployment,
    image: wh.ImagePython,
    names: dict[str, str],
    asker: Callable[[list[str]], dict[str, str | None]],
    pod: Pod | None,
) -> tuple[list[str], Wheels | None]:
    """``names``: each requirement's canonical project name; ``pod``: one that mounts the shared volume (where the
    wheels go when the storage is there)."""
    d.say(f"--offline: the image's {image.describe()}")
    found = asker(sorted(set(names.values())))
    left, has = what_the_image_has(list(names), {requirement_name(r): found.get(c) for r, c in names.items()})
    d.say(f"{has}; the wheelhouse holds {', '.join(left) if left else 'nothing'} and what they need")
    if not left:
        return left, None
    location = wh.storage_location(d.cfg)
    with tempfile.TemporaryDirectory(prefix="raytrain-eks-wheels-") as tmp:
        house = wh.build_wheelhouse(left, image, Path(tmp), installed=asker)
        for line in house.lines():
            d.say(line)
        if not wh.on_volume(d.cfg):
            return left, Wheels(house, wh.upload(house, location, d.say), on_volume=False)
        if pod is None:  # prepare() asks through a pod whenever the storage is on the volume
            raise AssertionError("a wheelhouse for the shared volume needs a pod that mounts it")
        through = pod

        def run(argv: list[str], stdin: str | None) -> Any:
            return d.kube.exec(
                through.namespace,
                through.name,
                argv,
                timeout=COPY_TIMEOUT_S,
                stdin=stdin,
                container=_container(through),
            )

        return left, Wheels(house, wh.write_through(house, location, run, d.say), on_volume=True)


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
