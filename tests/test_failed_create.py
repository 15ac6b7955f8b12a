"""A first ``eksctl create cluster`` that failed is undone: the stack it left is deleted by ``up`` (which then creates
the cluster) and by ``down``, its termination protection turned off first; a stack whose tags do not name the
cluster is never touched; the commands a hint names for deleting a stack by hand work when run.

Against test_deploy.py's World, with fakes that refuse what the real services refuse: moto's CloudFormation keeps
termination protection (fake_aws.keep_termination_protection) and every stack the fake eksctl creates has it on, as
eksctl's do; the fake eksctl dies, as eksctl v0.230.0 does, on ``delete cluster --force`` for a cluster EKS does not
have (fake_eksctl_stacks.delete_cluster_panics). The AWS CLI the hint names runs for real against moto's server."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import boto3
import botocore.exceptions
import fake_eksctl_stacks as cfn
import pytest
from fake_aws import PROTECTED_STACK_REFUSAL
from test_deploy import ZONES, World

from raytrain_eks.config import load_config
from raytrain_eks.eks import irsa, lifecycle
from raytrain_eks.errors import UserError
from raytrain_eks.k8s.runner import CommandError

REGION = "us-east-1"
CLUSTER = "ray-train-eks"
STACK = cfn.cluster_stack(CLUSTER)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    monkeypatch.chdir(tmp_path)  # no raytrain-eks.yaml of the repository is read
    return World(tmp_path, load_config(environ={}, path=None))


def _described(name: str = STACK) -> dict:
    (stack,) = boto3.client("cloudformation", region_name=REGION).describe_stacks(StackName=name)["Stacks"]
    return stack


def _failed_first_create(w: World) -> None:
    """``up`` whose ``eksctl create cluster`` fails (a VPC quota, a refused zone): its stack is left rolled back,
    protected, and EKS has no cluster."""
    w.tools.cluster_fails = "ROLLBACK_COMPLETE"
    with pytest.raises(CommandError, match=f'failed to create cluster "{CLUSTER}"'):
        w.up()
    w.tools.cluster_fails = None
    w.lines.clear()
    left = _described()
    assert left["StackStatus"] == "ROLLBACK_COMPLETE" and left["EnableTerminationProtection"] is True
    assert w.tools.cluster is None


def _foreign_stack() -> None:
    """A stack of the cluster's stack name that eksctl did not make for this cluster (its tag names another),
    rolled back, and without termination protection: nothing but its tags keeps it from being deleted."""
    template = {"Resources": {"VPC": {"Type": "AWS::EC2::VPC", "Properties": {"CidrBlock": cfn.VPC_CIDR}}}}
    boto3.client("cloudformation", region_name=REGION).create_stack(
        StackName=STACK,
        TemplateBody=json.dumps(template),
        Tags=[{"Key": cfn.CLUSTER_NAME_TAGS[0], "Value": "another-cluster"}],
    )
    cfn.fail_cluster_stack(CLUSTER, REGION, "ROLLBACK_COMPLETE")


# ------------------------------------------------------------------------------------------------------------------
# The fakes refuse what the services refuse
# ------------------------------------------------------------------------------------------------------------------


def test_the_fakes_refuse_to_delete_a_protected_stack_and_a_cluster_eks_does_not_have(world: World):
    _failed_first_create(world)
    cloudformation = boto3.client("cloudformation", region_name=REGION)
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        cloudformation.delete_stack(StackName=STACK)
    error = refused.value.response["Error"]
    assert (error["Code"], error["Message"]) == ("ValidationError", PROTECTED_STACK_REFUSAL.format(name=STACK))
    assert _described()["StackStatus"] == "ROLLBACK_COMPLETE", "the stack, its status included, remains unchanged"

    argv = ["eksctl", "delete", "cluster", "--name", CLUSTER, "--region", REGION, "--wait", "--force"]
    died = world.tools(argv, timeout=60, check=False)
    assert died.returncode == 2 and died.stderr.startswith("panic: runtime error: invalid memory address")
    assert f'deleting EKS cluster "{CLUSTER}"' in died.stdout
    assert _described()["StackStatus"] == "ROLLBACK_COMPLETE", "eksctl died before it looked for the stack"


# ------------------------------------------------------------------------------------------------------------------
# up and down undo it
# ------------------------------------------------------------------------------------------------------------------


def test_up_deletes_the_protected_stack_a_failed_create_left_then_creates_the_cluster(world: World):
    _failed_first_create(world)
    assert world.up().gpu_az == ZONES[0]
    assert f"CloudFormation stack {STACK} is ROLLBACK_COMPLETE, left by a create that failed" in world.said()
    (create, again) = world.tools.commands("eksctl", "create", "cluster")
    assert create == again and world.tools.cluster is not None
    remade = _described()
    assert (remade["StackStatus"], remade["EnableTerminationProtection"]) == ("CREATE_COMPLETE", True)


def test_down_deletes_the_protected_stack_of_a_cluster_eks_never_made_without_eksctl(world: World):
    _failed_first_create(world)
    result = lifecycle.down(world.d, confirm=lambda q: True)
    assert cfn.stack_status(CLUSTER, REGION) is None, "nothing of the failed create is left"
    assert not world.tools.commands("eksctl", "delete", "cluster"), "eksctl dies on a cluster EKS does not have"
    assert any(d.startswith(f"EKS cluster {CLUSTER}") for d in result.deleted) and not world.store.created
    assert f"{STACK} is ROLLBACK_COMPLETE, while EKS has no cluster {CLUSTER}: deleting it" in world.said()
    assert lifecycle.down(world.d, confirm=lambda q: True).deleted == [], "a second down finds nothing"


def test_down_deletes_an_existing_cluster_with_eksctl_as_before(world: World):
    world.up()
    lifecycle.down(world.d, confirm=lambda q: True)
    (delete,) = world.tools.commands("eksctl", "delete", "cluster")
    assert "--force" not in delete and world.tools.cluster is None
    assert cfn.stack_status(CLUSTER, REGION) is None


# ------------------------------------------------------------------------------------------------------------------
# A stack eksctl did not make for this cluster
# ------------------------------------------------------------------------------------------------------------------


def test_up_never_deletes_a_stack_whose_tags_do_not_name_the_cluster(world: World):
    _foreign_stack()
    with pytest.raises(UserError) as err:
        world.up()
    assert f"{STACK} (ROLLBACK_COMPLETE) in {REGION} has none of the tags eksctl gives" in err.value.message
    assert f"alpha.eksctl.io/cluster-name={CLUSTER}" in err.value.message
    assert "update-termination-protection" in (err.value.hint or "")
    assert not world.tools.commands("eksctl", "create", "cluster")
    assert _described()["StackStatus"] == "ROLLBACK_COMPLETE"


def test_down_leaves_a_stack_whose_tags_do_not_name_the_cluster(world: World):
    _failed_first_create(world)
    cfn.delete_cluster_stack(CLUSTER, REGION)  # removed in the console, and another stack took its name
    _foreign_stack()
    lifecycle.down(world.d, confirm=lambda q: True)
    assert "has none of the tags eksctl gives" in world.said() and not world.store.created
    assert _described()["StackStatus"] == "ROLLBACK_COMPLETE"


# ------------------------------------------------------------------------------------------------------------------
# Deleting a stack by hand, as the hints say
# ------------------------------------------------------------------------------------------------------------------


def _aws_commands(text: str) -> list[list[str]]:
    """Every AWS CLI command line ``text`` quotes (between backticks), split as a shell would."""
    return [shlex.split(q) for q in re.findall(r"`(aws [^`]*)`", text)]


def test_the_commands_the_hint_names_delete_a_protected_stack_in_use(world: World):
    assert cfn.create_cluster_stack(CLUSTER, REGION) is None  # made elsewhere, in use; EKS has no cluster
    with pytest.raises(UserError, match=r"exists \(CREATE_COMPLETE\) in us-east-1, but EKS has no cluster") as err:
        world.up()
    told = _aws_commands(err.value.hint or "")
    assert [argv[:3] for argv in told] == [
        ["aws", "cloudformation", "update-termination-protection"],
        ["aws", "cloudformation", "delete-stack"],
    ]
    aws = Path(sys.executable).with_name("aws")  # the AWS CLI, a test dependency, beside this Python
    if not aws.is_file():
        pytest.fail(
            f"the AWS CLI is not installed in {aws.parent}: install the test extras (`pip install -e '.[test]'`)"
        )
    for argv in told:  # the user runs them, in order, against the same CloudFormation (moto's server)
        done = subprocess.run([str(aws), *argv[1:]], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert cfn.stack_status(CLUSTER, REGION) is None


def test_downs_line_for_the_service_accounts_role_turns_termination_protection_off_first(world: World):
    world.tools.cluster = {"name": CLUSTER, "azs": ZONES}  # a cluster made elsewhere: up adds the service account
    world.up()
    world.tools.cluster = None  # deleted elsewhere since; the role's stack may be left
    lifecycle.down(world.d, confirm=lambda q: True)
    where = ["--stack-name", irsa.stack_name(world.d), "--region", REGION]
    assert _aws_commands(world.said()) == [
        ["aws", "cloudformation", "update-termination-protection", "--no-enable-termination-protection", *where],
        ["aws", "cloudformation", "delete-stack", *where],
    ]
