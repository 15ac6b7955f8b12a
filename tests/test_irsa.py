"""The Ray pods' IAM role and service account that ``up`` makes with ``eksctl create iamserviceaccount``: ``down``
deletes them, and the delete command ``up`` names when they stay unusable is one that deletes them.

Against test_deploy.py's World (FakeTools, whose eksctl makes and deletes service accounts and their roles in moto's
IAM, see fake_eksctl_auth.py); every eksctl command line run or quoted is checked against eksctl's vendored source
(test_eksctl.py)."""

from __future__ import annotations

from pathlib import Path

import boto3
import eksctl_source
import pytest
from test_deploy import ZONES, World
from test_eksctl import check_argv, eksctl_calls, quoted_eksctl

from raytrain_eks.config import load_config
from raytrain_eks.eks import irsa, lifecycle
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.runner import MissingToolsError

NS = "default"


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    monkeypatch.chdir(tmp_path)  # no raytrain-eks.yaml of the repository is read
    return World(tmp_path, load_config(environ={}, path=None))


def _roles() -> list[str]:
    return [r["RoleName"] for r in boto3.client("iam", region_name="us-east-1").list_roles()["Roles"]]


def _providers() -> list[str]:
    listed = boto3.client("iam", region_name="us-east-1").list_open_id_connect_providers()
    return [p["Arn"] for p in listed["OpenIDConnectProviderList"]]


def _existing_cluster(w: World) -> None:
    """A cluster made elsewhere: EKS has it, without an IAM OIDC provider or the Ray pods' service account."""
    w.tools.cluster = {"name": "ray-train-eks", "azs": ZONES}
    w.tools.iam.without_oidc.add("ray-train-eks")


def test_down_deletes_the_role_and_service_account_up_made_on_a_cluster_it_did_not_create(world: World):
    _existing_cluster(world)
    world.up()
    (created,) = world.tools.commands("eksctl", "create", "iamserviceaccount")
    role = world.kube.get("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, NS)["metadata"]["annotations"]
    assert len(_roles()) == 1 and role[irsa.ROLE_ARN_ANNOTATION].endswith(_roles()[0])
    world.tools.missing = {"eksctl"}
    with pytest.raises(MissingToolsError) as missing:
        lifecycle.down(world.d, confirm=lambda q: pytest.fail("asked before the programs were checked"))
    assert "(eksctl delete iamserviceaccount)" in missing.value.message
    world.tools.missing = set()
    questions: list[str] = []
    lifecycle.down(world.d, confirm=lambda q: questions.append(q) or True)
    assert f"IAM role and service account {NS}/{m.RAY_SERVICE_ACCOUNT}" in questions[0]
    (delete,) = world.tools.commands("eksctl", "delete", "iamserviceaccount")
    cmd, given = check_argv(delete)
    assert given["name"] == m.RAY_SERVICE_ACCOUNT and given["namespace"] == NS and given["cluster"] == "ray-train-eks"
    limit = next(t for a, t in eksctl_calls(world) if a == delete)
    assert "timeout" in given and eksctl_source.wait_seconds(cmd, given) < limit
    assert _roles() == [], "the IAM role is gone"
    assert not world.tools.iam.stacks, "and its CloudFormation stack"
    assert world.kube.get("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, NS) is None
    assert world.tools.cluster is not None and not world.tools.commands("eksctl", "delete", "cluster")
    assert not world.store.path.exists(), "nothing is left recorded"


def test_down_deletes_the_service_account_before_the_cluster_it_runs_on(world: World):
    # An up resumed after `eksctl create cluster` was stopped before its service-account task: up makes it itself.
    world.tools.fail_once["eksctl create cluster"] = "Error: context canceled"
    with pytest.raises(Exception, match="context canceled"):
        world.up()
    _existing_cluster(world)
    world.up()
    lifecycle.down(world.d, confirm=lambda q: True)
    deletes = [c[:3] for c in world.tools.commands("eksctl", "delete")]
    assert deletes.index(["eksctl", "delete", "iamserviceaccount"]) < deletes.index(["eksctl", "delete", "cluster"])
    assert _roles() == [] and world.tools.cluster is None


def test_up_stopped_by_an_unusable_service_account_names_a_delete_that_ends_it(world: World):
    world.up()  # a fresh cluster: eksctl create cluster made the service account and its role
    world.kube.delete("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, NS)  # someone removed it; its stack is left
    with pytest.raises(UserError) as err:
        world.up()
    assert "still not usable" in err.value.message
    quoted = quoted_eksctl(f"{err.value.message}\n{err.value.hint}")
    assert [c[:3] for c in quoted] == [
        ["eksctl", "create", "iamserviceaccount"],
        ["eksctl", "delete", "iamserviceaccount"],
    ]
    for argv in quoted:
        cmd, given = check_argv(argv)
        if cmd.verb == "delete":
            assert "timeout" in given and eksctl_source.wait_seconds(cmd, given) < irsa.TIMEOUT_S
    # The user runs the delete the hint names, then up again: the service account is made anew and usable.
    world.tools(quoted[1], timeout=irsa.TIMEOUT_S)
    world.up()
    assert world.kube.get("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, NS) is not None
    assert world.submit().exit_code == 0


def test_down_after_the_cluster_is_gone_names_the_stack_it_cannot_delete(world: World):
    _existing_cluster(world)
    world.up()
    world.tools.cluster = None  # deleted elsewhere; the role's stack may be left
    lifecycle.down(world.d, confirm=lambda q: True)
    assert not world.tools.commands("eksctl", "delete", "iamserviceaccount"), "eksctl needs the cluster for it"
    assert _providers() == [], "the IAM OIDC provider up made for the cluster is deleted through IAM"
    stack = irsa.stack_name(world.d)
    assert (
        f"if CloudFormation still has the stack {stack}, turn its termination protection off with `aws cloudformation "
        f"update-termination-protection --no-enable-termination-protection --stack-name {stack} --region us-east-1`, "
        f"then delete it with `aws cloudformation delete-stack --stack-name {stack} --region us-east-1`" in world.said()
    )
    assert not world.store.path.exists()


def test_down_keeps_a_service_account_that_existed_before_up_and_deletes_only_the_role_eksctl_added(world: World):
    _existing_cluster(world)
    team_sa = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": m.RAY_SERVICE_ACCOUNT,
            "namespace": NS,
            "labels": {"team": "ml"},
            "annotations": {"owner": "ml-platform"},
        },
    }
    world.kube.put(team_sa)  # the team's own account of that name, without an IAM role
    world.up()
    during = world.kube.get("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, NS)["metadata"]
    assert during["annotations"][irsa.ROLE_ARN_ANNOTATION].endswith(_roles()[0])
    assert during["labels"][irsa.MANAGED_BY_LABEL] == "eksctl", "eksctl's override marked it as its own"
    world.up()  # a second up finds it usable and keeps the first record
    questions: list[str] = []
    lifecycle.down(world.d, confirm=lambda q: questions.append(q) or True)
    assert "IAM role (the service account existed before and stays)" in questions[0]
    assert world.tools.commands("eksctl", "delete", "iamserviceaccount")
    assert _roles() == [] and not world.tools.iam.stacks, "the role and its stack are gone"
    after = world.kube.get("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, NS)
    assert after is not None, "the team's service account is still there"
    assert after["metadata"]["labels"] == {"team": "ml"}
    assert after["metadata"]["annotations"] == {"owner": "ml-platform"}
    assert not world.store.path.exists()


# ------------------------------------------------------------------------------------------------------------------
# The cluster's IAM OIDC provider, made by `eksctl utils associate-iam-oidc-provider` when the cluster had none
# ------------------------------------------------------------------------------------------------------------------


def test_down_deletes_the_oidc_provider_up_made_on_a_cluster_it_did_not_create(world: World):
    _existing_cluster(world)
    world.up()
    (arn,) = _providers()
    iam = boto3.client("iam", region_name="us-east-1")
    cluster = boto3.client("eks", region_name="us-east-1").describe_cluster(name="ray-train-eks")["cluster"]
    issuer = cluster["identity"]["oidc"]["issuer"]  # https://oidc.eks.us-east-1.amazonaws.com/id/...
    assert arn == f"arn:aws:iam::123456789012:oidc-provider/{issuer.removeprefix('https://')}"
    assert iam.get_open_id_connect_provider(OpenIDConnectProviderArn=arn)["ClientIDList"] == ["sts.amazonaws.com"]
    assert [i["name"] for i in world.store.created if i["type"] == "oidc-provider"] == [arn]
    assert (
        f"Recorded IAM OIDC provider {arn}, made by eksctl: `raytrain-eks down` deletes it, and keeps the cluster"
        in world.said()
    )
    world.up()  # a second up finds everything in place and keeps the record
    questions: list[str] = []
    lifecycle.down(world.d, confirm=lambda q: questions.append(q) or True)
    listing = questions[0]
    # Newest first: eksctl deletes the service account's role while the provider it needs is still there.
    assert listing.index(f"IAM role and service account {NS}/") < listing.index(f"IAM OIDC provider {arn}")
    assert _roles() == [] and f"Deleted IAM OIDC provider {arn}" in world.said()
    assert _providers() == [], "IAM lists no provider after down"
    assert world.tools.cluster is not None and not world.tools.commands("eksctl", "delete", "cluster")
    assert not world.store.path.exists()


def test_an_oidc_provider_the_cluster_had_before_up_stays(world: World):
    _existing_cluster(world)
    world.tools.iam.associate_oidc("ray-train-eks", "us-east-1", approve=True)  # made before, outside this folder
    theirs = _providers()
    world.up()
    assert "Cluster ray-train-eks had its IAM OIDC provider before `up`: `raytrain-eks down` leaves it" in world.said()
    assert not [i for i in world.store.created if i["type"] == "oidc-provider"]
    lifecycle.down(world.d, confirm=lambda q: True)
    assert _roles() == [] and _providers() == theirs


@pytest.mark.parametrize("status", ["ACTIVE", "FAILED"])
def test_the_oidc_provider_up_made_for_its_own_cluster_goes_with_the_cluster(world: World, status: str):
    # An up resumed after `eksctl create cluster` was stopped before its OIDC task: up has eksctl add it.
    world.tools.fail_once["eksctl create cluster"] = "Error: context canceled"
    with pytest.raises(Exception, match="context canceled"):
        world.up()
    _existing_cluster(world)
    world.up()
    (arn,) = _providers()
    assert "made by eksctl: `eksctl delete cluster` deletes it with the cluster" in world.said()
    world.tools.cluster["status"] = status
    lifecycle.down(world.d, confirm=lambda q: True)
    assert world.tools.cluster is None and _providers() == []
    if status == "ACTIVE":  # eksctl deletes the provider of a cluster it can operate
        assert world.tools.iam.deleted_with_cluster == [arn]
        assert f"IAM OIDC provider {arn} goes with cluster ray-train-eks" in world.said()
    else:  # and leaves it for a FAILED one: down deletes it through IAM
        assert world.tools.iam.deleted_with_cluster == []
        assert f"Deleted IAM OIDC provider {arn}" in world.said()
