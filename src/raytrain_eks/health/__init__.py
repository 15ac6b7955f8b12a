"""Whether a GPU node is fit for a long run: the parsers of what its tools print (:mod:`.parsers`) and the checks of
one node, run in a pod on it (:mod:`.node`). ``raytrain-eks check`` and ``submit`` run them in the Ray worker pods
(:mod:`raytrain_eks.deploy.checks`)."""
