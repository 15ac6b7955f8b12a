"""Each cluster target implements the whole :class:`~raytrain_eks.deploy.target.ClusterTarget` interface, and what the
interface decides is asked of the target: the programs a command runs and the price of a run are never chosen by
comparing ``cluster.target`` with a target's name outside the targets themselves."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from raytrain_eks.config import load_config
from raytrain_eks.deploy.target import ClusterTarget, target_for
from raytrain_eks.eks.target import EksTarget
from raytrain_eks.k8s.placement import PodPlacement
from raytrain_eks.kubernetes.target import KubernetesTarget

SRC = Path(__file__).resolve().parents[1] / "src" / "raytrain_eks"
TARGETS = [EksTarget, KubernetesTarget]
# Where a target's name may be compared: the targets and the choice of one.
TARGET_MODULES = {"eks/target.py", "kubernetes/existing.py", "kubernetes/target.py"}
# The modules of the two decisions, each as a whole.
DECISION_MODULES = ["eks/programs.py", "k8s/programs.py", "eks/pricing.py", "k8s/prices.py"]
# What a caller of the two decisions calls (any function calling one of these is checked as well).
DECISION_CALLS = {"require_programs", "needs", "credential_needs", "command_steps", "job_price", "price"}
TARGET_NAMES = {"eks", "kubernetes"}


def interface_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for interface in (PodPlacement, ClusterTarget)  # ClusterTarget extends the pods' placement
        for name, member in vars(interface).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def test_the_interface_covers_the_programs_the_price_the_plan_and_the_placement():
    assert {"command_steps", "price", "plan", "up_plan", "deployment", "worker_pod", "chart_values"} <= set(
        interface_methods()
    )


@pytest.mark.parametrize("cls", TARGETS, ids=lambda c: c.__name__)
def test_each_target_has_every_method_of_the_interface_with_its_parameters(cls: type):
    assert isinstance(cls.name, str)
    for name, wanted in interface_methods().items():
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} has no {name}"
        got = inspect.signature(method)
        assert list(got.parameters.values()) == list(wanted.parameters.values()), (
            f"{cls.__name__}.{name}{got} differs from ClusterTarget.{name}{wanted}"
        )


def test_target_for_gives_each_configured_target(tmp_path: Path):
    config = tmp_path / "raytrain-eks.yaml"
    config.write_text("cluster:\n  target: kubernetes\n")
    assert isinstance(target_for(load_config(path=config)), KubernetesTarget)
    config.write_text("cluster:\n  target: eks\n")
    assert isinstance(target_for(load_config(path=config)), EksTarget)


def _is_cluster_target(node: ast.AST) -> bool:
    """``<anything>.cluster.target``, or ``c.target`` / ``cluster.target`` of a local name."""
    if not (isinstance(node, ast.Attribute) and node.attr == "target"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "cluster") or (
        isinstance(owner, ast.Name) and owner.id in ("c", "cluster")
    )


def _target_name_tests(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = any(isinstance(s, ast.Constant) and s.value in TARGET_NAMES for s in sides)
        if names and any(_is_cluster_target(s) for s in sides):
            lines.append(node.lineno)
    return lines


def _calls(function: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            f = node.func
            found.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return found


def test_no_module_but_the_targets_picks_programs_or_prices_by_the_targets_name():
    problems = []
    for rel in DECISION_MODULES:
        problems += [f"{rel}:{line}" for line in _target_name_tests(ast.parse((SRC / rel).read_text()))]
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in TARGET_MODULES:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _calls(node) & DECISION_CALLS:
                problems += [f"{rel}:{line} ({node.name})" for line in _target_name_tests(node)]
    assert not problems, "compare cluster.target where the target should decide:\n" + "\n".join(sorted(set(problems)))


def _kubernetes_cfg(tmp_path: Path, extra: str = ""):
    config = tmp_path / "raytrain-eks.yaml"
    config.write_text("cluster:\n  target: kubernetes\n" + extra)
    return config, load_config(path=config)


def test_a_cluster_of_the_kubeconfig_takes_the_eks_steps_less_eksctl_and_ups_helm(tmp_path: Path):
    """What each command runs there: the EKS target's steps without those running eksctl, and without up's helm
    (up checks helm itself once it knows it installs something)."""
    from raytrain_eks.eks import programs
    from raytrain_eks.k8s.state import StateStore

    _, cfg = _kubernetes_cfg(tmp_path)
    store = StateStore(tmp_path / "state")
    d = SimpleNamespace(cfg=cfg, state=store)

    def check() -> None:
        for command in programs.COMMANDS:
            for mode in ("raycluster", "rayjob"):
                eks = programs.command_steps(d, command, mode=mode)
                want = tuple(
                    s
                    for s in eks
                    if programs.EKSCTL not in programs.STEPS[s].programs and (command, s) != ("up", "helm-releases")
                )
                assert KubernetesTarget().command_steps(d, command, mode=mode) == want, (
                    command,
                    mode,
                    dict(store.data),
                )

    check()  # nothing recorded
    store.record({"type": "helm", "name": "nvidia-device-plugin", "namespace": "kube-system"})
    check()
    store.record({"type": "object", "kind": "ServiceAccount", "name": "raytrain-eks-ray", "namespace": "default"})
    store.update(job={"id": "raysubmit_1", "mode": "raycluster"}, gpu_scaled_to=0)
    check()
    assert KubernetesTarget().command_steps(d, "down") == ("helm-releases", "kubernetes")
    assert KubernetesTarget().command_steps(d, "up") == ("kubernetes",)
    # What the EKS target takes is this module's (its up writes this folder's kubeconfig with eksctl).
    assert EksTarget().command_steps(d, "up") == programs.command_steps(d, "up")


def test_a_run_on_a_cluster_of_the_kubeconfig_is_priced_only_at_a_configured_price(tmp_path: Path):
    from raytrain_eks.eks.pricing import job_price

    summary = {"wall_s": 1800.0, "trained_tokens": 2_000_000, "nodes": 4}
    config, cfg = _kubernetes_cfg(tmp_path)
    price, why_not = target_for(cfg).price(cfg, config)
    assert price is None and why_not == job_price(config)[1]
    assert why_not.startswith(f"no deployment record beside {config}") and why_not.endswith(
        "set cluster.usd_per_hour (or cluster.usd_per_node_hour) to price runs on it"
    )
    for extra in ("  usd_per_node_hour: 5.5\n", "  usd_per_hour: 12.5\n"):
        config, cfg = _kubernetes_cfg(tmp_path, extra)
        price, why_not = target_for(cfg).price(cfg, config)
        c = cfg.cluster
        expected, _ = job_price(config, c.usd_per_hour, c.usd_per_node_hour)
        assert why_not is None and price is not None and expected is not None
        assert price(summary) == expected(summary)
