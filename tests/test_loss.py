"""The chunked loss: the value and gradients of plain cross-entropy over the full logits, without holding them;
and the training loop gives the same losses whether the loss is split into many chunks or computed in one."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from raytrain_eks.config import BUILTIN_MODEL, RANDOM_DATA, TrainingConfig
from raytrain_eks.train import loop
from raytrain_eks.train.model import chunked_cross_entropy
from raytrain_eks.train.precision import resolve_precision
from raytrain_eks.train.torchrun_entry import run

IGNORE = -100


def _inputs(seed: int, batch: int = 3, seq: int = 17, hidden: int = 24, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64).float().requires_grad_()
    w = (0.2 * torch.randn(vocab, hidden, generator=gen)).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, :5] = IGNORE  # a masked prompt
    labels[2, -3:] = IGNORE  # masked padding
    return h, w, labels


def _loss_and_grads(fn, h, w, labels):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _plain(h, w, labels):
    logits = (h @ w.t()).float()
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


@pytest.mark.parametrize("max_logits", [50, 50 * 7, 50 * 16, 50 * 51, 10**9])  # 1, 7, 16 (uneven), 51 rows, all
def test_chunked_loss_equals_the_plain_loss(max_logits):
    h, w, labels = _inputs(seed=max_logits)
    plain = _loss_and_grads(_plain, h, w, labels)
    chunked = _loss_and_grads(
        lambda a, b, y: chunked_cross_entropy(a, b, y, max_logits=max_logits, ignore_index=IGNORE), h, w, labels
    )
    assert plain[0].item() > 1.0  # a real loss, not a vacuous zero
    for p, c in zip(plain, chunked, strict=True):
        torch.testing.assert_close(c, p, rtol=1e-6, atol=1e-6)
    # Masked tokens contribute no gradient to their hidden states.
    assert torch.count_nonzero(chunked[1][0, :5]) == 0 and torch.count_nonzero(chunked[1][0, 5:]) > 0


def test_a_frozen_output_projection_gets_no_gradient_and_the_hidden_states_theirs(monkeypatch):
    # LoRA's base: the projection is frozen, so the chunked loss makes no gradient for it (nor its fp32 sum); the
    # hidden states still get the plain loss's gradient.
    import raytrain_eks.train.model as model_module

    h, w, labels = _inputs(seed=3)
    made: list[tuple[int, ...]] = []
    zeros = torch.zeros

    def counted_zeros(*shape, **kw):
        made.append(tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape)
        return zeros(*shape, **kw)

    monkeypatch.setattr(model_module.torch, "zeros", counted_zeros)
    hidden = h.detach().clone().requires_grad_()
    frozen = w.detach().clone()  # requires no gradient
    chunked_cross_entropy(hidden, frozen, labels, max_logits=50 * 7, ignore_index=IGNORE).backward()
    monkeypatch.undo()
    assert frozen.grad is None and tuple(w.shape) not in made, "no fp32 sum for a frozen projection's gradient"
    plain_h, _ = torch.autograd.grad(_plain(h, w, labels), (h, w))
    torch.testing.assert_close(hidden.grad, plain_h, rtol=1e-6, atol=1e-6)


def test_a_bf16_output_projection_gets_the_gradient_of_one_projection_however_the_tokens_are_cut():
    # Left to autograd, a bf16 weight's gradient is rounded to bf16 after each chunk; the chunked loss sums it in
    # fp32 and rounds once, as the plain loss over all tokens does.
    h, w, labels = _inputs(seed=5, batch=4, seq=64, hidden=32, vocab=300)
    h, w = h.to(torch.bfloat16), w.to(torch.bfloat16)
    plain = _loss_and_grads(_plain, h, w, labels)
    chunked = _loss_and_grads(
        lambda a, b, y: chunked_cross_entropy(a, b, y, max_logits=300 * 3, ignore_index=IGNORE), h, w, labels
    )  # 86 chunks of 3 tokens
    assert chunked[2].dtype == torch.bfloat16
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(chunked[1], plain[1], rtol=0, atol=0)
    ulp = plain[2].abs().float() * 2**-7 + 1e-30  # one bf16 step of each element
    assert ((chunked[2].float() - plain[2].float()).abs() <= ulp).all()


def test_all_masked_chunk_counts_zero():
    h, w, labels = _inputs(seed=1)
    labels[:] = IGNORE
    loss, h_grad, w_grad = _loss_and_grads(
        lambda a, b, y: chunked_cross_entropy(a, b, y, max_logits=50 * 4, ignore_index=IGNORE), h, w, labels
    )
    assert loss.item() == 0.0 and torch.count_nonzero(h_grad) == 0 and torch.count_nonzero(w_grad) == 0


def test_loop_losses_are_the_same_by_the_plain_loss_and_by_many_chunks(
    tmp_path, monkeypatch, one_process_group, builtin_model, capsys
):
    cfg = TrainingConfig(
        model_id=BUILTIN_MODEL,
        data=RANDOM_DATA,
        steps=3,
        seq_len=32,
        batch_size=4,
        learning_rate=1e-2,
        log_every=1,
        checkpoint_every=0,
        precision="auto",
    )
    one_chunk = run(cfg, tmp_path / "one")  # loss_kernel auto: plain on a CPU, the full logits being small
    monkeypatch.setattr(loop, "LOSS_CHUNK_LOGITS", 5 * 1024)  # a few tokens per chunk: ~25 chunks per micro-batch
    many = run(cfg.model_copy(update={"loss_kernel": "chunked"}), tmp_path / "many")
    assert (one_chunk["loss_kernel"], many["loss_kernel"]) == ("plain", "chunked")
    assert one_chunk["loss_kernel_reason"].startswith("auto: the full logits fit the memory estimate; not fused: ")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    chunked = [json.loads(line)["loss"] for line in (tmp_path / "many" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and abs(losses[2] - losses[0]) > 1e-3  # training moved the loss: not vacuous
    # auto was resolved once, by the worker that knows its device, and the summary says what it became.
    expected = resolve_precision("auto", torch.device("cpu"))[0]
    # In bf16 the plain loss's projection gradient is autograd's bf16 product and the chunked loss's an fp32 sum of
    # the chunks' (as one GPU product): they part by bf16 rounding, a few 1e-4 of the loss after two steps.
    assert chunked == pytest.approx(losses, rel=1e-5 if expected == "fp32" else 5e-4)
    assert one_chunk["precision"] == many["precision"] == expected
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["precision"] == expected
    out = capsys.readouterr().out
    assert f"precision: {expected} (auto:" in out
    assert "loss: plain (auto: the full logits fit" in out and "loss: chunked (as configured)" in out
