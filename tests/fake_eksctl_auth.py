"""What eksctl v0.230.0 does for identities, for the tests' FakeTools: the kubeconfig it writes (which credential
program every call to the cluster runs), the IAM roles of service accounts (IRSA) and the cluster's IAM OIDC
provider, made in moto's IAM.

Each answer follows eksctl's source at tag v0.230.0 (commit 6ee3b761771c4ae78c76c82bbf2ea168afd61a9e), vendored
under ``tests/fixtures/eksctl/`` (see its SOURCE.md); the file behind each is named where it is used. Example::

    iam = FakeIamServiceAccounts(kube)
    iam.create(cluster, doc, approve=True, override=True, include=[])   # (0, "", log) as eksctl would end
"""

from __future__ import annotations

import fnmatch
import json
import secrets
import string
from collections.abc import Collection
from typing import Any

import boto3
import botocore.exceptions
from fake_kube import FakeKube

# pkg/utils/kubeconfig/kubeconfig.go: authenticatorCommands() in the order lookupAuthenticator tries them.
AUTHENTICATORS = ("aws-iam-authenticator", "aws")
# pkg/apis/eksctl.io/v1alpha5/iam.go: AnnotationEKSRoleARN.
ROLE_ARN_ANNOTATION = "eks.amazonaws.com/role-arn"
# pkg/kubernetes/serviceaccount.go: the label MaybeCreateServiceAccountOrUpdateMetadata sets.
MANAGED_BY = ("app.kubernetes.io/managed-by", "eksctl")
# pkg/iam/oidc/api.go: defaultAudience, the one client id of the provider eksctl creates.
OIDC_AUDIENCE = "sts.amazonaws.com"
# eksctl computes the thumbprint from the issuer's root CA certificate (api.go getIssuerCAThumbprint: "%x" of its
# SHA-1); no issuer is reached here, so a fixed value of that form stands for it.
OIDC_THUMBPRINT = "9e99a48a9960b14926bb7f3b02e22da2b0ab7280"
# pkg/eks/eks.go CanOperate: eksctl leaves the IAM resources of a cluster in these states when it deletes it.
NOT_OPERABLE = ("CREATING", "DELETING", "FAILED")


def kubeconfig(cluster: str, region: str, missing: Collection[str]) -> dict[str, Any]:
    """The kubeconfig ``eksctl utils write-kubeconfig`` writes (pkg/ctl/utils/write_kubeconfig.go ->
    pkg/utils/kubeconfig/kubeconfig.go ``NewForKubectl``): its user runs the first of aws-iam-authenticator and aws
    found on PATH (``lookupAuthenticator``), aws-iam-authenticator when neither is, with the arguments
    ``AppendAuthenticator`` gives each. Only the parts the tests read are kept: no server, no certificate."""
    command = next((c for c in AUTHENTICATORS if c not in missing), AUTHENTICATORS[0])
    if command == "aws":
        args = ["eks", "get-token", "--output", "json", "--cluster-name", cluster, "--region", region]
    else:
        args = ["token", "-i", cluster]
    user = f"raytrain-eks@{cluster}.{region}.eksctl.io"
    exec_config = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": command,
        "args": args,
        "env": [{"name": "AWS_STS_REGIONAL_ENDPOINTS", "value": "regional"}],
        "provideClusterInfo": False,
    }
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": user,
        "contexts": [{"name": user, "context": {"cluster": f"{cluster}.{region}.eksctl.io", "user": user}}],
        "users": [{"name": user, "user": {"exec": exec_config}}],
    }


class FakeIamServiceAccounts:
    """eksctl's IAM service accounts: a CloudFormation stack per service account holding its role (moto's IAM), and
    the ServiceAccount in the fake cluster, annotated with the role's ARN.

    ``stacks``: stack name -> role name, the stacks eksctl made. ``without_oidc``: clusters with no IAM OIDC
    provider (one not created by eksctl with ``iam.withOIDC``). ``providers``: cluster -> (ARN, region) of the
    providers made in moto's IAM by :meth:`associate_oidc`; such a cluster has OIDC while IAM has its provider.
    ``deleted_with_cluster``: the providers :meth:`delete_cluster` deleted, as ``eksctl delete cluster`` does."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube
        self.stacks: dict[str, str] = {}
        self.without_oidc: set[str] = set()
        self.providers: dict[str, tuple[str, str]] = {}
        self.deleted_with_cluster: list[str] = []
        self._in_eks: set[tuple[str, str]] = set()
        self._clients: dict[str, Any] = {}

    @staticmethod
    def stack_name(cluster: str, ns: str, name: str) -> str:
        # pkg/actions/irsa/tasks.go: makeIAMServiceAccountStackName.
        return f"eksctl-{cluster}-addon-iamserviceaccount-{ns}-{name}"

    def _iam(self, region: str) -> Any:
        if region not in self._clients:
            self._clients[region] = boto3.client("iam", region_name=region)
        return self._clients[region]

    def has_oidc(self, cluster: str) -> bool:
        made = self.providers.get(cluster)
        return cluster not in self.without_oidc if made is None else self._in_iam(*made)

    def _in_iam(self, arn: str, region: str) -> bool:
        try:
            self._iam(region).get_open_id_connect_provider(OpenIDConnectProviderArn=arn)
        except botocore.exceptions.ClientError:  # NoSuchEntity: deleted through IAM since
            return False
        return True

    def _eks_cluster(self, cluster: str, region: str) -> dict[str, Any]:
        """The cluster as EKS describes it (its ARN, its OIDC issuer: pkg/eks/eks.go ``NewOpenIDConnectManager`` reads
        both). The tests' clusters live in FakeTools, so moto's EKS is given the cluster when first asked."""
        eks = boto3.client("eks", region_name=region)
        if (cluster, region) not in self._in_eks:
            role = "arn:aws:iam::123456789012:role/eks-cluster"
            eks.create_cluster(name=cluster, roleArn=role, resourcesVpcConfig={"subnetIds": []})
            self._in_eks.add((cluster, region))
        return dict(eks.describe_cluster(name=cluster)["cluster"])

    def make(self, cluster: str, region: str, sa: dict[str, Any]) -> str:
        """One service account's tasks (pkg/cfn/manager/create_tasks.go ``NewTasksToCreateIAMServiceAccounts``):
        the stack with its role, then the ServiceAccount. Returns the role's ARN."""
        ns, name = sa["metadata"].get("namespace", "default"), sa["metadata"]["name"]
        stack = self.stack_name(cluster, ns, name)
        iam = self._iam(region)
        account = "123456789012"  # moto's account; the provider's ARN is only written into the trust policy
        # pkg/cfn/builder/iam.go: the role (logical id Role1) trusts the cluster's OIDC provider for this service
        # account only (pkg/iam/oidc/api.go, MakeAssumeRolePolicyDocumentWithServiceAccountConditions); the
        # ``attachPolicy`` document is an inline policy named "<stack>-Policy1" (pkg/cfn/template/iam_helpers.go).
        issuer = f"oidc.eks.{region}.amazonaws.com/id/{cluster.upper()}"
        trust = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Action": ["sts:AssumeRoleWithWebIdentity"],
                    "Principal": {"Federated": f"arn:aws:iam::{account}:oidc-provider/{issuer}"},
                    "Condition": {
                        "StringEquals": {
                            f"{issuer}:sub": f"system:serviceaccount:{ns}:{name}",
                            f"{issuer}:aud": "sts.amazonaws.com",
                        }
                    },
                }
            ],
        }
        # The role's name is CloudFormation's own (not in eksctl's source): stack name, logical id, random suffix,
        # within IAM's 64 characters.
        suffix = "".join(secrets.choice(string.ascii_uppercase + string.digits) for _ in range(12))
        role = f"{stack[: 64 - len('-Role1-') - len(suffix)]}-Role1-{suffix}"
        arn = iam.create_role(RoleName=role, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
        if sa.get("attachPolicy"):
            iam.put_role_policy(
                RoleName=role, PolicyName=f"{stack}-Policy1", PolicyDocument=json.dumps(sa["attachPolicy"])
            )
        self.stacks[stack] = role
        self.upsert(ns, name, {ROLE_ARN_ANNOTATION: arn})
        return arn

    def upsert(self, ns: str, name: str, annotations: dict[str, str]) -> None:
        """pkg/kubernetes/serviceaccount.go ``MaybeCreateServiceAccountOrUpdateMetadata``: the namespace is created
        when missing (pkg/kubernetes/namespace.go ``MaybeCreateNamespace``); a ServiceAccount that exists keeps its
        own annotations and labels and gets these added."""
        if self.kube.get("v1", "Namespace", ns) is None and ns not in ("default", "kube-system"):
            self.kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        current = self.kube.get("v1", "ServiceAccount", name, ns) or {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": ns},
        }
        meta = current["metadata"]
        meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
        meta["labels"] = {**(meta.get("labels") or {}), MANAGED_BY[0]: MANAGED_BY[1]}
        self.kube.apply(current)

    def create(
        self, cluster: str, region: str, doc: dict[str, Any], *, approve: bool, override: bool, include: list[str]
    ) -> tuple[int, str, str]:
        """``eksctl create iamserviceaccount -f FILE`` (pkg/ctl/create/iamserviceaccount.go).

        Without ``--approve`` it only plans (``Plan`` is on by default, pkg/ctl/cmdutils/cmd.go; pkg/ctl/cmdutils/
        cmdutils.go ``AddApproveFlag`` turns it off). A cluster without an IAM OIDC provider is an error. Every
        service account whose stack exists is left out, and one named by ``--include`` too is an error
        (pkg/ctl/cmdutils/filter/filter.go ``doSetExcludeExistingFilter``); a ServiceAccount that exists in the
        cluster is left out too, unless ``--override-existing-serviceaccounts`` (filter/iamserviceaccount_filter.go
        ``SetExcludeExistingFilter``), and then gets the annotation added to what it has."""
        if not self.has_oidc(cluster):
            return 1, "", "Error: unable to create iamserviceaccount(s) without IAM OIDC provider enabled\n"
        accounts = doc["iam"]["serviceAccounts"]
        log = []
        for sa in accounts:
            ns, name = sa["metadata"].get("namespace", "default"), sa["metadata"]["name"]
            key = f"{ns}/{name}"
            if include and not any(fnmatch.fnmatchcase(key, g) for g in include):
                continue
            if self.stack_name(cluster, ns, name) in self.stacks:
                if include:
                    return 1, "", f'Error: existing iamserviceaccount "{key}" should be excluded, but matches include\n'
                log.append(f"1 existing iamserviceaccount(s) ({key}) will be excluded")
                continue
            if not override and self.kube.get("v1", "ServiceAccount", name, ns) is not None:
                log.append(f"1 existing iamserviceaccount(s) ({key}) will be excluded")
                continue
            if not approve:
                log.append(f"(plan) would create IAM role for serviceaccount {key!r}")
                continue
            self.make(cluster, region, sa)
            log.append(f"created serviceaccount {key!r}")
        return 0, "", "\n".join(log) + "\n"

    def associate_oidc(self, cluster: str, region: str, *, approve: bool) -> tuple[int, str, str]:
        """``eksctl utils associate-iam-oidc-provider`` (pkg/ctl/utils/associate_iam_oidc_provider.go): says so and
        changes nothing when the cluster has a provider; else, with ``--approve``, creates it in IAM as pkg/iam/oidc/
        api.go ``CreateProvider`` does (``CreateOpenIDConnectProvider``: the issuer's URL, client id
        ``sts.amazonaws.com``, the thumbprint, pkg/eks/eks.go ``sharedTags``). eksctl gives IAM the URL with ":443"
        added (``NewOpenIDConnectManager``); IAM keys the provider by host and path (eksctl's own
        ``CheckProviderExists`` looks it up so), and moto keeps a port, so the issuer goes to moto as EKS gives it.
        Its log lines go to stdout (cmd/eksctl/logger.go), with ``LogIntendedAction``'s prefix and
        ``LogPlanModeWarning`` (pkg/ctl/cmdutils/cmdutils.go)."""
        where = f'cluster "{cluster}" in "{region}"'
        if self.has_oidc(cluster):
            return 0, f"[ℹ]  IAM Open ID Connect provider is already associated with {where}\n", ""
        if not approve:
            log = f"[ℹ]  (plan) would create IAM Open ID Connect provider for {where}\n"
            return 0, log + "[!]  no changes were applied, run again with '--approve' to apply the changes\n", ""
        found = self._eks_cluster(cluster, region)
        tags = {"alpha.eksctl.io/cluster-name": cluster, "alpha.eksctl.io/eksctl-version": "0.230.0"}
        arn = self._iam(region).create_open_id_connect_provider(
            Url=found["identity"]["oidc"]["issuer"],
            ClientIDList=[OIDC_AUDIENCE],
            ThumbprintList=[OIDC_THUMBPRINT],
            Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
        )["OpenIDConnectProviderArn"]
        self.providers[cluster] = (arn, region)
        self.without_oidc.discard(cluster)
        log = f"[ℹ]  will create IAM Open ID Connect provider for {where}\n"
        return 0, log + f"[✔]  created IAM Open ID Connect provider for {where}\n", ""

    def delete_cluster(self, cluster: str, *, operable: bool) -> None:
        """What ``eksctl delete cluster`` does with the cluster's provider: pkg/actions/cluster/owned.go ``Delete``,
        for a cluster it can operate, runs pkg/cfn/manager/delete_tasks.go
        ``NewTasksToDeleteOIDCProviderWithIAMServiceAccounts``, whose "delete IAM OIDC provider" task deletes it
        when IAM has it. The cluster leaves moto's EKS too."""
        made = self.providers.pop(cluster, None)
        if made is not None and operable and self._in_iam(*made):
            self._iam(made[1]).delete_open_id_connect_provider(OpenIDConnectProviderArn=made[0])
            self.deleted_with_cluster.append(made[0])
        for name, region in [k for k in self._in_eks if k[0] == cluster]:
            boto3.client("eks", region_name=region).delete_cluster(name=name)
            self._in_eks.discard((name, region))

    def update(self, cluster: str, region: str, doc: dict[str, Any], *, approve: bool) -> tuple[int, str, str]:
        """``eksctl update iamserviceaccount -f FILE`` (pkg/ctl/update/iamserviceaccount.go, pkg/actions/irsa/
        update.go): each service account whose stack exists gets its stack updated to the config's policy; the others
        are only named in the log."""
        log = []
        for sa in doc["iam"]["serviceAccounts"]:
            ns, name = sa["metadata"].get("namespace", "default"), sa["metadata"]["name"]
            role = self.stacks.get(self.stack_name(cluster, ns, name))
            if role is None:
                log.append(f"cannot update IAMServiceAccount {ns}/{name} as it does not exist")
                continue
            if not approve:
                continue
            self._iam(region).put_role_policy(
                RoleName=role,
                PolicyName=f"{self.stack_name(cluster, ns, name)}-Policy1",
                PolicyDocument=json.dumps(sa["attachPolicy"]),
            )
            log.append(f"updating policies for IAMServiceAccount {ns}/{name}")
        return 0, "", "\n".join(log) + "\n"

    def delete(self, cluster: str, region: str, ns: str, name: str, *, wait: bool) -> tuple[int, str, str]:
        """``eksctl delete iamserviceaccount --cluster C --namespace NS --name N`` (pkg/ctl/delete/iamserviceaccount.go;
        named by flags it is no plan: pkg/ctl/cmdutils/configfile.go ``NewDeleteIAMServiceAccountLoader`` sets
        ``l.Plan = false``). A cluster without an IAM OIDC provider is an error. Then pkg/actions/irsa/delete.go runs
        pkg/cfn/manager/delete_tasks.go ``NewTasksToDeleteIAMServiceAccounts`` (both vendored in fixtures/eksctl):
        the service account's stack (its role), deleted and waited for with ``--wait`` (``DeleteStackBySpecSync``),
        only started without it (``DeleteStackBySpec``: the stack is still there when eksctl returns); then the
        ServiceAccount, which pkg/kubernetes/serviceaccount.go ``MaybeDeleteServiceAccount`` deletes only when it
        carries eksctl's managed-by label."""
        if not self.has_oidc(cluster):
            return 1, "", "Error: unable to delete iamserviceaccount(s) without IAM OIDC provider enabled\n"
        stack = self.stack_name(cluster, ns, name)
        log = [f'delete IAM role for serviceaccount "{ns}/{name}"'] if stack in self.stacks else []
        if stack in self.stacks and wait:
            role = self.stacks.pop(stack)
            iam = self._iam(region)
            for policy in iam.list_role_policies(RoleName=role)["PolicyNames"]:
                iam.delete_role_policy(RoleName=role, PolicyName=policy)
            iam.delete_role(RoleName=role)
        account = self.kube.get("v1", "ServiceAccount", name, ns)
        if account is not None and (account["metadata"].get("labels") or {}).get(MANAGED_BY[0]) == MANAGED_BY[1]:
            self.kube.delete("v1", "ServiceAccount", name, ns)
            log.append(f'deleted serviceaccount "{ns}/{name}"')
        return 0, "", "\n".join(log) + "\n"
