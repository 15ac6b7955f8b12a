"""Readable JSON-schema errors, shared by the manifest and plan tests."""

from __future__ import annotations

from typing import Any

import jsonschema


def schema_errors(validator: jsonschema.Draft7Validator, doc: dict[str, Any]) -> list[str]:
    """Every violation of ``doc`` as ``path: message``; empty when it validates."""
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
