"""Before the EKS commands act: every program they run is installed (all the missing ones named in one message), and
the Ray pods' service account exists with an IAM role that may use the checkpoint bucket, and the KMS key that
encrypts it when there is one.

Against the fakes of test_deploy.py (``World``: FakeKube, and FakeTools, whose ``missing`` are the programs not
installed and whose eksctl makes service accounts and their roles as eksctl v0.230.0 does, see
fake_eksctl_auth.py), with S3, IAM and KMS on moto's server."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import boto3
import pytest
import typer
import yaml
from test_deploy import ZONES, StateDeployment, World

from raytrain_eks.aws import eksctl
from raytrain_eks.cli import main
from raytrain_eks.config import load_config
from raytrain_eks.deploy import commands as deploy_commands
from raytrain_eks.deploy import submit as sub
from raytrain_eks.eks import buckets, irsa, lifecycle, nodegroups, programs
from raytrain_eks.eks.plan import build_plan
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s import runner
from raytrain_eks.k8s.runner import CommandError, MissingToolsError

EKSCTL_SOURCE = Path(__file__).parent / "fixtures" / "eksctl"
EVERY_PROGRAM = {"eksctl", "helm", "aws", "aws-iam-authenticator"}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    monkeypatch.chdir(tmp_path)  # no raytrain-eks.yaml of the repository is read
    return World(tmp_path, load_config(environ={}, path=None))


@pytest.fixture
def ready(world: World) -> World:
    """Up, on a machine with the AWS CLI and without aws-iam-authenticator: the kubeconfig runs `aws eks get-token`."""
    world.tools.missing = {"aws-iam-authenticator"}
    world.up()
    world.tools.missing = set()
    world.lines.clear()
    return world


def _iam() -> Any:
    return boto3.client("iam", region_name="us-east-1")


def _role_of_service_account(w: World) -> str:
    account = w.kube.get("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, w.d.cfg.ray.namespace)
    assert account is not None, "the Ray pods' service account exists"
    return account["metadata"]["annotations"][irsa.ROLE_ARN_ANNOTATION].rsplit("/", 1)[1]


def _statements(role: str) -> list[dict[str, Any]]:
    iam = _iam()
    names = iam.list_role_policies(RoleName=role)["PolicyNames"]
    return [
        st
        for name in names
        for st in iam.get_role_policy(RoleName=role, PolicyName=name)["PolicyDocument"]["Statement"]
    ]


def _flat(text: str) -> str:
    """The console wraps long lines: compare with every run of whitespace as one space."""
    return " ".join(text.split())


# ------------------------------------------------------------------------------------------------------------------
# Every program a command needs, named at once, before anything is created or asked
# ------------------------------------------------------------------------------------------------------------------


def test_up_names_every_missing_program_at_once_and_creates_nothing(world: World):
    world.tools.missing = set(EVERY_PROGRAM)
    questions: list[str] = []
    with pytest.raises(MissingToolsError) as err:
        lifecycle.up(
            world.d,
            confirm=lambda q: questions.append(q) or True,
            offered_zones=lambda: pytest.fail("the capacity check is not run without the programs"),
        )
    e = err.value
    assert e.exit_code == 2 and sorted(e.tools) == ["aws", "eksctl", "helm"]
    for name in ("eksctl", "helm", "aws"):
        assert f"`{name}`" in e.message and runner.INSTALL_HINTS[name] in (e.hint or "")
    assert "pip install awscli" in (e.hint or "")
    assert "(or `aws-iam-authenticator` instead)" in e.message, "either credential program will do for up"
    assert questions == [] and world.tools.calls == [] and world.store.created == []
    assert not world.store.path.exists()
    assert boto3.client("s3", region_name="us-east-1").list_buckets()["Buckets"] == [], "no bucket made"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["up", "-y"], {"eksctl", "helm", "aws"}),
        (["down"], {"eksctl", "helm", "aws"}),
        (["status"], {"eksctl", "aws"}),
        (["submit", "--mode", "rayjob"], {"eksctl", "aws"}),
        (["submit"], {"aws"}),
        (["logs"], {"aws"}),
        (["compare-fabric", "-y"], {"aws"}),
    ],
)
def test_each_command_names_every_missing_program_before_it_acts(
    ready: World, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], named: set[str]
):
    assert ready.submit().exit_code == 0  # a RayCluster and a job of this folder, for logs and compare-fabric
    ready.tools.missing = set(EVERY_PROGRAM)
    capsys.readouterr()

    def seen() -> tuple[Any, ...]:
        k = ready.kube
        return len(ready.tools.calls), len(k.applied), len(k.deleted), len(k.exec_calls), ready.store.path.read_text()

    before = seen()
    monkeypatch.setattr(deploy_commands, "make_deployment", lambda cfg, state_dir, *say: StateDeployment(ready))
    monkeypatch.setattr(nodegroups, "placement_zones", lambda cfg: pytest.fail("nothing is asked of AWS"))
    monkeypatch.setattr(typer, "confirm", lambda *a, **k: pytest.fail("nothing is asked of the user"))
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = _flat(capsys.readouterr().err)
    for name in named:
        assert f"`{name}`" in err and _flat(runner.INSTALL_HINTS[name]) in err, err
    for name in {"eksctl", "helm", "aws"} - named:
        assert f"`{name}`" not in err, f"{args[0]} does not run {name}"
    if "aws" in named and args[0] != "up":  # the kubeconfig up wrote runs `aws eks get-token`
        assert f"{ready.store.kubeconfig} runs `aws eks get-token`" in err
    assert seen() == before, "nothing was run, applied, deleted or recorded"


def test_the_credential_program_is_the_one_the_kubeconfig_names(world: World):
    world.up()  # every program installed: eksctl names aws-iam-authenticator, the first one it looks for
    (user,) = yaml.safe_load(world.store.kubeconfig.read_text())["users"]
    assert user["user"]["exec"]["command"] == "aws-iam-authenticator"
    world.tools.missing = {"aws"}
    programs.require_programs(world.d, "submit", steps_of=programs.command_steps)  # this kubeconfig never runs aws
    world.tools.missing = {"aws-iam-authenticator"}
    with pytest.raises(MissingToolsError) as err:
        programs.require_programs(world.d, "submit", steps_of=programs.command_steps)
    assert err.value.tools == ["aws-iam-authenticator"]
    assert f"{world.store.kubeconfig} runs `aws-iam-authenticator token -i`" in err.value.message
    # up is not stopped by it: it writes the kubeconfig anew, and eksctl then names the AWS CLI.
    world.up()
    (user,) = yaml.safe_load(world.store.kubeconfig.read_text())["users"]
    assert user["user"]["exec"]["command"] == "aws"
    programs.require_programs(world.d, "submit", "status", "logs", "down", steps_of=programs.command_steps)


class _Recording:
    """The deployment's Kubernetes interface, noting whether a command called it."""

    def __init__(self, kube: Any) -> None:
        self._kube = kube
        self.used = False

    def __getattr__(self, name: str) -> Any:
        self.used = True
        return getattr(self._kube, name)


def test_each_command_declares_exactly_the_programs_it_runs(world: World):
    recording = _Recording(world.kube)
    world.d.kube = recording  # type: ignore[assignment]

    def run(command: str, action: Any, mode: str = "raycluster") -> None:
        steps = programs.command_steps(world.d, command, mode=mode)
        declared = {p for step in steps for p in programs.STEPS[step].programs}
        first, recording.used = len(world.tools.calls), False
        action()
        ran = {c[0] for c in world.tools.calls[first:]} | ({programs.KUBERNETES} if recording.used else set())
        assert ran == declared, f"{command} ({mode}) runs {sorted(ran)}, declares {sorted(declared)}"

    run("up", world.up)
    run("status", lambda: lifecycle.status(world.d))
    run("submit", lambda: world.submit(mode="raycluster"))
    run("logs", lambda: sub.logs(world.d))
    world.kube.delete("ray.io/v1", "RayCluster", "ray-train", "default")  # its pods leave the GPU nodes
    run("submit", lambda: world.submit(mode="rayjob"), mode="rayjob")
    world.kube.delete("ray.io/v1", "RayJob", "ray-train", "default")
    run("submit", lambda: world.submit(mode="raycluster"))  # after a RayJob: the GPU group is scaled back
    run("down", lambda: lifecycle.down(world.d, confirm=lambda q: True))


def test_down_of_a_cluster_that_failed_early_needs_only_eksctl(world: World):
    world.tools.fail_once["eksctl create cluster"] = "Error: creating CloudFormation stack: AccessDenied"
    with pytest.raises(CommandError):
        world.up()
    assert [i["type"] for i in world.store.created] == ["bucket", "cluster"]
    world.tools.missing = {"helm", "aws", "aws-iam-authenticator"}  # nothing recorded needs them
    lifecycle.down(world.d, confirm=lambda q: True)
    assert not world.store.path.exists()


# ------------------------------------------------------------------------------------------------------------------
# The Ray pods' service account and its IAM role
# ------------------------------------------------------------------------------------------------------------------


def test_up_gives_a_cluster_it_did_not_create_the_ray_pods_service_account(world: World):
    # Made elsewhere: no IAM OIDC provider, and a ServiceAccount of that name made by someone, without a role.
    world.tools.cluster = {"name": "ray-train-eks", "azs": ZONES}
    world.tools.iam.without_oidc.add("ray-train-eks")
    theirs = {"name": m.RAY_SERVICE_ACCOUNT, "namespace": "default", "labels": {"team": "ml"}}
    world.kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": theirs})
    world.up()
    assert "was not created from this folder" in world.said()
    verbs = [c[:3] for c in world.tools.calls if "iamserviceaccount" in c or "associate-iam-oidc-provider" in c]
    assert verbs == [["eksctl", "utils", "associate-iam-oidc-provider"], ["eksctl", "create", "iamserviceaccount"]]
    (create,) = world.tools.commands("eksctl", "create", "iamserviceaccount")
    assert "--approve" in create and "--override-existing-serviceaccounts" in create
    doc = yaml.safe_load(Path(create[create.index("--config-file") + 1]).read_text())
    assert doc["iam"]["serviceAccounts"][0]["metadata"] == {"name": m.RAY_SERVICE_ACCOUNT, "namespace": "default"}
    account = world.kube.get("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, "default")
    assert account["metadata"]["labels"]["team"] == "ml", "eksctl adds to a service account, it keeps what is there"
    bucket = world.store.get("bucket")
    resources = {r for st in _statements(_role_of_service_account(world)) for r in st["Resource"]}
    assert resources == {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"}
    assert world.submit().exit_code == 0
    # Looked at again, found in place: nothing more is run for it.
    world.up()
    assert len(world.tools.commands("eksctl", "create", "iamserviceaccount")) == 1
    assert "Service account default/raytrain-eks-ray exists with IAM role" in world.said()


def test_up_resumed_after_the_cluster_step_makes_the_service_account(world: World):
    # Ctrl-C during `eksctl create cluster`: CloudFormation finishes the cluster's stack, but eksctl's tasks after it
    # (the OIDC provider, then iam.serviceAccounts: fixtures/eksctl/pkg/eks/tasks.go) never run.
    world.tools.fail_once["eksctl create cluster"] = "Error: context canceled"
    with pytest.raises(CommandError):
        world.up()
    world.tools.cluster = {"name": "ray-train-eks", "azs": ZONES}
    world.tools.iam.without_oidc.add("ray-train-eks")
    world.up()
    assert "Cluster ray-train-eks exists" in world.said()
    assert len(world.tools.commands("eksctl", "create", "iamserviceaccount")) == 1
    assert _role_of_service_account(world)
    assert world.submit().exit_code == 0


def test_a_fresh_cluster_gets_its_service_account_from_create_cluster_and_nothing_more(world: World):
    world.up()
    assert not world.tools.commands("eksctl", "create", "iamserviceaccount"), "create cluster made it"
    assert _role_of_service_account(world)


def test_submit_refuses_before_any_pod_when_the_service_account_is_missing(ready: World):
    ready.kube.delete("v1", "ServiceAccount", m.RAY_SERVICE_ACCOUNT, "default")
    applied, nodes = len(ready.kube.applied), len(ready.tools.calls)
    with pytest.raises(irsa.ServiceAccountNotReady) as err:
        ready.submit()
    assert "the service account default/raytrain-eks-ray does not exist" in err.value.message
    assert "Run `raytrain-eks up`" in (err.value.hint or "")
    assert len(ready.kube.applied) == applied and len(ready.tools.calls) == nodes
    assert not ready.kube.objects("RayCluster") and not ready.ray.submitted


def test_submit_refuses_a_role_whose_policy_does_not_name_the_bucket_and_up_brings_it_up_to_date(ready: World):
    role, bucket = _role_of_service_account(ready), ready.store.get("bucket")
    (name,) = _iam().list_role_policies(RoleName=role)["PolicyNames"]
    other = json.dumps(eksctl.bucket_policy("someone-elses-bucket"))
    _iam().put_role_policy(RoleName=role, PolicyName=name, PolicyDocument=other)
    with pytest.raises(irsa.ServiceAccountNotReady) as err:
        ready.submit()
    assert f"does not allow s3:ListBucket on arn:aws:s3:::{bucket}" in err.value.message
    assert f"s3:PutObject on arn:aws:s3:::{bucket}/runs/" in err.value.message
    assert not ready.kube.objects("RayCluster")
    ready.up()
    assert len(ready.tools.commands("eksctl", "update", "iamserviceaccount")) == 1
    assert not ready.tools.commands("eksctl", "create", "iamserviceaccount")
    assert ready.submit().exit_code == 0


def test_submit_refuses_when_the_role_is_gone(ready: World):
    role = _role_of_service_account(ready)
    iam = _iam()
    for name in iam.list_role_policies(RoleName=role)["PolicyNames"]:
        iam.delete_role_policy(RoleName=role, PolicyName=name)
    iam.delete_role(RoleName=role)
    with pytest.raises(irsa.ServiceAccountNotReady, match=f"the IAM role {role}, named by the service account"):
        ready.submit()


def test_storage_in_another_bucket_is_refused_with_what_to_set(ready: World):
    cfg = ready.d.cfg
    elsewhere = cfg.model_copy(
        update={"training": cfg.training.model_copy(update={"storage_path": "s3://team-other-bucket/runs"})}
    )
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="team-other-bucket")
    with pytest.raises(irsa.ServiceAccountNotReady) as err:
        sub.submit(dataclasses.replace(ready.d, cfg=elsewhere))
    assert "arn:aws:s3:::team-other-bucket" in err.value.message
    assert "CHECKPOINT_BUCKET" in (err.value.hint or "") and ready.store.get("bucket") in (err.value.hint or "")


def test_a_role_allowed_through_an_attached_wildcard_policy_is_accepted(ready: World):
    role = _role_of_service_account(ready)
    iam = _iam()
    for name in iam.list_role_policies(RoleName=role)["PolicyNames"]:
        iam.delete_role_policy(RoleName=role, PolicyName=name)
    doc = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "S3:*", "Resource": "arn:aws:s3:::*"}]}
    arn = iam.create_policy(PolicyName="all-s3", PolicyDocument=json.dumps(doc))["Policy"]["Arn"]
    iam.attach_role_policy(RoleName=role, PolicyArn=arn)
    assert irsa.look(ready.d, ready.store.get("bucket"), None).problems == []
    assert ready.submit().exit_code == 0


def test_the_policy_reader_counts_only_allow_statements_that_cover_the_grant():
    def doc(**st: Any) -> list[dict[str, Any]]:
        return [{"Statement": [{"Effect": "Allow", **st}]}]

    arn = "arn:aws:s3:::b/runs/checkpoint"
    assert irsa.allows(doc(Action="s3:Put*", Resource="arn:aws:s3:::b/*"), "s3:PutObject", arn)
    assert irsa.allows(doc(Action=["s3:getobject"], Resource=["arn:aws:s3:::b/runs/*"]), "s3:GetObject", arn)
    assert not irsa.allows(doc(Action="s3:PutObject", Resource="arn:aws:s3:::b"), "s3:PutObject", arn)
    assert not irsa.allows(doc(Action="s3:PutObject", Resource="arn:aws:s3:::B/*"), "s3:PutObject", arn)
    assert not irsa.allows(doc(NotAction="s3:DeleteObject", Resource="*"), "s3:PutObject", arn)
    assert not irsa.allows([{"Statement": {"Effect": "Deny", "Action": "*", "Resource": "*"}}], "s3:PutObject", arn)
    assert not irsa.allows(
        doc(Action="*", Resource="*", Condition={"Bool": {"aws:SecureTransport": "true"}}), "s3:PutObject", arn
    )
    assert not irsa.allows(doc(Action="s3:Put?bject.x", Resource="*"), "s3:PutObject", arn), "only * and ? are special"


def test_up_plan_and_plan_show_the_service_account_step(world: World):
    actions = {a.name: a for a in lifecycle.planned_actions(world.d.cfg)}
    names = list(actions)
    assert names.index("kubeconfig") < names.index("iam-service-account") < names.index("nodegroup-system")
    assert actions["iam-service-account"].argv == irsa.create_argv(".raytrain-eks/eksctl-iamserviceaccount.yaml")
    assert "aws (or aws-iam-authenticator)" in actions["preflight"].what
    plan = build_plan(world.d.cfg)
    steps = [s.name for s in plan.steps]
    assert steps[steps.index("create-cluster") + 1] == "iam-service-account"
    (doc,) = plan.files[irsa.CONFIG_FILE]
    assert doc["iam"]["serviceAccounts"] == plan.files[eksctl.CONFIG_FILE][0]["iam"]["serviceAccounts"]


def test_the_annotation_and_flags_are_eksctls():
    iam_go = (EKSCTL_SOURCE / "pkg/apis/eksctl.io/v1alpha5/iam.go").read_text()
    assert re.search(r'AnnotationEKSRoleARN\s*=\s*"([^"]+)"', iam_go).group(1) == irsa.ROLE_ARN_ANNOTATION
    create_go = (EKSCTL_SOURCE / "pkg/ctl/create/iamserviceaccount.go").read_text()
    assert '"override-existing-serviceaccounts"' in create_go and "cmdutils.AddApproveFlag(fs, cmd)" in create_go
    assert "cmdutils.AddConfigFileFlag(fs, &cmd.ClusterConfigFile)" in create_go


# ------------------------------------------------------------------------------------------------------------------
# A bucket encrypted with a KMS key (SSE-KMS)
# ------------------------------------------------------------------------------------------------------------------


def _kms_bucket(name: str, key_ref: str | None = None) -> dict[str, Any]:
    """A bucket of the account encrypted by default with a new KMS key (named by ``key_ref(key)``, or its id)."""
    kms = boto3.client("kms", region_name="us-east-1")
    key = kms.create_key(Description="checkpoints")["KeyMetadata"]
    kms.create_alias(AliasName=f"alias/{name}", TargetKeyId=key["KeyId"])
    refs = {
        "id": key["KeyId"],
        "arn": key["Arn"],
        "alias": f"alias/{name}",
        "alias-arn": f"arn:aws:kms:us-east-1:{key['AWSAccountId']}:alias/{name}",
    }
    s3 = boto3.client("s3", region_name="us-east-1")
    if name not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=name)
    default = {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": refs[key_ref or "id"]}
    s3.put_bucket_encryption(
        Bucket=name, ServerSideEncryptionConfiguration={"Rules": [{"ApplyServerSideEncryptionByDefault": default}]}
    )
    return key


def test_the_ray_pods_role_may_use_the_kms_key_of_an_encrypted_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str
):
    key = _kms_bucket("team-checkpoints", "alias")
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1a", "CHECKPOINT_BUCKET": "team-checkpoints"}))
    w.up()
    assert w.store.get("bucket_kms_key") == key["Arn"]
    assert f"encrypted with the KMS key {key['Arn']}" in w.said()
    # The cluster's own config already grants the key: no second eksctl call to mend the role.
    assert not w.tools.commands("eksctl", "update", "iamserviceaccount")
    grants = [st for st in _statements(_role_of_service_account(w)) if st["Resource"] == [key["Arn"]]]
    assert grants == [{"Effect": "Allow", "Action": ["kms:GenerateDataKey", "kms:Decrypt"], "Resource": [key["Arn"]]}]
    assert w.submit().exit_code == 0


@pytest.mark.parametrize("key_ref", ["id", "arn", "alias", "alias-arn"])
def test_the_kms_key_of_a_bucket_is_known_by_its_arn_however_the_bucket_names_it(world: World, key_ref: str):
    key = _kms_bucket("team-checkpoints", key_ref)
    assert buckets.bucket_kms_key(world.d, "team-checkpoints") == key["Arn"]


def test_a_bucket_without_a_key_of_its_own_needs_no_kms_grant(world: World):
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="team-checkpoints")
    assert buckets.bucket_kms_key(world.d, "team-checkpoints") is None  # no default encryption set
    for default in ({"SSEAlgorithm": "AES256"}, {"SSEAlgorithm": "aws:kms"}):  # SSE-S3; S3's own aws/s3 key
        rules = {"Rules": [{"ApplyServerSideEncryptionByDefault": default}]}
        s3.put_bucket_encryption(Bucket="team-checkpoints", ServerSideEncryptionConfiguration=rules)
        assert buckets.bucket_kms_key(world.d, "team-checkpoints") is None


def test_a_bucket_whose_kms_key_changed_is_refused_by_submit_until_up(ready: World, monkeypatch: pytest.MonkeyPatch):
    bucket = ready.store.get("bucket")
    key = _kms_bucket(bucket)  # the bucket up made (SSE-S3), now encrypted with a key of the team's
    with pytest.raises(irsa.ServiceAccountNotReady) as err:
        ready.submit()
    assert f"kms:GenerateDataKey on {key['Arn']}, kms:Decrypt on {key['Arn']}" in err.value.message
    ready.up()
    assert ready.store.get("bucket_kms_key") == key["Arn"]
    assert ready.submit().exit_code == 0


def test_a_kms_key_that_cannot_be_resolved_stops_up_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str
):
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="team-checkpoints")
    default = {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": "alias/no-such-key"}
    s3.put_bucket_encryption(
        Bucket="team-checkpoints",
        ServerSideEncryptionConfiguration={"Rules": [{"ApplyServerSideEncryptionByDefault": default}]},
    )
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1a", "CHECKPOINT_BUCKET": "team-checkpoints"}))
    with pytest.raises(UserError) as err:
        w.up()
    assert "encrypted with the KMS key 'alias/no-such-key'" in err.value.message
    assert "kms:GenerateDataKey and kms:Decrypt" in err.value.message and "kms:DescribeKey" in (err.value.hint or "")
    assert not w.tools.commands("eksctl", "create") and w.tools.cluster is None
