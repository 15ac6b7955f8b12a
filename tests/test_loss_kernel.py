"""``training.loss_kernel``: which kernel a worker runs on each device and for each model (the CUDA cases asked of
the selection function with a device and a compute capability, not by faking CUDA), why it says so, what the
driver refuses before anything starts, the numerics of the kernels that run on a CPU (plain and chunked: the same
loss and gradients, through a model's soft-capping and logit scaling), and what the memory estimate and a plan count
for each kernel."""

from __future__ import annotations

import pytest
import torch

from raytrain_eks.config import TrainingConfig
from raytrain_eks.errors import UserError
from raytrain_eks.train.loss import (
    LossKernel,
    check_loss_kernel,
    choose_loss_kernel,
    host_logits_fit,
    projected_loss,
)
from raytrain_eks.train.memory import GIB, KNOWN_SHAPES, check_training, estimate, loss_bytes
from raytrain_eks.train.model import LogitTransform

H100 = (9, 0)
SOFTCAP = LogitTransform(softcap=30.0)  # Gemma 2's final soft-capping
SCALED = LogitTransform(scale=0.125)  # Granite's logits_scaling 8


def choose(requested: str, **given):
    args = dict(device_type="cuda", capability=H100, transform=None, logits_fit=True, library="liger_kernel")
    return choose_loss_kernel(requested, **{**args, **given})


def test_auto_is_fused_on_a_cuda_gpu_with_a_library_and_says_which():
    assert choose("auto") == ("fused", "auto: Liger-Kernel's fused linear + cross-entropy on CUDA")
    assert choose("auto", library="cut_cross_entropy")[1].startswith("auto: cut-cross-entropy's")
    # A final soft-capping is one both libraries apply (their softcap argument).
    assert choose("auto", transform=SOFTCAP)[0] == "fused"


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ({"transform": SCALED}, "the model scales its logits (x0.125), which no fused library applies"),
        ({"library": None}, "neither Liger-Kernel nor cut-cross-entropy is installed (pip install raytrain-eks[gpu])"),
        ({"capability": (7, 5)}, "the GPU's compute capability 7.5 is below Triton's 8.0"),
        ({"device_type": "cpu", "capability": None}, "the device is a CPU, and the fused kernels need CUDA"),
    ],
)
def test_auto_without_fused_is_plain_where_the_logits_fit_and_chunked_where_not(given, why):
    assert choose("auto", **given) == ("plain", f"auto: the full logits fit the memory estimate; not fused: {why}")
    kernel, reason = choose("auto", logits_fit=False, **given)
    assert (kernel, reason) == ("chunked", f"auto: the full logits do not fit the memory estimate; not fused: {why}")


def test_plain_and_chunked_run_as_configured_anywhere():
    for kernel in ("plain", "chunked"):
        assert choose(kernel, device_type="cpu", logits_fit=False, library=None) == (kernel, "as configured")


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({"device_type": "cpu", "capability": None}, "the device is a CPU"),
        ({"capability": (7, 5)}, "compute capability 7.5"),
        ({"library": None}, "neither Liger-Kernel nor cut-cross-entropy is installed"),
        ({"transform": SCALED}, "scales its logits"),
    ],
)
def test_fused_where_it_cannot_run_is_refused_with_what_is_missing(given, missing):
    with pytest.raises(UserError, match="training.loss_kernel fused cannot run here: ") as refused:
        choose("fused", **given)
    assert missing in str(refused.value) and "loss_kernel auto" in refused.value.hint
    assert choose("fused") == ("fused", "as configured: Liger-Kernel's fused linear + cross-entropy")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_a_local_run_on_a_cpu_machine_refuses_fused_before_it_starts():
    with pytest.raises(UserError, match="the device is a CPU"):
        check_loss_kernel("fused", local=True)
    check_loss_kernel("fused", local=False)  # a cluster's workers decide on their own devices
    check_loss_kernel("auto", local=True)


def test_a_cpu_worker_scores_the_full_logits_while_they_fit_one_chunks_budget():
    assert host_logits_fit(2 * 1024, 32000)  # the built-in model's default run: 65.5 M logits
    assert not host_logits_fit(2 * 1024, 151936)  # Qwen2.5's vocabulary: 311 M logits, chunked


def _inputs(seed: int, hidden: int = 24, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 13, hidden, generator=gen)
    w = 0.5 * torch.randn(vocab, hidden, generator=gen)
    labels = torch.randint(0, vocab, (2, 13), generator=gen)
    labels[0, :4] = -100  # a masked prompt
    return h, w, labels


def _loss_and_grads(kernel: LossKernel, h, w, labels, transform):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = kernel(h, w, labels, transform=transform, max_logits=50 * 4)  # chunked: 4 tokens a chunk, 7 chunks
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("transform", [None, SOFTCAP, SCALED, LogitTransform(scale=2.0, softcap=5.0)])
def test_plain_and_chunked_give_the_same_loss_and_gradients(transform):
    h, w, labels = _inputs(seed=7)
    plain = _loss_and_grads(LossKernel("plain"), h, w, labels, transform)
    chunked = _loss_and_grads(LossKernel("chunked"), h, w, labels, transform)
    assert plain[0].item() > 1.0
    for p, c in zip(plain, chunked, strict=True):
        torch.testing.assert_close(c, p, rtol=1e-5, atol=1e-6)
    # The transform is applied: without it the loss differs.
    if transform is not None:
        assert abs(_loss_and_grads(LossKernel("plain"), h, w, labels, None)[0] - plain[0]) > 1e-3


def test_the_fused_kernel_is_never_called_for_a_model_it_cannot_compute():
    h, w, labels = _inputs(seed=1)
    with pytest.raises(ValueError, match="fused loss needs a library"):
        projected_loss("fused", h, w, labels, transform=SCALED, library="liger_kernel")


QWEN = KNOWN_SHAPES["Qwen/Qwen2.5-1.5B"]


def test_the_estimate_counts_each_kernels_loss():
    tokens = 4 * 2048
    plain, chunked, fused = (
        loss_bytes(QWEN, tokens=tokens, compute_bytes=2, kernel=k) for k in ("plain", "chunked", "fused")
    )
    # plain: fp32 log-probabilities, their fp32 gradient and its bf16 copy over all 8192 x 151936 logits (11.6 GiB)
    assert plain == tokens * QWEN.vocab * 10 + 2 * QWEN.vocab * QWEN.hidden
    assert plain > 10 * GIB > chunked > fused
    common = dict(shard_ranks=1, precision="bf16", micro_batch=4, seq_len=2048, activation_checkpointing=False)
    assert estimate(QWEN, loss_kernel="plain", **common).parts["loss"] == plain
    assert estimate(QWEN, **common).settings["loss_kernel"] == "chunked"


def test_a_plan_counts_plain_where_the_logits_fit_and_chunked_where_they_do_not_and_says_so():
    common = dict(shard_ranks=1, precision="bf16", gpu_name="H200")
    training = TrainingConfig(batch_size=4, seq_len=2048)
    roomy = check_training(QWEN, training, gpu_bytes=141 * GIB, **common)
    assert roomy.estimate.settings["loss_kernel"] == "plain" and roomy.to_dict()["loss_kernel_line"].startswith(
        "loss kernel: plain (auto: the full logits fit the memory estimate; fused instead where"
    )
    # On a 60 GiB card the plain loss's 11.6 GiB would not fit in 85%: the chunked loss does, without checkpointing.
    tight = check_training(QWEN, training, gpu_bytes=60 * GIB, **common)
    assert tight.fits and not tight.checkpointing
    assert tight.estimate.settings["loss_kernel"] == "chunked" and "do not fit" in tight.loss
    chosen = check_training(QWEN, training.model_copy(update={"loss_kernel": "plain"}), gpu_bytes=141 * GIB, **common)
    assert chosen.loss == "loss kernel: plain (as configured)"
