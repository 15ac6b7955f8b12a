"""What a training job ships to the cluster and the commands that start it: shared by ``submit`` (which runs them)
and ``plan`` (which writes them down), so the two can never differ.

The package reaches the cluster image as Ray ``runtime_env`` ``py_modules`` (the image has no copy of it): in
``--mode raycluster`` unpacked into the head pod from a base64 tar.gz on an exec's stdin, in ``--mode rayjob`` as
the same tar.gz in a ConfigMap (``binaryData``) mounted into the RayJob's submitter pod, which unpacks it before
``ray job submit``. What the image lacks travels the same way when it can (:class:`~raytrain_eks.k8s.wheelhouse.
Unpacked`: pure-Python wheels unpacked, one more archive, more ``py_modules`` entries); else ``pip`` installs it,
which makes Ray copy the image's whole virtualenv on every node first (``ray/_private/runtime_env/pip.py``).
Example::

    argv = ray_job_submit_argv(head_code_dir(package_files()))   # what runs in the head pod
    doc = rayjob_manifest(cfg, hf_token=False, code_map=code_map, items=items)
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.metadata
import io
import json
import re
import tarfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import raytrain_eks
from raytrain_eks.config import FLASH_ATTN_MIN, Config, TrainingConfig
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.wheelhouse import Unpacked

DIST_NAME = "raytrain-eks"
# Already in the cluster image (Ray 2.58 with Ray Train/Data, PyTorch): installing another copy would shadow the
# versions the image was built and tested with. pyarrow comes with Ray Data. kubernetes, boto3 and packaging are for
# the deploy side only.
IMAGE_PROVIDED = frozenset({"torch", "torchvision", "ray", "pyarrow"})
DEPLOY_ONLY = frozenset({"kubernetes", "boto3", "packaging"})
# Needed here, not on the cluster: matplotlib draws the report's plots. Its wheels are compiled (for each Python and
# platform) and pull four more the DLC lacks (contourpy, kiwisolver and fonttools, compiled too, and cycler): a
# run on an image without it writes its metrics and no report (train/launch.py says so), and `raytrain-eks results`
# draws the report here from the fetched metrics; an image that has matplotlib gets its report as before. py-spy
# reads a hung rank's stack for the watchdog: a compiled program, not a module py_modules can carry; on a node
# without it the watchdog names the rank from its process state and last step, and its stack file says py-spy is
# missing (train/watchdog.py).
LOCAL_ONLY = frozenset({"matplotlib", "py-spy"})
# What the job does without each of them, for plan's words.
WITHOUT_LOCAL_ONLY = {
    "matplotlib": "the run writes its metrics and no report, and `raytrain-eks results` draws the report here",
    "py-spy": "the watchdog names a hung rank without its stack",
}
# At most this many requirements the image lacks are tried as unpacked wheels when no --offline wheelhouse is built
# anyway: a few are what an image made for the job lacks (the DLC: peft); an image lacking more is a plain Ray image,
# whose missing packages include compiled ones (tokenizers, safetensors, pydantic-core), so pip installs them all.
MAX_SHIPPED = 4

DASHBOARD = f"http://127.0.0.1:{m.HEAD_PORTS['dashboard']}"
# What KubeRay's RayJob controller gives the submitter container (configureSubmitterContainer in
# ray-operator/controllers/ray/rayjob_controller.go, v1.7.0): the head service's dashboard address, without a scheme,
# and the Ray job id it chose for the RayJob (status.jobId).
SUBMITTER_CONTAINER = "ray-job-submitter"  # utils.SubmitterContainerName
SUBMITTER_ADDRESS_ENV = "RAY_DASHBOARD_ADDRESS"
SUBMITTER_JOB_ID_ENV = "RAY_JOB_SUBMISSION_ID"
DASHBOARD_HEALTH_PATH = "api/gcs_healthz"  # utils.RayDashboardGCSHealthPath
HEAD_CODE_ROOT = "/tmp/raytrain-eks"  # where the package is unpacked in the head pod (raycluster mode)
SUBMITTER_ARCHIVE_DIR = "/opt/raytrain-eks"  # where the code ConfigMap is mounted (read-only) in the submitter pod
ARCHIVE_KEY = "raytrain_eks.tar.gz"  # the ConfigMap's one key: the package_archive bytes
SUBMITTER_CODE_DIR = "/tmp/raytrain-eks-code"  # where the submitter pod unpacks it; py_modules points there
# The packages shipped unpacked (raycluster: a folder per wheelhouse digest in the head pod; rayjob: a second
# ConfigMap, mounted and unpacked in the submitter pod as the package is).
PACKAGES_KEY = "packages.tar.gz"
SUBMITTER_PACKAGES_ARCHIVE_DIR = "/opt/raytrain-eks-packages"
SUBMITTER_PACKAGES_DIR = "/tmp/raytrain-eks-packages"

# Unpacks the tar.gz bytes ``data`` into ``dest``; only regular files and folders inside ``dest`` are written.
_EXTRACT = """\
import base64, io, os, sys, tarfile
def extract(data, dest):
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            target = os.path.realpath(os.path.join(dest, member.name))
            if not target.startswith(os.path.realpath(dest) + os.sep) or not (member.isfile() or member.isdir()):
                raise SystemExit(f"refusing to unpack {member.name}")
        os.makedirs(dest, exist_ok=True)
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    print("unpacked", dest, flush=True)
"""

# Runs in the head pod: unpack the base64 tar.gz read from stdin into argv[1].
_UNPACK = _EXTRACT + "extract(base64.b64decode(sys.stdin.read()), sys.argv[1])\n"

# The submitter pod's first step (argv: runtime_env, entrypoint, then pairs of a mounted archive and where to unpack
# it): the package, and the packages shipped beside it, out of the read-only mounts into folders ``ray job submit``
# ships from. Runs alone too (the tests do).
_SUBMITTER_UNPACK = (
    _EXTRACT
    + """\
for path, dest in zip(sys.argv[3::2], sys.argv[4::2]):
    with open(path, "rb") as archive:
        extract(archive.read(), dest)
"""
)

# The command of a RayJob's submitter pod (argv: the runtime_env as JSON, the entrypoint, the mounted archive, the
# folder to unpack it into), after _SUBMITTER_UNPACK. KubeRay's default command
# (BuildJobSubmitCommand in ray-operator/controllers/ray/common/job.go, v1.7.0) waits for the dashboard with a bare
# `python -c ...`, an interpreter the image does not promise; this one runs the same steps under python3, calling
# no shell: wait until the dashboard's GCS health check answers "success" (every 2 s, 10 s per try), submit the job
# under the RayJob's job id unless `ray job status` knows it already (a retried submitter must not submit twice),
# then follow its logs; the exit status is that of `ray job logs`, as with KubeRay's. It reads SUBMITTER_ADDRESS_ENV,
# SUBMITTER_JOB_ID_ENV and DASHBOARD_HEALTH_PATH.
_SUBMITTER = (
    _SUBMITTER_UNPACK
    + """\
import shlex, subprocess, time, urllib.request
runtime_env, entrypoint = sys.argv[1], sys.argv[2]
address = os.environ["RAY_DASHBOARD_ADDRESS"]
address = address if address.startswith("http://") else "http://" + address
job_id = os.environ["RAY_JOB_SUBMISSION_ID"]
while True:
    try:
        with urllib.request.urlopen(address + "/api/gcs_healthz", timeout=10) as answer:
            if b"success" in answer.read():
                break
    except Exception:
        pass
    print("Waiting for Ray Dashboard GCS to become healthy at " + address + " ...", flush=True)
    time.sleep(2)
quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
if subprocess.run(["ray", "job", "status", "--address", address, job_id], **quiet).returncode != 0:
    submit = ["ray", "job", "submit", "--address", address, "--no-wait", "--runtime-env-json", runtime_env]
    code = subprocess.run([*submit, "--submission-id", job_id, "--", *shlex.split(entrypoint)]).returncode
    if code != 0:
        sys.exit(code)
sys.exit(subprocess.run(["ray", "job", "logs", "--address", address, "--follow", job_id]).returncode)
"""
)


def submitter_argv(entrypoint: str, runtime_env_json: str, *, packages: bool = False) -> list[str]:
    """The submitter container's command: :data:`_SUBMITTER` under ``python3`` with the RayJob's runtime_env (JSON,
    as KubeRay converts ``runtimeEnvYAML``), entrypoint (one string, split as the shell splits it for KubeRay), the
    mounted package archive and :data:`SUBMITTER_CODE_DIR`, where it unpacks the archive first; with ``packages``,
    then the mounted packages archive and :data:`SUBMITTER_PACKAGES_DIR`."""
    archive = f"{SUBMITTER_ARCHIVE_DIR}/{ARCHIVE_KEY}"
    argv = [m.IMAGE_PYTHON, "-c", _SUBMITTER, runtime_env_json, entrypoint, archive, SUBMITTER_CODE_DIR]
    if packages:
        argv += [f"{SUBMITTER_PACKAGES_ARCHIVE_DIR}/{PACKAGES_KEY}", SUBMITTER_PACKAGES_DIR]
    return argv


def submitter_unpack_argv(argv: list[str]) -> list[str]:
    """The first step of a submitter command (:func:`submitter_argv`) alone: unpack the archive, submit nothing."""
    return [argv[0], "-c", _SUBMITTER_UNPACK, *argv[3:]]


def image_missing_requirements(extras: Collection[str] = ()) -> list[str]:
    """This package's pinned dependencies (and those of its ``extras``, such as ``eval``) minus what the cluster image
    already has, as pip requirement lines.

    Example (reference): ``["transformers==5.23.0", "tokenizers==0.23.3", ..., "rich==15.0.0"]``.
    """
    try:
        requires = importlib.metadata.requires(DIST_NAME) or []
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            f"the {DIST_NAME} distribution metadata is missing",
            hint="Install raytrain-eks (pip install -e .) so that submit knows its pinned dependencies.",
        ) from None
    out = []
    for line in requires:
        spec, _, marker = line.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)""", marker)
        if "extra" in marker and (extra is None or extra.group(1) not in extras):
            continue
        name = re.match(r"\s*([A-Za-z0-9._-]+)", spec)
        if name is None or name.group(1).lower().replace("_", "-") in IMAGE_PROVIDED | DEPLOY_ONLY | LOCAL_ONLY:
            continue
        out.append(spec.replace(" ", ""))
    return out


# Older releases the job is also checked with, so that an image holding them needs nothing installed: AWS's Ray
# Train DLC ships transformers 5.13.0 (with tokenizers 0.22.2), datasets 5.0.0, pydantic 2.13.4 and typer 0.26.8
# (its build lock: :func:`known_image_packages`). `scripts/check_oldest.sh` runs the training and command-line tests
# against exactly these (every other package as pinned); the suite runs the pinned ones.
OLDEST_CHECKED: dict[str, str] = {
    "transformers": "5.13.0",
    "tokenizers": "0.22.2",
    "datasets": "5.0.0",
    "pydantic": "2.13.4",
    "typer": "0.26.8",
}


def _range(version: str, oldest: str | None = None) -> str:
    """The versions of a dependency the job takes on the cluster: from the one pinned (and tested) here, or the
    older ``oldest`` also checked, up to the pinned one's next major (next minor for a 0.x version), so a copy the
    image has in that range is used as it is. Example: ``_range("5.23.0") == ">=5.23.0,<6"``,
    ``_range("0.23.3", "0.22.2") == ">=0.22.2,<0.24"``."""
    parts = [int(x) if x.isdigit() else 0 for x in version.split(".")[:2]] + [0]
    upper = f"{parts[0] + 1}" if parts[0] else f"0.{parts[1] + 1}"
    return f">={oldest or version},<{upper}"


def job_extras(training: TrainingConfig) -> tuple[str, ...]:
    """The extras of this package a job of ``training`` needs on the cluster: ``eval`` (lm-eval) when it scores
    ``training.eval_tasks`` after its export."""
    return ("eval",) if training.eval_tasks else ()


def job_requirements(extras: Collection[str] = ()) -> list[str]:
    """What the job needs on the cluster beyond the image's Ray and PyTorch (with this package's ``extras``: see
    :func:`job_extras`), as ranges (:func:`_range`) of the pinned versions (:data:`LOCAL_ONLY` left out).

    Example (reference): ``["transformers>=5.13.0,<6", "tokenizers>=0.22.2,<0.24", "safetensors>=0.8.0,<0.9", ...]``.
    """
    out = []
    for spec in image_missing_requirements(extras):
        name, _, version = spec.partition("==")
        oldest = OLDEST_CHECKED.get(name.lower())
        out.append(f"{name}{_range(version, oldest)}" if version and "," not in version else spec)
    return out


# Run in the head pod (the image's python3): the installed version of each distribution named in argv, or null.
IMAGE_VERSIONS = """import importlib.metadata as md, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        found[name] = None
print(json.dumps(found))
"""


def requirement_name(spec: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9._-]+)", spec)
    return match.group(1) if match else spec


def left_to_install(requirements: list[str], installed: Mapping[str, str | None]) -> list[str]:
    """The ``requirements`` the image does not meet: not installed, or at a version outside the range."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    out = []
    for spec in requirements:
        name = requirement_name(spec)
        have = installed.get(name)
        try:
            usable = have is not None and SpecifierSet(spec[len(name) :]).contains(have, prereleases=True)
        except InvalidVersion:
            usable = False
        if not usable:
            out.append(spec)
    return out


def what_the_image_has(wanted: list[str], installed: Mapping[str, str | None]) -> tuple[list[str], str]:
    """:func:`left_to_install` of ``wanted`` (``installed``: by each requirement's name), and a sentence saying
    which of them the image has in range: ``"The image has 2 of the job's 11 packages in range (PyYAML 6.0.3,
    rich 15.1.0)"``."""
    left = left_to_install(wanted, installed)
    kept = [f"{requirement_name(r)} {installed[requirement_name(r)]}" for r in wanted if r not in left]
    said = f"The image has {len(kept)} of the job's {len(wanted)} packages in range"
    return left, said + (f" ({', '.join(kept)})" if kept else "")


IMAGE_PACKAGES_FILE = Path(__file__).resolve().parents[1] / "resources" / "image_packages.json"


def known_image_packages(image: str) -> tuple[dict[str, str], str] | None:
    """The Python packages ``image`` holds, by name, as this tool knows them without asking the image, and where
    that comes from in words; ``None`` for an image it does not know (a floating tag such as ``train-ml-cuda`` is
    not known: it may move). The AWS Ray Train DLC's pinned tags are (``resources/image_packages.json``: its build
    lock)."""
    table = json.loads(IMAGE_PACKAGES_FILE.read_text())
    if image not in table["images"]:
        return None
    src = table["source"]
    repo = src["repository"].removeprefix("https://github.com/")
    return dict(table["packages"]), f"its build lock, {repo}@{src['commit'][:8]} {src['files'][0]}"


def image_has_flash_attn(image: str) -> bool:
    """Whether ``image`` is known (:func:`known_image_packages`) to ship flash-attn 2 at a version the job can use:
    there ``training.attention: auto`` will choose flash-attention for a model that has it, in bf16. ``False`` for an
    image this tool does not know. Example: the default image (AWS's Ray Train DLC, flash-attn 2.8.3) is ``True``."""
    from packaging.version import InvalidVersion, Version

    known = known_image_packages(image)
    version = known[0].get("flash-attn") if known else None
    try:
        return version is not None and Version(FLASH_ATTN_MIN) <= Version(version) < Version("3")
    except InvalidVersion:
        return False


def planned_installs(image: str) -> tuple[list[str], str] | None:
    """What the job's runtime_env will install on ``image`` (:func:`job_requirements` the image lacks in range) and
    a sentence saying what the image has and how that is known; ``None`` for an image this tool does not know,
    where ``submit`` learns it by asking the image. Example (the default image):
    ``(["peft>=0.21.2,<0.22"], "The image has 9 of the job's 10 packages in range (...)")``.
    """
    known = known_image_packages(image)
    if known is None:
        return None
    from packaging.utils import canonicalize_name  # PEP 503: PyYAML and pyyaml are one distribution

    packages, source = known
    by_name = {canonicalize_name(name): version for name, version in packages.items()}
    wanted = job_requirements()
    left, said = what_the_image_has(
        wanted, {requirement_name(r): by_name.get(canonicalize_name(requirement_name(r))) for r in wanted}
    )
    return left, f"{said}, by {source}"


def expected_not_shipped(image: str, left: list[str]) -> str | None:
    """Why ``left`` (what the known ``image`` lacks, :func:`planned_installs`) would not all travel unpacked in
    py_modules, or ``None`` when they would, judged without downloading: from the copies installed here (this
    package pins the releases the job takes) and the image's package table. Each must be pure Python (its ``WHEEL``
    says so) with every dependency in the image in range, or travelling too. ``submit`` decides on the wheels it
    downloads for the image's Python; this is the plan's expectation. Example: ``expected_not_shipped(DLC, ["peft>=
    0.21.2,<0.22"]) is None`` (peft's wheel is py3-none-any; accelerate, torch, transformers... are in the DLC)."""
    import email.parser

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    if len(left) > MAX_SHIPPED:
        return f"{len(left)} packages, more than the {MAX_SHIPPED} that are tried as unpacked wheels"
    known = known_image_packages(image)
    has = {canonicalize_name(n): v for n, v in (known[0] if known else {}).items()}
    todo, seen = [Requirement(r) for r in left], set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            return f"{req.name} is not installed here to look at"
        wheel = email.parser.Parser().parsestr(dist.read_text("WHEEL") or "")
        tags = wheel.get_all("Tag") or ["no tag"]
        if str(wheel.get("Root-Is-Purelib", "")).lower() != "true" or any(not t.endswith("-none-any") for t in tags):
            return f"{req.name} {dist.version} is compiled ({tags[0]})"
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is not None and not dep.marker.evaluate({"extra": ""}):
                continue
            version = has.get(canonicalize_name(dep.name))
            if version is None or not dep.specifier.contains(version, prereleases=True):
                todo.append(dep)
    return None


def package_files(root: Path | None = None) -> dict[str, str]:
    """Relative path -> text of every source and data file of the ``raytrain_eks`` package (no caches)."""
    base = Path(root) if root is not None else Path(raytrain_eks.__file__).parent
    files = {}
    for path in sorted(base.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".jsonl", ".json", ".yaml"):
            files[f"raytrain_eks/{path.relative_to(base).as_posix()}"] = path.read_text(encoding="utf-8")
    return files


def package_digest(files: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return h.hexdigest()[:12]


def package_archive(files: Mapping[str, str]) -> str:
    """The files as a base64 tar.gz (text, to travel on an exec's stdin). Deterministic for the same files."""
    return archive({name: text.encode("utf-8") for name, text in files.items()})


def archive(files: Mapping[str, bytes]) -> str:
    """:func:`package_archive` of files given as bytes (the unpacked wheels of :func:`packages_archive`)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(files):
            data = files[name]
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    # gzip's header holds a time stamp: 0, so that the same files give the same text (a written plan matches).
    return base64.b64encode(gzip.compress(buf.getvalue(), compresslevel=9, mtime=0)).decode("ascii")


def runtime_env(
    code_dir: str,
    pip: list[str] | None = None,
    pip_options: list[str] | None = None,
    modules: Sequence[str] = (),
    env_vars: Mapping[str, str] | None = None,
) -> dict[str, object]:
    """The job's Ray ``runtime_env``: pip installs ``pip`` (default: all of :func:`job_requirements`; ``submit``
    leaves out what the image has in range, and what travels in ``modules``), ``py_modules`` ships ``raytrain_eks``
    from ``code_dir`` (a path where ``ray job submit`` runs) and then ``modules`` (:func:`shipped_modules`).
    ``pip_options`` (``submit --offline``: the local wheelhouse, no index) go to ``pip install`` in Ray's dict form.
    ``env_vars`` are set for the job's driver and workers. No secret is ever put here.
    Example: ``runtime_env("/c", [], modules=["/p/peft", "/p/peft-0.21.2.dist-info"])
    == {"py_modules": ["/c/raytrain_eks", "/p/peft", "/p/peft-0.21.2.dist-info"]}``."""
    env: dict[str, object] = {"py_modules": [f"{code_dir}/raytrain_eks", *modules]}
    if env_vars:
        env["env_vars"] = dict(env_vars)
    packages = job_requirements() if pip is None else pip
    if packages and pip_options:
        return {"pip": {"packages": packages, "pip_install_options": list(pip_options)}, **env}
    return {"pip": packages, **env} if packages else env


def shipped_modules(folder: str, packages: Unpacked) -> list[str]:
    """The py_modules entries of ``packages`` unpacked in ``folder`` (where ``ray job submit`` runs): one per top-level
    folder or module. Example: ``["/tmp/raytrain-eks/packages-3f2a9c1d0b7e4a11/peft", ".../peft-0.21.2.dist-info"]``."""
    return [f"{folder}/{top}" for top in packages.top_level]


def head_packages_dir(packages: Unpacked) -> str:
    """Where ``--mode raycluster`` unpacks ``packages`` in the head pod: one folder per wheelhouse."""
    return f"{HEAD_CODE_ROOT}/packages-{packages.digest}"


def packages_archive(packages: Unpacked) -> str:
    """The unpacked wheels as a base64 tar.gz (:func:`archive`), for :func:`unpack_argv` or a ConfigMap."""
    return archive(packages.files)


CONFIG_MAP_MAX_BYTES = 1 << 20  # Kubernetes rejects a ConfigMap whose data exceeds 1 MiB


def code_config_map(cfg: Config, files: Mapping[str, str]) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The package as a ConfigMap (for a RayJob's submitter pod): one ``binaryData`` key, :data:`ARCHIVE_KEY`, the
    :func:`package_archive` tar.gz (a quarter of the sources' size), and the volume ``items`` that mount it as that
    file. The submitter unpacks it (:func:`submitter_argv`)."""
    doc, size = _archive_config_map(cfg, "code", ARCHIVE_KEY, package_archive(files))
    if size > CONFIG_MAP_MAX_BYTES:
        largest = sorted(files, key=lambda p: len(files[p].encode("utf-8")), reverse=True)[:3]
        sizes = ", ".join(f"{p} ({len(files[p].encode('utf-8')):,} bytes)" for p in largest)
        raise UserError(
            f"the raytrain_eks package ({len(files)} files, compressed) makes ConfigMap {_where(doc)} {size:,} "
            f"bytes; Kubernetes accepts at most {CONFIG_MAP_MAX_BYTES:,}. Largest files: {sizes}",
            hint="Submit with --mode raycluster (it copies the package into the head pod instead), "
            "or move large data files out of the package.",
        )
    return doc, [{"key": ARCHIVE_KEY, "path": ARCHIVE_KEY}]


def packages_config_map(cfg: Config, packages: Unpacked) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The shipped packages as a ConfigMap of their own (for a RayJob's submitter pod, beside :func:`code_config_map`):
    one ``binaryData`` key, :data:`PACKAGES_KEY`, and the volume ``items`` that mount it as that file. A UserError
    when it exceeds 1 MiB (``submit`` checks first, and lets pip install such packages instead)."""
    doc, size = _archive_config_map(cfg, "packages", PACKAGES_KEY, packages_archive(packages))
    if size > CONFIG_MAP_MAX_BYTES:
        raise UserError(
            f"the packages shipped unpacked ({packages.describe()}) make ConfigMap {_where(doc)} {size:,} bytes; "
            f"Kubernetes accepts at most {CONFIG_MAP_MAX_BYTES:,}",
            hint="Submit with --mode raycluster (it copies them into the head pod instead).",
        )
    return doc, [{"key": PACKAGES_KEY, "path": PACKAGES_KEY}]


def _archive_config_map(cfg: Config, suffix: str, key: str, archive: str) -> tuple[dict[str, Any], int]:
    """A ConfigMap named ``<cluster>-<suffix>`` holding ``archive`` (base64 text) under ``key``, and its size."""
    meta = {"name": f"{cfg.ray.cluster_name}-{suffix}", "namespace": cfg.ray.namespace, "labels": m.labels(cfg)}
    doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "binaryData": {key: archive}}
    return doc, config_map_bytes(doc)


def _where(doc: Mapping[str, Any]) -> str:
    return f"{doc['metadata']['namespace']}/{doc['metadata']['name']}"


def config_map_bytes(doc: Mapping[str, object]) -> int:
    """The ConfigMap's size as compact UTF-8 JSON: at least the sum of its values, which the API server holds to
    1 MiB, and about what etcd stores. Example: ``config_map_bytes({"data": {"a": "xy"}}) == 19``."""
    return len(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def rayjob_manifest(
    cfg: Config,
    *,
    hf_token: bool,
    code_map: dict[str, Any],
    items: list[dict[str, str]],
    pip: list[str] | None = None,
    pip_options: list[str] | None = None,
    packages: tuple[dict[str, Any], Unpacked] | None = None,
) -> dict[str, Any]:
    """The RayJob of :func:`raytrain_eks.k8s.manifests.rayjob` (its entrypoint is the same driver command as
    :func:`submit_job`'s), plus the runtime_env (``pip``, ``pip_options``: as :func:`runtime_env` takes them) and a
    submitter pod that mounts the code ConfigMap and runs :func:`submitter_argv`: it unpacks the package where
    ``py_modules`` points, then ``ray job submit``. ``packages``: the :func:`packages_config_map` and what it holds,
    mounted and unpacked beside the package, each of its top-level entries one more py_modules entry."""
    modules = shipped_modules(SUBMITTER_PACKAGES_DIR, packages[1]) if packages else []
    env = runtime_env(SUBMITTER_CODE_DIR, pip, pip_options, modules)
    doc = m.rayjob(cfg, hf_token=hf_token, runtime_env=env)
    mounts = [{"name": "raytrain-eks-code", "mountPath": SUBMITTER_ARCHIVE_DIR, "readOnly": True}]
    volumes: list[dict[str, Any]] = [
        {"name": "raytrain-eks-code", "configMap": {"name": code_map["metadata"]["name"], "items": items}}
    ]
    if packages:
        mounts.append({"name": "raytrain-eks-packages", "mountPath": SUBMITTER_PACKAGES_ARCHIVE_DIR, "readOnly": True})
        shipped = [{"key": PACKAGES_KEY, "path": PACKAGES_KEY}]
        name = packages[0]["metadata"]["name"]
        volumes.append({"name": "raytrain-eks-packages", "configMap": {"name": name, "items": shipped}})
    submitter = {
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": SUBMITTER_CONTAINER,
                    "image": cfg.ray.image,
                    # KubeRay keeps a command it is given (K8sJobMode) instead of its default, which calls `python`.
                    "command": submitter_argv(doc["spec"]["entrypoint"], json.dumps(env), packages=bool(packages)),
                    # As the head: a pod that asks for no GPU sees none, even where the node's runtime would show all.
                    "env": [dict(m.NO_GPU_ENV)],
                    "resources": {
                        "requests": {"cpu": "500m", "memory": "512Mi"},
                        "limits": {"cpu": "1", "memory": "1Gi"},
                    },
                    "volumeMounts": mounts,
                }
            ],
            "volumes": volumes,
        }
    }
    return m.merge(doc, {"spec": {"submitterPodTemplate": submitter}})


def head_code_dir(files: Mapping[str, str]) -> str:
    """Where ``--mode raycluster`` unpacks the package in the head pod: one folder per package content, so a changed
    package is never mixed with an older one. Example: ``/tmp/raytrain-eks/3f2a9c1d0b7e``."""
    return f"{HEAD_CODE_ROOT}/{package_digest(files)}"


def unpack_argv(dest: str) -> list[str]:
    """The command, run in the head pod with the :func:`package_archive` text on its stdin, that unpacks it into
    ``dest``."""
    return [m.IMAGE_PYTHON, "-c", _UNPACK, dest]


def ray_job_submit_argv(
    code_dir: str,
    *,
    submission_id: str | None = None,
    wait: bool = True,
    pip: list[str] | None = None,
    pip_options: list[str] | None = None,
    modules: Sequence[str] = (),
    env_vars: Mapping[str, str] | None = None,
) -> list[str]:
    """``ray job submit`` as run in the head pod: the job's ``runtime_env`` (:func:`runtime_env` of ``code_dir``,
    ``pip``, ``pip_options`` and ``modules``) and its entrypoint (:func:`raytrain_eks.k8s.manifests.train_argv`).
    ``submission_id``: Ray makes one when ``None``. ``wait=False`` returns once submitted (``submit`` then follows
    the logs itself)."""
    argv = ["ray", "job", "submit", "--address", DASHBOARD]
    if submission_id is not None:
        argv += ["--submission-id", submission_id]
    if not wait:
        argv.append("--no-wait")
    env = runtime_env(code_dir, pip, pip_options, modules, env_vars)
    return [*argv, "--runtime-env-json", json.dumps(env), "--", *m.train_argv()]
