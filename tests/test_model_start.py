"""Start-up of a sharded model: only rank 0 reads the weights; the other ranks build the model on the meta device
(no memory) and receive their shard, and every buffer, from rank 0. Two gloo processes on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raytrain_eks.train.model import fill_from_rank0, load_model, load_model_shell
from raytrain_eks.train.sharding import apply_fsdp

pytestmark = pytest.mark.integration


def _rank(rank: int, world: int, store: str, model_path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        if rank == 0:
            model = load_model(model_path, activation_checkpointing=False)
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            model, full = load_model_shell(model_path, activation_checkpointing=False), None
            assert all(p.is_meta for p in model.parameters()), "a shell holds no weights"
        apply_fsdp(model, precision="fp32")
        fill_from_rank0(model, full, torch.device("cpu"))
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        buffers = {k: b.clone() for k, b in model.named_buffers()}
        if rank == world - 1:
            torch.save({"state": state, "buffers": buffers}, out)
        dist.barrier()  # both ranks leave the group together
    finally:
        dist.destroy_process_group()


def test_a_rank_that_read_nothing_gets_rank_0s_weights_and_buffers(tmp_path: Path, builtin_model: str):
    out = tmp_path / "last-rank.pt"
    args = ["2", str(tmp_path / "store"), builtin_model, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen([sys.executable, __file__, str(r), *args], env=env, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    errors = [p.communicate(timeout=300)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(e[-3000:] for e in errors)
    got = torch.load(out)
    want = load_model(builtin_model, activation_checkpointing=False)
    expected = want.state_dict()
    assert set(got["state"]) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got["state"][name], tensor), name
    buffers = dict(want.named_buffers())
    assert buffers and set(got["buffers"]) == set(buffers)  # rotary frequencies are not in the state dict
    for name, buffer in buffers.items():
        assert torch.equal(got["buffers"][name], buffer), name


if __name__ == "__main__":  # one rank of the test above: RANK WORLD STORE MODEL OUT
    _rank(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the torchrun entry does: no interpreter shutdown racing gloo's threads (SIGABRT at exit)
