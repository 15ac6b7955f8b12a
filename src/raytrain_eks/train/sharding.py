"""How the model is spread over the ranks: chosen from where the ranks run, then applied with FSDP2.

``training.sharding`` is ``auto``, ``fsdp``, ``hsdp`` or ``none``. ``auto`` looks at the node every rank runs on:

- one rank: no wrapper at all (nothing to shard, nothing to reduce);
- several ranks on one node: FSDP, one flat group sharding every parameter;
- ranks on several nodes, the same number on each: HSDP, a 2-D mesh ``(replicate, shard)`` whose rows are the
  nodes. Parameters are sharded inside a node (all-gathers never leave it) and replicated across nodes, so the
  only traffic between nodes is one gradient all-reduce of each rank's shard per optimizer step (none on the
  accumulation micro-batches, whose gradient sync the loop turns off) -- or, with ``reduce_precision: bf16``, one
  bf16 all-reduce per micro-batch, so that the micro-batches still add up in fp32 (:func:`set_gradient_sync`).

Sharding itself is one function, :func:`apply_fsdp`: ``fully_shard`` on each decoder layer, then on the root, with
one mixed-precision policy. On GPUs this shards over NCCL, on CPUs over gloo; the code is the same. Example::

    layout = choose_sharding("auto", ["node-a", "node-a", "node-b", "node-b"])
    # Layout(mode="hsdp", nodes=(("node-a", (0, 1)), ("node-b", (2, 3))), reason="auto: 4 ranks on 2 nodes ...")
    apply_fsdp(model, precision="bf16", reduce_precision="fp32", mesh=build_mesh(layout, "cuda"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain_eks.errors import UserError

if TYPE_CHECKING:  # torch is imported where a model is sharded: choosing a layout (plan) needs none of it
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from transformers import PreTrainedModel

SHARDING_MODES = ("auto", "fsdp", "hsdp", "none")
MESH_DIMS = ("replicate", "shard")  # HSDP's mesh: one row per node, one column per rank of a node


class ShardingError(UserError, ValueError):
    """A sharding that the ranks' placement cannot give (``hsdp`` on one node, ``none`` with several ranks, ...):
    one line, kept as it is when a worker raises it (the run then fails with that line)."""

    exit_code = 2


@dataclass(frozen=True)
class Layout:
    """The sharding chosen for a run: ``mode`` (fsdp, hsdp or none), the ranks of each node (in rank order of their
    first rank), and why, for the run's output."""

    mode: str
    nodes: tuple[tuple[str, tuple[int, ...]], ...]
    reason: str

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for _, ranks in self.nodes)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """``(nodes, ranks per node)`` for HSDP, ``(world_size,)`` for FSDP, ``()`` without a wrapper."""
        if self.mode == "hsdp":
            return (len(self.nodes), len(self.nodes[0][1]))
        return (self.world_size,) if self.mode == "fsdp" else ()

    def describe(self) -> str:
        """One line for the run's output, e.g. ``hsdp: 2 nodes x 2 ranks (auto: ...)``."""
        if self.mode == "hsdp":
            per_node = len(self.nodes[0][1])
            shape = f"{len(self.nodes)} nodes x {per_node} rank{'s' * (per_node > 1)}, sharded inside a node"
        elif self.mode == "fsdp":
            shape = f"{self.world_size} ranks in one group on {len(self.nodes)} node{'s' * (len(self.nodes) > 1)}"
        else:
            shape = "no wrapper"
        return f"{self.mode}: {shape} ({self.reason})"


def group_by_node(node_of_rank: Sequence[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The ranks of each node, nodes in the order of their lowest rank: ``["a", "b", "a"]`` -> ``(("a", (0, 2)),
    ("b", (1,)))``."""
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        groups.setdefault(node, []).append(rank)
    return tuple((node, tuple(ranks)) for node, ranks in groups.items())


def choose_sharding(requested: str, node_of_rank: Sequence[str], precision: str = "fp32") -> Layout:
    """The :class:`Layout` for ``requested`` when rank ``i`` runs on node ``node_of_rank[i]``, in the resolved
    ``precision``: bf16 compute comes from FSDP's mixed-precision policy, so a bf16 run always has a wrapper.

    An explicit mode the placement cannot give raises :class:`ShardingError` (one line saying what to change);
    ``auto`` never does: ranks spread unevenly over nodes fall back to flat FSDP, and the reason says so.
    """
    if requested not in SHARDING_MODES:
        raise ShardingError(f"training.sharding must be one of {', '.join(SHARDING_MODES)}, not {requested!r}")
    nodes = group_by_node(node_of_rank)
    world = len(node_of_rank)
    counts = sorted({len(ranks) for _, ranks in nodes})
    spread = f"{world} rank{'s' * (world > 1)} on {len(nodes)} node{'s' * (len(nodes) > 1)}"
    even = len(counts) == 1
    if requested == "none":
        if world > 1:
            raise ShardingError(
                f"training.sharding = 'none' needs a single worker, but the run has {spread}: set training.sharding "
                "to auto (or fsdp/hsdp), or training.num_workers to 1"
            )
        if precision != "fp32":
            raise ShardingError(
                f"training.sharding = 'none' computes in fp32 only, but the run's precision is {precision}: set "
                "training.precision to fp32, or training.sharding to auto"
            )
        return Layout("none", nodes, "as configured")
    if requested == "fsdp":
        return Layout("fsdp", nodes, "as configured")
    if requested == "hsdp":
        if len(nodes) < 2:
            raise ShardingError(
                f"training.sharding = 'hsdp' replicates across nodes, but the run has {spread}: use auto or fsdp "
                "on one node"
            )
        if not even:
            raise ShardingError(
                f"training.sharding = 'hsdp' needs the same number of ranks on every node, but the run has {spread} "
                f"({_per_node(nodes)}): make training.num_workers a multiple of the node count, or use auto/fsdp"
            )
        return Layout("hsdp", nodes, "as configured")
    if world == 1 and precision == "fp32":
        return Layout("none", nodes, "auto: one worker, nothing to shard")
    if world == 1:
        return Layout("fsdp", nodes, f"auto: one worker, wrapped for {precision} mixed precision")
    if len(nodes) == 1:
        return Layout("fsdp", nodes, f"auto: {spread}")
    if not even:
        return Layout("fsdp", nodes, f"auto: {spread} but uneven ({_per_node(nodes)}), so one flat group")
    return Layout("hsdp", nodes, f"auto: {spread}, no parameter all-gather crosses a node")


def _per_node(nodes: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
    return ", ".join(str(len(ranks)) for _, ranks in nodes) + " ranks per node"


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh | None:
    """The DeviceMesh of ``layout`` (a collective: every rank calls it), or ``None`` for ``none``.

    HSDP's rows are the nodes' rank lists, whatever order the launcher numbered the ranks in.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if layout.mode == "none":
        return None
    if layout.mode == "fsdp":
        return DeviceMesh(device_type, list(range(layout.world_size)))
    rows = [list(ranks) for _, ranks in layout.nodes]
    return DeviceMesh(device_type, rows, mesh_dim_names=MESH_DIMS)


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` for Llama/Qwen2 families; a
    multimodal model's text decoder, ``model.model.language_model.layers`` for Gemma 3's conditional generation)."""
    base = getattr(model, "model", None) or getattr(model, model.base_model_prefix, None)
    layers = None
    for holder in (base, getattr(base, "language_model", None)):
        layers = getattr(holder, "layers", None) or getattr(holder, "h", None)
        if layers is not None:
            break
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(layers)


REDUCE_PRECISIONS = ("bf16", "fp32")


def mixed_precision(precision: str, reduce_precision: str = "fp32") -> MixedPrecisionPolicy:
    """The policy for a resolved ``precision`` and the gradient reduction dtype ``reduce_precision``.

    bf16: compute in bf16 (fp32 master weights), reduce gradients in ``reduce_precision``. fp32: compute in fp32;
    with ``reduce_precision = "bf16"`` the gradients still cross the network in bf16 (half the bytes, rounded),
    otherwise no casting at all. ``precision`` is the resolved one (train/precision.py); ``auto`` must have been
    decided before sharding.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if reduce_precision not in REDUCE_PRECISIONS:
        raise ValueError(f"reduce_precision must be bf16 or fp32, not {reduce_precision!r}")
    if precision == "bf16":
        reduce_dtype = torch.bfloat16 if reduce_precision == "bf16" else torch.float32
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    if precision == "fp32":
        return MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if reduce_precision == "bf16" else None)
    raise ValueError(f"resolved precision must be bf16 or fp32, not {precision!r}")


def apply_fsdp(
    model: torch.nn.Module, *, precision: str, reduce_precision: str = "fp32", mesh: DeviceMesh | None = None
) -> torch.nn.Module:
    """Shard ``model`` in place over ``mesh`` (default: the default process group, flat) and return it.

    A 1-D mesh gives FSDP; a 2-D ``(replicate, shard)`` mesh gives HSDP.
    """
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(precision, reduce_precision)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed right after its backward by the root: keep them gathered.
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(layers) - 1)
    # The root (embedding, final norm, output projection) stays gathered after forward: the chunked loss multiplies
    # by the output projection's weight after the model's forward has returned.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def shard_model(
    model: torch.nn.Module, layout: Layout, *, precision: str, reduce_precision: str, device: torch.device
) -> torch.nn.Module:
    """Apply ``layout`` to ``model`` (already on ``device``): FSDP or HSDP via :func:`apply_fsdp`, or nothing."""
    if layout.mode == "none":
        return model
    return apply_fsdp(
        model, precision=precision, reduce_precision=reduce_precision, mesh=build_mesh(layout, device.type)
    )


def set_gradient_sync(model: torch.nn.Module, mode: str, last: bool) -> None:
    """How a micro-batch's backward reduces gradients under gradient accumulation, keeping them sharded: FSDP
    reduce-scatters every micro-batch (each rank then holds only its shard of the running sum, never the whole
    gradient, and adds each micro-batch's reduced shard to it in fp32); HSDP reduce-scatters inside the node every
    micro-batch and all-reduces across nodes only on the ``last`` (no traffic between nodes before it), unless
    gradients are reduced in bf16: then it all-reduces every micro-batch, so that the running sum stays fp32 as
    FSDP's does (one bf16 all-reduce of the rank's shard per micro-batch instead of one per step). A model without a
    wrapper (``none``) has nothing to reduce. Example, one step of ``k`` micro-batches::

        for i, batch in enumerate(micro_batches):
            set_gradient_sync(model, layout.mode, last=i == k - 1)
            loss(model, batch).backward()
    """
    from torch.distributed.fsdp import FSDPModule

    if mode == "none" or not isinstance(model, FSDPModule):
        return
    model.set_requires_gradient_sync(True)
    if mode != "hsdp":
        return
    # torch 2.13's FSDP2 (FSDPParamGroup.post_backward -> _fsdp_collectives.foreach_reduce) keeps the reduce-scattered
    # sum of the micro-batches that skip the all-reduce in FSDPParamGroup._partial_reduce_output, in the reduce dtype;
    # only the micro-batch that all-reduces casts it to the parameters' fp32 and adds it to the sharded gradient. In
    # bf16 each addition rounds to the running sum's step (1/128 to 1/256 of it): 32 micro-batches of 1 + 3/64 came
    # to 32.5 instead of 33.5. FSDP2 offers no fp32 running sum with a bf16 all-reduce: the policy's one reduce dtype
    # serves both collectives, set_all_reduce_hook runs after the native all-reduce (and only on micro-batches that
    # do it), set_custom_reduce_scatter replaces only the collective inside the node. So a module reduced in bf16
    # all-reduces on every micro-batch: foreach_reduce then never holds a partial sum, and adds each micro-batch's
    # bf16 result, cast to fp32, to the fp32 sharded gradient, as flat FSDP does. The cost: grad_accum_steps bf16
    # all-reduces of the shard per step instead of one, 2 x grad_accum_steps bytes per parameter of the shard
    # across nodes, against 4 for fp32 reduction (no partial-sum buffer is held, so no memory is added).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_all_reduce(last or _reduces_below_fp32(module), recurse=False)


def _reduces_below_fp32(module: FSDPModule) -> bool:
    """Whether FSDP reduces ``module``'s gradients in a dtype narrower than fp32: its policy's ``reduce_dtype``, or
    without one the compute dtype ``param_dtype`` (``MixedPrecisionPolicy``'s rule), or else the fp32 gradients."""
    import torch

    policy = module._get_fsdp_state()._mp_policy  # the policy apply_fsdp gave it: FSDP2 has no public getter
    dtype = policy.reduce_dtype or policy.param_dtype
    return dtype is not None and dtype != torch.float32
