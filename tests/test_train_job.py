"""The training job end to end on real Ray: FSDP equals one process, real data trains, bad data starts nothing.

Two FSDP workers on Ray are compared with one process training on the whole batch: the same training loop run in
this process (a process group of one, as ``torchrun_entry`` runs it), without a Ray Train start of its own.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from raytrain_eks import presets
from raytrain_eks.config import load_config
from raytrain_eks.errors import DataError, TrainingError, UserError
from raytrain_eks.train import launch
from raytrain_eks.train.launch import run_training

pytestmark = pytest.mark.usefixtures("starts_ray")


def config(tmp_path, monkeypatch, **training):
    monkeypatch.chdir(tmp_path)
    return load_config(preset=presets.local_tiny(), environ={}, overrides={"training": training})


def losses(result) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result.records}


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def one_process(cfg, out) -> tuple[dict, dict[int, float]]:
    """The training loop in this process, on its own: its summary and losses by step."""
    from raytrain_eks.train.torchrun_entry import run

    summary = run(cfg.training, out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, {r["step"]: r["loss"] for r in records}


@pytest.mark.parametrize(
    ("precision", "tolerance", "sharded_extra"),
    [
        ("fp32", 1e-5, {}),
        ("bf16", 2e-3, {}),
        # Gradient accumulation (no gradient sync on early micro-batches) and activation checkpointing on the
        # sharded side only: neither may change the result.
        ("fp32", 1e-5, {"grad_accum_steps": 2, "batch_size": 2, "activation_checkpointing": True}),
    ],
    ids=["fp32", "bf16", "fp32-accumulation-checkpointing"],
)
def test_two_fsdp_workers_match_one_process(
    tmp_path, monkeypatch, ray_local, one_process_group, precision, tolerance, sharded_extra
):
    common = {
        "data": "random",
        "steps": 6,
        "seq_len": 32,
        "log_every": 1,
        "learning_rate": 1e-2,
        "precision": precision,
    }
    accum = sharded_extra.get("grad_accum_steps", 1)
    sharded = run_training(
        config(tmp_path, monkeypatch, **{**common, "num_workers": 2, "batch_size": 4, **sharded_extra}),
        runs_root=tmp_path,
        say=lambda _: None,
    )
    single, b = one_process(
        config(tmp_path, monkeypatch, **common, num_workers=1, batch_size=4 * 2 // accum, grad_accum_steps=accum),
        tmp_path / "one-process",
    )
    a = losses(sharded)
    assert sorted(a) == list(range(1, 7)) == sorted(b)
    assert sharded.summary["world_size"] == 2 and single["world_size"] == 1
    assert sharded.summary["tokens"] == single["tokens"]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=tolerance), (step, a, b)
    # The check is not vacuous: training moved the loss.
    assert abs(a[6] - a[1]) > 5 * tolerance * a[1]


def test_chat_data_trains_and_writes_the_run_folder(tmp_path, monkeypatch, ray_local):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Count to {n}."},
                {"role": "assistant", "content": " ".join(map(str, range(1, n + 1)))},
            ]
        }
        for n in range(2, 12)
    ] * 8
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = config(
        tmp_path,
        monkeypatch,
        data=str(data),
        data_format="chat",
        steps=30,
        seq_len=64,
        batch_size=4,
        log_every=10,
        output_dir=str(tmp_path / "run"),
    )
    lines: list[str] = []
    result = run_training(cfg, runs_root=tmp_path, say=lines.append)
    assert result.run_dir == (tmp_path / "run").resolve()
    assert any("80/80 rows usable" in line for line in lines)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["world_size"] == 2
    assert summary["final_loss"] < 0.7 * summary["first_loss"]
    steps = [json.loads(line)["step"] for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 10, 20, 30]


def test_unusable_data_starts_no_worker(tmp_path, monkeypatch, ray_local):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "Q", "completion": "A"}) + "\n")
    cfg = config(tmp_path, monkeypatch, data=str(data), data_format="instruction", output_dir=str(tmp_path / "run"))
    lines: list[str] = []
    with pytest.raises(DataError, match="no usable row for format 'instruction'"):
        run_training(cfg, runs_root=tmp_path, say=lines.append)
    # Nothing was trained and no log was written: the run folder is not left behind, and the run says so.
    assert not (tmp_path / "run").exists()
    assert lines[-1] == f"run folder {(tmp_path / 'run').resolve()} removed: nothing was trained"


def test_a_data_error_keeps_its_traceback_in_error_log(tmp_path, monkeypatch, ray_local, capsys):
    from raytrain_eks.cli import main

    data = tmp_path / "broken.parquet"
    data.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")  # looks like Parquet from outside, cannot be read
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", "--data", str(data), "--data-format", "text", "--output-dir", "run"])
    assert info.value.code == 2
    log = (tmp_path / "run" / "error.log").resolve()
    err = capsys.readouterr().err
    (first,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert first.startswith(f"error: --data {str(data)!r}: cannot be read: ")
    assert first.endswith(f"(full traceback: {log})")
    assert "Traceback" not in err
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "pyarrow" in text


def test_missing_data_or_model_fails_before_anything_is_created(tmp_path, monkeypatch):
    cfg = config(tmp_path, monkeypatch, data=str(tmp_path / "nope.jsonl"), output_dir=str(tmp_path / "run"))
    with pytest.raises(DataError, match="no such file or folder"):
        run_training(cfg, runs_root=tmp_path, say=lambda _: None)
    cfg = config(tmp_path, monkeypatch, model_id=str(tmp_path), output_dir=str(tmp_path / "run"))
    with pytest.raises(UserError, match="not a Hugging Face model folder"):
        run_training(cfg, runs_root=tmp_path, say=lambda _: None)
    assert not (tmp_path / "run").exists()


def test_unusable_output_dir_is_one_clear_message(tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cfg = config(tmp_path, monkeypatch, data="random", output_dir=str(a_file))
    with pytest.raises(UserError, match="already exists and is not a folder"):
        run_training(cfg, runs_root=tmp_path, say=lambda _: None)
    cfg = config(tmp_path, monkeypatch, data="random", output_dir=str(a_file / "run"))
    with pytest.raises(UserError, match="cannot create the run folder"):
        run_training(cfg, runs_root=tmp_path, say=lambda _: None)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cfg = config(tmp_path, monkeypatch, data="random", output_dir=str(tmp_path / "full"))
    with pytest.raises(UserError, match="already exists and is not empty"):
        run_training(cfg, runs_root=tmp_path, say=lambda _: None)


def test_runs_started_in_the_same_second_each_get_their_own_folder(tmp_path, monkeypatch, same_second):
    same_second(launch)
    cfg = config(tmp_path, monkeypatch, data="random")
    first = launch.new_run_dir(cfg, tmp_path / "runs")
    (first / "metrics.jsonl").write_text("{}\n")
    with ThreadPoolExecutor(8) as pool:  # several at once: each folder is claimed in one step
        others = list(pool.map(lambda _: launch.new_run_dir(cfg, tmp_path / "runs"), range(8)))
    names = sorted(p.name for p in [first, *others])
    stem = "20261202-032457-tiny-qwen2"  # the time, then the model (builtin:tiny-qwen2)
    assert first.name == stem and len(set(names)) == 9
    assert set(names) == {stem, *(f"{stem}-{n}" for n in range(2, 10))}
    assert (first / "metrics.jsonl").read_text() == "{}\n" and all(not any(p.iterdir()) for p in others)


def test_required_fabric_not_met_stops_after_the_first_step(tmp_path, monkeypatch, ray_local):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        preset=presets.local_tiny(),
        environ={},
        overrides={"training": {"steps": 200, "output_dir": str(tmp_path / "run")}, "fabric": {"require": "efa"}},
    )
    lines: list[str] = []
    with pytest.raises(TrainingError, match="stopped after step 1: the inter-node transport is 'inconclusive'") as info:
        run_training(cfg, runs_root=tmp_path, say=lines.append)
    assert "fabric.require to 'any'" in info.value.hint
    assert any("no NCCL set-up lines found" in line for line in lines), "the report is shown"
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["fabric"] == {**summary["fabric"], "require": "efa", "verdict": "inconclusive", "met": False}
    assert summary["steps"] == 1, "the summary counts the steps that ran, not the 200 asked for"
    t = cfg.training
    positions = 2 * t.batch_size * t.grad_accum_steps * t.seq_len  # one step of 2 workers; padding is no token
    assert 0.8 * positions < summary["tokens"] == summary["trained_tokens"] <= positions
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1], "no training past the first step"
    assert sorted(p.name for p in (run / "nccl").iterdir()) == ["rank00000.log", "rank00001.log"]
    assert not (run / "model").exists()
