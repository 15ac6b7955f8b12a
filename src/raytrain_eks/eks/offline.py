"""``submit --offline`` on the cluster: ask the image, build and upload the wheelhouse, put it into the Ray pods.

``--mode raycluster``: once the pods run, the head pod's python3 says its Python, platform tags and which packages it
has (:mod:`raytrain_eks.k8s.wheelhouse` builds the wheels here and uploads them beside the checkpoints); the pods
already running copy the wheelhouse through exec, and the RayCluster is applied again with the init container that
copies it, so a pod KubeRay makes later (a worker replaced after a failure) has it too. What the image said is
remembered in the state, per image. ``--mode rayjob``: its runtime_env is fixed before any pod exists, so it builds
from what an earlier ``submit --offline`` (raycluster) remembered of that image, and refuses before anything is
applied when there is none. Example::

    check(d, "raycluster")                               # before anything is applied
    options = for_raycluster(d, head, workers, left)     # runtime_env pip_install_options, or None
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s import wheelhouse as wh
from raytrain_eks.k8s.cluster import Pod
from raytrain_eks.k8s.job import IMAGE_VERSIONS
from raytrain_eks.k8s.runner import CommandError
from raytrain_eks.k8s.state import Deployment

REMEMBERED = "offline_image"  # state key: {"image", "python": the IMAGE_PLATFORM report, "versions": name -> version}
COPY_TIMEOUT_S = 1800


def check(d: Deployment, mode: str) -> None:
    """What ``--offline`` needs, before anything is applied: storage the pods read through a URI, and for a RayJob
    what an earlier submit read from the image."""
    wh.storage_location(d.cfg)
    if mode == "rayjob" and _remembered(d) is None:
        raise UserError(
            f"--offline --mode rayjob: the image {d.cfg.ray.image} has not been asked for its Python, platform and "
            "packages yet (a RayJob's runtime_env is fixed before its pods exist). Nothing was applied",
            hint="Run `raytrain-eks submit --offline` (--mode raycluster) once: it asks the head pod and remembers "
            "the answer for this image. Then delete that RayCluster and run `submit --offline --mode rayjob`.",
        )


def _remembered(d: Deployment) -> dict[str, Any] | None:
    found = d.state.get(REMEMBERED)
    return found if isinstance(found, dict) and found.get("image") == d.cfg.ray.image else None


def _head_exec(d: Deployment, head: Pod, argv: list[str]) -> Any:
    return d.kube.exec(head.namespace, head.name, argv, timeout=120, container="ray-head")


def ask_head(d: Deployment, head: Pod, script: str, *args: str) -> tuple[dict[str, Any] | None, str]:
    """What ``script`` (run by the head pod's python3 with ``args``) printed as a JSON object, or ``None`` and
    what it said instead."""
    res = _head_exec(d, head, [m.IMAGE_PYTHON, "-c", script, *args])
    try:
        found = json.loads(res.stdout) if res.ok else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return None, (res.stderr or res.stdout).strip()
    return found, ""


def ask_image(d: Deployment, head: Pod) -> wh.ImagePython:
    """The head pod's python3: its version, ABI, platform tags and markers (remembered for this image)."""
    found, said = ask_head(d, head, wh.IMAGE_PLATFORM)
    if found is None:
        raise UserError(
            f"--offline: cannot read the image's Python and platform in {head.name}: {said[-300:]}",
            hint="--offline needs a CPython image whose python3 imports packaging (Ray's images do); or submit "
            "without --offline.",
        )
    image = wh.ImagePython.from_probe(found)
    old = _remembered(d) or {}
    d.state.update(**{REMEMBERED: {"image": d.cfg.ray.image, "python": found, "versions": old.get("versions", {})}})
    return image


def _asker(d: Deployment, head: Pod | None) -> Callable[[list[str]], dict[str, str | None]]:
    """The image's installed version of each name: asked of ``head``'s python3 (and remembered), else from what was
    remembered (a name never asked counts as not installed: its wheel goes in, which is safe)."""

    def installed(names: list[str]) -> dict[str, str | None]:
        record = _remembered(d) or {"image": d.cfg.ray.image, "versions": {}}
        known: dict[str, str | None] = dict(record.get("versions", {}))
        if head is None:
            return {n: known.get(n) for n in names}
        found, said = ask_head(d, head, IMAGE_VERSIONS, *names)
        if found is None:
            raise UserError(f"--offline: cannot ask the image which packages it has: {said[:300]}")
        known.update(found)
        d.state.update(**{REMEMBERED: {**record, "versions": known}})
        return {n: found.get(n) for n in names}

    return installed


def _build_and_upload(
    d: Deployment, image: wh.ImagePython, left: list[str], installed: Callable[[list[str]], Any]
) -> wh.Wheelhouse | None:
    location = wh.storage_location(d.cfg)
    if not left:
        d.say("--offline: the image has every package the job needs in range: no wheelhouse")
        return None
    with tempfile.TemporaryDirectory(prefix="raytrain-eks-wheels-") as tmp:
        house = wh.build_wheelhouse(left, image, Path(tmp), installed=installed)
        for line in house.lines():
            d.say(line)
        wh.upload(house, location, d.say)
    return house


def source_of(d: Deployment, house: wh.Wheelhouse) -> str:
    return f"{wh.storage_location(d.cfg)}/{house.digest}"


def for_raycluster(
    d: Deployment, head: Pod, workers: list[Pod], left: list[str], *, hf_token: bool
) -> list[str] | None:
    """Build and upload the wheelhouse of ``left``, copy it into the running Ray pods, and apply the RayCluster again
    (``hf_token`` as it was applied) with the init container that copies it; returns the runtime_env's
    ``pip_install_options`` (None: nothing to install)."""
    from packaging.utils import canonicalize_name

    from raytrain_eks.k8s.job import job_requirements, requirement_name

    image = ask_image(d, head)
    asker = _asker(d, head)
    asker([canonicalize_name(requirement_name(r)) for r in job_requirements()])  # remembered for a later RayJob
    house = _build_and_upload(d, image, left, asker)
    if house is None:
        return None
    source = source_of(d, house)
    argv = wh.copy_argv(source, house.digest)
    for pod in [head, *workers]:
        container = "ray-head" if pod is head else None
        res = d.kube.exec(pod.namespace, pod.name, argv, timeout=COPY_TIMEOUT_S, container=container)
        if not res.ok:
            raise CommandError(
                [*argv[:2], "<copy the wheelhouse>", *argv[3:]],
                res.returncode,
                res.stderr or res.stdout,
                hint=f"The pod {pod.name} could not copy the wheelhouse from {source}: check that its service "
                "account may read there.",
            )
        d.say(f"{pod.name}: {(res.stdout.strip().splitlines() or ['wheelhouse copied'])[-1]}")
    doc = wh.with_wheels(m.raycluster(d.cfg, hf_token=hf_token), d.cfg, source, house.digest)
    d.kube.apply(doc)
    d.say(f"Applied RayCluster {d.cfg.ray.namespace}/{d.cfg.ray.cluster_name} again: pods made from now on copy "
          f"wheelhouse {house.digest} in an init container")  # fmt: skip
    return wh.pip_options(house.digest)


def for_rayjob(d: Deployment, wanted: list[str]) -> tuple[list[str], wh.Wheelhouse | None]:
    """From what was remembered of the image: what is left to install of ``wanted`` and its wheelhouse (built and
    uploaded), before the RayJob is applied."""
    from packaging.utils import canonicalize_name

    from raytrain_eks.k8s.job import left_to_install, requirement_name

    record = _remembered(d)
    assert record is not None  # check() refused before
    image = wh.ImagePython.from_probe(record["python"])
    versions = record.get("versions", {})
    names = {requirement_name(r): versions.get(canonicalize_name(requirement_name(r))) for r in wanted}
    left = left_to_install(wanted, names)
    d.say(f"--offline: the image {d.cfg.ray.image} as an earlier submit read it: {image.describe()}")
    return left, _build_and_upload(d, image, left, _asker(d, None))
