"""The CloudFormation stack eksctl keeps a cluster in, read and deleted through boto3.

eksctl builds the cluster's VPC, subnets, NAT gateway and control plane as the stack ``eksctl-<name>-cluster``
(eksctl v0.230.0, ``pkg/cfn/manager``: ``MakeClusterStackName``). A failed ``eksctl create cluster`` leaves that
stack behind, rolled back (``ROLLBACK_COMPLETE``) or failed, while EKS has no cluster; the next create then fails on
the stack's name. :func:`stale_stack` tells such a stack from one in use or in progress. Example::

    aws = connect("us-east-1")
    status = stack_status(aws, "us-east-1", cluster_stack_name("ray-train-eks"))  # None: no such stack
    if stale_stack(status):
        delete_stack(aws, "us-east-1", cluster_stack_name("ray-train-eks"))       # then poll stack_status
"""

from __future__ import annotations

from raytrain_eks.aws.session import Aws, aws_errors, error_code, error_message

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


def stack_status(aws: Aws, region: str, name: str) -> str | None:
    """The stack's status (``CREATE_COMPLETE``, ``ROLLBACK_COMPLETE``, ...), or None when no stack has that name
    (a deleted stack is not found by name)."""
    import botocore.exceptions

    cfn = aws.client("cloudformation", region)
    with aws_errors(f"reading the CloudFormation stack {name} in {region}"):
        try:
            stacks = cfn.describe_stacks(StackName=name)["Stacks"]
        except botocore.exceptions.ClientError as exc:
            # CloudFormation's answer for a name it does not know: ValidationError "Stack with id X does not exist".
            if error_code(exc) == "ValidationError" and "does not exist" in error_message(exc):
                return None
            raise  # any other error: aws_errors makes it one clear message
    return str(stacks[0]["StackStatus"]) if stacks else None


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


def delete_stack(aws: Aws, region: str, name: str) -> None:
    """Ask CloudFormation to delete the stack (its resources first); poll :func:`stack_status` until it is gone."""
    cfn = aws.client("cloudformation", region)
    with aws_errors(f"deleting the CloudFormation stack {name} in {region}"):
        cfn.delete_stack(StackName=name)
