"""What eksctl v0.230.0 does with the CloudFormation stack of a cluster, and what it prints, for the tests' FakeTools.

eksctl keeps a cluster's VPC and control plane in the stack ``eksctl-<name>-cluster``; here that stack lives in moto's
CloudFormation (so the tool's own boto3 reads see it), holding the VPC alone, with eksctl's tags and its termination
protection on, as eksctl creates every stack (pkg/cfn/manager/api.go DoCreateStackRequest); moto's server refuses to
delete it while that is on once fake_aws.keep_termination_protection() has run, and eksctl's own deletes turn it off
first. A create that fails leaves it rolled back; moto cannot fail a stack, so :func:`fail_cluster_stack` sets the
status moto then reports.
Every text is eksctl's, from its source at tag v0.230.0 (commit 6ee3b761771c4ae78c76c82bbf2ea168afd61a9e) vendored
under ``tests/fixtures/eksctl/``, named where it is used; the AWS SDK for Go's error wording is marked as such.
Example::

    create_cluster_stack("ray-train-eks", "us-east-1")          # None, or the failure eksctl prints
    fail_cluster_stack("ray-train-eks", "us-east-1", "ROLLBACK_COMPLETE")
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import boto3
import botocore.exceptions

# pkg/apis/eksctl.io/v1alpha5/types.go: ClusterNameTag and OldClusterNameTag, the tags eksctl's stacks bear.
CLUSTER_NAME_TAGS = ("alpha.eksctl.io/cluster-name", "eksctl.cluster.k8s.io/v1alpha1/cluster-name")
# The VPC eksctl's cluster stack makes: DefaultCIDR() of pkg/apis/eksctl.io/v1alpha5/vpc.go (v0.230.0).
VPC_CIDR = "192.168.0.0/16"


def cluster_stack(cluster: str) -> str:
    # pkg/cfn/manager/cluster.go: MakeClusterStackNameFromName.
    return "eksctl-" + cluster + "-cluster"


def _cfn(region: str):
    return boto3.client("cloudformation", region_name=region)


def request_id() -> str:
    return str(uuid.uuid4())


def create_cluster_stack(cluster: str, region: str) -> str | None:
    """Create the cluster's stack; None, or what eksctl prints when CloudFormation refuses (the name is taken)."""
    template = {
        "Resources": {"VPC": {"Type": "AWS::EC2::VPC", "Properties": {"CidrBlock": VPC_CIDR}}},
    }
    tags = [{"Key": key, "Value": cluster} for key in CLUSTER_NAME_TAGS]
    name = cluster_stack(cluster)
    try:
        # pkg/cfn/manager/api.go DoCreateStackRequest: EnableTerminationProtection: aws.Bool(true), for every stack.
        _cfn(region).create_stack(
            StackName=name, TemplateBody=json.dumps(template), Tags=tags, EnableTerminationProtection=True
        )
    except botocore.exceptions.ClientError as exc:
        if exc.response["Error"]["Code"] != "AlreadyExistsException":
            raise
        # pkg/cfn/manager/api.go DoCreateStackRequest wraps the SDK's error ("operation error ..., https response
        # error StatusCode: ..., RequestID: ..., <code>: <message>", the SDK's format; CloudFormation's message).
        return (
            f'creating CloudFormation stack "{name}": operation error CloudFormation: CreateStack, https response '
            f"error StatusCode: 400, RequestID: {request_id()}, AlreadyExistsException: Stack [{name}] already exists"
        )
    return None


def fail_cluster_stack(cluster: str, region: str, status: str) -> None:
    """Leave the cluster's stack in ``status`` (``ROLLBACK_COMPLETE``, ``DELETE_FAILED``, ...), as AWS would after
    a create or delete that failed. moto's API cannot get there, so its model is set; moto then reports it."""
    from moto.backends import get_backend
    from moto.core import DEFAULT_ACCOUNT_ID

    name = cluster_stack(cluster)
    (stack,) = [s for s in get_backend("cloudformation")[DEFAULT_ACCOUNT_ID][region].stacks.values() if s.name == name]
    stack.status = status


def stack_status(cluster: str, region: str) -> str | None:
    try:
        return _cfn(region).describe_stacks(StackName=cluster_stack(cluster))["Stacks"][0]["StackStatus"]
    except botocore.exceptions.ClientError as exc:
        if "does not exist" in exc.response["Error"]["Message"]:
            return None
        raise


def delete_stack(cluster: str, region: str, name: str) -> bool:
    """Delete a stack as eksctl does (pkg/cfn/manager/api.go DeleteStackBySpec): only one whose tags name the
    cluster (matchesCluster; eksctl's error otherwise), its termination protection turned off first, both by the
    stack's ID; False when there is none."""
    cfn = _cfn(region)
    try:
        (stack,) = cfn.describe_stacks(StackName=name)["Stacks"]
    except botocore.exceptions.ClientError as exc:
        if "does not exist" in exc.response["Error"]["Message"]:
            return False
        raise
    tags = {t["Key"]: t["Value"] for t in stack.get("Tags", [])}
    if cluster not in (tags.get(key) for key in CLUSTER_NAME_TAGS):
        old, new = CLUSTER_NAME_TAGS[1], CLUSTER_NAME_TAGS[0]
        raise AssertionError(
            f'cannot delete stack "{name}" as it doesn\'t bear our "{old}:{cluster}", "{new}:{cluster}" tags'
        )
    if stack.get("EnableTerminationProtection"):
        cfn.update_termination_protection(StackName=stack["StackId"], EnableTerminationProtection=False)
    cfn.delete_stack(StackName=stack["StackId"])
    return True


def delete_cluster_stack(cluster: str, region: str) -> bool:
    """Delete the cluster's stack as eksctl does (DeleteStackBySpec, then wait); False when there is none."""
    return delete_stack(cluster, region, cluster_stack(cluster))


def delete_cluster_panics(cluster: str) -> tuple[str, str]:
    """(stdout, stderr) of ``eksctl delete cluster --force`` when EKS has no such cluster: eksctl dies (exit 2) and
    deletes nothing.

    pkg/ctl/delete/cluster.go doDeleteCluster: describing the missing cluster fails, and --force logs that as a
    warning and goes on with a provider that has no cluster status, logging 'deleting EKS cluster "NAME"'; then
    pkg/actions/cluster/cluster.go New reads ``ctl.Status.ClusterInfo.Cluster`` (its line 40 at v0.230.0) with
    ClusterInfo nil, before it looks for the cluster's stack. The first lines on stderr are Go's panic as eksctl's
    issue #7450 ("SIGSEGV when trying to clean up a deleted eks cluster", github.com/eksctl-io/eksctl, open) quotes
    them for this command, its program counter included; the frame after them is where v0.230.0's source panics
    (the issue's older eksctl got further, to OwnedCluster.Delete). Go writes a panic to stderr and exits 2."""
    warning = no_cluster(cluster, wrap="unable to describe cluster control plane").removeprefix("Error: ").rstrip()
    out = (
        f"[!]  failed to create provider for cluster; force = true skipping: {warning}\n"
        f'[ℹ]  deleting EKS cluster "{cluster}"\n'
    )
    err = (
        "panic: runtime error: invalid memory address or nil pointer dereference\n"
        "[signal SIGSEGV: segmentation violation code=0x1 addr=0x0 pc=0x5042d9b]\n\n"
        "goroutine 1 [running]:\n"
        "github.com/weaveworks/eksctl/pkg/actions/cluster.New(...)\n"
        "\tgithub.com/weaveworks/eksctl/pkg/actions/cluster/cluster.go:40\n"
    )
    return out, err


def create_cluster_failed(cluster: str, region: str, status: str) -> tuple[str, str]:
    """(stdout, stderr) of ``eksctl create cluster`` when the cluster stack ends in ``status``.

    pkg/cfn/manager/api.go createClusterStack: on the waiter's error it logs the stack's status; the waiter's error
    is pkg/cfn/waiter/stack.go's "ResourceNotReady: failed waiting for successful resource state"; then
    pkg/ctl/create/cluster.go logs the errors and returns `failed to create cluster "NAME"`, which cobra prints as
    "Error: ..." on stderr. eksctl's logger writes to stdout (cmd/eksctl/logger.go)."""
    name = cluster_stack(cluster)
    out = (
        f'[✖]  unexpected status "{status}" while waiting for CloudFormation stack "{name}"\n'
        "[ℹ]  fetching stack events in attempt to troubleshoot the root cause of the failure\n"
        "[!]  1 error(s) occurred and cluster hasn't been created properly, you may wish to check CloudFormation "
        "console\n"
        f"[ℹ]  to cleanup resources, run 'eksctl delete cluster --region={region} --name={cluster}'\n"
        "[✖]  ResourceNotReady: failed waiting for successful resource state\n"
    )
    return out, f'Error: failed to create cluster "{cluster}"\n'


def create_stack_refused(cluster: str, region: str, why: str) -> tuple[str, str]:
    """(stdout, stderr) of ``eksctl create cluster`` when CloudFormation refuses the stack (pkg/ctl/create/cluster.go
    logs each task's error, then returns `failed to create cluster "NAME"`)."""
    out = (
        "[!]  1 error(s) occurred and cluster hasn't been created properly, you may wish to check CloudFormation "
        f"console\n[ℹ]  to cleanup resources, run 'eksctl delete cluster --region={region} --name={cluster}'\n"
        f"[✖]  {why}\n"
    )
    return out, f'Error: failed to create cluster "{cluster}"\n'


def no_cluster(cluster: str, *, wrap: str) -> str:
    """eksctl's error for a cluster EKS does not know: pkg/eks/eks.go wraps DescribeCluster's error with ``wrap``
    (GetCluster: 'unable to describe control plane "NAME"'; DescribeControlPlane, which RefreshClusterStatus and so
    every command on an existing cluster uses: 'unable to describe cluster control plane'); the rest is the SDK's
    format around EKS's ResourceNotFoundException."""
    return (
        f"Error: {wrap}: operation error EKS: DescribeCluster, https response error StatusCode: 404, RequestID: "
        f"{request_id()}, ResourceNotFoundException: No cluster found for name: {cluster}.\n"
    )


def default_kubeconfig() -> Path:
    """``kubeconfig.DefaultPath()`` (pkg/utils/kubeconfig/kubeconfig.go): ``$KUBECONFIG``, else client-go's
    ``~/.kube/config``."""
    import os

    return Path(os.environ["KUBECONFIG"]) if os.environ.get("KUBECONFIG") else Path.home() / ".kube" / "config"


def auto_kubeconfig(cluster: str) -> Path:
    # pkg/utils/kubeconfig/kubeconfig.go AutoPath: path.Join(clientcmd.RecommendedConfigDir, "eksctl", "clusters", name)
    return Path.home() / ".kube" / "eksctl" / "clusters" / cluster


def nodegroup_stack(cluster: str, nodegroup: str) -> str:
    # pkg/cfn/manager/nodegroup.go: makeNodeGroupStackName.
    return f"eksctl-{cluster}-nodegroup-{nodegroup}"


def no_capacity_reason(nodegroup: str, az: str, instance_type: str) -> str:
    """The reason of the CREATE_FAILED event of a node group EC2 has no capacity for (see nodegroup_launch_failed)."""
    issue = (
        f"Could not launch On-Demand Instances. InsufficientInstanceCapacity - We currently do not have sufficient "
        f"{instance_type} capacity in the Availability Zone you requested ({az}). Our system will be working on "
        "provisioning additional capacity. Launching EC2 instance failed."
    )
    return (
        f'Resource handler returned message: "[Issue(Code=AsgInstanceLaunchFailures, Message={issue}, '
        f'ResourceIds=[eks-{nodegroup}-{request_id()[:8]}])]" (RequestToken: {request_id()}, HandlerErrorCode: '
        "GeneralServiceException)"
    )


def nodegroup_launch_failed(cluster: str, region: str, nodegroup: str, az: str, instance_type: str) -> tuple[str, str]:
    """A managed node group whose instances EC2 cannot launch in ``az``: its stack in moto, rolled back, with the
    failure CloudFormation records, and (stdout, stderr) of ``eksctl create nodegroup``.

    The stack's node group resource is ``ManagedNodeGroup`` (pkg/cfn/builder/managed_nodegroup.go,
    ManagedNodeGroupResourceName, v0.230.0); CloudFormation records EKS's health issue in its CREATE_FAILED event as
    'Resource handler returned message: "[Issue(Code=..., Message=..., ResourceIds=[...])]"' (the form `aws
    cloudformation describe-stack-events` shows for such node groups). eksctl waits for the stack with the SDK's
    StackCreateComplete waiter (pkg/cfn/manager/waiters.go), whose error for a rolled-back stack is "waiter state
    transitioned to Failure" (the SDK's wording; eksctl matches it in pkg/actions/addon/addon.go), logged as it is
    (pkg/eks/nodegroup_service.go DoAllNodegroupStackTasks) before `failed to create nodegroups for cluster`."""
    from moto.backends import get_backend
    from moto.cloudformation.models import Event
    from moto.core import DEFAULT_ACCOUNT_ID

    name = nodegroup_stack(cluster, nodegroup)
    data = {"LaunchTemplateData": {"InstanceType": instance_type}}
    template = {"Resources": {"LaunchTemplate": {"Type": "AWS::EC2::LaunchTemplate", "Properties": data}}}
    _cfn(region).create_stack(
        StackName=name,
        TemplateBody=json.dumps(template),
        Tags=[{"Key": k, "Value": cluster} for k in CLUSTER_NAME_TAGS],
        EnableTerminationProtection=True,  # as every stack eksctl creates (api.go DoCreateStackRequest)
    )
    (stack,) = [s for s in get_backend("cloudformation")[DEFAULT_ACCOUNT_ID][region].stacks.values() if s.name == name]
    reason = no_capacity_reason(nodegroup, az, instance_type)
    stack.events.append(
        Event(stack.stack_id, name, "ManagedNodeGroup", "", "AWS::EKS::Nodegroup", "CREATE_FAILED", reason, None)
    )
    stack.status = "ROLLBACK_COMPLETE"
    out = (
        f'[ℹ]  waiting for CloudFormation stack "{name}"\n'
        "[ℹ]  1 error(s) occurred and nodegroups haven't been created properly, you may wish to check "
        f"CloudFormation console\n[ℹ]  to cleanup resources, run 'eksctl delete nodegroup --region={region} "
        f"--cluster={cluster} --name=<name>' for each of the failed nodegroup\n"
        "[✖]  waiter state transitioned to Failure\n"
    )
    return out, f'Error: failed to create nodegroups for cluster "{cluster}"\n'


def delete_nodegroup_stack(cluster: str, region: str, nodegroup: str) -> None:
    """``eksctl delete nodegroup`` deletes the node group's stack as it deletes any (a no-op when there is none)."""
    delete_stack(cluster, region, nodegroup_stack(cluster, nodegroup))
