"""What a run leaves for people, on real Ray with two gloo workers: held-out loss, samples, TensorBoard events and
the HTML report (and ``raytrain-eks report`` on run folders, good and bad)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from raytrain_eks import presets
from raytrain_eks.cli import main
from raytrain_eks.config import load_config
from raytrain_eks.train.launch import run_training

pytestmark = pytest.mark.usefixtures("starts_ray")


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_local):
    """One short run of the default job (built-in data: 5% held out), evaluated every 10 steps. In fp32 (what
    ``precision: auto`` gives on a CPU without native bf16), so that one plain process in fp32 must agree with it:
    with bf16 compute, near-ties of greedy decoding and the loss's last digits depend on the machine."""
    root = tmp_path_factory.mktemp("runs")
    training = {"steps": 20, "eval_every": 10, "log_every": 5, "precision": "fp32", "output_dir": str(root / "run")}
    cfg = load_config(preset=presets.local_tiny(), environ={}, overrides={"training": training})
    lines: list[str] = []
    result = run_training(cfg, runs_root=root, say=lines.append)
    return cfg, result, lines


def _held_out_loss_by_hand(cfg, model_dir) -> tuple[float, int]:
    """The loss of the exported model over every held-out token, in one plain process (no sharding, no Ray Train)."""
    from transformers import AutoModelForCausalLM

    from raytrain_eks.train.builtin import sample_data_path
    from raytrain_eks.train.data.encoding import IGNORE_INDEX
    from raytrain_eks.train.data.pipeline import DataSettings, prepare_dataset

    t = cfg.training
    prepared = prepare_dataset(
        DataSettings(
            data_format=t.data_format,
            text_field=t.text_field,
            tokenizer_path=str(model_dir),
            seq_len=t.seq_len,
            seed=t.seed,
        ),
        data=str(sample_data_path()),
        min_blocks=1,
        eval_fraction=t.effective_eval_fraction,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in prepared.eval_dataset.iter_rows():
            ids = torch.tensor(row["input_ids"])[None]
            labels = torch.tensor(row["labels"])[None]
            # Packed by documents: each row's own positions, from which the model keeps its rows apart.
            positions = torch.tensor(row["position_ids"], dtype=torch.long)[None]
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, :-1]
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1)),
                    labels[:, 1:].reshape(-1),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
            )
            count += int((labels[:, 1:] != IGNORE_INDEX).sum())
    return total / count, count


def test_held_out_loss_covers_every_held_out_token_across_ranks(run):
    cfg, result, lines = run
    assert any(line.startswith("eval: 20 rows held out") for line in lines)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(evals) == [10, 20]
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["eval_loss"] == evals[20]["eval_loss"]
    assert summary["eval_ppl"] == pytest.approx(math.exp(summary["eval_loss"]))
    assert evals[20]["eval_loss"] < evals[10]["eval_loss"]  # training helped on rows it never saw
    # The final evaluation ran on the final weights, which is what export wrote: one process must agree exactly.
    expected, tokens = _held_out_loss_by_hand(cfg, result.run_dir / "model")
    assert summary["eval_tokens"] == tokens
    assert summary["eval_loss"] == pytest.approx(expected, rel=1e-5)


def test_samples_answer_the_datas_first_prompts(run):
    _, result, _ = run
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    from raytrain_eks.train.builtin import sample_data_path

    first = [json.loads(line) for line in sample_data_path().read_text().splitlines()[:3]]
    assert [s["prompt"] for s in samples] == [f"{r['instruction']}\n\n{r['input']}" for r in first]
    assert all(0 < s["tokens"] <= 32 and isinstance(s["completion"], str) for s in samples)
    assert all(s["rendered_prompt"].endswith("assistant\n") for s in samples)
    # Answered together on the sharded model, each prompt got what it gets alone from the exported weights.
    assert [s["completion"] for s in samples] == _greedy_alone(result.run_dir / "model", samples)


def _greedy_alone(model_dir, samples) -> list[str]:
    """Each sample's rendered prompt continued greedily on its own, in one plain process (no padding, no sharding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    completions = []
    with torch.no_grad():
        for sample in samples:
            ids = tokenizer(sample["rendered_prompt"], add_special_tokens=False)["input_ids"]
            new: list[int] = []
            for _ in range(sample["tokens"]):
                token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
                new.append(token)
            completions.append(tokenizer.decode(new, skip_special_tokens=True))
    return completions


def test_tensorboard_events_hold_the_curves(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, result, _ = run
    events = EventAccumulator(str(result.run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "eval/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s"} <= set(scalars)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/loss")] == [
        (r["step"], r["loss"]) for r in records
    ]
    assert [e.step for e in events.Scalars("eval/loss")] == [10, 20]


def test_the_run_writes_its_report(run):
    _, result, lines = run
    page = (result.run_dir / "report.html").read_text()
    assert f"report: {result.run_dir / 'report.html'}" in lines
    assert page.count('src="data:image/png;base64,') == len(list((result.run_dir / "plots").glob("*.png"))) >= 5
    assert "Write these words in capital letters." in page  # a sample's prompt
    assert "eval_every: 10" in page  # the configuration
    n = result.summary["parameters"]
    assert result.summary["trainable_parameters"] == n  # a full fine-tune trains every weight
    assert f"<td>{n:,} / {n:,} (100.0%)</td>" in page


def test_report_command_overlays_runs(run, tmp_path, capsys):
    _, result, _ = run
    other = tmp_path / "other"
    other.mkdir()
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    (other / "metrics.jsonl").write_text("".join(json.dumps({**r, "loss": r["loss"] + 1}) + "\n" for r in records))
    main(["report", str(result.run_dir), str(other), "--out", str(tmp_path / "both")])
    assert f"report: {tmp_path / 'both' / 'report.html'}" in capsys.readouterr().out
    page = (tmp_path / "both" / "report.html").read_text()
    assert "2 runs: run, other" in page
    single = (result.run_dir / "plots" / "loss.png").stat().st_size
    assert (tmp_path / "both" / "plots" / "loss.png").stat().st_size != single  # a second line was drawn
