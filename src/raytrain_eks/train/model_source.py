"""Where a model comes from, checked on the driver before anything starts: a hub id, a local folder, the built-in
model (built on first use), or a model staged where every node reads it (``s3://...``, :mod:`.staged`). Nothing
here imports torch, so these checks run while it has not been loaded yet.

Example::

    path = resolve_model_path("builtin:tiny-qwen2")    # a folder that ``from_pretrained`` reads
    config = check_model(path)                          # its config; its tokenizer loads too, or a UserError
"""

from __future__ import annotations

from pathlib import Path

from raytrain_eks.config import BUILTIN_MODEL
from raytrain_eks.errors import UserError


def resolve_model_path(model_id: str) -> str:
    """A path or hub id that ``from_pretrained`` accepts; builds the built-in model when asked for it."""
    if model_id == BUILTIN_MODEL:
        from raytrain_eks.train.builtin import ensure_builtin_model

        return str(ensure_builtin_model())
    if "://" in model_id:  # staged (raytrain-eks stage-model): this node's copy of it
        from raytrain_eks.train.staged import local_copy

        return local_copy(model_id)
    local = Path(model_id).expanduser()
    if model_id.startswith((".", "/", "~")) or local.exists():
        if not (local / "config.json").exists():
            raise UserError(
                f"--model {model_id!r}: not a Hugging Face model folder (no config.json in it)",
                hint="Give a folder written by save_pretrained, a hub id such as Qwen/Qwen2.5-1.5B, "
                "or builtin:tiny-qwen2.",
            )
        return str(local.resolve())
    return model_id


def check_model(path: str) -> object:
    """Load the model's config and tokenizer on the driver, so a bad id fails before any worker starts."""
    from transformers import AutoConfig

    from raytrain_eks.train.data.encoding import load_tokenizer

    try:
        config = AutoConfig.from_pretrained(path)
        load_tokenizer(path)
    except Exception as exc:  # hub errors, missing files, unknown architectures
        raise UserError(
            f"--model {path!r}: cannot load its config and tokenizer: {str(exc).strip().splitlines()[0]}",
            hint="Check the hub id (and HF_TOKEN for gated models) or the folder, and network access to the hub.",
        ) from None
    return config
