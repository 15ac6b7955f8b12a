"""What differs between the clusters raytrain-eks runs on: the :class:`ClusterTarget` interface, and
:func:`target_for`, which picks a configuration's target.

A target decides how its cluster is made ready and taken down (``up``, ``down``, ``status``, ``remembered``), how the
commands reach it (``deployment``), what ``plan`` and ``up --plan`` say it would do (``plan``, ``up_plan``), what the
GPU nodes are (``gpu_node_spec``, ``gpu_type``), where the Ray pods go when the configuration leaves it open (the
:class:`~raytrain_eks.k8s.placement.PodPlacement` it extends), the checks and hooks around the job
(``before_pods``, ``before_job``, ``after_rayjob``), the programs each command runs there (``command_steps``, named
from :mod:`raytrain_eks.k8s.programs`; ``check_own_programs``) and how a run on it is priced (``price``,
``deployment_record``). Everything else is shared by every target: the manifests (:mod:`raytrain_eks.k8s.manifests`),
the add-ons and the GPU node checks (:mod:`raytrain_eks.k8s.addons`), the state file and the waits, the configured
price (:mod:`raytrain_eks.k8s.prices`), the plan's shared parts, and the job with its evidence
(:mod:`raytrain_eks.deploy.submit`). One implementation per target, each in its own package: ``eks``
(:class:`raytrain_eks.eks.target.EksTarget`: the cluster it creates with eksctl) and ``kubernetes``
(:class:`raytrain_eks.kubernetes.target.KubernetesTarget`: a cluster of the kubeconfig, as it is).
``cluster.target`` chooses; :func:`target_for` returns it (through :mod:`raytrain_eks.targets`, the one place that
names the target packages), and callers ask it rather than the setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Protocol, cast

from raytrain_eks.config import Config
from raytrain_eks.deploy.plan import Mode, Plan
from raytrain_eks.instances import InstanceType
from raytrain_eks.k8s.addons import GpuNodeSpec
from raytrain_eks.k8s.placement import PodPlacement
from raytrain_eks.k8s.prices import Price
from raytrain_eks.k8s.state import Deployment, StateStore
from raytrain_eks.targets import implementation


class ClusterTarget(PodPlacement, Protocol):
    name: str
    #: Whether ``submit`` checks the GPU nodes before the job unless told ``--skip-checks`` (where a run is
    #: billed by the hour on nodes this tool launched, a bad node costs most).
    checks_by_default: bool

    def deployment(self, cfg: Config, store: StateStore, say: Callable[[str], None]) -> Deployment:
        """The real deployment the commands work on: the cluster's kubeconfig (this folder's, or the user's) through
        the official Kubernetes client, the runner, and ``cfg`` with what ``up`` recorded in ``store``."""
        ...

    def plan(self, cfg: Config, *, state_dir: str | Path, mode: Mode, hf_token: bool) -> Plan:
        """What ``up`` and ``submit`` would do here, built offline (nothing is contacted; ``state_dir`` only read)."""
        ...

    def up_plan(self, cfg: Config, *, train: bool, mode: str) -> list[str]:
        """The lines ``up --plan`` prints: what ``up`` would do (``train``: then submit in ``mode``)."""
        ...

    def require_programs(self, d: Deployment, *commands: str, mode: str = "raycluster") -> None:
        """Name every program ``commands`` run here from this folder now that is missing (exit 2), taking the
        steps of :meth:`command_steps` (``mode``: submit's); do nothing when all are installed."""
        ...

    def check_own_programs(self, d: Deployment, command: str) -> None:
        """Name every program ``command`` runs here that is missing (exit 2), before anything is asked or touched,
        unless the target's own lifecycle checks them when it knows what exists."""
        ...

    def deployment_record(self, cfg: Config, state: StateStore) -> dict[str, object] | None:
        """What ``submit`` tells the job about its cluster (:mod:`raytrain_eks.fabric.deployment`), or ``None``."""
        ...

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

    def exclude_node(self, d: Deployment, node: str) -> list[str]:
        """Take a node that failed ``check`` out of the next job's way (cordon it; where the target owns the node
        group, also have the group replace its instance). Returns what was done, as lines to show."""
        ...

    def after_rayjob(self, d: Deployment) -> None:
        """After a RayJob's evidence is read: let the GPU nodes go where that stops their bill."""
        ...

    def run_deadline(self, d: Deployment) -> datetime | None:
        """When the job must have checkpointed and stopped because its nodes end on a schedule (a Capacity Block's
        drain time); None where they do not."""
        ...


def target_for(cfg: Config) -> ClusterTarget:
    """The target ``cluster.target`` names."""
    return cast(ClusterTarget, implementation(cfg))
