"""Every causal LM transformers knows (``MODEL_FOR_CAUSAL_LM_MAPPING``) is either trained on its own loss or refused
when the job starts. Each is built tiny and random from its own config class: the loss as the job computes it (the
output projection deferred, the loss in several chunks, fp32) equals ``model(input_ids, labels=labels).loss``, or
``output_projection_deferred`` raises a :class:`UserError` (a bias in the projection, logits changed in a way the
loss does not know, a loss of its own such as BART's unshifted cross-entropy). Config classes that cannot be built
small here (their validators want other sizes, their forward other inputs) are skipped, and counted in the line
the test prints. About 25 s on one thread of a 2-core machine; the common architectures' gradients and sharding are
in ``test_loss_architectures.py``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from test_loss_architectures import SMALL as ARCHITECTURE_SIZES
from test_loss_architectures import VOCAB, jobs_loss
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from raytrain_eks.errors import UserError
from raytrain_eks.train.model import output_projection_deferred

pytestmark = pytest.mark.usefixtures("builds_models")

SMALL = dict(ARCHITECTURE_SIZES, head_dim=16)
# Sizes of mixtures of experts, latent attention and partial rotary embeddings, and a layer pattern left to the
# config's own default for two layers; tried first, then SMALL alone.
SMALLER_PARTS = dict(
    SMALL,
    layer_types=None,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    rotary_dim=8,
)
TINY_PARAMETERS = 20_000_000


def _tiny_config(config_class):
    """The config class with small sizes, for itself and its sub-configs (text, vision, ...), or ``None``; its
    size is counted on the meta device (no memory), as one config's defaults can make billions of parameters."""
    try:
        default = config_class()
    except Exception:  # its own defaults fail its validators
        return None
    for sizes in (SMALLER_PARTS, SMALL):
        subs = {}
        for key in getattr(default, "sub_configs", None) or {}:
            sub = getattr(default, key, None)
            if sub is not None:
                subs[key] = {**sub.to_dict(), **sizes}
        try:
            config = config_class(**sizes, **subs)
            with torch.device("meta"):
                shell = transformers.AutoModelForCausalLM.from_config(config)
        except Exception:  # a validator wants other sizes, or a package is missing
            continue
        if sum(p.numel() for p in shell.parameters()) <= TINY_PARAMETERS:
            return config
    return None


@pytest.fixture
def one_thread():
    """One intra-op thread: tiny matrices on a busy 2-core machine run several times faster than with two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_causal_lm_is_trained_on_its_own_loss_or_refused_at_start(capsys, one_thread):
    counts: dict[str, list[str]] = {"matched": [], "refused": [], "skipped": []}
    mismatched = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tiny = _tiny_config(CONFIG_MAPPING[model_type]) if model_type in CONFIG_MAPPING else None
            if tiny is None:
                counts["skipped"].append(model_type)
                continue
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(tiny, dtype=torch.float32)
            model.config.use_cache = False
            model.train()
            reference = copy.deepcopy(model)
            ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
            labels = ids.clone()
            labels[0, :6] = -100
            try:
                torch.manual_seed(1)  # the same dropout in both forwards
                own = reference(input_ids=ids, labels=labels).loss
            except Exception:  # its forward wants other sizes or inputs than these
                counts["skipped"].append(model_type)
                continue
            try:
                head = output_projection_deferred(model)
            except UserError:
                counts["refused"].append(model_type)
                continue
            torch.manual_seed(1)
            loss, _ = jobs_loss(model, head, ids, labels)
        if torch.allclose(loss.detach(), own.detach(), rtol=1e-5, atol=1e-6):
            counts["matched"].append(model_type)
        else:
            mismatched.append(f"{class_name}: model {own.item():.6f}, job {loss.item():.6f}")
    with capsys.disabled():
        print(
            f"\n{len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} causal LMs: "
            + ", ".join(f"{len(v)} {k}" for k, v in counts.items())
            + f", {len(mismatched)} mismatched; skipped: {' '.join(counts['skipped'])}"
        )
    assert not mismatched, mismatched
    # The sweep is not empty: the families whose forward scales or soft-caps its logits are among those compared.
    # Among those compared: the families that scale or soft-cap their logits, and Gemma 3's multimodal checkpoints
    # (Gemma3ForConditionalGeneration, trained on text through its own forward).
    assert {"gemma2", "gemma3_text", "gemma3", "granite", "cohere", "hyperclovax", "falcon_h1"} <= set(
        counts["matched"]
    )
    assert {"bart", "trocr"} <= set(counts["refused"])  # their own unshifted CrossEntropyLoss
