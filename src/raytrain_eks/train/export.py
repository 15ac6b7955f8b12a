"""Export a sharded checkpoint to a Hugging Face model folder, a bounded group of tensors at a time.

The export never builds the model: it reads the architecture from the checkpoint's ``hf/config.json`` (a model
on the meta device gives the tensor names, shapes and which weights are tied), plans the safetensors files, and
then fills them group by group: each group's tensors are loaded from the DCP shards in the exported dtype
(``torch.distributed.checkpoint`` casts as it copies), written to their file, and freed before the next group.
Peak memory is about one group plus the largest saved chunk of one tensor, whatever the model's size.

The folder holds what ``save_pretrained`` writes: ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors``
files and ``model.safetensors.index.json`` above ``max_shard_bytes``), ``config.json``,
``generation_config.json``, the tokenizer when the checkpoint has one, and :data:`EXPORT_MARKER`.

A checkpoint in remote storage (``s3://...``) is read without downloading it whole: only ``.metadata``,
``hf/`` and the byte ranges of the model's tensors are copied (into sparse local files), never the optimizer's.

Example::

    export_hf("runs/my-run", Path("my-model"))                          # newest complete checkpoint, fp32
    export_hf("s3://bucket/runs/my-run/ray/checkpoint_00000100", Path("m"), dtype="bfloat16")
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from raytrain_eks.errors import UserError
from raytrain_eks.train.checkpoint import EXPORT_MARKER, HF_DIR, resolve_checkpoint
from raytrain_eks.train.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_key, base_weight_of, is_adapter
from raytrain_eks.train.storage import copy_ranges, is_remote
from raytrain_eks.train.storage import filesystem as _fs

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class AdapterConfig(TypedDict, total=False):
    """The fields of peft's ``adapter_config.json`` (its ``LoraConfig``) that the export reads."""

    r: int
    lora_alpha: float
    use_rslora: bool
    use_dora: bool
    base_model_name_or_path: str | None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# safetensors' names of the dtypes a model's tensors may have.
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
# One safetensors file holds at most this many bytes of tensors (a larger single tensor gets a file alone).
MAX_SHARD_BYTES = 5 * 10**9
# Tensors loaded together: one read of the checkpoint's metadata per group, and at most this much held at once
# (a larger single tensor forms a group alone).
GROUP_BYTES = 64 * 2**20
_DCP_PREFIX = "model."  # the model's tensors are saved under "model" (train.checkpoint.save_sharded)


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    nbytes: int


def export_hf(
    checkpoint: str | Path,
    out_dir: Path,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = MAX_SHARD_BYTES,
    group_bytes: int = GROUP_BYTES,
    adapter_only: bool = False,
    base: str | None = None,
) -> Path:
    """Gather the sharded weights of ``checkpoint`` into one Hugging Face model folder (safetensors + tokenizer).

    ``checkpoint`` may be a run folder or a checkpoint, local or ``s3://``. Runs in a single process with no
    process group, holding about ``group_bytes`` of weights at a time. ``out_dir`` is replaced as a whole, so it
    must be new, empty, or an earlier export (a folder holding :data:`EXPORT_MARKER`, which every export writes);
    anything else, a downloaded model included, is refused before any work. Returns ``out_dir``.

    A LoRA checkpoint (adapters only) is merged into its base model (``base``: a model folder or Hub id; default:
    the base its ``adapter_config.json`` names), a group of tensors at a time, into a plain model folder; with
    ``adapter_only`` the adapters alone are written as a peft adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``) that ``PeftModel.from_pretrained`` loads onto the base.
    """
    if dtype not in DTYPES:
        raise UserError(f"export dtype {dtype!r} is not supported; use {' or '.join(DTYPES)}")
    out_dir = out_dir.expanduser().resolve()
    check_export_target(out_dir)
    source = resolve_checkpoint(checkpoint)
    with tempfile.TemporaryDirectory(prefix="raytrain-eks-export-") as tmp:
        local = _model_files(source, Path(tmp) / "checkpoint")
        lora = _adapters(local)
        if adapter_only and lora is None:
            raise UserError(
                f"--adapter-only: checkpoint {source} is a full fine-tune (training.method full); it has no adapters",
                hint="Leave out --adapter-only to export the model.",
            )
        load: Callable[[list[_Entry], torch.dtype], dict[str, torch.Tensor]]
        if lora is None:
            load = functools.partial(_load_group, local)
        elif adapter_only:
            return _export_adapters(local, out_dir, DTYPES[dtype], lora, source=source)
        else:
            load = _merging_loader(local, lora, _base_folder(base or lora.get("base_model_name_or_path")))
        return _export_local(
            local, out_dir, DTYPES[dtype], source=source, max_shard=max_shard_bytes, group=group_bytes, load=load
        )


def check_export_target(out_dir: Path) -> None:
    """Raise :class:`UserError` unless ``out_dir`` is new, an empty folder, or a folder an earlier export wrote."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        what = "not a folder"
    elif any(out_dir.iterdir()) and not (out_dir / EXPORT_MARKER).is_file():
        what = f"not an earlier export (it has no {EXPORT_MARKER})"
    else:
        return
    raise UserError(
        f"{out_dir} already exists and is {what}; the export replaces the whole folder, so it is left untouched",
        hint="Give a new folder, or one an earlier `raytrain-eks export` wrote.",
    )


def _model_files(location: str, into: Path) -> Path:
    """A local folder DCP can read the model's tensors from: ``location`` itself when local.

    From remote storage: ``.metadata`` and ``hf/`` whole, and of each shard file only the byte ranges holding
    model tensors, written at their own offsets into a sparse file of the shard's size (the rest, the optimizer
    state, is neither downloaded nor stored).
    """
    if not is_remote(location):
        return Path(location).expanduser().resolve()
    from pyarrow import fs as pafs
    from torch.distributed.checkpoint import FileSystemReader

    fs, base = _fs(location)
    local = pafs.LocalFileSystem()
    (into / HF_DIR).mkdir(parents=True)
    pafs.copy_files(f"{base}/{HF_DIR}", str(into / HF_DIR), source_filesystem=fs, destination_filesystem=local)
    pafs.copy_files(f"{base}/.metadata", str(into / ".metadata"), source_filesystem=fs, destination_filesystem=local)
    storage = FileSystemReader(str(into)).read_metadata().storage_data
    model_part = (
        (info.relative_path, info.offset, info.length)
        for index, info in storage.items()
        if index.fqn.startswith(_DCP_PREFIX)
    )
    copy_ranges(location, into, model_part)
    return into


def _meta_model(hf: Path, dtype: torch.dtype) -> PreTrainedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _entries(model: torch.nn.Module, dtype: torch.dtype) -> list[_Entry]:
    """The tensors a Hugging Face folder of ``model`` holds: its state dict, a tied weight once (its first name)."""
    seen: set[int] = set()
    entries = []
    size = torch.empty((), dtype=dtype).element_size()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        entries.append(_Entry(name, tuple(tensor.shape), tensor.numel() * size))
    return entries


def _split(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Consecutive runs of ``entries`` of at most ``limit`` bytes each (an entry larger than that alone)."""
    parts: list[list[_Entry]] = []
    total = 0
    for entry in entries:
        if not parts or (total + entry.nbytes > limit and parts[-1]):
            parts.append([])
            total = 0
        parts[-1].append(entry)
        total += entry.nbytes
    return parts


def _header(entries: list[_Entry], dtype: torch.dtype) -> bytes:
    """A safetensors header (length prefix + JSON, padded to 8 bytes) for ``entries`` laid out in order."""
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        meta[entry.name] = {
            "dtype": _ST_DTYPE[dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _load_group(checkpoint: Path, entries: list[_Entry], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of ``entries``, read from the DCP checkpoint and cast to ``dtype`` as they are copied."""
    import torch.distributed.checkpoint as dcp

    if not entries:
        return {}
    state = {"model": {e.name: torch.empty(e.shape, dtype=dtype) for e in entries}}
    with warnings.catch_warnings():  # loading in one process, without a process group, is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state["model"]


Loader = Callable[[list[_Entry], torch.dtype], dict[str, torch.Tensor]]


def _write_shards(
    load: Loader, folder: Path, entries: list[_Entry], dtype: torch.dtype, *, max_shard: int, group: int
) -> None:
    shards = _split(entries, max_shard)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for name, shard in zip(names, shards, strict=True):
        with open(folder / name, "wb") as f:
            f.write(_header(shard, dtype))
            for part in _split(shard, group):
                tensors = load(part, dtype)
                for entry in part:
                    data = tensors.pop(entry.name).contiguous().reshape(-1).view(torch.uint8)
                    f.write(data.numpy().data)
                    del data
    if len(shards) > 1:
        index = {
            "metadata": {
                "total_size": sum(e.nbytes for e in entries),
                "total_parameters": sum(e.nbytes for e in entries) // torch.empty((), dtype=dtype).element_size(),
            },
            "weight_map": {e.name: name for name, shard in zip(names, shards, strict=True) for e in shard},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _export_local(
    checkpoint: Path, out_dir: Path, dtype: torch.dtype, *, source: str, max_shard: int, group: int, load: Loader
) -> Path:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    hf = checkpoint / HF_DIR
    model = _meta_model(hf, dtype)
    staging = _staging(out_dir)
    _write_shards(load, staging, _entries(model, dtype), dtype, max_shard=max_shard, group=group)
    model.config.save_pretrained(staging)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    return _finish(staging, out_dir, hf, source=source, dtype=dtype)


def _staging(out_dir: Path) -> Path:
    """A new, empty folder beside ``out_dir`` that becomes it once complete (:func:`_finish`)."""
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _finish(staging: Path, out_dir: Path, hf: Path, *, source: str, dtype: torch.dtype, **extra: object) -> Path:
    """The tokenizer and :data:`EXPORT_MARKER` into ``staging``, then ``staging`` in the place of ``out_dir``."""
    from transformers import AutoTokenizer

    if (hf / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(hf).save_pretrained(staging)
    name = str(dtype).removeprefix("torch.")
    marker = {"checkpoint": str(source), "dtype": name, "time": datetime.now(UTC).isoformat(timespec="seconds")}
    (staging / EXPORT_MARKER).write_text(json.dumps({**marker, **extra}, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return out_dir


# --------------------------------------------------------------------------------------------- LoRA checkpoints


def _adapters(checkpoint: Path) -> AdapterConfig | None:
    """The checkpoint's ``adapter_config.json`` (peft's), or ``None`` for a full fine-tune."""
    path = checkpoint / HF_DIR / ADAPTER_CONFIG
    return json.loads(path.read_text()) if path.is_file() else None


def _adapter_entries(checkpoint: Path, dtype: torch.dtype) -> list[_Entry]:
    """The adapters' tensors in the checkpoint (names as the adapted model has them), from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    size = torch.empty((), dtype=dtype).element_size()
    entries = []
    for fqn, meta in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.items():
        name = fqn.removeprefix(_DCP_PREFIX)
        if fqn.startswith(_DCP_PREFIX) and is_adapter(name) and isinstance(meta, TensorStorageMetadata):
            shape = tuple(meta.size)
            entries.append(_Entry(name, shape, math.prod(shape) * size))
    if not entries:
        raise UserError(f"checkpoint {checkpoint} names LoRA adapters but holds none: it is damaged")
    return entries


def _base_folder(base: str | None) -> Path:
    """The base model's local folder for a merge: a model folder as it is, a Hub id or builtin: name resolved as
    a run resolves it (from the Hugging Face cache, or downloaded)."""
    from raytrain_eks.train.model_source import resolve_model_path

    if not base:
        raise UserError(
            "the LoRA checkpoint does not name its base model", hint="Give it: raytrain-eks export ... --base MODEL"
        )
    return Path(resolve_model_path(base))


class _BaseWeights:
    """The base model's weights by name, one tensor at a time from its safetensors files; a model whose files
    name their tensors otherwise than the model does (transformers converts some on loading) is loaded whole."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self._where = {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(folder / "model.safetensors", "pt") as f:
                self._where = dict.fromkeys(f.keys(), folder / "model.safetensors")
        else:
            self._where = {}
        self._whole: dict[str, torch.Tensor] | None = None

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name in self._where:
            with safe_open(self._where[name], "pt") as f:
                tensor: torch.Tensor = f.get_tensor(name)
                return tensor
        if self._whole is None:
            from transformers import AutoModelForCausalLM

            whole = AutoModelForCausalLM.from_pretrained(self._folder, dtype=torch.float32)
            self._whole = dict(whole.state_dict())
        if name not in self._whole:
            raise UserError(f"the base model in {self._folder} has no weight {name!r}: it is not the run's base")
        return self._whole[name]


def _merging_loader(checkpoint: Path, lora: AdapterConfig, base: Path) -> Loader:
    """A loader of the merged weights: each base weight, plus ``alpha / r * B @ A`` where it has adapters."""
    if lora.get("use_rslora") or lora.get("use_dora"):
        raise UserError("the checkpoint's adapters use rsLoRA or DoRA, which this export does not merge")
    scale = float(lora["lora_alpha"]) / float(lora["r"])
    adapters = {e.name: e for e in _adapter_entries(checkpoint, torch.float32)}
    pairs: dict[str, tuple[_Entry, _Entry]] = {}
    for name, entry in adapters.items():
        if ".lora_A." in name:
            pairs[base_weight_of(name)] = (entry, adapters[name.replace(".lora_A.", ".lora_B.")])
    weights = _BaseWeights(base)

    def load(entries: list[_Entry], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        wanted = [ab for e in entries if e.name in pairs for ab in pairs[e.name]]
        factors = _load_group(checkpoint, wanted, torch.float32)
        out = {}
        for entry in entries:
            weight = weights.get(entry.name).to(torch.float32)
            if tuple(weight.shape) != entry.shape:
                raise UserError(
                    f"the base model in {base} has {entry.name} of shape {tuple(weight.shape)}, the checkpoint's "
                    f"model {entry.shape}: it is not the run's base"
                )
            if entry.name in pairs:
                a, b = pairs[entry.name]
                weight = weight.addmm(factors.pop(b.name), factors.pop(a.name), alpha=scale)
            out[entry.name] = weight.to(dtype)
        return out

    return load


def _export_adapters(checkpoint: Path, out_dir: Path, dtype: torch.dtype, lora: AdapterConfig, *, source: str) -> Path:
    """The adapters alone as a peft adapter folder, named as peft names them."""
    from safetensors.torch import save_file

    entries = _adapter_entries(checkpoint, dtype)
    tensors = _load_group(checkpoint, entries, dtype)
    staging = _staging(out_dir)
    save_file({adapter_key(k): v.contiguous() for k, v in tensors.items()}, staging / ADAPTER_WEIGHTS, {"format": "pt"})
    (staging / ADAPTER_CONFIG).write_text(json.dumps(lora, indent=2, sort_keys=True) + "\n")
    return _finish(staging, out_dir, checkpoint / HF_DIR, source=source, dtype=dtype, adapter_only=True)
