"""The Kubernetes layer every cluster target shares: manifests as plain dicts (pure functions of the config), the
Kubernetes API client, the state file and the ``Deployment`` every step works on, helm and the add-ons, and where
the Ray pods go (``placement``, which the target answers). It knows no target: a difference between targets is asked
of the target (:mod:`raytrain_eks.targets`).

Example::

    from raytrain_eks.k8s.manifests import raycluster
    doc = raycluster(cfg)
"""
