"""What every target checks and shows of the Ray pods' surroundings: the shared volume they mount, and the Ray pods
of the last job as ``status`` lists them. Example::

    check_shared_volume(d)   # UserError unless ray.shared_volume is a ReadWriteMany claim of the Ray namespace
    ray_lines(d)             # ["Ray pod ray-train-head-x: Running Ready", "Last job raysubmit_1 (raycluster): ..."]
"""

from __future__ import annotations

from raytrain_eks.errors import UserError
from raytrain_eks.k8s.state import Deployment


def cluster_words(d: Deployment) -> str:
    """The cluster ``d`` reaches, in words: ``the cluster of ~/.kube/config (context gpu)``."""
    return f"the cluster of {d.kubeconfig}" + (f" (context {d.context})" if d.context else "")


def check_shared_volume(d: Deployment) -> None:
    """A :class:`UserError` unless ``ray.shared_volume`` (when set) is a claim of the Ray namespace that every pod
    can mount at once (``ReadWriteMany``): the checkpoints of every rank go there."""
    claim, ns = d.cfg.ray.shared_volume, d.cfg.ray.namespace
    if not claim:
        return
    found = d.kube.get("v1", "PersistentVolumeClaim", claim, ns)
    if found is None:
        raise UserError(
            f"ray.shared_volume = {claim!r}: no PersistentVolumeClaim {ns}/{claim} in {cluster_words(d)}",
            hint="Create the claim (ReadWriteMany, on EFS, FSx for Lustre or NFS) in ray.namespace, or name yours.",
        )
    modes = (found.get("spec") or {}).get("accessModes") or []
    if "ReadWriteMany" not in modes:
        raise UserError(
            f"ray.shared_volume = {claim!r}: the claim's access modes are {modes}, so the Ray pods on several nodes "
            "cannot all mount it",
            hint="Use a ReadWriteMany claim (EFS, FSx for Lustre, NFS), or s3:// in training.storage_path.",
        )


def ray_lines(d: Deployment) -> list[str]:
    """The Ray pods of the last job's RayCluster and the job's status, as ``status`` shows them on any target."""
    job = d.state.get("job") or {}
    ns = job.get("namespace", d.cfg.ray.namespace)
    lines = []
    for pod in d.kube.pods(ns, {"ray.io/cluster": job.get("raycluster", d.cfg.ray.cluster_name)}):
        lines.append(f"Ray pod {pod.name}: {pod.waiting_reason or pod.phase}{' Ready' if pod.ready else ''}")
    if job.get("id"):
        lines.append(f"Last job {job['id']} ({job.get('mode')}): {job.get('status', 'unknown')}")
    return lines
