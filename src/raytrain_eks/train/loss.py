"""The loss kernel (``training.loss_kernel``): how the final hidden states are projected and scored.

``plain`` projects every token at once and scores the full logits; ``chunked`` projects a chunk of tokens at a time
and recomputes it in backward (:func:`~raytrain_eks.train.model.chunked_cross_entropy`); ``fused`` hands both to a
fused linear + cross-entropy kernel of Liger-Kernel or cut-cross-entropy, on CUDA only. Every kernel computes the
model's own loss: its logit transform (:func:`~raytrain_eks.train.model.logit_transform`) applied, and a mixture of
experts' router term added by the loop outside it. Example::

    kernel, why = choose_loss_kernel("auto", device_type="cpu", capability=None, transform=None, logits_fit=True,
                                     library=None)          # ("plain", "auto: the full logits fit ...")
    loss = projected_loss(kernel, hidden, head(), labels, transform=head.transform)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from raytrain_eks.errors import UserError
from raytrain_eks.train.memory import LOSS_CHUNK_LOGITS
from raytrain_eks.train.model import LogitTransform, chunked_cross_entropy

# training.loss_kernel: how the loss projects the final hidden states and scores them.
PLAIN, CHUNKED, FUSED = "plain", "chunked", "fused"
# The fused linear + cross-entropy libraries, by the module each installs, tried in this order; neither is a
# dependency of the project (both need Triton on a CUDA GPU): ``pip install raytrain-eks[gpu]``.
FUSED_LIBRARIES = {"liger_kernel": "Liger-Kernel", "cut_cross_entropy": "cut-cross-entropy"}
# Triton, which both libraries' kernels are written in, supports NVIDIA GPUs of compute capability 8.0 and later
# (Triton's README, "Supported Hardware"): an A10G (8.6), L4 (8.9), H100 and H200 (9.0); not a T4 (7.5).
FUSED_MIN_CAPABILITY = (8, 0)


def fused_library() -> str | None:
    """The module of the first fused linear + cross-entropy library installed here (:data:`FUSED_LIBRARIES`), or
    ``None``. Found without importing it: both import Triton, which a machine without CUDA may lack."""
    from importlib.util import find_spec

    return next((module for module in FUSED_LIBRARIES if find_spec(module) is not None), None)


def fused_refusal(transform: LogitTransform | None) -> str | None:
    """Why a fused kernel cannot compute this model's own loss, or ``None`` when it can. Both libraries take a final
    soft-capping (their ``softcap`` argument: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, cut-cross-entropy's
    ``linear_cross_entropy``) and neither a scale of the logits (Granite, Cohere, Falcon-H1)."""
    if transform is not None and transform.scale != 1.0:
        return f"the model scales its logits (x{transform.scale:g}), which no fused library applies"
    return None


def _fused_missing(
    device_type: str, capability: tuple[int, int] | None, library: str | None, transform: LogitTransform | None
) -> str | None:
    """The first thing the fused kernel lacks to run here (:func:`choose_loss_kernel`), or ``None``."""
    if device_type != "cuda":
        return f"the device is {'a CPU' if device_type == 'cpu' else device_type}, and the fused kernels need CUDA"
    if capability is not None and capability < FUSED_MIN_CAPABILITY:
        return f"the GPU's compute capability {capability[0]}.{capability[1]} is below Triton's 8.0"
    if library is None:
        return "neither Liger-Kernel nor cut-cross-entropy is installed (pip install raytrain-eks[gpu])"
    return fused_refusal(transform)


def choose_loss_kernel(
    requested: str,
    *,
    device_type: str,
    capability: tuple[int, int] | None,
    transform: LogitTransform | None,
    logits_fit: bool,
    library: str | None,
) -> tuple[str, str]:
    """The loss kernel a worker runs (``training.loss_kernel``), and why.

    ``plain`` projects every token at once and scores the full logits; ``chunked`` projects a chunk of tokens at a
    time (:func:`chunked_cross_entropy`); ``fused`` is a fused linear + cross-entropy from ``library`` (a module of
    :data:`FUSED_LIBRARIES`; :func:`fused_library`) on a CUDA device of ``capability`` (``None``: not known).
    ``auto`` is fused where it can run and compute the model's own loss (its logit ``transform``), else plain when
    ``logits_fit`` (the full logits fit the memory estimate), chunked only when they do not. ``fused`` where it
    cannot run is refused (:class:`UserError`). Example: ``choose_loss_kernel("auto", device_type="cpu",
    capability=None, transform=None, logits_fit=True, library=None)`` is ``("plain", "auto: the full logits fit
    ...")``.
    """
    if requested in (PLAIN, CHUNKED):
        return requested, "as configured"
    missing = _fused_missing(device_type, capability, library, transform)
    if requested == FUSED:
        if missing:
            raise UserError(
                f"training.loss_kernel fused cannot run here: {missing}",
                hint="Use loss_kernel auto (fused where it can run, else plain or chunked by the memory estimate), "
                "plain or chunked; for fused, train on CUDA GPUs (compute capability 8.0 or later) whose image has "
                "Liger-Kernel or cut-cross-entropy (pip install raytrain-eks[gpu]).",
            )
        return FUSED, f"as configured: {FUSED_LIBRARIES[str(library)]}'s fused linear + cross-entropy"
    if requested != "auto":
        raise ValueError(f"loss_kernel must be auto, fused, chunked or plain, not {requested!r}")
    if not missing:
        return FUSED, f"auto: {FUSED_LIBRARIES[str(library)]}'s fused linear + cross-entropy on CUDA"
    fits = "fit" if logits_fit else "do not fit"
    return (PLAIN if logits_fit else CHUNKED), f"auto: the full logits {fits} the memory estimate; not fused: {missing}"


def check_loss_kernel(requested: str, *, local: bool) -> None:
    """Before the workers start: refuse ``training.loss_kernel fused`` for a ``local`` run on a machine without a
    CUDA GPU that runs Triton or without a fused library (:func:`choose_loss_kernel`'s message). The workers decide
    the rest (the model's logits are known there)."""
    if requested == FUSED and local:
        cuda = torch.cuda.is_available()
        choose_loss_kernel(
            FUSED,
            device_type="cuda" if cuda else "cpu",
            capability=torch.cuda.get_device_capability() if cuda else None,
            transform=None,
            logits_fit=True,
            library=fused_library(),
        )


def _fused_loss(
    library: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore: int,
    softcap: float | None,
) -> torch.Tensor:
    """The summed cross-entropy of ``hidden @ weight.T`` by a fused library's kernel (CUDA only; imported here)."""
    if library == "liger_kernel":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        # accum_dtype fp32: the projection's gradient summed over Liger's chunks in fp32, as the chunked loss does.
        loss = LigerFusedLinearCrossEntropyLoss(
            ignore_index=ignore, reduction="sum", softcap=softcap, accum_dtype=torch.float32
        )
        summed: torch.Tensor = loss(weight, hidden, labels)  # the libraries carry no type information
        return summed
    from cut_cross_entropy import linear_cross_entropy

    # filter_eps None: every logit's gradient is computed; its default drops the small ones (an approximation).
    cut: torch.Tensor = linear_cross_entropy(
        hidden, weight, labels, ignore_index=ignore, softcap=softcap, reduction="sum", filter_eps=None
    )
    return cut


def projected_loss(
    kernel: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    transform: LogitTransform | None = None,
    max_logits: int = 2**26,
    library: str | None = None,
) -> torch.Tensor:
    """The summed next-token cross-entropy of ``hidden @ weight.T`` (with the model's logit ``transform``) by
    ``kernel`` (:func:`choose_loss_kernel`): the same value and gradients by every kernel, up to rounding. Example:
    ``projected_loss("plain", hidden, head(), labels, transform=head.transform)``."""
    if kernel == CHUNKED:
        return chunked_cross_entropy(
            hidden, weight, labels, max_logits=max_logits, ignore_index=ignore_index, transform=transform
        )
    hidden, labels = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    if kernel == FUSED:
        if library is None or fused_refusal(transform):
            raise ValueError("the fused loss needs a library and a model whose logits it can transform")
        softcap = transform.softcap if transform is not None else None
        return _fused_loss(library, hidden.contiguous(), weight, labels, ignore=ignore_index, softcap=softcap)
    logits = F.linear(hidden, weight).float()
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def host_logits_fit(tokens: int, vocab: int, max_logits: int = LOSS_CHUNK_LOGITS) -> bool:
    """Where no GPU's memory is estimated (a CPU worker): whether a micro-batch's ``tokens`` x ``vocab`` logits fit
    the budget of one chunk of the chunked loss, ``max_logits`` (256 MiB of fp32 logits), which is the size at which
    the chunked loss itself would score all tokens at once."""
    return tokens * vocab <= max_logits


@dataclass(frozen=True)
class LossKernel:
    """The loss kernel a run resolved (:func:`choose_loss_kernel`): its ``name``, why, and the fused ``library``'s
    module (fused only). Called as :func:`projected_loss` with it."""

    name: str = CHUNKED
    reason: str = "as configured"
    library: str | None = None

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        ignore_index: int = -100,
        transform: LogitTransform | None = None,
        max_logits: int = LOSS_CHUNK_LOGITS,
    ) -> torch.Tensor:
        return projected_loss(
            self.name,
            hidden,
            weight,
            labels,
            ignore_index=ignore_index,
            transform=transform,
            max_logits=max_logits,
            library=self.library,
        )


def agreed_loss_kernel(
    requested: str,
    device: torch.device,
    transform: LogitTransform | None,
    logits_fit: bool,
    everywhere: Callable[[bool], bool],
) -> LossKernel:
    """:func:`choose_loss_kernel` on every rank, then the same kernel everywhere: fused only where every rank can run
    it (else plain or chunked by the memory rule); ``fused`` refused on any rank stops them all. ``everywhere``: whether
    a condition holds on every rank (a collective vote, the loop's)."""
    library = fused_library() if device.type == "cuda" else None
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    choose = partial(
        choose_loss_kernel, device_type=device.type, capability=capability, transform=transform, logits_fit=logits_fit
    )
    refused: UserError | None = None
    kernel, why = CHUNKED, ""
    try:
        kernel, why = choose(requested, library=library)
    except UserError as error:
        refused = error
    if not everywhere(refused is None):
        raise refused or UserError(
            f"training.loss_kernel {requested}: another rank cannot run it (its error says why)",
            hint="Use loss_kernel auto, plain or chunked, or give every worker the same image and GPUs.",
        )
    if not everywhere(kernel == FUSED) and kernel == FUSED:
        kernel, why = choose(requested, library=None)
        why = f"{why.split('; not fused')[0]}; not fused: another rank cannot run it"
    return LossKernel(kernel, why, library if kernel == FUSED else None)
