"""raytrain-eks: fine-tune causal LMs with Ray Train + FSDP2 on EKS with EFA, or locally."""

__version__ = "0.1.0"
