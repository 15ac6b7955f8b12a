"""The CloudFormation stack eksctl keeps a cluster in, read and deleted through boto3.

eksctl builds the cluster's VPC, subnets, NAT gateway and control plane as the stack ``eksctl-<name>-cluster``
(eksctl v0.230.0, ``pkg/cfn/manager``: ``MakeClusterStackName``). A failed ``eksctl create cluster`` leaves that
stack behind, rolled back (``ROLLBACK_COMPLETE``) or failed, while EKS has no cluster; the next create then fails on
the stack's name. :func:`stale_stack` tells such a stack from one in use or in progress. eksctl creates every stack
with termination protection on, so CloudFormation refuses to delete it until that is turned off:
:func:`delete_eksctl_stack` does both, as eksctl does, and only for a stack whose tags name the cluster. Example::

    aws = connect("us-east-1")
    stack = describe_stack(aws, "us-east-1", cluster_stack_name("ray-train-eks"))  # None: no such stack
    if stack is not None and stale_stack(stack.status):
        delete_eksctl_stack(aws, "us-east-1", stack, "ray-train-eks")  # then poll stack_status until None
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from raytrain_eks.aws.session import Aws, aws_errors, error_code, error_message
from raytrain_eks.errors import UserError

# The tags eksctl puts on every stack it creates, each naming the cluster (eksctl v0.230.0: ClusterNameTag and
# OldClusterNameTag of pkg/apis/eksctl.io/v1alpha5/types.go, set by NewStackCollection in pkg/cfn/manager/api.go).
# eksctl itself deletes only a stack bearing one of them with the cluster's name (matchesCluster, same file).
CLUSTER_NAME_TAGS = ("alpha.eksctl.io/cluster-name", "eksctl.cluster.k8s.io/v1alpha1/cluster-name")

# Left by a create that failed (or a delete that did): nothing uses them, and they hold the name.
STALE_STATUSES = frozenset({"ROLLBACK_COMPLETE", "CREATE_FAILED", "ROLLBACK_FAILED", "DELETE_FAILED"})
# On their way to another status: wait for it.
BUSY_STATUSES = frozenset(
    {
        "CREATE_IN_PROGRESS",
        "ROLLBACK_IN_PROGRESS",
        "DELETE_IN_PROGRESS",
        "UPDATE_IN_PROGRESS",
        "UPDATE_COMPLETE_CLEANUP_IN_PROGRESS",
        "UPDATE_ROLLBACK_IN_PROGRESS",
        "UPDATE_ROLLBACK_COMPLETE_CLEANUP_IN_PROGRESS",
        "REVIEW_IN_PROGRESS",
        "IMPORT_IN_PROGRESS",
        "IMPORT_ROLLBACK_IN_PROGRESS",
    }
)


def cluster_stack_name(cluster: str) -> str:
    """The stack eksctl creates for cluster ``cluster``: ``eksctl-<cluster>-cluster``."""
    return f"eksctl-{cluster}-cluster"


def nodegroup_stack_name(cluster: str, nodegroup: str) -> str:
    """The stack eksctl creates for a node group (``makeNodeGroupStackName``, pkg/cfn/manager/nodegroup.go)."""
    return f"eksctl-{cluster}-nodegroup-{nodegroup}"


def stale_stack(status: str | None) -> bool:
    """A stack in this status is left from a failed create or delete: it must go before the cluster is created."""
    return status in STALE_STATUSES


def busy_stack(status: str | None) -> bool:
    """A stack in this status is being created, rolled back, updated or deleted right now."""
    return status in BUSY_STATUSES


@dataclass(frozen=True)
class Stack:
    """One CloudFormation stack as DescribeStacks gives it: ``id`` its ARN, ``protected`` its termination
    protection (``EnableTerminationProtection``)."""

    name: str
    id: str
    status: str
    tags: dict[str, str] = field(default_factory=dict)
    protected: bool = False

    def made_for(self, cluster: str) -> bool:
        """eksctl made this stack for cluster ``cluster``: one of :data:`CLUSTER_NAME_TAGS` names it."""
        return any(self.tags.get(key) == cluster for key in CLUSTER_NAME_TAGS)


def describe_stack(aws: Aws, region: str, name: str) -> Stack | None:
    """The stack called ``name``, or None when there is none (a deleted stack is not found by name)."""
    import botocore.exceptions

    cfn = aws.client("cloudformation", region)
    with aws_errors(f"reading the CloudFormation stack {name} in {region}"):
        try:
            found = cfn.describe_stacks(StackName=name)["Stacks"]
        except botocore.exceptions.ClientError as exc:
            # CloudFormation's answer for a name it does not know: ValidationError "Stack with id X does not exist".
            if error_code(exc) == "ValidationError" and "does not exist" in error_message(exc):
                return None
            raise  # any other error: aws_errors makes it one clear message
    if not found:
        return None
    s = found[0]
    return Stack(
        name=str(s["StackName"]),
        id=str(s["StackId"]),
        status=str(s["StackStatus"]),
        tags={str(t["Key"]): str(t["Value"]) for t in s.get("Tags") or []},
        protected=bool(s.get("EnableTerminationProtection")),
    )


def stack_status(aws: Aws, region: str, name: str) -> str | None:
    """The stack's status (``CREATE_COMPLETE``, ``ROLLBACK_COMPLETE``, ...), or None when no stack has that name."""
    stack = describe_stack(aws, region, name)
    return stack.status if stack is not None else None


def failure_reasons(aws: Aws, region: str, name: str) -> list[str]:
    """Why the stack's resources failed, newest first: the reason of each ``*_FAILED`` event (for a managed node
    group, EKS's health issues: ``[Issue(Code=AsgInstanceLaunchFailures, Message=...)]``); [] when there is no
    such stack. eksctl does not print these for a node group's stack: it only says the waiter failed."""
    import botocore.exceptions

    cfn = aws.client("cloudformation", region)
    with aws_errors(f"reading the events of the CloudFormation stack {name} in {region}"):
        try:
            events = cfn.describe_stack_events(StackName=name)["StackEvents"]
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) == "ValidationError" and "does not exist" in error_message(exc):
                return []
            raise
    return [
        str(e["ResourceStatusReason"])
        for e in events
        if str(e.get("ResourceStatus", "")).endswith("_FAILED") and e.get("ResourceStatusReason")
    ]


def delete_commands(name: str, region: str) -> list[list[str]]:
    """The AWS CLI commands that delete a stack eksctl made: its termination protection off, then the delete.
    CloudFormation refuses the delete alone ("Stack [NAME] cannot be deleted while TerminationProtection is
    enabled")."""
    where = ["--stack-name", name, "--region", region]
    return [
        ["aws", "cloudformation", "update-termination-protection", "--no-enable-termination-protection", *where],
        ["aws", "cloudformation", "delete-stack", *where],
    ]


def delete_hint(name: str, region: str) -> str:
    """How to delete the stack by hand, each command quoted: ``turn its termination protection off with `aws ...`,
    then delete it with `aws ...```."""
    protection, delete = (shlex.join(argv) for argv in delete_commands(name, region))
    return f"turn its termination protection off with `{protection}`, then delete it with `{delete}`"


class NotEksctlStack(UserError):
    """A stack of the cluster's stack name whose tags do not name the cluster: never deleted here."""


def not_made_for(stack: Stack, cluster: str, region: str) -> NotEksctlStack:
    tags = ", ".join(f"{key}={cluster}" for key in CLUSTER_NAME_TAGS)
    return NotEksctlStack(
        f"the CloudFormation stack {stack.name} ({stack.status}) in {region} has none of the tags eksctl gives the "
        f"stacks of cluster {cluster} ({tags}): it was not made for this cluster, and is left as it is",
        hint=f"If nothing uses it, {delete_hint(stack.name, region)}; or choose another cluster.name.",
    )


def delete_eksctl_stack(aws: Aws, region: str, stack: Stack, cluster: str) -> None:
    """Delete a stack eksctl made for ``cluster`` as eksctl does (``DeleteStackBySpec``, pkg/cfn/manager/api.go,
    v0.230.0): its termination protection turned off first, then the delete, both by its ID. CloudFormation deletes
    the stack's resources before it: poll :func:`stack_status` until it is None.

    Raises :class:`NotEksctlStack`, with nothing changed, when the stack's tags do not name ``cluster``."""
    if not stack.made_for(cluster):
        raise not_made_for(stack, cluster, region)
    cfn = aws.client("cloudformation", region)
    if stack.protected:
        with aws_errors(f"turning off the termination protection of the CloudFormation stack {stack.name} in {region}"):
            cfn.update_termination_protection(StackName=stack.id, EnableTerminationProtection=False)
    with aws_errors(f"deleting the CloudFormation stack {stack.name} in {region}"):
        cfn.delete_stack(StackName=stack.id)
