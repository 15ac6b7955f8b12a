"""The report from run folders written here (no Ray): what it shows, what it refuses; evaluation settings; MLflow
against a real local tracking store, and Weights & Biases offline, read back from the run file it writes."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from run_folders import write_run

from raytrain_eks import presets
from raytrain_eks.cli import main
from raytrain_eks.config import load_config
from raytrain_eks.errors import ConfigError


def test_report_shows_fabric_evidence_cost_checkpoints_and_samples(tmp_path, capsys):
    run = write_run(
        tmp_path / "efa",
        fabric={"require": "efa", "verdict": "efa", "met": True, "basis": "NET/OFI lines", "report": "transport: EFA"},
        cost={"usd": 1.5, "usd_per_hour": 9.0, "usd_per_million_tokens": 0.25},
    )
    (run / "nccl").mkdir()
    (run / "nccl" / "rank00000.log").write_text("NCCL INFO NET/OFI Selected Provider is efa\n")
    main(["report", str(run)])
    assert f"report: {run / 'report.html'}" in capsys.readouterr().out
    page = (run / "report.html").read_text()
    assert "NET/OFI Selected Provider is efa" in page and "transport: EFA" in page
    assert "$0.25 per million tokens" in page and "$1.50 at $9.00/h" in page
    assert "10, 30" in page  # checkpoints
    assert "<th>checkpoint time (s per save, share of the loop)</th><td>1.25 s, 4.5%</td>" in page
    assert "Say &lt;hi&gt;" in page and "hi &amp; bye" in page  # samples, escaped
    plots = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert plots == sorted(
        f"{n}.png" for n in ["loss", "eval_ppl", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu"]
    )
    assert page.count("data:image/png;base64,") == len(plots)


def test_report_draws_only_what_the_metrics_have(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    main(["report", str(run)])
    assert [p.name for p in (run / "plots").glob("*.png")] == ["loss.png"]
    page = (run / "report.html").read_text()
    assert "No samples" in page
    assert "<th>checkpoint time (s per save, share of the loop)</th><td>—</td>" in page  # no summary: no figure


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p, "is not a folder"),
        (lambda p: (p.mkdir(), p)[1], "is not a run folder of raytrain-eks"),
        (lambda p: (p.mkdir(), (p / "config.yaml").write_text("{}"), p)[2], "has no metrics yet"),
        (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text('{"step": 1\n'), p)[2], "line 1 is not JSON"),
        (lambda p: (write_run(p), (p / "summary.json").write_text("[1, 2]"), p)[2], "summary.json: not a JSON object"),
        (lambda p: (write_run(p), (p / "summary.json").write_text('{"steps": 3'), p)[2], "not a JSON object"),
    ],
    ids=["missing", "not-a-run", "no-metrics", "broken-metrics", "summary-a-list", "summary-cut-short"],
)
def test_report_refuses_bad_folders_with_one_message(tmp_path, capsys, make, message):
    folder = make(tmp_path / "x")
    with pytest.raises(SystemExit) as info:
        main(["report", str(folder)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_report_refuses_a_file_as_its_folder(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    (tmp_path / "taken").write_text("")
    with pytest.raises(SystemExit) as info:
        main(["report", str(run), "--out", str(tmp_path / "taken")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "is a file, not a folder for the report" in err and "Traceback" not in err
    assert not (run / "plots").exists()


def test_report_shows_a_cost_that_has_no_price_per_token(tmp_path):
    # An attempt that trained no token (stopped before its first step) has no price per million tokens.
    run = write_run(tmp_path / "run", cost={"usd": 0.4, "usd_per_hour": 9.0, "usd_per_million_tokens": None})
    main(["report", str(run)])
    assert "$0.40 at $9.00/h; no token trained" in (run / "report.html").read_text()


@pytest.mark.parametrize("template", [True, False], ids=["chat-template", "plain-layout"])
def test_sample_prompts_are_what_training_shows_before_an_answer(builtin_model, template):
    from transformers import AutoTokenizer

    from raytrain_eks.train.builtin import sample_data_path
    from raytrain_eks.train.data.encoding import IGNORE_INDEX, encode_row
    from raytrain_eks.train.prompts import first_rows, sample_prompts

    tokenizer = AutoTokenizer.from_pretrained(builtin_model)
    if not template:
        tokenizer.chat_template = None
    listed = ([str(sample_data_path())], "json")
    shown, rendered = sample_prompts(None, listed, "instruction", "text", tokenizer, count=2)
    rows = first_rows(*listed, 2)[:2]  # it reads a few more, for rows that turn out malformed
    assert shown == [f"{r['instruction']}\n\n{r['input']}" for r in rows]
    for row, prompt in zip(rows, rendered, strict=True):
        ids, labels = encode_row(row, "instruction", tokenizer)
        first_answer = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
        assert tokenizer(prompt, add_special_tokens=False)["input_ids"] == ids[:first_answer]
    assert rendered[0].endswith("assistant\n" if template else "assistant: ")


def test_evaluation_settings(monkeypatch):
    tiny = presets.local_tiny()
    assert load_config(preset=tiny, environ={}).training.effective_eval_fraction == 0.05
    assert load_config(preset=presets.reference(), environ={}).training.effective_eval_fraction == 0.0  # random ids
    held = load_config(preset=tiny, environ={}, overrides={"training": {"eval_data": "eval.jsonl"}})
    assert held.training.effective_eval_fraction == 0.0
    with pytest.raises(ConfigError, match="eval_data .* or eval_fraction"):
        load_config(preset=tiny, environ={}, overrides={"training": {"eval_data": "e.jsonl", "eval_fraction": 0.1}})
    with pytest.raises(ConfigError, match="eval_data needs real training data"):
        load_config(preset=presets.reference(), environ={}, overrides={"training": {"eval_data": "e.jsonl"}})
    with pytest.raises(ConfigError, match="eval_fraction"):
        load_config(preset=tiny, environ={}, overrides={"training": {"eval_fraction": 1.0}})


def test_mlflow_gets_params_curves_and_summary_in_a_local_store(tmp_path, monkeypatch):
    import mlflow

    from raytrain_eks.report.tracking import Tracker

    # The file store is MLflow's plain local store (SQLite needs SQLAlchemy, which mlflow-skinny leaves out).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    tracker = Tracker(tmp_path / "run", presets.local_tiny())
    tracker.log({"step": 1, "loss": 3.0, "lr": 1e-3})
    tracker.log({"step": 10, "loss": 2.0, "eval_loss": 2.5})
    tracker.close()
    tracker.finish({"steps": 10, "final_loss": 2.0, "fabric": {}, "export": True})
    client = mlflow.MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("raytrain-eks").experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    assert found.data.params["steps"] == str(presets.local_tiny().training.steps) == "40"
    assert found.data.params["model_id"] == "builtin:tiny-qwen2"
    history = client.get_metric_history(found.info.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (10, 2.0)]
    assert found.data.metrics["eval_loss"] == 2.5 and found.data.metrics["summary_final_loss"] == 2.0
    assert "summary_export" not in found.data.metrics  # booleans are not metrics
    assert (tmp_path / "run" / "tensorboard").is_dir()


def _wandb_records(path: Path) -> list:
    """The records of a W&B run file (``run-<id>.wandb``), as W&B's protobuf ``Record`` messages.

    The file is W&B's own header (``:W&B``, magic 0xBEE1, version 0; 7 bytes) and then LevelDB's log format:
    32 KiB blocks of chunks, each with a 7-byte header (CRC-32, length, type: 1 whole, 2 first, 3 middle, 4 last),
    a block's last 6 bytes or fewer left as padding. wandb 0.31's Python package has no reader of it (its writer is
    the Go ``wandb-core``), so the test reads the chunks itself and parses them with wandb's own protobuf classes.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending + chunk)
            out.append(record)
            pending = b""
        elif kind in (2, 3):
            pending += chunk
        else:
            pos += left - 7 - length  # padding: the rest of the block is empty
    return out


def test_weights_and_biases_offline_gets_config_curves_and_summary(tmp_path, monkeypatch):
    from raytrain_eks.report.tracking import Tracker, wandb_wanted

    assert not wandb_wanted({}) and not wandb_wanted({"WANDB_PROJECT": "p", "WANDB_MODE": "disabled"})
    assert wandb_wanted({"WANDB_PROJECT": "p"}) and wandb_wanted({"WANDB_MODE": "offline"})
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    tracker = Tracker(run, presets.local_tiny())
    tracker.log({"step": 1, "loss": 3.0, "lr": 1e-3})
    tracker.log({"step": 10, "loss": 2.0, "eval_loss": 2.5})
    tracker.close()
    tracker.finish({"steps": 10, "final_loss": 2.0, "fabric": {}, "export": True})
    (run_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")  # in the run folder, as WANDB_DIR is unset
    records = _wandb_records(run_file)
    (header,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert header.display_name == "run" and header.project == "raytrain-eks"
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert config["steps"] == 40 and config["model_id"] == "builtin:tiny-qwen2"
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["train/loss"]) for h in history] == [(1, 3.0), (10, 2.0)]
    assert history[1]["eval/loss"] == 2.5 and history[0]["train/lr"] == 1e-3
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
    assert summary["summary/final_loss"] == 2.0 and summary["summary/steps"] == 10
    assert "summary/export" not in summary  # booleans are not numbers here either
    # The run's W&B service process (wandb-core) ended with it: nothing of the run outlives it.
    import procs

    assert not [p for p in procs.descendants(os.getpid()) if "wandb-core" in p.cmdline]


def test_weights_and_biases_that_cannot_start_leaves_the_run_to_its_other_trackers(tmp_path, monkeypatch, caplog):
    import procs

    from raytrain_eks.report.tracking import Tracker

    # Online with no API key anywhere (a HOME of its own: no ~/.netrc): W&B's own UsageError, said in one warning.
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    tracker = Tracker(tmp_path / "run", presets.local_tiny())
    tracker.log({"step": 1, "loss": 3.0})
    tracker.close()
    tracker.finish({"steps": 1})
    (warning,) = [r.getMessage() for r in caplog.records if "Weights & Biases did not start" in r.getMessage()]
    assert "No API key configured" in warning
    assert (tmp_path / "run" / "tensorboard").is_dir()
    assert not [p for p in procs.descendants(os.getpid()) if "wandb-core" in p.cmdline]
