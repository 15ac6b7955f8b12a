"""Have the GPU node group replace a node's instance: the node that failed ``raytrain-eks check`` is terminated through
its Auto Scaling group (an eksctl managed node group is one) without lowering the desired capacity, so the group
launches a fresh instance in its place. Example::

    replace_instance(d, "ip-10-0-1-5.us-west-2.compute.internal")  # "asked the node group to replace i-0abc..."
"""

from __future__ import annotations

from raytrain_eks.aws.session import Aws, aws_errors, connect
from raytrain_eks.k8s.state import Deployment


def instance_of(provider_id: str) -> str | None:
    """The EC2 instance id of a node's ``spec.providerID`` (the AWS cloud provider writes
    ``aws:///<zone>/<instance id>``), or ``None`` when it names none."""
    if not provider_id.startswith("aws://"):
        return None
    last = provider_id.rstrip("/").rsplit("/", 1)[-1]
    return last if last.startswith("i-") else None


def replace_instance(d: Deployment, node: str, aws: Aws | None = None) -> str:
    """Terminate ``node``'s instance through its Auto Scaling group, keeping the desired capacity, so the group
    starts a new instance; returns what was done, as a line to show."""
    obj = d.kube.get("v1", "Node", node) or {}
    instance = instance_of(str(obj.get("spec", {}).get("providerID", "")))
    if instance is None:
        return f"node {node} names no EC2 instance (spec.providerID): it was cordoned, not replaced"
    region = d.cfg.cluster.region
    client = (aws or connect(region)).client("autoscaling", region)
    with aws_errors(f"asking the node group to replace instance {instance} of node {node}"):
        client.terminate_instance_in_auto_scaling_group(InstanceId=instance, ShouldDecrementDesiredCapacity=False)
    return f"asked the node group to replace instance {instance} of node {node}: it launches a new one in its place"
