"""What a GPU node's tools print, read into facts a check can judge: ``nvidia-smi``'s GPU table, its row-remapper
query, the kernel log's NVIDIA Xid lines, ``dcgmi diag``'s result table and ``fi_info -p efa``'s EFA devices.

Each parser takes the tool's text as printed and never raises on text it does not know: a line it cannot read is
left out, so a check sees "no GPU found" rather than a traceback. Example::

    [g.uncorrected_ecc for g in gpu_table(nvidia_smi_stdout)]  # [0, 2]: GPU 1 has two uncorrectable ECC errors
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# One GPU's first line in nvidia-smi's table (driver 450 and later): "|   1  NVIDIA ... On  |   00000000:55:00.0 Off |
# 2 |". The last cell is "Volatile Uncorr. ECC": a count, or "N/A" where the GPU has no ECC (an A10G's is 0).
_GPU_ROW = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|\s+([0-9A-Fa-f:.]+)\s+\S+\s+\|\s+(\S+)\s+\|\s*$")
_DRIVER = re.compile(r"Driver Version:\s*([\d.]+)")
# The kernel log line NVIDIA's driver writes (NVIDIA's "XID Errors" guide): "NVRM: Xid (PCI:0000:55:00): 48, ...".
_XID = re.compile(r"NVRM: Xid \((PCI:[0-9A-Fa-f:.]+)\): (\d+),\s*(.*)")
# A dcgmi diag result row: "| pcie                      | Fail                                           |".
_DIAG_ROW = re.compile(r"^\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|\s*$")
_DIAG_RESULTS = ("Pass", "Fail", "Warn", "Skip")


@dataclass(frozen=True)
class Gpu:
    """One GPU of ``nvidia-smi``'s table: index, name, PCI bus id and volatile uncorrected ECC errors (``None``:
    N/A, the GPU has no ECC)."""

    index: int
    name: str
    bus_id: str
    uncorrected_ecc: int | None


@dataclass(frozen=True)
class RemappedRows:
    """One GPU's row remapper (``nvidia-smi --query-remapped-rows``): rows remapped for uncorrectable errors, a
    remap waiting for a GPU reset, a remap that failed (the GPU is out of spare rows)."""

    gpu: str
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True)
class Xid:
    """One NVIDIA Xid event of the kernel log: the GPU's PCI address, the Xid number and its text."""

    pci: str
    code: int
    text: str


@dataclass(frozen=True)
class DiagResult:
    """One test of ``dcgmi diag``: its name, ``Pass``/``Fail``/``Warn``/``Skip``, and the lines under it."""

    test: str
    result: str
    detail: tuple[str, ...] = ()


def gpu_table(text: str) -> list[Gpu]:
    """The GPUs of ``nvidia-smi``'s default table."""
    gpus = []
    for line in text.splitlines():
        match = _GPU_ROW.match(line.rstrip())
        if match:
            ecc = match.group(4)
            gpus.append(Gpu(int(match.group(1)), match.group(2), match.group(3), int(ecc) if ecc.isdigit() else None))
    return gpus


def driver_version(text: str) -> str | None:
    """The driver version ``nvidia-smi``'s table names in its heading (``535.230.02``), or ``None``."""
    match = _DRIVER.search(text)
    return match.group(1) if match else None


def remapped_rows(text: str) -> list[RemappedRows]:
    """The rows of ``nvidia-smi --query-remapped-rows=gpu_uuid,remapped_rows.correctable,
    remapped_rows.uncorrectable,remapped_rows.pending,remapped_rows.failure --format=csv``, read by its header."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = [h.strip() for h in lines[0].split(",")]
    needed = ("remapped_rows.uncorrectable", "remapped_rows.pending", "remapped_rows.failure")
    if not all(n in header for n in needed):
        return []
    rows = []
    for line in lines[1:]:
        cells = dict(zip(header, (c.strip() for c in line.split(",")), strict=False))
        gpu = cells.get("gpu_uuid") or cells.get("gpu_bus_id") or "?"
        count = cells.get("remapped_rows.uncorrectable", "")
        rows.append(
            RemappedRows(
                gpu,
                int(count) if count.isdigit() else 0,
                cells.get("remapped_rows.pending", "").lower() in ("yes", "1"),
                cells.get("remapped_rows.failure", "").lower() in ("yes", "1"),
            )
        )
    return rows


def xids(text: str) -> list[Xid]:
    """The Xid events of a kernel log (``dmesg`` or ``journalctl -k``)."""
    return [Xid(m.group(1), int(m.group(2)), m.group(3).strip()) for m in map(_XID.search, text.splitlines()) if m]


def dcgm_diag(text: str) -> list[DiagResult]:
    """The tests of ``dcgmi diag``'s table with their result and the lines under each (the metadata rows, such as
    ``DCGM Version``, are left out)."""
    results: list[DiagResult] = []
    for line in text.splitlines():
        match = _DIAG_ROW.match(line.strip())
        if not match:
            continue
        name, value = match.groups()
        verdict = value.split(" ")[0]
        if name and verdict in _DIAG_RESULTS:
            results.append(DiagResult(name, verdict))
        elif results and (not name or name == "Warning") and value:
            last = results[-1]
            results[-1] = DiagResult(last.test, last.result, (*last.detail, value))
    return results


def efa_devices(text: str) -> list[str]:
    """The EFA devices ``fi_info -p efa`` lists: its entries' ``domain`` names without the endpoint suffix
    (``rdmap16s27-rdm`` and ``rdmap16s27-dgrm`` are one device, ``rdmap16s27``)."""
    found: list[str] = []
    provider = None
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "provider":
            provider = value.strip()
        elif key == "domain" and provider == "efa":
            device = re.sub(r"-(rdm|dgrm)$", "", value.strip())
            if device not in found:
                found.append(device)
    return found
