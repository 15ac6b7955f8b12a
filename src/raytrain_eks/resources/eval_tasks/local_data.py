"""The datasets of the task files beside this one, read from the jsonl files here (lm-eval's ``custom_dataset``:
called with the task's ``metadata`` and ``dataset_kwargs`` as keywords, it returns the splits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def sample_mc(**_: Any) -> Any:
    """``raytrain_sample_mc``'s one split, ``test``."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_json(str(HERE / "raytrain_sample_mc.jsonl"))})
