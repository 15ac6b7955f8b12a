"""AWS side of raytrain-eks: the eksctl ClusterConfig (:mod:`.eksctl`, a pure function of the config), the
``capacity`` check (:mod:`.capacity`, its command in :mod:`.commands`), the boto3 reads and interfaces behind it
(:mod:`.services`, faked in :mod:`.fakes`) and sessions with one clear message per AWS error (:mod:`.session`).

Example::

    from raytrain_eks.aws.eksctl import cluster_config, planned_zones
    doc = cluster_config(cfg, planned_zones(cfg))
"""
