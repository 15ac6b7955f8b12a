"""The three pinned charts, vendored unchanged (fixtures/charts/SOURCE.md), rendered by real Helm 3 and Helm 4 with
the values the tool writes, and read for what the tool's waits, checks and deletes look for; and the release
metadata the tool reads, from both Helm majors.

The rendered objects the fake helm creates (fixtures/charts/rendered/) are checked here to be exactly what real
``helm template`` renders, so they cannot drift from the charts or from the tool's values. Tests that run real
binaries take the ``real_tools`` fixture (``python scripts/fetch_test_tools.py`` fetches them).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from charts import CHARTS, VENDORED, crds, eksctl_efa_daemon_set, rendered, rendered_path, values_path, vendored
from fake_kube import FakeKube, Placement, device_plugin_resource
from test_deploy import World

from raytrain_eks.aws import eksctl
from raytrain_eks.config import Config, load_config
from raytrain_eks.errors import UserError
from raytrain_eks.instances import EFA_GPU_TYPES
from raytrain_eks.k8s import addons
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import HelmRelease, helm_releases
from raytrain_eks.k8s.runner import CommandError, Completed
from raytrain_eks.k8s.state import Deployment, StateStore

# The git tree id of each chart's folder at the commit SOURCE.md names (`git rev-parse COMMIT:PATH`).
UPSTREAM_TREES = {
    "nvidia-device-plugin": "38dd1c92211658fa1ddf9730c67c8382f8a28f73",
    "aws-efa-k8s-device-plugin": "163ff055569d3853f2d8a6319a6415132bbe3506",
    "kuberay-operator": "2e5a42cfee75f5dfdd3ef3256a18f750c44ea838",
}


@pytest.fixture(scope="module")
def cfg() -> Config:
    return load_config(environ={}, path=None)


def _object_id(kind: str, data: bytes) -> tuple[str, bytes]:
    digest = hashlib.sha1(f"{kind} {len(data)}\0".encode() + data).digest()  # noqa: S324 - git's object ids
    return digest.hex(), digest


def git_tree_id(files: dict[str, bytes]) -> str:
    """The id git gives a folder holding ``files`` (paths relative to it), every file as a plain 100644 blob."""
    subdirs: dict[str, dict[str, bytes]] = {}
    entries: list[tuple[str, bytes]] = []
    for path, data in files.items():
        head, _, rest = path.partition("/")
        if rest:
            subdirs.setdefault(head, {})[rest] = data
        else:
            entries.append((head, b"100644 " + head.encode() + b"\0" + _object_id("blob", data)[1]))
    for name, inner in subdirs.items():
        entries.append((name + "/", b"40000 " + name.encode() + b"\0" + bytes.fromhex(git_tree_id(inner))))
    body = b"".join(entry for _, entry in sorted(entries))
    return _object_id("tree", body)[0]


class InstallRunner:
    """Answers the helm commands of ``ensure_release`` on a cluster without the release: ``helm get metadata`` with
    what real Helm 3 and 4 print then (test_release_metadata_of_both_helm_majors shows it), the install with
    success. Keeps every argv."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **_: Any) -> Completed:
        self.calls.append(list(argv))
        if argv[:3] == ["helm", "get", "metadata"]:
            return Completed(tuple(argv), 1, "", "Error: release: not found\n")
        return Completed(tuple(argv), 0, "", "")


def written_values(cfg: Config, tmp: Path) -> dict[str, Path]:
    """Each release's values file as ``ensure_release`` writes it (it runs, against :class:`InstallRunner`)."""
    run = InstallRunner()
    d = Deployment(cfg=cfg, kube=FakeKube(), run=run, state=StateStore(tmp / ".raytrain-eks"))
    for rel in helm_releases(cfg):
        addons.ensure_release(d, rel)
    installs = [c for c in run.calls if c[:3] == ["helm", "upgrade", "--install"]]
    return {c[3]: Path(c[c.index("--values") + 1]) for c in installs}


def template_args(rel: HelmRelease, values: Path) -> list[str]:
    """``helm template`` of the vendored chart as ``rel`` installs it (its release name, namespace and values)."""
    chart = vendored(rel.chart, rel.version)
    assert chart is not None, f"{rel.chart} {rel.version} is not vendored in {CHARTS}"
    return ["template", rel.name, str(chart.path), "--namespace", rel.namespace, "--values", str(values)]


# ------------------------------------------------------------------------------------------------------------------
# The vendored charts
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chart", VENDORED, ids=lambda c: c.name)
def test_vendored_charts_are_the_upstream_trees_unchanged(chart):
    assert git_tree_id(chart.files()) == UPSTREAM_TREES[chart.name]
    meta = yaml.safe_load(chart.file("Chart.yaml"))
    assert (meta["name"], str(meta["version"])) == (chart.name, chart.version)
    source = (CHARTS / "SOURCE.md").read_text()
    assert UPSTREAM_TREES[chart.name] in source and chart.version in source


def test_the_tools_releases_are_the_vendored_charts_from_their_repositories(cfg):
    for rel in helm_releases(cfg):
        chart = vendored(rel.chart, rel.version)
        assert chart is not None, f"{rel.chart} {rel.version}: no such chart in {CHARTS}"
        assert rel.repo_url == chart.repo_url


def test_the_nvidia_charts_subchart_is_off_and_vendored(cfg):
    # The node-feature-discovery subchart renders only with nfd.enabled or gfd.enabled; the tool sets neither, and
    # its .tgz is vendored with the chart, so `helm template` and `helm install` need no registry.
    chart = vendored("nvidia-device-plugin")
    meta = yaml.safe_load(chart.file("Chart.yaml"))
    (dep,) = meta["dependencies"]
    assert dep["condition"] == "nfd.enabled,gfd.enabled"
    assert f"charts/{dep['name']}-{dep['version']}.tgz" in chart.files()
    values = yaml.safe_load(chart.file("values.yaml"))
    (rel,) = [r for r in helm_releases(cfg) if r.chart == "nvidia-device-plugin"]
    merged = {**values, **rel.values}
    assert not merged.get("nfd", {}).get("enabled") and not merged.get("gfd", {}).get("enabled")
    assert not [o for o in rendered(rel.name) if "node-feature-discovery" in json.dumps(o.get("metadata", {}))]


# ------------------------------------------------------------------------------------------------------------------
# Rendered by real Helm, both majors
# ------------------------------------------------------------------------------------------------------------------


def test_the_rendered_fixtures_are_what_real_helm_renders_with_the_tools_values(cfg, tmp_path, real_tools):
    written = written_values(cfg, tmp_path)
    for rel in helm_releases(cfg):
        values = written[rel.name]
        assert values.read_text() == values_path(rel.name).read_text(), (
            f"the tool now writes other values for {rel.name}: render {rendered_path(rel.name)} again (see SOURCE.md)"
        )
        for major, helm in real_tools.helms.items():
            done = real_tools.run(helm, template_args(rel, values))
            assert done.returncode == 0, f"{major}: {done.stderr}"
            assert done.stdout == rendered_path(rel.name).read_text(), (
                f"{major} renders {rel.name} differently from {rendered_path(rel.name)} (see SOURCE.md to render it)"
            )


def test_kuberays_crds_are_the_ones_helm_installs(cfg, real_tools, tmp_path):
    (rel,) = [r for r in helm_releases(cfg) if r.name == addons.KUBERAY_RELEASE]
    values = written_values(cfg, tmp_path)[rel.name]
    heads = crds(vendored(rel.chart, rel.version))
    names = [c["metadata"]["name"] for c in heads]
    assert addons.RAYCLUSTER_CRD in names and "rayjobs.ray.io" in names
    for major, helm in real_tools.helms.items():
        done = real_tools.run(helm, [*template_args(rel, values), "--include-crds"])
        assert done.returncode == 0, f"{major}: {done.stderr}"
        # Each document's head only (the CRDs' schemas are megabytes of YAML): "---", apiVersion, kind, metadata.
        docs = [yaml.safe_load(doc.split("\nspec:")[0]) for doc in done.stdout.split("\n---\n")]
        found = [
            (d["apiVersion"], d["kind"], d["metadata"]["name"])
            for d in docs
            if d and d["kind"] == "CustomResourceDefinition"
        ]
        assert found == [(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in heads], major


# ------------------------------------------------------------------------------------------------------------------
# What the tool's waits, checks and deletes look for, in what the charts render
# ------------------------------------------------------------------------------------------------------------------


def gpu_node(cfg: Config) -> tuple[dict[str, str], list[dict[str, str]]]:
    """A GPU node's labels and taints: what the node group sets (the tool's constants) and what EKS's kubelet adds."""
    labels = {
        **m.GPU_NODE_LABELS,
        "node.kubernetes.io/instance-type": cfg.cluster.gpu_node_type,
        "topology.kubernetes.io/zone": "us-east-1a",
    }
    return labels, [dict(m.GPU_TAINT)]


def system_node(cfg: Config) -> tuple[dict[str, str], list[dict[str, str]]]:
    return {**m.SYSTEM_NODE_LABELS, "node.kubernetes.io/instance-type": cfg.cluster.system_node_type}, []


def _workload(rel: HelmRelease) -> dict[str, Any]:
    kind, name = rel.workload
    found = [o for o in rendered(rel.name) if (o["kind"], o["metadata"]["name"]) == (kind, name)]
    assert len(found) == 1, (
        f"{rel.name} renders no {kind} {name}: {[o['metadata']['name'] for o in rendered(rel.name)]}"
    )
    return found[0]


def test_the_charts_main_objects_are_where_the_tool_looks(cfg):
    for rel in helm_releases(cfg):
        obj = _workload(rel)
        assert obj["apiVersion"] == "apps/v1"
        # A namespaced object without a namespace goes to the release's (helm's --namespace).
        assert obj["metadata"].get("namespace", rel.namespace) == rel.namespace
        # _plugin_problems and wait_kuberay find them by the release's label, and their pods by the selector.
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == rel.name
        selector = obj["spec"]["selector"]["matchLabels"]
        pod_labels = obj["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
    (kuberay,) = [r for r in helm_releases(cfg) if r.name == addons.KUBERAY_RELEASE]
    pods = _workload(kuberay)["spec"]["template"]["metadata"]["labels"]
    assert pods["app.kubernetes.io/instance"] == addons.KUBERAY_RELEASE and kuberay.namespace == "kuberay-system"
    assert {r.name for r in helm_releases(cfg)} >= set(addons.DEVICE_PLUGIN_RELEASES)


def test_the_device_plugins_run_on_the_gpu_nodes_the_tool_makes(cfg):
    labels, taints = gpu_node(cfg)
    for rel in [r for r in helm_releases(cfg) if r.name in addons.DEVICE_PLUGIN_RELEASES]:
        spec = _workload(rel)["spec"]["template"]["spec"]
        placement = Placement.of(spec)
        assert placement.refusal(labels, taints) is None, f"{rel.name}: {placement.refusal(labels, taints)}"
        # Both tolerate the GPU taint, and the toleration is what lets them on.
        assert placement.refusal(labels, [{"key": "other", "value": "x", "effect": "NoSchedule"}]) is not None
        assert device_plugin_resource(spec) in (m.GPU_RESOURCE, m.EFA_RESOURCE)
    nvidia = Placement.of(_workload(helm_releases(cfg)[0])["spec"]["template"]["spec"])
    # The NVIDIA chart's affinity wants nvidia.com/gpu.present=true, which only the node group's labels set.
    assert nvidia.refusal({k: v for k, v in labels.items() if k != "nvidia.com/gpu.present"}, taints) is not None
    # The MPS control daemon the NVIDIA chart also renders runs only where nvidia.com/mps.capable=true: not here,
    # so the checks must not wait for it (they look at the workload only).
    others = [o for o in rendered("nvidia-device-plugin") if o["kind"] == "DaemonSet"]
    assert [o["metadata"]["name"] for o in others] == [
        "nvidia-device-plugin",
        "nvidia-device-plugin-mps-control-daemon",
    ]
    mps = others[1]["spec"]["template"]["spec"]
    assert Placement.of(mps).refusal(labels, taints) is not None and device_plugin_resource(mps) is None


def test_the_efa_charts_instance_types_include_every_efa_gpu_type_the_tool_takes(cfg):
    (rel,) = [r for r in helm_releases(cfg) if r.name == "aws-efa-k8s-device-plugin"]
    placement = Placement.of(_workload(rel)["spec"]["template"]["spec"])
    labels, taints = gpu_node(cfg)
    assert cfg.cluster.gpu_node_type in EFA_GPU_TYPES
    refused = {t: placement.refusal({**labels, "node.kubernetes.io/instance-type": t}, taints) for t in EFA_GPU_TYPES}
    assert {t: why for t, why in refused.items() if why} == {}
    assert placement.refusal({**labels, "node.kubernetes.io/instance-type": "m7i.xlarge"}, taints) is not None


def test_the_kuberay_operator_lands_on_the_system_node_only(cfg):
    (rel,) = [r for r in helm_releases(cfg) if r.name == addons.KUBERAY_RELEASE]
    placement = Placement.of(_workload(rel)["spec"]["template"]["spec"])
    assert placement.refusal(*system_node(cfg)) is None
    assert placement.refusal(*gpu_node(cfg)) is not None


def test_eksctls_efa_plugin_has_the_charts_name_and_no_helm_ownership(cfg):
    ds = eksctl_efa_daemon_set()
    (rel,) = [r for r in helm_releases(cfg) if r.name == "aws-efa-k8s-device-plugin"]
    assert (ds["metadata"]["name"], ds["metadata"]["namespace"]) == (eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET, "kube-system")
    assert ("DaemonSet", ds["metadata"]["name"]) == rel.workload, "the same name: Helm refuses to install over it"
    assert not addons.owned_by(ds, rel)
    chart_copy = {**_workload(rel), "metadata": {**_workload(rel)["metadata"], "namespace": rel.namespace}}
    chart_copy["metadata"]["annotations"] = {
        addons.HELM_RELEASE_NAME: rel.name,
        addons.HELM_RELEASE_NAMESPACE: rel.namespace,
    }
    assert addons.owned_by(chart_copy, rel), "what Helm installs (the chart's labels and Helm's annotations)"
    # eksctl's copy does not tolerate the GPU taint, so on the tool's GPU nodes it never runs.
    assert Placement.of(ds["spec"]["template"]["spec"]).refusal(*gpu_node(cfg)) is not None
    nvidia = (CHARTS.parent / "eksctl" / "pkg" / "addons" / "assets" / "nvidia-device-plugin.yaml").read_text()
    (doc,) = [d for d in yaml.safe_load_all(nvidia) if d]
    assert doc["metadata"]["name"] == eksctl.EKSCTL_NVIDIA_PLUGIN_DAEMONSET


def test_the_fake_keeps_an_object_deleted_in_the_foreground_until_its_pods_are_gone():
    kube = FakeKube()
    kube.foreground_delete_s = 30.0
    kube.put(eksctl_efa_daemon_set())
    assert kube.delete("apps/v1", "DaemonSet", eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET, "kube-system")
    kept = kube.get("apps/v1", "DaemonSet", eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET, "kube-system")
    assert kept is not None and kept["metadata"]["deletionTimestamp"]
    assert kept["metadata"]["finalizers"] == ["foregroundDeletion"]
    kube.sleep(29)
    assert kube.has("apps/v1", "DaemonSet", eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET, "kube-system")
    kube.sleep(1)
    assert not kube.has("apps/v1", "DaemonSet", eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET, "kube-system")


def _efa_installs(w: World) -> list[list[str]]:
    return [c for c in w.tools.commands("helm", "upgrade") if c[3] == "aws-efa-k8s-device-plugin"]


def test_up_installs_the_efa_chart_only_once_eksctls_daemonset_is_gone(tmp_path, monkeypatch, aws_env):
    # eksctl's copy is deleted in the foreground and stays while its pods end: Helm would refuse to install over it.
    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={}, path=None))
    w.kube.foreground_delete_s = 45.0
    w.up()
    where = f"DaemonSet kube-system/{eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET}"
    waited = next(i for i, line in enumerate(w.lines) if line.startswith(f"Waiting for {where} to be deleted"))
    assert "(finalizers: foregroundDeletion)" in w.lines[waited]
    installing = next(i for i, line in enumerate(w.lines) if line.startswith("Installing eks/aws-efa-k8s-device"))
    assert waited < installing and len(_efa_installs(w)) == 1
    efa = w.kube.get("apps/v1", "DaemonSet", eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET, "kube-system")
    (rel,) = [r for r in helm_releases(w.d.cfg) if r.name == "aws-efa-k8s-device-plugin"]
    assert addons.owned_by(efa, rel) and "deletionTimestamp" not in efa["metadata"]


def test_a_daemonset_that_is_never_deleted_stops_up_naming_it_before_helm_runs(tmp_path, monkeypatch, aws_env):
    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={}, path=None))
    w.kube.foreground_delete_s = 1e9  # a pod that never ends (its node stopped answering)
    with pytest.raises(UserError) as err:
        w.up()
    where = f"DaemonSet kube-system/{eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET}"
    assert err.value.message.startswith(f"{where} is still there after {addons.WORKLOAD_GONE_TIMEOUT_S} s")
    assert "the chart aws-efa-k8s-device-plugin cannot be installed" in err.value.message
    assert "kubectl --kubeconfig" in (err.value.hint or "") and "raytrain-eks up" in (err.value.hint or "")
    assert not _efa_installs(w)


# ------------------------------------------------------------------------------------------------------------------
# The release's metadata, as both Helm majors print it
# ------------------------------------------------------------------------------------------------------------------

UNREACHABLE_KUBECONFIG = """apiVersion: v1
kind: Config
clusters:
- name: nowhere
  cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}
users:
- name: token
  user: {token: not-a-secret}
contexts:
- name: nowhere
  context: {cluster: nowhere, user: token}
current-context: nowhere
"""


class RealHelm:
    """A :class:`~raytrain_eks.k8s.runner.Runner` running real helm (``helm`` -> the given binary) with ``env``."""

    def __init__(self, real_tools: Any, binary: Path, env: dict[str, str]) -> None:
        self.real_tools, self.binary, self.env = real_tools, binary, env

    def __call__(self, argv: list[str], *, timeout: float, check: bool = True, **_: Any) -> Completed:
        assert argv[0] == "helm"
        done = self.real_tools.run(self.binary, argv[1:], env=self.env, timeout=min(timeout, 60))
        if check and done.returncode:
            raise CommandError(argv, done.returncode, done.stderr)
        return Completed(tuple(argv), done.returncode, done.stdout, done.stderr)


# A release as Helm stores it (helm/helm pkg/release/release.go: name, namespace, version, info.status,
# chart.metadata), for Helm's memory driver: HELM_DRIVER=memory reads HELM_MEMORY_DRIVER_DATA and talks to no
# cluster (cmd/helm/helm.go loadReleasesInMemory, v3.17.3; pkg/cmd/root.go, v4.1.4).
STORED = """- name: nvidia-device-plugin
  namespace: kube-system
  version: 3
  info: {status: deployed}
  chart: {metadata: {name: nvidia-device-plugin, version: 0.20.0, appVersion: 0.20.0}}
- name: aws-efa-k8s-device-plugin
  namespace: kube-system
  version: 1
  info: {status: pending-install}
  chart: {metadata: {name: aws-efa-k8s-device-plugin, version: v0.5.30, appVersion: v0.5.20}}
"""


@pytest.mark.parametrize("major", ["helm3", "helm4"])
def test_release_metadata_of_both_helm_majors(cfg, tmp_path, real_tools, major):
    stored = tmp_path / "releases.yaml"
    stored.write_text(STORED)
    (tmp_path / "kubeconfig").write_text(UNREACHABLE_KUBECONFIG)
    helm = RealHelm(
        real_tools, real_tools.helms[major], {"HELM_DRIVER": "memory", "HELM_MEMORY_DRIVER_DATA": str(stored)}
    )
    d = Deployment(cfg=cfg, kube=FakeKube(), run=helm, state=StateStore(tmp_path))
    info = addons.release_info(d, "nvidia-device-plugin", "kube-system")
    assert (info["status"], info["version"], info["revision"]) == ("deployed", "0.20.0", 3)
    assert addons.release_info(d, "aws-efa-k8s-device-plugin", "kube-system")["status"] == "pending-install"
    assert addons.release_info(d, "kuberay-operator", "kuberay-system") is None
    # Anything else than "no such release" is an error, never "not installed".
    d.run = RealHelm(real_tools, real_tools.helms[major], {})
    with pytest.raises(CommandError) as err:
        addons.release_info(d, "nvidia-device-plugin", "kube-system")
    assert "cluster unreachable" in err.value.message.lower() and "connection refused" in err.value.message


def test_release_metadata_json_as_helms_struct_writes_it(cfg, tmp_path):
    # helm get metadata --output json writes action.Metadata (helm/helm pkg/action/get_metadata.go, v3.17.3 and
    # v4.1.4: name, chart, version, appVersion, namespace, revision, status, deployedAt; v4 adds applyMethod).
    answers = {
        "nvidia-device-plugin": (
            0,
            '{"name":"nvidia-device-plugin","chart":"nvidia-device-plugin","version":"0.20.0","appVersion":"0.20.0",'
            '"namespace":"kube-system","revision":1,"status":"deployed","deployedAt":"2026-12-02T10:00:00Z",'
            '"applyMethod":"ssa"}\n',
            "",
        ),
        "aws-efa-k8s-device-plugin": (1, "", "Error: release: not found\n"),
        "kuberay-operator": (1, "", 'Error: Kubernetes cluster unreachable: Get "https://x/version": EOF\n'),
        # A Helm without `helm get metadata` (before 3.13): what Helm 3.17 says for a `helm get` it does not have.
        "old-helm": (1, "", "Error: unknown flag: --output\n"),
    }

    def run(argv: list[str], **_: Any) -> Completed:
        assert argv[:3] == ["helm", "get", "metadata"] and "--kubeconfig" in argv
        return Completed(tuple(argv), *answers[argv[3]])

    d = Deployment(cfg=cfg, kube=FakeKube(), run=run, state=StateStore(tmp_path))
    assert addons.release_info(d, "nvidia-device-plugin", "kube-system")["version"] == "0.20.0"
    assert addons.release_info(d, "aws-efa-k8s-device-plugin", "kube-system") is None
    with pytest.raises(CommandError, match="cluster unreachable"):
        addons.release_info(d, "kuberay-operator", "kuberay-system")
    with pytest.raises(CommandError, match="unknown flag") as err:
        addons.release_info(d, "old-helm", "kube-system")
    assert "Helm 3.13 or later, or Helm 4" in (err.value.hint or "")
