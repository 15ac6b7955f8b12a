"""The ``eks`` cluster target: the EKS cluster ``up`` creates with eksctl, and everything that creates, uses and
removes it.

Modules, along the seams of the work: ``target`` (``EksTarget``, its
:class:`~raytrain_eks.deploy.target.ClusterTarget`), ``nodegroups`` (zones, the cluster and its node groups through
eksctl), ``lifecycle`` (up, down, status), ``irsa`` (the Ray pods' IAM role), ``buckets`` (the checkpoint bucket),
``plan`` and ``pricing`` (its written plan and what it costs) and ``programs`` (eksctl's steps, and the check that a
command's programs are installed). What both targets use (the plan's shared parts, submit, the commands) is
:mod:`raytrain_eks.deploy`'s.
"""
