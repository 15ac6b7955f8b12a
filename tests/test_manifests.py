"""Kubernetes manifests: the RayCluster and RayJob against the KubeRay v1 schema, their pod templates and the core
objects with kubernetes-validate (strict), and every property of the issue asserted one by one, for the reference
and for other instance types. Fast and hermetic: no cluster, no network."""

from __future__ import annotations

import copy
import http.server
import json
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from fake_kube import ZONE_LABEL
from schema_errors import schema_errors

from raytrain_eks.config import Config, load_config
from raytrain_eks.k8s import job as shipping
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.state import StateStore
from raytrain_eks.kubernetes import existing

SCHEMAS = Path(__file__).parent / "schemas"  # copies of the upstream schemas, see schemas/README.md
K8S_VERSION = "1.33"

# (instance type, GPUs, EFA interfaces, pod CPU, pod memory GiB): GPU and EFA follow the instance; CPU and memory
# are 5/6 of it (the reference's 40 of 48 vCPU, 160 of 192 GiB).
INSTANCES = [
    ("g6.12xlarge", 4, 1, 40, 160),
    ("g5.48xlarge", 8, 1, 160, 640),
    ("p4d.24xlarge", 8, 4, 80, 960),
    ("p5.48xlarge", 8, 32, 160, 1706),
]


def _schema(name: str) -> jsonschema.Draft7Validator:
    path = SCHEMAS / "kuberay" / name
    assert path.exists(), f"{path} is missing: tests/schemas/ must hold the upstream schemas (see its README.md)"
    return jsonschema.Draft7Validator(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def raycluster_schema() -> jsonschema.Draft7Validator:
    return _schema("raycluster.v1.schema.json")


@pytest.fixture(scope="module")
def rayjob_schema() -> jsonschema.Draft7Validator:
    return _schema("rayjob.v1.schema.json")


def _as_pod(template: dict[str, Any], name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **template["metadata"]},
        "spec": template["spec"],
    }


def _strict(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _head(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["headGroupSpec"]


def _workers(doc: dict[str, Any]) -> dict[str, Any]:
    groups = doc["spec"]["workerGroupSpecs"]
    assert len(groups) == 1
    return groups[0]


# --- merge ---------------------------------------------------------------------------------------------------------


def test_merge_is_deep_and_never_mutates_its_inputs():
    base = {"a": {"x": 1, "l": [1]}, "b": 1}
    over = {"a": {"y": 2}, "b": {"c": 3}}
    before = copy.deepcopy((base, over))
    out = m.merge(base, over)
    assert out == {"a": {"x": 1, "y": 2, "l": [1]}, "b": {"c": 3}}
    assert (base, over) == before
    out["a"]["l"].append(2)
    assert base["a"]["l"] == [1], "the result shares nothing with the inputs"


def test_renderers_are_pure(cfg_for):
    cfg = cfg_for()
    dumped = cfg.model_dump()
    first = m.raycluster(cfg, hf_token=True)
    first["spec"]["workerGroupSpecs"][0]["replicas"] = 99
    assert m.raycluster(cfg, hf_token=True)["spec"]["workerGroupSpecs"][0]["replicas"] == 2
    assert m.rayjob(cfg) == m.rayjob(cfg)
    assert cfg.model_dump() == dumped


# --- schemas ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("itype,gpus,efa,cpu,mem", INSTANCES)
def test_raycluster_and_rayjob_validate_against_kuberay_v1(
    cfg_for, raycluster_schema, rayjob_schema, itype, gpus, efa, cpu, mem
):
    cfg = cfg_for(GPU_NODE_TYPE=itype, GPUS_PER_NODE=str(gpus), NAMESPACE="train")
    for hf_token in (False, True):
        rc = m.raycluster(cfg, hf_token=hf_token)
        assert schema_errors(raycluster_schema, rc) == []
        assert (rc["apiVersion"], rc["kind"], rc["metadata"]["name"]) == ("ray.io/v1", "RayCluster", "ray-train")
        job = m.rayjob(cfg, hf_token=hf_token, runtime_env={"pip": ["example==1.0"]})
        assert schema_errors(rayjob_schema, job) == []
        assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("ray.io/v1", "RayJob", "ray-train")
        for i, template in enumerate(m.pod_templates(rc) + m.pod_templates(job)):
            _strict(_as_pod(template, f"pod-{i}"))


def test_core_objects_validate_strictly(cfg_for):
    cfg = cfg_for(NAMESPACE="train")
    for doc in (m.namespace(cfg), m.job_config_map(cfg), m.hf_token_secret(cfg, "hf_dummy")):
        _strict(doc)
        assert doc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "raytrain-eks"
    assert m.job_config_map(cfg)["metadata"]["namespace"] == "train"


def test_the_validators_do_reject_bad_documents(cfg_for, raycluster_schema):
    """The checks above would catch a mistake: a worker group without minReplicas, a misspelled pod field."""
    rc = m.raycluster(cfg_for())
    del rc["spec"]["workerGroupSpecs"][0]["minReplicas"]
    assert any("minReplicas" in e for e in schema_errors(raycluster_schema, rc))
    pod = _as_pod(m.pod_templates(m.raycluster(cfg_for()))[1], "w")
    pod["spec"]["nodeSelectors"] = pod["spec"].pop("nodeSelector")
    with pytest.raises(kubernetes_validate.ValidationError, match="nodeSelectors"):
        _strict(pod)


# --- the RayCluster, property by property ----------------------------------------------------------------------------


def test_head_reserves_no_gpu_and_runs_on_the_system_node(cfg_for):
    group = _head(m.raycluster(cfg_for()))
    assert group["rayStartParams"]["num-gpus"] == "0"
    assert group["rayStartParams"]["num-cpus"] == "0", "Ray Data tasks must not land on the head pod"
    assert group["serviceType"] == "ClusterIP", "the dashboard port must not leave the cluster"
    spec = group["template"]["spec"]
    assert spec["nodeSelector"] == {"role": "system"}
    assert "tolerations" not in spec, "the head must not tolerate the GPU taint"
    (container,) = spec["containers"]
    assert _env(container)["NVIDIA_VISIBLE_DEVICES"] == "void"
    res = container["resources"]
    assert res["requests"] == res["limits"] == {"cpu": "2", "memory": "8Gi"}  # half of m7i.xlarge
    assert not any("gpu" in k or "efa" in k for k in res["limits"])
    assert container["lifecycle"]["preStop"]["exec"]["command"][-1] == "ray stop"
    mounts = {v["name"]: v["mountPath"] for v in container["volumeMounts"]}
    assert mounts["ray-logs"] == "/tmp/ray"
    assert mounts["job-config"] == m.CONFIG_DIR
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["ray-logs"] == {"name": "ray-logs", "emptyDir": {}}
    assert volumes["job-config"]["configMap"]["name"] == m.job_config_map(cfg_for())["metadata"]["name"]


@pytest.mark.parametrize("itype,gpus,efa,cpu,mem", INSTANCES)
def test_workers_follow_the_instance_type(cfg_for, itype, gpus, efa, cpu, mem):
    cfg = cfg_for(GPU_NODE_TYPE=itype, GPUS_PER_NODE=str(gpus), GPU_NODE_COUNT="3")
    group = _workers(m.raycluster(cfg))
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 3, "one pod per GPU node"
    (container,) = group["template"]["spec"]["containers"]
    res = container["resources"]
    assert res["requests"] == res["limits"], "requests == limits: Guaranteed QoS"
    # Ray's num-gpus and the pod's GPU request come from the same setting.
    assert (
        group["rayStartParams"]["num-gpus"]
        == res["limits"]["nvidia.com/gpu"]
        == str(cfg.derived.ray_gpus_per_worker_pod)
    )
    assert res["limits"] == {
        "cpu": str(cpu),
        "memory": f"{mem}Gi",
        "nvidia.com/gpu": str(gpus),
        "vpc.amazonaws.com/efa": str(efa),
    }


def test_worker_pod_environment_volumes_and_placement(cfg_for):
    cfg = cfg_for()
    spec = _workers(m.raycluster(cfg))["template"]["spec"]
    (container,) = spec["containers"]
    env = _env(container)
    assert {k: env[k] for k in ("FI_PROVIDER", "NCCL_NET_PLUGIN", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG")} == {
        "FI_PROVIDER": "efa",
        "NCCL_NET_PLUGIN": "ofi",
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_DEBUG": "INFO",
    }
    assert "HF_TOKEN" not in env
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert spec["nodeSelector"]["role"] == "gpu-worker"
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert container["image"] == _head(m.raycluster(cfg))["template"]["spec"]["containers"][0]["image"] == cfg.ray.image


def test_every_ray_pod_runs_ray_stop_before_it_is_killed(cfg_for):
    # The reference's RayCluster has the hook on the head and on the workers: a worker killed without it loses
    # its raylet's logs and leaves the head waiting for the node to time out.
    for doc in (m.raycluster(cfg_for()), m.rayjob(cfg_for())):
        for template in m.pod_templates(doc):
            (container,) = template["spec"]["containers"]
            assert container["lifecycle"] == {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}}


def test_explicit_worker_size_wins_over_the_instance_share(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ={}, overrides={"ray": {"worker_cpu": 44, "worker_memory_gib": 170}})
    limits = _workers(m.raycluster(cfg))["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (limits["cpu"], limits["memory"]) == ("44", "170Gi")


def test_network_env_comes_from_the_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {"FI_PROVIDER": "efa", "NCCL_NET_PLUGIN": "ofi", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"}
    (tmp_path / "raytrain-eks.yaml").write_text(yaml.safe_dump({"network": {"env": env}}))
    container = _workers(m.raycluster(load_config(environ={})))["template"]["spec"]["containers"][0]
    assert _env(container) == env


def test_hf_token_comes_from_a_secret_and_never_appears_in_a_manifest(cfg_for):
    cfg = cfg_for(NAMESPACE="train")
    token = "hf_thisMustNeverBeWritten123"
    ref = {"secretKeyRef": {"name": "hf-token", "key": m.HF_TOKEN_KEY}}
    for doc in (m.raycluster(cfg, hf_token=True), m.rayjob(cfg, hf_token=True)):
        for template in m.pod_templates(doc):
            (container,) = template["spec"]["containers"]
            assert _env(container)["HF_TOKEN"] == ref
        assert token not in yaml.safe_dump(doc)
    secret = m.hf_token_secret(cfg, token)
    assert secret["metadata"] == {"name": "hf-token", "namespace": "train", "labels": m.labels(cfg)}
    assert secret["stringData"] == {m.HF_TOKEN_KEY: token}


def test_the_job_config_map_holds_the_resolved_configuration(cfg_for):
    cfg = cfg_for(STEPS="7", MODEL_ID="Qwen/Qwen2.5-0.5B")
    data = m.job_config_map(cfg)["data"][m.CONFIG_FILE]
    assert Config.model_validate(yaml.safe_load(data)) == cfg
    assert "HF_TOKEN" not in data


# --- the RayJob ------------------------------------------------------------------------------------------------------


def test_rayjob_stops_costing_when_the_job_ends(cfg_for):
    cfg = cfg_for()
    job = m.rayjob(cfg)
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == m.RAYJOB_TTL_S
    assert spec["activeDeadlineSeconds"] == cfg.ray.job_deadline_s
    assert spec["preRunningDeadlineSeconds"] == cfg.ray.job_start_deadline_s
    assert spec["backoffLimit"] == 0
    assert spec["rayClusterSpec"] == m.raycluster(cfg)["spec"], "the same cluster as --mode raycluster"
    assert "runtimeEnvYAML" not in spec


def test_rayjob_entrypoint_is_a_quoted_argv(cfg_for):
    spec = m.rayjob(cfg_for())["spec"]
    assert spec["entrypoint"] == shlex.join(m.train_argv())
    assert shlex.split(spec["entrypoint"]) == m.train_argv()
    assert m.train_argv()[:6] == ["python3", "-m", "raytrain_eks.cli", "train", "--address", "auto"]
    assert m.train_argv()[-1] == f"{m.CONFIG_DIR}/{m.CONFIG_FILE}"


def test_rayjob_runtime_env_is_yaml(cfg_for):
    spec = m.rayjob(cfg_for(), runtime_env={"pip": ["a==1"], "env_vars": {"X": "1"}})["spec"]
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == {"pip": ["a==1"], "env_vars": {"X": "1"}}


# --- the kubernetes target: where EFA is required, the worker pods stay in one zone ----------------------------------


def _kubernetes(tmp_path: Path, *sets: str, **recorded: Any) -> Config:
    """A kubernetes target's configuration as submit gets it after an up that recorded ``recorded``."""
    store = StateStore(tmp_path / ".raytrain-eks")
    store.update(target="kubernetes", worker_cpu=39, worker_memory_gib=154, **recorded)
    return existing.remembered(load_config(environ={}, path=None, sets=["cluster.target=kubernetes", *sets]), store)


@pytest.mark.parametrize("selected", [{}, {"pool": "gpu"}], ids=["gpu-request-only", "labelled"])
def test_on_the_kubernetes_target_efa_keeps_the_worker_pods_in_one_zone(
    tmp_path, monkeypatch, raycluster_schema, rayjob_schema, selected
):
    monkeypatch.chdir(tmp_path)
    labels = [f"cluster.gpu_node_selector={json.dumps(selected)}"] if selected else []
    cfg = _kubernetes(tmp_path, *labels, efa_per_node=1, gpu_az="us-east-1b")  # the zone up found the nodes in
    rc, job = m.raycluster(cfg), m.rayjob(cfg)
    assert schema_errors(raycluster_schema, rc) == [] and schema_errors(rayjob_schema, job) == []
    for i, template in enumerate(m.pod_templates(rc) + m.pod_templates(job)):
        _strict(_as_pod(template, f"pod-{i}"))
    for doc in (rc, job["spec"]["rayClusterSpec"]):
        spec = doc.get("spec", doc)
        worker = spec["workerGroupSpecs"][0]["template"]["spec"]
        assert worker["nodeSelector"] == {**selected, ZONE_LABEL: "us-east-1b"}
        assert "nodeSelector" not in spec["headGroupSpec"]["template"]["spec"]  # the head needs no EFA
    # cluster.gpu_az, when set, is the zone (and the one up checks the nodes of).
    chosen = _kubernetes(tmp_path / "chosen", *labels, "cluster.gpu_az=us-east-1c", efa_per_node=1, gpu_az="us-east-1b")
    assert _workers(m.raycluster(chosen))["template"]["spec"]["nodeSelector"][ZONE_LABEL] == "us-east-1c"
    # Without EFA required nothing changes: no EFA on the nodes, or fabric.require any.
    for without in (
        _kubernetes(tmp_path / "none", *labels, "cluster.gpu_az=us-east-1c", efa_per_node=0),
        _kubernetes(tmp_path / "any", *labels, "fabric.require=any", efa_per_node=1, gpu_az="us-east-1b"),
    ):
        assert _workers(m.raycluster(without))["template"]["spec"].get("nodeSelector", {}) == selected


# --- the RayJob's submitter, against KubeRay's own source ------------------------------------------------------------

KUBERAY = Path(__file__).parent / "fixtures" / "kuberay"  # KubeRay v1.7.0's files, see its SOURCE.md
CONTROLLER = KUBERAY / "ray-operator" / "controllers" / "ray"


def _go(rel: str) -> str:
    path = KUBERAY / rel
    assert path.exists(), f"{path} is missing: tests/fixtures/kuberay/ holds KubeRay's files (see its SOURCE.md)"
    return path.read_text()


def _go_const(text: str, name: str) -> str | int:
    """A Go constant's value as written upstream: a string (quoted or raw) or an integer."""
    match = re.search(rf"^\s*{name}\s*=\s*(\"[^\"\n]*\"|`[^`]*`|\d+)\s*$", text, re.MULTILINE)
    assert match, f"constant {name} not found"
    value = match.group(1)
    return int(value) if value.isdigit() else value[1:-1]


def _go_func(text: str, signature: str) -> str:
    """The body of the Go function whose declaration starts with ``signature`` (up to the next top-level ``}``)."""
    start = text.index(signature)
    return text[start : text.index("\n}\n", start)]


@pytest.fixture
def rayjob_and_code(cfg_for) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg = cfg_for()
    code_map, items = shipping.code_config_map(cfg, {"raytrain_eks/__init__.py": "shipped = True\n"})
    return shipping.rayjob_manifest(cfg, hf_token=True, code_map=code_map, items=items), code_map


@pytest.fixture
def rayjob_doc(rayjob_and_code) -> dict[str, Any]:
    return rayjob_and_code[0]


def test_kuberays_default_submitter_needs_a_python_the_image_does_not_promise():
    # KubeRay's own command for the submitter waits for the dashboard with BasePythonHealthCommand: `python -c`.
    constants = _go("ray-operator/controllers/ray/utils/constant.go")
    health = _go_const(constants, "BasePythonHealthCommand")
    assert isinstance(health, str) and health.split()[:2] == ["python", "-c"]
    build = _go_func(_go("ray-operator/controllers/ray/common/job.go"), "func BuildJobSubmitCommand(")
    assert "utils.BasePythonHealthCommand" in build and '"until", rayDashboardGCSHealthCommand' in build
    assert m.IMAGE_PYTHON == "python3" != health.split()[0], "the image promises python3 only"


def test_kuberay_runs_the_submitter_command_the_rayjob_gives(rayjob_doc, rayjob_schema):
    controller = _go("ray-operator/controllers/ray/rayjob_controller.go")
    configure = _go_func(controller, "func configureSubmitterContainer(")
    # In K8sJobMode a container with a command of its own keeps it; only an empty one gets the default.
    assert "if len(container.Command) == 0 || submissionMode == rayv1.SidecarMode {" in configure
    assert rayjob_doc["spec"]["submissionMode"] == "K8sJobMode"
    # The whole submitterPodTemplate is taken when given, and its first container is the one configured.
    template = _go_func(_go("ray-operator/controllers/ray/common/job.go"), "func GetSubmitterTemplate(")
    assert "return *rayJobSpec.SubmitterPodTemplate.DeepCopy()" in template
    constants = _go("ray-operator/controllers/ray/utils/constant.go")
    assert "configureSubmitterContainer(&submitterTemplate.Spec.Containers[utils.RayContainerIndex]" in controller
    assert _go_const(constants, "RayContainerIndex") == 0
    (container,) = rayjob_doc["spec"]["submitterPodTemplate"]["spec"]["containers"]
    assert container["name"] == _go_const(constants, "SubmitterContainerName") == shipping.SUBMITTER_CONTAINER
    # What the submitter reads is what KubeRay gives it: the dashboard address and the RayJob's job id.
    for env, field in ((shipping.SUBMITTER_ADDRESS_ENV, "DashboardURL"), (shipping.SUBMITTER_JOB_ID_ENV, "JobId")):
        assert _go_const(constants, env) == env
        assert f"{{Name: utils.{env}, Value: rayJobInstance.Status.{field}}}" in configure
    assert _go_const(constants, "RayDashboardGCSHealthPath") == shipping.DASHBOARD_HEALTH_PATH
    assert container["command"][:2] == [m.IMAGE_PYTHON, "-c"]
    assert _env(container)["NVIDIA_VISIBLE_DEVICES"] == "void", "like the head, the submitter sees no GPU"
    assert schema_errors(rayjob_schema, rayjob_doc) == []
    _strict(_as_pod(rayjob_doc["spec"]["submitterPodTemplate"] | {"metadata": {}}, "submitter"))


def test_every_rayjob_field_set_is_one_kuberay_reads(rayjob_doc):
    types = _go("ray-operator/apis/ray/v1/rayjob_types.go")
    spec_struct = types[types.index("type RayJobSpec struct {") :]
    spec_struct = spec_struct[: spec_struct.index("\n}\n")]
    fields = set(re.findall(r'`json:"([A-Za-z]+)[,"]', spec_struct))
    assert {"submitterPodTemplate", "ttlSecondsAfterFinished", "shutdownAfterJobFinishes"} <= fields
    assert set(rayjob_doc["spec"]) <= fields


_FAKE_RAY = """\
#!{python}
# `ray job ...` as Ray's job CLI answers it: `status` of a job the dashboard does not know exits 1.
import json, os, sys
calls = os.environ["FAKE_RAY_CALLS"]
with open(calls, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["job", "status"]:
    sys.exit(0 if os.environ.get("FAKE_RAY_KNOWS_JOB") else 1)
if sys.argv[1:3] == ["job", "logs"]:
    print("step 1 loss 2.0")
"""


class _Healthy(http.server.BaseHTTPRequestHandler):
    """The dashboard's GCS health check as Ray answers it when the GCS is up."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b"success" if self.path == f"/{shipping.DASHBOARD_HEALTH_PATH}" else b"not found"
        self.send_response(200 if body == b"success" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def dashboard() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"  # status.dashboardURL: host:port, no scheme
    server.shutdown()
    server.server_close()
    thread.join()


def test_the_submitter_runs_ray_job_submit_as_kuberay_would(rayjob_and_code, dashboard, tmp_path):
    import base64

    rayjob_doc, code_map = rayjob_and_code
    spec = rayjob_doc["spec"]
    (container,) = spec["submitterPodTemplate"]["spec"]["containers"]
    # The mounted ConfigMap as the kubelet writes a binaryData key (decoded), and the folder it unpacks into, moved
    # under this test's folder: the command's last two arguments.
    archive, code_dir = container["command"][-2:]
    assert archive == f"{container['volumeMounts'][0]['mountPath']}/{shipping.ARCHIVE_KEY}"
    assert yaml.safe_load(spec["runtimeEnvYAML"])["py_modules"] == [f"{code_dir}/raytrain_eks"]
    mounted = tmp_path / "mount" / shipping.ARCHIVE_KEY
    mounted.parent.mkdir()
    mounted.write_bytes(base64.b64decode(code_map["binaryData"][shipping.ARCHIVE_KEY]))
    unpacked = tmp_path / "code"
    command = [*container["command"][:-2], str(mounted), str(unpacked)]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(_FAKE_RAY.format(python=sys.executable))
    (bin_dir / "ray").chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_RAY_CALLS": str(calls),
        shipping.SUBMITTER_ADDRESS_ENV: dashboard,
        shipping.SUBMITTER_JOB_ID_ENV: "ray-train-x7k2p",
    }
    # python3 in the image; this interpreter here.
    run = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "step 1 loss 2.0" in run.stdout
    assert (unpacked / "raytrain_eks" / "__init__.py").read_text() == "shipped = True\n"
    address = f"http://{dashboard}"
    status, submit, logs = [json.loads(line) for line in calls.read_text().splitlines()]
    assert status == ["job", "status", "--address", address, "ray-train-x7k2p"]
    assert logs == ["job", "logs", "--address", address, "--follow", "ray-train-x7k2p"]
    flags, entrypoint = submit[: submit.index("--")], submit[submit.index("--") + 1 :]
    assert flags[:5] == ["job", "submit", "--address", address, "--no-wait"]
    assert flags[flags.index("--submission-id") + 1] == "ray-train-x7k2p"
    assert json.loads(flags[flags.index("--runtime-env-json") + 1]) == yaml.safe_load(spec["runtimeEnvYAML"])
    assert entrypoint == shlex.split(spec["entrypoint"]) == m.train_argv()
    # Only flags KubeRay's own command passes.
    build = _go_func(_go("ray-operator/controllers/ray/common/job.go"), "func BuildJobSubmitCommand(")
    assert {f for f in flags if f.startswith("--")} <= set(re.findall(r'"(--[a-z-]+)"', build))

    # A submitter run again (its Job retried) finds the job known and only follows it, as KubeRay's does.
    calls.unlink()
    again = subprocess.run(
        [sys.executable, *command[1:]], env={**env, "FAKE_RAY_KNOWS_JOB": "1"}, capture_output=True, timeout=60
    )
    assert again.returncode == 0
    assert [json.loads(line)[:3] for line in calls.read_text().splitlines()] == [
        ["job", "status", "--address"],
        ["job", "logs", "--address"],
    ]
