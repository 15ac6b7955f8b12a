"""Direct preference optimisation (``training.method: dpo``): the loss on pairs of responses to one prompt.

A pair is a chosen and a rejected response, each scored by the summed log-probability of its response tokens (the
labels that are not :data:`~raytrain_eks.train.data.encoding.IGNORE_INDEX`; the prompt is masked) under the policy
being trained and under the reference (the start weights). Their difference is the implicit reward,
``beta * (log pi(y|x) - log ref(y|x))``, and the loss pushes the chosen response's reward above the rejected one's:

- ``sigmoid`` (Rafailov et al., 2023): ``-log sigmoid(beta * (chosen_ratio - rejected_ratio))``;
- ``ipo`` (Azar et al., 2023, eq. 17): ``(chosen_ratio / n_chosen - rejected_ratio / n_rejected - 1 / (2 beta))^2``,
  each log-ratio averaged over its response tokens, as TRL 1.16's ``DPOTrainer`` does (its authors' form).

The metrics are TRL's names and meanings (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``), so a run reads like a TRL run of the same pairs.
Example::

    chosen, n_chosen = response_logps(model(chosen_ids).logits, chosen_labels)
    rejected, n_rejected = response_logps(model(rejected_ids).logits, rejected_labels)
    policy = PairLogps(chosen, rejected, n_chosen, n_rejected)
    loss, metrics = dpo_loss(policy, ref_chosen, ref_rejected, beta=0.1, loss_type="sigmoid")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from raytrain_eks.errors import ConfigError
from raytrain_eks.train.data.encoding import IGNORE_INDEX

SIGMOID, IPO = "sigmoid", "ipo"
LOSS_TYPES = (SIGMOID, IPO)
DEFAULT_BETA = 0.1


@dataclass(frozen=True)
class PairLogps:
    """Per pair, the summed response log-probabilities of the chosen and rejected responses and their token counts
    (each a tensor of shape ``(pairs,)``)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def _token_logps(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's log-probability of the next token's label (0 where it is masked) and whether it is scored;
    both ``[B, T - 1]``. In float32 whatever the logits' dtype: a bf16 sum over a long response loses the small
    difference DPO is made of."""
    logits, targets = logits[:, :-1, :], labels[:, 1:]
    token_loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=ignore_index, reduction="none"
    )
    return -token_loss.view(targets.shape), targets != ignore_index


def response_logps(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its labelled tokens, and how many there are.

    ``labels`` are aligned with the input ids (Hugging Face's convention): position ``t``'s logits score token
    ``t + 1``. ``response_logps(logits[B, T, V], labels[B, T]) -> (logps[B], tokens[B])``.
    """
    token_logps, scored = _token_logps(logits, labels, ignore_index)
    return token_logps.sum(dim=-1), scored.sum(dim=-1)


def packed_pair_logps(
    logits: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> PairLogps:
    """:class:`PairLogps` of blocks packed by :func:`~raytrain_eks.train.data.packing.pack_pairs`: each document
    starts where ``position_ids`` is 0, and a block's documents pair up in order (chosen, rejected, chosen, ...).
    The padding after a block's last document goes on counting, and is masked, so it adds nothing."""
    token_logps, scored = _token_logps(logits, labels, ignore_index)
    starts = position_ids == 0
    per_block = starts.sum(dim=-1)
    if bool((per_block % 2).any()):
        raise ValueError("a packed block holds a document without its pair: pack preference data with pack_pairs")
    first = per_block.cumsum(0) - per_block  # the index of each block's first document among all of them
    document = (starts.long().cumsum(dim=-1) - 1 + first[:, None])[:, 1:].reshape(-1)
    total = int(per_block.sum())
    sums = token_logps.new_zeros(total).index_add(0, document, token_logps.reshape(-1))
    counts = torch.zeros(total, dtype=torch.long, device=labels.device).index_add(
        0, document, scored.reshape(-1).long()
    )
    return PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


@contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """Inside, ``model`` runs with its LoRA adapters off: the base weights alone, DPO's reference when training
    adapters, with no second copy of the model. Works on a model adapted by
    :func:`~raytrain_eks.train.lora.apply_lora` (peft's ``inject_adapter_in_model``, no ``PeftModel`` around it and so
    no ``disable_adapter()``) by turning each of peft's tuner layers off (``enable_adapters``, as ``PeftModel`` does)
    and back on after, which also makes the adapters trainable again. Use it under ``torch.no_grad()``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError("the model has no LoRA adapters to turn off for the reference")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def check_loss_type(loss_type: str, beta: float) -> None:
    """:class:`ConfigError` for a loss type this module does not compute, or a ``beta`` that is not positive."""
    problems = []
    if loss_type not in LOSS_TYPES:
        problems.append(f"training.dpo.loss_type {loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    if not beta > 0:
        problems.append(f"training.dpo.beta {beta!r}: must be above 0 (the usual value is {DEFAULT_BETA})")
    if problems:
        raise ConfigError(problems)


def dpo_loss(
    policy: PairLogps,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float = DEFAULT_BETA,
    loss_type: str = SIGMOID,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean loss over the pairs and TRL's metrics (detached means over the pairs).

    ``reference_*`` carry no gradient (the reference is frozen); only ``policy`` does."""
    check_loss_type(loss_type, beta)
    chosen_ratio = policy.chosen - reference_chosen.detach()
    rejected_ratio = policy.rejected - reference_rejected.detach()
    if loss_type == SIGMOID:
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    else:
        # Averaged per response token, so beta means the same for short and long responses.
        chosen_mean = chosen_ratio / policy.chosen_tokens.clamp(min=1)
        rejected_mean = rejected_ratio / policy.rejected_tokens.clamp(min=1)
        losses = (chosen_mean - rejected_mean - 1 / (2 * beta)) ** 2
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": policy.chosen.detach().mean(),
        "logps/rejected": policy.rejected.detach().mean(),
    }
    return losses.mean(), metrics
