"""Checkpoints in S3 (moto's server on loopback): written there, resumed from there after a kill, exported; and the
run's bundle beside them (train/bundle.py): whole after the run, its evidence after a run that failed midway, listed
and fetched by `raytrain-eks results` into a folder whose report opens in Chromium."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import procs
import pytest
import torch
from safetensors.torch import load_file
from test_report_browser import browser  # noqa: F401 - the fixture: Chromium driven by selenium

from raytrain_eks import presets
from raytrain_eks.cli import main
from raytrain_eks.config import load_config
from raytrain_eks.errors import TrainingError
from raytrain_eks.train.checkpoint import list_checkpoints
from raytrain_eks.train.faults import ENV as FAULT_ENV
from raytrain_eks.train.launch import run_training
from raytrain_eks.train.staged import CACHE_ENV as MODEL_CACHE_ENV

pytestmark = pytest.mark.usefixtures("starts_ray")

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

    # The run's bundle lies beside its checkpoints: the whole run folder (no checkpoint twice), and run.json.
    def stored_text(name: str) -> str:
        return s3_and_ray.get_object(Bucket=BUCKET, Key=f"runs/run/{name}")["Body"].read().decode()

    assert result.bundle == f"s3://{BUCKET}/runs/run"
    assert f"run bundle: s3://{BUCKET}/runs/run (`raytrain-eks results s3://{BUCKET}/runs/run` fetches it)" in said
    keys = {o["Key"] for o in s3_and_ray.list_objects_v2(Bucket=BUCKET, Prefix="runs/run/")["Contents"]}
    apart = ("runs/run/ray/", "runs/run/logs/")  # the checkpoints, and the workers' logs (below)
    bundled = {k.removeprefix("runs/run/") for k in keys if not k.startswith(apart) and k[-1] != "/"}
    local = {p.relative_to(result.run_dir).as_posix() for p in result.run_dir.rglob("*") if p.is_file()}
    assert local <= bundled and bundled - local == {"run.json", "train.log"}, bundled ^ local
    assert {"model/model.safetensors", "report.html", "summary.json", "metrics.jsonl", "plots/loss.png"} <= local
    for name in ("metrics.jsonl", "summary.json", "report.html"):
        assert stored_text(name) == (result.run_dir / name).read_text(), name
    state = json.loads(stored_text("run.json"))
    assert (state["state"], state["steps"], state["total_steps"], state["error"]) == ("finished", 6, 6, None)
    assert state["final_loss"] == result.summary["final_loss"] and state["ended"] >= state["started"]
    log = stored_text("train.log")  # the driver's lines, the workers' notes among them
    assert "run folder: " in log and resumed in log and "model: " in log, log
    # Every rank's own output, as Ray wrote it on its node: the two ranks before the kill and the two after it.
    assert not [line for line in said if line.startswith("run bundle: the workers' logs")], said
    logs = worker_logs(s3_and_ray, "runs/run/")
    ranks = [name for name, text in logs.items() if name.endswith(".out") and ":actor_name:RayTrainWorker" in text]
    assert len(ranks) >= 4, sorted(logs)
    said_by_workers = "".join(logs.values())
    assert "Setting up process group for: env:// [rank=0, world_size=2]" in said_by_workers
    assert "from rank 1" in said_by_workers  # Ray Train's "Reporting training result ... from rank 1" of rank 1


def worker_logs(s3: Any, prefix: str) -> dict[str, str]:
    """The bundle's ``logs/NODE/FILE`` under ``prefix`` by their name there, checked to be this Ray job's worker
    output files (``worker-<worker id>-<job id>-<pid>.out``/``.err``) of the one node."""
    import ray

    job = ray.get_runtime_context().get_job_id()  # the driver's: Ray Train's workers run under it
    objects = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}logs/").get("Contents", [])
    logs = {o["Key"].removeprefix(f"{prefix}logs/"): o["Key"] for o in objects}
    assert logs, f"no worker log in the bundle {prefix}"
    for name in logs:
        node, file = name.split("/")
        assert re.fullmatch(rf"worker-[0-9a-f]+-{job}-\d+\.(out|err)", file), name
    assert len({name.split("/")[0] for name in logs}) == 1, sorted(logs)  # one node
    return {name: s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode() for name, key in logs.items()}


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


@pytest.fixture(scope="module")
def failed_midway(s3_and_ray, tmp_path_factory):
    """A run killed before its third optimizer step with no restart allowed: it fails after logging two steps, with
    its storage in S3. Returns the error it raised, its run folder and its storage folder."""
    root = tmp_path_factory.mktemp("failed")
    with contextlib.suppress(s3_and_ray.exceptions.BucketAlreadyOwnedByYou):  # aws_env's tests reset moto
        s3_and_ray.create_bucket(Bucket=BUCKET)
    training = {
        "data": "random",
        "steps": 6,
        "seq_len": 32,
        "batch_size": 2,
        "log_every": 1,
        "checkpoint_every": 0,
        "max_failures": 0,
        "storage_path": f"s3://{BUCKET}/failing",
        "output_dir": str(root / "broken"),
    }
    cfg = load_config(preset=presets.local_tiny(), environ={}, overrides={"training": training})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, f"step:3:0:{root / 'fired'}")
        with pytest.raises(TrainingError) as info:
            run_training(cfg, runs_root=root, say=lambda _: None)
    assert (root / "fired").exists()
    return {"error": info.value, "run_dir": root / "broken", "storage": f"s3://{BUCKET}/failing", "root": root}


def test_a_run_that_fails_midway_leaves_its_metrics_and_error_log_in_the_bundle(failed_midway, s3_and_ray, capsys):
    def stored(name: str) -> str:
        return s3_and_ray.get_object(Bucket=BUCKET, Key=f"failing/broken/{name}")["Body"].read().decode()

    error = failed_midway["error"]
    assert error.message.endswith(f"(run bundle: s3://{BUCKET}/failing/broken)"), error.message
    steps = [json.loads(line)["step"] for line in stored("metrics.jsonl").splitlines()]
    assert steps == [1, 2]
    log = stored("error.log")
    assert log == (failed_midway["run_dir"] / "error.log").read_text()
    assert "training failed" in log.splitlines()[0] and "Traceback (most recent call last)" in log
    state = json.loads(stored("run.json"))
    assert (state["state"], state["steps"]) == ("failed", 2) and state["error"].startswith("training failed"), state
    failing = s3_and_ray.list_objects_v2(Bucket=BUCKET, Prefix="failing/broken/")["Contents"]
    assert "failing/broken/report.html" not in {o["Key"] for o in failing}  # the run wrote none
    # Each rank's own output: the rank killed midway and the one stopped with it.
    logs = worker_logs(s3_and_ray, "failing/broken/")
    ranks = [name for name, text in logs.items() if name.endswith(".out") and ":actor_name:RayTrainWorker" in text]
    assert len(ranks) >= 2, sorted(logs)
    assert "Setting up process group for: env:// [rank=0, world_size=2]" in "".join(logs.values())

    # `results` lists the deployment's runs from its storage, with their state.
    main(["results", "--storage-path", failed_midway["storage"]])
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.strip().startswith("broken")]
    assert row.split()[:2] == ["broken", "failed"] and " 2/6 " in row and "training failed" in row, out


def test_results_fetches_a_failed_runs_bundle_and_its_report_opens_in_chromium(
    failed_midway,
    capsys,
    monkeypatch,
    browser: Any,  # noqa: F811 - the fixture imported above
    record_property,
):
    monkeypatch.chdir(failed_midway["root"])
    main(["results", "broken", "--storage-path", failed_midway["storage"]])
    out = " ".join(capsys.readouterr().out.split())
    into = failed_midway["root"] / "runs" / "broken"  # the default: ./runs/RUN
    assert f"Fetched s3://{BUCKET}/failing/broken (failed) into runs/broken" in out, out
    assert "written here from the fetched metrics: the run wrote none" in out, out
    assert (into / "error.log").read_text() == (failed_midway["run_dir"] / "error.log").read_text()
    assert not (into / "ray").exists()  # the checkpoints stay in storage
    # Fetching again updates the same folder in place.
    main(["results", "broken", "--storage-path", failed_midway["storage"]])
    capsys.readouterr()

    browser.get((into / "report.html").resolve().as_uri())
    assert browser.title == "raytrain-eks report: broken"
    overview = browser.execute_script("return document.querySelector('table').innerText")
    assert "outcome\tfailed: training failed: rank 0" in overview and "steps\t2\n" in overview, overview
    images = browser.execute_script("return Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth])")
    assert images and all(complete and width > 0 for _, complete, width in images), images
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")] == []
    shot = failed_midway["root"] / "fetched-report.png"
    assert browser.save_screenshot(str(shot))
    record_property("screenshot", str(shot))
