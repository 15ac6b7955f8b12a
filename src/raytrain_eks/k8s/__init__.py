"""Kubernetes side of raytrain-eks: manifests as plain dicts (pure functions of the config).

Example::

    from raytrain_eks.k8s.manifests import raycluster
    doc = raycluster(cfg)
"""
