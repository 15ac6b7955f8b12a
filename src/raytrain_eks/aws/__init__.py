"""AWS side of raytrain-eks: the eksctl ClusterConfig (a pure function of the config).

Example::

    from raytrain_eks.aws.eksctl import cluster_config, planned_zones
    doc = cluster_config(cfg, planned_zones(cfg))
"""
