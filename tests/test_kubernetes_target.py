"""The ``kubernetes`` target (``cluster.target: kubernetes``): an existing cluster of the user's kubeconfig.

Against the deploy tests' fakes (FakeKube's DaemonSet controller, scheduler and KubeRay; FakeTools' helm; FakeRay in
the pods), with one difference: the charts' objects are what real Helm 4 renders (``helm template`` of the vendored
chart with the values file the tool wrote), since on this target the values follow the user's node labels. Two
clusters: one of GPU nodes with no device plugin and no EFA (a cloud other than AWS), where up installs the NVIDIA
plugin and KubeRay; and one of EKS nodes whose plugins and KubeRay someone else installed, with EFA, where up
installs nothing. Every helm and kubectl command line is then parsed by the real binaries (test_command_lines).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from charts import crds, vendored
from fake_kube import ZONE_LABEL, FakeKube, NodePool
from test_charts import UNREACHABLE_KUBECONFIG
from test_command_lines import Collector, chart_repo, check  # noqa: F401 - chart_repo: the fixture
from test_deploy import TOKEN, FakeRay, FakeTools

from raytrain_eks.config import load_config
from raytrain_eks.deploy import submit as sub
from raytrain_eks.deploy.target import target_for
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.state import Cancelled, Deployment, StateStore
from raytrain_eks.kubernetes import existing

CONTEXT = "nowhere"  # the context of UNREACHABLE_KUBECONFIG: real helm and kubectl parse the lines against it
GPU_LABELS = {"pool": "gpu", existing.INSTANCE_TYPE_LABEL: "a2-highgpu-4g"}  # a Google Cloud node with 4 A100s
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}  # as GKE taints GPU node pools


def _helm_template(real_tools: Any) -> Any:
    def render(name: str, ns: str, values: Path) -> list[dict[str, Any]]:
        found = vendored(name)  # each release has its chart's name
        done = real_tools.run(
            real_tools.helm4, ["template", name, str(found.path), "--namespace", ns, "--values", str(values)]
        )
        assert done.returncode == 0, done.stderr
        return [d for d in yaml.safe_load_all(done.stdout) if d]

    return render


class Cluster:
    """A deployment on the kubernetes target against the fakes; ``lines`` is what it said."""

    def __init__(
        self, tmp: Path, real_tools: Any, *sets: str, storage: str | None = "s3://team-checkpoints/runs"
    ) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = tmp / "user-kubeconfig"
        self.kubeconfig.write_text(UNREACHABLE_KUBECONFIG)
        given = ["cluster.target=kubernetes", f"cluster.kubeconfig={self.kubeconfig}", f"cluster.context={CONTEXT}"]
        if storage:
            given.append(f"training.storage_path={storage}")  # every node reaches it
        self.cfg = load_config(environ={}, path=None, sets=[*given, *sets])
        self.kube = FakeKube()
        self.tools = FakeTools(self.kube)
        self.tools.render = _helm_template(real_tools)
        self.ray = FakeRay(tmp)
        self.kube.exec_handler = self.ray
        self.lines: list[str] = []
        self.store = StateStore(tmp / ".raytrain-eks")
        self.target = target_for(self.cfg)
        self.questions: list[str] = []

    def d(self) -> Deployment:
        """As the commands build it: with what up remembered applied."""
        return Deployment(
            cfg=existing.remembered(self.cfg, self.store),
            kube=self.kube,
            run=self.tools,
            state=self.store,
            say=self.lines.append,
            sleep=self.kube.sleep,
            clock=self.kube.monotonic,
            require_tool=self.tools.require,
            kubeconfig_file=str(self.kubeconfig),
            context=CONTEXT,
        )

    def ask(self, answer: bool = True) -> Any:
        def confirm(question: str) -> bool:
            self.questions.append(question)
            return answer

        return confirm

    def said(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def plain(tmp_path: Path, real_tools: Any, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """GPU nodes without a device plugin and without EFA, a CPU node, no KubeRay; the GPU nodes are found by label."""
    monkeypatch.chdir(tmp_path)
    c = Cluster(tmp_path, real_tools, "cluster.gpu_node_selector={pool: gpu}")
    c.kube.add_node("cpu-0", labels={"pool": "general"}, allocatable={"cpu": "7910m", "memory": "29Gi"})
    for i in range(2):
        c.kube.add_node(
            f"gpu-{i}",
            labels=GPU_LABELS,
            allocatable={"cpu": "11", "memory": "80Gi"},
            taints=[GPU_TAINT],
            devices={m.GPU_RESOURCE: "4"},  # the hardware: advertised only once a device plugin runs there
        )
    return c


def _eks_gpu_node(c: Cluster, name: str, zone: str) -> None:
    """A GPU node of an EKS node group with EFA, in ``zone`` (as EKS labels every node)."""
    c.kube.add_node(
        name,
        labels={
            existing.INSTANCE_TYPE_LABEL: "g6.12xlarge",
            "eks.amazonaws.com/nodegroup": "gpu",
            "kubernetes.io/hostname": name,
            ZONE_LABEL: zone,
        },
        allocatable={"cpu": "47", "memory": "185Gi", m.GPU_RESOURCE: "4", m.EFA_RESOURCE: "1"},
    )


@pytest.fixture
def efa(tmp_path: Path, real_tools: Any, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """An EKS cluster used as it is: its GPU nodes (one zone) advertise GPUs and EFA, KubeRay's CRD is there."""
    monkeypatch.chdir(tmp_path)
    c = Cluster(tmp_path, real_tools)
    for i in range(2):
        _eks_gpu_node(c, f"ip-10-0-1-{i}", "us-east-1a")
    cpu = {"cpu": "3920m", "memory": "14Gi"}
    c.kube.add_node("ip-10-0-2-9", labels={ZONE_LABEL: "us-east-1b"}, allocatable=cpu)
    for crd in crds(vendored("kuberay-operator")):  # installed earlier by the team: KubeRay 1.7.0's own CRDs
        c.kube.put(crd)
    return c


def _two_zones(tmp: Path, real_tools: Any, *sets: str) -> Cluster:
    """An EKS cluster whose GPU node group spans two zones: one GPU node in us-east-1b (listed first, so that a
    scheduler filling nodes in order would split a job) and two in us-east-1a, all with EFA; KubeRay's CRDs."""
    c = Cluster(tmp, real_tools, *sets)
    _eks_gpu_node(c, "ip-10-0-2-0", "us-east-1b")
    for i in range(2):
        _eks_gpu_node(c, f"ip-10-0-1-{i}", "us-east-1a")
    for crd in crds(vendored("kuberay-operator")):
        c.kube.put(crd)
    return c


ON_DEMAND = (
    "cluster.gpu_nodes_on_demand=true",
    "cluster.gpu_node_selector={karpenter.sh/nodepool: gpu}",
    "cluster.efa_per_node=1",
    "ray.worker_cpu=39",
    "ray.worker_memory_gib=154",
)


@pytest.fixture
def on_demand(tmp_path: Path, real_tools: Any, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    """An EKS cluster with Karpenter: a CPU node now, and a GPU node pool whose nodes (EFA, the NVIDIA and EFA
    plugins in their image) are launched only for worker pods that cannot be scheduled; no KubeRay yet."""
    monkeypatch.chdir(tmp_path)
    c = Cluster(tmp_path, real_tools, *ON_DEMAND)
    c.kube.add_node("ip-10-0-2-9", labels={}, allocatable={"cpu": "7910m", "memory": "29Gi"})
    c.kube.node_pool = NodePool(
        "gpu",
        labels={"karpenter.sh/nodepool": "gpu", existing.INSTANCE_TYPE_LABEL: "g6.12xlarge"},
        allocatable={"cpu": "47", "memory": "185Gi", m.GPU_RESOURCE: "4", m.EFA_RESOURCE: "1"},
        taints=({"key": "nvidia.com/gpu", "effect": "NoSchedule"},),
    )
    return c


def test_gpu_nodes_on_demand_are_not_required_at_up_and_come_with_the_worker_pods(on_demand: Cluster):
    c = on_demand
    c.target.up(c.d(), confirm=c.ask())
    (question,) = c.questions
    assert "kuberay-operator" in question and "device-plugin" not in question  # the nodes' image brings them
    assert "GPU nodes on demand (cluster.gpu_nodes_on_demand), 0 there now" in c.said()
    assert "come when the worker pods ask for them" in c.said() and len(c.kube.nodes()) == 1
    started = c.kube.time
    result = sub.submit(c.d())
    assert result.exit_code == 0 and result.report is not None and result.report.verdict == "efa", c.said()
    (group,) = _workers(c)
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    assert (limits[m.GPU_RESOURCE], limits[m.EFA_RESOURCE], limits["cpu"], limits["memory"]) == (
        "4",
        "1",
        "39",
        "154Gi",
    )
    assert group["template"]["spec"]["nodeSelector"] == {"karpenter.sh/nodepool": "gpu"}
    pods = c.kube.pods("default", {"ray.io/cluster": c.cfg.ray.cluster_name})
    assert sorted(p.node_name for p in pods if "worker" in p.name) == ["gpu-0", "gpu-1"]  # launched for them
    assert c.kube.time - started >= 90  # submit waited while the pool's nodes joined


def test_gpu_nodes_on_demand_need_their_shape_in_the_settings_and_target_kubernetes(tmp_path: Path):
    base = ["cluster.target=kubernetes", "cluster.gpu_nodes_on_demand=true"]
    with pytest.raises(ConfigError, match="set cluster.efa_per_node to the EFA interfaces each GPU node will have"):
        load_config(environ={}, path=None, sets=base)
    with pytest.raises(ConfigError, match="set ray.worker_cpu and ray.worker_memory_gib"):
        load_config(environ={}, path=None, sets=[*base, "cluster.efa_per_node=0"])
    with pytest.raises(ConfigError, match="applies to target kubernetes"):
        load_config(environ={}, path=None, sets=["cluster.gpu_nodes_on_demand=true"])


def _workers(c: Cluster) -> list[dict[str, Any]]:
    (cluster,) = [o for o in c.kube.applied if o["kind"] == "RayCluster"]
    return cluster["spec"]["workerGroupSpecs"]


def test_up_on_a_cluster_without_efa_installs_only_the_missing_plugin_and_kuberay(plain: Cluster):
    nodes = plain.target.up(plain.d(), confirm=plain.ask())
    assert nodes == ["gpu-0", "gpu-1"]
    (question,) = plain.questions
    assert "nvidia-device-plugin" in question and "kuberay-operator" in question
    assert "aws-efa-k8s-device-plugin" not in question and "nothing is created in any cloud" in question
    installs = plain.tools.commands("helm", "upgrade", "--install")
    assert [c[3] for c in installs] == ["nvidia-device-plugin", "kuberay-operator"]
    for argv in installs:  # the user's kubeconfig and context, never a file of this folder
        assert argv[argv.index("--kubeconfig") + 1] == str(plain.kubeconfig)
        assert argv[argv.index("--kube-context") + 1] == CONTEXT
    assert not plain.tools.commands("eksctl")
    # The NVIDIA plugin runs on the labelled GPU nodes (tolerating their taint) and made them advertise GPUs.
    advertised = {n.name: n.allocatable.get(m.GPU_RESOURCE) for n in plain.kube.nodes()}
    assert advertised == {"cpu-0": None, "gpu-0": "4", "gpu-1": "4"}
    state = json.loads(plain.store.path.read_text())
    assert (state["target"], state["context"], state["efa_per_node"]) == ("kubernetes", CONTEXT, 0)
    assert (state["worker_cpu"], state["worker_memory_gib"]) == (9, 66)  # 5/6 of the nodes' allocatable
    assert "no EFA" in plain.said() and "leaves out the memory estimate" in plain.said()
    assert "--set cluster.gpu_node_type=TYPE" in plain.said()  # and how to have it
    # Again: everything is there now; nothing is asked or installed.
    plain.questions.clear()
    plain.target.up(plain.d(), confirm=plain.ask())
    assert plain.questions == [] and len(plain.tools.commands("helm", "upgrade", "--install")) == 2


def test_declining_installs_nothing(plain: Cluster):
    with pytest.raises(Cancelled):
        plain.target.up(plain.d(), confirm=plain.ask(False))
    assert not plain.tools.commands("helm", "upgrade", "--install") and not plain.store.created


def test_no_gpu_node_found_is_one_message_before_anything(plain: Cluster):
    other = Cluster(plain.kubeconfig.parent / "x", None, "cluster.gpu_node_selector={pool: gpus}")
    other.kube = plain.kube
    with pytest.raises(UserError, match=r"no node .* matches the labels \{'pool': 'gpus'\}") as err:
        other.target.up(other.d(), confirm=other.ask())
    assert "gpu_node_selector" in (err.value.hint or "") and not other.questions


def test_submit_on_a_cluster_without_efa_requests_none_and_requires_any(plain: Cluster):
    plain.target.up(plain.d(), confirm=plain.ask())
    result = sub.submit(plain.d(), hf_token=TOKEN)
    assert result.exit_code == 0, plain.said()
    (group,) = _workers(plain)
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    assert m.EFA_RESOURCE not in container["resources"]["limits"]
    assert container["resources"]["limits"][m.GPU_RESOURCE] == "4"
    assert (container["resources"]["limits"]["cpu"], container["resources"]["limits"]["memory"]) == ("9", "66Gi")
    assert pod["nodeSelector"] == {"pool": "gpu"}
    (cluster,) = [o for o in plain.kube.applied if o["kind"] == "RayCluster"]
    assert "nodeSelector" not in cluster["spec"]["headGroupSpec"]["template"]["spec"]
    config = yaml.safe_load(next(o for o in plain.kube.applied if o["kind"] == "ConfigMap")["data"][m.CONFIG_FILE])
    assert config["fabric"]["require"] == "any" and config["cluster"]["efa_per_node"] == 0
    assert "memory estimate is left out" in plain.said()
    pods = plain.kube.pods("default", {"ray.io/cluster": plain.cfg.ray.cluster_name})
    assert sorted(p.node_name for p in pods if "worker" in p.name) == ["gpu-0", "gpu-1"]


def test_an_efa_cluster_gets_efa_requested_and_required(efa: Cluster):
    efa.target.up(efa.d(), confirm=efa.ask())
    assert not efa.tools.commands("helm", "upgrade", "--install")
    (question,) = efa.questions  # only the service account is created
    assert "ServiceAccount default/raytrain-eks-ray" in question and "Helm release" not in question
    result = sub.submit(efa.d())
    assert result.exit_code == 0 and result.report is not None and result.report.verdict == "efa", efa.said()
    (group,) = _workers(efa)
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"][m.EFA_RESOURCE] == "1"
    assert (container["resources"]["limits"]["cpu"], container["resources"]["limits"]["memory"]) == ("39", "154Gi")
    # The GPU request alone keeps them on GPU nodes; EFA keeps them in the nodes' one zone.
    assert group["template"]["spec"]["nodeSelector"] == {ZONE_LABEL: "us-east-1a"}
    config = yaml.safe_load(next(o for o in efa.kube.applied if o["kind"] == "ConfigMap")["data"][m.CONFIG_FILE])
    assert config["fabric"]["require"] == "efa" and config["cluster"]["gpu_node_type"] == "g6.12xlarge"
    assert "memory estimate is left out" not in efa.said()  # the nodes' EC2 type is known: it was made


def test_on_an_efa_cluster_logs_status_and_down_read_and_remove_only_this_tools_part(efa: Cluster):
    efa.target.up(efa.d(), confirm=efa.ask())
    result = sub.submit(efa.d())
    assert result.exit_code == 0, efa.said()
    efa.lines.clear()
    assert sub.logs(efa.d()) == 0
    assert "step 20 loss 1.87" in efa.said()  # the job's output, read in the head pod
    (head,) = [c for c in efa.kube.exec_calls if c[2][:3] == ["ray", "job", "logs"]][-1:]
    assert head[1].startswith(f"{efa.cfg.ray.cluster_name}-head") and head[2][-1] == result.submission_id
    lines = efa.target.status(efa.d())
    gpu_lines = [line for line in lines if line.startswith("GPU node ip-10-0-1-")]
    assert len(gpu_lines) == 2 and all(f"{m.EFA_RESOURCE}=1 Ready" in line for line in gpu_lines)
    assert not [line for line in lines if "problem:" in line]
    efa.target.down(efa.d(), confirm=efa.ask())
    assert not efa.tools.commands("helm", "uninstall")  # it installed no chart here
    deleted = {(k, n) for _, k, n, _ in efa.kube.deleted}
    assert {("RayCluster", "ray-train"), ("ServiceAccount", "raytrain-eks-ray")} <= deleted
    assert efa.kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", "rayclusters.ray.io") is not None
    assert len(efa.kube.nodes()) == 3 and not efa.store.path.exists()


def test_efa_the_nodes_do_not_have_is_refused_or_installed(efa: Cluster, plain: Cluster):
    wants = Cluster(efa.kubeconfig.parent / "more", None, "cluster.efa_per_node=2")
    wants.kube, wants.tools = efa.kube, efa.tools
    with pytest.raises(UserError, match="efa_per_node = 2, and the GPU nodes advertise vpc.amazonaws.com/efa=1"):
        wants.target.up(wants.d(), confirm=wants.ask())
    asks = Cluster(
        plain.kubeconfig.parent / "asks", None, "cluster.gpu_node_selector={pool: gpu}", "cluster.efa_per_node=1"
    )
    asks.kube = plain.kube
    with pytest.raises(Cancelled):
        asks.target.up(asks.d(), confirm=asks.ask(False))
    assert "aws-efa-k8s-device-plugin" in asks.questions[0]


def test_status_and_down_remove_only_what_was_created(plain: Cluster):
    plain.target.up(plain.d(), confirm=plain.ask())
    assert sub.submit(plain.d(), hf_token=TOKEN).exit_code == 0
    lines = plain.target.status(plain.d())
    assert lines[0] == f"Kubernetes: the cluster of {plain.kubeconfig} (context {CONTEXT})"
    assert any(line.startswith("GPU node gpu-0: nvidia.com/gpu=4") for line in lines)
    assert any(line.startswith("Ray pod ") for line in lines) and any("Last job" in line for line in lines)
    plain.target.down(plain.d(), confirm=plain.ask())
    uninstalled = [c[2] for c in plain.tools.commands("helm", "uninstall")]
    assert uninstalled == ["kuberay-operator", "nvidia-device-plugin"]  # newest first
    deleted = {(k, n) for _, k, n, _ in plain.kube.deleted}
    assert {("RayCluster", "ray-train"), ("ServiceAccount", "raytrain-eks-ray"), ("Secret", "hf-token")} <= deleted
    assert not plain.store.path.exists()
    assert [n.name for n in plain.kube.nodes()] == ["cpu-0", "gpu-0", "gpu-1"]  # the cluster stays
    plain.lines.clear()
    assert plain.target.down(plain.d(), confirm=plain.ask()) == [] and "Nothing to delete" in plain.said()


def test_a_folder_of_an_eks_deployment_is_not_reused_for_another_cluster(plain: Cluster):
    plain.store.update(cluster="ray-train-eks", region="us-east-1")
    plain.store.record({"type": "cluster", "name": "ray-train-eks", "region": "us-east-1"})
    with pytest.raises(UserError, match="records an EKS deployment"):
        plain.target.up(plain.d(), confirm=plain.ask())


def test_every_command_line_parses_with_the_real_binaries(
    plain: Cluster,
    real_tools: Any,
    chart_repo: Any,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
):
    plain.target.up(plain.d(), confirm=plain.ask())
    assert sub.submit(plain.d(), hf_token=TOKEN).exit_code == 0
    with pytest.raises(UserError) as err:  # a RayJob beside the RayCluster: the hint says how to delete that
        sub.submit(plain.d(), mode="rayjob")
    found = Collector()
    found.error(err.value, tmp_path, "submit --mode rayjob beside a RayCluster")
    found.text("\n".join(plain.target.status(plain.d())), tmp_path, "status")
    for argv in plain.tools.calls:
        found.add(argv, tmp_path, "up and submit")
    found.text(plain.said(), tmp_path, "up and submit")
    home = tmp_path / "checks"
    home.mkdir()
    before = found.take()
    problems = check(before, real_tools, chart_repo, home)  # before down, which removes the values files they name
    plain.target.down(plain.d(), confirm=plain.ask())
    for argv in plain.tools.calls:
        found.add(argv, tmp_path, "down")
    after = [c for c in found.take() if c.argv not in {b.argv for b in before}]
    problems += check(after, real_tools, chart_repo, home)
    commands = before + after
    verbs = {" ".join(c.argv[:3]) for c in commands}
    assert {"helm upgrade --install", "helm get metadata", "helm uninstall kuberay-operator"} <= verbs, sorted(verbs)
    assert any(c.argv[0] == "kubectl" for c in commands)
    assert all(CONTEXT in c.argv for c in commands), "every line names the context"
    assert not problems, "\n".join(problems)


def test_hugging_face_wandb_and_mlflow_settings_reach_the_job_through_a_secret_only(plain: Cluster):
    environ = {
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "1",
        "WANDB_API_KEY": "wandb-key-0123456789abcdef",
        "WANDB_PROJECT": "fine-tunes",
        "MLFLOW_TRACKING_URI": "http://mlflow.internal:5000",
        "MLFLOW_TRACKING_PASSWORD": "mlflow-pass-42",
        "HOME": "/root",
        "WANDB_MODE": "",
    }
    env = m.passed_env(environ)
    assert list(env) == [
        "HF_HUB_OFFLINE",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_URI",
        "WANDB_API_KEY",
        "WANDB_PROJECT",
    ]
    plain.target.up(plain.d(), confirm=plain.ask())
    assert sub.submit(plain.d(), hf_token=TOKEN, env=env).exit_code == 0
    (secret,) = [o for o in plain.kube.applied if o["metadata"]["name"] == m.job_env_secret_name(plain.cfg)]
    assert secret["kind"] == "Secret" and secret["stringData"] == env
    (cluster,) = [o for o in plain.kube.applied if o["kind"] == "RayCluster"]
    templates = [cluster["spec"]["headGroupSpec"]["template"], cluster["spec"]["workerGroupSpecs"][0]["template"]]
    for template in templates:
        (container,) = template["spec"]["containers"]
        assert {"secretRef": {"name": m.job_env_secret_name(plain.cfg), "optional": True}} in container["envFrom"]
    hidden = [TOKEN, "wandb-key-0123456789abcdef", "mlflow-pass-42"]
    outside = json.dumps([o for o in plain.kube.applied if o["kind"] != "Secret"]) + json.dumps(plain.tools.calls)
    outside += json.dumps(plain.kube.exec_calls) + plain.said()
    assert not [h for h in hidden if h in outside]
    assert "passed to the job: HF_HUB_OFFLINE, MLFLOW_TRACKING_PASSWORD" in plain.said()


def _claim(c: Cluster, modes: list[str]) -> None:
    c.kube.put(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "checkpoints", "namespace": "default"},
            "spec": {"accessModes": modes, "storageClassName": "efs-sc", "resources": {"requests": {"storage": "1Ti"}}},
        }
    )


def test_a_read_write_many_volume_is_mounted_into_every_ray_pod_and_holds_the_checkpoints(
    tmp_path: Path, real_tools: Any, plain: Cluster
):
    selected, volume = "cluster.gpu_node_selector={pool: gpu}", "ray.shared_volume=checkpoints"
    shared = Cluster(tmp_path / "rwx-claim", real_tools, selected, volume, storage=None)
    shared.kube, shared.tools = plain.kube, plain.tools
    shared.kube.exec_handler = shared.ray
    with pytest.raises(UserError, match="no PersistentVolumeClaim default/checkpoints"):
        shared.target.up(shared.d(), confirm=shared.ask())
    _claim(shared, ["ReadWriteOnce"])
    with pytest.raises(UserError, match=r"access modes are \['ReadWriteOnce'\]"):
        shared.target.up(shared.d(), confirm=shared.ask())
    assert not shared.questions  # refused before anything was asked or installed
    _claim(shared, ["ReadWriteMany"])
    shared.target.up(shared.d(), confirm=shared.ask())
    assert sub.submit(shared.d()).exit_code == 0, shared.said()
    (cluster,) = [o for o in shared.kube.applied if o["kind"] == "RayCluster"]
    for template in (cluster["spec"]["headGroupSpec"]["template"], cluster["spec"]["workerGroupSpecs"][0]["template"]):
        spec = template["spec"]
        assert {"name": m.SHARED_VOLUME, "persistentVolumeClaim": {"claimName": "checkpoints"}} in spec["volumes"]
        (container,) = spec["containers"]
        assert {"name": m.SHARED_VOLUME, "mountPath": "/mnt/shared"} in container["volumeMounts"]
    config = yaml.safe_load(next(o for o in shared.kube.applied if o["kind"] == "ConfigMap")["data"][m.CONFIG_FILE])
    assert (config["training"]["storage_path"], config["training"]["storage_shared"]) == ("/mnt/shared/runs", True)


def test_runtime_env_installs_only_what_the_image_lacks_in_range(plain: Cluster):
    # As an image's python3 would report them: some in range, some older or newer than the job takes.
    plain.ray.image = {"transformers": "5.12.0", "PyYAML": "6.0.3", "rich": "15.1.0", "tokenizers": "0.24.0"}
    plain.target.up(plain.d(), confirm=plain.ask())
    assert sub.submit(plain.d()).exit_code == 0
    (argv,) = plain.ray.submitted
    pip = json.loads(argv[argv.index("--runtime-env-json") + 1])["pip"]
    names = [p.split(">")[0] for p in pip]
    assert "transformers>=5.13.0,<6" in pip and "tokenizers>=0.22.2,<0.24" in pip  # 5.12 too old, 0.24 too new
    assert "PyYAML" not in names and "rich" not in names and "torch" not in names and "ray" not in names
    assert "The image has 2 of the job's" in plain.said() and "PyYAML 6.0.3" in plain.said()
    # The DLC's own transformers 5.13 with its tokenizers: in range, nothing of theirs installed.
    plain.ray.image = {"transformers": "5.13.0", "tokenizers": "0.22.2"}
    plain.ray.submitted.clear()
    plain.kube.delete("ray.io/v1", "RayCluster", plain.cfg.ray.cluster_name, plain.cfg.ray.namespace)
    assert sub.submit(plain.d()).exit_code == 0, plain.said()
    (argv,) = plain.ray.submitted
    names = [p.split(">")[0] for p in json.loads(argv[argv.index("--runtime-env-json") + 1])["pip"]]
    assert "transformers" not in names and "tokenizers" not in names and "rich" in names


def test_the_image_version_probe_reports_what_an_interpreter_has():
    import subprocess
    import sys

    import transformers

    from raytrain_eks.k8s import job

    done = subprocess.run(
        [sys.executable, "-c", job.IMAGE_VERSIONS, "transformers", "no-such-distribution"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == {"transformers": transformers.__version__, "no-such-distribution": None}
    assert job.left_to_install(["a>=1.2,<2", "b>=0.3,<0.4"], {"a": "1.9.1", "b": "0.2"}) == ["b>=0.3,<0.4"]


def test_the_commands_say_what_is_missing_before_touching_anything(tmp_path, monkeypatch, capsys):
    from raytrain_eks.cli import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "raytrain-eks.yaml"
    config.write_text("cluster:\n  target: kubernetes\n")
    for command in ("up", "status", "down", "compare-fabric"):
        yes = [] if command == "status" else ["-y"]
        with pytest.raises(SystemExit) as done:
            main([command, "--config", str(config), "--kubeconfig", str(tmp_path / "nope"), *yes])
        assert done.value.code != 0
        assert f"the kubeconfig {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:  # plan never reads the cluster: it names what up would read there
        main(["plan", "--config", str(config)])
    assert done.value.code == 2
    said = capsys.readouterr().err
    assert "ray.worker_cpu, ray.worker_memory_gib and cluster.efa_per_node are not set" in said
    assert "Run `raytrain-eks up` first" in said
    assert not (tmp_path / ".raytrain-eks").exists()


def test_gpu_feature_discoverys_labels_give_the_memory_estimate(plain: Cluster):
    gfd = {existing.GPU_MEMORY_LABEL: "40960", existing.GPU_PRODUCT_LABEL: "NVIDIA-A100-SXM4-40GB"}
    for i in range(2):  # the same nodes, as the GPU operator's feature discovery labels an A100 40GB node
        plain.kube.add_node(
            f"gpu-{i}",
            labels={**GPU_LABELS, **gfd},
            allocatable={"cpu": "11", "memory": "80Gi"},
            taints=[GPU_TAINT],
            devices={m.GPU_RESOURCE: "4"},
        )
    plain.target.up(plain.d(), confirm=plain.ask())
    assert "leaves out the memory estimate" not in plain.said()
    gpu = plain.target.gpu_type(plain.d())
    assert gpu is not None and (gpu.gpu_mib, gpu.gpu_model, gpu.gpus) == (40960, "NVIDIA-A100-SXM4-40GB", 4)
    assert sub.submit(plain.d()).exit_code == 0
    assert "memory estimate is left out" not in plain.said() and "NVIDIA-A100-SXM4-40GB" in plain.said()


def test_without_up_or_efa_the_job_commands_stop_with_the_fix(plain: Cluster, monkeypatch, capsys):
    from raytrain_eks.cli import main
    from raytrain_eks.deploy import commands

    with pytest.raises(UserError, match="service account default/raytrain-eks-ray does not exist") as err:
        sub.submit(plain.d())  # up has not run: nothing it makes is there, nor what it reads from the nodes
    assert "raytrain-eks up" in (err.value.hint or "") and not plain.kube.applied
    plain.target.up(plain.d(), confirm=plain.ask())
    monkeypatch.setattr(commands, "make_deployment", lambda cfg, state_dir, say=None: plain.d())
    config = plain.kubeconfig.parent / "raytrain-eks.yaml"
    config.write_text(yaml.safe_dump(plain.cfg.model_dump(mode="json")))
    with pytest.raises(SystemExit):
        main(["compare-fabric", "--config", str(config), "-y"])
    assert "the GPU nodes have no EFA" in capsys.readouterr().err
    assert not [o for o in plain.kube.applied if o["kind"] == "RayCluster"]


def test_a_kuberay_too_old_for_the_fields_submit_sets_stops_up_before_anything(efa: Cluster):
    # The team's KubeRay predates a field the RayJob sets: its CRD (1.7.0's, less the field KubeRay added later)
    # would let the API server drop it silently, and a job whose pods never start would hold the GPU nodes.
    crd = efa.kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", "rayjobs.ray.io")
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    del v1["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["preRunningDeadlineSeconds"]
    efa.kube.put(crd)
    with pytest.raises(UserError) as refused:
        efa.target.up(efa.d(), confirm=efa.ask())
    assert "rayjobs.ray.io has no spec.preRunningDeadlineSeconds" in refused.value.message
    assert "kubectl replace -k" in str(refused.value.hint) and "?ref=v1.7.0" in str(refused.value.hint)
    assert not efa.questions and not efa.tools.commands("helm") and not efa.kube.applied
    assert not efa.store.created


# The user entry of a kubeconfig that `gcloud container clusters get-credentials` writes for GKE: its credential
# program is gke-gcloud-auth-plugin (cloud.google.com/kubernetes-engine/docs/how-to/cluster-access-for-kubectl,
# "Install the gke-gcloud-auth-plugin"). Not installed here, nor on CI's machines.
GKE_USER = {
    "name": "gke_team_europe-west4_gpus",
    "user": {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": "gke-gcloud-auth-plugin",
            "installHint": "Install gke-gcloud-auth-plugin for use with kubectl",
            "provideClusterInfo": True,
        }
    },
}


def test_every_command_names_the_kubeconfigs_missing_credential_program_before_touching_anything(
    plain: Cluster, monkeypatch, capsys
):
    from raytrain_eks.cli import main
    from raytrain_eks.deploy import commands

    plain.target.up(plain.d(), confirm=plain.ask())
    assert sub.submit(plain.d()).exit_code == 0
    doc = yaml.safe_load(plain.kubeconfig.read_text())
    doc["users"] = [GKE_USER]
    doc["contexts"][0]["context"]["user"] = GKE_USER["name"]
    plain.kubeconfig.write_text(yaml.safe_dump(doc))
    plain.tools.missing = {"gke-gcloud-auth-plugin", "helm"}
    monkeypatch.setattr(commands, "make_deployment", lambda cfg, state_dir, say=None: plain.d())
    config = plain.kubeconfig.parent / "raytrain-eks.yaml"
    config.write_text(yaml.safe_dump(plain.cfg.model_dump(mode="json")))
    state, applied, deleted = plain.store.path.read_text(), len(plain.kube.applied), len(plain.kube.deleted)
    calls, questions = len(plain.tools.calls), len(plain.questions)
    for command, extra, programs in [
        ("status", [], ["gke-gcloud-auth-plugin"]),
        ("logs", [], ["gke-gcloud-auth-plugin"]),
        ("submit", [], ["gke-gcloud-auth-plugin"]),
        ("up", ["-y"], ["gke-gcloud-auth-plugin"]),  # helm only once up knows it installs something
        ("down", ["-y"], ["helm", "gke-gcloud-auth-plugin"]),  # the releases up installed, and the objects
    ]:
        with pytest.raises(SystemExit) as done:
            main([command, "--config", str(config), *extra])
        err = " ".join(capsys.readouterr().err.split())
        assert done.value.code == 2, (command, err)
        for program in programs:
            assert f"`{program}`" in err, (command, err)
        assert f"{plain.kubeconfig} runs `gke-gcloud-auth-plugin`" in err, (command, err)
        if "helm" not in programs:
            assert "`helm`" not in err, (command, err)
    # Nothing was asked, run, applied or deleted, and the folder's record is as it was.
    assert plain.store.path.read_text() == state
    assert (len(plain.kube.applied), len(plain.kube.deleted)) == (applied, deleted)
    assert (len(plain.tools.calls), len(plain.questions)) == (calls, questions)


def test_a_configured_gpu_node_type_gives_the_memory_estimate_where_the_nodes_name_none_known(plain: Cluster):
    """Nodes whose labels name no type the tool knows (a Google Cloud a2 node here): cluster.gpu_node_type, set by
    the user, is what up, submit and plan take for the estimate; left at its default it names no node here."""
    from raytrain_eks.instances import INSTANCE_TYPES
    from raytrain_eks.kubernetes.plan import build_plan

    plain.target.up(plain.d(), confirm=plain.ask())
    assert "leaves out the memory estimate" in plain.said() and plain.target.gpu_type(plain.d()) is None
    cluster = plain.cfg.cluster.model_copy(update={"gpu_node_type": "g5.12xlarge"})
    plain.cfg = plain.cfg.model_copy(update={"cluster": cluster})
    plain.lines.clear()
    plain.target.up(plain.d(), confirm=plain.ask())
    assert "leaves out the memory estimate" not in plain.said()
    assert plain.target.gpu_type(plain.d()) is INSTANCE_TYPES["g5.12xlarge"]
    assert sub.submit(plain.d()).exit_code == 0
    assert "memory estimate is left out" not in plain.said()
    assert INSTANCE_TYPES["g5.12xlarge"].gpu_model in plain.said()
    plan = build_plan(plain.d().cfg, state_dir=plain.store.path.parent)
    assert plan.summary["gpu_node_type"] == "g5.12xlarge" and plan.summary["memory_per_gpu"] is not None


# --- EFA and zones: the worker pods are kept to one zone where EFA is required ----------------------------------------


def _worker_zones(c: Cluster) -> list[str | None]:
    """The zones of the nodes the job's worker pods run on."""
    zones = {n.name: n.zone for n in c.kube.nodes()}
    pods = c.kube.pods("default", {"ray.io/cluster": c.cfg.ray.cluster_name})
    return sorted(zones.get(p.node_name or "") for p in pods if "worker" in p.name)


def test_efa_gpu_nodes_in_two_zones_without_a_choice_are_refused_before_anything(tmp_path: Path, real_tools: Any):
    c = _two_zones(tmp_path, real_tools)
    with pytest.raises(UserError) as refused:
        c.target.up(c.d(), confirm=c.ask())
    said = refused.value.message
    assert "EFA is required" in said and "us-east-1a (2 GPU nodes), us-east-1b (1 GPU node)" in said, said
    assert "--set cluster.gpu_az=us-east-1a" in str(refused.value.hint)
    assert not c.questions and not c.kube.applied and not c.tools.commands("helm") and not c.store.created
    # A zone with too few GPU nodes for cluster.gpu_node_count is refused as well, naming what each zone has.
    short = _two_zones(tmp_path / "short", real_tools, "cluster.gpu_az=us-east-1b")
    with pytest.raises(UserError, match=r"cluster.gpu_az = us-east-1b: .* 1 of the GPU nodes .*gpu_node_count = 2"):
        short.target.up(short.d(), confirm=short.ask())
    assert not short.questions and not short.kube.applied and not short.store.created


def test_efa_gpu_nodes_in_two_zones_run_the_job_in_the_zone_chosen(tmp_path: Path, real_tools: Any):
    c = _two_zones(tmp_path, real_tools, "cluster.gpu_az=us-east-1a")
    c.target.up(c.d(), confirm=c.ask())
    assert "in zone us-east-1a (the worker pods are kept there" in c.said()
    assert json.loads(c.store.path.read_text())["gpu_az"] == "us-east-1a"
    result = sub.submit(c.d())
    assert result.exit_code == 0, c.said()
    (group,) = _workers(c)
    assert group["template"]["spec"]["nodeSelector"] == {ZONE_LABEL: "us-east-1a"}
    assert _worker_zones(c) == ["us-east-1a", "us-east-1a"]


def test_submit_refuses_worker_pods_that_efa_would_split_before_applying_anything(efa: Cluster):
    efa.target.up(efa.d(), confirm=efa.ask())
    assert json.loads(efa.store.path.read_text())["gpu_az"] == "us-east-1a"  # the nodes' one zone
    _eks_gpu_node(efa, "ip-10-0-3-0", "us-east-1b")  # the node group grew into a second zone
    efa.kube.remove_nodes({"kubernetes.io/hostname": "ip-10-0-1-1"})
    applied = len(efa.kube.applied)
    with pytest.raises(UserError, match=r"zone us-east-1a, which up chose before .* 1 of the GPU nodes") as refused:
        sub.submit(efa.d())
    assert "nothing was applied" in refused.value.message and len(efa.kube.applied) == applied
    # An up that recorded no zone (nodes in one zone then): now in two, submit names them and the setting.
    efa.store.update(gpu_az=None)
    with pytest.raises(UserError, match=r"us-east-1a \(1 GPU node\), us-east-1b \(1 GPU node\)") as refused:
        sub.submit(efa.d())
    assert "cluster.gpu_az" in str(refused.value.hint) and len(efa.kube.applied) == applied


def test_gpu_nodes_on_demand_come_up_in_the_zone_chosen(on_demand: Cluster, tmp_path: Path):
    assert on_demand.kube.node_pool is not None
    pool = dataclasses.replace(on_demand.kube.node_pool, zones=("us-east-1a", "us-east-1b"))  # Karpenter, two zones
    on_demand.target.up(on_demand.d(), confirm=on_demand.ask())
    assert "the worker pods may land in different zones" in on_demand.said()
    assert "--set cluster.gpu_az=us-east-1a" in on_demand.said()
    chosen = Cluster(tmp_path / "chosen", None, *ON_DEMAND, "cluster.gpu_az=us-east-1b")
    chosen.kube = on_demand.kube
    chosen.kube.node_pool = pool
    chosen.tools, chosen.ray = on_demand.tools, on_demand.ray
    chosen.target.up(chosen.d(), confirm=chosen.ask())
    result = sub.submit(chosen.d())
    assert result.exit_code == 0, chosen.said()
    assert _worker_zones(chosen) == ["us-east-1b", "us-east-1b"]


# --- the NVIDIA driver the image's CUDA needs -------------------------------------------------------------------------


def _driver(version: str, *, old_names: bool = False) -> dict[str, str]:
    """GPU feature discovery's driver labels for ``version`` (``old_names``: only the deprecated ones)."""
    major, minor, rev = version.split(".")
    if old_names:
        return {"nvidia.com/cuda.driver.major": major, "nvidia.com/cuda.driver.minor": minor}
    keys = ("major", "minor", "revision")
    return {f"nvidia.com/cuda.driver-version.{k}": v for k, v in zip(keys, (major, minor, rev), strict=True)}


def _relabel(c: Cluster, labels: dict[str, dict[str, str]]) -> None:
    for name, extra in labels.items():
        c.kube.add_node(
            name,
            labels={**GPU_LABELS, **extra},
            allocatable={"cpu": "11", "memory": "80Gi"},
            taints=[GPU_TAINT],
            devices={m.GPU_RESOURCE: "4"},
        )


def test_a_driver_older_than_the_images_cuda_needs_is_refused_before_anything(plain: Cluster):
    _relabel(plain, {"gpu-0": _driver("535.104.05"), "gpu-1": _driver("570.172.08", old_names=True)})
    with pytest.raises(UserError) as refused:
        plain.target.up(plain.d(), confirm=plain.ask())
    said = refused.value.message
    assert "gpu-0 (535.104), gpu-1 (570.172)" in said and "CUDA 13.0" in said and "580 or later" in said, said
    assert "KubeRay replaces" in str(refused.value.hint)
    assert not plain.questions and not plain.tools.commands("helm") and not plain.kube.applied
    _relabel(plain, {"gpu-0": _driver("580.65.06"), "gpu-1": _driver("590.44.01", old_names=True)})
    plain.target.up(plain.d(), confirm=plain.ask())
    assert "could not be checked" not in plain.said()


def test_nodes_without_the_driver_labels_are_said_to_be_unchecked(plain: Cluster):
    _relabel(plain, {"gpu-0": _driver("580.95.05")})  # gpu-1 has no GPU feature discovery
    plain.target.up(plain.d(), confirm=plain.ask())  # not a refusal: up goes on
    (line,) = [line for line in plain.lines if "could not be checked" in line]
    assert line.startswith("The NVIDIA driver of GPU node gpu-1 could not be checked: no GPU feature discovery label")
    assert "580 or later" in line and "Ready: 2 GPU nodes" in plain.said()


def test_the_cuda_the_driver_check_knows_is_the_images():
    # The image's build files, vendored unchanged (tests/fixtures/ray-train-dlc/SOURCE.md).
    dockerfile = Path(__file__).parent / "fixtures/ray-train-dlc/docker/ray-train/Dockerfile.cuda"
    (version,) = re.findall(r"^ARG CUDA_VERSION=(\S+)$", dockerfile.read_text(), re.M)
    assert ".".join(version.split(".")[:2]) == existing.IMAGE_CUDA
    assert existing.MIN_DRIVER[0] == 580  # NVIDIA's minimum for CUDA 13.x
