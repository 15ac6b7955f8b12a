"""The EKS path: everything that creates, uses and removes the cluster.

Modules, along the seams of the work: ``state`` (what was created, remembered on disk), ``nodegroups`` (zones, the
cluster and its node groups through eksctl), ``addons`` (Helm releases and their readiness checks), ``lifecycle``
(up, down, status), ``submit`` (shipping the code and running the job on the RayCluster), ``plan`` and
``pricing`` (the written plan and what it costs), ``compare`` (the EFA-versus-TCP comparison), ``commands`` (the
CLI commands), ``runner`` (eksctl and helm as child processes) and ``wait`` (polling with a deadline).
"""
