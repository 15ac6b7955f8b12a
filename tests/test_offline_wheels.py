"""How the job's packages beyond the image reach the cluster, with real pip and wheels built here.

- ``submit --offline``: the wheelhouse built for the image's Python, uploaded with its manifest to moto's S3,
  copied into a pod's folder by the init container's own script, and installed from there by pip with no index;
  the manifests carrying the init container validate against the real schemas, and real Ray accepts the
  runtime_env. The job requirement the stand-in image lacks here (``rich``) is built compiled, so pip installs it.
- An image lacking a pure-Python package (``tensorboardX`` here): its wheel, downloaded for the image's Python,
  travels unpacked beside the package (py_modules, into the head pod or a RayJob's packages ConfigMap) and the
  runtime_env has no ``pip``, with and without ``--offline``; a compiled one, or too many, fall back to pip.

Real pip builds, downloads and installs every wheel (from a local folder this test fills with packages it builds
itself: ``PIP_NO_INDEX``/``PIP_FIND_LINKS``, pip's own settings, stand in for PyPI)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path
from typing import Any

import boto3
import jsonschema
import kubernetes_validate
import pytest
import yaml
from fake_kube import PULL_NO_CREDENTIALS, PULL_NOT_FOUND
from schema_errors import schema_errors

import raytrain_eks
from raytrain_eks.config import load_config
from raytrain_eks.k8s import job as shipping
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s import wheelhouse as wh

BUCKET = "offline-wheels"
SCHEMAS = Path(__file__).parent / "schemas" / "kuberay"
IMAGE_HAS = {"rte-image-dep": "2.1.0"}  # what the stand-in image reports installed (any other name: not installed)
# What the real peft (the release the job pins, installed here) requires, extras left out.
PEFT_REQUIRES = [r for r in importlib.metadata.requires("peft") or [] if "extra ==" not in r]
DLC = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"


def _package(root: Path, name: str, version: str, requires: list[str], *, compiled: bool = False) -> Path:
    """A one-module project (setuptools) whose module says its name and version when imported; ``compiled``: its
    wheel is tagged for this interpreter and platform (``Root-Is-Purelib: false``), as one with C code is."""
    src = root / f"{name}-{version}"
    module = name.replace("-", "_")
    (src / module).mkdir(parents=True)
    (src / module / "__init__.py").write_text(f"WHO = {name + ' ' + version!r}\n")
    deps = ", ".join(json.dumps(r) for r in requires)
    (src / "pyproject.toml").write_text(
        textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "{version}"
        dependencies = [{deps}]
        [tool.setuptools]
        packages = ["{module}"]
        """)
    )
    if compiled:
        (src / "setup.py").write_text(
            "from setuptools import setup\nfrom setuptools.dist import Distribution\n\n\n"
            "class Compiled(Distribution):\n    def has_ext_modules(self):\n        return True\n\n\n"
            "setup(distclass=Compiled)\n"
        )
    return src


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local package index (a folder pip reads with --find-links): wheels built here by ``pip wheel``, and one
    project with a source distribution only."""
    root = tmp_path_factory.mktemp("index")
    projects = tmp_path_factory.mktemp("projects")
    top = ["rte-offline-dep>=1,<2", "rte-image-dep>=2", 'rte-never-here>=1; python_version < "3"']
    specs = [
        ("rte-offline-top", "1.0.0", top),
        ("rte-offline-dep", "1.4.0", []),
        ("rte-offline-dep", "2.0.0", []),  # outside the range top asks for: never chosen
        ("rte-image-dep", "2.5.0", []),  # the image's 2.1.0 serves: never downloaded
        # Stand-ins for job requirements a submit test's image lacks: one compiled, two pure Python (peft with the
        # real one's dependencies, which the DLC has; tensorboardX with one no image has).
        ("rich", "15.0.0", []),
        ("peft", "0.21.2", PEFT_REQUIRES),
        ("tensorboardX", "2.6.5", ["rte-offline-dep>=1,<2"]),
    ]
    for name, version, requires in specs:
        src = _package(projects, name, version, requires, compiled=name == "rich")
        argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w"]
        subprocess.run([*argv, str(root), str(src)], check=True, capture_output=True, timeout=300)
    # A project that publishes only a source distribution (pip never opens it: --only-binary skips it by name).
    sdist = projects / "rte-sdist-only-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(_package(projects, "rte-sdist-only", "1.0", []), arcname="rte-sdist-only-1.0")
    (root / sdist.name).write_bytes(sdist.read_bytes())
    return root


def _wheel_of(name: str) -> str:
    """The file name of the one wheel of ``name`` in the local index."""
    (found,) = Path(os.environ["PIP_FIND_LINKS"]).glob(f"{name}-*.whl")
    return found.name


@pytest.fixture
def pip_reads(index: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip (in every child process) reads the local index only: its own PIP_NO_INDEX and PIP_FIND_LINKS settings."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return index


@pytest.fixture(scope="module")
def here() -> wh.ImagePython:
    """This interpreter as the image probe (the very script submit runs in the head pod) reports it."""
    done = subprocess.run(
        [sys.executable, "-c", wh.IMAGE_PLATFORM], capture_output=True, text=True, check=True, timeout=60
    )
    return wh.ImagePython.from_probe(json.loads(done.stdout))


def _image_has(asked: list[list[str]]) -> Any:
    def installed(names: list[str]) -> dict[str, str | None]:
        asked.append(list(names))
        return {n: IMAGE_HAS.get(n) for n in names}

    return installed


def test_the_probe_reports_this_interpreters_python_abi_and_platform_tags(here: wh.ImagePython):
    from packaging import tags

    assert here.python == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert here.abi == f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert here.platforms[0] == next(iter(tags.sys_tags())).platform and "any" not in here.platforms
    assert here.markers["python_version"] == here.python
    with pytest.raises(wh.UserError, match="did not report a CPython version"):
        wh.ImagePython.from_probe({"python": "3.12", "implementation": "pypy", "abi": "pp73", "platforms": ["x"]})


def test_pip_download_argv_for_an_image_python_and_platform_and_pip_accepts_it(pip_reads: Path, tmp_path: Path):
    image = wh.ImagePython("3.12", "cp312", ("manylinux_2_35_x86_64", "manylinux2014_x86_64", "linux_x86_64"), {})
    argv = wh.pip_download_argv(["rte-offline-dep>=1,<2"], image, tmp_path / "out")
    assert argv == [
        sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
        "--platform", "manylinux_2_35_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64",
        "--dest", str(tmp_path / "out"), "rte-offline-dep>=1,<2",
    ]  # fmt: skip
    # Real pip takes every option for a Python other than its own (3.12 here whatever runs the test).
    subprocess.run(argv, check=True, capture_output=True, timeout=300)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["rte_offline_dep-1.4.0-py3-none-any.whl"]


def test_the_wheelhouse_holds_what_the_image_lacks_and_its_unmet_dependencies_only(
    pip_reads: Path, here: wh.ImagePython, tmp_path: Path
):
    asked: list[list[str]] = []
    calls: list[list[str]] = []

    def run(argv: list[str], **kw: Any) -> Any:
        calls.append(argv)
        return subprocess.run(argv, **kw)

    house = wh.build_wheelhouse(
        ["rte-offline-top>=1,<2"], here, tmp_path / "house", installed=_image_has(asked), run=run
    )
    assert [w.name for w in house.wheels] == [
        "rte_offline_dep-1.4.0-py3-none-any.whl",  # in top's range (2.0.0 is not)
        "rte_offline_top-1.0.0-py3-none-any.whl",
    ]  # not rte-image-dep (the image's 2.1.0 meets >=2), not rte-never-here (its marker is false for the image)
    assert asked == [["rte-offline-top"], ["rte-image-dep", "rte-offline-dep"]]
    assert [c[-1] for c in calls] == ["rte-offline-top<2,>=1", "rte-offline-dep<2,>=1"]
    for argv in calls:
        assert argv[argv.index("--python-version") + 1] == here.python and "--no-deps" in argv
        platforms = [argv[i + 1] for i, a in enumerate(argv) if a == "--platform"]
        assert platforms == list(here.platforms)
    for w in house.wheels:
        data = (house.folder / w.name).read_bytes()
        assert (w.bytes, w.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    lines = house.lines()
    assert lines[0].startswith(f"Wheelhouse for CPython {here.python} ({here.abi}, {here.platforms[0]}): 2 wheels")
    assert "rte_offline_top-1.0.0-py3-none-any.whl" in lines[2]


def test_a_requirement_without_a_wheel_for_the_image_is_one_message_naming_it(
    pip_reads: Path, here: wh.ImagePython, tmp_path: Path
):
    with pytest.raises(wh.NoWheel) as err:
        wh.build_wheelhouse(["rte-sdist-only>=1"], here, tmp_path / "house", installed=_image_has([]))
    assert err.value.exit_code == 2
    assert err.value.message.startswith(
        f"--offline: rte-sdist-only>=1 has no wheel for the image's CPython {here.python}"
    )
    assert "Nothing was uploaded and no Ray object applied" in err.value.message
    assert (
        err.value.hint and "pip wheel 'rte-sdist-only>=1'" in err.value.hint and "without --offline" in err.value.hint
    )


@pytest.fixture
def bucket(aws_env: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    return s3


def test_uploaded_to_s3_copied_by_the_init_containers_script_and_installed_with_no_index(
    pip_reads: Path, here: wh.ImagePython, tmp_path: Path, bucket: Any, monkeypatch: pytest.MonkeyPatch
):
    # An image with none of them (pip installs into an empty --target below, as into a bare image).
    nothing = {"rte-image-dep": None}
    house = wh.build_wheelhouse(
        ["rte-offline-top>=1"], here, tmp_path / "house", installed=lambda names: {n: nothing.get(n) for n in names}
    )
    assert len(house.wheels) == 3
    cfg = load_config(environ={}, path=None, sets=[f"training.storage_path=s3://{BUCKET}/runs", "ray.offline=true"])
    location = wh.storage_location(cfg)
    assert location == f"s3://{BUCKET}/runs/{wh.STORAGE_FOLDER}"
    said: list[str] = []
    source = wh.upload(house, location, said.append)
    assert source == f"{location}/{house.digest}" and "manifest last" in said[-1]
    prefix = f"runs/{wh.STORAGE_FOLDER}/{house.digest}/"
    keys = sorted(o["Key"].removeprefix(prefix) for o in bucket.list_objects_v2(Bucket=BUCKET)["Contents"])
    assert keys == sorted([wh.MANIFEST, *(w.name for w in house.wheels)])
    manifest = json.loads(bucket.get_object(Bucket=BUCKET, Key=prefix + wh.MANIFEST)["Body"].read())
    assert manifest["files"] == [{"name": w.name, "bytes": w.bytes, "sha256": w.sha256} for w in house.wheels]
    assert wh.upload(house, location, said.append) == source and "already at" in said[-1]

    # The init container's command as the RayCluster carries it: the image's python3 is this interpreter here,
    # and the pod's emptyDir at /tmp/raytrain-eks-wheels is a folder of this test.
    doc = wh.with_wheels(m.raycluster(cfg), cfg, source, house.digest)
    (init,) = doc["spec"]["headGroupSpec"]["template"]["spec"]["initContainers"]
    command = init["command"]
    assert command[:2] == [m.IMAGE_PYTHON, "-c"] and command[3:] == [source, wh.local_folder(house.digest)]
    pod_dir = tmp_path / "pod" / house.digest
    (tmp_path / "pod").mkdir()  # the emptyDir, which Kubernetes makes
    argv = [sys.executable, "-c", command[2], command[3], str(pod_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "copied 3 wheels" in done.stdout
    assert sorted(p.name for p in pod_dir.iterdir()) == sorted([wh.MANIFEST, *(w.name for w in house.wheels)])
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    assert "already at" in again.stdout

    # pip as the runtime_env runs it: the job's options, this folder instead of the pod's, nothing else to read.
    monkeypatch.delenv("PIP_FIND_LINKS")
    options = wh.pip_options(house.digest)
    options[options.index("--find-links") + 1] = str(pod_dir)
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--target", str(target), *options, "rte-offline-top>=1"]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    imported = subprocess.run(
        [sys.executable, "-c", "import rte_offline_top as t, rte_offline_dep as d; print(t.WHO, '|', d.WHO)"],
        capture_output=True, text=True, check=True, timeout=60, env={"PYTHONPATH": str(target)},
    )  # fmt: skip
    assert imported.stdout.strip() == "rte-offline-top 1.0.0 | rte-offline-dep 1.4.0"


def test_the_copy_refuses_a_wheel_that_differs_from_the_manifest(
    pip_reads: Path, here: wh.ImagePython, tmp_path: Path, bucket: Any
):
    house = wh.build_wheelhouse(["rte-offline-dep>=1,<2"], here, tmp_path / "house", installed=_image_has([]))
    source = wh.upload(house, f"s3://{BUCKET}/runs/{wh.STORAGE_FOLDER}")
    key = source.removeprefix(f"s3://{BUCKET}/") + "/" + house.wheels[0].name
    bucket.put_object(Bucket=BUCKET, Key=key, Body=b"not the wheel the manifest names")
    command = wh.copy_argv(source, house.digest)
    (tmp_path / "pod").mkdir()
    done = subprocess.run(
        [sys.executable, *command[1:4], str(tmp_path / "pod" / house.digest)], capture_output=True, text=True
    )
    assert done.returncode != 0 and "the manifest says" in done.stderr and house.wheels[0].sha256 in done.stderr
    assert not (tmp_path / "pod" / house.digest).exists()  # nothing complete was left behind


def _on_volume_cfg(*sets: str) -> Any:
    from raytrain_eks.k8s.state import with_shared_volume

    return with_shared_volume(load_config(environ={}, path=None, sets=["ray.shared_volume=shared-fs", *sets]))


def test_offline_needs_storage_every_ray_pod_reads():
    cfg = load_config(environ={}, path=None, sets=["training.storage_path=/mnt/local", "training.storage_shared=true"])
    with pytest.raises(wh.UserError, match="neither storage the Ray pods read through a URI nor a folder of") as err:
        wh.storage_location(cfg)
    assert err.value.hint and "s3://" in err.value.hint and "ray.shared_volume" in err.value.hint
    # A folder of the shared volume (where its checkpoints go) is storage every Ray pod reads.
    cfg = _on_volume_cfg()
    assert wh.on_volume(cfg) and wh.storage_location(cfg) == f"/mnt/shared/runs/{wh.STORAGE_FOLDER}"
    # The volume set, but the checkpoints on a node's own disk: refused as before.
    local = load_config(environ={}, path=None, sets=["ray.shared_volume=shared-fs", "training.storage_path=/data/x"])
    assert not wh.on_volume(local)
    with pytest.raises(wh.UserError, match="neither storage"):
        wh.storage_location(local)


def _pod_runs(volume: Path) -> Any:
    """Exec in a pod that mounts the shared volume at /mnt/shared: the scripts themselves, with the volume's paths
    mapped onto ``volume``."""
    from test_deploy import run_script

    def run(argv: list[str], stdin: str | None) -> Any:
        assert argv[:2] == [m.IMAGE_PYTHON, "-c"]
        args = [a.replace("/mnt/shared", str(volume)) for a in argv[3:]]
        return run_script(argv[2], args, stdin)

    return run


def test_written_onto_the_shared_volume_through_a_pod_in_pieces_and_installed_from_there_with_no_index(
    pip_reads: Path, here: wh.ImagePython, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    nothing = {"rte-image-dep": None}
    house = wh.build_wheelhouse(
        ["rte-offline-top>=1"], here, tmp_path / "house", installed=lambda names: {n: nothing.get(n) for n in names}
    )
    cfg = _on_volume_cfg("ray.offline=true")
    location = wh.storage_location(cfg)
    volume = tmp_path / "volume"
    volume.mkdir()  # the claim's file system, which the volume's provisioner makes
    monkeypatch.setattr(wh, "PIECE_BYTES", 700)  # each wheel in several exec calls
    calls: list[list[str]] = []
    runs = _pod_runs(volume)

    def counted(argv: list[str], stdin: str | None) -> Any:
        calls.append(argv)
        return runs(argv, stdin)

    said: list[str] = []
    folder = wh.write_through(house, location, counted, said.append)
    assert folder == f"/mnt/shared/runs/{wh.STORAGE_FOLDER}/{house.digest}" and "on the shared volume" in said[-1]
    pieces = [c for c in calls if "new" in c or "more" in c]
    assert len(pieces) > len(house.wheels)  # split, as a wheel larger than one piece is
    local = volume / folder.removeprefix("/mnt/shared/")
    assert sorted(p.name for p in local.iterdir()) == sorted([wh.MANIFEST, *(w.name for w in house.wheels)])
    for w in house.wheels:
        assert hashlib.sha256((local / w.name).read_bytes()).hexdigest() == w.sha256
    assert [p.name for p in local.parent.iterdir()] == [house.digest]  # no partial folder left
    calls.clear()
    assert wh.write_through(house, location, counted, said.append) == folder and "already at" in said[-1]
    assert len(calls) == 1
    # The Ray pods need no init container: the runtime_env's pip reads the volume's folder itself.
    monkeypatch.delenv("PIP_FIND_LINKS")
    options = wh.pip_options(house.digest, folder)
    assert options[-2:] == ["--find-links", folder]
    options[-1] = str(local)
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--target", str(target), *options, "rte-offline-top>=1"]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    assert (target / "rte_offline_top" / "__init__.py").is_file() and (target / "rte_offline_dep").is_dir()


def test_a_wheel_that_arrives_damaged_on_the_volume_is_refused_and_nothing_is_left(
    pip_reads: Path, here: wh.ImagePython, tmp_path: Path
):
    house = wh.build_wheelhouse(["rte-offline-dep>=1,<2"], here, tmp_path / "house", installed=_image_has([]))
    (house.folder / house.wheels[0].name).write_bytes(b"not the wheel the manifest names")
    volume = tmp_path / "volume"
    volume.mkdir()
    with pytest.raises(wh.UserError, match="the manifest says") as err:
        wh.write_through(house, f"/mnt/shared/runs/{wh.STORAGE_FOLDER}", _pod_runs(volume))
    assert house.wheels[0].sha256 in err.value.message
    assert not list((volume / "runs" / wh.STORAGE_FOLDER).iterdir())  # no folder, complete or partial


def _schema(name: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((SCHEMAS / name).read_text()))


def test_the_ray_pods_with_the_init_container_validate_and_keep_guaranteed_qos(cfg_for):
    cfg = cfg_for(NAMESPACE="train")
    source, digest = f"s3://b/runs/{wh.STORAGE_FOLDER}/0123456789abcdef", "0123456789abcdef"
    rc = wh.with_wheels(m.raycluster(cfg, hf_token=True), cfg, source, digest)
    code_map, items = shipping.code_config_map(cfg, {"raytrain_eks/__init__.py": "shipped = True\n"})
    options = wh.pip_options(digest)
    plain = shipping.rayjob_manifest(
        cfg, hf_token=True, code_map=code_map, items=items, pip=["rte-offline-top>=1"], pip_options=options
    )
    job = wh.with_wheels(plain, cfg, source, digest)
    assert (
        plain["spec"]["submitterPodTemplate"] == job["spec"]["submitterPodTemplate"]
    )  # the submitter installs nothing
    assert schema_errors(_schema("raycluster.v1.schema.json"), rc) == []
    assert schema_errors(_schema("rayjob.v1.schema.json"), job) == []
    for i, template in enumerate(m.pod_templates(rc) + m.pod_templates(job)):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{i}", **template["metadata"]}}
        kubernetes_validate.validate({**pod, "spec": template["spec"]}, "1.33", strict=True)
        spec = template["spec"]
        (init,) = spec["initContainers"]
        assert init["image"] == cfg.ray.image and init["command"] == wh.copy_argv(source, digest)
        assert init["resources"]["requests"] == init["resources"]["limits"]
        assert {"name": wh.WHEELS_VOLUME, "emptyDir": {}} in spec["volumes"]
        for container in [init, *spec["containers"]]:
            assert {"name": wh.WHEELS_VOLUME, "mountPath": wh.WHEELS_DIR} in container["volumeMounts"]
    env = json.loads(job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["command"][3])
    assert env["pip"] == {"packages": ["rte-offline-top>=1"], "pip_install_options": options}
    assert options[-2:] == ["--find-links", f"{wh.WHEELS_DIR}/{digest}"] and "--no-index" in options


def test_real_ray_accepts_the_offline_runtime_env():
    from ray.runtime_env import RuntimeEnv

    code_dir = str(Path(raytrain_eks.__file__).parent.parent)  # a folder holding raytrain_eks, as in the head pod
    options = wh.pip_options("0123456789abcdef")
    argv = shipping.ray_job_submit_argv(code_dir, pip=["rte-offline-top>=1"], pip_options=options)
    env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    parsed = RuntimeEnv(**env)
    assert parsed["pip"]["packages"] == ["rte-offline-top>=1"]
    assert parsed["pip"]["pip_install_options"] == options
    # Nothing to install: no pip entry at all, whatever the options.
    assert "pip" not in shipping.runtime_env(code_dir, [], options)


# --- submit --offline through the deploy fakes (test_deploy.py): Kubernetes and Ray faked, S3 and pip real ---------


@pytest.fixture
def offline_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str, pip_reads: Path) -> Any:
    from test_deploy import World, run_script

    monkeypatch.chdir(tmp_path)
    world = World(
        tmp_path,
        load_config(
            environ={}, path=None, sets=["ray.offline=true", "training.model_id=s3://team-models/Qwen2.5-1.5B"]
        ),
    )
    world.up()
    world.lines.clear()
    # The image has every job requirement in range but rich (the versions pinned here are in their ranges).
    world.ray.image = {
        shipping.requirement_name(r): r.split(">=")[1].split(",")[0] for r in shipping.job_requirements()
    }
    del world.ray.image["rich"]
    copies: list[str] = []
    answer = world.kube.exec_handler

    def handler(ns: str, pod: str, argv: list[str], stdin: str | None) -> Any:
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] == wh.IMAGE_PLATFORM:
            return run_script(argv[2], [])  # the probe itself, on this interpreter
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] == wh.copy_argv("", "")[2]:
            copies.append(pod)
            local = tmp_path / "pods" / pod / argv[4].lstrip("/")  # the pod's own /tmp
            local.parent.mkdir(parents=True, exist_ok=True)
            return run_script(argv[2], [argv[3], str(local)])  # the copy script itself, against moto
        return answer(ns, pod, argv, stdin)

    world.kube.exec_handler = handler
    world.copies = copies
    return world


def _probe_name(world: Any) -> str:
    return wh.probe_pod(world.d.cfg)["metadata"]["name"]


def _ray_objects(world: Any) -> list[dict[str, Any]]:
    return [o for o in world.kube.applied if o["kind"] in ("RayCluster", "RayJob")]


def test_submit_offline_asks_the_image_before_any_ray_object_then_installs_from_the_wheelhouse(offline_world: Any):
    world = offline_world
    probe = _probe_name(world)
    applied_at: dict[str, int] = {}
    seen_pods: list[list[str]] = []
    answer = world.kube.exec_handler

    def handler(ns: str, pod: str, argv: list[str], stdin: str | None) -> Any:
        # What exists in the cluster at the moment the image is asked.
        seen_pods.append([o["kind"] for o in world.kube.applied])
        return answer(ns, pod, argv, stdin)

    world.kube.exec_handler = handler
    assert world.submit().exit_code == 0, world.said()
    asked = [(pod, argv[2]) for _, pod, argv, _ in world.kube.exec_calls if argv[:2] == [m.IMAGE_PYTHON, "-c"]]
    # The image's platform and packages were read from the probe pod, before any Ray object was applied.
    assert (probe, wh.IMAGE_PLATFORM) in asked and (probe, shipping.IMAGE_VERSIONS) in asked
    first_ask = next(i for i, (pod, _) in enumerate(asked) if pod == probe)
    assert "RayCluster" not in seen_pods[first_ask] and "ConfigMap" not in seen_pods[first_ask]
    for i, obj in enumerate(world.kube.applied):
        applied_at.setdefault(obj["kind"], i)
    assert applied_at["Pod"] < applied_at["RayCluster"]
    # The probe pod is gone, and the state no longer lists it for `down`.
    assert ("v1", "Pod", probe, world.d.cfg.ray.namespace) in world.kube.deleted
    assert world.kube.get("v1", "Pod", probe, world.d.cfg.ray.namespace) is None
    assert not [i for i in world.store.created if i.get("kind") == "Pod"]
    # The one RayCluster applied carries the init container from the start.
    (rc,) = [o for o in _ray_objects(world)]
    (argv,) = world.ray.submitted
    pip = json.loads(argv[argv.index("--runtime-env-json") + 1])["pip"]
    assert pip["packages"] == ["rich>=15.0.0,<16"]
    folder = pip["pip_install_options"][-1]
    digest = folder.rsplit("/", 1)[1]
    assert pip["pip_install_options"] == wh.pip_options(digest)
    for template in m.pod_templates(rc):
        (init,) = template["spec"]["initContainers"]
        assert init["command"][-1] == folder
    said = world.said()
    assert "Wheelhouse for CPython" in said and _wheel_of("rich") in said and "rich-15.0.0-py3-none-any" not in said
    assert "rich-15.0.0-cp" in said and "is compiled for" in said
    # The running pods run the same copy (a no-op where the init container did it; this fake runs no init
    # containers, so here it copies).
    assert sorted(world.copies) == [
        "ray-train-gpu-workers-worker-0",
        "ray-train-gpu-workers-worker-1",
        "ray-train-head-0",
    ]
    storage = apply_bucket(world)
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=storage)["Contents"]]
    assert f"runs/{wh.STORAGE_FOLDER}/{digest}/{wh.MANIFEST}" in keys


def apply_bucket(world: Any) -> str:
    from raytrain_eks.k8s.state import apply_state

    path = apply_state(world.d.cfg, world.store).training.storage_path
    return str(path).removeprefix("s3://").split("/", 1)[0]


def test_a_job_requirement_without_a_wheel_stops_submit_before_any_ray_object_and_removes_the_probe(
    offline_world: Any,
):
    world = offline_world
    lacking = shipping.requirement_name(next(r for r in shipping.job_requirements() if not r.startswith("rich")))
    del world.ray.image[lacking]  # the local index has no such project: no wheel for the image
    with pytest.raises(wh.NoWheel) as err:
        world.submit()
    assert lacking in err.value.message and "no Ray object applied" in err.value.message
    assert not _ray_objects(world)
    assert not [o for o in world.kube.applied if o["kind"] in ("ConfigMap", "Secret")]
    probe = _probe_name(world)
    assert world.kube.get("v1", "Pod", probe, world.d.cfg.ray.namespace) is None
    assert not [i for i in world.store.created if i.get("kind") == "Pod"]


def test_a_probe_pod_that_cannot_start_is_one_message_with_its_events_and_is_deleted(offline_world: Any):
    world = offline_world
    world.kube.image_pull_error = PULL_NO_CREDENTIALS
    with pytest.raises(wh.UserError) as err:
        world.submit()
    assert "did not run within" in err.value.message and "no basic auth credentials" in err.value.message
    assert err.value.hint and "ImagePullBackOff" in err.value.hint
    assert not _ray_objects(world)
    assert world.kube.get("v1", "Pod", _probe_name(world), world.d.cfg.ray.namespace) is None
    assert world.kube.time >= world.d.cfg.ray.job_start_deadline_s  # it waited: kubelet tries again, it may pass
    # An image the registry does not have is told at once, with the registry's answer.
    world.kube.image_pull_error = PULL_NOT_FOUND
    started = world.kube.time
    with pytest.raises(wh.UserError) as err:
        world.submit()
    assert "will not start: the registry has no such image" in err.value.message
    assert "code = NotFound" in err.value.message and world.kube.time - started < 60
    assert not _ray_objects(world)
    assert world.kube.get("v1", "Pod", _probe_name(world), world.d.cfg.ray.namespace) is None
    # A probe whose process ends (an image without python3) is told at once, not after the deadline.
    world.kube.image_pull_error = None
    world.kube.exiting.add((world.d.cfg.ray.namespace, _probe_name(world)))
    started = world.kube.time
    with pytest.raises(wh.UserError) as err:
        world.submit()
    assert "ended Failed instead of waiting" in err.value.message and "exited with status 1" in err.value.message
    assert world.kube.time - started < 60
    assert not _ray_objects(world)
    assert world.kube.get("v1", "Pod", _probe_name(world), world.d.cfg.ray.namespace) is None


def test_submit_offline_rayjob_asks_through_a_probe_pod_and_then_from_what_it_remembered(offline_world: Any):
    world = offline_world
    probe = _probe_name(world)
    assert world.submit(mode="rayjob").exit_code == 0, world.said()
    (job,) = [o for o in _ray_objects(world) if o["kind"] == "RayJob"]
    assert any(pod == probe for _, pod, _, _ in world.kube.exec_calls)
    env = json.loads(job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["command"][3])
    assert env["pip"]["packages"] == ["rich>=15.0.0,<16"]
    digest = env["pip"]["pip_install_options"][-1].rsplit("/", 1)[1]
    for template in m.pod_templates(job):
        (init,) = template["spec"]["initContainers"]
        assert init["command"] == wh.copy_argv(init["command"][3], digest)
    # A second submit of the same image needs no pod: what the first read is remembered.
    calls = len(world.kube.exec_calls)
    world.kube.applied.clear()
    assert world.submit(mode="rayjob").exit_code == 0, world.said()
    assert not [c for c in world.kube.exec_calls[calls:] if c[1] == probe]
    assert not [o for o in world.kube.applied if o["kind"] == "Pod"]
    assert "as an earlier submit read it" in world.said()


def test_the_probe_pod_is_a_valid_pod_placed_as_the_workers_and_asks_for_no_gpu(cfg_for):
    cfg = cfg_for(NAMESPACE="train")
    pod = wh.probe_pod(cfg)
    kubernetes_validate.validate(pod, "1.33", strict=True)
    worker = m.pod_templates(m.raycluster(cfg))[1]["spec"]
    assert pod["spec"].get("nodeSelector") == worker.get("nodeSelector")
    assert pod["spec"]["tolerations"] == worker["tolerations"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == cfg.ray.image
    for resource in (m.GPU_RESOURCE, m.EFA_RESOURCE):
        assert resource not in container["resources"]["requests"] and resource not in container["resources"]["limits"]
    assert pod["spec"]["activeDeadlineSeconds"] == wh.PROBE_LIFETIME_S and pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["namespace"] == cfg.ray.namespace
    # Its process waits, and leaves at once on SIGTERM (what deleting the pod sends).
    proc = subprocess.Popen([sys.executable, *container["command"][1:]])
    try:
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()


def test_submit_offline_on_a_shared_volume_writes_the_wheels_through_the_probe_pod_and_needs_no_init_container(
    tmp_path: Path, real_tools: Any, pip_reads: Path, monkeypatch: pytest.MonkeyPatch
):
    from test_deploy import run_script
    from test_kubernetes_target import GPU_LABELS, GPU_TAINT, Cluster, _claim

    from raytrain_eks.deploy import submit as sub

    monkeypatch.chdir(tmp_path)
    sets = (
        "cluster.gpu_node_selector={pool: gpu}",
        "ray.shared_volume=checkpoints",
        "ray.offline=true",
        "training.model_id=/mnt/shared/models/Qwen2.5-1.5B",
    )
    c = Cluster(tmp_path, real_tools, *sets, storage=None)
    c.kube.add_node("cpu-0", labels={"pool": "general"}, allocatable={"cpu": "7910m", "memory": "29Gi"})
    for i in range(2):
        c.kube.add_node(
            f"gpu-{i}", labels=GPU_LABELS, allocatable={"cpu": "11", "memory": "80Gi"}, taints=[GPU_TAINT],
            devices={m.GPU_RESOURCE: "4"},
        )  # fmt: skip
    _claim(c, ["ReadWriteMany"])
    c.target.up(c.d(), confirm=c.ask())
    c.ray.image = {shipping.requirement_name(r): r.split(">=")[1].split(",")[0] for r in shipping.job_requirements()}
    del c.ray.image["rich"]
    volume = tmp_path / "volume"  # the claim's file system, as every pod that mounts it sees it
    volume.mkdir()
    probe = wh.probe_pod(c.d().cfg)["metadata"]["name"]
    written_by: set[str] = set()

    def handler(ns: str, pod: str, argv: list[str], stdin: str | None) -> Any:
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] == wh.IMAGE_PLATFORM:
            return run_script(argv[2], [])
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] in (wh._HAVE, wh._PUT_PIECE, wh._SEAL):
            written_by.add(pod)
            return run_script(argv[2], [a.replace("/mnt/shared", str(volume)) for a in argv[3:]], stdin)
        return c.ray(ns, pod, argv, stdin)

    c.kube.exec_handler = handler
    assert sub.submit(c.d()).exit_code == 0, c.said()
    assert written_by == {probe}
    (pod,) = [o for o in c.kube.applied if o["kind"] == "Pod"]
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert {"name": m.SHARED_VOLUME, "persistentVolumeClaim": {"claimName": "checkpoints"}} in pod["spec"]["volumes"]
    (cluster,) = [o for o in c.kube.applied if o["kind"] == "RayCluster"]
    for template in m.pod_templates(cluster):
        assert "initContainers" not in template["spec"]
    (argv,) = c.ray.submitted
    pip = json.loads(argv[argv.index("--runtime-env-json") + 1])["pip"]
    assert pip["packages"] == ["rich>=15.0.0,<16"]
    folder = pip["pip_install_options"][-1]
    assert folder.startswith(f"/mnt/shared/runs/{wh.STORAGE_FOLDER}/")
    local = volume / folder.removeprefix("/mnt/shared/")
    assert sorted(p.name for p in local.iterdir()) == sorted([wh.MANIFEST, _wheel_of("rich")])
    assert not [i for i in c.store.created if i.get("kind") == "Pod"]
    assert "on the shared volume" in c.said()


# --- pure-Python packages the image lacks: unpacked in py_modules, no pip ----------------------------------------


def test_a_pure_python_wheel_unpacks_as_site_packages_and_a_compiled_one_is_refused(
    pip_reads: Path, here: wh.ImagePython, tmp_path: Path
):
    house = wh.build_wheelhouse(["tensorboardX>=2.6.5,<3"], here, tmp_path / "pure", installed=_image_has([]))
    shipped = wh.unpack_pure(house)
    assert isinstance(shipped, wh.Unpacked), shipped
    # The package and its dependency the image lacks, each beside its .dist-info (what importlib.metadata reads).
    assert shipped.top_level == (
        "rte_offline_dep",
        "rte_offline_dep-1.4.0.dist-info",
        "tensorboardX",
        "tensorboardx-2.6.5.dist-info",
    )
    assert shipped.files["tensorboardX/__init__.py"] == b"WHO = 'tensorboardX 2.6.5'\n"
    assert shipped.digest == house.digest and shipped.wheels == tuple(w.name for w in house.wheels)
    compiled = wh.build_wheelhouse(["rich>=15"], here, tmp_path / "compiled", installed=_image_has([]))
    why = wh.unpack_pure(compiled)
    assert isinstance(why, str) and why.startswith(f"{_wheel_of('rich')} is compiled for cp")


def _image_lacking(world: Any, name: str) -> None:
    """The stand-in image has every job requirement at the oldest release in its range, but ``name``."""
    world.ray.image = {
        shipping.requirement_name(r): r.split(">=")[1].split(",")[0] for r in shipping.job_requirements()
    }
    del world.ray.image[name]


@pytest.fixture
def online_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str, pip_reads: Path) -> Any:
    """test_deploy's world, submitting without --offline; the head pod's and the probe pod's python3 is this one."""
    from test_deploy import World, run_script

    monkeypatch.chdir(tmp_path)
    world = World(tmp_path, load_config(environ={}, path=None))
    world.up()
    world.lines.clear()
    answer = world.kube.exec_handler

    def handler(ns: str, pod: str, argv: list[str], stdin: str | None) -> Any:
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] == wh.IMAGE_PLATFORM:
            return run_script(argv[2], [])
        return answer(ns, pod, argv, stdin)

    world.kube.exec_handler = handler
    return world


def _runtime_env(world: Any) -> dict[str, Any]:
    (argv,) = world.ray.submitted
    return json.loads(argv[argv.index("--runtime-env-json") + 1])


def test_on_the_dlcs_packages_submit_ships_peft_unpacked_into_the_head_pod_and_the_runtime_env_has_no_pip(
    online_world: Any,
):
    world = online_world
    world.ray.image = dict(shipping.known_image_packages(DLC)[0])  # the DLC's build lock, as its python3 reports it
    assert world.submit().exit_code == 0, world.said()
    env = _runtime_env(world)
    assert "pip" not in env, "Ray's pip plugin would copy the image's virtualenv on every node"
    code, *modules = env["py_modules"]
    assert code.startswith(shipping.HEAD_CODE_ROOT) and code.endswith("/raytrain_eks")
    folder = modules[0].rsplit("/", 1)[0]
    assert folder.startswith(f"{shipping.HEAD_CODE_ROOT}/packages-")
    # peft alone: each of its dependencies (torch, transformers, accelerate...) is in the DLC in range.
    assert modules == [f"{folder}/peft", f"{folder}/peft-0.21.2.dist-info"]
    # It really arrived in the head pod, by the package's own unpack script.
    head = world.ray.tmp / "head" / folder.lstrip("/")
    assert (head / "peft" / "__init__.py").read_text() == "WHO = 'peft 0.21.2'\n"
    assert (head / "peft-0.21.2.dist-info" / "METADATA").is_file()
    said = world.said()
    assert "The image has 9 of the job's 10 packages in range" in said
    assert "peft>=0.21.2,<0.22 travels unpacked beside the package" in said and "no pip" in said
    assert "peft-0.21.2-py3-none-any.whl" in said and "Wheelhouse for CPython" in said
    # A second submit to the same head pod finds them there and copies nothing.
    unpacks = [c for c in world.kube.exec_calls if c[2][:3] == [m.IMAGE_PYTHON, "-c", shipping._UNPACK]]
    assert len(unpacks) == 2  # the package, then the packages
    world.ray.submitted.clear()
    assert world.submit().exit_code == 0, world.said()
    assert _runtime_env(world)["py_modules"] == env["py_modules"]
    assert [c for c in world.kube.exec_calls if c[2][:3] == [m.IMAGE_PYTHON, "-c", shipping._UNPACK]] == unpacks


def test_a_compiled_package_the_image_lacks_is_left_to_pip_saying_why(online_world: Any):
    world = online_world
    _image_lacking(world, "rich")
    assert world.submit().exit_code == 0, world.said()
    env = _runtime_env(world)
    assert env["pip"] == ["rich>=15.0.0,<16"] and len(env["py_modules"]) == 1
    assert (
        f"pip installs rich>=15.0.0,<16 (Ray first copies the image's Python on every node): {_wheel_of('rich')}"
        in (world.said())
    )


def test_submit_rayjob_ships_the_packages_in_a_config_map_the_submitter_unpacks(online_world: Any):
    world = online_world
    _image_lacking(world, "tensorboardX")
    assert world.submit(mode="rayjob").exit_code == 0, world.said()
    probe = _probe_name(world)
    assert any(pod == probe for _, pod, _, _ in world.kube.exec_calls), "asked before the RayJob existed"
    (job,) = [o for o in _ray_objects(world) if o["kind"] == "RayJob"]
    jsonschema.Draft7Validator(json.loads((SCHEMAS / "rayjob.v1.schema.json").read_text())).validate(
        {k: v for k, v in job.items() if k != "status"}
    )
    pod = job["spec"]["submitterPodTemplate"]["spec"]
    (container,) = pod["containers"]
    env = json.loads(container["command"][3])
    assert "pip" not in env and yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == env
    assert env["py_modules"][1:] == [
        f"{shipping.SUBMITTER_PACKAGES_DIR}/{n}"
        for n in ("rte_offline_dep", "rte_offline_dep-1.4.0.dist-info", "tensorboardX", "tensorboardx-2.6.5.dist-info")
    ]
    assert container["command"][-2:] == [
        f"{shipping.SUBMITTER_PACKAGES_ARCHIVE_DIR}/{shipping.PACKAGES_KEY}",
        shipping.SUBMITTER_PACKAGES_DIR,
    ]
    packages = next(o for o in world.kube.applied if o["metadata"]["name"] == "ray-train-packages")
    assert list(packages["binaryData"]) == [shipping.PACKAGES_KEY]
    mount = {"name": "raytrain-eks-packages", "mountPath": shipping.SUBMITTER_PACKAGES_ARCHIVE_DIR, "readOnly": True}
    assert mount in container["volumeMounts"]
    assert {"name": "raytrain-eks-packages", "configMap": {"name": "ray-train-packages", "items": [
        {"key": shipping.PACKAGES_KEY, "path": shipping.PACKAGES_KEY}]}} in pod["volumes"]  # fmt: skip
    kubernetes_validate.validate(packages, "1.33", strict=True)
    assert shipping.config_map_bytes(packages) < shipping.CONFIG_MAP_MAX_BYTES


def test_submit_offline_ships_a_pure_package_with_no_wheelhouse_and_no_init_container(offline_world: Any):
    world = offline_world
    world.ray.image["rich"] = "15.0.0"
    del world.ray.image["tensorboardX"]
    assert world.submit().exit_code == 0, world.said()
    env = _runtime_env(world)
    assert "pip" not in env and env["py_modules"][-1].endswith("/tensorboardx-2.6.5.dist-info")
    (rc,) = _ray_objects(world)
    assert all("initContainers" not in t["spec"] for t in m.pod_templates(rc))
    assert world.copies == []
    storage = apply_bucket(world)
    listed = boto3.client("s3").list_objects_v2(Bucket=storage).get("Contents", [])
    assert not [o for o in listed if wh.STORAGE_FOLDER in o["Key"]], "no wheelhouse uploaded"
