"""The memory estimate before anything is created, for the image the cluster's pods will run: ``auto`` attention
counts as flash-attention where that image is known to ship flash-attn
(:func:`~raytrain_eks.k8s.job.image_has_flash_attn`). Used by ``plan`` (both targets), ``up``, ``submit`` and
``config show``."""

from __future__ import annotations

from raytrain_eks.config import Config
from raytrain_eks.k8s.job import image_has_flash_attn
from raytrain_eks.train.memory import MemoryCheck, NodeGpu, check_config, fit_config


def check_on_image(cfg: Config, gpu: NodeGpu) -> MemoryCheck | None:
    """:func:`~raytrain_eks.train.memory.check_config` with what ``cfg.ray.image`` is known to ship."""
    return check_config(cfg, gpu, image_flash=image_has_flash_attn(cfg.ray.image))


def fit_on_image(cfg: Config, gpu: NodeGpu) -> tuple[Config, MemoryCheck | None]:
    """:func:`~raytrain_eks.train.memory.fit_config` with what ``cfg.ray.image`` is known to ship: raises
    :class:`~raytrain_eks.train.memory.DoesNotFit`, or returns the config with activation checkpointing switched on
    where it must be."""
    return fit_config(cfg, gpu, image_flash=image_has_flash_attn(cfg.ray.image))
