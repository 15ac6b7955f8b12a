"""``raytrain-eks eval``: a run's exported model scored on the shipped local multiple-choice task with EleutherAI's
lm-evaluation-harness.

What a user notices: the accuracy (and its standard error and example count) equals what lm-eval's own CLI gives on
the same model and task; two Ray workers, each scoring half of the examples, give the figures of one process; the
results land in the run folder's ``eval.json``, its bundle and its report; a wrong task or folder is one message,
given before any model loads.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from raytrain_eks.cli import main
from raytrain_eks.evaluation import harness
from raytrain_eks.evaluation.run import evaluate, resolve_target

TASK = "raytrain_sample_mc"
EXAMPLES = 32  # the lines of resources/eval_tasks/raytrain_sample_mc.jsonl


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as ended:
        main(list(args))
        raise SystemExit(0)
    return int(ended.value.code or 0), out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run_dir(builtin_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run as ``train`` leaves it: its config (storage in a local folder), metrics, and its export."""
    root = tmp_path_factory.mktemp("eval")
    run = root / "runs" / "20261208-000000-tiny-qwen2"
    shutil.copytree(builtin_model, run / "model")
    storage = root / "storage"
    (run / "config.yaml").write_text(yaml.safe_dump({"training": {"storage_path": str(storage), "steps": 2}}))
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 3.0 - s, "lr": 1e-4, "tokens_per_s": 100.0}) + "\n" for s in (1, 2))
    )
    return run


@pytest.fixture(scope="module")
def evaluated(run_dir: Path) -> tuple[dict[str, Any], str]:
    """``raytrain-eks eval RUN --tasks raytrain_sample_mc`` (one process): eval.json's content and what it printed."""
    code, out, err = _cli("eval", str(run_dir), "--tasks", TASK)
    assert code == 0, err
    return json.loads((run_dir / "eval.json").read_text()), out


@pytest.mark.usefixtures("starts_programs")  # lm-eval's own CLI, in a process of its own
def test_eval_gives_the_accuracy_of_lm_evals_own_cli(evaluated, run_dir, tmp_path):
    doc, printed = evaluated
    argv = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={run_dir / 'model'}"]
    argv += ["--tasks", TASK, "--include_path", str(harness.SHIPPED_TASKS), "--device", "cpu"]
    argv += ["--output_path", str(tmp_path / "lm_eval")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(next((tmp_path / "lm_eval").rglob("results_*.json")).read_text())
    ours = doc["tasks"][TASK]
    assert ours["n"] == theirs["n-samples"][TASK]["effective"] == EXAMPLES
    for metric in ("acc", "acc_norm"):
        assert ours["metrics"][metric]["value"] == pytest.approx(theirs["results"][TASK][f"{metric},none"], abs=1e-12)
        assert ours["metrics"][metric]["stderr"] == pytest.approx(
            theirs["results"][TASK][f"{metric}_stderr,none"], abs=1e-12
        )
    # the terminal's table, where the results went, and the run's bundle (a finished run kept in storage)
    assert TASK in printed and f"{ours['metrics']['acc']['value']:.4f}" in printed
    assert f"results: {(run_dir / 'eval.json').resolve()}" in printed
    storage = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["training"]["storage_path"])
    assert json.loads((storage / run_dir.name / "eval.json").read_text()) == doc


def test_the_report_shows_the_runs_evaluation(tmp_path):
    from raytrain_eks.report.html import write_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "lr": 1e-4, "tokens_per_s": 10.0}) + "\n")
    acc = {"value": 0.21875, "stderr": 0.0742, "higher_is_better": True}
    (run / "eval.json").write_text(json.dumps({"tasks": {TASK: {"n": EXAMPLES, "metrics": {"acc": acc}}}}))
    page = write_report([run], run).read_text()
    assert "<h2>Evaluation</h2>" in page
    assert f"<td>{TASK}</td><td>acc</td><td>0.2188 ± 0.0742</td><td>{EXAMPLES}</td>" in page
    (run / "eval.json").unlink()
    assert "<h2>Evaluation</h2>" not in write_report([run], run).read_text()


def test_two_ray_workers_give_the_single_process_figures(evaluated, run_dir, ray_local):
    single, _ = evaluated
    tasks = harness.load_tasks([TASK], [])
    # The workers get the model's files through Ray, as on a cluster whose nodes do not see this folder.
    results = evaluate(run_dir / "model", tasks, workers=2, on_ray=True, ship_model=True)
    assert results[TASK].as_dict()["n"] == EXAMPLES
    assert results[TASK].as_dict()["metrics"] == single["tasks"][TASK]["metrics"]


def test_shares_cover_each_example_once_within_the_limit():
    info = harness.TaskInfo(TASK, EXAMPLES, 1, 0, {}, {})
    shares = harness.split_examples({TASK: info}, 3, 10)
    ids = sorted(i for share in shares for i in share[TASK])
    assert ids == list(range(10))
    assert [len(share[TASK]) for share in shares] == [4, 3, 3]
    assert len(harness.split_examples({TASK: info}, 40, None)) == EXAMPLES  # no worker without an example


def test_merge_counts_every_example_rather_than_averaging_the_workers():
    from lm_eval.api.metrics import mean

    info = harness.TaskInfo(TASK, 4, 1, 0, {"acc": True}, {"acc": mean})
    three_right = {TASK: [(0, {"acc": 1.0}), (2, {"acc": 1.0}), (3, {"acc": 1.0})]}
    one_wrong = {TASK: [(1, {"acc": 0.0})]}
    merged = harness.merge({TASK: info}, [three_right, one_wrong])[TASK]
    assert merged.n == 4
    assert merged.metrics["acc"][0] == 0.75  # not (1.0 + 0.0) / 2
    assert merged.metrics["acc"][1] == pytest.approx(0.25)  # the sample's stddev (0.5) over sqrt(4)


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ({"config.yaml": "training: {}\n", "metrics.jsonl": ""}, "has no exported model"),
        ({"adapter_config.json": "{}"}, "holds LoRA adapters alone"),
        ({"notes.txt": "x"}, "holds no model"),
    ],
)
def test_a_folder_without_a_model_is_one_message(tmp_path, files, words):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    code, _, err = _cli("eval", str(tmp_path), "--tasks", TASK)
    assert code == 1
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "eval.json").exists()


def test_an_unknown_task_is_named_before_the_model_loads(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # no weights: loading it would fail with another error
    code, _, err = _cli("eval", str(tmp_path), "--tasks", f"{TASK},no_such_task_xyz")
    assert code == 1
    assert "unknown lm-eval task(s): no_such_task_xyz" in err and TASK in err  # the hint names the shipped one
    assert not (tmp_path / "eval.json").exists()


def test_a_run_folder_resolves_to_its_export_and_a_model_folder_to_itself(tmp_path):
    (tmp_path / "run" / "model").mkdir(parents=True)
    (tmp_path / "run" / "model" / "config.json").write_text("{}")
    run = resolve_target(tmp_path / "run")
    assert (run.model_dir, run.results_file, run.run_dir) == (
        tmp_path / "run" / "model",
        tmp_path / "run" / "eval.json",
        tmp_path / "run",
    )
    model = resolve_target(tmp_path / "run" / "model")
    assert (model.model_dir, model.results_file, model.run_dir) == (
        tmp_path / "run" / "model",
        tmp_path / "run" / "model" / "eval.json",
        None,
    )
