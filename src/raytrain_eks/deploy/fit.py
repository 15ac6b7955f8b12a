"""The memory estimate before anything is created, for the image the cluster's pods will run: ``auto`` attention
counts as flash-attention where that image is known to ship flash-attn
(:func:`~raytrain_eks.k8s.job.image_has_flash_attn`). Used by ``plan`` (both targets), ``up``, ``submit`` and
``config show``."""

from __future__ import annotations

from raytrain_eks.config import Config
from raytrain_eks.k8s.job import image_has_flash_attn
from raytrain_eks.train.memory import MemoryCheck, NodeGpu, check_config, fit_config, planned_layout


def check_on_image(cfg: Config, gpu: NodeGpu) -> MemoryCheck | None:
    """:func:`~raytrain_eks.train.memory.check_config` with what ``cfg.ray.image`` is known to ship."""
    return check_config(cfg, gpu, image_flash=image_has_flash_attn(cfg.ray.image))


def fit_on_image(cfg: Config, gpu: NodeGpu) -> tuple[Config, MemoryCheck | None]:
    """:func:`~raytrain_eks.train.memory.fit_config` with what ``cfg.ray.image`` is known to ship: raises
    :class:`~raytrain_eks.train.memory.DoesNotFit`, or returns the config with activation checkpointing switched on
    where it must be."""
    return fit_config(cfg, gpu, image_flash=image_has_flash_attn(cfg.ray.image))


def sharding_line(cfg: Config) -> str:
    """How a GPU run of ``cfg`` spreads the model over its GPUs (:func:`~raytrain_eks.train.memory.planned_layout`,
    the layout the memory estimate assumes), in one line. Example, the reference: ``sharding: hsdp, 2 nodes x 4
    ranks: parameters sharded over the 4 GPUs of a node, replicated across the 2 nodes (auto: ...)``."""
    layout = planned_layout(cfg)
    nodes, world = len(layout.nodes), layout.world_size
    if layout.mode == "hsdp":
        per_node = layout.mesh_shape[1]
        shape = (
            f"{nodes} nodes x {per_node} ranks: parameters sharded over the {per_node} GPUs of a node, replicated "
            f"across the {nodes} nodes"
        )
    elif world == 1:
        shape = "one rank: every parameter whole on its one GPU"
    else:
        on = "one node" if nodes == 1 else f"{nodes} nodes"
        shape = f"{world} ranks in one group on {on}: parameters sharded over all {world} GPUs"
    return f"sharding: {layout.mode}, {shape} ({layout.reason})"
