"""Where a target's Ray pods go and how large they are when the configuration leaves it open: the part of the
target interface the manifests and the add-ons ask.

Every setting the user gives (``ray.worker_cpu``, ``cluster.gpu_node_selector``, ``cluster.efa_per_node``...) wins;
what fills the rest is the target's: the EKS target knows the node groups it creates (their instance types and
labels), the ``kubernetes`` target knows nothing of the cluster's nodes until ``up`` reads them. Example::

    placement_for(cfg).gpu_node_labels(cfg)   # {"role": "gpu-worker", ...} on eks, {} on kubernetes
"""

from __future__ import annotations

from typing import Protocol, cast

from raytrain_eks.config import Config
from raytrain_eks.targets import implementation


class PodPlacement(Protocol):
    def worker_pod(self, cfg: Config) -> tuple[int, int] | None:
        """Each GPU worker pod's CPU and memory (GiB) when ``ray.worker_cpu``/``ray.worker_memory_gib`` are unset;
        ``None`` when they cannot be known here."""
        ...

    def head_pod(self, cfg: Config) -> tuple[int, int]:
        """The Ray head pod's CPU and memory (GiB) when ``ray.head_cpu``/``ray.head_memory_gib`` are unset."""
        ...

    def efa_per_pod(self, cfg: Config) -> int:
        """EFA interfaces each worker pod requests when ``cluster.efa_per_node`` is unset."""
        ...

    def gpu_node_labels(self, cfg: Config) -> dict[str, str]:
        """The labels the worker pods select when ``cluster.gpu_node_selector`` is unset."""
        ...

    def head_node_labels(self, cfg: Config) -> dict[str, str]:
        """The labels the head pod selects when ``cluster.head_node_selector`` is unset."""
        ...

    def chart_values(self, cfg: Config) -> dict[str, dict[str, object]]:
        """The Helm values of the three pinned charts, keyed ``nvidia``, ``efa`` and ``kuberay``: where the device
        plugins and the operator run on this target's nodes."""
        ...


def placement_for(cfg: Config) -> PodPlacement:
    """The placement of the target ``cluster.target`` names."""
    return cast(PodPlacement, implementation(cfg))
