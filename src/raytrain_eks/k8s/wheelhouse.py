"""``submit --offline``: the job's packages from a wheelhouse in the run's storage, so no node needs a package index.

On the machine that runs ``submit`` (which reaches PyPI or the index pip is configured for), :func:`build_wheelhouse`
downloads wheels for the image's Python and platform (read from its python3 by :data:`IMAGE_PLATFORM`): the
requirements the image lacks and, one ``pip download --no-deps`` round at a time, each dependency the image does not
already meet (so a dependency the image has, such as torch under peft, is never downloaded). :func:`upload` puts the
wheels and their manifest (:data:`MANIFEST`: names, sizes, sha256; written last) at
``training.storage_path/.raytrain-eks-wheelhouse/DIGEST``. Every Ray pod gets an init container (:func:`with_wheels`)
that runs :data:`_COPY` under the image's python3 (pyarrow, the pod's IRSA credentials): the wheels into an emptyDir
at :data:`WHEELS_DIR`, each checked against the manifest; the job's runtime_env then installs with ``--no-index
--find-links`` there (:func:`pip_options`). When the storage is a folder of ``ray.shared_volume`` (:func:`on_volume`),
:func:`write_through` writes the wheelhouse there instead, through exec in a pod that mounts the volume, and pip reads
it on the volume (no init container). Example::

    image = ImagePython.from_probe(json.loads(probe_output))
    house = build_wheelhouse(["peft>=0.21.2,<0.22"], image, Path(tmp), installed=ask_image)
    source = upload(house, "s3://bucket/runs")           # s3://bucket/runs/.raytrain-eks-wheelhouse/3f2a...
    doc = with_wheels(raycluster_doc, cfg, source, house.digest)
"""

from __future__ import annotations

import copy
import email.parser
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.cluster import ExecResult

if TYPE_CHECKING:
    from packaging.requirements import Requirement

MANIFEST = "raytrain-eks-wheelhouse.json"
STORAGE_FOLDER = ".raytrain-eks-wheelhouse"  # under training.storage_path, one folder per wheelhouse digest
WHEELS_DIR = "/tmp/raytrain-eks-wheels"  # the emptyDir in every Ray pod (/tmp: writable in pods made without it)
WHEELS_VOLUME = "raytrain-eks-wheels"
INIT_CONTAINER = "raytrain-eks-wheels"
MAX_ROUNDS = 30  # dependency rounds of build_wheelhouse: each only narrows a range; far more than a real tree needs
PIP_TIMEOUT_S = 900


class NoWheel(UserError):
    """A requirement has no wheel pip can use for the image's Python and platform."""

    exit_code = 2


# Run in the head pod (the image's python3): the interpreter's version, ABI, platform tags (most specific first, as
# pip ranks them) and environment markers, as JSON. packaging comes with Ray (one of its own dependencies).
IMAGE_PLATFORM = """import json, platform, sys
from packaging import tags
from packaging.markers import default_environment
platforms, abi = [], None
for tag in tags.sys_tags():
    if tag.interpreter.startswith("cp") and abi is None and tag.abi not in ("abi3", "none"):
        abi = tag.abi
    if tag.platform not in platforms and tag.platform != "any":
        platforms.append(tag.platform)
print(json.dumps({
    "python": "%d.%d" % sys.version_info[:2],
    "implementation": sys.implementation.name,
    "abi": abi,
    "platforms": platforms,
    "markers": default_environment(),
}))
"""


@dataclass(frozen=True)
class ImagePython:
    """The image's interpreter as :data:`IMAGE_PLATFORM` reports it."""

    python: str  # "3.12"
    abi: str  # "cp312"
    platforms: tuple[str, ...]  # ("manylinux_2_35_x86_64", ..., "linux_x86_64")
    markers: Mapping[str, str]

    @classmethod
    def from_probe(cls, found: Any) -> ImagePython:
        """From the probe's JSON; a UserError when it is not a CPython report with platform tags."""
        ok = isinstance(found, dict) and found.get("implementation") == "cpython" and found.get("abi")
        if not ok or not found.get("platforms") or not re.fullmatch(r"3\.\d+", str(found.get("python"))):
            raise UserError(
                f"the image's python3 did not report a CPython version and platform tags: {str(found)[:300]}",
                hint="--offline downloads wheels for the image's own Python; use a CPython image with Ray "
                "(its packaging module reports the tags), or submit without --offline.",
            )
        return cls(str(found["python"]), str(found["abi"]), tuple(found["platforms"]), dict(found["markers"]))

    def describe(self) -> str:
        return f"CPython {self.python} ({self.abi}, {self.platforms[0]})"


@dataclass(frozen=True)
class Wheel:
    name: str  # the file name
    bytes: int
    sha256: str


@dataclass
class Wheelhouse:
    """The wheels in ``folder`` and what they are for; ``digest`` names them (their names and hashes)."""

    folder: Path
    requirements: list[str]
    image: ImagePython
    wheels: list[Wheel] = field(default_factory=list)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for w in sorted(self.wheels, key=lambda w: w.name):
            h.update(f"{w.name}\0{w.sha256}\0".encode())
        return h.hexdigest()[:16]

    @property
    def total_bytes(self) -> int:
        return sum(w.bytes for w in self.wheels)

    def manifest(self) -> dict[str, Any]:
        return {
            "wheelhouse": self.digest,
            "python": self.image.python,
            "abi": self.image.abi,
            "platforms": list(self.image.platforms),
            "requirements": list(self.requirements),
            "files": [{"name": w.name, "bytes": w.bytes, "sha256": w.sha256} for w in self.wheels],
        }

    def lines(self) -> list[str]:
        """What goes into the wheelhouse, for ``submit`` to print."""
        head = (
            f"Wheelhouse for {self.image.describe()}: {len(self.wheels)} wheels, "
            f"{self.total_bytes / 2**20:,.1f} MiB (for {', '.join(self.requirements)})"
        )
        return [head, *(f"  {w.name} ({w.bytes / 2**20:,.2f} MiB)" for w in self.wheels)]


def pip_download_argv(requirements: Sequence[str], image: ImagePython, dest: Path) -> list[str]:
    """``pip download`` of ``requirements`` alone (``--no-deps``: :func:`build_wheelhouse` walks the dependencies
    itself, leaving out those the image meets), wheels only, for the image's Python, ABI and every platform tag it
    accepts (pip does not widen a ``manylinux_2_X`` tag to the older ones by itself)."""
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps"]
    argv += ["--only-binary=:all:", "--python-version", image.python, "--implementation", "cp", "--abi", image.abi]
    for platform_tag in image.platforms:
        argv += ["--platform", platform_tag]
    return [*argv, "--dest", str(dest), *requirements]


def _no_wheel(stderr: str, image: ImagePython) -> NoWheel | None:
    match = re.search(r"No matching distribution found for (\S+)", stderr)
    if match is None:
        return None
    versions = re.search(r"\(from versions: ([^)]*)\)", stderr)
    seen = f" (pip: from versions: {versions.group(1)})" if versions else ""
    return NoWheel(
        f"--offline: {match.group(1)} has no wheel for the image's {image.describe()}"
        + seen
        + ". Nothing was uploaded and no Ray object applied",
        hint=f"It may publish only a source distribution: build its wheel on a machine like the image "
        f"(`pip wheel '{match.group(1)}'`) into your own index, add it to the image, or submit without --offline.",
    )


def _requires(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = email.parser.Parser().parsestr(z.read(name).decode("utf-8"))
    return list(meta.get_all("Requires-Dist") or [])


def _wheel_id(path: Path) -> tuple[str, str]:
    from packaging.utils import parse_wheel_filename

    name, version, _, _ = parse_wheel_filename(path.name)
    return str(name), str(version)


def _applies(req: Requirement, parent_extras: frozenset[str], markers: Mapping[str, str]) -> bool:
    """Whether requirement ``req`` holds in the image's environment, for one of the extras its parent was asked with."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**markers, "extra": e}) for e in sorted(parent_extras) or [""])


def build_wheelhouse(
    requirements: Sequence[str],
    image: ImagePython,
    dest: Path,
    *,
    installed: Callable[[list[str]], Mapping[str, str | None]],
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> Wheelhouse:
    """Download into ``dest`` wheels of ``requirements`` and of every dependency (for the image's environment
    markers and the extras asked) that the image does not meet; ``installed(names)`` gives the image's versions
    (None: not installed). A dependency whose range narrows past the wheel chosen earlier is downloaded again."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    dest.mkdir(parents=True, exist_ok=True)
    ranges: dict[str, SpecifierSet] = {}
    extras: dict[str, set[str]] = {}
    chosen: dict[str, Path] = {}
    image_has: dict[str, str | None] = {}
    pending = [(Requirement(r), frozenset[str]()) for r in requirements]
    for _ in range(MAX_ROUNDS):
        pending = [(r, e) for r, e in pending if _applies(r, e, image.markers)]
        if not pending:
            break
        unknown = sorted({str(canonicalize_name(r.name)) for r, _ in pending} - set(image_has))
        if unknown:
            image_has.update({str(canonicalize_name(k)): v for k, v in installed(unknown).items()})
        fetch: dict[str, Requirement] = {}
        reread: set[str] = set()
        for req, _ in pending:
            name = str(canonicalize_name(req.name))
            ranges[name] = ranges.get(name, SpecifierSet()) & req.specifier
            new_extras = set(req.extras) - extras.setdefault(name, set())
            extras[name] |= set(req.extras)
            have = image_has.get(name)
            if name not in chosen and have is not None and ranges[name].contains(have, prereleases=True):
                continue  # the image's copy serves (pip on the node keeps it)
            if name in chosen and ranges[name].contains(Version(_wheel_id(chosen[name])[1]), prereleases=True):
                if new_extras:
                    reread.add(name)
                continue
            fetch[name] = req
        pending = []
        for name in reread - set(fetch):
            pending += [(Requirement(r), frozenset(extras[name])) for r in _requires(chosen[name])]
        if not fetch:
            continue
        for name in fetch:
            if name in chosen:
                chosen.pop(name).unlink()
        before = set(dest.glob("*.whl"))
        specs = [f"{name}{ranges[name]}" for name in sorted(fetch)]
        argv = pip_download_argv(specs, image, dest)
        try:
            done = run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        except FileNotFoundError:
            raise UserError(f"--offline: {sys.executable} cannot be run to download wheels") from None
        if done.returncode != 0:
            raise _no_wheel(done.stderr, image) or UserError(
                f"--offline: pip download failed (exit status {done.returncode}): "
                + "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:]),
                hint="Read pip's message above (is a package index reachable from here? pip reads its usual "
                "settings, PIP_INDEX_URL among them); nothing was uploaded or applied.",
            )
        for path in sorted(set(dest.glob("*.whl")) - before):
            got = str(canonicalize_name(_wheel_id(path)[0]))
            chosen[got] = path
            pending += [(Requirement(r), frozenset(extras.get(got, set()))) for r in _requires(path)]
    else:
        raise UserError(
            f"--offline: the dependencies of {', '.join(requirements)} did not settle in {MAX_ROUNDS} rounds"
        )
    house = Wheelhouse(dest, list(requirements), image)
    for path in sorted(chosen.values()):
        house.wheels.append(Wheel(path.name, path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()))
    return house


@dataclass(frozen=True)
class Unpacked:
    """Pure-Python wheels unpacked as pip would lay them out in site-packages, for the job's ``py_modules``.

    ``files``: path (relative to that site-packages) -> bytes; ``top_level``: the folders and modules at its root, one
    py_modules entry each (Ray puts the folder holding an entry on the workers' PYTHONPATH, so a package and its
    ``.dist-info``, which ``importlib.metadata`` reads, are two entries side by side); ``digest``: the wheelhouse's.
    Example: ``top_level == ("peft", "peft-0.21.2.dist-info")`` for peft's wheel."""

    files: dict[str, bytes]
    top_level: tuple[str, ...]
    wheels: tuple[str, ...]
    requirements: tuple[str, ...]
    digest: str

    @property
    def total_bytes(self) -> int:
        return sum(len(data) for data in self.files.values())

    def describe(self) -> str:
        """``"peft-0.21.2-py3-none-any.whl unpacked: 261 files, 3.6 MiB"``."""
        return f"{', '.join(self.wheels)} unpacked: {len(self.files)} files, {self.total_bytes / 2**20:,.1f} MiB"


def not_pure(wheel: Path) -> str | None:
    """Why ``wheel`` cannot travel unpacked in py_modules, or ``None`` when it can: it must be pure Python (its
    ``WHEEL`` says ``Root-Is-Purelib: true`` and every tag is ``py3-none-any`` or alike: no compiled code, which
    would tie it to one interpreter and platform) and install nothing outside site-packages but console scripts,
    which the job never runs. Example: ``not_pure(Path("peft-0.21.2-py3-none-any.whl")) is None``."""
    from packaging.utils import parse_wheel_filename

    _, _, _, tags = parse_wheel_filename(wheel.name)
    compiled = sorted({str(t) for t in tags if t.abi != "none" or t.platform != "any"})
    if compiled:
        return f"{wheel.name} is compiled for {compiled[0]}"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next((n for n in names if re.fullmatch(r"[^/]+\.dist-info/WHEEL", n)), None)
        if info is None:
            return f"{wheel.name} has no .dist-info/WHEEL"
        wheel_meta = email.parser.Parser().parsestr(z.read(info).decode("utf-8"))
    if str(wheel_meta.get("Root-Is-Purelib", "")).strip().lower() != "true":
        return f"{wheel.name} is not pure Python (its WHEEL says Root-Is-Purelib: {wheel_meta.get('Root-Is-Purelib')})"
    for name in names:
        parts = name.split("/")
        if parts[0].endswith(".data") and len(parts) > 2 and parts[1] not in ("scripts", "purelib"):
            return f"{wheel.name} installs {parts[1]} files outside site-packages ({name})"
        if len(parts) == 1 and not name.endswith(".py"):
            return f"{wheel.name} puts {name} at the root of site-packages, which py_modules cannot carry"
    return None


def unpack_pure(house: Wheelhouse) -> Unpacked | str:
    """Every wheel of ``house`` unpacked in memory (:class:`Unpacked`), or why they cannot all travel so (the first
    :func:`not_pure` reason, or two wheels writing one file). ``.data/purelib`` goes to the root, console scripts
    are left out."""
    files: dict[str, bytes] = {}
    for wheel in house.wheels:
        path = house.folder / wheel.name
        why = not_pure(path)
        if why is not None:
            return why
        with zipfile.ZipFile(path) as z:
            for member in z.infolist():
                parts = member.filename.split("/")
                if member.is_dir() or ".." in parts or member.filename.startswith("/"):
                    continue
                if parts[0].endswith(".data"):
                    if parts[1] != "purelib":
                        continue  # console scripts: the job imports packages, it never runs their commands
                    parts = parts[2:]
                rel = "/".join(parts)
                if rel in files:
                    return f"{wheel.name} and another wheel both hold {rel}"
                files[rel] = z.read(member)
    top = tuple(sorted({rel.split("/")[0] for rel in files}))
    names = tuple(w.name for w in house.wheels)
    return Unpacked(files, top, names, tuple(house.requirements), house.digest)


def on_volume(cfg: Config) -> bool:
    """Whether ``training.storage_path`` lies on ``ray.shared_volume`` (a folder of its mount in every Ray pod)."""
    path, mount = cfg.training.storage_path or "", cfg.ray.shared_volume_path
    return bool(cfg.ray.shared_volume) and (path == mount or path.startswith(mount + "/"))


def storage_location(cfg: Config) -> str:
    """Where the wheelhouses of ``cfg``'s jobs go, beside the checkpoints: a folder of ``training.storage_path``,
    which must be a URI every pod reads with its own credentials (``s3://``) or a folder of ``ray.shared_volume``,
    which every Ray pod mounts."""
    path = cfg.training.storage_path
    if not on_volume(cfg) and (not path or "://" not in path):
        raise UserError(
            f"--offline: training.storage_path = {path!r} is neither storage the Ray pods read through a URI nor a "
            "folder of ray.shared_volume; the wheelhouse goes beside the checkpoints, where every Ray pod reads it",
            hint="Set training.storage_path to an s3:// prefix the Ray pods may read (on EKS `up` makes one), or set "
            "ray.shared_volume (a ReadWriteMany claim; the checkpoints go there too), or submit without --offline.",
        )
    return f"{str(path).rstrip('/')}/{STORAGE_FOLDER}"


def upload(house: Wheelhouse, location: str, say: Callable[[str], None] = lambda _: None) -> str:
    """The wheels, then the manifest, into ``location/DIGEST``; returns that folder. A folder whose manifest is
    already there is used as it is (the same digest is the same wheels)."""
    from pyarrow import fs as pafs

    target = f"{location.rstrip('/')}/{house.digest}"
    manifest = (json.dumps(house.manifest(), indent=2) + "\n").encode()
    try:
        fs, root = pafs.FileSystem.from_uri(target)
        if fs.get_file_info(f"{root}/{MANIFEST}").type == pafs.FileType.File:
            say(f"Wheelhouse {house.digest} is already at {target}")
            return target
        for wheel in house.wheels:
            with (house.folder / wheel.name).open("rb") as src, fs.open_output_stream(f"{root}/{wheel.name}") as out:
                while chunk := src.read(8 << 20):
                    out.write(chunk)
        with fs.open_output_stream(f"{root}/{MANIFEST}") as out:
            out.write(manifest)
    except OSError as exc:  # no such bucket, no credentials, access denied
        raise UserError(
            f"--offline: cannot write the wheelhouse to {target}: {exc}",
            hint="Check that the bucket exists and that this machine's credentials may write there.",
        ) from None
    say(f"Uploaded wheelhouse {house.digest} to {target} ({house.total_bytes / 2**20:,.1f} MiB, manifest last)")
    return target


# Runs under the image's python3 (argv: the wheelhouse's storage folder, the local folder to fill), in every Ray pod's
# init container and, for pods already running, through exec: each wheel the manifest names, read with pyarrow (the
# pod's own credentials), its size and sha256 checked, into a partial folder renamed into place once complete, the
# manifest copied last. A folder already complete is kept. Writes nothing outside the folder given.
_COPY = """\
import hashlib, json, os, shutil, sys
source, dest = sys.argv[1].rstrip("/"), sys.argv[2].rstrip("/")
manifest_name = "raytrain-eks-wheelhouse.json"
if os.path.isfile(os.path.join(dest, manifest_name)):
    print("wheelhouse already at", dest, flush=True)
    sys.exit(0)
from pyarrow import fs as pafs
fs, root = pafs.FileSystem.from_uri(source)
with fs.open_input_stream(root + "/" + manifest_name) as f:
    raw = f.read()
manifest = json.loads(raw)
partial = "%s.partial-%d" % (dest, os.getpid())
os.makedirs(partial)
total = 0
for entry in manifest["files"]:
    name = entry["name"]
    if "/" in name or name.startswith(".") or not name.endswith(".whl"):
        sys.exit("refusing to copy %r: not a wheel file name" % name)
    digest, size = hashlib.sha256(), 0
    with fs.open_input_stream(root + "/" + name) as src, open(os.path.join(partial, name), "wb") as out:
        while True:
            chunk = src.read(8 << 20)
            if not chunk:
                break
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
    if size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
        sys.exit("%s/%s: %d bytes, sha256 %s; the manifest says %d bytes, %s"
                 % (source, name, size, digest.hexdigest(), entry["bytes"], entry["sha256"]))
    total += size
with open(os.path.join(partial, manifest_name), "wb") as out:
    out.write(raw)
try:
    os.rename(partial, dest)
except OSError:
    if not os.path.isfile(os.path.join(dest, manifest_name)):
        raise
    shutil.rmtree(partial, ignore_errors=True)
print("copied %d wheels (%.1f MiB) from %s into %s" % (len(manifest["files"]), total / 2**20, source, dest), flush=True)
"""


def local_folder(digest: str) -> str:
    """Where a pod holds the wheelhouse ``digest``: what ``--find-links`` names."""
    return f"{WHEELS_DIR}/{digest}"


def copy_argv(source: str, digest: str) -> list[str]:
    """The command (init container, or exec in a running pod) that copies the wheelhouse at ``source`` into
    :func:`local_folder`."""
    return [m.IMAGE_PYTHON, "-c", _COPY, source, local_folder(digest)]


def pip_options(digest: str, folder: str | None = None) -> list[str]:
    """runtime_env ``pip_install_options``: Ray's two defaults (which a list given replaces), then the wheelhouse
    (in ``folder``, default each pod's own copy of ``digest``) as the only place pip looks."""
    where = folder or local_folder(digest)
    return ["--disable-pip-version-check", "--no-cache-dir", "--no-index", "--find-links", where]


def with_wheels(doc: Mapping[str, Any], cfg: Config, source: str, digest: str) -> dict[str, Any]:
    """A copy of the RayCluster or RayJob ``doc`` whose every Ray pod first copies the wheelhouse at ``source`` into
    an emptyDir at :data:`WHEELS_DIR` (an init container of the same image), which its Ray container mounts too."""
    out = copy.deepcopy(dict(doc))
    mount = {"name": WHEELS_VOLUME, "mountPath": WHEELS_DIR}
    init = {
        "name": INIT_CONTAINER,
        "image": cfg.ray.image,
        "imagePullPolicy": "IfNotPresent",
        "command": copy_argv(source, digest),
        # requests == limits, as the Ray containers have: the pods keep their Guaranteed QoS.
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        "volumeMounts": [mount],
    }
    for template in m.pod_templates(out):
        spec = template["spec"]
        spec["initContainers"] = [*spec.get("initContainers", []), init]
        spec["volumes"] = [*spec.get("volumes", []), {"name": WHEELS_VOLUME, "emptyDir": {}}]
        for container in spec["containers"]:
            container["volumeMounts"] = [*container.get("volumeMounts", []), dict(mount)]
    return out


PROBE_POD_SUFFIX = "-image-probe"
PROBE_LIFETIME_S = 3600  # activeDeadlineSeconds: a probe pod left behind (its submit interrupted) ends on its own
# The probe pod's only process: it waits to be asked (exec) and leaves at once when the pod is deleted (a bare
# `sleep` as PID 1 ignores SIGTERM and would hold the pod for its whole grace period).
_PROBE_WAIT = (
    f"import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\ntime.sleep({PROBE_LIFETIME_S})\n"
)


def probe_pod(cfg: Config) -> dict[str, Any]:
    """A short-lived ``v1`` Pod of the Ray image, placed as the Ray workers are (their node selector and
    tolerations, so the image is pulled where the workers need it anyway), that only waits: ``submit --offline``
    asks its python3 (:data:`IMAGE_PLATFORM`, the installed versions) before any Ray object exists, and writes
    through it the wheelhouse onto ``ray.shared_volume`` (mounted as in the Ray pods), then deletes it. It requests
    no GPU and sees none."""
    worker = m.pod_templates(m.raycluster(cfg))[1]["spec"]
    small = {"cpu": "100m", "memory": "256Mi"}
    mounts, volumes = m.shared_volume(cfg)  # the wheelhouse is written there when the storage is on it
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": PROBE_LIFETIME_S,
        "terminationGracePeriodSeconds": 5,
        **({"nodeSelector": dict(worker["nodeSelector"])} if worker.get("nodeSelector") else {}),
        "tolerations": copy.deepcopy(worker.get("tolerations", [])),
        "containers": [
            {
                "name": "image-probe",
                "image": cfg.ray.image,
                "imagePullPolicy": "IfNotPresent",
                "command": [m.IMAGE_PYTHON, "-c", _PROBE_WAIT],
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
                "resources": {"requests": dict(small), "limits": dict(small)},
                **({"volumeMounts": mounts} if mounts else {}),
            }
        ],
        **({"volumes": volumes} if volumes else {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{cfg.ray.cluster_name}{PROBE_POD_SUFFIX}",
            "namespace": cfg.ray.namespace,
            "labels": {**m.labels(cfg), "app.kubernetes.io/component": "image-probe"},
        },
        "spec": spec,
    }


# Writing a wheelhouse onto the shared volume through a pod that mounts it (the Ray head, or the image's probe pod):
# the wheels go in pieces through exec's stdin (base64 text) into a partial folder; the last call checks every file
# against the manifest, writes the manifest and renames the folder into place. All three run under the image's
# python3 and write nothing outside the folders given.
PIECE_BYTES = 4 << 20  # raw bytes of one exec call (about 5.3 MB of base64 on the wire)

# argv: the complete folder. Exit 0 when it already holds a manifest (the same digest is the same wheels).
_HAVE = """\
import os, sys
sys.exit(0 if os.path.isfile(os.path.join(sys.argv[1], "raytrain-eks-wheelhouse.json")) else 1)
"""

# argv: the partial folder, a wheel file name, "new" or "more"; stdin: base64 of the next piece of that file.
_PUT_PIECE = """\
import base64, os, sys
folder, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if "/" in name or name.startswith(".") or not name.endswith(".whl"):
    sys.exit("refusing to write %r: not a wheel file name" % name)
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, name), "wb" if mode == "new" else "ab") as out:
    out.write(base64.b64decode(sys.stdin.read()))
"""

# argv: the partial folder, the complete folder; stdin: the manifest. Every file checked, the manifest written
# last, the folder renamed into place (a folder another submit completed first is kept).
_SEAL = """\
import hashlib, json, os, shutil, sys
partial, dest = sys.argv[1].rstrip("/"), sys.argv[2].rstrip("/")
raw = sys.stdin.read()
manifest = json.loads(raw)
for entry in manifest["files"]:
    digest, size = hashlib.sha256(), 0
    with open(os.path.join(partial, entry["name"]), "rb") as f:
        while True:
            chunk = f.read(8 << 20)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    if size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
        shutil.rmtree(partial, ignore_errors=True)
        sys.exit("%s: %d bytes, sha256 %s; the manifest says %d bytes, %s"
                 % (entry["name"], size, digest.hexdigest(), entry["bytes"], entry["sha256"]))
with open(os.path.join(partial, "raytrain-eks-wheelhouse.json"), "w") as out:
    out.write(raw)
try:
    os.rename(partial, dest)
except OSError:
    if not os.path.isfile(os.path.join(dest, "raytrain-eks-wheelhouse.json")):
        raise
    shutil.rmtree(partial, ignore_errors=True)
print("wheelhouse of %d wheels in %s" % (len(manifest["files"]), dest), flush=True)
"""

# (argv, stdin) -> the command run in a pod that mounts the volume
PodRun = Callable[[list[str], "str | None"], ExecResult]


def write_through(house: Wheelhouse, location: str, run: PodRun, say: Callable[[str], None] = lambda _: None) -> str:
    """The wheels, checked, then the manifest, into ``location/DIGEST`` on the shared volume, through ``run`` (exec
    in a pod that mounts it); returns that folder. A folder whose manifest is already there is used as it is."""
    import base64
    import secrets

    target = f"{location.rstrip('/')}/{house.digest}"
    if run([m.IMAGE_PYTHON, "-c", _HAVE, target], None).ok:
        say(f"Wheelhouse {house.digest} is already at {target}")
        return target
    partial = f"{target}.partial-{secrets.token_hex(4)}"

    def checked(argv: list[str], stdin: str | None, what: str) -> ExecResult:
        res = run(argv, stdin)
        if not res.ok:
            raise UserError(
                f"--offline: cannot write the wheelhouse to {target} ({what}): "
                + (res.stderr or res.stdout).strip()[-300:],
                hint="A file that differs from the manifest was damaged on the way: submit again. A permission error: "
                "the shared volume must be writable by the Ray pods (its access modes and file permissions).",
            )
        return res

    for wheel in house.wheels:
        with (house.folder / wheel.name).open("rb") as src:
            mode = "new"
            while True:
                piece = src.read(PIECE_BYTES)
                if not piece and mode == "more":
                    break
                text = base64.b64encode(piece).decode("ascii")
                checked([m.IMAGE_PYTHON, "-c", _PUT_PIECE, partial, wheel.name, mode], text, wheel.name)
                mode = "more"
    manifest = json.dumps(house.manifest(), indent=2) + "\n"
    checked([m.IMAGE_PYTHON, "-c", _SEAL, partial, target], manifest, "the manifest")
    say(f"Wrote wheelhouse {house.digest} to {target} on the shared volume ({house.total_bytes / 2**20:,.1f} MiB)")
    return target
