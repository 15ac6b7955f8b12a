"""DPO in the training loop (``training.method: dpo``).

In one process (a gloo world of one, FSDP over it, no Ray): with ``dpo.adapters: none`` the reference is a frozen
copy of the start weights, so the first step's rewards are exactly 0, the policy's weights move and the copy's never
do, and the copy is in no optimizer. A real run of two Ray Train workers (FSDP2 over both) with LoRA on the built-in
pairs: the reference is the model with its adapters off, the margin grows, the records and the summary carry TRL's
metrics, a worker SIGKILLed before a step resumes from its checkpoint to the same losses, and the merged export loads.
"""

from __future__ import annotations

import json
import time
from importlib import resources

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed as dist
from test_attention import PackedInMemory
from test_host_syncs import META, _meta_model
from test_lora import history, make_config, quiet
from torch.testing._internal.distributed.fake_pg import FakeStore

from raytrain_eks.config import BUILTIN_MODEL, LoraSettings, TrainingConfig
from raytrain_eks.train.data.encoding import encode_joined_pair
from raytrain_eks.train.data.packing import pack_table
from raytrain_eks.train.dpo import METRICS, Reference, pair_documents, pairs_in
from raytrain_eks.train.faults import ENV as FAULT_ENV
from raytrain_eks.train.launch import run_training
from raytrain_eks.train.loop import PreparedModel, logged_dpo, start_run, train_step
from raytrain_eks.train.lora import apply_lora
from raytrain_eks.train.model import output_projection_deferred
from raytrain_eks.train.records import dpo_line

SEQ = 64


def _pair_blocks(tokenizer, pairs: int = 16) -> dict[str, np.ndarray]:
    """The first built-in preference pairs, encoded and packed as the pipeline does: each pair one joined row
    (encode_joined_pair), the rows packed by pack_table with their split."""
    text = resources.files("raytrain_eks.resources").joinpath("sample_preferences.jsonl").read_text()
    joined = [encode_joined_pair(json.loads(line), "preference", tokenizer) for line in text.splitlines()[:pairs]]
    table = pa.table(
        {"input_ids": [j.ids for j in joined], "labels": [j.labels for j in joined], "split": [j.split for j in joined]}
    )
    return pack_table(table, SEQ, tokenizer.pad_token_id, packing="documents", overlong="drop")


def _full(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}


def test_full_dpo_trains_the_policy_against_a_frozen_copy_of_its_start(
    builtin_model, tokenizer, tmp_path, one_process_group
):
    cfg = TrainingConfig(
        model_id=builtin_model,
        method="dpo",
        dpo={"adapters": "none"},
        steps=4,
        seq_len=SEQ,
        batch_size=2,
        grad_accum_steps=2,
        learning_rate=1e-3,
        warmup_steps=0,
        precision="fp32",
        sharding="fsdp",  # FSDP2 over a world of one: the copy is sharded, and freed after its pass, as in a run
        sample_tokens=0,
    )
    blocks = _pair_blocks(tokenizer, pairs=4)
    assert len(blocks["input_ids"]) == 4  # a pair a block: each step trains on the same pairs, in its 4 blocks
    ctx = PackedInMemory(tmp_path, blocks)
    run = start_run(cfg, builtin_model, ctx, time.perf_counter())
    reference, policy = run.reference.model, run.prepared.model
    assert reference is not policy and not run.reference.adapters
    assert all(not p.requires_grad for p in reference.parameters())
    optimized = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
    assert optimized and not optimized & {id(p) for p in reference.parameters()}
    start_policy, start_reference = _full(policy), _full(reference)
    assert start_policy.keys() == start_reference.keys()
    assert all(torch.equal(start_policy[k], start_reference[k]) for k in start_policy)  # the start weights

    metrics = []
    for _ in range(cfg.steps):
        micro = [next(run.batches) for _ in range(cfg.grad_accum_steps)]
        result = train_step(run.prepared, run.optimizer, run.scheduler, micro, cfg=cfg, mode=run.layout.mode,
                            world_size=1, device=run.device, reference=run.reference)  # fmt: skip
        metrics.append(logged_dpo(result))
    assert set(metrics[0]) == set(METRICS)
    # Step 1: the policy is its reference, so every reward is 0 and no pair is ahead; then the policy learns.
    assert metrics[0]["rewards/chosen"] == metrics[0]["rewards/rejected"] == 0.0
    assert metrics[0]["rewards/accuracies"] == 0.0
    margins = [m["rewards/margins"] for m in metrics]
    assert margins[-1] > margins[0] + 0.05, (margins, [m["rewards/accuracies"] for m in metrics])
    moved, kept = _full(policy), _full(reference)
    assert any(not torch.equal(moved[k], start_policy[k]) for k in moved)
    assert all(torch.equal(kept[k], start_reference[k]) for k in kept)
    assert dpo_line({"dpo": metrics[-1]}).startswith("margin ") and dpo_line({"loss": 1.0}) == ""


def test_lora_dpo_under_fsdp2_in_bf16_trains_after_its_reference_pass(
    builtin_model, tokenizer, tmp_path, one_process_group
):
    """The reference pass (adapters off, no_grad) comes first, and is FSDP2's first forward: the policy's backward
    after it still reduces the adapters' gradients into their fp32 parameters, and only the adapters move."""
    cfg = TrainingConfig(
        model_id=builtin_model,
        method="dpo",
        steps=2,
        seq_len=SEQ,
        batch_size=2,
        learning_rate=2e-3,
        warmup_steps=0,
        precision="bf16",
        sharding="fsdp",
        sample_tokens=0,
    )
    run = start_run(cfg, builtin_model, PackedInMemory(tmp_path, _pair_blocks(tokenizer, pairs=2)), time.perf_counter())
    assert run.reference.adapters and run.reference.model is run.prepared.model
    policy = run.prepared.model
    start = _full(policy)
    metrics = []
    for _ in range(cfg.steps):
        micro = [next(run.batches)]
        result = train_step(run.prepared, run.optimizer, run.scheduler, micro, cfg=cfg, mode=run.layout.mode,
                            world_size=1, device=run.device, reference=run.reference)  # fmt: skip
        metrics.append(logged_dpo(result))
    assert metrics[0]["rewards/margins"] == 0.0 and metrics[1]["rewards/margins"] > 0.0, metrics
    after = _full(policy)
    moved = {k for k in after if not torch.equal(after[k], start[k])}
    assert moved and all("lora_" in k for k in moved)
    assert all(p.requires_grad == ("lora_" in n) for n, p in policy.named_parameters())


def test_the_pairs_of_a_step_are_counted_on_the_host(tokenizer):
    """The step's normaliser comes from the batch's host positions, never from the device."""
    blocks = {k: torch.from_numpy(v) for k, v in _pair_blocks(tokenizer, pairs=5).items()}
    document, total = pair_documents(blocks["position_ids"])
    assert pairs_in(blocks) == 5 and total == 10
    assert document.shape == (blocks["labels"][:, 1:].numel(),)


@pytest.fixture
def fake_world():
    """A process group of one whose collectives leave tensors as they are (torch's own test backend)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("adapters", [False, True], ids=["frozen-copy", "lora"])
def test_a_dpo_step_reads_nothing_back_from_the_device(adapters, tokenizer, fake_world):
    """As test_host_syncs' step: on the meta device any read of a device value raises, so a DPO step (the
    reference's pass, the policy's, the pairs' sums) that runs there waits for nothing; its pairs are found from the
    batch's host positions."""
    model = _meta_model("qwen2")
    if adapters:
        apply_lora(model, LoraSettings(rank=4, target_modules=["q_proj", "v_proj"]))
    head = output_projection_deferred(model)
    if adapters:
        reference = Reference(model, head, adapters=True)
    else:
        frozen = _meta_model("qwen2").requires_grad_(False)
        reference = Reference(frozen, output_projection_deferred(frozen), adapters=False)
    blocks = {k: torch.from_numpy(v.astype(np.int64)) for k, v in _pair_blocks(tokenizer, pairs=4).items()}
    micro = [{k: v[:2] for k, v in blocks.items()}, {k: v[2:] for k, v in blocks.items()}]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    cfg = TrainingConfig(model_id=BUILTIN_MODEL, method="dpo", steps=1, seq_len=SEQ, batch_size=2, precision="fp32")
    result = train_step(PreparedModel(model, head, 0, 0), optimizer, scheduler, micro, cfg=cfg, mode="none",
                        world_size=1, device=META, reference=reference)  # fmt: skip
    assert result.dpo is not None and result.dpo.device == META and result.loss_sum.device == META


def test_the_estimate_counts_a_frozen_reference_copy_and_nothing_more_for_lora():
    """What the plan and a GPU run's start admit: DPO without adapters holds a second, frozen, sharded copy of the
    weights (fp32, as the model's); with LoRA the reference is the model itself. DPO scores responses from the
    full logits, so its estimate counts the plain loss."""
    from raytrain_eks.train.memory import GIB, KNOWN_SHAPES, check_training

    qwen = KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]
    common = dict(shard_ranks=8, precision="bf16", gpu_name="H200", gpu_bytes=141 * GIB)

    def peak(**training) -> tuple[int, dict[str, int], str]:
        check = check_training(qwen, TrainingConfig(batch_size=2, seq_len=2048, **training), **common)
        return check.estimate.peak_bytes, check.estimate.parts, check.loss

    full, _, _ = peak(method="full", loss_kernel="plain")
    dpo, parts, line = peak(method="dpo", dpo={"adapters": "none"}, data="prefs.jsonl")
    assert parts["DPO reference weights (fp32, sharded)"] == 4 * qwen.params // 8
    assert dpo == full + 4 * qwen.params // 8
    assert line.startswith("loss kernel: plain (method dpo")
    lora, _, _ = peak(method="lora", loss_kernel="plain")
    assert peak(method="dpo", data="prefs.jsonl")[0] == lora


# A LoRA DPO run on 2 Ray Train workers: few steps of 2 x 2 blocks, checkpoints at 4 and 8, a learning rate the
# adapters move with.
DPO_RUN = {
    "method": "dpo",
    "steps": 10,
    "seq_len": SEQ,
    "batch_size": 2,
    "log_every": 1,
    "checkpoint_every": 4,
    "learning_rate": 2e-3,
    "sample_tokens": 0,
}


def test_a_lora_dpo_run_trains_resumes_exactly_and_exports(tmp_path, monkeypatch, ray_local):
    # Rank 1 SIGKILLs itself before step 8, once: the workers restart from checkpoint 4 and run steps 5-7 again.
    monkeypatch.setenv(FAULT_ENV, f"step:8:1:{tmp_path / 'fired'}")
    assert make_config(method="dpo").training.data == "builtin:sample-preferences"  # dpo's data when none is set
    # The first 5 built-in pairs, one held out: a block each, every step trains on the 4 others (the margin must grow).
    built_in = resources.files("raytrain_eks.resources").joinpath("sample_preferences.jsonl").read_text()
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(line + "\n" for line in built_in.splitlines()[:5]))
    cfg = make_config(**DPO_RUN, data=str(data), output_dir=str(tmp_path / "run"))
    assert cfg.training.data_format == "preference" and cfg.training.adapters is not None
    result = run_training(cfg, runs_root=tmp_path, say=quiet)
    summary, records = result.summary, history(result.run_dir)
    assert (tmp_path / "fired").exists() and summary["steps"] == 10 and summary["method"] == "dpo"
    resumed = summary["resumed_from_step"]
    assert resumed == 4, summary
    first = {r["step"]: r for r in records if r["resumed_from_step"] is None}
    again = {r["step"]: r for r in records if r["resumed_from_step"] == resumed}
    # Steps 5-7, which both attempts ran: the resumed one computes what the first did (loss and metrics).
    assert sorted(first) == list(range(1, 8)) and sorted(again) == list(range(5, 11)), records
    for step in (5, 6, 7):
        assert again[step]["loss"] == first[step]["loss"], step
        assert again[step]["dpo"] == first[step]["dpo"], step
    # The reference is the model with its adapters off: at step 1 the adapters are 0, so every reward is 0.
    assert first[1]["dpo"]["rewards/margins"] == 0.0 and set(first[1]["dpo"]) == set(METRICS)
    last = again[10]["dpo"]
    assert last["rewards/margins"] > first[1]["dpo"]["rewards/margins"] + 0.05, records
    assert summary["dpo"] == last
    # The merged export is a plain model folder.
    from transformers import AutoModelForCausalLM

    assert not (result.run_dir / "model" / "adapter_config.json").exists()
    AutoModelForCausalLM.from_pretrained(result.run_dir / "model")
    page = (result.run_dir / "report.html").read_text()
    assert f"{last['rewards/margins']:.3f}" in page and f"{100 * last['rewards/accuracies']:.0f}%" in page
