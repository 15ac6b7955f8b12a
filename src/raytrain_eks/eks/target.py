"""The ``eks`` :class:`~raytrain_eks.deploy.target.ClusterTarget`: the cluster ``up`` creates with eksctl, whose node
groups (their instance types and labels) this tool knows."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from raytrain_eks.config import Config
from raytrain_eks.deploy.plan import Mode, Plan
from raytrain_eks.eks import lifecycle, nodegroups, programs
from raytrain_eks.eks.irsa import check_before_pods
from raytrain_eks.eks.plan import build_plan
from raytrain_eks.eks.pricing import check_deployable, cost_per_hour, deployment_record, job_price
from raytrain_eks.instances import InstanceType, default_worker_pod_size, head_pod_size, instance_type
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s import runner
from raytrain_eks.k8s.addons import GpuNodeSpec, wait_gpu_nodes
from raytrain_eks.k8s.cluster import KubernetesApi
from raytrain_eks.k8s.prices import Price
from raytrain_eks.k8s.raypods import check_shared_volume
from raytrain_eks.k8s.state import Deployment, StateStore, apply_state, remembered_config


class EksTarget:
    name = "eks"
    checks_by_default = True  # nodes launched and billed for this run: a bad one is replaced before it is paid for

    def deployment(self, cfg: Config, store: StateStore, say: Callable[[str], None]) -> Deployment:
        """This folder's kubeconfig, which eksctl writes at ``up``; ``cfg`` with the cluster, region and zone the
        state remembers (said when they differ from the configured ones)."""
        remembered = remembered_config(cfg, store, say)
        return Deployment(cfg=remembered, kube=KubernetesApi(store.kubeconfig), run=runner.run, state=store, say=say)

    def plan(self, cfg: Config, *, state_dir: str | Path, mode: Mode, hf_token: bool) -> Plan:
        """The EKS plan, the GPU nodes priced with what ``capacity`` recorded in ``state_dir`` (only read)."""
        return build_plan(cfg, mode=mode, hf_token=hf_token, market=StateStore(state_dir).data)

    def up_plan(self, cfg: Config, *, train: bool, mode: str) -> list[str]:
        lines = [f"up would do, for cluster {cfg.cluster.name} in {cfg.cluster.region} (nothing is created now):"]
        for i, action in enumerate(lifecycle.planned_actions(cfg), 1):
            lines.append(f"{i:>2}. {action.name}: {action.what}")
            if action.argv:
                lines.append(f"    $ {shlex.join(action.argv)}")
        if train:
            lines.append(f"then submit ({mode}): see `raytrain-eks plan --mode {mode}`")
        gpu, system = check_deployable(cfg)
        cost = cost_per_hour(cfg, gpu, system)
        lines.append(f"Cost while it runs: about ${cost['total_usd']:.2f} per hour ({cost['price_region']} on-demand).")
        return lines

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

    # Where the Ray pods go: the node groups up creates, of the configured instance types.
    def worker_pod(self, cfg: Config) -> tuple[int, int] | None:
        return default_worker_pod_size(instance_type(cfg.cluster.gpu_node_type))

    def head_pod(self, cfg: Config) -> tuple[int, int]:
        return head_pod_size(instance_type(cfg.cluster.system_node_type))

    def efa_per_pod(self, cfg: Config) -> int:
        return instance_type(cfg.cluster.gpu_node_type).efa_interfaces

    def gpu_node_labels(self, cfg: Config) -> dict[str, str]:
        return dict(m.GPU_NODE_LABELS)

    def head_node_labels(self, cfg: Config) -> dict[str, str]:
        return dict(m.SYSTEM_NODE_LABELS)

    def chart_values(self, cfg: Config) -> dict[str, dict[str, object]]:
        # The NVIDIA chart's default affinity (nvidia.com/gpu.present=true, set on the GPU node group) and its default
        # toleration of the nvidia.com/gpu taint are what we need; nothing to override. The EFA chart tolerates only
        # CriticalAddonsOnly; without the toleration it would never run on the tainted GPU nodes.
        return {
            "nvidia": {},
            "efa": {"tolerations": [dict(m.GPU_TOLERATION)]},
            "kuberay": {"nodeSelector": dict(m.SYSTEM_NODE_LABELS)},
        }

    def gpu_node_spec(self, d: Deployment) -> GpuNodeSpec:
        return nodegroups.gpu_node_spec(d.cfg, d.state.get("gpu_az"))

    def gpu_type(self, d: Deployment) -> InstanceType | None:
        return check_deployable(d.cfg)[0]

    def command_steps(self, d: Deployment, command: str, *, mode: str = "raycluster") -> tuple[str, ...]:
        return programs.command_steps(d, command, mode=mode)

    def require_programs(self, d: Deployment, *commands: str, mode: str = "raycluster") -> None:
        programs.require_programs(d, *commands, mode=mode, steps_of=self.command_steps)

    def check_own_programs(self, d: Deployment, command: str) -> None:
        """Nothing here: the lifecycle checks its own programs once eksctl has told it what exists."""

    def price(self, cfg: Config, config: str | os.PathLike[str] | None) -> tuple[Price | None, str | None]:
        """At the price configured, else from the deployment record ``submit`` put beside ``config`` (the on-demand
        price of the instance table on the day the job was sent)."""
        return job_price(config, cfg.cluster.usd_per_hour, cfg.cluster.usd_per_node_hour)

    def deployment_record(self, cfg: Config, state: StateStore) -> dict[str, object] | None:
        return deployment_record(cfg, state)

    def before_pods(self, d: Deployment) -> None:
        check_shared_volume(d)
        check_before_pods(d)  # the service account, and its IAM role's grants on the bucket

    def before_job(self, d: Deployment) -> None:
        if d.state.get("gpu_scaled_to") == 0:  # a finished RayJob left the GPU group at 0 nodes
            c = d.cfg.cluster
            d.say(f"Scaling GPU node group {c.gpu_nodegroup_name} back to {c.gpu_node_count} nodes")
            nodegroups.scale_gpu_nodes(d, c.gpu_node_count)
            wait_gpu_nodes(d, self.gpu_node_spec(d))

    def exclude_node(self, d: Deployment, node: str) -> list[str]:
        from raytrain_eks.deploy.checks import cordon
        from raytrain_eks.eks.replace import replace_instance

        return [cordon(d, node), replace_instance(d, node)]

    def after_rayjob(self, d: Deployment) -> None:
        # The RayJob removes its pods, not the GPU instances: scale the group to 0 so they stop billing.
        d.say(
            f"RayJob done: scaling GPU node group {d.cfg.cluster.gpu_nodegroup_name} to 0 (the next submit or up "
            "scales it back)"
        )
        nodegroups.scale_gpu_nodes(d, 0)

    def run_deadline(self, d: Deployment) -> datetime | None:
        """The drain time of the Capacity Block the GPU nodes run in (``up`` records the source it used), which EKS
        advises keeping more than 30 minutes before the block ends."""
        if d.state.get("gpu_capacity_used") != "capacity-block":
            return None
        block = nodegroups.recorded_block(d.cfg, d.state)
        return block.drain_by if block is not None else None
