"""The DPO loss (train/dpo.py): its value, its gradients and its metrics equal those of TRL's own ``DPOTrainer``
(trl 1.16.0, a test dependency) on the same pairs and the same tiny random model, for the sigmoid and ipo losses,
full fine-tune (a separate frozen reference) and LoRA (the reference is the base with the adapters off); and the
summed response log-probabilities score only the response tokens."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from raytrain_eks.errors import ConfigError
from raytrain_eks.train.data.encoding import IGNORE_INDEX
from raytrain_eks.train.dpo import PairLogps, adapters_off, dpo_loss, response_logps

# TRL's trainer built four times on tiny models: the models tier.
pytestmark = pytest.mark.usefixtures("builds_models")

VOCAB, PAD = 1024, 0


def _tiny_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config).float()


def _pairs(pairs: int = 3, seed: int = 0):
    """Right-padded ``[chosen..., rejected...]`` rows as TRL's collator lays them out: a shared prompt per pair, then
    responses of different lengths; ``completion_mask`` 1 on response tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=gen) for n in torch.randint(3, 7, (pairs,), generator=gen)]
    for side in range(2):
        for prompt in prompts:
            response = torch.randint(1, VOCAB, (int(torch.randint(2, 9, (1,), generator=gen)) + side,), generator=gen)
            rows.append(torch.cat([prompt, response]))
            masks.append(torch.cat([torch.zeros(len(prompt)), torch.ones(len(response))]).long())
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), PAD)
    attention, completion = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        input_ids[i, : len(row)], attention[i, : len(row)], completion[i, : len(row)] = row, 1, mask
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


def _trl_trainer(model, ref_model, tokenizer, tmp_path, loss_type: str, peft_config=None):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp_path),
        beta=0.1,
        loss_type=[loss_type],
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=2,
        # TRL's default, gradient_checkpointing=True, is transformers 5's deprecated name (a FutureWarning); the
        # checkpointing does not change the values compared here.
        activation_checkpointing=False,
    )
    data = Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    return DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def _ours(model, reference, inputs, loss_type: str):
    """Our loss on the same rows: labels are the input ids with everything but the response masked."""
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX)
    kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    logps, tokens = response_logps(model(**kwargs).logits, labels)
    with torch.no_grad(), reference() as ref:
        ref_logps, _ = response_logps(ref(**kwargs).logits, labels)
    chosen, rejected = logps.chunk(2)
    n_chosen, n_rejected = tokens.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    return dpo_loss(
        PairLogps(chosen, rejected, n_chosen, n_rejected), ref_chosen, ref_rejected, beta=0.1, loss_type=loss_type
    )


@contextlib.contextmanager
def _adapters_off(model):
    """The same PEFT model with its adapters off (:func:`adapters_off`), yielded as the reference."""
    with adapters_off(model):
        yield model


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_gradients_and_metrics_equal_trls_dpo_trainer(loss_type, lora, tokenizer, tmp_path):
    adapters = None
    if lora:
        from peft import LoraConfig

        # Adapters that start non-zero, so the policy differs from the reference and the log-ratios are not 0.
        adapters = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    # TRL adds the adapters itself (a new adapter: its reference is the base with the adapters off, as ours).
    reference = None if lora else _tiny_model(seed=2)
    trainer = _trl_trainer(_tiny_model(seed=1), reference, tokenizer, tmp_path, loss_type, adapters)
    # A model of our own with the same weights: TRL re-binds its model's forward (to return log-probs), so a deep
    # copy of it would still run TRL's forward on TRL's parameters.
    ours_policy = _tiny_model(seed=3)
    if lora:
        from peft import get_peft_model

        ours_policy = get_peft_model(ours_policy, adapters)
    ours_policy.load_state_dict(trainer.model.state_dict())
    frozen = copy.deepcopy(reference)
    ours_reference = (lambda: _adapters_off(ours_policy)) if lora else (lambda: contextlib.nullcontext(frozen))
    inputs = _pairs()

    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, {k: v.clone() for k, v in inputs.items()})
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    ours_policy.train()
    loss, metrics = _ours(ours_policy, ours_reference, inputs, loss_type)
    loss.backward()

    # The policy differs from its reference (else every log-ratio is 0 and the comparison says little).
    assert abs(metrics["rewards/chosen"].item()) > 1e-4 and abs(metrics["rewards/rejected"].item()) > 1e-4
    torch.testing.assert_close(loss, trl_loss.detach(), rtol=1e-5, atol=1e-6)
    for name, value in metrics.items():
        assert value.item() == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
    ours, theirs = _grads(ours_policy), _grads(trainer.model)
    assert ours.keys() == theirs.keys() and len(ours) > 0
    assert all(("lora_" in name) == lora for name in ours)  # LoRA trains only the adapters
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_only_response_tokens_are_scored():
    logits = torch.randn(1, 5, 7)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX]])
    logps, tokens = response_logps(logits, labels)
    by_hand = torch.log_softmax(logits, -1)[0, 1, 3] + torch.log_softmax(logits, -1)[0, 2, 4]
    torch.testing.assert_close(logps[0], by_hand)
    assert tokens.tolist() == [2]


def test_a_pair_the_policy_prefers_more_than_the_reference_lowers_the_loss():
    ref = torch.zeros(1)
    ahead = PairLogps(torch.tensor([-1.0]), torch.tensor([-5.0]), torch.tensor([2]), torch.tensor([2]))
    behind = PairLogps(torch.tensor([-5.0]), torch.tensor([-1.0]), torch.tensor([2]), torch.tensor([2]))
    for loss_type in ("sigmoid", "ipo"):
        ahead_loss, ahead_metrics = dpo_loss(ahead, ref, ref, loss_type=loss_type)
        behind_loss, _ = dpo_loss(behind, ref, ref, loss_type=loss_type)
        assert ahead_loss < behind_loss, loss_type
        assert ahead_metrics["rewards/margins"].item() == pytest.approx(0.4)
        assert ahead_metrics["rewards/accuracies"].item() == 1.0


def test_an_unknown_loss_type_and_a_bad_beta_are_both_named():
    pairs = PairLogps(torch.zeros(1), torch.zeros(1), torch.ones(1), torch.ones(1))
    with pytest.raises(ConfigError) as err:
        dpo_loss(pairs, torch.zeros(1), torch.zeros(1), beta=0.0, loss_type="hinge")
    assert "loss_type 'hinge'" in str(err.value) and "sigmoid, ipo" in str(err.value)
    assert "beta 0.0" in str(err.value)


def test_the_reference_of_a_lora_run_is_the_base_model_with_no_second_copy():
    """The loop's adapters (apply_lora: injected, no PeftModel): off inside adapters_off, the model is the base;
    after it, the adapters act and train again."""
    from raytrain_eks.config import LoraSettings
    from raytrain_eks.train.lora import apply_lora

    base = _tiny_model(seed=4).eval()
    adapted = copy.deepcopy(base)
    apply_lora(adapted, LoraSettings(rank=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_()  # adapters that change the output (lora_B starts at 0)
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        want = base(input_ids=ids).logits
        with adapters_off(adapted):
            reference = adapted(input_ids=ids).logits
        policy = adapted(input_ids=ids).logits
    torch.testing.assert_close(reference, want)
    assert (policy - want).abs().max() > 1e-3
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    with pytest.raises(ValueError, match="no LoRA adapters"), adapters_off(base):
        pass
