"""Named starting points for the configuration; each returns a fresh :class:`~raytrain_eks.config.Config`.

``reference()`` is AWS's reference deployment (2 x g6.12xlarge, Qwen2.5-1.5B, random token ids).
``local_tiny()`` changes only the training section so the same job runs on a laptop's CPUs in minutes.
Example::

    cfg = load_config(preset=local_tiny())
"""

from __future__ import annotations

from raytrain_eks.config import BUILTIN_DATA, BUILTIN_MODEL, Config
from raytrain_eks.errors import UserError


def reference() -> Config:
    """The reference deployment's settings."""
    return Config()


def local_tiny() -> Config:
    """A tiny Qwen2 model and the shipped instruction data: the default main job, no cloud, no network."""
    base = reference()
    training = base.training.model_copy(
        update={
            "model_id": BUILTIN_MODEL,
            "data": BUILTIN_DATA,
            "data_format": "instruction",
            # 40 steps of 2 x 4 blocks of 128 tokens (3 passes over the shipped data): the loss falls from ~6.9 to
            # ~2.5 in about 20 s of training on 2 cores without native bf16 (fp32, ~0.45 s a step); more steps
            # only wander around the loss this little data allows.
            "steps": 40,
            "seq_len": 128,
            "batch_size": 4,
            "learning_rate": 3e-3,
            "weight_decay": 0.0,
            "log_every": 10,
        }
    )
    # No NCCL and no EFA on a laptop: the transport gate has nothing to check.
    fabric = base.fabric.model_copy(update={"require": "any"})
    return base.model_copy(update={"training": training, "fabric": fabric})


def eks_2x_g6_12xlarge() -> Config:
    """The reference cluster by name (same as :func:`reference`)."""
    return reference()


PRESETS = {"reference": reference, "local-tiny": local_tiny, "eks-2x-g6-12xlarge": eks_2x_g6_12xlarge}


def choose(name: str | None, *, address: str | None = None) -> Config:
    """The preset called ``name``; with none named, ``local_tiny`` on this machine and ``reference`` when joining
    a cluster (``address`` given). An unknown name is a :class:`UserError` listing the known ones."""
    if name is None:
        return local_tiny() if address is None else reference()
    if name not in PRESETS:
        raise UserError(f"--preset {name!r} is not known; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]()
