"""Whether a cluster's own KubeRay knows every field of the RayCluster and RayJob this tool applies.

A KubeRay installed before ``up`` is kept. Its CRDs are structural schemas, so the API server drops a field they
do not list without an error (the pruning of unknown fields): against an operator older than the one this tool
pins, ``spec.preRunningDeadlineSeconds`` of a RayJob would vanish and a job whose pods never start would hold the
GPU nodes until someone noticed. :func:`check_kuberay_fields` reads the CRDs the cluster serves and stops ``up``
with the fields they lack, before anything is made (the way to upgrade it: KubeRay's upgrade guide,
https://docs.ray.io/en/latest/cluster/kubernetes/user-guides/upgrade-guide.html). Example::

    unknown_fields({"spec": {"a": 1}}, {"properties": {"spec": {"properties": {}}}})   # ["spec.a"]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import RAYCLUSTER_CRD
from raytrain_eks.k8s.state import Deployment

CRD_API = "apiextensions.k8s.io/v1"
RAYJOB_CRD = "rayjobs.ray.io"


def unknown_fields(obj: object, schema: Mapping[str, Any], path: str = "") -> list[str]:
    """The dotted paths of ``obj`` that the OpenAPI v3 ``schema`` of a CRD would prune: keys an object schema
    neither lists in ``properties`` nor admits by ``additionalProperties``, below any
    ``x-kubernetes-preserve-unknown-fields``. An object schema with neither (``metadata: {type: object}``) is
    taken as the API server's own and not looked into."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(obj, Mapping):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is None and extra is None:
            return []
        out: list[str] = []
        for key, value in obj.items():
            where = f"{path}.{key}" if path else str(key)
            if props is not None and key in props:
                out += unknown_fields(value, props[key], where)
            elif isinstance(extra, Mapping):
                out += unknown_fields(value, extra, where)
            elif extra is not True:
                out.append(where)
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        return [p for i, item in enumerate(obj) for p in unknown_fields(item, schema["items"], f"{path}[{i}]")]
    return []


def _served_schema(crd: Mapping[str, Any], version: str) -> Mapping[str, Any] | None:
    for v in (crd.get("spec") or {}).get("versions") or []:
        if v.get("name") == version and v.get("served", True):
            return ((v.get("schema") or {}).get("openAPIV3Schema")) or {}
    return None


def kuberay_gaps(d: Deployment) -> list[str]:
    """What the cluster's KubeRay CRDs lack of the objects ``submit`` would apply: one line per CRD, naming the
    fields (or the ``ray.io/v1`` version) it does not have. A missing RayJob CRD is not a gap (``--mode raycluster``
    needs only the RayCluster's); a missing RayCluster CRD means KubeRay is not installed, which ``up`` installs."""
    cfg = d.cfg
    if not (cfg.ray.worker_cpu and cfg.ray.worker_memory_gib):  # read from the nodes later; the sizes name no field
        cfg = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"worker_cpu": 1, "worker_memory_gib": 1})})
    gaps = []
    for crd_name, doc in ((RAYCLUSTER_CRD, m.raycluster(cfg, hf_token=True)), (RAYJOB_CRD, m.rayjob(cfg))):
        crd = d.kube.get(CRD_API, "CustomResourceDefinition", crd_name)
        if crd is None:
            continue
        schema = _served_schema(crd, str(doc["apiVersion"]).split("/")[1])
        if schema is None:
            gaps.append(f"{crd_name} serves no {doc['apiVersion']}")
            continue
        lacking = unknown_fields({"spec": doc["spec"]}, schema)
        if lacking:
            gaps.append(f"{crd_name} has no {', '.join(lacking)}")
    return gaps


def check_kuberay_fields(d: Deployment) -> None:
    """A :class:`UserError` when the cluster's KubeRay CRDs would drop fields this tool sets (see the module)."""
    gaps = kuberay_gaps(d)
    if not gaps:
        return
    version = d.cfg.addons.kuberay_version
    raise UserError(
        "the cluster's KubeRay is older than this tool needs: the API server would silently drop what its CRDs do "
        "not list (" + "; ".join(gaps) + "); nothing was created",
        hint=f"Upgrade the KubeRay operator to {version} or later, with its CRDs: `helm upgrade` leaves a chart's "
        f"crds/ as they are, so replace the CRDs first, as KubeRay's upgrade guide says (`kubectl replace -k "
        f"'github.com/ray-project/kuberay/ray-operator/config/crd?ref=v{version}'`; the RayClusters stay). Then run "
        "`raytrain-eks up` again.",
    )
