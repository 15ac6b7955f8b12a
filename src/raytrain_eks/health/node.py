"""The checks of one GPU node, run in a pod on it: every GPU seen and free of uncorrectable ECC errors, no pending
or failed row remap, no hardware Xid in the kernel log (where the pod may read it), DCGM's level-1 diagnostic
(where the image has ``dcgmi``), the EFA devices libfabric sees against the instance type's EFA interfaces, and the
NVIDIA driver against the one the image's CUDA needs (where this tool knows the image's CUDA).

:func:`check_node` takes how to run a command in that pod, so the same checks run through ``kubectl exec`` in a Ray
worker pod or anywhere else. Example::

    health = check_node("ip-10-0-1-5", "ray-worker-abc", lambda argv: kube.exec(ns, pod, argv, timeout=120),
                        Expectation(gpus=4, efa=1))
    health.ok, [f.line() for f in health.failures()]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raytrain_eks.health import parsers
from raytrain_eks.k8s.cluster import ExecResult
from raytrain_eks.k8s.cuda import driver_version

Run = Callable[[list[str]], ExecResult]

#: ``nvidia-smi``'s query of the row remapper (Ampere and later), read by its header (:func:`parsers.remapped_rows`).
REMAP_QUERY = [
    "nvidia-smi",
    "--query-remapped-rows=gpu_uuid,remapped_rows.correctable,remapped_rows.uncorrectable,remapped_rows.pending,"
    "remapped_rows.failure",
    "--format=csv",
]
#: DCGM's short diagnostic: seconds, meant as a readiness check before a workload (NVIDIA's DCGM user guide, "DCGM
#: Diagnostics", run levels: "Level 1 tests to use as a readiness metric").
DCGM_DIAG = ["dcgmi", "diag", "-r", "1"]
#: Xids that say the GPU or its memory is at fault rather than the program that ran on it (NVIDIA's "XID Errors"
#: catalog): 48 double-bit ECC error, 64 row remap or page retirement failed, 74 NVLink error, 79 fallen off the
#: bus, 92 high single-bit ECC rate, 94/95 contained/uncontained ECC error, 119/120 GSP timeout or error, 154 the
#: driver asks for a recovery action (drain and reset). 13, 31 and 43 (a program's fault) and 63 (a row marked for
#: remapping, which the remapper query reports) are left out.
HARDWARE_XIDS = frozenset({48, 64, 74, 79, 92, 94, 95, 119, 120, 154})
_NOT_FOUND = 127  # a shell's and kubectl exec's status when the program is not in the image


@dataclass(frozen=True)
class Expectation:
    """What each node should show: its pod's GPUs, the EFA devices the instance type has (0: none expected), and the
    oldest NVIDIA driver the image's CUDA runs on (``None``: the image's CUDA is not known, the driver not judged)."""

    gpus: int
    efa: int
    min_driver: tuple[int, int] | None = None
    image_cuda: str | None = None


@dataclass(frozen=True)
class Finding:
    """One check's verdict on a node: ``ok`` ``True`` or ``False``, ``None`` when it could not be checked there
    (the tool missing or the log unreadable), with the evidence as the tool printed it."""

    check: str
    ok: bool | None
    evidence: str

    def line(self) -> str:
        mark = {True: "ok", False: "FAIL", None: "not checked"}[self.ok]
        return f"{self.check}: {mark} - {self.evidence}"


@dataclass(frozen=True)
class NodeHealth:
    """Every check of one node, and the pod they ran in."""

    node: str
    pod: str
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return all(f.ok is not False for f in self.findings)

    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.ok is False]


def check_node(node: str, pod: str, run: Run, expect: Expectation) -> NodeHealth:
    """Run every check of one node through ``run`` (a command in a pod on that node)."""
    findings = [*_gpus(run, expect), _remaps(run), _xids(run), _dcgm(run), _efa(run, expect)]
    return NodeHealth(node, pod, tuple(findings))


def _said(res: ExecResult) -> str:
    lines = (res.stderr or res.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {res.returncode}"


def _gpus(run: Run, expect: Expectation) -> list[Finding]:
    res = run(["nvidia-smi"])
    if not res.ok:
        return [Finding("gpus", False, f"nvidia-smi failed: {_said(res)}")]
    gpus = parsers.gpu_table(res.stdout)
    driver = parsers.driver_version(res.stdout)
    seen = Finding(
        "gpus",
        len(gpus) >= expect.gpus,
        f"{len(gpus)} of {expect.gpus} GPUs seen (driver {driver or 'unknown'})",
    )
    bad = [g for g in gpus if g.uncorrected_ecc]
    ecc = Finding(
        "ecc",
        not bad,
        "; ".join(f"GPU {g.index} ({g.bus_id}): {g.uncorrected_ecc} volatile uncorrectable ECC errors" for g in bad)
        or "no uncorrectable ECC errors",
    )
    return [seen, ecc, _driver(driver, expect)]


def _driver(driver: str | None, expect: Expectation) -> Finding:
    """The node's driver against the oldest one the image's CUDA runs on: an older driver fails the job's first CUDA
    call ("CUDA driver version is insufficient for CUDA runtime version")."""
    if expect.min_driver is None:
        return Finding("driver", None, f"{driver or 'unknown'}; the CUDA of the image is not known here")
    found = driver_version(driver or "")
    need = ".".join(map(str, expect.min_driver)).removesuffix(".0")
    if found is None:
        return Finding("driver", None, f"nvidia-smi named no driver version; CUDA {expect.image_cuda} needs {need}+")
    words = f"{driver}, CUDA {expect.image_cuda} of the image needs {need} or later"
    return Finding("driver", found >= expect.min_driver, words)


def _remaps(run: Run) -> Finding:
    res = run(REMAP_QUERY)
    rows = parsers.remapped_rows(res.stdout) if res.ok else []
    if not rows:
        return Finding("row remap", None, f"not reported here ({_said(res)})")
    bad = [r for r in rows if r.pending or r.failure]
    words = [f"{r.gpu}: {'remap failed' if r.failure else 'remap pending a GPU reset'}" for r in bad]
    return Finding("row remap", not bad, "; ".join(words) or f"{len(rows)} GPUs: none pending or failed")


def _xids(run: Run) -> Finding:
    res = run(["dmesg"])
    if not res.ok:
        return Finding("xid", None, f"kernel log not readable from the pod ({_said(res)})")
    events = [x for x in parsers.xids(res.stdout) if x.code in HARDWARE_XIDS]
    shown = "; ".join(f"Xid {x.code} on {x.pci}: {x.text}" for x in events[:3])
    more = f" (+{len(events) - 3} more)" if len(events) > 3 else ""
    return Finding("xid", not events, shown + more if events else "no hardware Xid in the kernel log")


def _dcgm(run: Run) -> Finding:
    res = run(DCGM_DIAG)
    if res.returncode == _NOT_FOUND:
        return Finding("dcgm diag", None, "dcgmi is not in the image")
    results = parsers.dcgm_diag(res.stdout)
    if not results:
        return Finding("dcgm diag", False, f"dcgmi diag -r 1 gave no result: {_said(res)}")
    failed = [r for r in results if r.result == "Fail"]
    words = [f"{r.test} Fail{': ' + ' '.join(r.detail) if r.detail else ''}" for r in failed]
    return Finding("dcgm diag", not failed, "; ".join(words) or f"{len(results)} tests passed")


def _efa(run: Run, expect: Expectation) -> Finding:
    res = _fi_info(run)
    devices = parsers.efa_devices(res.stdout) if res.ok else []
    if expect.efa == 0:
        return Finding("efa", None if not devices else True, f"{len(devices)} EFA devices (none expected)")
    names = f" ({', '.join(devices)})" if devices else f": {_said(res)}"
    return Finding("efa", len(devices) >= expect.efa, f"{len(devices)} of {expect.efa} EFA devices{names}")


def _fi_info(run: Run) -> ExecResult:
    res = ExecResult(_NOT_FOUND, "", "fi_info not found")
    for exe in ("fi_info", "/opt/amazon/efa/bin/fi_info"):  # the EFA installer's place when it is not on PATH
        res = run([exe, "-p", "efa"])
        if res.returncode != _NOT_FOUND:
            return res
    return res


def table(nodes: Sequence[NodeHealth]) -> list[str]:
    """Readable lines: each node with its verdict, then each of its checks with the evidence."""
    lines = []
    for h in nodes:
        lines.append(f"{h.node} (pod {h.pod}): {'healthy' if h.ok else 'FAILED'}")
        lines.extend(f"  {f.line()}" for f in h.findings)
    return lines
