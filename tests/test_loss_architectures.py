"""The job's loss is each model's own: for the architectures people fine-tune, the loss as the training loop computes
it (the output projection deferred, the loss in several chunks, the model sharded by FSDP) equals
``model(input_ids, labels=labels).loss`` of the same weights in fp32, and so do the gradients. Tiny random models
built from transformers' own config classes, no network, Gemma 3's multimodal checkpoints among them. Gemma's
final-logit soft-capping, Granite's, HyperCLOVAX's and Cohere's logit scaling (each in its own direction) and a
mixture of experts' router load-balancing term are the model's way; a model that changes its logits in a way the
loss does not know, or computes a loss of its own, is refused."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
import transformers

from raytrain_eks.errors import UserError
from raytrain_eks.train.loss import LossKernel
from raytrain_eks.train.model import (
    chunked_cross_entropy,
    logit_transform,
    output_projection_deferred,
    router_aux_loss,
)
from raytrain_eks.train.sharding import apply_fsdp

VOCAB = 256
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    # The router's load-balancing term joins the model's loss when the config asks for it.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.02,
        },
    ),
    "gemma2": ("Gemma2Config", {"head_dim": 16}),  # final_logit_softcapping 30 by default
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "final_logit_softcapping": 5.0}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "gpt-neox": ("GPTNeoXConfig", {}),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0}),  # divides by it
    "hyperclovax": ("HyperCLOVAXConfig", {"logits_scaling": 4.0}),  # multiplies by it
    "cohere": ("CohereConfig", {"logit_scale": 0.25}),
}
# Composite configs, the small sizes their text model's. Gemma 3's 4B/12B/27B checkpoints load as
# Gemma3ForConditionalGeneration, trained on text through its own forward (which, in transformers 5.23, leaves the
# text config's soft-capping out); its vision tower gets no gradient. Sharding wraps its text decoder's layers
# (``model.model.language_model.layers``).
MULTIMODAL = {
    "gemma3-multimodal": (
        "Gemma3Config",
        {
            "text_config": {"head_dim": 16, "final_logit_softcapping": 5.0},
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 28,
                "patch_size": 14,
            },
            "mm_tokens_per_image": 4,
            "boi_token_id": 253,
            "eoi_token_id": 254,
            "image_token_id": 255,
        },
    ),
}


def _config(arch):
    if arch in MULTIMODAL:
        name, extra = MULTIMODAL[arch]
        return getattr(transformers, name)(**{**extra, "text_config": {**SMALL, **extra["text_config"]}})
    name, extra = ARCHITECTURES[arch]
    return getattr(transformers, name)(**{**SMALL, **extra})


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :6] = -100  # a masked prompt
    labels[1, -4:] = -100  # masked padding
    return ids, labels


def jobs_loss(model, head, ids, labels, kernel: str = "chunked"):
    """The loss as the loop takes it: the deferred projection's hidden states, the cross-entropy by the loss
    ``kernel`` (chunked: in chunks of 5 tokens) with the model's logit transform, over the tokens counted, plus the
    router term when the model has one. Returns ``(loss, router term or None)``."""
    outputs = head.forward(model, input_ids=ids)
    weight = head()
    count = int((labels[:, 1:] != -100).sum())
    loss = LossKernel(kernel)(
        outputs.logits[:, :-1],
        weight,
        labels[:, 1:],
        max_logits=weight.size(0) * 5,
        ignore_index=-100,
        transform=head.transform,
    )
    loss = loss / count
    router = router_aux_loss(model, outputs)
    return (loss if router is None else loss + router), router


def _grads(model):
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().clone()
    return out


@pytest.mark.parametrize("arch", [*ARCHITECTURES, *MULTIMODAL])
def test_the_jobs_loss_and_gradients_are_the_models_own(one_rank, arch):
    config = _config(arch)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    reference = copy.deepcopy(model)
    ids, labels = _batch(seed=len(arch))

    own = reference(input_ids=ids, labels=labels).loss
    own.backward()
    assert own.item() > 1.0

    # As the loop does it: deferred projection, sharded, the loss in 9 chunks of 5 tokens.
    model.train()
    reference.train()
    if arch in MULTIMODAL and "self.loss_function" not in inspect.getsource(type(model).forward):
        # transformers 5.13 (the Ray Train DLC's, checked by scripts/check_oldest.sh): Gemma 3's multimodal forward
        # computes a cross-entropy of its own (upcast logits, its own shift and mask): refused, never approximated.
        with pytest.raises(UserError, match="computes its loss in its own way"):
            output_projection_deferred(model)
        return
    head = output_projection_deferred(model)
    apply_fsdp(model, precision="fp32")
    theirs = _grads(reference)
    for kernel in ("chunked", "plain"):  # the loss kernels that run on a CPU (training.loss_kernel)
        model.zero_grad(set_to_none=True)
        loss, router = jobs_loss(model, head, ids, labels, kernel)
        assert (router is not None) == (arch == "qwen3-moe")
        loss.backward()
        torch.testing.assert_close(loss.detach(), own.detach(), rtol=1e-5, atol=1e-6, msg=kernel)
        mine = _grads(model)
        assert mine.keys() == theirs.keys() and len(mine) > 5
        for key in theirs:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-4, atol=1e-6, msg=f"{kernel}: {key}")


def test_the_transforms_are_read_from_the_models_own_config():
    def build(name, **extra):
        return transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**{**SMALL, **extra}))

    assert logit_transform(build("LlamaConfig")) is None
    gemma = logit_transform(build("Gemma2Config", head_dim=16, final_logit_softcapping=7.0))
    assert gemma.softcap == 7.0 and gemma.scale == 1.0
    assert logit_transform(build("Gemma2Config", head_dim=16, final_logit_softcapping=None)) is None
    assert logit_transform(build("GraniteConfig", logits_scaling=8.0)).scale == 1 / 8
    assert logit_transform(build("GraniteConfig", logits_scaling=1.0)) is None
    assert logit_transform(build("HyperCLOVAXConfig", logits_scaling=8.0)).scale == 8
    assert logit_transform(build("CohereConfig", logit_scale=0.5)).scale == 0.5
    # While the loss applies it, the model's own transform is off; its config is its own again after.
    model = build("GraniteConfig", logits_scaling=8.0)
    head = output_projection_deferred(model)
    with head.untransformed():
        assert model.config.logits_scaling == 1.0
    assert model.config.logits_scaling == 8.0


class _CroppedLogits(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden)
        logits = logits[..., :100]  # a change the chunked loss does not know
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=100, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_model_that_changes_its_logits_in_an_unknown_way_is_refused():
    model = _CroppedLogits(transformers.LlamaConfig(**SMALL))
    with pytest.raises(UserError, match=r"_CroppedLogits changes its logits .*logits = logits\[\.\.\., :100\]"):
        output_projection_deferred(model)


class _ShiftedProjection(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden) + 1.0  # the projection's own line, and more
        loss = self.loss_function(logits, labels, self.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class _OwnCrossEntropy(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())  # labels not shifted
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_projection_that_does_more_or_a_loss_of_its_own_is_refused():
    with pytest.raises(
        UserError, match=r"_ShiftedProjection changes its logits .*logits = self\.lm_head\(hidden\) \+ 1\.0"
    ):
        output_projection_deferred(_ShiftedProjection(transformers.LlamaConfig(**SMALL)))
    with pytest.raises(UserError, match=r"_OwnCrossEntropy computes its loss in its own way"):
        output_projection_deferred(_OwnCrossEntropy(transformers.LlamaConfig(**SMALL)))


class _WalrusSoftcap(transformers.LlamaForCausalLM):
    """Soft-capped as Gemma 3n's and Gemma 4's conditional-generation forwards write it (transformers 5.23)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden_states)
        if (final_logit_softcapping := self.config.get_text_config().final_logit_softcapping) is not None:
            logits = logits / final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * final_logit_softcapping
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.get_text_config().vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class _UnguardedSoftcap(transformers.LlamaForCausalLM):
    """Soft-capped as RecurrentGemma writes it: no value of the cap turns it off while the loss applies it."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        cap = self.config.final_logit_softcapping
        logits = torch.nn.functional.tanh(logits / cap) * cap
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_soft_cap_read_through_a_local_name_is_applied_and_one_that_cannot_be_turned_off_is_refused():
    torch.manual_seed(0)
    model = _WalrusSoftcap(transformers.LlamaConfig(**SMALL, final_logit_softcapping=3.0))
    ids, labels = _batch(seed=3)
    own = model(input_ids=ids, labels=labels).loss
    head = output_projection_deferred(model)
    assert head.transform.softcap == 3.0
    hidden = head.forward(model, input_ids=ids).logits
    loss = chunked_cross_entropy(hidden[:, :-1], head(), labels[:, 1:], max_logits=VOCAB * 5, transform=head.transform)
    torch.testing.assert_close(loss / int((labels[:, 1:] != -100).sum()), own, rtol=1e-5, atol=1e-6)
    with pytest.raises(UserError, match=r"_UnguardedSoftcap changes its logits .*soft-cap by final_logit_softcapping"):
        output_projection_deferred(_UnguardedSoftcap(transformers.LlamaConfig(**SMALL, final_logit_softcapping=3.0)))
