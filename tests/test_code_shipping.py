"""How ``--mode rayjob`` ships the package: the code ConfigMap (the package as one tar.gz), the submitter pod
unpacking it, and Ray's ``py_modules`` reading the unpacked folder; and the same for a package the image lacks,
shipped as its unpacked pure-Python wheel in a second ConfigMap (no ``pip`` in the runtime_env).

The kubelet does not mount a ConfigMap as plain files. Its atomic writer puts them (a ``binaryData`` key decoded)
in a hidden timestamped folder, points ``..data`` at it and links each top-level path to ``..data/<path>``::

    MOUNT/..2026_11_30_04_12_01.123456789/raytrain_eks.tar.gz   (0644)
    MOUNT/..data -> ..2026_11_30_04_12_01.123456789
    MOUNT/raytrain_eks.tar.gz -> ..data/raytrain_eks.tar.gz

The integration test builds that layout from the real ConfigMap, runs the submitter command's unpack step as the
pod runs it, and lets embedded Ray ship the result with the runtime_env that ``ray job submit`` gets in the
submitter pod, then proves the worker imported Ray's unpacked copies (the package complete and unchanged; the shipped
package with its ``.dist-info``, which ``importlib.metadata`` finds), and that nothing was written into the
(read-only) mounts. The fast tests hold the ConfigMap to Kubernetes' 1 MiB limit.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_eks.errors import UserError
from raytrain_eks.k8s import job as shipping
from raytrain_eks.k8s import wheelhouse as wh

KUBELET_TIMESTAMP_DIR = "..2026_11_30_04_12_01.123456789"


@pytest.fixture
def cfg(cfg_for):
    return cfg_for()


def kubelet_config_map_volume(mount: Path, binary_data: dict[str, str], items: list[dict[str, str]]) -> Path:
    """Lay out a ConfigMap's ``binaryData`` under ``mount`` as the kubelet does for a volume with ``items`` (each
    value base64-decoded into its file); returns ``mount``."""
    stamped = mount / KUBELET_TIMESTAMP_DIR
    for item in items:
        target = stamped / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(binary_data[item["key"]]))
    for folder, _dirs, files in os.walk(stamped):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)  # the volume's defaultMode
    (mount / "..data").symlink_to(KUBELET_TIMESTAMP_DIR)
    for top in sorted({item["path"].split("/")[0] for item in items}):
        (mount / top).symlink_to(f"..data/{top}")
    return mount


def pure_wheel(folder: Path) -> wh.Unpacked:
    """A pure-Python wheel of ``rte-shipped`` 1.2.3 (as a build backend writes one), unpacked for py_modules."""
    import hashlib
    import zipfile

    folder.mkdir(parents=True)
    path = folder / "rte_shipped-1.2.3-py3-none-any.whl"
    info = "rte_shipped-1.2.3.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("rte_shipped/__init__.py", "WHO = 'shipped 1.2.3'\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: rte-shipped\nVersion: 1.2.3\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    data = path.read_bytes()
    image = wh.ImagePython("3.13", "cp313", ("linux_x86_64",), {})
    house = wh.Wheelhouse(
        folder, ["rte-shipped>=1"], image, [wh.Wheel(path.name, len(data), hashlib.sha256(data).hexdigest())]
    )
    shipped = wh.unpack_pure(house)
    assert isinstance(shipped, wh.Unpacked), shipped
    return shipped


def tree(root: Path) -> set[str]:
    """Relative paths of every file and folder under ``root``, symlinks listed but not followed."""
    out = set()
    for folder, dirs, files in os.walk(root):
        out.update(os.path.relpath(os.path.join(folder, n), root) for n in dirs + files)
    return out


def test_kubelet_layout_helper_matches_the_mount(cfg, tmp_path: Path):
    import tarfile

    code_map, items = shipping.code_config_map(cfg, {"raytrain_eks/__init__.py": "x = 1\n", "raytrain_eks/a/b.py": ""})
    assert "data" not in code_map and list(code_map["binaryData"]) == [shipping.ARCHIVE_KEY]
    mount = kubelet_config_map_volume(tmp_path, code_map["binaryData"], items)
    assert os.readlink(mount / "..data") == KUBELET_TIMESTAMP_DIR
    assert os.readlink(mount / shipping.ARCHIVE_KEY) == f"..data/{shipping.ARCHIVE_KEY}"
    assert (mount / shipping.ARCHIVE_KEY).stat().st_mode & 0o777 == 0o644
    with tarfile.open(mount / shipping.ARCHIVE_KEY, "r:gz") as tar:
        assert sorted(tar.getnames()) == ["raytrain_eks/__init__.py", "raytrain_eks/a/b.py"]
    assert sorted(p.name for p in mount.iterdir()) == [KUBELET_TIMESTAMP_DIR, "..data", shipping.ARCHIVE_KEY]


@pytest.mark.usefixtures("starts_ray")
def test_ray_ships_the_package_from_the_mounted_config_map(cfg, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import ray

    expected = shipping.package_files()
    code_map, items = shipping.code_config_map(cfg, expected)
    assert {"raytrain_eks/train/loop.py", "raytrain_eks/fabric/nccl_log.py"} <= set(expected)
    mount = kubelet_config_map_volume(tmp_path / "mount", code_map["binaryData"], items)
    packages = pure_wheel(tmp_path / "wheels")
    packages_map, packages_items = shipping.packages_config_map(cfg, packages)
    packages_mount = kubelet_config_map_volume(tmp_path / "packages-mount", packages_map["binaryData"], packages_items)
    before = tree(mount), tree(packages_mount)
    # The submitter pod's command, its mount and unpack folders moved under this test's; its first step (the
    # unpack) run as the pod runs it, with python3 there and this interpreter here.
    argv = shipping.submitter_argv("python3 -m raytrain_eks.cli train", "{}", packages=True)
    assert argv[-4:] == [
        f"{shipping.SUBMITTER_ARCHIVE_DIR}/{shipping.ARCHIVE_KEY}",
        shipping.SUBMITTER_CODE_DIR,
        f"{shipping.SUBMITTER_PACKAGES_ARCHIVE_DIR}/{shipping.PACKAGES_KEY}",
        shipping.SUBMITTER_PACKAGES_DIR,
    ]
    unpacked, site = tmp_path / "code", tmp_path / "packages"
    argv[-4:] = [
        str(mount / shipping.ARCHIVE_KEY),
        str(unpacked),
        str(packages_mount / shipping.PACKAGES_KEY),
        str(site),
    ]
    step = shipping.submitter_unpack_argv(argv)
    done = subprocess.run([sys.executable, *step[1:]], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # The paths rayjob_manifest's runtime_env names, with the unpack folders moved to this test's: no pip.
    job = shipping.rayjob_manifest(
        cfg, hf_token=False, code_map=code_map, items=items, pip=[], packages=(packages_map, packages)
    )
    env = json.loads(job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["command"][3])
    assert "pip" not in env
    module, *shipped_modules = (
        p.replace(shipping.SUBMITTER_CODE_DIR, str(unpacked), 1).replace(shipping.SUBMITTER_PACKAGES_DIR, str(site), 1)
        for p in env["py_modules"]
    )
    assert shipped_modules == [str(site / "rte_shipped"), str(site / "rte_shipped-1.2.3.dist-info")]

    # A job-level runtime_env, as `ray job submit --runtime-env-json` gives it (Ray uploads local paths only there).
    # No pip key: nothing may be installed here. address="local" never joins another test run's Ray.
    monkeypatch.chdir(tmp_path)  # the driver's folder goes on the workers' sys.path: one without the package
    ctx = ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"py_modules": [module, *shipped_modules]},
    )
    try:

        @ray.remote
        def import_shipped() -> dict:
            import importlib.metadata
            import sys

            preloaded = "raytrain_eks" in sys.modules
            import rte_shipped

            import raytrain_eks
            import raytrain_eks.fabric.nccl_log
            import raytrain_eks.train.loop

            return {
                "preloaded": preloaded,
                "package": raytrain_eks.__file__,
                "modules": [raytrain_eks.train.loop.__file__, raytrain_eks.fabric.nccl_log.__file__],
                "shipped": [rte_shipped.__file__, rte_shipped.WHO, importlib.metadata.version("rte-shipped")],
            }

        got = ray.get(import_shipped.remote(), timeout=60)
        runtime_resources = Path(ctx.address_info["session_dir"]) / "runtime_resources"
    finally:
        ray.shutdown()

    # Imported from Ray's unpacked copy, not from the editable install (which the worker's sys.path also has).
    assert not got["preloaded"]
    package = Path(got["package"]).parent
    assert package.name == "raytrain_eks" and package.is_relative_to(runtime_resources), got["package"]
    assert not package.is_relative_to(mount.resolve())
    assert got["modules"] == [str(package / "train" / "loop.py"), str(package / "fabric" / "nccl_log.py")]
    # Every file arrived with its content, and nothing else did (no hidden kubelet folders, no links).
    shipped = {
        f"raytrain_eks/{p.relative_to(package).as_posix()}"
        for p in package.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert shipped == set(expected)
    assert not any(p.is_symlink() for p in package.rglob("*"))
    changed = [p for p, text in expected.items() if (package.parent / p).read_text(encoding="utf-8") != text]
    assert changed == []
    assert (tree(mount), tree(packages_mount)) == before, "Ray wrote into a mount: read-only in the submitter pod"
    # The package the image lacks: imported from Ray's unpacked copy, its version read from its .dist-info there.
    shipped_file, who, version = got["shipped"]
    assert Path(shipped_file).is_relative_to(runtime_resources) and (who, version) == ("shipped 1.2.3", "1.2.3")


def test_the_real_package_fits_a_config_map_with_room_to_grow(cfg):
    code_map, _ = shipping.code_config_map(cfg, shipping.package_files())
    size = shipping.config_map_bytes(code_map)
    assert size >= sum(len(v.encode("utf-8")) for v in code_map["binaryData"].values())
    # A seventh of the limit kept free, so a growing package fails here before it fails in the cluster. (The
    # sources are about 0.9 MiB now; compressed, the ConfigMap holds about a third of that.)
    assert size < 0.86 * shipping.CONFIG_MAP_MAX_BYTES, f"{size:,} bytes of {shipping.CONFIG_MAP_MAX_BYTES:,}"


def _incompressible(n: int) -> str:
    """``n`` characters gzip cannot shrink much (base64 of random bytes: about 6 bits of 8 each)."""
    return base64.b64encode(os.urandom(n))[:n].decode()


def test_an_oversized_package_is_refused_with_its_largest_files(cfg):
    files = {
        "raytrain_eks/__init__.py": "",
        "raytrain_eks/resources/big.jsonl": _incompressible(1_200_000),
        "raytrain_eks/train/loop.py": "y" * 3000,
    }
    with pytest.raises(UserError) as err:
        shipping.code_config_map(cfg, files)
    message = str(err.value)
    assert f"ConfigMap {cfg.ray.namespace}/{cfg.ray.cluster_name}-code" in message
    assert "at most 1,048,576" in message
    assert "raytrain_eks/resources/big.jsonl (1,200,000 bytes)" in message
    assert "--mode raycluster" in message


def test_a_package_just_under_the_limit_is_accepted(cfg):
    files = {"raytrain_eks/big.py": _incompressible(1_000_000)}  # about 0.98 MiB once gzipped and base64-encoded
    code_map, items = shipping.code_config_map(cfg, files)
    assert 0.9 * shipping.CONFIG_MAP_MAX_BYTES < shipping.config_map_bytes(code_map) <= shipping.CONFIG_MAP_MAX_BYTES
    assert items == [{"key": shipping.ARCHIVE_KEY, "path": shipping.ARCHIVE_KEY}]
