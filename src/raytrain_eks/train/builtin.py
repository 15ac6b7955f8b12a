"""The built-in tiny model: a Qwen2-architecture causal LM and a BPE tokenizer trained on the shipped data.

It is made once, on the spot, with no network access, saved with ``save_pretrained`` into a cache folder, and
then loaded through exactly the same ``from_pretrained`` path as ``Qwen/Qwen2.5-1.5B``. Example::

    path = ensure_builtin_model()          # ~/.cache/raytrain-eks/tiny-qwen2-<hash>
    AutoModelForCausalLM.from_pretrained(path)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

SAMPLE_DATA = "sample_instructions.jsonl"

# Bump when the recipe below changes, so caches built by an older recipe are not reused.
_RECIPE = {
    "version": 1,
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "seed": 0,
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the layout Qwen2 models use: each turn is <|im_start|>role\n...<|im_end|>\n.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def sample_data_path() -> Path:
    """The instruction data set that ships with the package (JSONL, alpaca-style rows)."""
    return Path(str(resources.files("raytrain_eks.resources").joinpath(SAMPLE_DATA)))


def cache_root() -> Path:
    """Where built artefacts live: ``$RAYTRAIN_EKS_CACHE`` or ``~/.cache/raytrain-eks``."""
    return Path(os.environ.get("RAYTRAIN_EKS_CACHE", Path.home() / ".cache" / "raytrain-eks"))


def _texts(data: Path) -> list[str]:
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    return [" ".join(str(row.get(k, "")) for k in ("instruction", "input", "output")) for row in rows]


def _build(target: Path, data: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_RECIPE["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _texts(data)
    # Also teach it the chat layout and the roles, so chat data tokenizes compactly.
    texts += ["system\nuser\nassistant\n"] * 20
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target)

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=_RECIPE["hidden_size"],
        intermediate_size=_RECIPE["intermediate_size"],
        num_hidden_layers=_RECIPE["num_hidden_layers"],
        num_attention_heads=_RECIPE["num_attention_heads"],
        num_key_value_heads=_RECIPE["num_key_value_heads"],
        max_position_embeddings=_RECIPE["max_position_embeddings"],
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(_RECIPE["seed"])
    model = Qwen2ForCausalLM(config)
    from transformers.utils import logging as hf_logging

    # A one-off save of a few MB: no progress bar of transformers' in the first run's display.
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(target)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def ensure_builtin_model(root: Path | None = None) -> Path:
    """Return the folder of the built-in model, building it first if this recipe and data have not been built.

    Safe against concurrent callers: each builds in a temporary folder and renames it into place.
    """
    data = sample_data_path()
    digest = hashlib.sha256(json.dumps(_RECIPE, sort_keys=True).encode() + data.read_bytes()).hexdigest()[:12]
    target = (root or cache_root()) / f"tiny-qwen2-{digest}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        _build(tmp, data)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # someone else won the race with a complete build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
