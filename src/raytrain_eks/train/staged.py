"""A model staged once where every node reads it (an ``s3://`` prefix, any URI pyarrow reads, or a shared folder),
so that no node of a job downloads it from the Hugging Face Hub.

``stage_model`` copies a Hub snapshot, a local model folder or the built-in model there, the manifest
(:data:`MANIFEST`: every file and its size) last, so a half-made copy is never taken for a model. A job whose
``training.model_id`` is such a location reads it through :func:`local_copy`: each node copies it once into its own
cache (``$RAYTRAIN_EKS_MODEL_CACHE``, else ``~/.cache/raytrain-eks/models``), under a lock the ranks of that node
share, keyed by the manifest (a model staged again is copied again). Example::

    uri = stage_model("Qwen/Qwen2.5-1.5B", "s3://my-bucket/models")   # s3://my-bucket/models/Qwen2.5-1.5B
    path = local_copy(uri)                                            # a folder from_pretrained reads
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypedDict

from raytrain_eks.config import BUILTIN_MODEL
from raytrain_eks.errors import UserError
from raytrain_eks.train.storage import filesystem, is_remote, join

MANIFEST = "raytrain-eks-staged.json"
CACHE_ENV = "RAYTRAIN_EKS_MODEL_CACHE"
# What from_pretrained and the tokenizer read: configs, weights, tokenizer files, chat templates. Not the Hub's
# other files (README, the .bin and .pth copies of the same weights, ONNX or GGUF exports).
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")


def _wanted(name: str) -> bool:
    return any(fnmatch.fnmatch(Path(name).name, p) for p in MODEL_FILES) and Path(name).name != MANIFEST


def is_staged_location(model_id: str) -> bool:
    """Whether ``model_id`` names a staged model (a URI), rather than a Hub id or a local folder."""
    return is_remote(model_id)


def _source_folder(model: str, say: Callable[[str], None]) -> Path:
    """The local folder of ``model``: the built-in model, a folder, or a snapshot of a Hub id (its model files
    only, into the Hugging Face cache; HF_TOKEN is used for gated models)."""
    if model == BUILTIN_MODEL:
        from raytrain_eks.train.builtin import ensure_builtin_model

        return Path(ensure_builtin_model())
    local = Path(model).expanduser()
    if model.startswith((".", "/", "~")) or local.exists():
        if not (local / "config.json").is_file():
            raise UserError(
                f"{model!r}: not a Hugging Face model folder (no config.json in it)",
                hint="Give a folder written by save_pretrained, a hub id (Qwen/Qwen2.5-1.5B) or builtin:tiny-qwen2.",
            )
        return local.resolve()
    from huggingface_hub import snapshot_download

    say(f"Downloading {model} from the Hugging Face Hub (model files only)")
    try:
        return Path(snapshot_download(repo_id=model, allow_patterns=list(MODEL_FILES)))
    except Exception as exc:  # unknown repository, gated without a token, no network
        raise UserError(
            f"cannot download {model!r} from the Hugging Face Hub: {str(exc).strip().splitlines()[0]}",
            hint="Check the model id, HF_TOKEN for gated models, and network access to the Hub; or stage a local "
            "folder written by save_pretrained.",
        ) from None


def stage_model(model: str, destination: str, say: Callable[[str], None] = lambda _: None) -> str:
    """Copy ``model``'s files into ``destination/NAME`` (NAME: the id's last part) and return that location."""
    source = _source_folder(model, say)
    files = sorted(p for p in source.rglob("*") if p.is_file() and _wanted(str(p.relative_to(source))))
    if not any(p.name == "config.json" for p in files):
        raise UserError(f"{model!r}: no config.json among its files, so it is not a model from_pretrained reads")
    name = model.removeprefix("builtin:").rstrip("/").rsplit("/", 1)[-1]
    target = join(destination, name)
    try:
        entries = _upload(source, files, target, model)
    except OSError as exc:  # no such bucket, no credentials, a folder that cannot be written
        raise UserError(
            f"cannot write the model to {target}: {exc}",
            hint="Check that the bucket (or folder) exists and that these credentials may write there.",
        ) from None
    total = sum(path.stat().st_size for path in files)
    say(f"Staged {model} at {target}: {len(entries)} files, {total / 2**20:,.1f} MiB")
    return target


class StagedFile(TypedDict):
    """A file of a staged model, as its manifest lists it: its path in the model's folder and its size."""

    path: str
    bytes: int


class StagedManifest(TypedDict):
    """A staged model's manifest: what was staged, when, the staging's own id, and its files."""

    source: str
    staged_at: str
    staging: str
    files: list[StagedFile]


def _upload(source: Path, files: list[Path], target: str, model: str) -> list[StagedFile]:
    """Write ``files`` (of the folder ``source``) to ``target``, then the manifest; returns its file entries."""
    fs, root = filesystem(target)
    if not is_remote(target):
        Path(root).mkdir(parents=True, exist_ok=True)
    entries: list[StagedFile] = []
    for path in files:
        rel = path.relative_to(source).as_posix()
        parent = f"{root}/{rel}".rsplit("/", 1)[0]
        if not is_remote(target):
            Path(parent).mkdir(parents=True, exist_ok=True)
        with path.open("rb") as src, fs.open_output_stream(f"{root}/{rel}") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        entries.append({"path": rel, "bytes": path.stat().st_size})
    manifest: StagedManifest = {
        "source": model,
        "staged_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "staging": secrets.token_hex(8),  # each staging its own: the nodes copy it again
        "files": entries,
    }
    with fs.open_output_stream(f"{root}/{MANIFEST}") as out:
        out.write((json.dumps(manifest, indent=2) + "\n").encode())
    return entries


def _manifest(uri: str) -> tuple[StagedManifest, bytes]:
    fs, root = filesystem(uri)
    try:
        with fs.open_input_stream(f"{root.rstrip('/')}/{MANIFEST}") as f:
            raw = f.read()
    except FileNotFoundError:
        raise UserError(
            f"--model {uri!r}: not a staged model (no {MANIFEST} there)",
            hint="Stage it there first: `raytrain-eks stage-model MODEL --to " + uri.rsplit("/", 1)[0] + "`.",
        ) from None
    except OSError as exc:  # no credentials, access denied, no such bucket
        raise UserError(
            f"--model {uri!r}: cannot read it: {exc}", hint="Check the credentials this node reads the bucket with."
        ) from None
    return json.loads(raw), raw


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/raytrain-eks/models").expanduser()


def local_copy(uri: str) -> str:
    """A folder on this node holding the model staged at ``uri``, copied once per node and staging."""
    import fcntl

    manifest, raw = _manifest(uri)
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    folder = cache_root() / f"{name}-{hashlib.sha256(uri.encode() + raw).hexdigest()[:16]}"
    done = folder / MANIFEST
    if done.is_file():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other ranks of this node wait here, then find the copy
        if done.is_file():
            return str(folder)
        fs, root = filesystem(uri)
        partial = Path(f"{folder}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        for entry in manifest["files"]:
            dest = partial / entry["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(f"{root.rstrip('/')}/{entry['path']}") as src, dest.open("wb") as out:
                shutil.copyfileobj(src, out, 8 << 20)
            if dest.stat().st_size != entry["bytes"]:
                raise UserError(
                    f"{uri}/{entry['path']}: {dest.stat().st_size} bytes, the manifest says {entry['bytes']}"
                )
        (partial / MANIFEST).write_bytes(raw)  # last: the folder is complete
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    return str(folder)
