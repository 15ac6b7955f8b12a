"""Memory admission on what a GPU must hold: the estimate's peak times the allocator's measured margin, plus the fixed
terms outside torch's tensors (the CUDA context, NCCL's buffers per communicator, cuBLAS's workspaces per
architecture), each named in the line a plan or run says. Hermetic: the memory model only."""

from __future__ import annotations

import pytest

from raytrain_eks.config import load_config
from raytrain_eks.train.memory import (
    GIB,
    KNOWN_SHAPES,
    MIB,
    RESERVED_PER_ALLOCATED,
    DoesNotFit,
    check_fit,
    estimate,
    fixed_bytes,
    layout_communicators,
    planned_layout,
    refuse_unless_fits,
)

QWEN = KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]


def test_the_fixed_terms_by_gpu_and_sharding():
    hsdp, fsdp, alone = (fixed_bytes("NVIDIA H100 80GB HBM3", n) for n in (3, 1, 0))
    assert set(hsdp) == {"CUDA context", "NCCL buffers", "cuBLAS workspace"}
    # 4 MiB (NCCL_BUFFSIZE) x 32 channels x 2 peers per communicator; three under HSDP.
    assert (alone["NCCL buffers"], fsdp["NCCL buffers"], hsdp["NCCL buffers"]) == (0, 256 * MIB, 768 * MIB)
    assert hsdp["cuBLAS workspace"] == 64 * MIB  # Hopper: 32 MiB for cuBLAS and 32 for cuBLASLt
    assert fixed_bytes("NVIDIA L4", 1)["cuBLAS workspace"] == 8 * MIB + 128 * 2**10 + 4 * MIB


def test_hsdp_holds_more_than_fsdp_and_the_reference_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ={"MODEL_ID": "Qwen/Qwen2.5-1.5B"})  # the reference: 2 nodes x 4 L4s, HSDP
    hsdp = planned_layout(cfg)
    fsdp = planned_layout(cfg.model_copy(update={"training": cfg.training.model_copy(update={"sharding": "fsdp"})}))
    assert (hsdp.mode, layout_communicators(hsdp), fsdp.mode, layout_communicators(fsdp)) == ("hsdp", 3, "fsdp", 1)
    common = dict(gpu_bytes=22888 * MIB, gpu_name="L4", shard_ranks=4, precision="bf16", micro_batch=2, seq_len=1024)
    on_hsdp = check_fit(QWEN, activation_checkpointing=False, communicators=3, **common)
    on_fsdp = check_fit(QWEN, activation_checkpointing=False, communicators=1, **common)
    assert on_hsdp.reserved_bytes - on_fsdp.reserved_bytes == 512 * MIB
    assert on_hsdp.to_dict()["reserved_gib"] > on_fsdp.to_dict()["reserved_gib"]
    assert on_hsdp.line.endswith("GiB reserved with the allocator and fixed terms, of 22.4 GiB L4")


def test_a_run_admitted_at_the_edge_by_the_old_rule_is_refused_naming_the_terms():
    common = dict(shard_ranks=8, precision="bf16", micro_batch=2, seq_len=2048, activation_checkpointing=True)
    peak = estimate(QWEN, **common).peak_bytes
    gpu = int(peak / 0.84)  # within the 85% of the GPU that admitted a run before
    check = check_fit(QWEN, gpu_bytes=gpu, gpu_name="H100", communicators=1, **common)
    assert not check.fits
    assert check.reserved_bytes == int(peak * RESERVED_PER_ALLOCATED) + GIB + 256 * MIB + 64 * MIB
    with pytest.raises(DoesNotFit) as refused:
        refuse_unless_fits(check)
    assert (
        f"reserved (the peak x {RESERVED_PER_ALLOCATED} for the allocator; CUDA context 1.00, NCCL buffers 0.25, "
        "cuBLAS workspace 0.06 GiB), over the"
    ) in refused.value.message
    # With room for the margin and the terms it is admitted.
    roomy = check_fit(QWEN, gpu_bytes=check.reserved_bytes, gpu_name="H100", communicators=1, **common)
    assert roomy.fits
