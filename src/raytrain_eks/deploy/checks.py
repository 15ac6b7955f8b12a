"""``raytrain-eks check``, and the same checks at the start of ``submit``: each GPU node proven in its Ray worker pod
(:mod:`raytrain_eks.health.node`) before a long run is paid for on it, and a failing node named with the evidence.

With ``exclude``, each failing node is taken out of the job's way through its target
(:meth:`~raytrain_eks.deploy.target.ClusterTarget.exclude_node`: cordoned; on EKS the node group also replaces its
instance). Example::

    result = check_cluster(d, target_for(d.cfg), exclude=False)
    print("\\n".join(result.lines())); raise SystemExit(0 if result.ok else 1)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from raytrain_eks.errors import UserError
from raytrain_eks.health.node import Expectation, NodeHealth, check_node, table
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.cluster import ExecResult, Pod

if TYPE_CHECKING:
    from raytrain_eks.deploy.target import ClusterTarget
    from raytrain_eks.k8s.state import Deployment

#: Seconds one check command may take in a pod: ``dcgmi diag -r 1`` takes seconds, the rest less.
CHECK_TIMEOUT_S = 180.0


@dataclass
class ClusterHealth:
    """The checks of every GPU node, and what was done to the failing ones."""

    nodes: list[NodeHealth]
    excluded: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.nodes)

    @property
    def bad_nodes(self) -> list[str]:
        return [h.node for h in self.nodes if not h.ok]

    def lines(self) -> list[str]:
        verdict = "every GPU node passed" if self.ok else f"failing nodes: {', '.join(self.bad_nodes)}"
        return [*table(self.nodes), *self.excluded, f"check: {verdict}"]

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": self.ok,
                "bad_nodes": self.bad_nodes,
                "nodes": [asdict(h) for h in self.nodes],
                "excluded": self.excluded,
            },
            indent=2,
        )


def expectation(d: Deployment) -> Expectation:
    """What each worker pod should see: the GPUs it requests and the EFA devices it requests (the type's interfaces
    on EKS, ``cluster.efa_per_node`` when set)."""
    return Expectation(gpus=d.cfg.derived.ray_gpus_per_worker_pod, efa=m.efa_per_pod(d.cfg))


def check_pods(d: Deployment, workers: Sequence[Pod]) -> list[NodeHealth]:
    """Every check, in each worker pod (one per GPU node), in node order."""
    expect = expectation(d)
    found = []
    for pod in sorted(workers, key=lambda p: p.node_name or p.name):

        def run(argv: list[str], pod: Pod = pod) -> ExecResult:
            return d.kube.exec(pod.namespace, pod.name, argv, timeout=CHECK_TIMEOUT_S)

        found.append(check_node(pod.node_name or "?", pod.name, run, expect))
    return found


def running_workers(d: Deployment) -> list[Pod]:
    """The running Ray worker pods of the deployment's RayCluster; a :class:`UserError` when there is none."""
    ns, name = d.cfg.ray.namespace, d.cfg.ray.cluster_name
    pods = d.kube.pods(ns, {"ray.io/cluster": name, "ray.io/node-type": "worker"})
    up = [p for p in pods if p.phase == "Running" and p.ready]
    if not up:
        raise UserError(
            f"no Ray worker pod of RayCluster {ns}/{name} is running: the checks run inside them, on each GPU node.",
            hint="Start the Ray pods with `raytrain-eks submit` (the checks run at its start), or see "
            "`raytrain-eks status`.",
        )
    return up


def check_cluster(d: Deployment, target: ClusterTarget, *, exclude: bool) -> ClusterHealth:
    """Check every GPU node through its running worker pod; with ``exclude``, take each failing node out through
    ``target``."""
    result = ClusterHealth(check_pods(d, running_workers(d)))
    if exclude:
        _exclude(d, target, result)
    return result


def _exclude(d: Deployment, target: ClusterTarget, result: ClusterHealth) -> None:
    """Each failing node out through its target, then its worker pod deleted: cordoning leaves a running pod where it
    is, and KubeRay replaces a deleted worker on a node that can take it."""
    for h in result.nodes:
        if h.ok:
            continue
        result.excluded.extend(target.exclude_node(d, h.node))
        if d.kube.delete("v1", "Pod", h.pod, d.cfg.ray.namespace):
            result.excluded.append(f"deleted worker pod {h.pod}: KubeRay starts a new one on a node that can take it")


def before_job(d: Deployment, target: ClusterTarget, workers: Sequence[Pod], *, exclude: bool = False) -> None:
    """``submit``'s gate: the checks in the job's worker pods; a :class:`UserError` naming each failing node and its
    evidence, so no run starts on it."""
    d.say(f"Checking the {len(workers)} GPU nodes before the job (skip with --skip-checks)")
    result = ClusterHealth(check_pods(d, workers))
    if result.ok:
        d.say(f"check: every GPU node passed ({len(result.nodes)} nodes)")
        return
    if exclude:
        _exclude(d, target, result)
    failing = [f"{h.node}: {f.line()}" for h in result.nodes for f in h.failures()]
    raise UserError(
        "GPU node checks failed, the job was not submitted:\n  " + "\n  ".join([*failing, *result.excluded]),
        hint="Take the node out of the job with `raytrain-eks check --exclude-bad-nodes`, then submit again; or "
        "submit with --skip-checks to run on it anyway.",
    )


def cordon(d: Deployment, node: str) -> str:
    """Mark ``node`` unschedulable (``kubectl cordon``: ``spec.unschedulable``), so no new pod is placed on it."""
    if not d.kube.merge_patch("v1", "Node", node, None, {"spec": {"unschedulable": True}}):
        return f"node {node} was not found to cordon (already gone?)"
    return f"cordoned node {node}: no new pod will be placed on it"
