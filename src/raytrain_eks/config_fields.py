"""What every section of the configuration shares: the frozen pydantic base that refuses unknown fields, and the
patterns AWS, Kubernetes and the registries give their names, each checked with a message saying what is allowed."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

REGION = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d$")
ZONE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d[a-z]$")
RESERVATION = re.compile(r"^cr-[0-9a-f]{8,17}$")
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
EKS_NAME = re.compile(r"^[0-9A-Za-z][A-Za-z0-9_-]*$")
# Kubernetes label keys (an optional DNS-subdomain prefix, then a name of 63 at most) and values.
LABEL_KEY = re.compile(r"^([a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
IMAGE = re.compile(r"^[a-z0-9.-]+(:\d+)?(/[a-z0-9._-]+)+(:[A-Za-z0-9_.-]{1,128}|@sha256:[0-9a-f]{64})$")
VERSION = re.compile(r"^v?\d+\.\d+\.\d+([-+][0-9A-Za-z.-]+)?$")
DELIMITER = re.compile(r"[\t !#-~]\Z")  # one character pyarrow's CSV reader splits on: ASCII, no quote, no newline


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


def check(pattern: re.Pattern[str], value: str, allowed: str) -> str:
    if not pattern.match(value):
        raise ValueError(f"allowed: {allowed}")
    return value


def check_optional(pattern: re.Pattern[str], value: str | None, allowed: str) -> str | None:
    """:func:`_check` for a setting that may be left empty (``None`` or ``""``, both read as not set)."""
    return check(pattern, value, allowed) if value else None
