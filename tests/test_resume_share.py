"""A resume from S3 (moto's server on loopback) downloads only what its rank reads, and loads exactly.

Two gloo processes save a checkpoint of the built-in model, sharded with FSDP2, with AdamW's moments, to S3 as a run
does (``save_sharded`` into a staging folder, uploaded as Ray Train's report uploads it, then ``mark_complete``);
each then loads it from the ``s3://`` URI with ``load_sharded`` into a fresh model and optimizer. Then one process
resumes the same two-rank checkpoint alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.usefixtures("starts_ray")

BUCKET = "raytrain-eks-resume"
URI = f"s3://{BUCKET}/runs/r/ray/checkpoint_00000001"


def _fresh(model_path: str) -> tuple[Any, Any, Any]:
    """The built-in model (the same weights on every rank), sharded, with a fresh AdamW and schedule."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from raytrain_eks.train.sharding import apply_fsdp

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
    apply_fsdp(model, precision="fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _whole(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every weight and AdamW moment, gathered whole (a collective)."""
    out = {}
    for name, param in model.named_parameters():
        for key, value in [("weight", param), *optimizer.state.get(param, {}).items()]:
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"{name}:{key}"] = full.detach().clone()
    return out


def _rank(mode: str, rank: int, world: int, store: str, model_path: str, out: str) -> None:
    """``save``: train one step, save to S3, then load it back into a fresh model; ``load``: only the latter."""
    import torch.distributed.checkpoint as dcp
    from pyarrow import fs as pafs

    from raytrain_eks.train import checkpoint
    from raytrain_eks.train.storage import filesystem

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    folder = Path(out)
    if mode == "save":
        model, optimizer, scheduler = _fresh(model_path)
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        saved = _whole(model, optimizer)
        assert len(saved) > 2 * len(list(model.parameters())), "AdamW's moments exist"
        staging = folder / f"staging-{rank}"
        checkpoint.save_sharded(
            staging,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            step=1,
            data_position={"epoch": 0, "sample": 4},
            rank=rank,
            tokenizer_path=model_path,
        )
        fs, base = filesystem(URI)  # what Ray Train's report does with a rank's folder
        pafs.copy_files(str(staging), base, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
        dist.barrier()
        if rank == 0:
            checkpoint.mark_complete(URI, step=1, world_size=world)
            torch.save(saved, folder / "saved.pt")
        dist.barrier()
        del model, optimizer, scheduler

    seen: dict[str, Any] = {}
    load = dcp.load

    def looking(state: Any, *, checkpoint_id: str, **kwargs: Any) -> Any:  # the local folder DCP reads
        files = [p for p in Path(checkpoint_id).rglob("*") if p.is_file()]
        seen["folder"] = checkpoint_id
        seen["stored"] = sum(p.stat().st_blocks * 512 for p in files)
        return load(state, checkpoint_id=checkpoint_id, **kwargs)

    dcp.load = looking
    model, optimizer, scheduler = _fresh(model_path)
    state = checkpoint.load_sharded(URI, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
    loaded = _whole(model, optimizer)
    if rank == 0:
        torch.save(loaded, folder / f"loaded-{mode}.pt")
    result = {
        "step": state.step,
        "data": state.data,
        "read": state.read_bytes,
        "total": state.checkpoint_bytes,
        "note": state.note,
        "lr": scheduler.get_last_lr(),
        "folder": seen["folder"],
        "stored": seen["stored"],
        "left": Path(seen["folder"]).exists(),
    }
    (folder / f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # both ranks leave the group together
    dist.destroy_process_group()


def _run(mode: str, world: int, tmp_path: Path, builtin_model: str) -> list[dict[str, Any]]:
    store = tmp_path / f"store-{mode}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__, mode, str(r), str(world), str(store), builtin_model, str(tmp_path)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    errors = [p.communicate(timeout=300)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [0] * world, "\n".join(e[-3000:] for e in errors)
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in range(world)]


def test_a_resume_from_s3_reads_only_its_ranks_share_and_loads_exactly(tmp_path, builtin_model, aws_env, monkeypatch):
    import boto3

    from raytrain_eks.train.context import _TEMP_FOLDER

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)

    two = _run("save", 2, tmp_path, builtin_model)
    objects = s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/r/ray/checkpoint_00000001/")["Contents"]
    total = sum(o["Size"] for o in objects)
    shards = sum(o["Size"] for o in objects if o["Key"].endswith(".distcp"))
    assert len([o for o in objects if o["Key"].endswith(".distcp")]) == 8  # 4 files per rank
    saved = torch.load(tmp_path / "saved.pt")
    loaded = torch.load(tmp_path / "loaded-save.pt")  # gathered from both ranks' loaded shards
    assert loaded.keys() == saved.keys()
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []
    for rank, got in enumerate(two):
        assert got["step"] == 1 and got["data"] == {"epoch": 0, "sample": 4} and got["lr"] == [0.5e-3]
        assert got["total"] == total, "the checkpoint's size is the whole folder's"
        # About half the shards: this rank's model and AdamW shards, a few hundred bytes of rank 0's beside them.
        assert 0.4 * shards < got["read"] < 0.65 * shards, (rank, got["read"], shards)
        assert got["stored"] <= got["read"] + 64 * 1024, "only what was read is on disk (sparse files)"
        assert got["note"] == (
            f"resume: read {got['read'] / 1e6:.1f} MB of the checkpoint's {total / 1e6:.1f} MB (this rank's share)"
        )
        name = Path(got["folder"]).name
        assert _TEMP_FOLDER.match(name) and f"resume-r{rank}-p" in name, name
        assert not got["left"], "the downloaded share is removed after the load"

    # One rank resumes the two-rank checkpoint: it reads every shard, and loads the same.
    (one,) = _run("load", 1, tmp_path, builtin_model)
    loaded = torch.load(tmp_path / "loaded-load.pt")
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []
    assert one["step"] == 1 and one["lr"] == [0.5e-3]
    assert shards < one["read"] < total


if __name__ == "__main__":  # one rank of the test above: MODE RANK WORLD STORE MODEL OUT
    _rank(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the torchrun entry does: no interpreter shutdown racing gloo's threads (SIGABRT at exit)
