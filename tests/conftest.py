"""Shared fixtures: one built-in model cache per test session, one embedded Ray per integration module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the built-in model once for the whole session, in a folder of its own (never ~/.cache)."""
    root = Path(os.environ.get("RAYTRAIN_EKS_TEST_CACHE") or tmp_path_factory.mktemp("cache"))
    os.environ["RAYTRAIN_EKS_CACHE"] = str(root)
    return root


@pytest.fixture(scope="session")
def builtin_model(builtin_cache: Path) -> str:
    from raytrain_eks.train.builtin import ensure_builtin_model

    return str(ensure_builtin_model())


@pytest.fixture(scope="session")
def tokenizer(builtin_model: str):
    from raytrain_eks.train.data import load_tokenizer

    return load_tokenizer(builtin_model)


@pytest.fixture
def cfg_for(tmp_path, monkeypatch):
    """Build a config from env.sh-style variables only (no file from the current folder, no real environment)."""
    from raytrain_eks.config import load_config

    monkeypatch.chdir(tmp_path)

    def build(**environ: str):
        return load_config(environ=environ)

    return build


@pytest.fixture(scope="module")
def ray_local():
    """An embedded Ray shared by one test module (startup costs 15-20 s here)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
