"""The ``kubernetes`` :class:`~raytrain_eks.deploy.target.ClusterTarget`: an existing cluster of the user's
kubeconfig, as it is. Nothing of its nodes is known until ``up`` reads them (:mod:`raytrain_eks.kubernetes.existing`),
so the Ray pods go where the configuration says, and a run is priced only at a configured price."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from raytrain_eks.config import Config
from raytrain_eks.deploy.plan import Mode, Plan
from raytrain_eks.eks.programs import require_programs
from raytrain_eks.errors import UserError
from raytrain_eks.instances import InstanceType
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s import runner
from raytrain_eks.k8s.addons import GpuNodeSpec
from raytrain_eks.k8s.cluster import KubernetesApi
from raytrain_eks.k8s.prices import Price, configured_price, unpriced_reason
from raytrain_eks.k8s.programs import DELETE_STEPS
from raytrain_eks.k8s.raypods import check_shared_volume, cluster_words
from raytrain_eks.k8s.state import Deployment, StateStore
from raytrain_eks.kubernetes import existing
from raytrain_eks.kubernetes import plan as existing_plan

# The Ray head pod on a cluster this tool did not make, unless ray.head_cpu / head_memory_gib say otherwise.
DEFAULT_HEAD_POD = (2, 8)

UP_PLAN = (
    "up would, on the cluster of the kubeconfig (nothing is changed now): find the GPU nodes "
    "(cluster.gpu_node_selector, else those advertising nvidia.com/gpu) and read what they advertise; "
    "install, after asking, only what is missing of: the NVIDIA device plugin (nodes advertising no GPU), "
    "the EFA device plugin (cluster.efa_per_node above what the nodes advertise), KubeRay (no RayCluster "
    "CRD); create the Ray pods' service account; then wait until the GPU nodes and KubeRay are ready. "
    "No cloud resource is created. `raytrain-eks plan` shows these steps with the files submit applies."
)


class KubernetesTarget:
    """The :class:`~raytrain_eks.deploy.target.ClusterTarget` of an existing cluster (``cluster.target:
    kubernetes``)."""

    name = existing.TARGET
    checks_by_default = False  # the user's own nodes, on no bill this tool starts: check on request

    def deployment(self, cfg: Config, store: StateStore, say: Callable[[str], None]) -> Deployment:
        """The user's cluster, through their kubeconfig (:func:`~raytrain_eks.kubernetes.existing.kubeconfig_path`)
        and ``cluster.context``; a :class:`UserError` when that file does not exist."""
        path, context = existing.kubeconfig_path(cfg), cfg.cluster.context
        if not Path(path).is_file():
            raise UserError(
                f"the kubeconfig {path} does not exist (cluster.target is kubernetes)",
                hint="Give the cluster's kubeconfig with --kubeconfig (or cluster.kubeconfig, or $KUBECONFIG).",
            )
        kube = KubernetesApi(path, context=context)
        return Deployment(
            cfg=existing.remembered(cfg, store), kube=kube, run=runner.run, state=store, say=say,
            kubeconfig_file=path, context=context,
        )  # fmt: skip

    def plan(self, cfg: Config, *, state_dir: str | Path, mode: Mode, hf_token: bool) -> Plan:
        return existing_plan.build_plan(cfg, state_dir=state_dir, mode=mode, hf_token=hf_token)

    def up_plan(self, cfg: Config, *, train: bool, mode: str) -> list[str]:
        return [UP_PLAN]

    def up(self, d: Deployment, *, confirm: Callable[[str], bool]) -> list[str]:
        return existing.up(d, confirm=confirm)

    def down(self, d: Deployment, *, confirm: Callable[[str], bool], delete_checkpoints: bool = False) -> list[str]:
        return existing.down(d, confirm=confirm)

    def status(self, d: Deployment) -> list[str]:
        return existing.status(d)

    def remembered(self, cfg: Config, state: StateStore) -> Config:
        return existing.remembered(cfg, state)

    # Where the Ray pods go: nothing is known of the nodes here, so only what the configuration (or up's record,
    # laid over it by remembered) says; the nvidia.com/gpu request alone keeps the workers on GPU nodes.
    def worker_pod(self, cfg: Config) -> tuple[int, int] | None:
        return None

    def head_pod(self, cfg: Config) -> tuple[int, int]:
        return DEFAULT_HEAD_POD

    def efa_per_pod(self, cfg: Config) -> int:
        return 0

    def gpu_node_labels(self, cfg: Config) -> dict[str, str]:
        return {}

    def head_node_labels(self, cfg: Config) -> dict[str, str]:
        return {}

    def chart_values(self, cfg: Config) -> dict[str, dict[str, object]]:
        # The plugins go to the nodes of cluster.gpu_node_selector (tolerating the worker pods' tolerations) and the
        # operator to those of cluster.head_node_selector; the NVIDIA chart's own affinity (labels that node feature
        # discovery sets) is replaced by that selector, which every cluster can give.
        gpu, tolerations, selector = m.gpu_node_selector(cfg), m.gpu_tolerations(cfg), m.head_node_selector(cfg)
        return {
            "nvidia": {"nodeSelector": gpu, "affinity": None, "tolerations": tolerations},
            "efa": {"nodeSelector": dict(gpu), "tolerations": m.gpu_tolerations(cfg)},
            "kuberay": {"nodeSelector": selector} if selector else {},
        }

    def gpu_node_spec(self, d: Deployment) -> GpuNodeSpec:
        return existing.gpu_node_spec(d.cfg, d.state)

    def command_steps(self, d: Deployment, command: str, *, mode: str = "raycluster") -> tuple[str, ...]:
        """The steps of :data:`~raytrain_eks.kubernetes.existing.COMMANDS`; ``down``'s delete what the state file
        records. Nothing for ``down`` when nothing is recorded, nor for ``logs`` when no job is. ``mode`` changes
        nothing: no node group is scaled."""
        s = d.state
        steps = existing.COMMANDS[command]
        if command == "down":
            steps = tuple(step for item in s.created for step in DELETE_STEPS.get(item["type"], ()))
        elif command == "logs" and not (s.get("job") or {}).get("id"):
            return ()
        return tuple(dict.fromkeys(steps))

    def require_programs(self, d: Deployment, *commands: str, mode: str = "raycluster") -> None:
        require_programs(d, *commands, mode=mode, steps_of=self.command_steps)

    def check_own_programs(self, d: Deployment, command: str) -> None:
        """The kubeconfig's credential program, and helm for what is recorded, before anything is asked."""
        self.require_programs(d, command)

    def price(self, cfg: Config, config: str | os.PathLike[str] | None) -> tuple[Price | None, str | None]:
        """Only at the price the user configured (``cluster.usd_per_hour`` or ``cluster.usd_per_node_hour``): what
        the cluster's nodes cost is not known here. Else ``(None, why)``."""
        price = configured_price(cfg.cluster.usd_per_hour, cfg.cluster.usd_per_node_hour)
        return (price, None) if price is not None else (None, unpriced_reason(config))

    def deployment_record(self, cfg: Config, state: StateStore) -> dict[str, object] | None:
        """None: up made no cluster here, so there is no deployment to record (a configured price prices the run)."""
        return None

    def gpu_type(self, d: Deployment) -> InstanceType | None:
        return existing.gpu_type(d.cfg, d.state)

    def before_pods(self, d: Deployment) -> None:
        """The Ray pods' service account must exist (``up`` creates it), the shared volume when one is set, and
        where EFA is required the GPU nodes of the worker pods' one zone (:func:`check_zone`)."""
        check_shared_volume(d)
        existing.check_zone(d)
        if d.kube.get("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, d.cfg.ray.namespace) is None:
            raise UserError(
                f"the Ray pods' service account {d.cfg.ray.namespace}/{m.RAY_SERVICE_ACCOUNT} does not exist in "
                f"{cluster_words(d)}; nothing was applied",
                hint="Run `raytrain-eks up`: it creates it (and installs what else the cluster lacks).",
            )

    def before_job(self, d: Deployment) -> None:
        return None

    def exclude_node(self, d: Deployment, node: str) -> list[str]:
        from raytrain_eks.deploy.checks import cordon

        return [cordon(d, node), f"node {node} is the cluster's own: its owner repairs or replaces it"]

    def after_rayjob(self, d: Deployment) -> None:
        return None

    def run_deadline(self, d: Deployment) -> datetime | None:
        return None  # the cluster's nodes are the user's, on no schedule this tool knows
