"""Checkpoints in S3 (moto's server on loopback): written there, resumed from there after a kill, exported."""

from __future__ import annotations

import json

import procs
import pytest
import torch
from safetensors.torch import load_file

from raytrain_eks import presets
from raytrain_eks.cli import main
from raytrain_eks.config import load_config
from raytrain_eks.train.checkpoint import list_checkpoints
from raytrain_eks.train.faults import ENV as FAULT_ENV
from raytrain_eks.train.launch import run_training
from raytrain_eks.train.staged import CACHE_ENV as MODEL_CACHE_ENV

pytestmark = pytest.mark.integration

BUCKET = "raytrain-eks-test"


@pytest.fixture(scope="module")
def s3_and_ray(moto_url):
    """The session's moto S3, then a Ray whose workers inherit the endpoint and dummy credentials."""
    import boto3
    import ray

    env = {
        "AWS_ENDPOINT_URL": moto_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        procs.start_local_ray()  # a Ray of its own, never one already running on this machine
        try:
            yield boto3.client("s3")
        finally:
            ray.shutdown()


def test_checkpoints_live_in_s3_and_survive_a_kill(tmp_path, monkeypatch, s3_and_ray):
    # The model too comes from S3: staged there once, each node (here, the one) reads its own copy of it.
    main(["stage-model", "builtin:tiny-qwen2", "--to", f"s3://{BUCKET}/models"])
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "model-cache"))
    training = {
        "model_id": f"s3://{BUCKET}/models/tiny-qwen2",
        "data": "random",
        "steps": 6,
        "seq_len": 32,
        "batch_size": 2,
        "log_every": 1,
        "checkpoint_every": 2,
        "storage_path": f"s3://{BUCKET}/runs",
        "output_dir": str(tmp_path / "run"),
    }
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(FAULT_ENV, f"checkpoint:4:1:{tmp_path / 'fired'}")
    cfg = load_config(preset=presets.local_tiny(), environ={}, overrides={"training": training})
    said: list[str] = []
    result = run_training(cfg, runs_root=tmp_path, say=said.append)
    assert (tmp_path / "fired").exists()
    assert result.summary["resumed_from_step"] == 2
    # Each rank read its own shard of the staged model at the start; the resume read no weight of the model (the
    # checkpoint holds them all), only each rank's own share of the checkpoint in S3.
    assert sum(line.startswith("model start: each rank read its own shard") for line in said) == 1, said
    (resumed,) = [line for line in said if line.startswith("resume: read ")]
    assert "this rank's share" in resumed, resumed
    root = f"s3://{BUCKET}/runs/run/ray"
    assert result.summary["checkpoints"] == [f"{root}/checkpoint_00000004", f"{root}/checkpoint_00000006"]
    assert [step for step, _, ok in list_checkpoints(root) if ok] == [4, 6]
    keys = [o["Key"] for o in s3_and_ray.list_objects_v2(Bucket=BUCKET, Prefix="runs/run/")["Contents"]]
    assert "runs/run/ray/checkpoint_00000006/complete.json" in keys
    # The run's configuration lies beside its checkpoints, for `train --resume s3://...` on another machine.
    stored = s3_and_ray.get_object(Bucket=BUCKET, Key="runs/run/config.yaml")["Body"].read().decode()
    assert stored == (result.run_dir / "config.yaml").read_text()
    assert not (tmp_path / "run" / "ray").exists(), "nothing of the checkpoints is kept on the driver's disk"
    (copy,) = (tmp_path / "model-cache").glob("tiny-qwen2-*/config.json")  # one copy, shared by the ranks
    staged = {o["Key"] for o in s3_and_ray.list_objects_v2(Bucket=BUCKET, Prefix="models/")["Contents"]}
    assert {"models/tiny-qwen2/config.json", "models/tiny-qwen2/model.safetensors"} <= staged
    assert stored.count(f"s3://{BUCKET}/models/tiny-qwen2") == 1  # the run's config names the staged model

    # `export RUN_DIR` finds the run's checkpoints in S3 through its config.yaml.
    main(["export", str(result.run_dir), str(tmp_path / "exported")])
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    at_end = load_file(result.run_dir / "model" / "model.safetensors")
    assert exported.keys() == at_end.keys()
    assert all(torch.equal(exported[k], at_end[k]) for k in exported)
    history = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history].count(3) == 2  # steps 3-4 ran twice: before the kill and after the resume


def test_a_resume_from_a_storage_folder_is_checked_before_anything_starts(aws_env, tmp_path, monkeypatch, capsys):
    import boto3

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="held")

    def refused(*args: str) -> str:
        with pytest.raises(SystemExit) as info:
            main(["train", *args])
        assert info.value.code == 1  # a UserError: one message, no traceback
        return " ".join(capsys.readouterr().err.split())

    # Nothing of a run there.
    err = refused("--resume", "s3://held/runs/gone")
    assert "--resume 's3://held/runs/gone': no config.yaml there" in err and "storage folder" in err, err
    # A config.yaml whose storage is elsewhere: its checkpoints are not under the folder given.
    config = "training:\n  storage_path: s3://held/elsewhere\n"
    s3.put_object(Bucket="held", Key="runs/r1/config.yaml", Body=config.encode())
    err = refused("--resume", "s3://held/runs/r1")
    assert "puts its checkpoints in 's3://held/elsewhere/r1'" in err and "not there" in err, err
    # The right storage, but no checkpoint written yet.
    s3.put_object(Bucket="held", Key="runs/r2/config.yaml", Body=b"training:\n  storage_path: s3://held/runs\n")
    err = refused("--resume", "s3://held/runs/r2")
    assert "s3://held/runs/r2" in err and "Traceback" not in err, err
    # A bucket that does not exist: one message too, not a traceback.
    err = refused("--resume", "s3://no-such-bucket/runs/r1")
    assert "--resume 's3://no-such-bucket/runs/r1'" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists(), "nothing is created on this machine before the checks pass"
