"""What a job knows of the cluster it runs on: the record ``submit`` puts beside the job's configuration.

``submit`` mounts the job's configuration in the head pod from a ConfigMap; when ``.raytrain-eks/state.json`` says
that ``up`` made the cluster, the same ConfigMap holds ``deployment.json``: the cluster's name and region, its node
types and counts, and its hourly on-demand price. A run prices itself (``summary.json``'s ``cost``) and the bandwidth
probe takes the nodes' network rate only from this record; a Ray cluster joined with ``--address`` that this tool
did not deploy has none, and nothing is assumed from the configuration's default instance types. It lives here, the
lowest package that both the training job and the probe may import. Example::

    record = read_deployment("/etc/raytrain-eks/raytrain-eks.yaml")   # the record beside that file, or None
    record["gpu_node_type"] if record else None                       # "g6.12xlarge"
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEPLOYMENT_RECORD = "deployment.json"  # its name beside the configuration (a key of the job's ConfigMap)
RECORD_KIND = "raytrain-eks deployment"
# Fields of a record, each required: who wrote it, and what the job may take from it.
RECORD_FIELDS = (
    "kind",
    "cluster",
    "region",
    "gpu_node_type",
    "gpu_node_count",
    "system_node_type",
    "system_node_count",
    "usd_per_hour",
    "price_region",
)


def read_deployment(config: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The deployment record beside the configuration file ``config``; None when there is none (no ``--config``,
    no record, or a file that is not a whole record of this tool)."""
    if config is None:
        return None
    try:
        data = json.loads((Path(config).parent / DEPLOYMENT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("kind") != RECORD_KIND or any(f not in data for f in RECORD_FIELDS):
        return None
    return data
