"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): writing, finding, pruning and reading them.

A checkpoint folder ``checkpoint_<step>`` holds:

- the DCP shards and ``.metadata`` of the model and optimizer state (each rank writes its share as
  :data:`FILES_PER_RANK` files of about equal size);
- ``trainer_rank<r>.pt`` per rank: step, LR-scheduler state, data position and RNG state;
- ``hf/``: the model's ``config.json`` and tokenizer (from rank 0), so export (:mod:`.export`) needs nothing else;
- ``complete.json``, written last, once every rank's files are in place. A folder without it was cut short
  (a process died while writing) and is never taken as a checkpoint to resume from.

Example::

    save_sharded(folder, model=model, optimizer=opt, scheduler=sched, step=50, data_position=pos, rank=r, ...)
    latest_complete(checkpoint_root(run_dir, None))   # the newest complete checkpoint, or None
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from raytrain_eks.errors import UserError
from raytrain_eks.train.storage import copy_ranges, is_remote, join
from raytrain_eks.train.storage import filesystem as _fs

if TYPE_CHECKING:  # torch is imported where it is used: the driver's checks before a run read no tensor
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.checkpoint.state_dict import OptimizerStateType, StateDictOptions, ValueType
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PretrainedConfig, PreTrainedModel

    from raytrain_eks.train.lora import AdapterSettings

MARKER = "complete.json"
# Written into every exported model folder (by .export): only a folder holding it may be replaced by a later export.
EXPORT_MARKER = ".raytrain-eks-export"
HF_DIR = "hf"
RAY_DIR = "ray"  # Ray Train's storage folder (its run name) in a run's storage root: the checkpoints live there
# Ray Train's own list of the checkpoints reported to it, in its storage folder (Ray 2.60's file name).
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
_NAME = re.compile(r"^checkpoint_(\d+)$")
# The start of the name of every temporary folder a worker makes (a checkpoint's share it downloads to resume
# from, one it stages to save); each also names the worker's process id, so those of dead workers are found.
TEMP_PREFIX = "raytrain-eks-"
# Each rank writes its share of a checkpoint as this many files (on as many threads), so storage moves a rank's
# files in parallel (an upload or download copies several files at once) and no single object grows to a rank's
# whole share (1.6 GB at 250 M parameters with AdamW on 2 ranks; 9 GB per rank of Qwen2.5-1.5B on 2).
FILES_PER_RANK = 4
# Architecture fields that must agree between a checkpoint and the model it is loaded into.
_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def checkpoint_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


@dataclass
class TrainerState:
    """What a resume needs besides the state :func:`load_sharded` restores in place (weights, optimizer, schedule)."""

    step: int
    data: dict[str, int] = field(default_factory=dict)
    # From remote storage: the bytes this rank downloaded, and the checkpoint's size (0 and 0 when local).
    read_bytes: int = 0
    checkpoint_bytes: int = 0

    @property
    def note(self) -> str:
        """A line for the user on what a resume from remote storage downloaded ("" when the checkpoint was local)."""
        if not self.checkpoint_bytes:
            return ""
        return (
            f"resume: read {self.read_bytes / 1e6:.1f} MB of the checkpoint's {self.checkpoint_bytes / 1e6:.1f} MB "
            "(this rank's share)"
        )


def save_sharded(
    folder: Path,
    *,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    step: int,
    data_position: dict[str, int],
    rank: int,
    tokenizer_path: str | None,
    chat_template: str | None = None,
    background: ProcessGroup | None = None,
    stager: DefaultStager | None = None,
) -> Future[None] | None:
    """Write this rank's part of the checkpoint of ``step`` into ``folder`` (a collective: every rank calls it).
    The tokenizer goes into ``hf/`` with ``chat_template`` (the run's own, when it has one), so an export renders
    conversations as training did.

    With ``background`` (a gloo process group of all ranks, kept for this), the model and optimizer state are
    copied now and written by DCP's asynchronous save on a thread of its own, whose collectives use that group;
    the future of that write is returned and training may change the weights meanwhile. ``stager``
    (:func:`checkpoint_stager`) makes that copy into host buffers kept from one save to the next; the caller lets a
    save's write finish before the next save stages into them. The trainer state and ``hf/`` are written before this
    returns either way."""
    import torch.distributed.checkpoint as dcp

    from raytrain_eks.train.faults import checkpoint_writer
    from raytrain_eks.train.lora import lora_of

    folder.mkdir(parents=True, exist_ok=True)
    lora = lora_of(model)
    model_sd, optim_sd, _ = _saved_state(model, optimizer)
    writer = checkpoint_writer(str(folder), thread_count=FILES_PER_RANK)
    state = {"model": model_sd, "optim": optim_sd}
    written: Future[None] | None = None
    if background is None:
        dcp.save(state, storage_writer=writer)
    else:
        response = dcp.async_save(state, storage_writer=writer, process_group=background, async_stager=stager)
        written = response if isinstance(response, Future) else response.upload_completion
    save_trainer_state(folder, rank=rank, step=step, scheduler=scheduler, data_position=data_position)
    if rank == 0:
        hf = folder / HF_DIR
        model.config.save_pretrained(hf)
        if lora is not None:  # the adapters' settings, as peft writes them (the base is named, never saved)
            lora.save_pretrained(str(hf))
        if tokenizer_path:
            from raytrain_eks.train.data.encoding import encoding_tokenizer

            encoding_tokenizer(tokenizer_path, chat_template).save_pretrained(hf)
    return written


def checkpoint_stager(device: torch.device) -> DefaultStager:
    """DCP's stager (torch's ``DefaultStager``) for :func:`save_sharded`'s background saves: it copies the state into
    host memory it keeps, by the storage it was copied from, and copies into the same buffers at every later save, so
    no save allocates (or, on CUDA, pins) host memory again. On CUDA the buffers are pinned and the copies
    non-blocking, waited for once at the end of the staging, so the copy from the GPU runs at the bus's speed without
    a bounce through pageable memory; pinned memory and non-blocking copies need CUDA (torch's ``StagingOptions``).
    The staging runs on the calling thread (``use_async_staging`` off): the weights must not change while they are
    copied, and the step after a save changes them. Close it (``close()``) after the run's last save is written."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device.type == "cuda"
    options = StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )
    return DefaultStager(options)


def tied_names(model: torch.nn.Module) -> set[str]:
    """The second and later names of parameters that are one tensor (an output projection tied to the embedding):
    a checkpoint holds each such tensor once, under its first name, and loading that name fills them all."""
    seen: set[int] = set()
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def _saved_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, ValueType], OptimizerStateType, StateDictOptions]:
    """The model's and optimizer's state dicts as a checkpoint holds them, and the options to load them back with:
    a tied tensor once (:func:`tied_names`: 0.93 GB less per checkpoint of Qwen2.5-1.5B in fp32), and with LoRA
    the adapters only (the frozen base is the model the run started from, loaded again on resume; filtered by name
    too, as a frozen tied weight's second name escapes ``ignore_frozen_params``). Loading is not strict then: the
    names left out are filled through the tensors they share, or by the base."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from raytrain_eks.train.lora import is_adapter, lora_of

    adapted = lora_of(model) is not None
    tied = tied_names(model)
    options = StateDictOptions(ignore_frozen_params=adapted, strict=not (adapted or tied))
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    model_sd = {k: v for k, v in model_sd.items() if k not in tied and (is_adapter(k) or not adapted)}
    return model_sd, optim_sd, options


class SavedTrainerState(TypedDict):
    """A rank's trainer state as :func:`save_trainer_state` writes it."""

    step: int
    scheduler: dict[str, object]
    data: dict[str, int]
    rng: dict[str, torch.Tensor]  # "cpu", and "cuda" where a GPU was there


def _trainer_file(folder: Path, rank: int) -> Path:
    return folder / f"trainer_rank{rank:05d}.pt"


def save_trainer_state(
    folder: Path, *, rank: int, step: int, scheduler: LRScheduler, data_position: dict[str, int]
) -> None:
    """This rank's step, schedule, data position and RNG state: tensors and plain values only (see below)."""
    import torch

    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {"step": int(step), "scheduler": scheduler.state_dict(), "data": dict(data_position), "rng": rng}
    torch.save(state, _trainer_file(folder, rank))


def load_trainer_state(folder: Path, rank: int) -> SavedTrainerState:
    """This rank's trainer state from ``folder`` (rank 0's when the run had fewer ranks), read as data only.

    Checkpoints may come from shared storage, so the file is unpickled with ``weights_only=True``: tensors,
    numbers, strings and containers load; any other object (which could run code when unpickled) is refused
    with a :class:`UserError`.
    """
    import pickle

    import torch

    own = _trainer_file(folder, rank)
    path = own if own.exists() else _trainer_file(folder, 0)
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
        raise UserError(
            f"{path} holds objects other than tensors and plain values, so it is not loaded"
            + (f" ({detail})" if detail else ""),
            hint="A checkpoint written by raytrain-eks holds none: resume only from checkpoints of this tool, "
            "kept where only you can write.",
        ) from None


def mark_complete(folder: str | Path, *, step: int, world_size: int) -> None:
    """Write the marker that makes ``folder`` a usable checkpoint; call after every rank's files are in place."""
    fs, base = _fs(folder)
    body = (json.dumps({"step": step, "world_size": world_size, "time": time.time()}) + "\n").encode()
    tmp = f"{base}/.{MARKER}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(body)
    fs.move(tmp, f"{base}/{MARKER}")  # a rename on local disks: the marker appears whole or not at all


def load_sharded(
    location: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler, rank: int
) -> TrainerState:
    """Load model, optimizer, scheduler and RNG state of this rank from the checkpoint at ``location``; return the
    trainer state.

    A local checkpoint is read in place. From remote storage (``s3://...``) only what this rank reads is
    downloaded (:func:`_download_share`), into a temporary folder removed after the load; the returned state
    says how many bytes that was (:attr:`TrainerState.note`).
    """
    check_compatible(location, model.config, lora=_lora_settings(model))
    model_sd, optim_sd, options = _saved_state(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if not is_remote(location):
        return _load_local(Path(location).expanduser().resolve(), state, model, optimizer, scheduler, options, rank)
    folder = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}resume-r{rank}-p{os.getpid()}-"))
    try:
        read, total = _download_share(str(location), folder, state, rank)
        loaded = _load_local(folder, state, model, optimizer, scheduler, options, rank)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    loaded.read_bytes, loaded.checkpoint_bytes = read, total
    return loaded


def _load_local(
    folder: Path,
    state: STATE_DICT_TYPE,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    options: StateDictOptions,
    rank: int,
) -> TrainerState:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    # A resume on another world size has no file of this rank: take rank 0's step and schedule.
    extra = load_trainer_state(folder, rank)
    scheduler.load_state_dict(extra["scheduler"])
    if _trainer_file(folder, rank).exists():
        torch.set_rng_state(extra["rng"]["cpu"])
        if "cuda" in extra["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["rng"]["cuda"])
    return TrainerState(step=int(extra["step"]), data=extra["data"])


def _download_share(location: str, into: Path, state: STATE_DICT_TYPE, rank: int) -> tuple[int, int]:
    """Copy into ``into`` what loading ``state`` from the remote checkpoint ``location`` reads on this rank:
    ``.metadata``, this rank's trainer state (rank 0's when the run had fewer ranks), and of each shard file only
    the byte ranges of the items this rank's DCP load plan names (into sparse files: on as many ranks as saved
    it, about ``1 / ranks`` of the checkpoint). Returns (bytes downloaded, the checkpoint's bytes)."""
    from pyarrow import fs as pafs
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    fs, base = _fs(location)
    base = base.rstrip("/")
    try:
        listed = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except OSError as exc:
        raise UserError(
            f"cannot list checkpoint {location}: {str(exc).strip().splitlines()[0]}",
            hint="Check that this machine may read the checkpoint's storage (credentials, role, network).",
        ) from None
    sizes = {i.path[len(base) + 1 :]: i.size for i in listed if i.type == pafs.FileType.File}
    trainer = next((f.name for f in (_trainer_file(Path(), r) for r in (rank, 0)) if f.name in sizes), None)
    if ".metadata" not in sizes or trainer is None:
        raise UserError(
            f"checkpoint {location} lacks {'.metadata' if trainer else _trainer_file(Path(), 0).name}: it is damaged",
            hint="Resume from an older checkpoint beside it, or start the run again without --resume.",
        )
    read = copy_ranges(location, into, [(n, 0, sizes[n]) for n in (".metadata", trainer)])
    metadata = FileSystemReader(str(into)).read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, rank == 0)
    stored = [metadata.storage_data[item.storage_index] for item in planner.create_local_plan().items]
    read += copy_ranges(location, into, [(s.relative_path, s.offset, s.length) for s in stored])
    return read, sum(sizes.values())


def checkpoint_step(path: str) -> int | None:
    """The step of a checkpoint folder by its name (``.../checkpoint_00000040`` -> 40), else ``None``."""
    match = _NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def list_checkpoints(root: str | Path) -> list[tuple[int, str, bool]]:
    """(step, location, complete) for every ``checkpoint_*`` folder under ``root`` (a path or URI), oldest first."""
    from pyarrow import fs as pafs

    fs, base = _fs(root)
    try:
        children = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    except (OSError, ValueError):
        return []
    found = []
    for child in children:
        name = child.path.rstrip("/").rsplit("/", 1)[-1]
        m = _NAME.match(name)
        if m and child.type == pafs.FileType.Directory:
            location = join(root, name)
            found.append((int(m.group(1)), location, is_complete(location)))
    return sorted(found)


def is_complete(folder: str | Path) -> bool:
    from pyarrow import fs as pafs

    fs, base = _fs(folder)
    infos = fs.get_file_info([f"{base}/{MARKER}", f"{base}/.metadata", f"{base}/{HF_DIR}/config.json"])
    return all(i.type == pafs.FileType.File for i in infos)


def saved_world_size(folder: str | Path) -> int | None:
    """How many ranks wrote the complete checkpoint at ``folder`` (its marker says), or ``None`` when it does not."""
    try:
        return int(json.loads(_read_text(join(folder, MARKER)))["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_complete(root: str | Path) -> str | None:
    """The newest complete checkpoint under ``root``; folders cut short by a crash are skipped."""
    complete = [folder for _, folder, ok in list_checkpoints(root) if ok]
    return complete[-1] if complete else None


def prune(root: str | Path, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``, and cut-short ones older than those.

    Retention is done here rather than by Ray Train, whose bookkeeping after a worker-group restart can keep an
    extra checkpoint. Returns what was deleted.
    """
    found = list_checkpoints(root)
    complete = [step for step, _, ok in found if ok]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    doomed = [location for step, location, _ in found if step < oldest_kept]
    for location in doomed:
        fs, base = _fs(location)
        fs.delete_dir(base)
    return doomed


def forget_ray_snapshot(root: str | Path) -> None:
    """Delete Ray Train's checkpoint list from the run's Ray storage folder ``root``, when there is one.

    Which checkpoints exist is decided here (complete markers, :func:`prune`), and resuming takes its
    checkpoint from :func:`latest_complete`, never from Ray. Ray's list still names the checkpoints pruned
    since it was written, and a new ``TorchTrainer`` over the same folder refuses to start when one of them is
    gone. Call before starting a trainer that continues an earlier run (``train --resume``).
    """
    snapshot = join(root, RAY_SNAPSHOT)
    if _is_file(snapshot):
        fs, base = _fs(snapshot)
        fs.delete_file(base)


def _is_file(location: str | Path) -> bool:
    """Whether ``location`` (local or remote) is a file."""
    from pyarrow import fs as pafs

    fs, base = _fs(location)
    return fs.get_file_info(base).type == pafs.FileType.File


def _read_text(location: str | Path) -> str:
    fs, base = _fs(location)
    with fs.open_input_stream(base) as f:
        return f.read().decode()


def check_compatible(folder: str | Path, config: PretrainedConfig, *, lora: AdapterSettings | None = None) -> None:
    """Raise :class:`UserError` when the checkpoint in ``folder`` belongs to a model of another architecture, or
    to another method: ``lora`` is the run's adapters (``{"r", "target_modules"}``) or ``None`` for full
    fine-tuning, and must be what the checkpoint holds."""
    from raytrain_eks.train.lora import ADAPTER_CONFIG

    saved = json.loads(_read_text(join(join(folder, HF_DIR), "config.json")))
    current = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r}, model {current.get(k)!r}"
        for k in _ARCH_KEYS
        if saved.get(k) != current.get(k)
    ]
    hint = "Resume with the model the run was started with, or start a new run without --resume."
    if diffs:
        raise UserError(f"checkpoint {folder} is of a different model ({'; '.join(diffs)})", hint=hint)
    adapters_file = join(join(folder, HF_DIR), ADAPTER_CONFIG)
    had = json.loads(_read_text(adapters_file)) if _is_file(adapters_file) else None
    if (had is None) != (lora is None):
        what = "LoRA adapters on a frozen base" if had is not None else "a full fine-tune (every weight)"
        now = (
            "method lora (or dpo with training.dpo.adapters lora)"
            if lora is not None
            else "method full (or dpo with training.dpo.adapters none)"
        )
        raise UserError(
            f"checkpoint {folder} holds {what}, but this run is set to {now}",
            hint="Resume with the training.method (and training.lora, training.dpo.adapters) the run was started with.",
        )
    if had is not None and lora is not None:
        from raytrain_eks.train.lora import adapter_settings

        then = adapter_settings(had.get("r", 0), had.get("target_modules") or [])
        want = adapter_settings(lora["r"], lora["target_modules"])
        if then != want:
            raise UserError(
                f"checkpoint {folder} has LoRA rank {then['r']} on {', '.join(then['target_modules'])}, but this run "
                f"is set to rank {want['r']} on {', '.join(want['target_modules'])}",
                hint="Resume with the training.lora settings the run was started with.",
            )


def _lora_settings(model: torch.nn.Module) -> AdapterSettings | None:
    """The adapters :func:`check_compatible` compares: ``model``'s LoRA rank and targeted layers, or ``None``."""
    from raytrain_eks.train.lora import adapter_settings, lora_of

    lora = lora_of(model)
    return None if lora is None else adapter_settings(lora.r, lora.target_modules or [])


def storage_root(run_dir: Path, storage_path: str | None) -> str:
    """Where a run's Ray Train storage lives: ``storage_path/<run name>`` when set, else the run folder."""
    return join(storage_path, run_dir.name) if storage_path else str(run_dir)


RUN_CONFIG = "config.yaml"  # a run's configuration, in its run folder and beside its checkpoints in its storage


def write_storage_config(run_dir: Path, storage_path: str | None, text: str) -> None:
    """Put the run's ``config.yaml`` into its storage folder (when ``storage_path`` is set), beside its checkpoints,
    so that a machine without the run folder can continue the run: ``train --resume STORAGE_PATH/RUN``."""
    if not storage_path:
        return
    location = join(storage_root(run_dir, storage_path), RUN_CONFIG)
    try:
        fs, base = _fs(location)
        if not is_remote(location):
            fs.create_dir(base.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(base) as f:
            f.write(text.encode())
    except OSError as exc:
        raise UserError(
            f"training.storage_path {storage_path!r}: cannot write {location}: {str(exc).strip().splitlines()[0]}",
            hint="Check that the bucket or folder exists and that this machine may write there (credentials, role).",
        ) from None


def read_storage_config(location: str) -> str:
    """The ``config.yaml`` a run left in its storage folder ``location`` (see :func:`write_storage_config`)."""
    path = join(location, RUN_CONFIG)
    try:
        text = _read_text(path) if _is_file(path) else None
    except OSError as exc:  # no such bucket, no credentials, no network
        raise UserError(
            f"--resume {location!r}: cannot read {path}: {str(exc).strip().splitlines()[0]}",
            hint="Check the bucket name and that this machine may read it (credentials, role).",
        ) from None
    if text is None:
        raise UserError(
            f"--resume {location!r}: no {RUN_CONFIG} there, so it is not the storage folder of a raytrain-eks run",
            hint="Give the run's storage folder (training.storage_path followed by the run folder's name), or the "
            "run folder itself on the machine that has it.",
        )
    return text


def checkpoint_root(run_dir: Path, storage_path: str | None) -> str:
    """The folder (path or URI) holding a run's ``checkpoint_*`` folders: :data:`RAY_DIR` in its storage root."""
    return join(storage_root(run_dir, storage_path), RAY_DIR)


def _root_of_run(run_dir: Path) -> str | None:
    """The checkpoint root of a run folder, from its config.yaml (``training.storage_path``), if it has one."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    import yaml

    storage = ((yaml.safe_load(config.read_text()) or {}).get("training") or {}).get("storage_path")
    return checkpoint_root(run_dir.resolve(), storage) if storage else None


def resolve_checkpoint(path: str | Path) -> str:
    """A complete checkpoint from a checkpoint folder, a run folder or a storage folder (local path or URI).

    Raises :class:`UserError` naming what is wrong: nothing there, no checkpoint yet, or only incomplete ones.
    """
    from pyarrow import fs as pafs

    text = str(path) if is_remote(path) else str(Path(path).expanduser())
    fs, base = _fs(text)
    if fs.get_file_info(base).type == pafs.FileType.NotFound:
        raise UserError(
            f"{text} does not exist", hint="Give a run folder (runs/...) or one of its checkpoint_* folders."
        )
    if _NAME.match(text.rstrip("/").rsplit("/", 1)[-1]):
        if not is_complete(text):
            raise UserError(
                f"{text} is not a complete checkpoint (its writing was cut short or files are missing)",
                hint="Use an older checkpoint beside it, or the run folder to pick the newest complete one.",
            )
        return text
    roots = [join(text, RAY_DIR), text]
    if not is_remote(text):
        remote = _root_of_run(Path(text))
        if remote:
            roots.insert(0, remote)
    for root in roots:
        found = list_checkpoints(root)
        if found:
            latest = latest_complete(root)
            if latest is None:
                raise UserError(
                    f"{text} has {len(found)} checkpoint folder(s) but none is complete",
                    hint="The run died while writing its first checkpoint: start it again without --resume.",
                )
            return latest
    raise UserError(
        f"{text} holds no checkpoint",
        hint="The run stopped before its first checkpoint (see checkpoint_every): start it again without --resume.",
    )
