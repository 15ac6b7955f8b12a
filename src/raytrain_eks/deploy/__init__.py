"""What both cluster targets use: the :class:`~raytrain_eks.deploy.target.ClusterTarget` interface and
:func:`~raytrain_eks.deploy.target.target_for`, the plan's shared parts, submit and its evidence, ``submit
--offline``, the memory fit, ``compare-fabric``, ``results`` and the deploy commands of the CLI.

Nothing here imports a target's package: what differs between targets is asked of the target ``target_for``
returns (the registry :mod:`raytrain_eks.targets` imports it by name).
"""
