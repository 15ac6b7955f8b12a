"""Where training data comes from: the files of a path (local or ``s3://``) or of a Hugging Face dataset.

:func:`list_data_files` answers which files to read and with which reader (``json``, ``parquet``, ``csv``,
``tsv`` or ``arrow``), before anything is started; :func:`hf_data_files` finds one split of a Hugging Face dataset
(``hf:OWNER/NAME[:SPLIT]``) in the Hugging Face cache, from the Hub when it answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from raytrain_eks.errors import DataError

# .ndjson (newline-delimited JSON) is JSON lines by another name; .tsv is CSV with a tab between the fields, a kind
# of its own so that a folder mixing the two is refused rather than read with one delimiter.
DATA_SUFFIXES = {
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "tsv",
    ".arrow": "arrow",
}
READ_TYPES = ".jsonl, .ndjson, .json, .parquet, .csv, .tsv or .arrow"  # what DATA_SUFFIXES reads, as errors name it
READ_KINDS = "Parquet, JSON, JSONL, NDJSON, CSV, TSV and Arrow"  # the same, as the kinds of a dataset's files
_KIND_NAMES = {"json": "JSON", "parquet": "Parquet", "csv": "CSV", "tsv": "TSV", "arrow": "Arrow"}
# What the datasets library's save_to_disk writes beside a folder's .arrow files: its metadata, not rows.
SAVED_DATASET_FILES = ("dataset_info.json", "state.json")


# The data sets that ship with the package, by the name training.data gives them, and their file in its resources.
BUILTIN_DATA_FILES = {
    "builtin:sample-instructions": "sample_instructions.jsonl",  # alpaca-style instruction rows
    "builtin:sample-preferences": "sample_preferences.jsonl",  # prompt, chosen and rejected (method dpo)
}
BUILTIN_PREFIX = "builtin:"


def builtin_data_file(data: str, option: str = "--data") -> str:
    """The file of a data set that ships with the package (:data:`BUILTIN_DATA_FILES`); :class:`DataError` naming
    the known ones otherwise."""
    from importlib import resources

    if data not in BUILTIN_DATA_FILES:
        raise DataError(f"{option} {data!r}: no such built-in data set; there are {', '.join(BUILTIN_DATA_FILES)}")
    return str(resources.files("raytrain_eks.resources").joinpath(BUILTIN_DATA_FILES[data]))


HF_PREFIX = "hf:"  # a Hugging Face dataset: hf:OWNER/NAME[:SPLIT], or hf:FOLDER[:SPLIT] for one in the Hub's layout


def hf_data_files(data: str, option: str = "--data") -> tuple[list[str], str]:
    """The local files of one split of a Hugging Face dataset, and their reader; :class:`DataError` otherwise.

    ``data`` is ``hf:OWNER/NAME[:SPLIT]`` (split ``train`` by default): the dataset repository is brought into
    the Hugging Face cache (``huggingface_hub.snapshot_download``; from the cache alone when ``HF_HUB_OFFLINE`` is
    set or the Hub cannot be reached), then the ``datasets`` library decides which files make the split (its data
    file patterns and the README's ``configs``), as ``load_dataset`` would. ``hf:./FOLDER[:SPLIT]`` (or an absolute
    path) takes a local folder in the Hub's layout. Datasets of :data:`READ_KINDS` files are read; others are
    refused.
    """
    spec = data[len(HF_PREFIX) :]
    source, sep, split = spec.rpartition(":")
    if not sep:
        source, split = spec, ""
    split = split or "train"
    hint = "Write hf:OWNER/NAME or hf:OWNER/NAME:SPLIT (a local folder in the Hub's layout: hf:./FOLDER)."
    if not source:
        raise DataError(f"{option} {data!r}: name a dataset after hf:", hint=hint)
    local = source.startswith(("/", "./", "../", "~"))
    folder = Path(source).expanduser() if local else _hub_snapshot(source, data, option)
    if not folder.is_dir():
        raise DataError(f"{option} {data!r}: no such folder {str(folder)!r}", hint=hint)
    import datasets

    try:
        with _quiet_datasets():
            builder = datasets.load_dataset_builder(str(folder))
    except Exception as exc:
        raise DataError(f"{option} {data!r}: not a dataset the datasets library reads: {root_cause(exc)}") from None
    splits = builder.config.data_files or {}
    if split not in splits:
        have = ", ".join(sorted(splits)) or "none"
        raise DataError(f"{option} {data!r}: the dataset has no split {split!r} (its splits: {have})", hint=hint)
    files = sorted(str(f) for f in splits[split])
    kinds = {DATA_SUFFIXES.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        suffixes = ", ".join(sorted({Path(f).suffix or "(none)" for f in files}))
        raise DataError(f"{option} {data!r}: split {split!r} is stored as {suffixes}; {READ_KINDS} datasets are read")
    (kind,) = {k for k in kinds if k is not None}
    return files, kind


def _hub_snapshot(repo_id: str, data: str, option: str) -> Path:
    """The dataset repository ``repo_id`` in the Hugging Face cache: downloaded (or updated) when the Hub answers,
    else the cached snapshot; :class:`DataError` when neither is there."""
    import os

    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        if not offline:
            try:
                return Path(snapshot_download(repo_id, repo_type="dataset"))
            except Exception:  # no route to the Hub (or it refused): the cache may still have it
                pass
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except Exception as exc:
        raise DataError(
            f"{option} {data!r}: dataset {repo_id!r} is neither reachable on the Hub nor in the Hugging Face cache "
            f"({root_cause(exc)})",
            hint="Check the name (and HF_TOKEN for a gated dataset), or download it once where the Hub is reachable "
            "and set HF_HOME to that cache.",
        ) from None


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """The datasets library without its progress bars and info lines while it resolves a split's files."""
    import datasets

    before = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.set_verbosity_error()
    datasets.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(before)
        datasets.utils.logging.enable_progress_bar()


def list_data_files(data: str, option: str = "--data") -> tuple[list[str], str]:
    """The files to read and their reader ('json', 'parquet', 'csv', 'tsv' or 'arrow'); :class:`DataError` when
    there are none.

    ``data`` is a file or a folder, local or ``s3://`` (listed through pyarrow's file systems), a Hugging Face
    dataset (:func:`hf_data_files`), or one that ships with the package (``builtin:sample-preferences``).
    ``option`` is the setting it came from, named in the errors (``training.eval_data`` for the evaluation set).
    """
    from pyarrow import fs as pafs

    if data.startswith(HF_PREFIX):
        return hf_data_files(data, option)
    if data.startswith(BUILTIN_PREFIX):
        return [builtin_data_file(data, option)], "json"

    from raytrain_eks.train.storage import filesystem as storage_fs
    from raytrain_eks.train.storage import is_remote

    remote = is_remote(data)
    try:
        filesystem, root = storage_fs(data)
        info = filesystem.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise DataError(
                f"{option} {data!r}: no such file or folder",
                hint=f"Give a file or folder of {READ_TYPES} files.",
            )
        if info.type == pafs.FileType.File:
            found = [info]
        else:
            found = [i for i in filesystem.get_file_info(pafs.FileSelector(root, recursive=True)) if i.is_file]
    except DataError:
        raise
    except Exception as exc:  # credentials, permissions, bad bucket names: say which and stop
        raise DataError(f"{option} {data!r}: cannot be listed: {root_cause(exc)}") from None
    prefix = data.split("://", 1)[0] + "://" if remote else ""
    if len(found) == 1 and info.type == pafs.FileType.File:
        suffix = Path(found[0].path).suffix
        if suffix not in DATA_SUFFIXES:
            raise DataError(f"{option} {data!r}: unsupported file type {suffix or '(none)'!r}; use {READ_TYPES}")
        return [prefix + found[0].path], DATA_SUFFIXES[suffix]
    files = sorted(prefix + i.path for i in found if Path(i.path).suffix in DATA_SUFFIXES)
    if any(f.endswith(".arrow") for f in files):
        files = [f for f in files if Path(f).name not in SAVED_DATASET_FILES]
    if not files:
        raise DataError(f"{option} {data!r}: the folder has no {READ_TYPES} file")
    kinds = {DATA_SUFFIXES[Path(f).suffix] for f in files}
    if len(kinds) > 1:
        *some, last = [_KIND_NAMES[k] for k in sorted(kinds)]
        mixed = f"{', '.join(some)} and {last}"
        raise DataError(f"{option} {data!r}: the folder mixes {mixed} files; keep one kind per folder")
    return files, kinds.pop()


def root_cause(exc: BaseException) -> str:
    """The last line of the innermost cause of ``exc`` (Ray and pyarrow wrap the error that says what is wrong)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
