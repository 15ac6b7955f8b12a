"""Held-out loss and greedy samples, computed by every rank together (the model is sharded across them).

Evaluation walks this rank's share of the held-out blocks (kept in memory after the first pass: it is small),
sums the token losses and token counts, and reduces both across ranks, so the answer is the loss over every
held-out token whatever the world size. Ranks with fewer batches than the others run fully masked batches, so
every rank takes part in the same number of forward passes (each one gathers the sharded parameters). Example::

    held_out = HeldOut(batches, seq_len=cfg.seq_len, batch_size=cfg.batch_size, max_logits=2**26)
    held_out.evaluate(model, output_weight, device)   # {"eval_loss": 2.1, "eval_ppl": 8.2, "eval_tokens": 5120}
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from raytrain_eks.train.data.encoding import IGNORE_INDEX
from raytrain_eks.train.model import OutputHead, chunked_cross_entropy, forward_inputs

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

Batch = dict[str, torch.Tensor]


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType | None = None) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


class HeldOut:
    """This rank's held-out batches and the loss of a model over all ranks' held-out tokens."""

    def __init__(self, batches: Iterable[Batch], *, seq_len: int, batch_size: int, max_logits: int) -> None:
        self._source = batches
        self._cached: list[Batch] | None = None
        self._shape = (batch_size, seq_len)
        self._max_logits = max_logits

    def _batches(self) -> list[Batch]:
        if self._cached is None:
            self._cached = list(self._source)
        return self._cached

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, output_weight: OutputHead, device: torch.device) -> dict[str, float]:
        mine = self._batches()
        count = _all_reduce(torch.tensor([len(mine)], device=device), dist.ReduceOp.MAX)
        masked = {
            "input_ids": torch.zeros(self._shape, dtype=torch.long),
            "labels": torch.full(self._shape, IGNORE_INDEX, dtype=torch.long),
        }
        config: PretrainedConfig = model.config
        attention = str(config._attn_implementation)  # flash-attention: a packed batch goes in as one row
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(int(count)):
            batch = mine[i] if i < len(mine) else masked
            given = forward_inputs(batch, attention=attention)
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in given.items()}
            labels = batch["labels"].to(device)
            hidden = output_weight.forward(model, **inputs).logits.reshape(*labels.shape, -1)
            loss_sum += chunked_cross_entropy(
                hidden[:, :-1],
                output_weight(),
                labels[:, 1:],
                max_logits=self._max_logits,
                ignore_index=IGNORE_INDEX,
                transform=output_weight.transform,
            ).double()
            tokens += (labels[:, 1:] != IGNORE_INDEX).sum()
        model.train(was_training)
        totals = _all_reduce(torch.stack([loss_sum, tokens]))
        n = float(totals[1])
        if not n:
            return {}
        loss = float(totals[0]) / n
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": int(n)}


@torch.no_grad()
def greedy_samples(
    model: torch.nn.Module,
    output_weight: OutputHead,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int,
    device: torch.device,
) -> list[dict[str, object]]:
    """Greedy continuations of ``prompts`` (already rendered as the model was trained to read them).

    All prompts go through the model together: padded on the left to one length, the padding masked out and each
    prompt's positions counted from its own first token, so every answer is the one the prompt gets alone. Every
    rank runs the same forward passes (the parameters are sharded), one per new token until every prompt has met
    its end-of-sequence token; no KV cache, so keep ``max_new_tokens`` short. Returns
    ``[{"prompt", "completion", "tokens"}]``.
    """
    if not prompts:
        return []
    eos = tokenizer.eos_token_id
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] or [eos or 0] for p in prompts]
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    x = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], dtype=torch.long, device=device)
    new: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = output_weight.forward(model, input_ids=x, attention_mask=mask, position_ids=positions).logits
        weight = output_weight()  # after the forward: the gathered form of a sharded parameter
        logits = torch.nn.functional.linear(hidden[:, -1].to(weight.dtype), weight)
        transform = output_weight.transform
        tokens = (transform(logits.float()) if transform is not None else logits).argmax(-1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(tokens, src=0)  # rank 0's tokens for all: every rank stops at the same forward
        for i, token in enumerate(tokens.tolist()):
            if not finished[i]:
                new[i].append(token)
                finished[i] = token == eos
        if all(finished):
            break
        x = torch.cat([x, tokens[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    model.train(was_training)
    return [
        {"prompt": prompt, "completion": tokenizer.decode(ids, skip_special_tokens=True), "tokens": len(ids)}
        for prompt, ids in zip(prompts, new, strict=True)
    ]
