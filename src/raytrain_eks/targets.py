"""Which package implements each ``cluster.target``: the one place the code every target shares reaches a target's
package.

The neutral code (:mod:`raytrain_eks.deploy`, :mod:`raytrain_eks.k8s`) never imports a target's package; it asks
:func:`implementation` for the target the configuration names and talks to it through its interface
(:class:`raytrain_eks.deploy.target.ClusterTarget`, and the pods' part of it,
:class:`raytrain_eks.k8s.placement.PodPlacement`). The import is by name, when first asked, so the target packages
(which build on the neutral ones) load only when a command needs them. Example::

    implementation(cfg).name   # "eks"
"""

from __future__ import annotations

from importlib import import_module

from raytrain_eks.config import Config

# cluster.target -> (module, class); the config's Literal lists the same names (tests check they agree).
IMPLEMENTATIONS: dict[str, tuple[str, str]] = {
    "eks": ("raytrain_eks.eks.target", "EksTarget"),
    "kubernetes": ("raytrain_eks.kubernetes.target", "KubernetesTarget"),
}


def implementation(cfg: Config) -> object:
    """A new instance of the class implementing ``cfg.cluster.target`` (validated by the config: one of
    :data:`IMPLEMENTATIONS`)."""
    module, name = IMPLEMENTATIONS[cfg.cluster.target]
    return getattr(import_module(module), name)()
