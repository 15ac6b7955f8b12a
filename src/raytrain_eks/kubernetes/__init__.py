"""The ``kubernetes`` cluster target: an existing cluster of the user's kubeconfig, used as it is.

Modules: ``target`` (``KubernetesTarget``, its :class:`~raytrain_eks.deploy.target.ClusterTarget`), ``existing``
(what ``up``, ``down`` and ``status`` do there: find the GPU nodes, install only what is missing) and ``plan`` (its
written plan). What both targets use is :mod:`raytrain_eks.deploy`'s.
"""
