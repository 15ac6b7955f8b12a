"""A training step that does not log never makes the host wait for the device.

A host waits when it reads a value the device computed (``.item()``, ``bool(tensor)``, a data-dependent shape): on
a GPU every such read stalls the queue of kernels. On the meta device every tensor has a shape and no value, so
such a read raises there: a whole ``train_step`` (forward, chunked loss, backward, gradient clipping, AdamW, the
schedule) that runs on meta reads nothing from the device, for each architecture of the loss test, packed rows or
not, with gradient accumulation. The host's own work (counting the batch's trained tokens, deciding whether its rows
are packed) reads CPU tensors only. FSDP refuses parameters on meta, so sharding is not part of it here:
``benchmarks/gpu_check.py`` counts the reads of the sharded step on a GPU under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import transformers
from test_loss_architectures import ARCHITECTURES, SMALL
from torch.testing._internal.distributed.fake_pg import FakeStore

from raytrain_eks.config import BUILTIN_MODEL, TrainingConfig
from raytrain_eks.train.data.packing import pack
from raytrain_eks.train.loop import PreparedModel, train_step
from raytrain_eks.train.model import output_projection_deferred

META = torch.device("meta")
SEQ = 32


@pytest.fixture(scope="module")
def fake_world():
    """A process group of one whose collectives leave tensors as they are (torch's own test backend), so that
    collectives on meta tensors need no transport."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    """Two micro-batches as the data cursor hands them (host tensors): one block of three packed rows, one block
    holding a single row (no ``position_ids`` reach the model for it)."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, SMALL["vocab_size"], (n,), generator=gen).tolist() for n in (10, 12, 7)]
    packed = pack([(r, r) for r in rows], seq_len=SEQ, pad_id=0)
    single = pack([(list(range(3, 3 + SEQ)), list(range(3, 3 + SEQ)))], seq_len=SEQ, pad_id=0)
    return [{k: torch.from_numpy(v.astype(np.int64)) for k, v in b.items()} for b in (packed, single)]


def _meta_model(arch: str):
    name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, name)(**SMALL, **extra)
    # A mixture of experts' grouped matrix product takes bf16 on a device (FSDP's bf16 compute on GPUs gives it
    # that); the others in the fp32 the loss test uses.
    dtype = torch.bfloat16 if arch == "qwen3-moe" else torch.float32
    with META:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


def _step(model) -> None:
    """One training step of ``model`` on meta, unsharded (the job's way on one rank)."""
    head = output_projection_deferred(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    cfg = TrainingConfig(model_id=BUILTIN_MODEL, steps=1, seq_len=SEQ, batch_size=1, precision="fp32")
    result = train_step(
        PreparedModel(model, head, 0, 0),
        optimizer,
        scheduler,
        _micro_batches(),
        cfg=cfg,
        mode="none",
        world_size=1,
        device=META,
    )
    assert result.loss_sum.device == META and result.grad_norm.device == META  # nothing was read back


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_training_step_reads_nothing_back_from_the_device(arch, fake_world):
    _step(_meta_model(arch))


def test_the_meta_step_catches_a_read(fake_world):
    """The premise: a step that reads a device value fails here (transformers' own mask code asks the device
    whether a batch's rows are packed when it is not told)."""
    model = _meta_model("qwen2")
    packed = _micro_batches()[0]
    with pytest.raises(RuntimeError, match="meta"):
        model(input_ids=packed["input_ids"].to(META), position_ids=packed["position_ids"].to(META))
