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
