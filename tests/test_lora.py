"""LoRA (peft) on the real path: Ray Train workers, FSDP2 over 2 ranks, the shipped data, a SIGKILLed worker.

A LoRA run of the built-in model trains without interruption (its folder is only read); another is killed and must
resume to the same losses and adapters. Exports are loaded the ways users load them: the merged model with
``AutoModelForCausalLM``, the adapters with ``PeftModel.from_pretrained`` on the base, and both must give the
logits of the trained model, rebuilt here from its base and the checkpoint's adapters.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import procs
import pytest
import torch
from run_folders import checkpoint_tensor_bytes
from safetensors.torch import load_file

from raytrain_eks import presets
from raytrain_eks.cli import main
from raytrain_eks.config import LoraSettings, load_config
from raytrain_eks.deploy.plan import storage_estimate
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.train.checkpoint import check_compatible, list_checkpoints
from raytrain_eks.train.flops import flops_per_token, matmul_flops_per_token, matmul_params
from raytrain_eks.train.launch import run_training
from raytrain_eks.train.lora import apply_lora, linear_layers

pytestmark = pytest.mark.usefixtures("starts_ray")

# As the full fine-tune's checkpoint tests: 30 steps of 2 x 4 blocks of 64 tokens into a second epoch, checkpoints
# at 10, 20 and 30 (mid-epoch); a learning rate LoRA moves with (its adapters start at zero).
REFERENCE = {
    "method": "lora",
    "steps": 30,
    "seq_len": 64,
    "batch_size": 4,
    "log_every": 1,
    "checkpoint_every": 10,
    "learning_rate": 2e-3,
}


def make_config(**training):
    return load_config(preset=presets.local_tiny(), path=None, environ={}, overrides={"training": training})


def quiet(_: str) -> None:
    pass


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def saved_tensors(checkpoint: str) -> dict[str, tuple[int, ...]]:
    """Every tensor a DCP checkpoint holds, by name, with its shape (from its metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in meta.items() if hasattr(v, "size")}


def adapters(checkpoint: str) -> dict[str, torch.Tensor]:
    """The adapters a checkpoint holds, read with DCP in this process."""
    import torch.distributed.checkpoint as dcp

    names = {k: s for k, s in saved_tensors(checkpoint).items() if k.startswith("model.")}
    state = {"model": {k.removeprefix("model."): torch.empty(s) for k, s in names.items()}}
    with warnings.catch_warnings():  # one process without a process group is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return state["model"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("lora")
    return run_training(make_config(**REFERENCE, output_dir=str(root / "run")), runs_root=root, say=quiet)


def test_lora_settings_are_checked_before_anything_starts(tmp_path, builtin_model):
    with pytest.raises(ConfigError, match="training.lora.rank"):
        make_config(method="lora", lora={"rank": 0})
    with pytest.raises(ConfigError, match="training.method"):
        make_config(method="qlora")
    from raytrain_eks.train.model import load_model

    model = load_model(builtin_model, activation_checkpointing=False)
    assert linear_layers(model) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with pytest.raises(UserError) as info:
        apply_lora(model, LoraSettings(target_modules=["q_proj", "qkv_proj"]))
    assert "'qkv_proj' matches no linear layer of Qwen2ForCausalLM's decoder blocks" in str(info.value)
    assert "its linear layers are: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in str(info.value)
    # An architecture transformers builds no causal LM of: one message, not a traceback.
    from transformers import T5Config

    from raytrain_eks.train.lora import check_lora

    with pytest.raises(UserError, match="cannot be built to find its linear layers"):
        check_lora(T5Config(), LoraSettings())
    # The same message from a run, before any run folder or worker exists.
    cfg = make_config(method="lora", lora={"target_modules": ["qkv_proj"]}, output_dir=str(tmp_path / "run"))
    with pytest.raises(UserError, match="'qkv_proj' matches no linear layer"):
        run_training(cfg, runs_root=tmp_path, say=quiet)
    assert not (tmp_path / "run").exists()


def test_a_lora_run_trains_and_checkpoints_only_the_adapters(lora_run):
    summary = lora_run.summary
    assert summary["method"] == "lora"
    losses = [r["loss"] for r in lora_run.records if "loss" in r]
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    # The built-in model: 7 adapted projections per block, rank 16 each side.
    cfg = json.loads((lora_run.run_dir / "model" / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]  # (in, out) of each
    adapter_params = layers * sum(16 * (i + o) for i, o in shapes)
    assert summary["trainable_parameters"] == adapter_params
    assert summary["parameters"] > 5 * adapter_params
    page = (lora_run.run_dir / "report.html").read_text()
    share = 100 * adapter_params / summary["parameters"]
    assert f"<td>{adapter_params:,} / {summary['parameters']:,} ({share:.1f}%)</td>" in page and "<td>lora</td>" in page
    # MFU's FLOPs: the frozen base makes no weight gradients (4 N), the adapters all three products (6 A).
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(lora_run.run_dir / "model")
    per_token = matmul_flops_per_token(config, adapters=adapter_params)
    assert per_token == 4 * matmul_params(config) + 6 * adapter_params
    assert flops_per_token(config, 64, adapters=adapter_params) == per_token + 12 * layers * h * 64
    # The run's rows are shorter than its blocks of 64: each attends over its own length, padding is no token.
    assert per_token < summary["flops_per_token"] < flops_per_token(config, 64, adapters=adapter_params)
    # Checkpoints hold the adapters and their optimizer moments, never a weight of the frozen base.
    newest = list_checkpoints(lora_run.run_dir / "ray")[-1][1]
    held = saved_tensors(newest)
    weights = [k for k in held if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert sum(math.prod(held[k]) for k in weights) == adapter_params
    moments = [k for k in held if k.startswith("optim.state.")]
    assert moments and all(".lora_" in k or k.endswith(".step") for k in moments)
    assert json.loads((Path(newest) / "hf" / "adapter_config.json").read_text())["r"] == 16
    # What plan says the kept checkpoints take is what they hold: 12 bytes for each adapter parameter, not for the
    # frozen base (a full fine-tune's estimate of this model is over 5 times as much).
    estimate = storage_estimate(make_config(**REFERENCE))
    assert estimate["trained_parameters"] == adapter_params
    assert checkpoint_tensor_bytes(newest) == pytest.approx(estimate["bytes_per_checkpoint"], rel=0.01)
    assert (
        storage_estimate(make_config(**{**REFERENCE, "method": "full"}))["bytes_per_checkpoint"]
        > 5 * (estimate["bytes_per_checkpoint"])
    )


def _trained_logits(base: str, checkpoint: str, ids: torch.Tensor) -> torch.Tensor:
    """The trained model's logits: its base with the checkpoint's adapters put back, as the workers had it."""
    from raytrain_eks.train.model import load_model

    model = load_model(base, activation_checkpointing=False)
    apply_lora(model, LoraSettings())
    state = model.state_dict()
    for name, tensor in adapters(checkpoint).items():
        state[name].copy_(tensor)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_exports_merged_and_adapter_only_give_the_trained_models_logits(tmp_path, lora_run, builtin_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    newest = list_checkpoints(lora_run.run_dir / "ray")[-1][1]
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    trained = _trained_logits(builtin_model, newest, ids)
    base = AutoModelForCausalLM.from_pretrained(builtin_model)
    with torch.no_grad():
        assert (base(input_ids=ids).logits - trained).abs().max() > 0.1, "the adapters changed the model"
    # The merged model the run exported (a plain model folder: no peft needed to load it).
    merged = AutoModelForCausalLM.from_pretrained(lora_run.run_dir / "model")
    assert not (lora_run.run_dir / "model" / "adapter_config.json").exists()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=1e-4, atol=1e-4)
    # The adapters alone, as peft loads them onto the base.
    out = tmp_path / "adapter"
    main(["export", str(lora_run.run_dir), str(out), "--adapter-only"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert all(".lora_" in k and ".default." not in k for k in load_file(out / "adapter_model.safetensors"))
    peft_model = PeftModel.from_pretrained(base, out)
    peft_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, trained, rtol=1e-4, atol=1e-4)


def test_a_lora_run_resumes_exactly_after_a_sigkilled_worker(tmp_path, lora_run):
    killed: list[int] = []

    def kill_a_worker(record: dict, total: int) -> None:
        if record.get("step", 0) >= 14 and not killed:
            killed.append(procs.kill_newest_train_worker())

    cfg = make_config(**REFERENCE, output_dir=str(tmp_path / "run"))
    result = run_training(cfg, runs_root=tmp_path, say=quiet, progress=kill_a_worker)
    assert killed and result.summary["steps"] == 30
    resumed = result.summary["resumed_from_step"]
    assert resumed in (10, 20), result.summary
    after = {r["step"]: r["loss"] for r in history(result.run_dir) if r["resumed_from_step"] == resumed}
    before = {r["step"]: r["loss"] for r in lora_run.records if "loss" in r}
    assert after and after == {s: before[s] for s in after}  # dropout's random draws resumed too
    mine = adapters(list_checkpoints(result.run_dir / "ray")[-1][1])
    reference = adapters(list_checkpoints(lora_run.run_dir / "ray")[-1][1])
    assert mine.keys() == reference.keys()
    for name in mine:
        assert torch.equal(mine[name], reference[name]), name
    # A resume with another method is refused with one message, before any worker starts.
    newest = list_checkpoints(lora_run.run_dir / "ray")[-1][1]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(Path(newest) / "hf")
    with pytest.raises(UserError, match="holds LoRA adapters on a frozen base, but this run is set to method full"):
        check_compatible(newest, config, lora=None)
    with pytest.raises(UserError, match="has LoRA rank 16 on .* but this run is set to rank 8"):
        check_compatible(newest, config, lora={"r": 8, "target_modules": ["q_proj"]})
