"""The environment the training workers start with (Ray gives them the raylet's, not the driver's): what the job
needs is passed explicitly, and the GPU workers' caching allocator grows its segments in place."""

from __future__ import annotations

import pytest

from raytrain_eks.config import load_config
from raytrain_eks.train.worker_env import worker_environment


def test_gpu_workers_get_expandable_segments_unless_the_user_chose_an_allocator_setting(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cfg = load_config(environ={}, path=None)
    assert worker_environment(cfg, "run", use_gpu=True)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in worker_environment(cfg, "run", use_gpu=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert worker_environment(cfg, "run", use_gpu=True)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


@pytest.mark.parametrize(("require", "evidence"), [("efa", True), ("any", False)])
def test_nccl_writes_its_evidence_only_where_the_transport_is_checked(monkeypatch, require, evidence):
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    cfg = load_config(environ={}, path=None, sets=[f"fabric.require={require}"])
    env = worker_environment(cfg, "run-1", use_gpu=True)
    assert ("NCCL_DEBUG_FILE" in env) is evidence
    if evidence:
        assert env["NCCL_DEBUG"] == "INFO" and "run-1" in env["NCCL_DEBUG_FILE"]
