"""The CUDA of the images whose contents this tool knows, and the oldest NVIDIA driver that CUDA runs on: what the
kubernetes target checks from GPU feature discovery's labels at ``up`` and what ``raytrain-eks check`` compares each
node's ``nvidia-smi`` with. Example::

    driver_version("535.183.01") < MIN_DRIVER   # True: too old for IMAGE_CUDA
"""

from __future__ import annotations

import re

# AWS's Ray Train DLC tags of resources/image_packages.json: ARG CUDA_VERSION=13.0.2 in its
# docker/ray-train/Dockerfile.cuda. The oldest driver CUDA 13.x runs on: 580 (NVIDIA's CUDA Compatibility guide,
# "Minor Version Compatibility", Table 1: CUDA 13.x, minimum required driver >= 580). The image's CUDA
# forward-compatibility libraries do not lower it here: only the image's entrypoint adds them, and KubeRay replaces
# the Ray containers' command.
IMAGE_CUDA = "13.0"
MIN_DRIVER = (580, 0)

_VERSION = re.compile(r"^(\d+)(?:\.(\d+))?")


def driver_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a driver version as ``nvidia-smi`` prints it (``"580.65.06"`` -> ``(580, 65)``), else
    ``None``."""
    match = _VERSION.match(text.strip())
    if not match:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def min_driver_text() -> str:
    """:data:`MIN_DRIVER` as a version: ``"580"`` (the minor left out when it is 0)."""
    return f"{MIN_DRIVER[0]}" + (f".{MIN_DRIVER[1]}" if MIN_DRIVER[1] else "")
