"""``up`` and ``down`` on an EKS cluster the user already has (``cluster.existing: true``): the device plugins and
KubeRay it already runs are kept, through ``up`` and ``down``, when their pods will run on the new GPU nodes; what it
lacks is installed, recorded, and removed again by ``down``; a plugin whose pods would not run on the new nodes is
named, with what to do, before anything is created.

Against test_deploy.py's World (FakeTools' eksctl and helm, FakeKube's DaemonSet controller, which runs a plugin's
pods where its selector, affinity and tolerations let them), with ``eksctl delete iamserviceaccount`` as
test_irsa.py adds it. The cluster's own plugins are eksctl's static NVIDIA manifest (what eksctl applies for a GPU
node group made without ``--install-nvidia-plugin=false``, fixtures/eksctl/pkg/addons/assets) and AWS's EFA chart
installed as a release of its own name, or eksctl's EFA manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from charts import FIXTURES, crds, eksctl_efa_daemon_set, rendered, vendored
from test_deploy import ALLOCATABLE, ZONES, World

from raytrain_eks.config import load_config
from raytrain_eks.eks import lifecycle, nodegroups
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m

EKSCTL_NVIDIA_ASSET = FIXTURES / "eksctl" / "pkg" / "addons" / "assets" / "nvidia-device-plugin.yaml"
THEIR_NODES = {"eks.amazonaws.com/nodegroup": "their-gpus", "node.kubernetes.io/instance-type": "g6.12xlarge"}


@pytest.fixture
def existing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    """An EKS cluster of the user's with a GPU node group of its own (one node, tainted as this tool's are)."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ={}, path=None)
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"existing": True})})
    w = World(tmp_path, cfg)
    w.tools.cluster = {"name": cfg.cluster.name, "azs": ZONES}
    w.kube.add_node("their-gpu-0", labels=THEIR_NODES, allocatable=ALLOCATABLE["g6.12xlarge"], taints=[m.GPU_TAINT])
    return w


def _up(w: World) -> lifecycle.UpResult:
    return lifecycle.up(w.d, confirm=lambda q: True, offered_zones=lambda: nodegroups.Placement(list(ZONES)))


def _down(w: World) -> None:
    lifecycle.down(w.d, confirm=lambda q: True)
    w.kube.sleep(5)


def _eksctl_nvidia_plugin() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(EKSCTL_NVIDIA_ASSET.read_text()) if d]
    return doc


def _efa_release(release: str) -> dict[str, Any]:
    """The EFA chart's DaemonSet as Helm makes it for a release named ``release`` (tolerating nvidia.com/gpu)."""
    (ds,) = [o for o in rendered("aws-efa-k8s-device-plugin") if o["kind"] == "DaemonSet"]
    name = f"{release}-aws-efa-k8s-device-plugin"
    ds["metadata"].update(name=name, namespace="kube-system")
    ds["metadata"]["labels"].update({"app.kubernetes.io/instance": release, "app.kubernetes.io/managed-by": "Helm"})
    annotations = {"meta.helm.sh/release-name": release, "meta.helm.sh/release-namespace": "kube-system"}
    ds["metadata"]["annotations"] = annotations
    ds["spec"]["selector"]["matchLabels"] = {"name": name}
    ds["spec"]["template"]["metadata"]["labels"] = {"name": name}
    return ds


def _advertised(w: World, node: str) -> tuple[str | None, str | None]:
    (n,) = [n for n in w.kube.nodes() if n.name == node]
    return n.allocatable.get(m.GPU_RESOURCE), n.allocatable.get(m.EFA_RESOURCE)


def _plugin_installs(w: World) -> list[str]:
    return [c[3] for c in w.tools.commands("helm", "upgrade", "--install")]


def test_the_clusters_own_device_plugins_are_kept_through_up_and_down(existing: World):
    existing.kube.put(_eksctl_nvidia_plugin())
    existing.kube.put(_efa_release("efa"))
    existing.kube.sleep(5)
    assert _advertised(existing, "their-gpu-0") == ("4", "1")
    _up(existing)
    assert _plugin_installs(existing) == ["kuberay-operator"]  # the plugins are the cluster's; KubeRay was missing
    said = existing.said()
    assert "Keeping the cluster's nvidia-device-plugin: DaemonSet kube-system/nvidia-device-plugin-daemonset" in said
    assert (
        "Keeping the cluster's aws-efa-k8s-device-plugin: DaemonSet kube-system/efa-aws-efa-k8s-device-plugin" in said
    )
    # eksctl's EFA copy, applied for the new node group alone, is gone; the cluster's plugins stay.
    assert existing.kube.get("apps/v1", "DaemonSet", "aws-efa-k8s-device-plugin", "kube-system") is None
    for name in ("nvidia-device-plugin-daemonset", "efa-aws-efa-k8s-device-plugin"):
        assert existing.kube.get("apps/v1", "DaemonSet", name, "kube-system") is not None
    for node in ("their-gpu-0", *[n.name for n in existing.kube.nodes({"role": "gpu-worker"})]):
        assert _advertised(existing, node) == ("4", "1")
    assert {i["name"] for i in existing.store.created if i["type"] == "helm"} == {"kuberay-operator"}
    _down(existing)
    assert ("kuberay-system", "kuberay-operator") not in existing.tools.releases
    for name in ("nvidia-device-plugin-daemonset", "efa-aws-efa-k8s-device-plugin"):
        assert existing.kube.get("apps/v1", "DaemonSet", name, "kube-system") is not None
    assert _advertised(existing, "their-gpu-0") == ("4", "1")


def test_a_cluster_without_plugins_gets_the_pinned_ones_and_down_removes_them(existing: World):
    _up(existing)
    assert _plugin_installs(existing) == ["nvidia-device-plugin", "aws-efa-k8s-device-plugin", "kuberay-operator"]
    for node in existing.kube.nodes({"role": "gpu-worker"}):
        assert _advertised(existing, node.name) == ("4", "1")
    # up again: the charts it installed are its own, not the cluster's; nothing is installed or kept anew.
    _up(existing)
    assert len(_plugin_installs(existing)) == 3 and "Keeping the cluster's" not in existing.said()
    _down(existing)
    assert not existing.tools.releases
    assert not [n for n in ("nvidia-device-plugin", "aws-efa-k8s-device-plugin")
                if existing.kube.get("apps/v1", "DaemonSet", n, "kube-system")]  # fmt: skip
    assert _advertised(existing, "their-gpu-0") == (None, None)  # as before up: the cluster had no plugin
    assert existing.tools.cluster is not None


def test_a_plugin_that_would_not_run_on_the_new_nodes_is_named_before_anything_is_made(existing: World):
    # eksctl's EFA manifest, from an EFA node group of the cluster's own, tolerates only CriticalAddonsOnly and
    # aws.amazon.com/efa: its pods would never run on GPU nodes tainted nvidia.com/gpu.
    existing.kube.put(_eksctl_nvidia_plugin())
    existing.kube.put(eksctl_efa_daemon_set())
    questions: list[str] = []
    with pytest.raises(UserError) as err:
        lifecycle.up(existing.d, confirm=questions.append, offered_zones=lambda: nodegroups.Placement(list(ZONES)))
    assert "DaemonSet kube-system/aws-efa-k8s-device-plugin" in err.value.message
    assert "does not tolerate their taint nvidia.com/gpu=true:NoSchedule" in err.value.message
    assert "nvidia-device-plugin-daemonset" not in err.value.message  # that one tolerates it
    assert "tolerate" in (err.value.hint or "")
    assert questions == [] and not existing.store.created and not existing.tools.commands("eksctl", "create")
    assert not boto3.client("s3").list_buckets()["Buckets"]
    assert existing.kube.get("apps/v1", "DaemonSet", "aws-efa-k8s-device-plugin", "kube-system") is not None


def test_eksctls_efa_daemonset_tolerating_the_gpu_taint_is_still_named_for_eksctl_replaces_it(existing: World):
    # Made to tolerate nvidia.com/gpu by the user, it would cover the new nodes, but eksctl applies its own manifest
    # over it when it creates the GPU node group (fixtures/eksctl/pkg/addons/device_plugin.go CreateOrReplace).
    existing.kube.put(_eksctl_nvidia_plugin())
    patched = eksctl_efa_daemon_set()
    patched["spec"]["template"]["spec"]["tolerations"].append(dict(m.GPU_TOLERATION))
    existing.kube.put(patched)
    with pytest.raises(UserError) as err:
        _up(existing)
    assert "kube-system/aws-efa-k8s-device-plugin" in err.value.message
    assert "once eksctl has applied its own EFA manifest over it" in err.value.message
    assert "another release name" in (err.value.hint or "")
    assert not existing.tools.commands("eksctl", "create")


def test_a_kept_kuberay_whose_crds_lack_a_field_submit_sets_stops_up_before_the_node_group(existing: World):
    for crd in crds(vendored("kuberay-operator")):  # the cluster's KubeRay, its RayJob CRD from before a field
        if crd["metadata"]["name"] == "rayjobs.ray.io":
            (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
            del v1["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["preRunningDeadlineSeconds"]
        existing.kube.put(crd)
    with pytest.raises(UserError) as refused:
        _up(existing)
    assert "rayjobs.ray.io has no spec.preRunningDeadlineSeconds" in refused.value.message
    assert not existing.tools.commands("eksctl", "create", "nodegroup") and not _plugin_installs(existing)


def test_a_plugin_in_a_namespace_of_its_own_is_kept(existing: World):
    # NVIDIA's plugin where a team's GPU operator runs it (a namespace of its own name): up finds it by its image.
    existing.kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "nvidia-gpu-operator"}})
    theirs = _eksctl_nvidia_plugin()
    theirs["metadata"]["namespace"] = "nvidia-gpu-operator"
    existing.kube.put(theirs)
    existing.kube.put(_efa_release("efa"))
    _up(existing)
    assert _plugin_installs(existing) == ["kuberay-operator"]
    assert (
        "Keeping the cluster's nvidia-device-plugin: DaemonSet nvidia-gpu-operator/nvidia-device-plugin-daemonset"
        in existing.said()
    )


def test_without_the_right_to_list_every_namespace_the_usual_ones_are_looked_at(existing: World, monkeypatch):
    # Kubernetes' RBAC answer to a cluster-wide list the kubeconfig's user may not make (403; the message as the
    # RBAC authorizer words it, k8s.io/apiserver pkg/endpoints/handlers/responsewriters/errors.go forbiddenMessage).
    from raytrain_eks.k8s.cluster import KubeApiError

    namespaced = existing.kube.daemon_sets

    def daemon_sets(namespace, selector=None):
        if namespace is None:
            raise KubeApiError(
                'list DaemonSets in every namespace: daemonsets.apps is forbidden: User "dev" cannot list resource '
                '"daemonsets" in API group "apps" at the cluster scope'
            )
        return namespaced(namespace, selector)

    monkeypatch.setattr(existing.kube, "daemon_sets", daemon_sets)
    existing.kube.put(_eksctl_nvidia_plugin())
    existing.kube.put(_efa_release("efa"))
    _up(existing)
    assert _plugin_installs(existing) == ["kuberay-operator"]
