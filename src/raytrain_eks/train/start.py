"""Where a sharded model's weights come from at start, so that no rank holds more than its shard.

Every rank builds the model on the meta device (:func:`~raytrain_eks.train.model.load_model_shell`: shapes, no
memory), the model is sharded, and then each rank fills only its own shard:

- ``own-shard``: each rank reads, from the model's safetensors files, only the slices of every weight that its shard
  holds (DCP's Hugging Face reader, which reads a slice of a memory-mapped file): the start of a fresh run;
- ``checkpoint``: nothing is read from the model's files at all; the resume fills every weight from the run's
  checkpoint (a full fine-tune's checkpoint holds them all);
- ``rank0``: rank 0 reads the whole model and sends each rank its shard (the fallback when the files cannot be read
  by shard: no safetensors, names or shapes that differ from the model's, or a conversion on load other than a
  renaming or a stack of experts). The run says why. Rank 0 keeps the loaded tensors on the CPU, once
  (:func:`take_weights`), and shards an empty model like the other ranks; its shards are sent from the CPU one weight
  at a time (:func:`~raytrain_eks.train.model.fill_from_rank0`), so no device ever holds the whole model.

Files that transformers converts while loading are read by shard too, with transformers' own conversion table for
the model (:func:`transformers.conversion_mapping.get_model_conversion_mapping`): a renamed weight (GPT-NeoX's
``embed_out`` is the model's ``lm_head``) is read under its name in the files, and a stack of experts (a
Mixture-of-Experts layer's ``mlp.experts.gate_up_proj`` of shape ``[experts, 2 * width, hidden]``, built on load from
every expert's ``gate_proj`` and ``up_proj``) is filled expert by expert: a rank reads the experts of its shard only.

Buffers that are not in a state dict (rotary frequencies) are computed on every rank the way ``from_pretrained``
computes them (it too builds models on the meta device): the model's own ``_init_weights``.

Example::

    model = load_model_shell(path, activation_checkpointing=False)
    source = weights_source(path, model)              # a WeightFiles, or the reason they cannot be read by shard
    buffers = computed_buffers(model)                 # before sharding, on the CPU
    shard_model(model, ...)
    model.to_empty(device=device); restore_buffers(model, buffers); read_own_shard(model, source)
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from raytrain_eks.train.checkpoint import tied_names
from raytrain_eks.train.lora import ADAPTER_NAME, is_adapter

if TYPE_CHECKING:
    from safetensors import safe_open
    from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem
    from torch.distributed.checkpoint.state_dict import ValueType
    from transformers import PreTrainedModel
    from transformers.core_model_loading import WeightConverter

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
_BASE_LAYER = ".base_layer."  # peft's name for the layer it adapts: the model's own files name it without this


@dataclass(frozen=True)
class WeightFiles:
    """The safetensors files that hold the model's weights, and the names in them of the weights to read."""

    files: tuple[Path, ...]
    # A weight of the model (named as the un-adapted model names it) -> its name in the files.
    names: dict[str, str]
    # A weight built on load from several of the files' tensors -> for each of its sources (gate, up), the files' names
    # of that source's tensor for every expert, in expert order; and where each of those names is.
    stacked: dict[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    located: dict[str, Path] = field(default_factory=dict)


def file_name(key: str) -> str:
    """The name the model's own files give a state-dict key of the (possibly adapted) model."""
    return key.replace(_BASE_LAYER, ".")


def _local_files(path: str) -> tuple[list[Path], str]:
    """The model's safetensors files (a model folder, or a hub id's files in the Hugging Face cache, fetched when
    missing), or the reason there are none."""
    folder = Path(path)
    if folder.is_dir():
        index = folder / SAFETENSORS_INDEX
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / n for n in names], ""
        if (folder / SAFETENSORS_SINGLE).is_file():
            return [folder / SAFETENSORS_SINGLE], ""
        return [], f"{path} has no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}"
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        try:
            index_path = Path(hf_hub_download(path, SAFETENSORS_INDEX))
        except EntryNotFoundError:
            return [Path(hf_hub_download(path, SAFETENSORS_SINGLE))], ""
        names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        return [Path(hf_hub_download(path, n)) for n in names], ""
    except Exception as exc:  # no safetensors on the hub, no network, no access: the rank-0 start reports it
        return [], f"the safetensors files of {path} could not be had ({str(exc).strip().splitlines()[0]})"


def weights_source(path: str, model: PreTrainedModel) -> WeightFiles | str:
    """The files to read each weight of ``model`` (a meta-device shell, not yet sharded) from by shard, or the
    reason they cannot be: every weight to fill (all but a tied second name and LoRA's adapters) must be in the
    files, under its own name or the one transformers renames on load, with its shape, or be a stack of experts."""
    from safetensors import safe_open

    files, why = _local_files(path)
    if not files:
        return why
    shapes: dict[str, tuple[int, ...]] = {}
    located: dict[str, Path] = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as opened:
                held = opened.keys()  # a safetensors file is not iterable itself
                for name in held:
                    shapes[name] = tuple(opened.get_slice(name).get_shape())
                    located[name] = f
    except Exception as exc:  # a damaged file: the whole read by from_pretrained then says what is wrong with it
        return f"its files cannot be read by shard ({str(exc).strip().splitlines()[0]})"
    loads = _loaded_as(model, list(shapes))
    if isinstance(loads, str):
        return loads
    renamed, stacked = loads
    tied = tied_names(model)
    state = model.state_dict()
    wanted = [file_name(k) for k in state if k not in tied and not is_adapter(k)]
    missing = [k for k in wanted if k not in renamed and k not in stacked]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"its files name its weights differently ({', '.join(missing[:3])}{more} not found)"
    model_shapes = {file_name(k): tuple(v.shape) for k, v in state.items()}
    wrong = [k for k in wanted if k in renamed and shapes[renamed[k]] != model_shapes[k]]
    for key in (k for k in wanted if k in stacked):
        parts = [[shapes[n] for n in names] for names in stacked[key]]
        if _stacked_shape(parts) != model_shapes[key]:
            wrong.append(key)
    if wrong:
        return f"its files hold other shapes for {', '.join(wrong[:3])}"
    names = {k: renamed[k] for k in wanted if k in renamed}
    stacks = {k: stacked[k] for k in wanted if k in stacked}
    return WeightFiles(tuple(files), names, stacks, {n: located[n] for s in stacks.values() for p in s for n in p})


def _stacked_shape(parts: list[list[tuple[int, ...]]]) -> tuple[int, ...] | None:
    """The shape of experts stacked along a new first dimension, each expert's sources joined along their first: the
    weight transformers builds on load (``MergeModulelist(dim=0)``, then ``Concatenate(dim=1)``); ``None`` when the
    parts do not stack."""
    if not parts or len({len(p) for p in parts}) != 1 or any(len(set(p)) != 1 for p in parts):
        return None
    firsts = [p[0] for p in parts]
    if len({f[1:] for f in firsts}) != 1:
        return None
    return (len(parts[0]), sum(f[0] for f in firsts), *firsts[0][1:])


def _loaded_as(
    model: PreTrainedModel, file_keys: list[str]
) -> tuple[dict[str, str], dict[str, tuple[tuple[str, ...], ...]]] | str:
    """Which weight of ``model`` each of the files' tensors becomes when transformers loads them, by transformers'
    own conversion table for the model: the weights read as stored (their name in the files, the same or renamed),
    and the stacks of experts (for each source, the files' names in the order transformers stacks them). The reason
    they cannot be read by shard when a conversion does more than that."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # a transformers without a conversion table loads the files' names as they are
        return {k: k for k in file_keys}, {}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    renamed: dict[str, str] = {}
    sources: dict[str, dict[str, list[str]]] = {}  # weight -> source pattern -> the files' names, in load order
    converter_of: dict[str, WeightConverter] = {}
    for key in sorted(file_keys, key=dot_natural_key):  # the order transformers collects them in
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if target not in meta and key in meta:  # as transformers does: a name it renamed in vain stays as stored
            target, pattern = key, None
        if target not in meta:
            continue  # a tensor the model does not hold (transformers drops it too)
        if pattern is None:
            renamed[target] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            steps = ", ".join(name for name, _ in ops)
            return f"its files are converted on load in a way not read by shard ({target}: {steps})"
        converter_of[target] = converter
        sources.setdefault(target, {}).setdefault(pattern, []).append(key)
    stacked = {
        target: tuple(tuple(by_pattern.get(p, ())) for p in converter_of[target].source_patterns)
        for target, by_pattern in sources.items()
    }
    return renamed, stacked


def read_own_shard(model: PreTrainedModel, source: WeightFiles) -> int:
    """Fill this rank's shard of every weight of the sharded ``model`` (storage already on its device) from
    ``source``'s files, reading only the slices the shard holds, cast to the model's dtype; returns the bytes read
    from the files. A collective."""
    import torch.distributed.checkpoint as dcp

    class Counted(dcp.HuggingFaceStorageReader):
        read = 0

        def _process_read_request(self, f: safe_open, req: ReadItem, planner: LoadPlanner) -> None:
            sliced = f.get_slice(req.storage_index.fqn)
            Counted.read += math.prod(req.lengths) * _DTYPE_BYTES[sliced.get_dtype()]
            super()._process_read_request(f, req, planner)

    state = model.state_dict()
    wanted = {source.names[file_name(k)]: v for k, v in state.items() if file_name(k) in source.names}
    folder = Path(tempfile.mkdtemp(prefix="raytrain-eks-weights-"))
    try:  # the reader takes every safetensors file of a folder: only the model's own, by link
        for f in source.files:
            (folder / f.name).symlink_to(f.resolve())
        dcp.load(wanted, storage_reader=Counted(str(folder)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stacks = {k: v for k, v in state.items() if file_name(k) in source.stacked}
    return Counted.read + _read_stacked(stacks, source)


def _read_stacked(weights: dict[str, torch.Tensor], source: WeightFiles) -> int:
    """Fill this rank's shard of each stack of experts in ``weights`` (name -> sharded tensor) from the experts'
    tensors in the files, reading only the experts the shard holds; returns the bytes read."""
    from contextlib import ExitStack

    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    read = 0
    with ExitStack() as stack, torch.no_grad():
        opened: dict[Path, safe_open] = {}

        def tensor(name: str) -> torch.Tensor:
            nonlocal read
            f = source.located[name]
            if f not in opened:
                opened[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            got = opened[f].get_tensor(name)
            read += got.numel() * got.element_size()
            return got

        for key, weight in weights.items():
            sources = source.stacked[file_name(key)]
            if isinstance(weight, DTensor):
                local = weight.to_local()
                shape, offset = compute_local_shape_and_global_offset(
                    weight.shape, weight.device_mesh, weight.placements
                )
            else:
                local, shape, offset = weight, tuple(weight.shape), (0,) * weight.dim()
            inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
            for i in range(shape[0]):  # the experts of this shard only
                expert = torch.cat([tensor(names[offset[0] + i]) for names in sources], dim=0)
                local[i].copy_(expert[inner])
    return read


def files_bytes(source: WeightFiles) -> int:
    """The size of the model's weight files."""
    return sum(f.stat().st_size for f in source.files)


# Bytes per element of the dtypes safetensors names (its header's names).
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_DTYPE_BYTES.update({"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1})


def computed_buffers(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's non-persistent buffers (rotary frequencies and the like: in no state dict, so in no file), computed
    on the CPU by the model's own ``_init_weights`` as ``from_pretrained`` computes them. Call on the meta shell
    before sharding; :func:`restore_buffers` puts them back after the storage is made."""
    values: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        own = [b for b in module._non_persistent_buffers_set if module._buffers.get(b) is not None]
        if not own:
            continue
        for b in own:
            module._buffers[b] = torch.empty_like(module._buffers[b], device="cpu")
        with torch.no_grad():
            model._init_weights(module)
        for b in own:
            values[f"{prefix}.{b}" if prefix else b] = module._buffers[b]
    return values


def take_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The weights of a loaded ``model``, taken out of it for rank 0 to send: its state dict and the buffers outside
    it (rotary frequencies), the loaded tensors themselves where they are (the CPU), not a copy. ``model`` is left
    holding none, its parameters and buffers on the meta device like a
    :func:`~raytrain_eks.train.model.load_model_shell`'s, to be sharded and filled like one.

    Example::

        model = load_model(path, activation_checkpointing=False)
        weights = take_weights(model)       # the one copy of the weights, on the CPU
        shard_model(model, ...)
        fill_from_rank0(model, weights, device)
    """
    weights = model.state_dict()  # detached views: the loaded storage
    weights.update((k, b.detach()) for k, b in model.named_buffers() if k not in weights)
    made: dict[int, torch.Tensor] = {}  # a tensor held under two names (tied embeddings) stays one
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                setattr(module, name, made[id(param)])
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, made.setdefault(id(buffer), buffer.to("meta")))
    return weights


def restore_buffers(model: PreTrainedModel, values: dict[str, torch.Tensor]) -> None:
    """Copy :func:`computed_buffers`'s values into the model's buffers (now on their device)."""
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in values.items():
            buffers[name].copy_(value)


def initial_adapters(model: PreTrainedModel, seed: int) -> dict[str, torch.Tensor]:
    """LoRA's adapters as they start, full size on the CPU, drawn from ``seed`` by peft's own initialisation
    (``reset_lora_parameters``): the same values on every rank, whether its model holds real weights or is a meta
    shell (whose adapters hold none). Empty for a model without adapters."""
    import copy

    from peft.tuners.lora import LoraLayer

    from raytrain_eks.train.lora import lora_of

    config = lora_of(model)
    if config is None:
        return {}
    values: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for prefix, module in model.named_modules():
            if not isinstance(module, LoraLayer) or ADAPTER_NAME not in module.lora_A:
                continue
            held = module.lora_A, module.lora_B
            twins = [copy.deepcopy(part).to_empty(device="cpu") for part in held]
            try:
                module.lora_A, module.lora_B = twins
                module.reset_lora_parameters(ADAPTER_NAME, config.init_lora_weights)
            finally:
                module.lora_A, module.lora_B = held
            for part, twin in zip(("lora_A", "lora_B"), twins, strict=True):
                for key, tensor in twin[ADAPTER_NAME].state_dict().items():
                    values[f"{prefix}.{part}.{ADAPTER_NAME}.{key}"] = tensor
    return values


def set_full_values(model: PreTrainedModel, values: dict[str, torch.Tensor]) -> None:
    """Give the (sharded) model's parameters named in ``values`` those full-size values; each rank keeps its shard.
    Every rank holds the same ``values``, so nothing is sent."""
    if not values:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict[str, ValueType] = dict(values)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
