"""What differs between the clusters raytrain-eks runs on: the :class:`ClusterTarget` interface.

A target decides how its cluster is made ready and taken down (``up``, ``down``, ``status``, ``remembered``), what
the GPU nodes are (``gpu_node_spec``, ``gpu_type``), the checks and hooks around the job (``before_pods``,
``before_job``, ``after_rayjob``), the programs each command runs there (``command_steps``, named from
:mod:`raytrain_eks.k8s.programs`; :mod:`raytrain_eks.eks.programs` checks they are installed) and how a run on it is
priced (``price``). Everything else is shared by every target: the manifests (:mod:`raytrain_eks.k8s.manifests`),
the add-ons and the GPU node checks (:mod:`raytrain_eks.k8s.addons`), the state file and the waits, the configured
price (:mod:`raytrain_eks.k8s.prices`), and the job with its evidence. One implementation per target: ``eks``
(:class:`raytrain_eks.eks.target.EksTarget`: the cluster it creates with eksctl) and ``kubernetes``
(:class:`raytrain_eks.k8s.existing.KubernetesTarget`: a cluster of the kubeconfig, as it is). ``cluster.target``
chooses; :func:`raytrain_eks.eks.target.target_for` returns it, and callers ask it rather than the setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

from raytrain_eks.config import Config
from raytrain_eks.instances import InstanceType
from raytrain_eks.k8s.addons import GpuNodeSpec
from raytrain_eks.k8s.prices import Price
from raytrain_eks.k8s.state import Deployment, StateStore


class ClusterTarget(Protocol):
    name: str

    def up(self, d: Deployment, *, confirm: Callable[[str], bool]) -> object:
        """Make the cluster ready for the job (create it, or install what it lacks), after one question."""
        ...

    def down(self, d: Deployment, *, confirm: Callable[[str], bool], delete_checkpoints: bool = False) -> object:
        """Remove what ``up`` and ``submit`` created, and only that, after one question."""
        ...

    def status(self, d: Deployment) -> list[str]:
        """Readable lines: the cluster, what was created there, the GPU nodes, the Ray pods and the last job."""
        ...

    def remembered(self, cfg: Config, state: StateStore) -> Config:
        """``cfg`` with what ``up`` recorded (the cluster it made or found), for the later commands."""
        ...

    def gpu_node_spec(self, d: Deployment) -> GpuNodeSpec:
        """What the worker pods need of the GPU nodes."""
        ...

    def gpu_type(self, d: Deployment) -> InstanceType | None:
        """The GPU nodes' instance type, for the memory estimate; ``None`` when not known."""
        ...

    def command_steps(self, d: Deployment, command: str, *, mode: str = "raycluster") -> tuple[str, ...]:
        """The steps ``command`` takes here from this folder now, in order, each declaring the programs it runs (those
        of :mod:`raytrain_eks.k8s.programs`, and eksctl's of :mod:`raytrain_eks.eks.programs`); ``mode``: submit's."""
        ...

    def price(self, cfg: Config, config: str | os.PathLike[str] | None) -> tuple[Price | None, str | None]:
        """How ``train --address`` prices a run on this target, ``cfg`` read from the file ``config``: ``(price,
        None)``, ``price(summary)`` being the run's cost, or ``(None, why)`` when it cannot be priced."""
        ...

    def before_pods(self, d: Deployment) -> None:
        """Check the access and storage wiring the Ray pods need, before any is applied."""
        ...

    def before_job(self, d: Deployment) -> None:
        """Bring the GPU nodes back when an earlier job let them go (the EKS node group scaled to 0)."""
        ...

    def after_rayjob(self, d: Deployment) -> None:
        """After a RayJob's evidence is read: let the GPU nodes go where that stops their bill."""
        ...
