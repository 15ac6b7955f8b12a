"""``training.compile`` (auto, on, off): ``auto`` compiles on CUDA only, so a run on CPU stays eager and says so;
``on`` compiles every decoder layer with the inductor (on CPU here) before sharding, and the run trains as it does
eagerly: same losses and gradient norms, step by step, in one process with FSDP (fp32). The compiled code is cached
in the folder the workers' environment names; older files and flags (true/false, --compile/--no-compile) read as on
and off; the summary records the choice and the time to the first step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrain_eks.config import BUILTIN_MODEL, RANDOM_DATA, TrainingConfig, load_config
from raytrain_eks.errors import ConfigError
from raytrain_eks.train.model import resolve_compile
from raytrain_eks.train.torchrun_entry import run
from raytrain_eks.train.worker_env import compile_cache_environment, worker_environment

CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")
STEPS = 3


def _training(**extra: Any) -> TrainingConfig:
    return TrainingConfig(
        model_id=BUILTIN_MODEL,
        data=RANDOM_DATA,
        steps=STEPS,
        seq_len=32,
        batch_size=4,
        grad_accum_steps=2,
        learning_rate=1e-2,
        warmup_steps=1,
        precision="fp32",
        sharding="fsdp",
        log_every=1,
        checkpoint_every=0,
        **extra,
    )


def _records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("starts_ray")
def test_compiled_layers_train_as_eager_ones(tmp_path, one_process_group, builtin_model, capsys, monkeypatch):
    import torch._dynamo

    eager_summary = run(_training(), tmp_path / "eager")  # auto, on a CPU: not compiled
    assert "compile: off (auto: the device is a CPU)" in capsys.readouterr().out
    assert eager_summary["compile"] == "off"
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # Compiled with the cache the Ray workers are given (its folder outlives this test, as it outlives a worker).
    for name in CACHE_VARS:
        monkeypatch.delenv(name, raising=False)
    env = worker_environment(load_config(environ={}, path=None), "run", use_gpu=False)
    for name in CACHE_VARS:
        monkeypatch.setenv(name, env[name])
    summary = run(_training(compile="on"), tmp_path / "compiled")
    assert summary["steps"] == STEPS and summary["compile"] == "on" and summary["first_step_s"] > 0
    out = capsys.readouterr().out
    from raytrain_eks.train.model import load_model
    from raytrain_eks.train.sharding import decoder_layers

    layers = len(decoder_layers(load_model(builtin_model, activation_checkpointing=False)))
    assert f"compile: {layers} decoder layers with torch.compile (as configured)" in out
    assert "first step: done " in out and "(model start, compiling and the step)" in out
    # The inductor really compiled (at least one graph), and the layers ran compiled code without falling back.
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] >= 1
    # Its graphs went through the FX graph and AOT autograd caches, kept in the workers' folder.
    assert counters["inductor"]["fxgraph_cache_hit"] + counters["inductor"]["fxgraph_cache_miss"] >= 1
    assert counters["aot_autograd"]["autograd_cache_hit"] + counters["aot_autograd"]["autograd_cache_miss"] >= 1
    assert any((Path(env["TORCHINDUCTOR_CACHE_DIR"]) / "fxgraph").iterdir())
    eager, compiled = _records(tmp_path / "eager"), _records(tmp_path / "compiled")
    assert [r["step"] for r in compiled] == list(range(1, STEPS + 1))
    assert abs(eager[-1]["loss"] - eager[0]["loss"]) > 1e-3  # the weights moved: later steps test the updates
    for a, b in zip(compiled, eager, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]


def test_auto_compiles_on_cuda_and_not_on_a_cpu():
    assert resolve_compile("auto", torch.device("cuda", 0)) == (True, "auto: CUDA")
    assert resolve_compile("auto", torch.device("cpu")) == (False, "auto: the device is a CPU")
    assert resolve_compile("on", torch.device("cpu")) == (True, "as configured")
    assert resolve_compile("off", torch.device("cuda", 0)) == (False, "as configured")


def test_older_files_and_flags_read_as_on_and_off(train_settings, tmp_path):
    assert TrainingConfig().compile == "auto"
    assert train_settings().compile == "auto"
    assert train_settings("--compile").compile == "on"
    assert train_settings("--no-compile").compile == "off"
    file = tmp_path / "settings.yaml"
    # YAML reads true, false, on and off unquoted as booleans; quoted, on and off are the setting's own words.
    for given, read in [
        ("true", "on"),
        ("false", "off"),
        ("on", "on"),
        ("off", "off"),
        ("'off'", "off"),
        ("auto", "auto"),
    ]:
        file.write_text(f"training:\n  compile: {given}\n")
        assert load_config(path=file, environ={}).training.compile == read, given
    assert load_config(path=None, environ={}, sets=["training.compile=false"]).training.compile == "off"
    file.write_text("training:\n  compile: fast\n")
    with pytest.raises(ConfigError, match="training.compile") as info:
        load_config(path=file, environ={})
    assert "'auto', 'on' or 'off'" in str(info.value)


def test_the_workers_keep_compiled_code_in_a_folder_of_the_user_on_the_node(monkeypatch):
    import getpass

    for name in CACHE_VARS:
        monkeypatch.delenv(name, raising=False)
    env = worker_environment(load_config(environ={}, path=None), "run", use_gpu=True)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"/tmp/raytrain-eks-{getpass.getuser()}/inductor"
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    # What the user chose stays.
    chosen = compile_cache_environment({"TORCHINDUCTOR_CACHE_DIR": "/scratch/ic", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})
    assert chosen == {
        "TORCHINDUCTOR_CACHE_DIR": "/scratch/ic",
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
