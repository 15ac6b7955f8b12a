"""Checkpoints, recovery and export, with real processes killed by SIGKILL (no mocks).

A reference run trains on the shipped data without interruption; the other runs are killed (from outside, or by the
fault point at a chosen place) and must end with exactly the reference's weights, resuming from the newest complete
checkpoint. Each run is a Ray Train start (tens of seconds here), so the reference serves every test that compares
with it, and the run the checkpoint flags make is the one a later test resumes after its oldest checkpoint was pruned.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import procs
import pytest
import torch
from run_folders import checkpoint_tensor_bytes
from safetensors.torch import load_file

from raytrain_eks import presets
from raytrain_eks.cli import main
from raytrain_eks.config import load_config
from raytrain_eks.deploy.plan import storage_estimate
from raytrain_eks.errors import TrainingError, UserError
from raytrain_eks.train.checkpoint import (
    EXPORT_MARKER,
    FILES_PER_RANK,
    MARKER,
    RAY_SNAPSHOT,
    list_checkpoints,
    resolve_checkpoint,
)
from raytrain_eks.train.faults import ENV as FAULT_ENV
from raytrain_eks.train.faults import SLOW_WRITE_ENV
from raytrain_eks.train.launch import ERROR_LOG, run_training

pytestmark = pytest.mark.usefixtures("starts_ray")

# The shipped sample (the preset's data) at 64 tokens: 26 global batches of 2 x 4 an epoch, so 30 steps go into a
# second epoch and every checkpoint (10, 20, 30) falls mid-epoch.
REFERENCE = {"steps": 30, "seq_len": 64, "batch_size": 4, "log_every": 1, "checkpoint_every": 10}
RANDOM = {**REFERENCE, "data": "random"}


def make_config(**training):
    return load_config(preset=presets.local_tiny(), path=None, environ={}, overrides={"training": training})


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, ray_local):
    """The run without faults that the others are compared with (its folder is only read)."""
    root = tmp_path_factory.mktemp("reference")
    return run_training(make_config(**REFERENCE, output_dir=str(root / "run")), runs_root=root, say=quiet)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_reference_run_writes_checkpoints_and_exports(reference_run):
    run = reference_run.run_dir
    found = list_checkpoints(run / "ray")
    assert [step for step, _, ok in found if ok] == [20, 30]  # keep_checkpoints=2: step 10 was removed
    assert reference_run.summary["resumed_from_step"] is None
    assert len(reference_run.summary["checkpoints"]) == 2
    summary = reference_run.summary
    assert summary["checkpoint_s_per_save"] == pytest.approx(summary["checkpoint_s"] / 3)  # saved at 10, 20, 30
    assert summary["checkpoint_share"] == pytest.approx(summary["checkpoint_s"] / summary["train_s"])
    assert 0 < summary["checkpoint_share"] < 1
    # What each save cost the training thread (the staging into kept host buffers), in summary.json too.
    stalls = json.loads((run / "summary.json").read_text())["checkpoint_stall_s"]
    assert len(stalls) == 3 and summary["checkpoint_stall_s_max"] == pytest.approx(max(stalls), abs=1e-4)
    assert 0 < summary["checkpoint_stall_s_mean"] <= summary["checkpoint_stall_s_max"]
    # The output projection is tied to the embedding: the checkpoint holds that tensor once (and its moments once).
    from torch.distributed.checkpoint import FileSystemReader

    held = FileSystemReader(found[-1][1]).read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in held and "model.lm_head.weight" not in held
    assert (run / "model" / "model.safetensors").exists()
    # What plan says the kept checkpoints take is what they hold: 12 bytes for each of the model's parameters.
    estimate = storage_estimate(make_config(**REFERENCE))
    assert estimate["trained_parameters"] == summary["parameters"]
    assert checkpoint_tensor_bytes(found[-1][1]) == pytest.approx(estimate["bytes_per_checkpoint"], rel=0.01)
    for _, folder, _ in found:  # each rank's share in FILES_PER_RANK files, so storage moves them in parallel
        ranks = len(list(Path(folder).glob("trainer_rank*.pt")))
        assert ranks == 2
        names = sorted(p.name for p in Path(folder).glob("*.distcp"))
        assert names == sorted(f"__{r}_{i}.distcp" for r in range(ranks) for i in range(FILES_PER_RANK))


def test_sigkilled_worker_resumes_and_ends_with_identical_weights(tmp_path, reference_run):
    killed: list[int] = []

    def kill_a_worker(record: dict, total: int) -> None:
        if record["step"] >= 14 and not killed:
            killed.append(procs.kill_newest_train_worker())

    cfg = make_config(**REFERENCE, output_dir=str(tmp_path / "run"))
    result = run_training(cfg, runs_root=tmp_path, say=quiet, progress=kill_a_worker)
    assert killed
    assert result.summary["steps"] == 30
    resumed = result.summary["resumed_from_step"]
    assert resumed in (10, 20), result.summary
    steps = [r["step"] for r in history(result.run_dir)]
    assert steps.count(resumed + 1) == 2, "metrics.jsonl keeps the steps of both attempts"
    after = {r["step"]: r["loss"] for r in history(result.run_dir) if r["resumed_from_step"] == resumed}
    before = {r["step"]: r["loss"] for r in reference_run.records}
    assert after == {s: before[s] for s in after}
    assert_same_weights(weights(result.run_dir), weights(reference_run.run_dir))


def test_kill_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, monkeypatch, reference_run):
    monkeypatch.setenv(FAULT_ENV, f"checkpoint:20:1:{tmp_path / 'fired'}")
    cfg = make_config(**REFERENCE, output_dir=str(tmp_path / "run"))
    result = run_training(cfg, runs_root=tmp_path, say=quiet)
    assert (tmp_path / "fired").exists(), "the fault point must have fired"
    assert result.summary["resumed_from_step"] == 10
    assert_same_weights(weights(result.run_dir), weights(reference_run.run_dir))


def test_resume_run_dir_continues_real_data_exactly(tmp_path, monkeypatch, reference_run):
    # Stopped at step 25 with no restart allowed: resumed from checkpoint 20, mid-epoch, into the second epoch.
    monkeypatch.setenv(FAULT_ENV, f"step:25:0:{tmp_path / 'fired'}")
    cfg = make_config(**REFERENCE, max_failures=0, output_dir=str(tmp_path / "cut"))
    with pytest.raises(TrainingError, match="training failed"):
        run_training(cfg, runs_root=tmp_path, say=quiet)
    monkeypatch.delenv(FAULT_ENV)
    cut = tmp_path / "cut"
    assert not (cut / "summary.json").exists()
    # The CLI path a user takes: the run folder's own config.yaml, no other flag.
    monkeypatch.chdir(tmp_path)
    main(["train", "--resume", str(cut)])
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["resumed_from_step"] == 20 and summary["steps"] == 30
    expected = {r["step"]: r["loss"] for r in reference_run.records}
    resumed = {r["step"]: r["loss"] for r in history(cut) if r["resumed_from_step"] == 20}
    assert sorted(resumed) == list(range(21, 31))
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], rel=1e-6), step
    assert_same_weights(weights(cut), weights(reference_run.run_dir))


def test_export_command_writes_a_loadable_model_with_the_trained_weights(tmp_path, reference_run, capsys):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    main(["export", str(reference_run.run_dir), str(out)])
    assert f"model: {out.resolve()}" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("What is 2 plus 3?", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert generated.shape[1] == ids.shape[1] + 5
    # Independent gathering of the same checkpoint with PyTorch's own converter.
    newest = list_checkpoints(reference_run.run_dir / "ray")[-1][1]
    dcp_to_torch_save(newest, str(tmp_path / "plain.pt"))
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)["model"]
    exported = load_file(out / "model.safetensors")
    for name, tensor in exported.items():
        assert torch.equal(tensor, plain[name]), name


def test_export_never_replaces_a_folder_that_is_not_a_model(tmp_path, monkeypatch, reference_run, capsys):
    keep = tmp_path / "my-project"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    monkeypatch.chdir(keep)
    for target in (str(keep), "."):
        with pytest.raises(SystemExit) as info:
            main(["export", str(reference_run.run_dir), target])
        assert info.value.code == 1
        err = capsys.readouterr().err
        assert "is not an earlier export" in err and "Traceback" not in err
    assert [p.name for p in keep.iterdir()] == ["notes.txt"]
    # An earlier export carries the marker: exporting again replaces it, and the marker says what it holds.
    again = tmp_path / "again"
    main(["export", str(reference_run.run_dir), str(again)])
    (again / "stale.txt").write_text("from the first export")
    main(["export", str(reference_run.run_dir), str(again), "--dtype", "bfloat16"])
    assert (again / "model.safetensors").exists() and not (again / "stale.txt").exists()
    marker = json.loads((again / EXPORT_MARKER).read_text())
    assert marker["dtype"] == "bfloat16"
    assert marker["checkpoint"] == list_checkpoints(reference_run.run_dir / "ray")[-1][1]
    # The model folder a run exports is an export too.
    assert (reference_run.run_dir / "model" / EXPORT_MARKER).is_file()
    # A full fine-tune has no adapters to export alone: one message, nothing written.
    with pytest.raises(SystemExit):
        main(["export", str(reference_run.run_dir), str(tmp_path / "adapter"), "--adapter-only"])
    assert "is a full fine-tune (training.method full); it has no adapters" in capsys.readouterr().err
    assert not (tmp_path / "adapter").exists()


def test_bad_resume_inputs_are_one_clear_message(tmp_path, monkeypatch, capsys, reference_run):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", str(tmp_path / "missing-run")])
    assert info.value.code == 1
    assert "no config.yaml there" in capsys.readouterr().err

    other = tmp_path / "other-model"
    Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(other)
    tok_src = reference_run.run_dir / "model"
    for f in tok_src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            (other / f.name).write_bytes(f.read_bytes())
    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", str(reference_run.run_dir), "--model", str(other)])
    err = capsys.readouterr().err
    assert info.value.code == 1
    assert "is of a different model (hidden_size: checkpoint 128, model 64" in err
    assert "Traceback" not in err

    incomplete = tmp_path / "run-with-cut-checkpoint"
    (incomplete / "ray" / "checkpoint_00000005").mkdir(parents=True)
    (incomplete / "config.yaml").write_text((reference_run.run_dir / "config.yaml").read_text())
    with pytest.raises(UserError, match="none is complete"):
        resolve_checkpoint(incomplete)
    newest = Path(list_checkpoints(reference_run.run_dir / "ray")[-1][1])
    assert (newest / MARKER).exists()


@pytest.fixture(scope="module")
def flags_run(tmp_path_factory, ray_local) -> dict:
    """``raytrain-eks train`` with the checkpoint flags, 16 steps: what its folders held when it ended (a later test
    resumes it)."""
    root = tmp_path_factory.mktemp("flags")
    (root / "every-step.yaml").write_text("training:\n  log_every: 1\n")  # the resume's steps are compared one by one
    argv = ["train", "--config", "every-step.yaml", "--data", "random", "--steps", "16", "--seq-len", "64"]
    argv += ["--batch-size", "4", "--checkpoint-every", "4", "--keep-checkpoints", "3"]
    argv += ["--storage-path", "store", "--output-dir", "run"]
    out = io.StringIO()
    with contextlib.chdir(root), contextlib.redirect_stdout(out):
        main(argv)
    store, run = root / "store", root / "run"
    return {
        "store": store,
        "run": run,
        "output": out.getvalue(),
        "found": list_checkpoints(store / "run" / "ray"),
        "checkpoints_in_run_folder": (run / "ray").exists(),
        "snapshot": (store / "run" / "ray" / RAY_SNAPSHOT).is_file(),
    }


def test_checkpoint_flags_decide_where_and_how_often(flags_run):
    store, run = flags_run["store"], flags_run["run"]
    assert f"Run folder: {run.resolve()}" in flags_run["output"]
    # Every 4 steps, 3 kept (the default keeps 2), under the storage path (a relative one is made absolute).
    assert [(step, ok) for step, _, ok in flags_run["found"]] == [(8, True), (12, True), (16, True)]
    assert not flags_run["checkpoints_in_run_folder"]
    saved = load_config(path=run / "config.yaml", environ={}).training
    assert (saved.checkpoint_every, saved.keep_checkpoints) == (4, 3)
    assert saved.storage_path == str(store.resolve())


def test_training_goes_on_while_a_checkpoint_is_written_and_the_run_ends_with_it_complete(
    tmp_path, monkeypatch, ray_local
):
    delay = 3.0  # each rank's files take this much longer to write
    monkeypatch.setenv(SLOW_WRITE_ENV, str(delay))
    cfg = make_config(**{**RANDOM, "steps": 6, "checkpoint_every": 3}, output_dir=str(tmp_path / "run"))
    result = run_training(cfg, runs_root=tmp_path, say=quiet)
    summary = result.summary
    # Step 3's save returned at once and training went on; step 6's save waited for it first, then returned at
    # once too; the run ended only once the last one was complete.
    assert len(summary["checkpoint_done_s"]) == 2 and min(summary["checkpoint_done_s"]) >= delay, summary
    assert summary["checkpoint_s"] < 2 * delay, summary  # not both writes (nor the uploads) in the loop
    # The first save cost the training thread its staging only; the second waited for the first's write.
    first, second = summary["checkpoint_stall_s"]
    assert first < delay / 2 and second == pytest.approx(summary["checkpoint_stall_s_max"], abs=1e-4), summary
    assert [step for step, _, ok in list_checkpoints(result.run_dir / "ray") if ok] == [3, 6]
    steps = [r["step"] for r in history(result.run_dir)]
    assert steps == [1, 2, 3, 4, 5, 6]
    exported = load_file(result.run_dir / "model" / "model.safetensors")  # from the last checkpoint, once complete
    assert exported


def test_trainer_state_that_is_not_plain_data_stops_the_resume(tmp_path, ray_local):
    short = {**RANDOM, "steps": 2, "checkpoint_every": 0, "export": False}
    run = run_training(make_config(**short, output_dir=str(tmp_path / "run")), runs_root=tmp_path, say=quiet).run_dir
    (checkpoint,) = [Path(location) for _, location, ok in list_checkpoints(run / "ray") if ok]
    proof = tmp_path / "code-ran"
    for state in checkpoint.glob("trainer_rank*.pt"):
        torch.save({"step": 2, "scheduler": _RunsCode(proof), "data": {}, "rng": {}}, state)
    cfg = make_config(**{**short, "steps": 4}, max_failures=0)
    with pytest.raises(TrainingError, match="holds objects other than tensors and plain values") as info:
        run_training(cfg, runs_root=tmp_path, say=quiet, resume=run)
    assert not proof.exists(), "the pickled object's code ran"
    assert info.value.message.endswith(f"(full traceback: {run / ERROR_LOG})")


def test_a_worker_error_keeps_its_traceback_in_error_log(tmp_path, builtin_model, ray_local):
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(builtin_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # config and tokenizer still load
    cfg = make_config(**RANDOM, model_id=str(broken), max_failures=0, output_dir=str(tmp_path / "run"))
    with pytest.raises(TrainingError, match=r"^training failed: rank \d+: ") as info:
        run_training(cfg, runs_root=tmp_path, say=quiet)
    log = tmp_path / "run" / ERROR_LOG
    assert info.value.message.endswith(f"(full traceback: {log})")
    assert "\n" not in info.value.message, "the console keeps one line"
    text = log.read_text()
    assert text.startswith("=== ") and "training failed: rank" in text.splitlines()[0]
    # The worker's own traceback, down to the model load in this package's code.
    assert "Traceback (most recent call last)" in text
    assert "raytrain_eks/train/model.py" in text and "load_model" in text
    assert "--- worker rank" in text


class _RunsCode:
    """Unpickling this object runs code (creates a folder); a checkpoint must never make that happen."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (str(self.target),))


def test_resume_after_older_checkpoints_were_pruned(tmp_path, monkeypatch, flags_run):
    # Four checkpoints written, three kept (flags_run): the first is gone from storage when the run is resumed, and
    # Ray Train's own list of the run's checkpoints, in the storage folder, still names it.
    store, run = flags_run["store"], flags_run["run"]
    assert [step for step, _, ok in flags_run["found"]] == [8, 12, 16]
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    assert flags_run["snapshot"] and RAY_SNAPSHOT == CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    monkeypatch.chdir(tmp_path)
    main(["train", "--resume", str(run), "--steps", "20"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 16 and summary["steps"] == 20
    assert [step for step, _, ok in list_checkpoints(store / "run" / "ray") if ok] == [12, 16, 20]
    resumed = [r["step"] for r in history(run) if r["resumed_from_step"] == 16]
    assert resumed == [17, 18, 19, 20]
