"""Deterministic data per epoch with real Ray Data and Ray Train: the packed set's order depends only on the data and
the seed, not on how Ray Data cut the blocks; each epoch walks it in an order drawn from (seed, epoch), of which
each rank takes its share; the position a checkpoint records (epoch, samples all ranks took in it) resumes every
rank exactly, mid-epoch and in a later epoch, in a new Ray Train run too (no sample repeated, none dropped).

These runs are on one Ray node; the two-host runs (tests/test_two_host.py) read the same way across a link. Each
rank takes only the rows it trains on: a task beside each block that holds some of them returns just those
(``PackedSet.take``), so what reaches a rank is its share of the epoch. The data is
prepared through Ray Data's tasks (``in_driver=False``), where blocks can be cut differently; the driver's path
gives the same packed set (tests/test_data_pipeline.py).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time

import numpy as np
import pytest

from raytrain_eks.train.builtin import sample_data_path
from raytrain_eks.train.data.cursor import DataCursor, global_position, take_from_parts
from raytrain_eks.train.data.pipeline import (
    DataSettings,
    epoch_order,
    prepare_dataset,
    rank_epoch_blocks,
    train_datasets,
)

pytestmark = pytest.mark.usefixtures("starts_ray")

WORLD, BATCH, SEQ = 2, 4, 64


def prepared(builtin_model, *, seed=0, block_bytes=None):
    import ray.data

    context = ray.data.DataContext.get_current()
    before = context.target_max_block_size
    if block_bytes:  # another cut of the same data into blocks
        context.target_max_block_size = block_bytes
    try:
        return prepare_dataset(
            DataSettings(
                data_format="instruction",
                text_field="text",
                tokenizer_path=builtin_model,
                seq_len=SEQ,
                seed=seed,
            ),
            data=str(sample_data_path()),
            min_blocks=WORLD * BATCH,
            in_driver=False,
        )
    finally:
        context.target_max_block_size = before


def row_hashes(dataset) -> list[str]:
    return [hashlib.sha1(bytes(r["input_ids"].tobytes())).hexdigest()[:12] for r in dataset.iter_rows()]


@pytest.fixture(scope="module")
def layouts(ray_local, builtin_model) -> dict[str, object]:
    """The sample prepared once with Ray Data's default blocks and once cut into blocks of 16 KiB, for the module
    (each preparation through Ray Data's tasks takes tens of seconds here); both are materialized."""
    return {"default": prepared(builtin_model), "small blocks": prepared(builtin_model, block_bytes=16384)}


def test_packed_order_does_not_depend_on_block_layout_and_follows_the_seed(layouts, builtin_model):
    a = row_hashes(layouts["default"].dataset)
    b = row_hashes(layouts["small blocks"].dataset)
    assert a == b
    assert len(a) > WORLD * BATCH
    assert len(set(a)) == len(a), "every packed block is distinct (so the checks below can tell them apart)"
    assert row_hashes(prepared(builtin_model, seed=1).dataset) != a, "another seed, another shuffle"


def test_each_epoch_has_its_own_order_and_the_ranks_share_it_out():
    blocks, per_step = 50, WORLD * BATCH
    first = epoch_order(blocks, seed=0, epoch=0)
    assert sorted(first.tolist()) == list(range(blocks))
    assert (epoch_order(blocks, seed=0, epoch=0) == first).all(), "the same seed and epoch, the same order"
    assert (epoch_order(blocks, seed=0, epoch=1) != first).any(), "another epoch, another order"
    assert (epoch_order(blocks, seed=1, epoch=0) != first).any(), "another seed, another order"
    shares = [
        rank_epoch_blocks(blocks, seed=0, epoch=0, start=0, rank=r, world_size=WORLD, batch_size=BATCH) for r in (0, 1)
    ]
    steps = blocks // per_step
    assert [len(s) for s in shares] == [steps * BATCH] * WORLD
    # Global batch j is the epoch's j-th run of world x batch blocks; rank r takes its r-th part.
    assert shares[1][:BATCH].tolist() == first[BATCH:per_step].tolist()
    assert not set(shares[0].tolist()) & set(shares[1].tolist())
    # From a sample count on (a resume): the same global stream, whatever the layout of ranks and batches.
    later = rank_epoch_blocks(blocks, seed=0, epoch=0, start=2 * per_step, rank=1, world_size=WORLD, batch_size=BATCH)
    assert later.tolist() == shares[1][2 * BATCH :].tolist()
    alone = rank_epoch_blocks(blocks, seed=0, epoch=0, start=per_step, rank=0, world_size=1, batch_size=per_step)
    assert alone.tolist() == first[per_step : per_step * steps].tolist()


def _local_read(rows: np.ndarray, chunk: int):
    """A ``take`` over the rows in memory, walked in parts of ``chunk`` rows."""
    return take_from_parts(
        lambda: (
            {"input_ids": rows[i : i + chunk], "labels": -rows[i : i + chunk]} for i in range(0, len(rows), chunk)
        ),
        len(rows),
    )


def test_cursor_positions_resume_exactly_and_earlier_positions_are_converted():
    blocks = 37  # 4 global batches of 8 per epoch, 5 blocks left out of each (other ones each epoch)
    rows = np.arange(blocks * 3).reshape(blocks, 3)
    cursors = [
        DataCursor(_local_read(rows, 5), blocks=blocks, seed=3, rank=r, world_size=WORLD, batch_size=BATCH)
        for r in range(WORLD)
    ]
    streams: dict[int, list[int]] = {r: [] for r in range(WORLD)}
    positions = []
    for _ in range(10):  # two epochs and a half
        for r, cursor in enumerate(cursors):
            batch = next(cursor)
            assert (batch["labels"] == -batch["input_ids"]).all()
            streams[r] += (batch["input_ids"][:, 0] // 3).tolist()
        assert cursors[0].position == cursors[1].position
        positions.append(cursors[0].position)
    assert positions[3] == {"epoch": 0, "sample": 32} and positions[4] == {"epoch": 1, "sample": 8}
    for r in range(WORLD):
        epochs = [streams[r][i * 4 * BATCH : (i + 1) * 4 * BATCH] for i in range(2)]
        assert epochs[0] != epochs[1] and len(set(epochs[0])) == 4 * BATCH
    for cut in (1, 3, 5):
        for r in range(WORLD):
            resumed = DataCursor(
                _local_read(rows, 7),
                blocks=blocks,
                seed=3,
                rank=r,
                world_size=WORLD,
                batch_size=BATCH,
                position=positions[cut],
            )
            rest = [v for _ in range(10 - cut - 1) for v in (next(resumed)["input_ids"][:, 0] // 3).tolist()]
            assert rest == streams[r][(cut + 1) * BATCH :], (cut, r)
    old = {"epoch": 1, "batch": 2}
    assert global_position(old, world_size=WORLD, batch_size=BATCH)[0] == {"epoch": 1, "sample": 16}
    converted = DataCursor(
        _local_read(rows, 5), blocks=blocks, seed=3, rank=0, world_size=WORLD, batch_size=BATCH, position=old
    )
    assert "earlier format" in converted.note and converted.position == {"epoch": 1, "sample": 16}
    assert next(converted)["input_ids"][:, 0].div(3).tolist() == streams[0][(4 + 2) * BATCH : (4 + 3) * BATCH]
    with pytest.raises(RuntimeError, match="fewer than one global batch"):
        DataCursor(_local_read(rows[:7], 5), blocks=7, seed=0, rank=0, world_size=WORLD, batch_size=BATCH)


def test_the_next_epochs_share_is_read_while_this_epochs_batches_train():
    blocks = 37  # 4 global batches per epoch
    rows = np.arange(blocks * 3).reshape(blocks, 3)
    readers: list[str] = []

    def read():
        readers.append(threading.current_thread().name)
        if len(readers) == 3:
            raise OSError("the object store lost a block")
        return ({"input_ids": rows[i : i + 5], "labels": -rows[i : i + 5]} for i in range(0, blocks, 5))

    cursor = DataCursor(
        take_from_parts(read, blocks), blocks=blocks, seed=3, rank=0, world_size=WORLD, batch_size=BATCH
    )
    next(cursor)  # epoch 0's share is read for this batch; epoch 1's starts on its own thread
    deadline = time.monotonic() + 30
    while len(readers) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert readers == [threading.current_thread().name, "raytrain-eks-next-epoch"]
    assert cursor.position == {"epoch": 0, "sample": WORLD * BATCH}  # still at the start of epoch 0
    for _ in range(3):
        next(cursor)
    assert cursor.position == {"epoch": 0, "sample": 4 * WORLD * BATCH}
    next(cursor)  # epoch 1 from what was read ahead; epoch 2's read (the third) fails on its thread
    assert cursor.position == {"epoch": 1, "sample": WORLD * BATCH}
    for _ in range(3):
        next(cursor)
    with pytest.raises(OSError, match="lost a block"):  # raised where training waits for it, not lost
        next(cursor)


def _streams(dataset, out_dir, take: int, cuts: list[int], resume: dict[str, list] | None) -> dict[int, dict]:
    """Per rank, from a real 2-worker Ray Train run: ``take`` batch hashes from the start, the cursor's position
    after each of ``cuts`` batches, and (given ``resume``: per rank, earlier positions) the batches from each."""
    import ray.train
    from ray.train.torch import TorchTrainer

    def loop(job):
        import hashlib as hl
        import json as js
        from pathlib import Path

        import ray.train as rt

        from raytrain_eks.train.context import RayContext

        ctx = RayContext(None, job["root"], datasets=job["datasets"])
        digest = lambda b: hl.sha1(b["input_ids"].numpy().tobytes()).hexdigest()[:12]  # noqa: E731
        whole = ctx.data_batches(job["batch"], None, seed=0)
        first, positions = [], []
        for i in range(job["take"]):
            first.append(digest(next(whole)))
            if i + 1 in job["cuts"]:
                positions.append(whole.position)
        rest = []
        for cut, position in zip(job["cuts"], (job["resume"] or {}).get(str(ctx.rank), []), strict=False):
            resumed = ctx.data_batches(job["batch"], position, seed=0)
            rest.append([digest(next(resumed)) for _ in range(job["take"] - cut)])
        record = {"first": first, "positions": positions, "rest": rest}
        Path(job["out"], f"rank{ctx.rank}.json").write_text(js.dumps(record))
        rt.report({"done": 1})

    out_dir.mkdir()
    config = {"root": str(out_dir), "batch": BATCH, "take": take, "cuts": cuts, "resume": resume, "out": str(out_dir)}
    config["datasets"] = train_datasets(dataset)
    trainer = TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=WORLD),
        run_config=ray.train.RunConfig(name="shards", storage_path=str(out_dir / "ray")),
    )
    trainer.fit()
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)}


def test_each_rank_reads_the_same_stream_every_run_per_epoch_and_after_a_restart(layouts, tmp_path):
    data = layouts["default"]
    per_epoch = data.blocks // (WORLD * BATCH)  # batches per rank and epoch
    take = 2 * per_epoch + 2  # into the third epoch
    cuts = [per_epoch // 2, per_epoch + per_epoch // 2]  # mid first epoch, mid second epoch
    one = _streams(data.dataset, tmp_path / "one", take, cuts, None)
    # Prepared again, cut into other blocks, trained again as a new Ray Train run that resumes from the first run's
    # positions: the same batches for every rank, in order, and the resumes continue exactly.
    resume = {str(r): one[r]["positions"] for r in range(WORLD)}
    two = _streams(layouts["small blocks"].dataset, tmp_path / "two", take, cuts, resume)
    for rank in range(WORLD):
        stream = one[rank]["first"]
        assert two[rank]["first"] == stream, rank
        assert one[rank]["positions"] == [
            {"epoch": 0, "sample": cuts[0] * WORLD * BATCH},
            {"epoch": 1, "sample": (cuts[1] - per_epoch) * WORLD * BATCH},
        ]
        for cut, rest in zip(cuts, two[rank]["rest"], strict=True):
            assert rest == stream[cut:], (rank, cut)
        assert stream[:per_epoch] != stream[per_epoch : 2 * per_epoch], "another epoch, another order"
    for epoch in range(2):
        span = slice(epoch * per_epoch, (epoch + 1) * per_epoch)
        mine = [set(one[r]["first"][span]) for r in range(WORLD)]
        assert not mine[0] & mine[1], "ranks read disjoint samples within an epoch"
        assert all(len(m) == per_epoch for m in mine), "no sample twice in an epoch"


def test_a_rank_receives_only_the_rows_it_trains_on(layouts, monkeypatch):
    """``PackedSet.take``: a task on the node that holds the blocks with some of a rank's rows returns just those
    rows, so what reaches the rank is its share of the epoch (a half here), not the whole set; the rows are those
    the whole set holds at those positions, in the order asked."""
    import ray

    packed = train_datasets(layouts["small blocks"].dataset)["train"]
    assert len(packed.blocks) > 4 and sum(packed.block_rows) == packed.rows == layouts["small blocks"].blocks
    wanted = rank_epoch_blocks(packed.rows, seed=0, epoch=1, start=0, rank=1, world_size=WORLD, batch_size=BATCH)
    received: list = []
    real_get = ray.get

    def counting_get(refs, *args, **kwargs):
        out = real_get(refs, *args, **kwargs)
        received.extend(out if isinstance(out, list) else [out])
        return out

    monkeypatch.setattr(ray, "get", counting_get)
    share = packed.take(wanted)
    monkeypatch.undo()
    whole = take_from_parts(lambda: packed.batches(64), packed.rows)
    expected = whole(wanted)
    assert set(share) == set(expected) >= {"input_ids", "labels"}
    for column in share:
        assert share[column].dtype == np.int32 and (share[column] == expected[column]).all(), column
    # One task for the blocks this node holds, however many they are (a task per block would start a Ray worker
    # process per block at once); blocks too small for the object store's shared memory may make a second.
    assert 1 <= len(received) <= 2 < len(packed.blocks)
    got = sum(col.nbytes for task in received for part in task for col in part.values())
    whole_set = sum(col.nbytes for col in whole(np.arange(packed.rows)).values())
    assert got == sum(col.nbytes for col in share.values()) <= whole_set / WORLD
    with pytest.raises(IndexError, match="asked of a packed set"):
        packed.take(np.array([packed.rows]))
