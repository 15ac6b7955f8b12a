"""How long a job waits for its packages on the two-host world: a pip runtime_env against unpacked wheels in py_modules.

The time from ``ray job submit`` to the job's first line (the head's runtime_env ready: the driver runs in it), and
to both nodes having run a task that imports the package (each node sets the runtime_env up when its first worker
of the job starts), on the two-host world of ``tests/twohost.py`` (two network namespaces, a Ray node each, each
with a private ``/tmp`` holding Ray's session folder, as two pods have). Two ways to bring peft, the one package
AWS's Ray Train DLC lacks, beside the job's own code (``raytrain_eks`` in py_modules in both):

- ``pip``: what ``submit`` did before: ``{"pip": {"packages": ["peft>=0.21.2,<0.22"], ...}}``. Ray's pip plugin
  copies the virtualenv its nodes run from (``ray/_private/runtime_env/virtualenv_utils.py``: ``is_in_virtualenv``,
  then ``_clonevirtualenv.py``'s ``shutil.copytree`` of the whole tree but ``*.pyc``) into the session folder of
  every node, checks that Ray still imports there, then pip installs into the copy. The hosts reach no package
  index, so pip reads the wheel from a folder both see (``--no-index --find-links``, as ``submit --offline`` does);
  from PyPI a download would come on top.
- ``py_modules``: what ``submit`` does now: peft's wheel, downloaded here for the image's Python by the project's
  own wheelhouse (``k8s/wheelhouse.py``: ``build_wheelhouse``, then ``unpack_pure``), unpacked beside the package,
  its folder and its ``.dist-info`` two more py_modules entries (zipped into Ray's GCS by ``ray job submit``,
  unpacked on each node).

The "image" is a copy of this project's virtualenv (torch, transformers, accelerate, Ray with its dashboard...) made
with Ray's own clone script, less peft and raytrain-eks: it stands for the DLC's ``/opt/venv``, and both Ray nodes
and the job's ``python`` run from it, as in the DLC. Every run gets a fresh two-host Ray (nothing cached from a run
before); the runs alternate between the two ways. Also reported: what each way left in each node's
``runtime_resources`` folder.

Needs root, iproute2 and a package index reachable from this machine (peft's wheel). Example::

    .venv/bin/python benchmarks/bench_runtime_env_twohost.py --rounds 3

Human-readable lines first, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import procs  # noqa: E402
from twohost import GCS_PORT, RAY_TEMP, TwoHostCluster, requirement_missing  # noqa: E402

from raytrain_eks.k8s import job  # noqa: E402
from raytrain_eks.k8s import wheelhouse as wh  # noqa: E402

PEFT = "peft>=0.21.2,<0.22"  # job_requirements()'s range of the pinned peft
DASHBOARD_PORT = 8265
WORK = Path("/var/tmp/rtek-bench-runtime-env")  # outside /tmp: both hosts see it (each has a private /tmp)

# The job: its first line at once (its own clock: every host shares this machine's), then one task on each node
# (pinned there) that notes when it started (its node's runtime_env set up and a worker started in it), imports peft
# (which imports torch and transformers: seconds on this machine, the same in both ways) and raytrain_eks there, and
# notes when that was done.
JOB = """\
import time
print(f"BENCH first-line {time.time():.3f}", flush=True)
import json, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address="auto", log_to_driver=False)

@ray.remote(num_cpus=0)
def probe():
    import time
    started = time.time()
    import importlib.metadata
    import peft, raytrain_eks
    return {"node": ray.get_runtime_context().get_node_id()[:8], "peft": peft.__file__,
            "version": importlib.metadata.version("peft"), "started": started, "imported": time.time()}

nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
pinned = [NodeAffinitySchedulingStrategy(n, soft=False) for n in nodes]
got = ray.get([probe.options(scheduling_strategy=s).remote() for s in pinned])
print("BENCH ready " + json.dumps({"time": time.time(), "nodes": got}), flush=True)
"""


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} ... failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return done


def make_image(image: Path) -> None:
    """The stand-in image: this virtualenv copied with Ray's own clone script, less peft and raytrain-eks."""
    if (image / "bin" / "python").exists():
        return
    import ray

    clone = Path(ray.__file__).parent / "_private" / "runtime_env" / "_clonevirtualenv.py"
    print(f"making the stand-in image's virtualenv at {image} (a copy of {sys.prefix})", flush=True)
    _run([sys.executable, str(clone), sys.prefix, str(image)], timeout=1800)
    pip = [str(image / "bin" / "python"), "-m", "pip", "uninstall", "--yes", "--disable-pip-version-check"]
    _run([*pip, "peft", "raytrain-eks"], timeout=600)


def shipped_peft(image: Path, folder: Path) -> tuple[wh.Wheelhouse, wh.Unpacked]:
    """peft's wheel for the image's Python (and any dependency it does not meet), and unpacked, as submit does."""
    python = str(image / "bin" / "python")
    probe = wh.ImagePython.from_probe(json.loads(_run([python, "-c", wh.IMAGE_PLATFORM], timeout=120).stdout))

    def installed(names: list[str]) -> dict[str, str | None]:
        return json.loads(_run([python, "-c", job.IMAGE_VERSIONS, *names], timeout=120).stdout)

    house = wh.build_wheelhouse([PEFT], probe, folder, installed=installed)
    unpacked = wh.unpack_pure(house)
    if isinstance(unpacked, str):
        raise SystemExit(f"peft cannot travel unpacked: {unpacked}")
    return house, unpacked


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def start_ray(cluster: TwoHostCluster, image: Path) -> None:
    """A head with its dashboard (the job API) on host 0 and a worker node on host 1, both of the image's Ray."""
    ray = str(image / "bin" / "ray")
    common = ["--num-cpus=1", "--object-store-memory=268435456", "--disable-usage-stats", f"--temp-dir={RAY_TEMP}"]
    head = [ray, "start", "--head", f"--node-ip-address={cluster.ips[0]}", f"--port={GCS_PORT}", *common]
    head += ["--include-dashboard=true", f"--dashboard-host={cluster.ips[0]}", f"--dashboard-port={DASHBOARD_PORT}"]
    head += [f"--system-config={json.dumps(procs.TEST_RAY_SYSTEM_CONFIG)}"]
    cluster.run(head, host=0, timeout=300, check=True)
    worker = [ray, "start", f"--address={cluster.address}", f"--node-ip-address={cluster.ips[1]}", *common]
    cluster.run(worker, host=1, timeout=300, check=True)
    cluster.wait_for_nodes(2, timeout=180)


def folder_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            if not os.path.islink(full):
                total += os.path.getsize(full)
    return total


def one_run(way: str, env: dict[str, Any], image: Path) -> dict[str, Any]:
    """A fresh two-host Ray, the job submitted once with ``env``: the seconds to its first line and to both nodes
    ready, and the bytes each node's ``runtime_resources`` holds afterwards."""
    with TwoHostCluster(start_ray=False) as cluster:
        # The job's `python` is the image's, as /opt/venv/bin comes first on the DLC's PATH.
        cluster.env["PATH"] = f"{image / 'bin'}:{cluster.env.get('PATH', '')}"
        start_ray(cluster, image)
        submit = [str(image / "bin" / "ray"), "job", "submit", "--address", f"http://{cluster.ips[0]}:{DASHBOARD_PORT}"]
        submit += ["--runtime-env-json", json.dumps(env), "--", "python", "-c", JOB]
        started = time.time()
        done = cluster.run(submit, host=0, timeout=1200)
        ended = time.time()
        out = done.stdout + done.stderr
        first = [ln for ln in out.splitlines() if ln.startswith("BENCH first-line ")]
        ready = [ln for ln in out.splitlines() if ln.startswith("BENCH ready ")]
        if done.returncode != 0 or not first or not ready:
            raise SystemExit(f"the {way} job failed (exit {done.returncode}):\n{out[-4000:]}")
        report = json.loads(ready[0].removeprefix("BENCH ready "))
        sizes = []
        for host in range(2):
            # session_latest links to the session's folder by its path inside the host.
            latest = os.readlink(cluster.host_path(host, f"{RAY_TEMP}/session_latest"))
            sizes.append(folder_bytes(cluster.host_path(host, latest) / "runtime_resources"))
    return {
        "way": way,
        "first_line_s": round(float(first[0].split()[-1]) - started, 2),
        "both_nodes_s": round(max(n["started"] for n in report["nodes"]) - started, 2),
        "both_imported_s": round(max(n["imported"] for n in report["nodes"]) - started, 2),
        "submit_returned_s": round(ended - started, 2),
        "runtime_resources_bytes": sizes,
        "peft": [n["peft"] for n in report["nodes"]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="runs of each way (default 3), alternating")
    p.add_argument("--image", type=Path, default=WORK / "image-venv", help="the stand-in image's virtualenv")
    args = p.parse_args(argv)
    missing = requirement_missing()
    if missing:
        print(f"cannot run: {missing}", file=sys.stderr)
        return 2
    make_image(args.image)
    image_bytes = folder_bytes(args.image)
    print(f"stand-in image: {args.image} ({image_bytes / 2**30:.2f} GiB, peft and raytrain-eks removed)", flush=True)
    shutil.rmtree(WORK / "job", ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="rtek-bench-wheels-") as tmp:
        house, unpacked = shipped_peft(args.image, Path(tmp))
        for line in house.lines():
            print(line, flush=True)
        wheels = WORK / "job" / "wheels"
        wheels.mkdir(parents=True)
        for w in house.wheels:
            shutil.copy2(house.folder / w.name, wheels / w.name)
    code = WORK / "job" / "code"
    write_files(code, {name: text.encode() for name, text in job.package_files().items()})
    packages = WORK / "job" / "packages"
    write_files(packages, unpacked.files)
    print(f"py_modules: {unpacked.describe()}", flush=True)
    envs = {
        "pip": job.runtime_env(str(code), [PEFT], wh.pip_options(house.digest, str(wheels))),
        "py_modules": job.runtime_env(str(code), [], modules=job.shipped_modules(str(packages), unpacked)),
    }
    runs = []
    for r in range(args.rounds):
        for way in ("pip", "py_modules") if r % 2 == 0 else ("py_modules", "pip"):
            run = one_run(way, envs[way], args.image)
            runs.append(run)
            sizes = ", ".join(f"{b / 2**20:,.1f} MiB" for b in run["runtime_resources_bytes"])
            first, both, imported = run["first_line_s"], run["both_nodes_s"], run["both_imported_s"]
            print(
                f"round {r + 1} {way:>10}: first line {first:6.2f} s, a task running on both nodes {both:6.2f} s",
                end="",
            )
            print(f" (peft imported there {imported:6.2f} s), ", end="")
            print(f"runtime_resources per node {sizes}", flush=True)
    summary = {}
    for way in envs:
        mine = [r for r in runs if r["way"] == way]
        summary[way] = {
            "first_line_s_median": statistics.median(r["first_line_s"] for r in mine),
            "both_nodes_s_median": statistics.median(r["both_nodes_s"] for r in mine),
            "both_imported_s_median": statistics.median(r["both_imported_s"] for r in mine),
            "runtime_resources_mib_per_node": round(
                statistics.median(b for r in mine for b in r["runtime_resources_bytes"]) / 2**20, 1
            ),
        }
        s = summary[way]
        print(
            f"{way:>10} (median of {len(mine)}): first line {s['first_line_s_median']:.2f} s, a task running on both "
            f"nodes {s['both_nodes_s_median']:.2f} s (peft imported there {s['both_imported_s_median']:.2f} s), "
            f"{s['runtime_resources_mib_per_node']:,.1f} MiB per node"
        )
    print(json.dumps({"image_bytes": image_bytes, "envs": envs, "runs": runs, "summary": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
