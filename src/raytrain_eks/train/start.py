"""Where a sharded model's weights come from at start, so that no rank holds more than its shard.

Every rank builds the model on the meta device (:func:`~raytrain_eks.train.model.load_model_shell`: shapes, no
memory), the model is sharded, and then each rank fills only its own shard:

- ``own-shard``: each rank reads, from the model's safetensors files, only the slices of every weight that its shard
  holds (DCP's Hugging Face reader, which reads a slice of a memory-mapped file): the start of a fresh run;
- ``checkpoint``: nothing is read from the model's files at all; the resume fills every weight from the run's
  checkpoint (a full fine-tune's checkpoint holds them all);
- ``rank0``: rank 0 reads the whole model and sends each rank its shard (the fallback when the files cannot be read
  by shard: no safetensors, or names or shapes that differ from the model's, as in checkpoints transformers converts
  while loading). The run says why.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raytrain_eks.train.checkpoint import tied_names
from raytrain_eks.train.lora import ADAPTER_NAME, is_adapter

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
_BASE_LAYER = ".base_layer."  # peft's name for the layer it adapts: the model's own files name it without this


@dataclass(frozen=True)
class WeightFiles:
    """The safetensors files that hold the model's weights, and the names in them of the weights to read."""

    files: tuple[Path, ...]
    names: frozenset[str]  # as the files name them (an adapted layer's weight without peft's ``base_layer``)


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


def weights_source(path: str, model: Any) -> WeightFiles | str:
    """The files to read each weight of ``model`` (a meta-device shell, not yet sharded) from by shard, or the
    reason they cannot be: every weight to fill (all but a tied second name and LoRA's adapters) must be in the
    files under its own name with its own shape."""
    from safetensors import safe_open

    files, why = _local_files(path)
    if not files:
        return why
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as opened:
                held = opened.keys()  # a safetensors file is not iterable itself
                for name in held:
                    shapes[name] = tuple(opened.get_slice(name).get_shape())
    except Exception as exc:  # a damaged file: the whole read by from_pretrained then says what is wrong with it
        return f"its files cannot be read by shard ({str(exc).strip().splitlines()[0]})"
    tied = tied_names(model)
    state = model.state_dict()
    names = {key: file_name(key) for key in state if key not in tied and not is_adapter(key)}
    missing = [n for n in names.values() if n not in shapes]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return f"its files name its weights differently ({', '.join(missing[:3])}{more} not found)"
    wrong = [n for k, n in names.items() if shapes[n] != tuple(state[k].shape)]
    if wrong:
        return f"its files hold other shapes for {', '.join(wrong[:3])}"
    return WeightFiles(tuple(files), frozenset(names.values()))


def read_own_shard(model: Any, source: WeightFiles) -> int:
    """Fill this rank's shard of every weight of the sharded ``model`` (storage already on its device) from
    ``source``'s files, reading only the slices the shard holds, cast to the model's dtype; returns the bytes read
    from the files. A collective."""
    import torch.distributed.checkpoint as dcp

    class Counted(dcp.HuggingFaceStorageReader):
        read = 0

        def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
            sliced = f.get_slice(req.storage_index.fqn)
            Counted.read += math.prod(req.lengths) * _DTYPE_BYTES[sliced.get_dtype()]
            super()._process_read_request(f, req, planner)

    wanted = {file_name(k): v for k, v in model.state_dict().items() if file_name(k) in source.names}
    folder = Path(tempfile.mkdtemp(prefix="raytrain-eks-weights-"))
    try:  # the reader takes every safetensors file of a folder: only the model's own, by link
        for f in source.files:
            (folder / f.name).symlink_to(f.resolve())
        dcp.load(wanted, storage_reader=Counted(str(folder)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return Counted.read


def files_bytes(source: WeightFiles) -> int:
    """The size of the model's weight files."""
    return sum(f.stat().st_size for f in source.files)


# Bytes per element of the dtypes safetensors names (its header's names).
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_DTYPE_BYTES.update({"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1})


def computed_buffers(model: Any) -> dict[str, torch.Tensor]:
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


def restore_buffers(model: Any, values: dict[str, torch.Tensor]) -> None:
    """Copy :func:`computed_buffers`'s values into the model's buffers (now on their device)."""
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in values.items():
            buffers[name].copy_(value)


def initial_adapters(model: Any, seed: int) -> dict[str, torch.Tensor]:
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


def set_full_values(model: Any, values: dict[str, torch.Tensor]) -> None:
    """Give the (sharded) model's parameters named in ``values`` those full-size values; each rank keeps its shard.
    Every rank holds the same ``values``, so nothing is sent."""
    if not values:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict[str, Any] = dict(values)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
