"""The ``eks`` :class:`~raytrain_eks.k8s.target.ClusterTarget` (the cluster ``up`` creates with eksctl), and
:func:`target_for`, which picks a configuration's target."""

from __future__ import annotations

import os
from collections.abc import Callable

from raytrain_eks.config import Config
from raytrain_eks.eks import lifecycle, nodegroups, programs
from raytrain_eks.eks.irsa import check_before_pods
from raytrain_eks.eks.pricing import check_deployable, job_price
from raytrain_eks.instances import InstanceType
from raytrain_eks.k8s.addons import GpuNodeSpec, wait_gpu_nodes
from raytrain_eks.k8s.existing import KubernetesTarget, check_shared_volume
from raytrain_eks.k8s.prices import Price
from raytrain_eks.k8s.state import Deployment, StateStore, apply_state
from raytrain_eks.k8s.target import ClusterTarget


class EksTarget:
    name = "eks"

    def up(self, d: Deployment, *, confirm: Callable[[str], bool]) -> lifecycle.UpResult:
        return lifecycle.up(d, confirm=confirm, offered_zones=lambda: nodegroups.placement_zones(d.cfg))

    def down(
        self, d: Deployment, *, confirm: Callable[[str], bool], delete_checkpoints: bool = False
    ) -> lifecycle.DownResult:
        return lifecycle.down(d, confirm=confirm, delete_checkpoints=delete_checkpoints)

    def status(self, d: Deployment) -> list[str]:
        return lifecycle.status(d)

    def remembered(self, cfg: Config, state: StateStore) -> Config:
        return apply_state(cfg, state)

    def gpu_node_spec(self, d: Deployment) -> GpuNodeSpec:
        return nodegroups.gpu_node_spec(d.cfg, d.state.get("gpu_az"))

    def gpu_type(self, d: Deployment) -> InstanceType | None:
        return check_deployable(d.cfg)[0]

    def command_steps(self, d: Deployment, command: str, *, mode: str = "raycluster") -> tuple[str, ...]:
        return programs.command_steps(d, command, mode=mode)

    def price(self, cfg: Config, config: str | os.PathLike[str] | None) -> tuple[Price | None, str | None]:
        """At the price configured, else from the deployment record ``submit`` put beside ``config`` (the on-demand
        price of the instance table on the day the job was sent)."""
        return job_price(config, cfg.cluster.usd_per_hour, cfg.cluster.usd_per_node_hour)

    def before_pods(self, d: Deployment) -> None:
        check_shared_volume(d)
        check_before_pods(d)  # the service account, and its IAM role's grants on the bucket

    def before_job(self, d: Deployment) -> None:
        if d.state.get("gpu_scaled_to") == 0:  # a finished RayJob left the GPU group at 0 nodes
            c = d.cfg.cluster
            d.say(f"Scaling GPU node group {c.gpu_nodegroup_name} back to {c.gpu_node_count} nodes")
            nodegroups.scale_gpu_nodes(d, c.gpu_node_count)
            wait_gpu_nodes(d, self.gpu_node_spec(d))

    def after_rayjob(self, d: Deployment) -> None:
        # The RayJob removes its pods, not the GPU instances: scale the group to 0 so they stop billing.
        d.say(
            f"RayJob done: scaling GPU node group {d.cfg.cluster.gpu_nodegroup_name} to 0 (the next submit or up "
            "scales it back)"
        )
        nodegroups.scale_gpu_nodes(d, 0)


def target_for(cfg: Config) -> ClusterTarget:
    """The target ``cluster.target`` names."""
    return KubernetesTarget() if cfg.cluster.target == "kubernetes" else EksTarget()
