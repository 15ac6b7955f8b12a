"""Precision: ``auto`` resolves from the device (native bf16 or not), explicit values win, and the policy and the
MFU read the resolved value, never ``auto``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytrain_eks import presets
from raytrain_eks.config import load_config
from raytrain_eks.errors import ConfigError
from raytrain_eks.train import precision as precision_module
from raytrain_eks.train.flops import peak_flops_for
from raytrain_eks.train.precision import cpu_flags, cpu_has_native_bf16, resolve_precision
from raytrain_eks.train.sharding import mixed_precision

# A Cascade Lake-like x86 CPU: AVX-512 but no bf16 instructions (bf16 matmuls are emulated there).
AVX512_ONLY = {"fpu", "sse4_2", "avx2", "avx512f", "avx512bw", "avx512_vnni"}


@pytest.mark.parametrize(
    ("machine", "flags", "native"),
    [
        ("x86_64", AVX512_ONLY, False),
        ("x86_64", AVX512_ONLY | {"avx512_bf16"}, True),  # Cooper Lake, Zen 4
        ("x86_64", AVX512_ONLY | {"amx_bf16", "amx_tile"}, True),  # Sapphire Rapids
        ("AMD64", {"AVX512_BF16"}, True),  # spelling of platform.machine() and flags does not matter
        ("x86_64", {"bf16"}, False),  # the Arm flag name means nothing on x86
        ("aarch64", {"fp", "asimd", "sve", "bf16", "i8mm"}, True),  # Graviton 3/4
        ("aarch64", {"fp", "asimd", "atomics"}, False),  # Graviton 2
        ("arm64", {"bf16"}, True),
        ("riscv64", {"bf16", "avx512_bf16"}, False),  # unknown architecture: fp32, always correct
        ("x86_64", set(), False),
    ],
)
def test_native_bf16_detection(machine, flags, native):
    assert cpu_has_native_bf16(machine, flags) is native


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx512f amx_bf16\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd bf16\nCPU part\t: 0xd40\n")
    assert cpu_flags(x86) == {"fpu", "avx512f", "amx_bf16"}
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize(("flags", "expected"), [(AVX512_ONLY, "fp32"), (AVX512_ONLY | {"avx512_bf16"}, "bf16")])
def test_auto_on_cpu_follows_the_flags(monkeypatch, flags, expected):
    monkeypatch.setattr(precision_module.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: flags)
    chosen, reason = resolve_precision("auto", torch.device("cpu"))
    assert chosen == expected and reason.startswith("auto:")


@pytest.mark.parametrize("explicit", ["bf16", "fp32"])
def test_explicit_precision_wins(monkeypatch, explicit):
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: AVX512_ONLY)
    assert resolve_precision(explicit, torch.device("cpu")) == (explicit, "as configured")


def test_auto_is_the_default_and_bad_values_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(environ={}).training.precision == "auto"
    assert load_config(preset=presets.local_tiny(), environ={}).training.precision == "auto"
    with pytest.raises(ConfigError, match=r"training\.precision.*fp16"):
        load_config(environ={}, overrides={"training": {"precision": "fp16"}})


def test_policy_and_peak_take_only_a_resolved_precision():
    assert mixed_precision("bf16").param_dtype == torch.bfloat16
    assert mixed_precision("fp32").param_dtype is None
    with pytest.raises(ValueError, match="resolved precision"):
        mixed_precision("auto")
    # The peak table is bf16: an fp32 run gets no MFU rather than one against the wrong peak.
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "fp32") is None
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "auto") is None


def test_this_machine_reads_its_own_flags():
    # On Linux the flags come from /proc/cpuinfo; elsewhere the set is empty and auto means fp32.
    flags = cpu_flags()
    assert bool(flags) == Path("/proc/cpuinfo").is_file()
