"""``plan`` on the ``kubernetes`` target: pure (no cluster, no kubeconfig read, the state folder only read), the worker
pods sized from what ``up`` recorded or from the settings (else one error naming the settings), the files submit
applies (each validated against the upstream schemas as test_plan.py validates the EKS plan's), the cost only at a
configured price, and every helm and kubectl line parsed by the real binaries. After a real ``up`` against the
deploy tests' fakes, the plan's worker pods are the ones ``submit`` then applies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_kube import ZONE_LABEL
from test_command_lines import Collector, chart_repo, check  # noqa: F401 - chart_repo: the fixture
from test_deploy import TOKEN
from test_kubernetes_target import CONTEXT, Cluster, efa, plain  # noqa: F401 - efa, plain: the fixtures
from test_plan import _validate_written, schemas  # noqa: F401 - schemas: the fixture

from raytrain_eks.config import load_config
from raytrain_eks.deploy import submit as sub
from raytrain_eks.deploy.plan import PACKAGE_ARCHIVE_FILE
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.kubernetes import existing
from raytrain_eks.kubernetes import plan as plan_existing

BASE = ["cluster.target=kubernetes", "training.storage_path=s3://team-checkpoints/runs"]
SHAPE = ["ray.worker_cpu=39", "ray.worker_memory_gib=154"]
UP_STEPS = ["find-gpu-nodes", "helm-nvidia-device-plugin", "helm-kuberay-operator", "check-gpu-nodes"]
NO_EKS_STEPS = {"preflight", "checkpoint-bucket", "create-cluster", "iam-service-account", "scale-down-gpus"}


def _cfg(*sets: str) -> Any:
    return load_config(environ={}, path=None, sets=[*BASE, *sets])


def _worker(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    (group,) = spec["workerGroupSpecs"]
    return group["template"]["spec"]


def _names(written: list[Path], out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in written}


# --- the shape from the settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("efa_per_node", [0, 1])
@pytest.mark.parametrize("mode", ["raycluster", "rayjob"])
def test_the_settings_size_the_worker_pods_and_every_file_validates(
    schemas: Any,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    efa_per_node: int,
):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(*SHAPE, f"cluster.efa_per_node={efa_per_node}", "ray.namespace=train", "cluster.context=gpus")
    out = tmp_path / "plan-out"
    plan, written = plan_existing.write_plan(cfg, out, state_dir=tmp_path / ".raytrain-eks", mode=mode, hf_token=True)
    manifest = f"{mode}.yaml"
    expected = {
        "helm-releases.yaml",
        "helm/nvidia-device-plugin.values.yaml",
        *(["helm/aws-efa-k8s-device-plugin.values.yaml"] if efa_per_node else []),
        "helm/kuberay-operator.values.yaml",
        "namespace.yaml",
        "service-account.yaml",
        "job-config.yaml",
        manifest,
        PACKAGE_ARCHIVE_FILE if mode == "raycluster" else "code-configmap.yaml",
        "plan.json",
    }
    assert _names(written, out) == expected
    assert {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} == expected  # no eksctl file
    assert not (tmp_path / ".raytrain-eks").exists(), "the state folder is only read"
    docs = _validate_written(out, schemas, cfg.cluster.k8s_version)
    (job,) = docs[manifest]
    pod = _worker(job)
    (container,) = pod["containers"]
    limits = container["resources"]["limits"]
    assert (limits["cpu"], limits["memory"], limits[m.GPU_RESOURCE]) == ("39", "154Gi", "4")
    assert (m.EFA_RESOURCE in limits) is bool(efa_per_node)
    if efa_per_node:
        assert limits[m.EFA_RESOURCE] == "1"
    assert pod["serviceAccountName"] == m.RAY_SERVICE_ACCOUNT
    (account,) = docs["service-account.yaml"]
    assert account == existing.service_account(cfg) and "annotations" not in account["metadata"]  # no cloud role
    data = json.loads((out / "plan.json").read_text())
    assert data == json.loads(json.dumps(plan.to_json()))
    names = [s["name"] for s in data["steps"]]
    assert names[:2] == ["find-gpu-nodes", "helm-nvidia-device-plugin"] and not NO_EKS_STEPS & set(names)
    assert ("helm-aws-efa-k8s-device-plugin" in names) is bool(efa_per_node)
    assert names.index("namespace") < names.index("service-account") < names.index("hf-token-secret")
    assert names.index("hf-token-secret") < names.index("job-config") < names.index(f"apply-{mode}")
    assert names[-1] == ("check-nccl-transport" if mode == "raycluster" else "delete-rayjob-cluster")
    nccl = next(s["action"] for s in data["steps"] if s["name"] == "check-nccl-transport")
    assert ("over EFA" in nccl) is bool(efa_per_node)  # fabric.require efa only where the pods get EFA
    assert plan.summary["fabric_require"] == ("efa" if efa_per_node else "any")
    for step in data["steps"]:
        for f in [*step["files"], *([step["stdin"]] if "stdin" in step else [])]:
            assert (out / f).is_file(), f"step {step['name']} names a file that was not written: {f}"
        if step["command"]:  # on the user's cluster, in the configured context
            assert step["command"][0] in ("helm", "kubectl") and "gpus" in step["command"]


def test_gpu_nodes_on_demand_plan_no_device_plugin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(
        *SHAPE,
        "cluster.efa_per_node=1",
        "cluster.gpu_nodes_on_demand=true",
        "cluster.gpu_node_selector={karpenter.sh/nodepool: gpu}",
    )
    plan = plan_existing.build_plan(cfg, state_dir=tmp_path / ".raytrain-eks")
    names = [s.name for s in plan.steps]
    assert names[:3] == ["find-gpu-nodes", "helm-kuberay-operator", "check-gpu-nodes"]
    assert "GPU nodes come on demand" in plan.steps[0].action
    assert [r.name for r in plan.helm_releases] == ["kuberay-operator"]
    pod = _worker(plan.files["raycluster.yaml"][0])
    assert pod["nodeSelector"] == {"karpenter.sh/nodepool": "gpu"}
    assert pod["containers"][0]["resources"]["limits"][m.EFA_RESOURCE] == "1"


def test_the_plan_keeps_efa_worker_pods_in_the_zone_chosen_and_says_how_up_finds_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = tmp_path / ".raytrain-eks"
    chosen = plan_existing.build_plan(
        _cfg(*SHAPE, "cluster.efa_per_node=1", "cluster.gpu_az=us-east-1c"), state_dir=state
    )
    assert _worker(chosen.files["raycluster.yaml"][0])["nodeSelector"] == {ZONE_LABEL: "us-east-1c"}
    assert chosen.summary["gpu_zone"] == "us-east-1c"
    assert "the worker pods are kept to zone us-east-1c" in chosen.steps[0].action
    assert "NVIDIA driver" in chosen.steps[0].action and "580 or later" in chosen.steps[0].action
    found = plan_existing.build_plan(_cfg(*SHAPE, "cluster.efa_per_node=1"), state_dir=state)
    assert "nodeSelector" not in _worker(found.files["raycluster.yaml"][0]) and found.summary["gpu_zone"] is None
    assert (
        "up stops, naming the zones, when they are in several and cluster.gpu_az chooses none" in found.steps[0].action
    )
    without = plan_existing.build_plan(
        _cfg(*SHAPE, "cluster.efa_per_node=0", "cluster.gpu_az=us-east-1c"), state_dir=state
    )
    assert "nodeSelector" not in _worker(without.files["raycluster.yaml"][0]) and "zone" not in without.steps[0].action


# --- the shape from up's record --------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["plain", "efa"])
def test_after_up_the_plans_worker_pods_are_those_submit_applies(which, request, tmp_path):
    c: Cluster = request.getfixturevalue(which)
    c.target.up(c.d(), confirm=c.ask())
    state = c.store.path.read_text()
    plan = plan_existing.build_plan(c.cfg, state_dir=c.store.root)
    assert c.store.path.read_text() == state, "plan only reads the state"
    assert plan.summary["worker_pods_from"].startswith("up's record")
    assert sub.submit(c.d(), hf_token=TOKEN).exit_code == 0, c.said()
    (applied,) = [o for o in c.kube.applied if o["kind"] == "RayCluster"]
    planned, got = _worker(plan.files["raycluster.yaml"][0]), _worker(applied)
    for key in ("nodeSelector", "tolerations", "serviceAccountName"):
        assert planned.get(key) == got.get(key), key
    assert planned["containers"][0]["resources"] == got["containers"][0]["resources"]
    limits = got["containers"][0]["resources"]["limits"]
    if which == "plain":  # 5/6 of the nodes' 11 CPU and 80 GiB, no EFA: fabric.require any, no estimate
        assert (limits["cpu"], limits["memory"], m.EFA_RESOURCE in limits) == ("9", "66Gi", False)
        assert plan.summary["fabric_require"] == "any" and plan.summary["memory_per_gpu"] is None
        assert any("memory estimate is left out" in a for a in plan.assumptions)
    else:  # EKS nodes used as they are: EFA requested and required, g6.12xlarge recorded: the estimate
        assert (limits["cpu"], limits[m.EFA_RESOURCE]) == ("39", "1")
        assert plan.summary["fabric_require"] == "efa" and plan.summary["gpu_node_type"] == "g6.12xlarge"
        assert plan.summary["memory_per_gpu"] is not None
        assert "helm-aws-efa-k8s-device-plugin" in [s.name for s in plan.steps]
        assert plan.summary["gpu_zone"] == "us-east-1a" and planned["nodeSelector"] == {ZONE_LABEL: "us-east-1a"}
    config = yaml.safe_load(next(o for o in c.kube.applied if o["kind"] == "ConfigMap")["data"][m.CONFIG_FILE])
    assert config["fabric"]["require"] == plan.summary["fabric_require"]


def test_a_configured_gpu_node_type_gives_the_estimate_and_its_default_does_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = tmp_path / ".raytrain-eks"
    shape = [*SHAPE, "cluster.efa_per_node=4"]
    p4d = plan_existing.build_plan(_cfg(*shape, "cluster.gpu_node_type=p4d.24xlarge", "cluster.gpus_per_node=8"),
                                   state_dir=state)  # fmt: skip
    assert p4d.summary["gpu_node_type"] == "p4d.24xlarge" and p4d.summary["memory_per_gpu"] is not None
    default = plan_existing.build_plan(_cfg(*shape), state_dir=state)
    assert default.summary["memory_per_gpu"] is None and default.summary["gpu_node_type"] is None
    assert any("memory estimate is left out" in a and "cluster.gpu_node_type" in a for a in default.assumptions)


def test_the_default_gpu_node_type_counts_when_this_command_is_given_it_and_not_from_an_init_file(
    tmp_path, monkeypatch
):
    """g6.12xlarge is both the EKS target's default and a type a kubernetes cluster's unlabelled nodes may be: given
    with --set or GPU_NODE_TYPE it gives the L4's estimate; the same value in a file written by init does not."""
    from raytrain_eks.config_file import commented_yaml
    from raytrain_eks.presets import reference

    monkeypatch.chdir(tmp_path)
    state = tmp_path / ".raytrain-eks"
    shape = [*SHAPE, "cluster.efa_per_node=4"]
    by_set = plan_existing.build_plan(_cfg(*shape, "cluster.gpu_node_type=g6.12xlarge"), state_dir=state)
    assert by_set.summary["gpu_node_type"] == "g6.12xlarge" and by_set.summary["memory_per_gpu"] is not None
    env = load_config(environ={"GPU_NODE_TYPE": "g6.12xlarge"}, path=None, sets=[*BASE, *shape])
    by_env = plan_existing.build_plan(env, state_dir=state)
    assert by_env.summary["memory_per_gpu"] == by_set.summary["memory_per_gpu"]

    written = tmp_path / "raytrain-eks.yaml"
    written.write_text(commented_yaml(reference()))  # what `raytrain-eks init` writes: gpu_node_type among the rest
    from_file = load_config(environ={}, path=written, sets=[*BASE, *shape])
    assert from_file.cluster.gpu_node_type == "g6.12xlarge"
    plan = plan_existing.build_plan(from_file, state_dir=state)
    assert plan.summary["memory_per_gpu"] is None
    (why,) = [a for a in plan.assumptions if "memory estimate is left out" in a]
    assert "--set cluster.gpu_node_type=g6.12xlarge" in why and "GPU_NODE_TYPE" in why
    assert from_file.given_in_command("cluster.target") and not from_file.given_in_command("cluster.gpu_node_type")


# --- neither ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given,missing",
    [
        ([], ["ray.worker_cpu", "ray.worker_memory_gib", "cluster.efa_per_node"]),
        (["ray.worker_cpu=8", "ray.worker_memory_gib=60"], ["cluster.efa_per_node"]),
        (["cluster.efa_per_node=0"], ["ray.worker_cpu", "ray.worker_memory_gib"]),
    ],
)
def test_without_up_or_the_settings_one_error_names_them_and_nothing_is_written(tmp_path, monkeypatch, given, missing):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "plan-out"
    with pytest.raises(UserError) as err:
        plan_existing.write_plan(_cfg(*given), out, state_dir=tmp_path / ".raytrain-eks")
    assert err.value.exit_code == 2
    named = [s for s in plan_existing.SHAPE_SETTINGS if s in err.value.message]
    assert named == missing, err.value.message
    assert "raytrain-eks up" in (err.value.hint or "") and all(s in (err.value.hint or "") for s in missing)
    assert not out.exists() and not (tmp_path / ".raytrain-eks").exists()


def test_the_cli_refuses_with_exit_2_and_creates_nothing(tmp_path, monkeypatch, capsys):
    from raytrain_eks.cli import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "raytrain-eks.yaml"
    config.write_text("cluster:\n  target: kubernetes\ntraining:\n  storage_path: s3://b/runs\n")
    with pytest.raises(SystemExit) as done:
        main(["plan", "--config", str(config), "-o", str(tmp_path / "out")])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "ray.worker_cpu, ray.worker_memory_gib and cluster.efa_per_node are not set" in err
    assert "raytrain-eks up" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raytrain-eks.yaml"]


def test_storage_every_node_reaches_is_required_as_on_eks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ={}, path=None, sets=["cluster.target=kubernetes", *SHAPE, "cluster.efa_per_node=0"])
    with pytest.raises(UserError) as err:
        plan_existing.build_plan(cfg, state_dir=tmp_path / ".raytrain-eks")
    with pytest.raises(UserError) as same:
        cfg.check_cluster_storage()
    assert err.value.message == same.value.message
    shared = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"shared_volume": "ckpt"})})
    volume = plan_existing.build_plan(shared, state_dir=tmp_path / ".raytrain-eks")
    assert volume.summary["checkpoints"] == f"{cfg.ray.shared_volume_path}/runs"
    # What the kept checkpoints take is said wherever they go; only S3 has a price here.
    on_volume = volume.summary["checkpoint_storage"]
    assert on_volume["gb"] == pytest.approx(37.0, abs=0.1)  # Qwen2.5-1.5B: 1.54 G parameters x 12 bytes x 2 kept
    assert on_volume["usd_per_month"] is None and on_volume["where"] == "ray.shared_volume ckpt"
    in_s3 = plan_existing.build_plan(_cfg(*SHAPE, "cluster.efa_per_node=0"), state_dir=tmp_path / ".raytrain-eks")
    assert in_s3.summary["checkpoint_storage"]["usd_per_month"] == pytest.approx(0.85, abs=0.01)


# --- price -----------------------------------------------------------------------------------------------------------


def test_the_cost_is_a_configured_price_times_the_nodes_or_unknown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shape, state = [*SHAPE, "cluster.efa_per_node=0", "cluster.gpu_node_count=3"], tmp_path / ".raytrain-eks"
    per_node = plan_existing.build_plan(_cfg(*shape, "cluster.usd_per_node_hour=5.5"), state_dir=state).cost
    assert per_node["total_usd"] == pytest.approx(16.5)
    (item,) = per_node["items"]
    assert (item["count"], item["unit_usd_per_hour"], item["usd_per_hour"]) == (3, 5.5, pytest.approx(16.5))
    whole = plan_existing.build_plan(_cfg(*shape, "cluster.usd_per_hour=12.5"), state_dir=state).cost
    assert whole["total_usd"] == pytest.approx(12.5)
    unknown = plan_existing.build_plan(_cfg(*shape), state_dir=state).cost
    assert unknown["total_usd"] is None and "cluster.usd_per_node_hour" in unknown["unpriced"]


# --- the CLI ---------------------------------------------------------------------------------------------------------


def _config(tmp_path: Path, extra: str = "") -> Path:
    config = tmp_path / "raytrain-eks.yaml"
    config.write_text(
        "cluster:\n  target: kubernetes\n  efa_per_node: 0\n"
        + extra
        + "ray:\n  worker_cpu: 9\n  worker_memory_gib: 66\n"
        "training:\n  storage_path: s3://b/runs\n"
    )
    return config


def test_cli_plan_writes_a_rayjobs_files_prices_it_and_keeps_the_token_secret(tmp_path, monkeypatch, capsys):
    from raytrain_eks.cli import main
    from raytrain_eks.deploy import commands

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_planTokenThatMustNotLeak7")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))  # never read

    def no_cluster(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("plan made a deployment")

    monkeypatch.setattr(commands, "make_deployment", no_cluster)
    config, out = _config(tmp_path, "  usd_per_node_hour: 5.5\n"), tmp_path / "out"
    main(["plan", "--config", str(config), "--mode", "rayjob", "-o", str(out)])
    said = capsys.readouterr().out
    assert f"Plan (rayjob) for the cluster of {tmp_path / 'no-such-kubeconfig'}:" in said
    assert "Cost per hour (cluster.usd_per_node_hour as configured): $11.00" in said
    assert "GPU nodes: 2 x GPU node at cluster.usd_per_node_hour = $11.0000" in said
    assert "apply-rayjob" in said and "hf-token-secret" in said and f"files to {out}:" in said
    assert (out / "rayjob.yaml").is_file() and (out / "code-configmap.yaml").is_file()
    assert not (out / "raycluster.yaml").exists() and not list(out.glob("eksctl*"))
    for path in out.rglob("*"):
        assert not path.is_file() or "hf_planTokenThatMustNotLeak7" not in path.read_text(), path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raytrain-eks.yaml"]  # no state folder


def test_cli_plan_without_a_price_says_it_is_unknown_and_which_setting_gives_it(tmp_path, monkeypatch, capsys):
    from raytrain_eks.cli import main

    monkeypatch.chdir(tmp_path)
    main(["plan", "--config", str(_config(tmp_path))])
    said = capsys.readouterr().out
    assert "Cost per hour: price unknown:" in said
    assert "set cluster.usd_per_node_hour (each GPU node) or cluster.usd_per_hour (the whole cluster)" in said
    assert "Nothing written" in said and sorted(p.name for p in tmp_path.iterdir()) == ["raytrain-eks.yaml"]
    assert "2 kept checkpoints of a run: about 37.0 GB, $0.85 a month while kept" in said


def test_the_cli_reads_up_s_record_from_state_dir(plain: Cluster, capsys):  # noqa: F811 - the fixture
    from raytrain_eks.cli import main

    plain.target.up(plain.d(), confirm=plain.ask())
    config = plain.kubeconfig.parent / "plan.yaml"
    config.write_text(yaml.safe_dump(plain.cfg.model_dump(mode="json")))
    main(["plan", "--config", str(config), "--state-dir", str(plain.store.root), "-o", str(config.parent / "p")])
    (doc,) = yaml.safe_load_all((config.parent / "p" / "raycluster.yaml").read_text())
    limits = _worker(doc)["containers"][0]["resources"]["limits"]
    assert (limits["cpu"], limits["memory"]) == ("9", "66Gi")
    assert "Read the cluster of" in capsys.readouterr().out


# --- the command lines -----------------------------------------------------------------------------------------------


def test_every_command_line_of_the_plan_parses_with_the_real_binaries(
    real_tools: Any,
    chart_repo: Any,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.chdir(tmp_path)
    # The context of the unreachable kubeconfig check() runs them against; EFA, so that every chart is planned.
    cfg = _cfg(*SHAPE, "cluster.efa_per_node=1", f"cluster.context={CONTEXT}", "ray.namespace=train")
    found = Collector()
    for mode in ("raycluster", "rayjob"):
        folder = tmp_path / f"plan-{mode}"
        plan_existing.write_plan(cfg, folder, state_dir=tmp_path / ".raytrain-eks", mode=mode, hf_token=True)
        found.plan(folder, f"plan --mode {mode} (kubernetes)")
    commands = found.take()
    home = tmp_path / "checks"
    home.mkdir()
    problems = check(commands, real_tools, chart_repo, home)
    verbs = {" ".join(c.argv[:2]) for c in commands}
    assert {"helm upgrade", "kubectl --kubeconfig"} <= verbs, sorted(verbs)
    installs = [c.argv[3] for c in commands if c.argv[:3] == ("helm", "upgrade", "--install")]
    assert installs == ["nvidia-device-plugin", "aws-efa-k8s-device-plugin", "kuberay-operator"]
    assert any("exec" in c.argv for c in commands) and all(CONTEXT in c.argv for c in commands)
    assert not problems, f"{len(problems)} of {len(commands)} command lines are refused:\n" + "\n".join(problems)
