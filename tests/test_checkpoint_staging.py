"""A background save stages the state into host buffers kept across saves (DCP's stager): the second save copies into
the same buffers, allocating none, and a resume from it reads the values of its own step, not the first save's. One
rank over gloo, the built-in model, no Ray."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raytrain_eks.train.checkpoint import checkpoint_stager, load_sharded, save_sharded
from raytrain_eks.train.model import load_model


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.new_group(backend="gloo")  # the background writes' own group, as the Ray context makes it
    dist.destroy_process_group()


def _step(model, optimizer) -> None:
    ids = torch.arange(16).reshape(1, 16)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _buffers(stager) -> dict[int, int]:
    """The stager's host buffers: id of each kept storage -> its data pointer."""
    kept = stager._state_dict_stager._cached_storage_mapping  # torch 2.13's StateDictStager cache
    return {id(storage): storage.data_ptr() for storage in kept.values()}


def test_a_second_save_reuses_the_first_ones_host_buffers_and_resumes_at_its_own_step(
    tmp_path, one_rank, builtin_model
):
    torch.manual_seed(0)
    model = load_model(builtin_model, activation_checkpointing=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    _step(model, optimizer)  # AdamW's moments exist from here on
    stager = checkpoint_stager(torch.device("cpu"))
    common = dict(model=model, optimizer=optimizer, scheduler=scheduler, rank=0, tokenizer_path=None)
    try:
        save_sharded(
            tmp_path / "one", step=1, data_position={"step": 1}, background=one_rank, stager=stager, **common
        ).result()
        first = _buffers(stager)
        _step(model, optimizer)
        save_sharded(
            tmp_path / "two", step=2, data_position={"step": 2}, background=one_rank, stager=stager, **common
        ).result()
        # Every tensor of the state was staged once, into buffers the second save copied into again.
        assert len(first) > 2 * len(list(model.parameters())) and _buffers(stager) == first
    finally:
        stager.close()
    start = load_model(builtin_model, activation_checkpointing=False).state_dict()
    fresh = load_model(builtin_model, activation_checkpointing=False)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda s: 1.0)
    state = load_sharded(tmp_path / "two", model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler, rank=0)
    assert state.step == 2 and state.data == {"step": 2}
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    assert not all(torch.equal(start[n], v) for n, v in model.state_dict().items())  # trained: not the start
    ours, theirs = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k]["exp_avg"], theirs[k]["exp_avg"]) for k in ours)
