"""Deterministic data shards with real Ray Data and Ray Train: what a rank reads depends only on the data, the
seed and the world size, not on how Ray Data cut the blocks, and a resume that skips N batches continues the same
stream (no sample repeated, none dropped), across the end of an epoch too.

These runs are on one Ray node. That the node does not matter either follows from the design (each rank reads its
own named shard whole, with shard locality off: :func:`~raytrain_eks.train.data.shard_data_config`), not from a
test here.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from raytrain_eks.train.builtin import sample_data_path
from raytrain_eks.train.data import prepare_dataset, rank_dataset_name, rank_shards

pytestmark = pytest.mark.integration

WORLD, BATCH, SEQ = 2, 4, 64


def prepared(builtin_model, *, seed=0, block_bytes=None):
    import ray.data

    context = ray.data.DataContext.get_current()
    before = context.target_max_block_size
    if block_bytes:  # another cut of the same data into blocks
        context.target_max_block_size = block_bytes
    try:
        return prepare_dataset(
            data=str(sample_data_path()),
            data_format="instruction",
            text_field="text",
            tokenizer_path=builtin_model,
            seq_len=SEQ,
            seed=seed,
            min_blocks=WORLD * BATCH,
        )
    finally:
        context.target_max_block_size = before


def row_hashes(dataset) -> list[str]:
    return [hashlib.sha1(bytes(r["input_ids"].tobytes())).hexdigest()[:12] for r in dataset.iter_rows()]


def test_shards_do_not_depend_on_block_layout_and_follow_the_seed(ray_local, builtin_model):
    a = {k: row_hashes(v) for k, v in rank_shards(prepared(builtin_model).dataset, WORLD).items()}
    b = {k: row_hashes(v) for k, v in rank_shards(prepared(builtin_model, block_bytes=16384).dataset, WORLD).items()}
    assert a == b
    assert list(a) == [rank_dataset_name(0), rank_dataset_name(1)]
    assert len(a[rank_dataset_name(0)]) == len(a[rank_dataset_name(1)]) > BATCH
    other = {k: row_hashes(v) for k, v in rank_shards(prepared(builtin_model, seed=1).dataset, WORLD).items()}
    assert other != a, "another seed, another shuffle"


def _streams(dataset, out_dir, take: int, skip: int) -> dict[int, dict]:
    """Per rank, from a real 2-worker Ray Train run: ``take`` batch hashes from the start, and from ``skip`` on."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytrain_eks.train.data import shard_data_config

    def loop(job):
        import hashlib as hl
        import json as js
        from pathlib import Path

        import ray.train as rt

        from raytrain_eks.train.context import RayContext

        ctx = RayContext(None, job["root"])
        digest = lambda b: hl.sha1(b["input_ids"].numpy().tobytes()).hexdigest()[:12]  # noqa: E731
        whole = ctx.data_batches(job["batch"], None)
        first = [digest(next(whole)) for _ in range(job["take"])]
        resumed = ctx.data_batches(job["batch"], {"epoch": 0, "batch": job["skip"]})
        rest = [digest(next(resumed)) for _ in range(job["take"] - job["skip"])]
        record = {"first": first, "rest": rest, "position": whole.position}
        Path(job["out"], f"rank{ctx.rank}.json").write_text(js.dumps(record))
        rt.report({"done": 1})

    out_dir.mkdir()
    trainer = TorchTrainer(
        loop,
        train_loop_config={"root": str(out_dir), "batch": BATCH, "take": take, "skip": skip, "out": str(out_dir)},
        scaling_config=ray.train.ScalingConfig(num_workers=WORLD),
        run_config=ray.train.RunConfig(name="shards", storage_path=str(out_dir / "ray")),
        datasets=rank_shards(dataset, WORLD),
        dataset_config=shard_data_config(),
    )
    trainer.fit()
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)}


def test_each_rank_reads_the_same_stream_every_run_and_after_a_resume(ray_local, builtin_model, tmp_path):
    data = prepared(builtin_model)
    per_epoch = len(row_hashes(rank_shards(data.dataset, WORLD)[rank_dataset_name(0)])) // BATCH
    take, skip = per_epoch + 3, per_epoch - 1  # past the end of the first epoch; resume just before it
    one = _streams(data.dataset, tmp_path / "one", take, skip)
    # Prepared again, cut into other blocks, and trained again: the same batches for every rank, in order.
    two = _streams(prepared(builtin_model, block_bytes=16384).dataset, tmp_path / "two", take, skip)
    for rank in range(WORLD):
        assert one[rank]["first"] == two[rank]["first"], rank
        stream = one[rank]["first"]
        # Every epoch walks the shard in the same order; the resume continues exactly where it left off.
        assert stream[per_epoch : per_epoch + 3] == stream[:3]
        assert one[rank]["rest"] == stream[skip:], rank
        assert one[rank]["position"] == {"epoch": 1, "batch": 3}
    assert not set(one[0]["first"][:per_epoch]) & set(one[1]["first"][:per_epoch]), "ranks read disjoint samples"
