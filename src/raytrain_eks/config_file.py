"""The commented YAML file ``raytrain-eks init`` writes: every setting, what it does, and its env.sh name."""

from __future__ import annotations

import yaml

from raytrain_eks.config import ENV_VARS, Config

SECTION_HELP = {
    "cluster": "The EKS cluster: region, Kubernetes version, the system node group and the EFA GPU node group.",
    "addons": "Helm chart versions of the add-ons installed into the cluster.",
    "ray": "The RayCluster: one image for head and workers, and the size of each GPU worker pod.",
    "network": "Environment of the Ray workers; it steers NCCL onto EFA (keep NCCL_DEBUG=INFO: it is the evidence).",
    "fabric": "The inter-node network a run must use, checked from NCCL's log lines (efa, ib or any).",
    "training": "The fine-tuning job run by every Ray Train worker.",
}

FIELD_HELP = {
    ("cluster", "gpu_az"): "one availability zone for every GPU node (EFA cannot cross zones); empty = pick at deploy",
    ("cluster", "capacity_reservation_id"): "an existing on-demand capacity reservation (cr-...) for the GPU nodes; "
    "its zone becomes the GPU zone; empty = up still uses one that holds every node in the zone it picks",
    ("cluster", "gpus_per_node"): "also Ray's num-gpus and the pod's nvidia.com/gpu request (never typed twice)",
    ("ray", "image"): "pin a tag or a digest (@sha256:...), or follow a moving tag",
    ("cluster", "availability_zones"): "the cluster's subnet zones (2 or more, gpu_az among them); empty = at deploy",
    ("cluster", "ami_family"): "node image, one of eksctl's Linux families; AmazonLinux2023 carries the NVIDIA and "
    "EFA drivers on GPU instances (AmazonLinux2 only up to Kubernetes 1.32)",
    ("fabric", "compare_steps"): "compare-fabric: steps of each of its two runs; empty = training.steps",
    ("fabric", "compare_warmup_steps"): "compare-fabric: first steps of each run left out of the timing",
    ("cluster", "gpu_volume_gib"): "root volume of each GPU node, GiB (the image alone is tens of GB)",
    ("ray", "worker_cpu"): "CPU request = limit of each GPU worker pod (Guaranteed QoS); empty = 5/6 of the instance",
    ("ray", "worker_memory_gib"): "memory request = limit of each GPU worker pod, GiB; empty = 5/6 of the instance",
    ("ray", "hf_token_secret"): "Kubernetes Secret that holds HF_TOKEN (created from your environment, never written)",
    ("ray", "job_deadline_s"): "--mode rayjob: the job is stopped and its GPU pods removed after this many seconds",
    ("ray", "job_start_deadline_s"): "--mode rayjob: give up if the job is not running after this many seconds",
    ("training", "model_id"): "Hugging Face hub id, a save_pretrained folder, or builtin:tiny-qwen2",
    (
        "training",
        "data",
    ): "'random' (synthetic ids), builtin:sample-instructions, or JSONL/JSON/Parquet path or s3:// URI",
    ("training", "data_format"): "text | instruction (instruction/input/output) | chat (messages with role/content)",
    ("training", "text_field"): "the field read by the text format",
    ("training", "batch_size"): "packed samples per worker per micro-batch",
    ("training", "num_workers"): "training workers; 0 = one per GPU in the cluster (2 CPU workers locally)",
    (
        "training",
        "precision",
    ): "auto (bf16 where the GPU or CPU does bf16 natively, else fp32), bf16 (bf16 compute, fp32 gradient "
    "reduction) or fp32",
    ("training", "warmup_steps"): "linear warm-up before the cosine decay; empty = 5% of the steps",
    ("training", "log_every"): "steps between metric records sent to the driver",
    (
        "training",
        "checkpoint_every",
    ): "steps between sharded checkpoints (one is always written at the end); 0 = end only",
    (
        "training",
        "keep_checkpoints",
    ): "newest checkpoints kept (at least 2: one is always complete while the next is written)",
    ("training", "max_failures"): "worker-group restarts (from the last checkpoint) before the run fails",
    ("training", "export"): "write the trained model in Hugging Face format to RUN_DIR/model at the end",
    ("training", "storage_path"): "checkpoints: a folder every node reaches or s3://bucket/prefix; empty = run folder",
    (
        "training",
        "storage_shared",
    ): "true: storage_path is a folder every node mounts (required for a local path when workers span nodes)",
    ("training", "output_dir"): "run folder; empty = runs/<time>-<model>",
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
    for section, values in data.items():
        lines.append(f"# {SECTION_HELP[section]}")
        lines.append(f"{section}:")
        for field, value in values.items():
            notes = []
            if (section, field) in env_names:
                notes.append(f"env {env_names[(section, field)]}")
            if (section, field) in FIELD_HELP:
                notes.append(FIELD_HELP[(section, field)])
            if notes:
                lines.append(f"  # {'; '.join(notes)}")
            dumped = yaml.safe_dump({field: value}, sort_keys=False, default_flow_style=False).rstrip("\n")
            lines.extend(f"  {line}" for line in dumped.splitlines())
        lines.append("")
    return "\n".join(lines)
