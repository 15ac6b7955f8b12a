"""``plan``: the eksctl ClusterConfig (against eksctl's schema and its EFA rules), the pinned Helm releases, the
ordered steps, the hourly cost, every file ``plan --output-dir`` writes (each validated), and bad input refused
with one clear message before anything is written. Runs with no AWS credentials and no eksctl, helm or kubectl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml
from schema_errors import schema_errors
from typer.testing import CliRunner

from raytrain_eks.aws import eksctl
from raytrain_eks.config import load_config
from raytrain_eks.config_cluster import AMI_FAMILIES
from raytrain_eks.deploy.commands import register
from raytrain_eks.deploy.plan import CODE_CONFIG_MAP_FILE, JOB_CONFIG_FILE, PACKAGE_ARCHIVE_FILE
from raytrain_eks.eks.plan import build_plan, write_plan
from raytrain_eks.eks.pricing import cost_per_hour, run_cost
from raytrain_eks.errors import ConfigError, DataError, UserError
from raytrain_eks.instances import instance_type
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import helm_releases
from raytrain_eks.k8s.state import StateStore, apply_state

SCHEMAS = Path(__file__).parent / "schemas"  # copies of the upstream schemas, see schemas/README.md
INSTANCES = [("g6.12xlarge", 4, 1), ("g5.48xlarge", 8, 1), ("p4d.24xlarge", 8, 4), ("p5.48xlarge", 8, 32)]
RAYCLUSTER_STEPS = [
    "preflight",
    "checkpoint-bucket",
    "create-cluster",
    "iam-service-account",
    "remove-eksctl-device-plugins",
    "helm-nvidia-device-plugin",
    "helm-aws-efa-k8s-device-plugin",
    "helm-kuberay-operator",
    "check-gpu-nodes",
    "job-config",
    "apply-raycluster",
    "wait-raycluster",
    "upload-package",
    "submit",
    "check-nccl-transport",
]


def _validator(*parts: str) -> jsonschema.Draft7Validator:
    path = SCHEMAS.joinpath(*parts)
    assert path.exists(), f"{path} is missing: tests/schemas/ must hold the upstream schemas (see its README.md)"
    return jsonschema.Draft7Validator(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def schemas() -> dict[str, jsonschema.Draft7Validator]:
    return {
        "eksctl": _validator("eksctl", "clusterconfig.v1alpha5.schema.json"),
        "RayCluster": _validator("kuberay", "raycluster.v1.schema.json"),
        "RayJob": _validator("kuberay", "rayjob.v1.schema.json"),
    }


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def root() -> None:  # keeps `plan` a subcommand, as in the real CLI
        pass

    register(app)
    return app


def _nodegroups(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {ng["name"]: ng for ng in doc["managedNodeGroups"]}


# --- eksctl ClusterConfig ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("itype,gpus,efa", INSTANCES)
def test_cluster_config_validates_and_keeps_eksctls_efa_rules(cfg_for, schemas, itype, gpus, efa):
    cfg = cfg_for(GPU_NODE_TYPE=itype, GPUS_PER_NODE=str(gpus), GPU_AZ="us-east-1c")
    doc = eksctl.cluster_config(cfg, eksctl.planned_zones(cfg))
    assert schema_errors(schemas["eksctl"], doc) == []
    assert doc["metadata"] == {
        "name": "ray-train-eks",
        "region": "us-east-1",
        "version": "1.36",
        "tags": {"created-by": "raytrain-eks", "raytrain-eks/cluster": "ray-train-eks"},
    }
    assert doc["iam"]["withOIDC"] is True
    assert doc["vpc"]["nat"]["gateway"] == "Single"
    assert len(set(doc["availabilityZones"])) >= 2 and "us-east-1c" in doc["availabilityZones"]
    groups = _nodegroups(doc)
    assert set(groups) == {"system", "gpu-efa"}
    gpu = groups["gpu-efa"]
    assert gpu["instanceType"] == itype
    assert gpu["efaEnabled"] is True
    assert gpu["availabilityZones"] == ["us-east-1c"] and "subnets" not in gpu, "exactly one AZ for an EFA group"
    assert "placement" not in gpu, "eksctl adds the cluster placement group itself"
    assert gpu["privateNetworking"] is True
    assert gpu["amiFamily"] == "AmazonLinux2023"
    assert gpu["volumeSize"] == 200
    assert gpu["labels"] == {"role": "gpu-worker", "nvidia.com/gpu.present": "true"}
    assert gpu["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]
    assert gpu["desiredCapacity"] == gpu["minSize"] == gpu["maxSize"] == 2
    system = groups["system"]
    assert (system["instanceType"], system["desiredCapacity"], system["privateNetworking"]) == ("m7i.xlarge", 1, True)
    assert system["labels"] == {"role": "system"} and "taints" not in system and "efaEnabled" not in system


def test_a_configured_capacity_reservation_is_targeted_by_the_gpu_group_only(cfg_for, schemas):
    cfg = cfg_for(GPU_AZ="us-east-1c").model_copy(deep=True)
    cfg = cfg.model_copy(
        update={"cluster": cfg.cluster.model_copy(update={"capacity_reservation_id": "cr-0123456789abcdef0"})}
    )
    doc = eksctl.cluster_config(cfg, eksctl.planned_zones(cfg))
    assert schema_errors(schemas["eksctl"], doc) == []
    groups = _nodegroups(doc)
    target = {"capacityReservationTarget": {"capacityReservationID": "cr-0123456789abcdef0"}}
    assert groups["gpu-efa"]["capacityReservation"] == target and "capacityReservation" not in groups["system"]
    steps = {s.name: s for s in build_plan(cfg, mode="raycluster", hf_token=False).steps}
    assert "launched into capacity reservation cr-0123456789abcdef0" in steps["create-cluster"].action
    assert "standard quota (L-1216C47A) the system node" in steps["preflight"].action


def test_preflight_names_the_quota_each_node_group_draws_on(cfg_for):
    def preflight(**environ: str) -> str:
        return next(s.action for s in build_plan(cfg_for(**environ)).steps if s.name == "preflight")

    assert "the P quota (L-417A185B) 384 vCPUs" in preflight(GPU_NODE_TYPE="p5.48xlarge", GPUS_PER_NODE="8")
    assert "the G quota (L-DB2E81BA) the system node" in preflight(SYSTEM_NODE_TYPE="g5.xlarge")


def test_node_ami_family_reaches_both_node_groups_and_is_one_eksctl_accepts(cfg_for, schemas):
    enum = schemas["eksctl"].schema["definitions"]["ManagedNodeGroup"]["properties"]["amiFamily"]["enum"]
    assert set(AMI_FAMILIES) <= set(enum), "every family the config allows is one eksctl knows"
    cfg = cfg_for(NODE_AMI_FAMILY="Bottlerocket")
    doc = eksctl.cluster_config(cfg, eksctl.planned_zones(cfg))
    assert {g["amiFamily"] for g in doc["managedNodeGroups"]} == {"Bottlerocket"}
    assert schema_errors(schemas["eksctl"], doc) == []


def test_the_eksctl_validator_does_reject_unknown_keys(cfg_for, schemas):
    cfg = cfg_for()
    doc = eksctl.cluster_config(cfg, eksctl.planned_zones(cfg))
    doc["managedNodeGroups"][1]["efaEnable"] = True
    assert any("efaEnable" in e for e in schema_errors(schemas["eksctl"], doc))


def test_zones_come_from_the_config_or_are_a_stated_assumption(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    zones = eksctl.planned_zones(load_config(environ={}))
    assert (zones.gpu_az, zones.cluster_azs, zones.assumed) == ("us-east-1a", ("us-east-1a", "us-east-1b"), True)
    zones = eksctl.planned_zones(load_config(environ={"GPU_AZ": "us-east-1a"}))
    assert (zones.gpu_az, zones.cluster_azs, zones.assumed) == ("us-east-1a", ("us-east-1a", "us-east-1b"), False)
    azs = {"cluster": {"availability_zones": ["us-east-1b", "us-east-1d", "us-east-1f"]}}
    zones = eksctl.planned_zones(load_config(environ={"GPU_AZ": "us-east-1d"}, overrides=azs))
    assert zones.cluster_azs == ("us-east-1d", "us-east-1b", "us-east-1f") and not zones.assumed
    with pytest.raises(ConfigError, match="must be one of availability_zones"):
        load_config(environ={"GPU_AZ": "us-east-1a"}, overrides=azs)
    with pytest.raises(ConfigError, match="at least 2 different zones"):
        load_config(environ={}, overrides={"cluster": {"availability_zones": ["us-east-1a"]}})


# --- device plugins and Helm ----------------------------------------------------------------------------------------


def test_helm_releases_are_pinned(cfg_for):
    releases = {r.name: r for r in helm_releases(cfg_for())}
    pinned = {name: (r.repo_url, r.chart, r.version) for name, r in releases.items()}
    assert pinned == {
        "nvidia-device-plugin": ("https://nvidia.github.io/k8s-device-plugin", "nvidia-device-plugin", "0.20.0"),
        "aws-efa-k8s-device-plugin": ("https://aws.github.io/eks-charts", "aws-efa-k8s-device-plugin", "v0.5.30"),
        "kuberay-operator": ("https://ray-project.github.io/kuberay-helm/", "kuberay-operator", "1.7.0"),
    }
    # The EFA chart only tolerates CriticalAddonsOnly by default; the GPU nodes carry the nvidia.com/gpu taint.
    assert m.GPU_TOLERATION in releases["aws-efa-k8s-device-plugin"].values["tolerations"]
    assert releases["kuberay-operator"].values["nodeSelector"] == {"role": "system"}
    argv = releases["kuberay-operator"].argv()
    assert argv[:5] == ["helm", "upgrade", "--install", "kuberay-operator", "kuberay-operator"]
    assert argv[argv.index("--version") + 1] == "1.7.0"


def test_no_duplicate_device_plugin_daemonsets(cfg_for):
    plan = build_plan(cfg_for())
    steps = {s.name: s for s in plan.steps}
    names = [s.name for s in plan.steps]
    # eksctl's static NVIDIA plugin is switched off at creation ...
    assert "--install-nvidia-plugin=false" in steps["create-cluster"].command
    # ... and the EFA one (no opt-out) is deleted before the pinned charts are installed.
    remove = steps["remove-eksctl-device-plugins"].command
    assert remove[:3] == ["kubectl", "delete", "daemonset"] and "--ignore-not-found" in remove
    assert remove[remove.index("--field-selector") + 1] == f"metadata.name={eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET}"
    assert names.index("remove-eksctl-device-plugins") < names.index("helm-nvidia-device-plugin")
    assert names.index("remove-eksctl-device-plugins") < names.index("helm-aws-efa-k8s-device-plugin")
    # eksctl's EFA DaemonSet has the very name of the EFA chart's: only a copy without Helm's label is deleted.
    (efa,) = [r for r in plan.helm_releases if r.chart == "aws-efa-k8s-device-plugin"]
    assert efa.workload == ("DaemonSet", eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET)
    assert remove[remove.index("--selector") + 1] == "app.kubernetes.io/managed-by!=Helm"


# --- steps and cost -------------------------------------------------------------------------------------------------


def test_steps_in_order_for_both_modes(cfg_for):
    cfg = cfg_for()
    assert [s.name for s in build_plan(cfg).steps] == RAYCLUSTER_STEPS
    job_steps = [s.name for s in build_plan(cfg, mode="rayjob").steps]
    assert job_steps[-4:] == ["apply-rayjob", "wait-rayjob", "check-nccl-transport", "scale-down-gpus"]
    assert "submit" not in job_steps
    scale = next(s for s in build_plan(cfg, mode="rayjob").steps if s.name == "scale-down-gpus").command
    assert scale[:3] == ["eksctl", "scale", "nodegroup"] and scale[scale.index("--nodes") + 1] == "0"
    steps = [s.name for s in build_plan(cfg_for(NAMESPACE="train"), hf_token=True).steps]
    assert steps.index("check-gpu-nodes") < steps.index("namespace") < steps.index("hf-token-secret")
    assert steps.index("hf-token-secret") < steps.index("apply-raycluster")
    for step in build_plan(cfg).steps:
        assert step.action and (step.command is None or all(isinstance(a, str) for a in step.command))


def test_offline_reads_the_image_and_builds_its_wheelhouse_before_any_ray_object(cfg_for):
    staged = "training.model_id=s3://team-models/Qwen2.5-1.5B"  # --offline: no node downloads from the Hub
    cfg = load_config(environ={"NAMESPACE": "train"}, path=None, sets=["ray.offline=true", staged])
    for mode, ray_step in (("raycluster", "apply-raycluster"), ("rayjob", "code-configmap")):
        steps = build_plan(cfg, mode=mode, hf_token=True).steps
        names = [s.name for s in steps]
        assert names.index("namespace") < names.index("offline-wheelhouse") < names.index("hf-token-secret")
        assert names.index("offline-wheelhouse") < names.index("job-config") < names.index(ray_step)
        action = steps[names.index("offline-wheelhouse")].action
        assert "train/ray-train-image-probe" in action and "before any Ray object" in action
        assert ("Ray head pod" in action) == (mode == "raycluster")
    assert "offline-wheelhouse" not in [s.name for s in build_plan(cfg_for()).steps]
    assert "remembered" in action and "init container" in action
    # On a shared volume: written there through the pod (always asked), read there by pip, no init container.
    from raytrain_eks.k8s.state import with_shared_volume

    on_volume = with_shared_volume(
        load_config(environ={}, path=None, sets=["ray.offline=true", "ray.shared_volume=team-fs", staged])
    )
    step = next(s for s in build_plan(on_volume, mode="rayjob").steps if s.name == "offline-wheelhouse")
    assert "onto ray.shared_volume team-fs at /mnt/shared/runs/.raytrain-eks-wheelhouse/DIGEST" in step.action
    assert "remembered" not in step.action and "init container" not in step.action


def test_submit_runs_inside_the_head_pod(cfg_for):
    submit = next(s for s in build_plan(cfg_for()).steps if s.name == "submit").command
    assert submit[:2] == ["kubectl", "exec"] and "service/ray-train-head-svc" in submit
    assert submit[submit.index("submit") + 1 : submit.index("submit") + 3] == ["--address", "http://127.0.0.1:8265"]
    assert submit[-len(m.train_argv()) :] == m.train_argv()


def test_plan_states_the_system_nodes_root_volume_and_why(cfg_for):
    plan = build_plan(cfg_for())
    volume = plan.summary["system_node_volume"]
    assert (volume["gib"], volume["type"]) == (eksctl.SYSTEM_VOLUME_GIB, "gp3") and volume["gib"] > 80
    assert "image" in volume["why"] and "run folder" in volume["why"] and "eksctl's default is 80 GiB" in volume["why"]
    (create,) = [s for s in plan.steps if s.name == "create-cluster"]
    assert (
        f"node group system (1 x m7i.xlarge, a {eksctl.SYSTEM_VOLUME_GIB} GiB gp3 root volume each: " in create.action
    )
    # EBS has no price in the plan: its note says so, and the volume adds no line.
    assert any("Excludes EBS volumes" in note for note in plan.cost["notes"])
    assert not [i for i in plan.cost["items"] if "EBS" in i["name"] or "volume" in i["name"].lower()]


def test_reference_cost_is_about_nine_and_a_half_dollars_an_hour(cfg_for):
    cost = build_plan(cfg_for()).cost
    assert cost["total_usd"] == pytest.approx(9.5498)
    items = {i["name"]: i for i in cost["items"]}
    assert list(items) == ["GPU instances", "system node", "EKS control plane", "NAT gateway"]
    assert (items["GPU instances"]["count"], items["GPU instances"]["unit_usd_per_hour"]) == (2, 4.6016)
    assert items["system node"]["usd_per_hour"] == pytest.approx(0.2016)
    assert items["EKS control plane"]["usd_per_hour"] == pytest.approx(0.10)
    assert items["NAT gateway"]["usd_per_hour"] == pytest.approx(0.045)
    assert cost["complete"] is True and cost["price_region"] == "us-east-1"


@pytest.mark.parametrize(
    ("version", "day", "period", "control_plane_usd"),
    [
        ("1.36", date(2026, 11, 30), "standard", 0.10),  # the reference's version, newer than EKS's calendar here
        ("1.34", date(2026, 11, 30), "standard", 0.10),  # standard support ends 2026-12-02
        ("1.34", date(2026, 12, 3), "extended", 0.60),
        ("1.33", date(2026, 11, 30), "extended", 0.60),  # standard support ended 2026-07-29
        ("1.32", date(2026, 11, 30), "extended", 0.60),
        ("1.31", date(2026, 11, 30), "ended", 0.10),  # extended support ended 2026-11-26
    ],
)
def test_the_control_plane_is_priced_by_the_versions_eks_support(cfg_for, version, day, period, control_plane_usd):
    cost = build_plan(cfg_for(K8S_VERSION=version), on=day).cost
    items = {i["name"]: i for i in cost["items"]}
    plane = items["EKS control plane"]
    assert plane["usd_per_hour"] == pytest.approx(control_plane_usd)
    assert plane["what"] == f"cluster on Kubernetes {version}, {period} support"
    assert cost["total_usd"] == pytest.approx(2 * 4.6016 + 0.2016 + control_plane_usd + 0.045)
    note = next(n for n in cost["notes"] if f"Kubernetes {version}" in n)
    if period == "extended":
        assert "extended support until" in note and "$0.60/h instead of $0.10/h" in note
    if period == "ended":
        assert "a new cluster cannot be created with it" in note


def test_cost_follows_the_instance_and_says_when_a_price_is_unknown(cfg_for):
    cfg = cfg_for(GPU_NODE_TYPE="p5.48xlarge", GPUS_PER_NODE="8", GPU_NODE_COUNT="4", REGION="eu-west-1")
    cost = build_plan(cfg).cost
    assert cost["total_usd"] == pytest.approx(4 * 55.04 + 0.2016 + 0.10 + 0.045)
    assert any("eu-west-1 differs" in n for n in cost["notes"])
    cfg = cfg_for(GPU_NODE_TYPE="p5e.48xlarge", GPUS_PER_NODE="8")
    plan = build_plan(cfg)
    gpu_item = plan.cost["items"][0]
    assert gpu_item["usd_per_hour"] is None and plan.cost["complete"] is False
    assert plan.cost["total_usd"] == pytest.approx(0.2016 + 0.10 + 0.045)
    direct = cost_per_hour(cfg, instance_type("p5e.48xlarge"), instance_type("m7i.xlarge"))
    assert direct == plan.cost and any("No price known for p5e.48xlarge" in n for n in direct["notes"])


def test_run_cost_prices_the_tokens_this_attempt_trained(cfg_for):
    # A run resumed at step 50 of 100: its summary's tokens count from step 0, but this attempt trained 50 steps.
    summary = {"wall_s": 1800.0, "train_s": 1500.0, "tokens_per_s": 20_000.0, "tokens": 60_000_000, "steps": 100}
    cost = run_cost(cfg_for(), summary)
    assert cost["usd"] == pytest.approx(9.5498 / 2, abs=1e-4)
    assert cost["usd_per_million_tokens"] == pytest.approx(9.5498 / 2 / 30, abs=1e-4), "30 M tokens, not 60 M"


def test_run_cost_counts_the_tokens_the_summary_says_this_attempt_trained(cfg_for):
    # tokens_per_s is the steady-state rate (warm-up and checkpoints left out), so it is not multiplied by a time:
    # the summary's trained_tokens is what this attempt trained.
    summary = {"wall_s": 1800.0, "train_s": 1500.0, "tokens_per_s": 30_000.0, "tokens": 60_000_000, "steps": 100}
    cost = run_cost(cfg_for(), {**summary, "trained_tokens": 24_000_000})
    assert cost["usd_per_million_tokens"] == pytest.approx(9.5498 / 2 / 24, abs=1e-4)
    assert run_cost(cfg_for(), {**summary, "trained_tokens": 0})["usd_per_million_tokens"] is None


# --- plan --output-dir ------------------------------------------------------------------------------------------------


def _validate_written(out: Path, schemas: dict[str, jsonschema.Draft7Validator], k8s_version: str) -> dict[str, Any]:
    """Validate every YAML file under ``out``; return the documents by file name."""
    docs: dict[str, Any] = {}
    for path in sorted(out.rglob("*.yaml")):
        loaded = list(yaml.safe_load_all(path.read_text()))
        docs[str(path.relative_to(out))] = loaded
        for doc in loaded:
            kind = doc.get("kind") if isinstance(doc, dict) else None
            if kind == "ClusterConfig":
                assert schema_errors(schemas["eksctl"], doc) == [], path
            elif kind in ("RayCluster", "RayJob"):
                assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"]
                assert schema_errors(schemas[kind], doc) == [], path
                for i, t in enumerate(m.pod_templates(doc)):
                    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}"}, "spec": t["spec"]}
                    kubernetes_validate.validate(pod, k8s_version, strict=True)
            elif kind is not None:
                kubernetes_validate.validate(doc, k8s_version, strict=True)
    return docs


@pytest.mark.parametrize("mode", ["raycluster", "rayjob"])
@pytest.mark.parametrize("itype,gpus,efa", INSTANCES)
def test_everything_plan_writes_validates(cfg_for, schemas, tmp_path, itype, gpus, efa, mode):
    cfg = cfg_for(GPU_NODE_TYPE=itype, GPUS_PER_NODE=str(gpus), NAMESPACE="train")
    out = tmp_path / "plan-out"
    plan, written = write_plan(cfg, out, mode=mode, hf_token=True)
    manifest = f"{mode}.yaml"
    expected = {
        "eksctl-cluster.yaml",
        "eksctl-iamserviceaccount.yaml",
        "helm-releases.yaml",
        "helm/nvidia-device-plugin.values.yaml",
        "helm/aws-efa-k8s-device-plugin.values.yaml",
        "helm/kuberay-operator.values.yaml",
        "namespace.yaml",
        "job-config.yaml",
        manifest,
        "plan.json",
        # The package the job imports, as the step that ships it reads it.
        PACKAGE_ARCHIVE_FILE if mode == "raycluster" else CODE_CONFIG_MAP_FILE,
    }
    assert {str(p.relative_to(out)) for p in written} == expected
    assert {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} == expected
    docs = _validate_written(out, schemas, cfg.cluster.k8s_version)
    (job,) = docs[manifest]
    spec = job["spec"].get("rayClusterSpec", job["spec"])
    limits = spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"]) == (str(gpus), str(efa))
    (helm,) = docs["helm-releases.yaml"]
    assert {r["name"]: r["version"] for r in helm["releases"]} == {
        "nvidia-device-plugin": "0.20.0",
        "aws-efa-k8s-device-plugin": "v0.5.30",
        "kuberay-operator": "1.7.0",
    }
    data = json.loads((out / "plan.json").read_text())
    assert data == json.loads(json.dumps(plan.to_json()))
    assert [s["name"] for s in data["steps"]][0] == "preflight"
    assert all(set(s) >= {"name", "action"} for s in data["steps"])
    assert set(data["cost_per_hour"]) >= {"total_usd", "items"}
    for step in data["steps"]:
        for f in [*step["files"], *([step["stdin"]] if "stdin" in step else [])]:
            assert (out / f).is_file(), f"step {step['name']} names a file that was not written: {f}"


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"GPU_NODE_TYPE": "g6.xlarge", "GPUS_PER_NODE": "1"}, "does not support EFA"),
        ({"GPUS_PER_NODE": "8"}, "g6.12xlarge has 4 GPUs and each worker pod takes a whole node; set GPUS_PER_NODE=4"),
        ({"REGION": "xx-nowhere-9"}, "cluster.region = 'xx-nowhere-9': not a region where raytrain-eks knows EKS runs"),
        ({"REGION": "us-est-1"}, "did you mean us-west-1 or us-east-1"),
        ({"GPU_NODE_TYPE": "z9.huge"}, "cluster.gpu_node_type = 'z9.huge': unknown instance type"),
        ({"NUM_WORKERS": "16"}, "training.num_workers = 16: more than the 8 GPUs"),
    ],
)
def test_bad_input_is_one_clear_message_and_nothing_is_written(tmp_path, monkeypatch, environ, expected):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ=environ)
    out = tmp_path / "plan-out"
    with pytest.raises(ConfigError) as info:
        write_plan(cfg, out)
    assert len(info.value.problems) == 1, info.value.problems
    assert expected in info.value.problems[0]
    assert not out.exists()


def test_cli_bad_input_names_the_problem_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("GPU_NODE_TYPE", "GPUS_PER_NODE", "REGION", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPU_NODE_TYPE", "g5.4xlarge")
    monkeypatch.setenv("GPUS_PER_NODE", "1")
    result = CliRunner().invoke(_app(), ["plan", "--output-dir", str(tmp_path / "out")])
    assert isinstance(result.exception, ConfigError)
    assert "does not support EFA" in str(result.exception)
    assert not (tmp_path / "out").exists()


def test_cli_plan_prints_steps_and_cost_and_keeps_the_token_secret(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    token = "hf_cliTokenThatMustNotLeak42"
    monkeypatch.setenv("HF_TOKEN", token)
    result = CliRunner().invoke(_app(), ["plan", "--mode", "rayjob", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "Cost per hour (us-east-1 on-demand): $9.55" in result.output
    assert "hf-token-secret" in result.output and "apply-rayjob" in result.output
    assert token not in result.output
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert token not in path.read_text(), path
    assert (tmp_path / "out" / "rayjob.yaml").exists() and not (tmp_path / "out" / "raycluster.yaml").exists()
    job = yaml.safe_load((tmp_path / "out" / "rayjob.yaml").read_text())
    head_env = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in head_env
    result = CliRunner().invoke(_app(), ["plan"])
    assert result.exit_code == 0 and "Nothing written" in result.output


def test_plan_needs_no_credentials_and_no_cluster_tools(tmp_path):
    """A clean process: no AWS variables or files, an empty PATH, and nothing cloud-side imported."""
    script = (
        "import shutil, sys, typer\n"
        "from raytrain_eks.deploy.commands import register\n"
        "assert not any(shutil.which(t) for t in ('eksctl', 'helm', 'kubectl', 'aws'))\n"
        "app = typer.Typer()\n"
        "app.callback()(lambda: None)\n"
        "register(app)\n"
        "try:\n"
        "    app(['plan', '--output-dir', 'out'])\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "loaded = [m for m in ('boto3', 'botocore', 'kubernetes', 'ray', 'torch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    bindir = tmp_path / "empty-bin"
    bindir.mkdir()
    env = {
        "PATH": str(bindir),
        "HOME": str(tmp_path),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "out" / "plan.json").is_file() and (tmp_path / "out" / "eksctl-cluster.yaml").is_file()


def test_plan_shows_the_checkpoint_bucket_its_role_and_what_kept_checkpoints_cost(cfg_for):
    plan = build_plan(cfg_for())
    summary = plan.summary
    assert summary["checkpoint_bucket"] == "ray-train-eks-checkpoints-xxxxxxxx"
    assert summary["checkpoints"] == "s3://ray-train-eks-checkpoints-xxxxxxxx/runs"
    assert "raytrain-eks-ray, this bucket only" in summary["checkpoint_role"]
    # Qwen2.5-1.5B: 1.54 G parameters x 12 bytes x 2 kept checkpoints = 37.0 GB at $0.023/GB-month.
    assert summary["checkpoint_storage"]["gb"] == pytest.approx(37.0, abs=0.1)
    assert summary["checkpoint_storage"]["usd_per_month"] == pytest.approx(0.85, abs=0.01)
    own = build_plan(cfg_for(CHECKPOINT_BUCKET="team-ckpt", KEEP_CHECKPOINTS="3"))
    assert own.summary["checkpoint_bucket"] == "team-ckpt" and own.summary["checkpoint_storage"]["gb"] > 55
    # LoRA keeps its adapters only: rank 16 on the 7 linear layers of each of the 28 blocks, 18.5 M parameters.
    cfg = cfg_for()
    lora = cfg.model_copy(update={"training": cfg.training.model_copy(update={"method": "lora"})})
    storage = build_plan(lora).summary["checkpoint_storage"]
    assert storage["trained_parameters"] == 28 * 16 * (2 * (1536 + 1536) + 2 * (1536 + 256) + 3 * (1536 + 8960))
    assert storage["gb"] == pytest.approx(0.44, abs=0.01) and storage["usd_per_month"] == pytest.approx(0.01)
    assert "adapter parameters of LoRA rank 16 (the frozen base is never saved)" in storage["basis"]
    step = next(s for s in own.steps if s.name == "checkpoint-bucket")
    assert "existing S3 bucket team-ckpt" in step.action and "never deleted" in step.action
    policy = own.files["eksctl-cluster.yaml"][0]["iam"]["serviceAccounts"][0]["attachPolicy"]
    assert {r for st in policy["Statement"] for r in st["Resource"]} == {
        "arn:aws:s3:::team-ckpt",
        "arn:aws:s3:::team-ckpt/*",
    }


def test_a_bucket_name_that_s3_refuses_is_one_config_error(cfg_for):
    with pytest.raises(ConfigError, match="checkpoint_bucket"):
        cfg_for(CHECKPOINT_BUCKET="Team_Checkpoints")


def test_the_planned_job_keeps_its_checkpoints_where_both_nodes_reach(cfg_for):
    doc = build_plan(cfg_for()).files["job-config.yaml"][0]
    job_cfg = yaml.safe_load(next(iter(doc["data"].values())))
    assert job_cfg["training"]["storage_path"] == "s3://ray-train-eks-checkpoints-xxxxxxxx/runs"
    # A folder on each node's own disk is refused before anything is planned, naming both ways out.
    with pytest.raises(ConfigError, match="span 2 nodes"):
        build_plan(cfg_for(STORAGE_PATH="/data/runs"))
    shared = build_plan(cfg_for(STORAGE_PATH="/mnt/efs/runs", STORAGE_SHARED="true"))
    assert shared.summary["checkpoints"] == "/mnt/efs/runs"


def test_a_run_on_a_cluster_this_tool_did_not_deploy_is_priced_only_at_a_configured_price(tmp_path):
    from raytrain_eks.eks.pricing import job_price
    from raytrain_eks.report.html import cost_text

    config = tmp_path / "raytrain-eks.yaml"  # no deployment record beside it: `submit` did not send this job
    config.write_text("cluster:\n  usd_per_hour: 12.5\n")
    price, why_not = job_price(config, None)
    assert price is None and why_not is not None
    assert why_not.startswith("no deployment record beside") and why_not.endswith(
        "set cluster.usd_per_hour (or cluster.usd_per_node_hour) to price runs on it"
    )

    hourly = load_config(path=config).cluster.usd_per_hour
    price, why_not = job_price(config, hourly)
    assert why_not is None and price is not None
    cost = price({"wall_s": 1800.0, "trained_tokens": 2_000_000})
    assert (cost["usd"], cost["usd_per_hour"], cost["usd_per_million_tokens"]) == (6.25, 12.5, 3.125)
    assert cost["source"] == "configured" and cost["cluster"] is None
    assert cost_text(cost) == "$6.25 at $12.50/h (cluster.usd_per_hour); $3.12 per million tokens"


def test_a_price_per_node_hour_counts_the_gpu_nodes_the_run_used(tmp_path):
    from raytrain_eks.eks.pricing import job_price
    from raytrain_eks.report.html import cost_text

    config = tmp_path / "raytrain-eks.yaml"  # an autoscaled cluster: no fixed size, a known price per GPU node
    config.write_text("cluster:\n  target: kubernetes\n  usd_per_node_hour: 5.5\n")
    c = load_config(path=config).cluster
    price, why_not = job_price(config, c.usd_per_hour, c.usd_per_node_hour)
    assert why_not is None and price is not None
    cost = price({"wall_s": 1800.0, "trained_tokens": 2_000_000, "nodes": 4})
    assert (cost["usd"], cost["usd_per_hour"], cost["nodes"]) == (11.0, 22.0, 4)
    assert cost_text(cost) == (
        "$11.00 at $22.00/h (4 GPU node(s) x $5.50, cluster.usd_per_node_hour); $5.50 per million tokens"
    )
    config.write_text("cluster:\n  usd_per_hour: 20\n  usd_per_node_hour: 5.5\n")
    with pytest.raises(ConfigError, match="usd_per_hour .the whole cluster. or cluster.usd_per_node_hour"):
        load_config(path=config)


@pytest.mark.parametrize("value", ["0", "-3", "cheap"])
def test_a_configured_price_that_is_not_a_positive_number_is_one_config_error(tmp_path, value):
    config = tmp_path / "raytrain-eks.yaml"
    config.write_text(f"cluster:\n  usd_per_hour: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path=config)
    assert "cluster.usd_per_hour" in str(info.value)


def test_the_plans_job_config_carries_the_chat_templates_text_and_refuses_an_unreadable_file(tmp_path: Path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    cfg = load_config(environ={}, path=None, sets=[f"training.chat_template={tmp_path / 'chat.jinja'}"])
    (job_config,) = build_plan(cfg).files[JOB_CONFIG_FILE]
    assert yaml.safe_load(job_config["data"][m.CONFIG_FILE])["training"]["chat_template"] == template
    gone = load_config(environ={}, path=None, sets=[f"training.chat_template={tmp_path / 'gone.jinja'}"])
    with pytest.raises(DataError, match="gone.jinja'?: cannot read the template file"):
        write_plan(gone, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_plan_refuses_lora_layers_the_model_lacks_naming_those_it_has():
    sets = ["training.method=lora", "training.lora.target_modules=[q_proj, query_key_value]"]
    with pytest.raises(UserError, match="'query_key_value' matches no linear layer of Qwen/Qwen2.5-1.5B") as err:
        build_plan(load_config(environ={}, path=None, sets=sets))
    assert "its linear layers are: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in str(err.value)
    fine = ["training.method=lora", "training.lora.target_modules=[q_proj, v_proj]"]
    assert build_plan(load_config(environ={}, path=None, sets=fine)).summary["memory_per_gpu"]["settings"]["method"]


def test_plan_shows_the_learning_rate_the_job_trains_with_and_why(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LEARNING_RATE", raising=False)
    result = CliRunner().invoke(_app(), ["plan", "--set", "training.method=lora", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "learning_rate 0.0002 (LoRA's default; full fine-tuning's is 2e-05)" in result.output
    shipped = yaml.safe_load((tmp_path / "out" / JOB_CONFIG_FILE).read_text())["data"][m.CONFIG_FILE]
    assert yaml.safe_load(shipped)["training"]["learning_rate"] == 2e-4  # what the job's optimizer is given
    result = CliRunner().invoke(
        _app(), ["plan", "--set", "training.method=lora", "--set", "training.learning_rate=1e-4"]
    )
    assert "learning_rate 0.0001 (as set; LoRA's default is 0.0002)" in result.output


def test_plan_states_the_sharding_the_job_will_choose_beside_its_memory_estimate(cfg_for, tmp_path):
    # The reference, 2 nodes x 4 GPUs under training.sharding auto: HSDP, each parameter sharded over a node's GPUs.
    plan = build_plan(cfg_for())
    assert plan.summary["sharding"]["mode"] == "hsdp" and plan.summary["sharding"]["mesh_shape"] == [2, 4]
    assert plan.summary["memory_per_gpu"]["settings"]["shard_ranks"] == 4  # the layout the estimate assumes
    one_node = build_plan(cfg_for(GPU_NODE_COUNT="1")).summary["sharding"]
    assert one_node["mode"] == "fsdp" and one_node["mesh_shape"] == [4]
    assert one_node["line"].startswith("sharding: fsdp, 4 ranks in one group on one node")
    said = (
        "sharding: hsdp, 2 nodes x 4 ranks: parameters sharded over the 4 GPUs of a node, replicated across the 2 "
        "nodes (auto: 8 ranks on 2 nodes"
    )
    for mode in ("raycluster", "rayjob"):
        result = CliRunner().invoke(_app(), ["plan", "--mode", mode], env={"COLUMNS": "400"})
        assert result.exit_code == 0, result.output
        assert said in result.output
        lines = result.output.splitlines()
        memory = next(i for i, line in enumerate(lines) if line.startswith("memory: "))
        assert lines[memory + 1].startswith(said), "the layout is said on the line after the estimate"
    # config show: the line after its memory estimate (a progress bar on stderr may share the estimate's line).
    from raytrain_eks.cli import app

    shown = CliRunner().invoke(app, ["config", "show"], env={"COLUMNS": "400"}).output.splitlines()
    memory_line = next(i for i, line in enumerate(shown) if "# memory: " in line)
    assert shown[memory_line + 1].startswith(f"# {said}")


KUBERNETES = ["cluster.target=kubernetes", "ray.worker_cpu=8", "ray.worker_memory_gib=60", "cluster.efa_per_node=1"]


def _kubernetes_plan(tmp_path: Path, *sets: str):
    from raytrain_eks.kubernetes import plan as plan_existing

    cfg = load_config(environ={}, path=None, sets=[*KUBERNETES, "training.storage_path=s3://b/runs", *sets])
    return plan_existing.build_plan(cfg, state_dir=tmp_path / ".raytrain-eks")


def test_the_plan_says_where_the_operator_and_the_head_run_on_each_target(cfg_for, tmp_path):
    def where(plan) -> tuple[str, str]:
        steps = {s.name: s.action for s in plan.steps}
        return steps["helm-kuberay-operator"], steps["apply-raycluster"]

    operator, head = where(build_plan(cfg_for()))
    assert "runs the operator on the system node" in operator and "GPU-less head on the system node" in head
    # A cluster of the user's kubeconfig has no system node: the operator and the head go where the settings say.
    plan = _kubernetes_plan(tmp_path)
    operator, head = where(plan)
    assert "runs the operator on any node that takes it" in operator and "GPU-less head on any node that" in head
    assert not [s.name for s in plan.steps if "system node" in s.action]
    operator, head = where(_kubernetes_plan(tmp_path, "cluster.head_node_selector={pool: cpu}"))
    assert "runs the operator on a node labelled pool=cpu" in operator
    assert "GPU-less head on a node labelled pool=cpu" in head


def test_the_kubernetes_plan_names_every_missing_setting_at_once(tmp_path):
    from raytrain_eks.kubernetes import plan as plan_existing

    # Neither the worker pods' shape nor storage every node reaches: one message names both.
    cfg = load_config(environ={}, path=None, sets=["cluster.target=kubernetes"])
    with pytest.raises(UserError) as err:
        plan_existing.write_plan(cfg, tmp_path / "out", state_dir=tmp_path / ".raytrain-eks")
    said = err.value.message
    assert "ray.worker_cpu, ray.worker_memory_gib and cluster.efa_per_node are not set" in said
    assert "training.storage_path = None: the training workers span 2 nodes" in said
    assert err.value.exit_code == 2 and "checkpoints" in (err.value.hint or "")
    assert not (tmp_path / "out").exists()
    # With the shape given, storage alone is the one problem, as before.
    with pytest.raises(ConfigError, match="training.storage_path = None"):
        plan_existing.build_plan(load_config(environ={}, path=None, sets=KUBERNETES), state_dir=tmp_path / "s")


def test_plan_refuses_a_hub_model_under_offline():
    with pytest.raises(UserError, match="training.model_id 'Qwen/Qwen2.5-1.5B' is a Hub model") as err:
        build_plan(load_config(environ={}, path=None, sets=["ray.offline=true"]))
    assert "raytrain-eks stage-model" in (err.value.hint or "")


def test_with_a_shared_volume_the_plan_puts_checkpoints_where_submit_does(tmp_path: Path):
    cfg = load_config(environ={}, path=None, sets=["ray.shared_volume=team-fs"])
    store = StateStore(tmp_path / ".raytrain-eks")
    store.update(cluster=cfg.cluster.name, bucket="raytrain-ckpt-abcdefgh")  # what up remembers
    submitted = apply_state(cfg, store).training  # what submit's job config holds
    plan = build_plan(cfg)
    (job_config,) = plan.files[JOB_CONFIG_FILE]
    planned = yaml.safe_load(job_config["data"][m.CONFIG_FILE])["training"]
    assert planned["storage_path"] == submitted.storage_path == "/mnt/shared/runs"
    assert planned["storage_shared"] is submitted.storage_shared is True
    assert plan.summary["checkpoints"] == "/mnt/shared/runs" and "team-fs" in plan.summary["checkpoint_role"]
