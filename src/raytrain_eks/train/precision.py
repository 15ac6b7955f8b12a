"""Which precision a run computes in: ``training.precision`` resolved against the device the workers have.

``auto`` means bf16 where the hardware multiplies bf16 natively (a GPU with bf16 support, a CPU with AVX512-BF16,
AMX or Arm's BF16 extension) and fp32 elsewhere: on a CPU without native bf16, PyTorch emulates bf16 matrix
multiplications, tens of times slower than fp32. An explicit ``bf16`` or ``fp32`` is used as given. Example::

    precision, why = resolve_precision("auto", torch.device("cpu"))   # ("fp32", "auto: the CPU has no native bf16 ...")
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from pathlib import Path

import torch

# CPU feature flags that mean native bf16 arithmetic, as /proc/cpuinfo spells them.
_X86_BF16 = {"avx512_bf16", "amx_bf16"}
_ARM_BF16 = {"bf16"}


def cpu_has_native_bf16(machine: str, flags: Iterable[str]) -> bool:
    """Whether a CPU of architecture ``machine`` (``platform.machine()``) with these feature ``flags`` does bf16
    natively. Unknown architectures count as not native (fp32 is always correct, only slower)."""
    arch = machine.lower()
    have = {f.lower() for f in flags}
    if arch in {"x86_64", "amd64", "i686", "i386"}:
        return bool(have & _X86_BF16)
    if arch in {"aarch64", "arm64"}:
        return bool(have & _ARM_BF16)
    return False


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (x86 ``flags``, Arm ``Features``); empty where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux: no /proc; treated as no native bf16
        return set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in {"flags", "features"}:
            return set(value.split())
    return set()


def resolve_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """``(precision, reason)``: ``bf16`` or ``fp32`` for ``requested`` (auto, bf16 or fp32) on ``device``."""
    if requested in {"bf16", "fp32"}:
        return requested, "as configured"
    if requested != "auto":
        raise ValueError(f"precision must be auto, bf16 or fp32, not {requested!r}")
    if device.type == "cuda":
        # Not counting emulation: a GPU without bf16 tensor cores (T4, V100) would run it far slower than fp32.
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", "auto: the GPU supports bf16"
        return "fp32", "auto: the GPU has no bf16 support"
    if device.type == "cpu":
        if cpu_has_native_bf16(platform.machine(), cpu_flags()):
            return "bf16", "auto: the CPU has native bf16"
        return "fp32", "auto: the CPU has no native bf16 (emulated bf16 is far slower than fp32)"
    return "fp32", f"auto: no bf16 check for {device.type} devices"
