"""The steps every target's commands share, each with the programs it runs: the names a target's
``command_steps`` (:class:`~raytrain_eks.deploy.target.ClusterTarget`) gives its steps from.

Every target reaches the cluster through the Kubernetes API (whose credentials come from the program the kubeconfig
names) and installs its add-ons with helm; the EKS target adds the steps that run eksctl
(:mod:`raytrain_eks.eks.programs`, which also checks that the programs of a command's steps are installed).
Example::

    {p for step in ("kubernetes", "helm-releases") for p in STEPS[step].programs}   # {"kubernetes-api", "helm"}
"""

from __future__ import annotations

from dataclasses import dataclass

HELM = "helm"
KUBERNETES = "kubernetes-api"  # not a program: the kubeconfig's credential program


@dataclass(frozen=True)
class Step:
    """What a step does, in words, and the programs it runs."""

    what: str
    programs: tuple[str, ...]


STEPS: dict[str, Step] = {
    "helm-releases": Step("the device plugins and KubeRay (helm get metadata/upgrade/uninstall)", (HELM, KUBERNETES)),
    "kubernetes": Step("the nodes, the Ray pods and jobs (the Kubernetes API)", (KUBERNETES,)),
}

# What down takes to delete each kind of item the state file records on any target.
DELETE_STEPS: dict[str, tuple[str, ...]] = {
    "object": ("kubernetes",),
    "helm": ("helm-releases",),
}
