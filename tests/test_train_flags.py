"""`raytrain-eks train`'s checkpoint flags and data settings: bad values are refused with the field named, before
anything starts.

That good values reach the run (checkpoints where and as often as asked) is shown by the integration test
``test_checkpoint_flags_decide_where_and_how_often`` in test_checkpoint.py.
"""

from __future__ import annotations

import pytest

from raytrain_eks.cli import main


def test_bad_checkpoint_flags_are_named_and_start_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", "--checkpoint-every", "-1", "--keep-checkpoints", "1", "--output-dir", str(tmp_path / "run")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Invalid configuration: 2 problems" in err
    assert "training.checkpoint_every = -1 (from flag --checkpoint-every)" in err
    assert "training.keep_checkpoints = 1 (from flag --keep-checkpoints)" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_empty_storage_path_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", "--storage-path", " "])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "training.storage_path = ' ' (from flag --storage-path): must not be empty" in err
    assert not (tmp_path / "runs").exists()


def test_a_checkpoint_flag_that_is_not_a_number_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", "--keep-checkpoints", "many"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Invalid value for '--keep-checkpoints'" in err and "Traceback" not in err


def test_a_missing_eval_data_file_is_named_as_eval_data_before_anything_starts(
    tmp_path, monkeypatch, capsys, builtin_model
):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "raytrain-eks.yaml"
    config.write_text("training:\n  eval_data: held-out.jsonl\n")
    with pytest.raises(SystemExit) as info:
        main(["train", "--preset", "local-tiny", "--config", str(config), "--output-dir", str(tmp_path / "run")])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "training.eval_data 'held-out.jsonl': no such file or folder" in err, err
    assert "--data" not in err and "Traceback" not in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_ray_address_is_read_from_the_environment_unless_address_is_given():
    from raytrain_eks.ray_session import address_from_environment

    assert address_from_environment(None, {}) == (None, "")
    assert address_from_environment(None, {"RAY_ADDRESS": " 10.0.0.5:6379 "}) == ("10.0.0.5:6379", "RAY_ADDRESS")
    assert address_from_environment("auto", {"RAY_ADDRESS": "10.0.0.5:6379"}) == ("auto", "--address")


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--preset", "local-tiny", "--steps", "1"],  # joining, the default preset is the reference's
        ["probe", "--num-workers", "2"],  # measures that cluster, not a Ray of its own on the head
    ],
    ids=["train", "probe"],
)
def test_ray_address_in_the_environment_is_the_cluster_a_command_joins(argv, tmp_path, monkeypatch, capsys):
    """Inside a Ray cluster's pod RAY_ADDRESS names that cluster: `train` and `probe` join it, not a second Ray of
    their own. Here nobody listens there, so the command stops at once saying so, before a run folder exists."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert f"ray: joining the cluster RAY_ADDRESS names (127.0.0.1:{port})" in err
    assert f"cannot connect to the Ray cluster at 127.0.0.1:{port}" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


# Every flag of `train`, frozen: a flag added without a line here fails the test below, and a flag that sets a
# setting names its config field, so `--set`, the config file and `config show` reach everything a flag does.
# ``None``: a flag that chooses what to run, not a setting.
TRAIN_FLAGS: dict[str, str | None] = {
    "--config": None,
    "--preset": None,
    "--address": None,
    "--resume": None,
    "--set": None,
    "--verbose": None,
    "--output-dir": "output_dir",
    "--model": "model_id",
    "--data": "data",
    "--data-format": "data_format",
    "--method": "method",
    "--steps": "steps",
    "--seq-len": "seq_len",
    "--batch-size": "batch_size",
    "--learning-rate": "learning_rate",
    "--num-workers": "num_workers",
    "--checkpoint-every": "checkpoint_every",
    "--keep-checkpoints": "keep_checkpoints",
    "--storage-path": "storage_path",
    "--storage-shared": "storage_shared",
    "--no-storage-shared": "storage_shared",
    "--sharding": "sharding",
    "--reduce-precision": "reduce_precision",
    "--compile": "compile",
    "--no-compile": "compile",
    "--eval-tasks": "eval_tasks",
}
# A value for each setting flag, and the value the setting then holds.
FLAG_VALUES: dict[str, tuple[list[str], object]] = {
    "--output-dir": (["--output-dir", "elsewhere"], "elsewhere"),
    "--model": (["--model", "Qwen/Qwen2.5-0.5B"], "Qwen/Qwen2.5-0.5B"),
    "--data": (["--data", "random"], "random"),
    "--data-format": (["--data-format", "chat"], "chat"),
    "--method": (["--method", "lora"], "lora"),
    "--steps": (["--steps", "7"], 7),
    "--seq-len": (["--seq-len", "96"], 96),
    "--batch-size": (["--batch-size", "3"], 3),
    "--batch-size auto": (["--batch-size", "auto"], "auto"),
    "--learning-rate": (["--learning-rate", "0.001"], 0.001),
    "--num-workers": (["--num-workers", "1"], 1),
    "--checkpoint-every": (["--checkpoint-every", "5"], 5),
    "--keep-checkpoints": (["--keep-checkpoints", "3"], 3),
    "--storage-path": (["--storage-path", "s3://bucket/runs"], "s3://bucket/runs"),
    "--storage-shared": (["--storage-path", "/mnt/shared/runs", "--storage-shared"], True),
    "--no-storage-shared": (["--no-storage-shared"], False),
    "--sharding": (["--sharding", "fsdp"], "fsdp"),
    "--reduce-precision": (["--reduce-precision", "bf16", "--sharding", "fsdp"], "bf16"),
    "--compile": (["--compile"], "on"),
    "--no-compile": (["--no-compile"], "off"),
    "--eval-tasks": (["--eval-tasks", "raytrain_sample_mc, hellaswag"], ["raytrain_sample_mc", "hellaswag"]),
}


def test_the_train_flags_are_frozen_and_each_setting_flag_names_its_field():
    import typer

    from raytrain_eks.cli import app
    from raytrain_eks.config import TrainingConfig

    command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    flags = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")}
    added, gone = sorted(flags - set(TRAIN_FLAGS)), sorted(set(TRAIN_FLAGS) - flags)
    assert not added, f"train has new flags {added}: give each its training.* field (or None) in TRAIN_FLAGS"
    assert not gone, f"TRAIN_FLAGS lists flags train no longer has: {gone}"
    fields = set(TrainingConfig.model_fields)
    assert {f for f in TRAIN_FLAGS.values() if f} <= fields
    assert {flag.split()[0] for flag in FLAG_VALUES} == {flag for flag, f in TRAIN_FLAGS.items() if f}


@pytest.mark.parametrize("flag", sorted(FLAG_VALUES))
def test_each_setting_flag_sets_its_field(flag, train_settings):
    argv, expected = FLAG_VALUES[flag]
    training = train_settings(*argv)
    got = getattr(training, TRAIN_FLAGS[flag.split()[0]])
    assert got.endswith(str(expected)) if flag == "--output-dir" else got == expected, (flag, got)


def test_eval_tasks_without_an_export_are_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", "--eval-tasks", "raytrain_sample_mc", "--set", "training.export=false"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "eval_tasks score the exported model: set export to true" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_an_eval_task_lm_eval_does_not_know_stops_the_run_before_it_trains(starts_ray, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", "--eval-tasks", "raytrain_sample_mc,no_such_task_here", "--output-dir", str(tmp_path / "run")])
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert "unknown lm-eval task(s): no_such_task_here" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
