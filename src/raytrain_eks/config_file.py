"""The commented YAML file ``raytrain-eks init`` writes (every setting, what it does, and its env.sh name), and the
settings as env.sh lines."""

from __future__ import annotations

import yaml

from raytrain_eks.config import Config
from raytrain_eks.config_layers import ENV_VARS

SECTION_HELP = {
    "cluster": "The cluster the job runs on. target eks: the EKS cluster up creates (region, Kubernetes version, the "
    "system node group and the EFA GPU node group); target kubernetes: the cluster of your kubeconfig, as it is.",
    "addons": "Helm chart versions of the add-ons installed into the cluster.",
    "ray": "The RayCluster: one image for head and workers, and the size of each GPU worker pod.",
    "network": "Environment of the Ray workers; it steers NCCL onto EFA (keep NCCL_DEBUG=INFO: it is the evidence).",
    "fabric": "The inter-node network a run must use, checked from NCCL's log lines (efa, ib or any).",
    "training": "The fine-tuning job run by every Ray Train worker.",
}


def commented_yaml(cfg: Config) -> str:
    """The configuration as YAML with a comment on each section and on each non-obvious field."""
    env_names = {v: k for k, v in ENV_VARS.items()}
    lines = [
        "# raytrain-eks configuration. Every later step reads this file.",
        "# Environment variables with the reference's env.sh names override it; command-line flags override both.",
        "# Check the result with: raytrain-eks config show",
        "",
    ]
    data = cfg.model_dump(mode="json")
    if "learning_rate" not in cfg.training.model_fields_set:  # left empty, it stays the method's when that changes
        data["training"]["learning_rate"] = None
    for section, values in data.items():
        lines.append(f"# {SECTION_HELP[section]}")
        lines.append(f"{section}:")
        for field, value in values.items():
            notes = []
            if (section, field) in env_names:
                notes.append(f"env {env_names[(section, field)]}")
            description = type(getattr(cfg, section)).model_fields[field].description
            if description:
                notes.append(description)
            if notes:
                lines.append(f"  # {'; '.join(notes)}")
            dumped = yaml.safe_dump({field: value}, sort_keys=False, default_flow_style=False).rstrip("\n")
            lines.extend(f"  {line}" for line in dumped.splitlines())
        lines.append("")
    return "\n".join(lines)


def env_file_lines(cfg: Config) -> list[str]:
    """The configuration as ``export NAME=value`` lines of the reference's env.sh names."""
    lines = []
    for name, (section, field) in ENV_VARS.items():
        value = getattr(getattr(cfg, section), field)
        lines.append(f"export {name}={'' if value is None else value}")
    return lines
