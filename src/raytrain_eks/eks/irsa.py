"""The Ray pods' service account and its IAM role (IRSA): made by ``up`` on any cluster, checked by ``submit``.

The Ray pods run as the service account ``raytrain-eks-ray`` (:data:`raytrain_eks.k8s.manifests.RAY_SERVICE_ACCOUNT`)
of the Ray namespace. Its annotation ``eks.amazonaws.com/role-arn`` names the IAM role the pods act as, whose policy
lets them use the checkpoint bucket, and the KMS key that encrypts it when there is one, and nothing else
(:func:`raytrain_eks.aws.eksctl.bucket_policy`).

eksctl makes both when it creates the cluster (``iam.serviceAccounts`` of the ClusterConfig), and otherwise only
through ``eksctl create iamserviceaccount``. So ``up`` has a step of its own for them (:func:`ensure_service_account`),
for a cluster this folder did not create and for an ``up`` resumed after the cluster step. It looks first (the
ServiceAccount through the Kubernetes API, the role and its policies through IAM: :func:`look`) and does nothing when
all is in place. Otherwise it gives the cluster an IAM OIDC provider when it has none (``eksctl utils
associate-iam-oidc-provider``: a cluster whose ``create cluster`` was stopped after its stack, or one made elsewhere,
may lack it; a provider eksctl creates is recorded, and ``down`` deletes it through IAM when the cluster stays:
:func:`record_oidc_provider`) and runs ``eksctl create iamserviceaccount --config-file FILE --approve
--override-existing-serviceaccounts``: eksctl makes the role in a CloudFormation stack of its own, then creates the
ServiceAccount with the annotation, or, for one that exists already, adds the annotation to it (the override; without
it eksctl leaves such a service account out). A service account whose stack exists already is always left out
(eksctl v0.230.0, ``pkg/ctl/cmdutils/filter/iamserviceaccount_filter.go``), so a role whose policy no longer fits (the
bucket changed, or a KMS key encrypts it) is brought up to date with ``eksctl update iamserviceaccount --config-file
FILE --approve`` instead. Then it looks again, and stops with what is still wrong.

``submit`` looks the same way before it applies any pod (:func:`check_before_pods`). Example::

    ensure_service_account(d)                       # up, once the cluster exists
    look(d, "team-ckpt", None).problems             # [] when the Ray pods may use the bucket
"""

from __future__ import annotations

import json
import re
import shlex
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_eks.aws import eksctl, stacks
from raytrain_eks.eks.buckets import bucket_kms_key
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.manifests import to_yaml
from raytrain_eks.k8s.state import RUNS_PREFIX, Deployment, Item, cluster_item, describe

if TYPE_CHECKING:  # the session type only: boto3 is imported when AWS is first called
    from botocore.client import BaseClient

    from raytrain_eks.aws.session import Aws
    from raytrain_eks.k8s.runner import Completed

# The annotation eksctl puts on the service account (eksctl v0.230.0, pkg/apis/eksctl.io/v1alpha5/iam.go:
# AnnotationEKSRoleARN), which EKS's pod identity webhook reads to give the pods the role's credentials.
ROLE_ARN_ANNOTATION = "eks.amazonaws.com/role-arn"
# The label eksctl puts on the service accounts it creates or overrides, and the only ones its delete removes
# (eksctl v0.230.0, pkg/kubernetes/serviceaccount.go: managedByKubernetesLabelKey/Value).
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "eksctl"
CONFIG_FILE = "eksctl-iamserviceaccount.yaml"
# eksctl's own wait for the service account's CloudFormation stack (one role and its policy: a minute or two), and
# the runner's limit above it, so eksctl's message is the one seen.
WAIT_MIN = 15
TIMEOUT_S = (WAIT_MIN + 5) * 60
# Object actions the job's checkpoints take (write, read back, prune old ones); the bucket is listed too.
OBJECT_ACTIONS = ("s3:PutObject", "s3:GetObject", "s3:DeleteObject")


def create_argv(config_path: str) -> list[str]:
    """Create the Ray pods' role and service account; annotate the service account when it exists already."""
    return [
        "eksctl",
        "create",
        "iamserviceaccount",
        "--config-file",
        config_path,
        "--approve",
        "--override-existing-serviceaccounts",
        *eksctl.wait_flag(WAIT_MIN),
    ]


def oidc_argv(config_path: str) -> list[str]:
    """Give the cluster an IAM OIDC provider unless it has one (eksctl v0.230.0,
    pkg/ctl/utils/associate_iam_oidc_provider.go: a no-op when it exists). ``create cluster`` makes it among the
    tasks after the cluster's stack, so a cluster whose ``eksctl create cluster`` was stopped may lack it, and one
    made elsewhere may never have had one; ``create iamserviceaccount`` refuses to run without it."""
    return ["eksctl", "utils", "associate-iam-oidc-provider", "--config-file", config_path, "--approve"]


def update_argv(config_path: str) -> list[str]:
    """Update the policy of the role eksctl made for the Ray pods (its CloudFormation stack) to the config's."""
    return [
        "eksctl",
        "update",
        "iamserviceaccount",
        "--config-file",
        config_path,
        "--approve",
        *eksctl.wait_flag(WAIT_MIN),
    ]


def stack_name(d: Deployment) -> str:
    """The CloudFormation stack eksctl keeps the role in (eksctl v0.230.0, pkg/actions/irsa/tasks.go:
    makeIAMServiceAccountStackName)."""
    return f"eksctl-{d.cfg.cluster.name}-addon-iamserviceaccount-{d.cfg.ray.namespace}-{m.RAY_SERVICE_ACCOUNT}"


def delete_argv(d: Deployment) -> list[str]:
    """Delete the Ray pods' role (its CloudFormation stack) and the service account eksctl labelled as its own
    (eksctl v0.230.0, pkg/cfn/manager/delete_tasks.go ``NewTasksToDeleteIAMServiceAccounts``). Named by flags, not a
    config file, it is no plan: eksctl's loader turns plan mode off and refuses ``--approve``
    (pkg/ctl/cmdutils/configfile.go ``NewDeleteIAMServiceAccountLoader``). ``--wait`` is off by default for this
    command (pkg/ctl/delete/iamserviceaccount.go): without it eksctl returns while the stack is still being deleted,
    and a ``create iamserviceaccount`` right after leaves the service account out (its stack exists)."""
    c = d.cfg.cluster
    return [
        "eksctl",
        "delete",
        "iamserviceaccount",
        "--cluster",
        c.name,
        "--region",
        c.region,
        "--namespace",
        d.cfg.ray.namespace,
        "--name",
        m.RAY_SERVICE_ACCOUNT,
        "--wait",
        *eksctl.wait_flag(WAIT_MIN),
    ]


def created_item(d: Deployment, existing: dict[str, Any] | None = None) -> Item:
    """What the state file records of the role and service account ``eksctl create iamserviceaccount`` makes, so
    that ``down`` deletes them (:func:`delete_created`). ``existing``: the ServiceAccount as it was before, when
    there was one (eksctl's ``--override-existing-serviceaccounts`` then adds its role annotation and its managed-by
    label to it, and ``eksctl delete iamserviceaccount`` would delete it): its own values of those two keys are
    kept, so that ``down`` gives it back as it was instead."""
    item: Item = {
        "type": "iamserviceaccount",
        "kind": "IAM role and service account",
        "namespace": d.cfg.ray.namespace,
        "name": m.RAY_SERVICE_ACCOUNT,
    }
    if existing is not None:
        meta = existing.get("metadata") or {}
        item["kind"] = "IAM role (the service account existed before and stays)"
        item["restore"] = {
            "annotations": {ROLE_ARN_ANNOTATION: (meta.get("annotations") or {}).get(ROLE_ARN_ANNOTATION)},
            "labels": {MANAGED_BY_LABEL: (meta.get("labels") or {}).get(MANAGED_BY_LABEL)},
        }
    return item


def _recorded(d: Deployment) -> bool:
    """Whether an earlier ``up`` recorded the service account already: a resumed ``up`` keeps that record, which
    knows whether the account was there before eksctl touched it."""
    ns, name = d.cfg.ray.namespace, m.RAY_SERVICE_ACCOUNT
    return any(
        i.get("type") == "iamserviceaccount" and i.get("namespace") == ns and i.get("name") == name
        for i in d.state.created
    )


def give_back(d: Deployment, restore: Mapping[str, object]) -> None:
    """The service account that existed before ``up`` without eksctl's managed-by label gets its own annotation
    and label values back (a JSON merge patch: a ``None`` removes what eksctl added); ``eksctl delete
    iamserviceaccount`` then deletes only the role's stack, since it deletes a ServiceAccount only when that label
    says eksctl manages it (eksctl v0.230.0, pkg/kubernetes/serviceaccount.go ``MaybeDeleteServiceAccount``)."""
    ns, name = d.cfg.ray.namespace, m.RAY_SERVICE_ACCOUNT
    if d.kube.merge_patch("v1", "ServiceAccount", name, ns, {"metadata": restore}):
        d.say(f"Service account {ns}/{name} existed before up: it stays, without the IAM role eksctl added to it")


def delete_created(d: Deployment, cluster_exists: bool, item: Item | None = None) -> bool:
    """``down``: delete the role and service account ``up`` made with eksctl (:func:`delete_argv`), or only the
    role when the service account existed before (``item["restore"]``, see :func:`created_item`); ``True`` when
    eksctl ran. eksctl needs the cluster for it (its OIDC provider, the ServiceAccount); without it, the stack may be
    left, and the line said names the commands that delete it."""
    c = d.cfg.cluster
    if not cluster_exists:
        d.say(
            f"EKS has no cluster {c.name}, so eksctl cannot delete the Ray pods' IAM role: if CloudFormation still "
            f"has the stack {stack_name(d)}, {stacks.delete_hint(stack_name(d), c.region)}"
        )
        return False
    restore = item.get("restore") if item is not None else None
    if restore is not None and restore["labels"].get(MANAGED_BY_LABEL) != MANAGED_BY_VALUE:
        give_back(d, restore)
    d.run(
        delete_argv(d),
        timeout=TIMEOUT_S,
        on_output=d.say,
        hint=f"Run `raytrain-eks down` again; the CloudFormation console shows why the stack {stack_name(d)} could "
        "not be deleted.",
    )
    return True


# ----------------------------------------------------------------------------------------------------------------
# Looking: the ServiceAccount, its role, and what the role's policies allow
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Access:
    """What :func:`look` found. ``problems``: empty when the Ray pods may use the bucket. ``role``: the name of the
    role the service account names, when that role exists (only its policy is then wrong)."""

    problems: list[str] = field(default_factory=list)
    role: str | None = None


def required(bucket: str, prefix: str, kms_key: str | None) -> list[tuple[str, str]]:
    """(action, resource) pairs the job needs: list the bucket; write, read and delete objects under ``prefix``;
    and with ``kms_key`` (the ARN of the key that encrypts the bucket) make and read its data keys."""
    objects = f"arn:aws:s3:::{bucket}/" + (f"{prefix.strip('/')}/" if prefix.strip("/") else "") + "checkpoint"
    needs = [("s3:ListBucket", f"arn:aws:s3:::{bucket}")] + [(a, objects) for a in OBJECT_ACTIONS]
    if kms_key:
        needs += [(a, kms_key) for a in eksctl.KMS_ACTIONS]
    return needs


def _glob(pattern: str, value: str, *, ignore_case: bool) -> bool:
    """IAM's wildcards: ``*`` any run of characters, ``?`` one character; nothing else is special."""
    regex = "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)
    return re.fullmatch(regex, value, re.IGNORECASE if ignore_case else 0) is not None


def _as_list(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else [str(value)] if value is not None else []


def allows(documents: Sequence[Mapping[str, object]], action: str, resource: str) -> bool:
    """Whether an ``Allow`` statement of ``documents`` covers ``action`` on ``resource`` (action names compare
    without case, ARNs with it). Statements with ``NotAction``/``NotResource`` or conditions are not counted, and
    ``Deny`` is not weighed: this looks for the grant the role needs, it does not evaluate every policy."""
    for doc in documents:
        statements = doc.get("Statement", [])
        for st in statements if isinstance(statements, list) else [statements]:
            if not isinstance(st, dict) or str(st.get("Effect", "")).lower() != "allow" or st.get("Condition"):
                continue
            if any(_glob(a, action, ignore_case=True) for a in _as_list(st.get("Action"))) and any(
                _glob(r, resource, ignore_case=False) for r in _as_list(st.get("Resource"))
            ):
                return True
    return False


def _document(raw: object) -> dict[str, object]:
    """A policy document as boto3 returns it: already a dict (botocore decodes IAM's URL-encoded JSON), or text."""
    if isinstance(raw, dict):
        return raw
    return dict(json.loads(urllib.parse.unquote(str(raw))))


def role_documents(iam: BaseClient, role: str) -> list[dict[str, object]]:
    """Every policy document of ``role``: its inline policies and the default version of each attached one."""
    docs = []
    for page in iam.get_paginator("list_role_policies").paginate(RoleName=role):
        for name in page.get("PolicyNames", []):
            docs.append(_document(iam.get_role_policy(RoleName=role, PolicyName=name)["PolicyDocument"]))
    for page in iam.get_paginator("list_attached_role_policies").paginate(RoleName=role):
        for attached in page.get("AttachedPolicies", []):
            arn = attached["PolicyArn"]
            version = iam.get_policy(PolicyArn=arn)["Policy"]["DefaultVersionId"]
            docs.append(
                _document(iam.get_policy_version(PolicyArn=arn, VersionId=version)["PolicyVersion"]["Document"])
            )
    return docs


def named_role(d: Deployment) -> tuple[str | None, str | None]:
    """(the role the Ray pods' service account names, what is wrong): read through the Kubernetes API only."""
    ns, name = d.cfg.ray.namespace, m.RAY_SERVICE_ACCOUNT
    account = d.kube.get("v1", "ServiceAccount", name, ns)
    if account is None:
        return None, f"the service account {ns}/{name} does not exist"
    arn = ((account.get("metadata") or {}).get("annotations") or {}).get(ROLE_ARN_ANNOTATION)
    if not arn:
        return None, f"the service account {ns}/{name} has no {ROLE_ARN_ANNOTATION} annotation (no IAM role)"
    match = re.fullmatch(r"arn:aws[a-z-]*:iam::\d{12}:role/(?:.*/)?([\w+=,.@-]+)", arn)
    if match is None:
        return None, f"the service account {ns}/{name} names {arn!r} as its IAM role, which is not a role ARN"
    return match.group(1), None


def look(
    d: Deployment, bucket: str | None, kms_key: str | None, prefix: str = RUNS_PREFIX, *, aws: Aws | None = None
) -> Access:
    """Whether the Ray pods' service account exists in the Ray namespace with the role annotation, the role exists,
    and (with ``bucket``) its policies allow what the job does with the bucket under ``prefix`` and with
    ``kms_key``. Reads the Kubernetes API and IAM (through ``aws``, a session already made, or a new one); changes
    nothing."""
    ns, name = d.cfg.ray.namespace, m.RAY_SERVICE_ACCOUNT
    role, problem = named_role(d)
    if role is None:
        return Access([str(problem)])

    import botocore.exceptions

    from raytrain_eks.aws.session import aws_errors, connect

    iam = (aws or connect(d.cfg.cluster.region)).client("iam", d.cfg.cluster.region)
    try:
        with aws_errors(f"reading the IAM role {role} of the service account {ns}/{name}", expected=("NoSuchEntity",)):
            documents = role_documents(iam, role)  # NoSuchEntity when the role does not exist
    except botocore.exceptions.ClientError:
        return Access([f"the IAM role {role}, named by the service account {ns}/{name}, does not exist"])
    if bucket is None:
        return Access(role=role)
    lacking = [f"{a} on {r}" for a, r in required(bucket, prefix, kms_key) if not allows(documents, a, r)]
    if lacking:
        return Access(
            [f"the IAM role {role} of the service account {ns}/{name} does not allow " + ", ".join(lacking)], role
        )
    return Access(role=role)


# ----------------------------------------------------------------------------------------------------------------
# up: the step
# ----------------------------------------------------------------------------------------------------------------


def write_config(d: Deployment, bucket: str, kms_key: str | None) -> Path:
    return d.state.write_file(CONFIG_FILE, to_yaml([eksctl.service_account_config(d.cfg, bucket, kms_key)]))


def ensure_service_account(d: Deployment) -> None:
    """The Ray pods' service account with an IAM role that may use the checkpoint bucket (and its KMS key), on the
    cluster as it is: made, or its role's policy updated, through eksctl when :func:`look` finds it wanting; a
    :class:`UserError` saying what is still wrong after that. Needs the cluster and this folder's kubeconfig; a
    cluster without an IAM OIDC provider gets one first (:func:`oidc_argv`)."""
    bucket, kms_key = d.state.get("bucket"), d.state.get("bucket_kms_key")
    if not bucket:
        return
    ns, name = d.cfg.ray.namespace, m.RAY_SERVICE_ACCOUNT
    found = look(d, bucket, kms_key)
    if not found.problems:
        d.say(f"Service account {ns}/{name} exists with IAM role {found.role}")
        return
    path = write_config(d, bucket, kms_key)
    hint = "Run `raytrain-eks up` again: it looks at what exists and resumes."
    if found.role is not None:
        d.say(f"Updating the policy of IAM role {found.role} ({found.problems[0]})")
        argv = update_argv(str(path))
    else:
        d.say(f"Creating service account {ns}/{name} and its IAM role ({found.problems[0]})")
        record_oidc_provider(d, d.run(oidc_argv(str(path)), timeout=TIMEOUT_S, on_output=d.say, hint=hint))
        argv = create_argv(str(path))
        if not _recorded(d):  # before eksctl makes it: down deletes even a half-made stack
            d.state.record(created_item(d, d.kube.get("v1", "ServiceAccount", name, ns)))
    d.run(argv, timeout=TIMEOUT_S, on_output=d.say, hint=hint)
    after = look(d, bucket, kms_key)
    if after.problems:
        raise UserError(
            f"the Ray pods' service account {ns}/{name} is still not usable after `{shlex.join(argv)}`: "
            + "; ".join(after.problems),
            hint="eksctl leaves alone a service account whose CloudFormation stack exists already "
            f"({stack_name(d)}), and updates only the roles it made: delete it with `{shlex.join(delete_argv(d))}` "
            f"and run `raytrain-eks up` again, or give the role that service account names these permissions.",
        )
    d.say(f"Service account {ns}/{name} uses IAM role {after.role}")


# ----------------------------------------------------------------------------------------------------------------
# The cluster's IAM OIDC provider, when up had eksctl create it
# ----------------------------------------------------------------------------------------------------------------

OIDC_ITEM = "oidc-provider"
# What eksctl v0.230.0 logs once it has created the provider (pkg/ctl/utils/associate_iam_oidc_provider.go:
# logger.Success after oidc.CreateProvider); "will create ..." before it, "... is already associated ..." when the
# cluster has one and nothing is made.
OIDC_CREATED = re.compile(r"created IAM Open ID Connect provider for cluster")
# The states in which eksctl cannot operate a cluster (v0.230.0, pkg/eks/eks.go ``CanOperate``); deleting such a
# cluster, eksctl leaves its OIDC provider alone.
NOT_OPERABLE = frozenset({"CREATING", "DELETING", "FAILED"})


def provider_arn(cluster_arn: str, issuer: str) -> str:
    """The ARN of a cluster's IAM OIDC provider, as eksctl v0.230.0 names it: the partition and account of the
    cluster's ARN (pkg/eks/eks.go ``NewOpenIDConnectManager``) and the issuer's host and path, without scheme or port
    (pkg/iam/oidc/api.go ``CheckProviderExists``, ``hostnameAndPath``). Example::

        provider_arn("arn:aws:eks:us-east-1:111122223333:cluster/c", "https://oidc.eks.us-east-1.amazonaws.com/id/AB")
        # "arn:aws:iam::111122223333:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/AB"
    """
    parts = cluster_arn.split(":")
    url = urllib.parse.urlsplit(issuer)
    return f"arn:{parts[1]}:iam::{parts[4]}:oidc-provider/{url.hostname}{url.path}"


def oidc_item(arn: str) -> Item:
    return {"type": OIDC_ITEM, "kind": "IAM OIDC provider", "name": arn}


def record_oidc_provider(d: Deployment, done: Completed) -> None:
    """After :func:`oidc_argv` ran (``done``): when eksctl says it created the cluster's IAM OIDC provider, record
    it (its ARN, from EKS's description of the cluster), so that ``down`` deletes it (:func:`delete_oidc_provider`).
    A provider the cluster had already is not recorded and stays."""
    c = d.cfg.cluster
    if not OIDC_CREATED.search(done.stdout + done.stderr):
        if not any(i.get("type") == OIDC_ITEM for i in d.state.created):  # else an earlier up made it
            d.say(f"Cluster {c.name} had its IAM OIDC provider before `up`: `raytrain-eks down` leaves it")
        return
    from raytrain_eks.aws.session import aws_errors, connect

    with aws_errors(f"reading the OIDC issuer of EKS cluster {c.name}"):
        cluster = connect(c.region).client("eks", c.region).describe_cluster(name=c.name)["cluster"]
    item = oidc_item(provider_arn(cluster["arn"], cluster["identity"]["oidc"]["issuer"]))
    d.state.record(item)
    if d.state.has(cluster_item(d.cfg)):
        d.say(f"Recorded {describe(item)}, made by eksctl: `eksctl delete cluster` deletes it with the cluster")
    else:
        d.say(f"Recorded {describe(item)}, made by eksctl: `raytrain-eks down` deletes it, and keeps the cluster")


def delete_oidc_provider(d: Deployment, item: Item, cluster_status: str | None) -> bool:
    """``down``: delete the IAM OIDC provider ``up`` had eksctl create (:func:`record_oidc_provider`) when IAM still
    has it; ``True`` when it was deleted. ``cluster_status``: EKS's, ``None`` when the cluster is gone.

    Of a cluster this folder created that eksctl can operate it is left to ``eksctl delete cluster``, which deletes
    the provider of the cluster it deletes (eksctl v0.230.0, commit 6ee3b761771c4ae78c76c82bbf2ea168afd61a9e:
    pkg/actions/cluster/owned.go ``OwnedCluster.Delete`` -> pkg/cfn/manager/delete_tasks.go
    ``NewTasksToDeleteClusterWithNodeGroups`` -> ``NewTasksToDeleteOIDCProviderWithIAMServiceAccounts``, its "delete
    IAM OIDC provider" task when ``CheckProviderExists``), but only when ``clusterOperable`` (:data:`NOT_OPERABLE`).
    """
    arn = item["name"]
    if d.state.has(cluster_item(d.cfg)) and cluster_status is not None and cluster_status not in NOT_OPERABLE:
        d.say(f"{describe(item)} goes with cluster {d.cfg.cluster.name}: `eksctl delete cluster` deletes it")
        return False
    import botocore.exceptions

    from raytrain_eks.aws.session import aws_errors, connect

    region = d.cfg.cluster.region
    iam = connect(region).client("iam", region)
    try:
        with aws_errors(f"deleting {describe(item)}", expected=("NoSuchEntity",)):
            iam.get_open_id_connect_provider(OpenIDConnectProviderArn=arn)  # NoSuchEntity: deleted already
            iam.delete_open_id_connect_provider(OpenIDConnectProviderArn=arn)
    except botocore.exceptions.ClientError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# submit: the look before any pod
# ----------------------------------------------------------------------------------------------------------------


def _storage_bucket(storage_path: str | None) -> tuple[str, str] | None:
    """(bucket, prefix) of an ``s3://`` storage path, else ``None``."""
    if not storage_path or not storage_path.startswith("s3://"):
        return None
    bucket, _, prefix = storage_path[len("s3://") :].partition("/")
    return bucket, prefix


class ServiceAccountNotReady(UserError):
    """The Ray pods' service account or its IAM role is missing or may not use the checkpoint bucket."""


def check_before_pods(d: Deployment) -> None:
    """Raise :class:`ServiceAccountNotReady` unless the Ray pods' service account exists with a role that may use
    the bucket the job writes its checkpoints to (``training.storage_path``), and its KMS key when one encrypts it.
    Without the service account Kubernetes creates none of the pods; without the grants every checkpoint fails."""
    ns, name = d.cfg.ray.namespace, m.RAY_SERVICE_ACCOUNT
    from raytrain_eks.aws.session import connect

    where = _storage_bucket(d.cfg.training.storage_path)
    bucket, prefix = where if where is not None else (None, "")
    _, problem = named_role(d)  # the Kubernetes API first: AWS is asked only about a role that is named
    if problem is not None:
        found = Access([problem])
    else:
        aws = connect(d.cfg.cluster.region)
        kms_key = bucket_kms_key(d, bucket, aws) if bucket else None
        found = look(d, bucket, kms_key, prefix, aws=aws)
    if not found.problems:
        return
    mine = d.state.get("bucket")
    hint = (
        "Run `raytrain-eks up`: it creates the service account and its IAM role (eksctl create iamserviceaccount), "
        "or brings the role's policy up to date; then submit again."
    )
    if bucket and mine and bucket != mine:
        hint = (
            f"training.storage_path is in s3://{bucket}, but the role `up` makes may use only the cluster's "
            f"checkpoint bucket s3://{mine}: leave training.storage_path unset (or put it in s3://{mine}), or set "
            f"cluster.checkpoint_bucket (CHECKPOINT_BUCKET) to {bucket} and run `raytrain-eks up` again."
        )
    raise ServiceAccountNotReady(
        f"the Ray pods cannot run as the service account {ns}/{name}: "
        + "; ".join(found.problems)
        + ". Nothing was applied.",
        hint=hint,
    )
