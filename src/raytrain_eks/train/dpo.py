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

In the training loop a step's micro-batches are blocks packed by :func:`~.data.packing.pack_table`
and :class:`Reference` computes each one's loss: the reference's pass under ``no_grad`` (the same model with its
adapters off, or a frozen copy of the start weights), then the policy's, summed over the pairs (:func:`dpo_sums`)
so that the step divides by the pairs of every rank and micro-batch, as the supervised loss divides by tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from raytrain_eks.errors import ConfigError
from raytrain_eks.train.data.encoding import IGNORE_INDEX

if TYPE_CHECKING:
    from raytrain_eks.train.model import OutputHead

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


def pair_documents(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Where each scored position's log-probability goes in blocks packed by
    :func:`~.data.packing.pack_table`: the index of its document among all the batch's documents
    (``[B * (T - 1)]``, in the order of the labels it scores) and how many documents there are. Each document starts
    where ``position_ids`` is 0, and a block's documents pair up in order (chosen, rejected, chosen, ...); the
    padding after a block's last document goes on counting (it is masked, so it adds nothing). Computed from host
    positions in the loop, so that a step never waits for the device to learn the batch's shape."""
    starts = position_ids == 0
    per_block = starts.sum(dim=-1)
    if bool((per_block % 2).any()):
        raise ValueError("a packed block holds a document without its pair: pack pairs joined, with their split")
    first = per_block.cumsum(0) - per_block  # the index of each block's first document among all of them
    document = (starts.long().cumsum(dim=-1) - 1 + first[:, None])[:, 1:].reshape(-1)
    return document, int(per_block.sum())


def packed_pair_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    documents: tuple[torch.Tensor, int] | None = None,
) -> PairLogps:
    """:class:`PairLogps` of blocks packed by :func:`~.data.packing.pack_table` (the pairs as
    :func:`pair_documents` finds them; ``documents``: its answer, already computed)."""
    token_logps, scored = _token_logps(logits, labels, ignore_index)
    document, total = documents if documents is not None else pair_documents(position_ids)
    document = _on(document, token_logps.device)
    sums = token_logps.new_zeros(total).index_add(0, document, token_logps.reshape(-1))
    counts = torch.zeros(total, dtype=torch.long, device=labels.device).index_add(
        0, document, scored.reshape(-1).long()
    )
    return PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


def _on(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU from pinned memory, a copy that does not wait for the queued work."""
    if host.device == device:
        return host
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


@contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """Inside, ``model`` runs with its LoRA adapters off: the base weights alone, DPO's reference when training
    adapters, with no second copy of the model. Works on a model adapted by
    :func:`~raytrain_eks.train.lora.apply_lora` (peft's ``inject_adapter_in_model``, no ``PeftModel`` around it and so
    no ``disable_adapter()``) by turning each of peft's tuner layers off (``enable_adapters``, as ``PeftModel`` does)
    and back on after. Which parameters train never changes, even inside: peft's ``enable_adapters(False)`` also
    freezes the adapters, and FSDP2 sets a gradient's dtype at its first forward from the parameters that train then
    (``FSDPParamGroup._init_mp_dtypes``, torch 2.13): a first forward with the adapters frozen left their bf16
    gradients unconverted for the fp32 parameters. Use it under ``torch.no_grad()``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers: list[Any] = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError("the model has no LoRA adapters to turn off for the reference")
    trains = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    for param, flag in trains:
        param.requires_grad_(flag)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in trains:
            param.requires_grad_(flag)


def check_loss_type(loss_type: str, beta: float) -> None:
    """:class:`ConfigError` for a loss type this module does not compute, or a ``beta`` that is not positive."""
    problems = []
    if loss_type not in LOSS_TYPES:
        problems.append(f"training.dpo.loss_type {loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
    if not beta > 0:
        problems.append(f"training.dpo.beta {beta!r}: must be above 0 (the usual value is {DEFAULT_BETA})")
    if problems:
        raise ConfigError(problems)


METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def _pair_terms(
    policy: PairLogps, reference_chosen: torch.Tensor, reference_rejected: torch.Tensor, beta: float, loss_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss, and each pair's :data:`METRICS` (detached, ``[pairs, len(METRICS)]``)."""
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
    metrics = torch.stack(
        [
            chosen_rewards,
            rejected_rewards,
            chosen_rewards - rejected_rewards,
            (chosen_rewards > rejected_rewards).float(),
            policy.chosen.detach(),
            policy.rejected.detach(),
        ],
        dim=-1,
    )
    return losses, metrics


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
    losses, metrics = _pair_terms(policy, reference_chosen, reference_rejected, beta, loss_type)
    return losses.mean(), dict(zip(METRICS, metrics.mean(dim=0), strict=True))


def dpo_sums(
    policy: PairLogps,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float = DEFAULT_BETA,
    loss_type: str = SIGMOID,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dpo_loss` summed over the pairs instead of averaged: the loss, and the :data:`METRICS` as one tensor.
    A training step adds these up over its micro-batches and ranks and divides by all their pairs, so any world size
    and accumulation give one process's mean over the whole batch (a micro-batch of no pair adds 0, not NaN)."""
    losses, metrics = _pair_terms(policy, reference_chosen, reference_rejected, beta, loss_type)
    return losses.sum(), metrics.sum(dim=0)


def metrics_of(sums: torch.Tensor, pairs: float) -> dict[str, float]:
    """The :data:`METRICS` by name, from their sums over ``pairs`` pairs (host numbers, for a step's record)."""
    return {name: float(value) / max(1.0, pairs) for name, value in zip(METRICS, sums.tolist(), strict=True)}


def pairs_in(batch: dict[str, torch.Tensor]) -> int:
    """The pairs of a batch packed by :func:`~.data.packing.pack_table`, counted from its host
    ``position_ids`` (two documents a pair)."""
    return int((batch["position_ids"] == 0).sum()) // 2


@dataclass
class Reference:
    """DPO's reference policy, whose summed log-probabilities the loss compares the policy's with.

    ``adapters`` True: ``model`` is the policy itself and the reference is its base, its LoRA adapters off
    (:func:`adapters_off`: no second copy). False: ``model`` is a frozen copy of the start weights, sharded like
    the policy, in no optimizer and no checkpoint (a resumed run builds it again from the model's files)."""

    model: Any
    head: OutputHead
    adapters: bool
    beta: float = DEFAULT_BETA
    loss_type: str = SIGMOID

    def describe(self) -> str:
        """One line for the run: ``dpo: sigmoid loss, beta 0.1; reference: the model with its adapters off``."""
        what = "the model with its adapters off" if self.adapters else "a frozen copy of the start weights"
        return f"dpo: {self.loss_type} loss, beta {self.beta:g}; reference: {what}"

    def logps(
        self, inputs: dict[str, Any], labels: torch.Tensor, positions: torch.Tensor, documents: tuple[torch.Tensor, int]
    ) -> PairLogps:
        """The reference's :class:`PairLogps` of a packed batch (``documents``: :func:`pair_documents` of its
        ``positions``), without a gradient."""
        with torch.no_grad(), adapters_off(self.model) if self.adapters else nullcontext():
            hidden = self.head.forward(self.model, **inputs).logits
            logits = project(hidden.reshape(*labels.shape, -1), self.head)
            logps = packed_pair_logps(logits, labels, positions, documents=documents)
        if not self.adapters and hasattr(self.model, "reshard"):
            # FSDP keeps the root gathered after forward for the loss; the copy has no backward to free it after.
            self.model.reshard()
        return logps

    def loss(
        self, model: Any, head: OutputHead, inputs: dict[str, Any], labels: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One packed micro-batch: the reference's pass under ``no_grad``, then the policy's ``model`` forward;
        the summed loss of its pairs (for backward), the policy's outputs and the summed :data:`METRICS`.
        ``positions``: the batch's host ``position_ids`` (its pairs found without asking the device)."""
        document, total = pair_documents(positions)
        documents = (_on(document, labels.device), total)  # moved once for both passes
        reference = self.logps(inputs, labels, positions, documents)
        outputs = head.forward(model, **inputs)
        logits = project(outputs.logits.reshape(*labels.shape, -1), head)
        policy = packed_pair_logps(logits, labels, positions, documents=documents)
        loss, metrics = dpo_sums(policy, reference.chosen, reference.rejected, beta=self.beta, loss_type=self.loss_type)
        return loss, outputs, metrics


def project(hidden: torch.Tensor, head: OutputHead) -> torch.Tensor:
    """The full logits from the final hidden states of a model whose projection the loss applies
    (:func:`~raytrain_eks.train.model.output_projection_deferred`), with the model's own logit transform. DPO sums
    log-probabilities per response, so it takes the whole logits (``[B, T, V]``) rather than the chunked loss."""
    logits = torch.nn.functional.linear(hidden, head())  # after the forward: the gathered form of a sharded weight
    return head.transform(logits) if head.transform is not None else logits
