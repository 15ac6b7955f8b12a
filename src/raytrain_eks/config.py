"""One typed configuration for every step: cluster, add-ons, Ray, network environment and training.

Layers, lowest first: a named preset (:mod:`raytrain_eks.presets`), the YAML file, environment variables with
the reference's names (``STEPS=20``), then command-line flags. The merged result is validated once; every
problem is reported together as a :class:`~raytrain_eks.errors.ConfigError` naming the field, the bad value,
where it came from and what is allowed. Example::

    cfg = load_config(preset=presets.local_tiny(), path=None, environ={"STEPS": "20"})
    cfg.training.steps  # 20
    cfg.derived.world_size
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from raytrain_eks import config_layers as layers
from raytrain_eks.config_cluster import ClusterConfig
from raytrain_eks.config_fields import DELIMITER, DNS_LABEL, IMAGE, VERSION, Section, check, check_optional
from raytrain_eks.errors import ConfigError
from raytrain_eks.formats import FORMAT_NAMES, data_format, formats_help

DEFAULT_CONFIG_FILE = "raytrain-eks.yaml"

BUILTIN_MODEL = "builtin:tiny-qwen2"
DEFAULT_BATCH_SIZE = 2  # training.batch_size, and what auto is where no GPU's memory is estimated
BUILTIN_DATA = "builtin:sample-instructions"
BUILTIN_PREFERENCES = "builtin:sample-preferences"  # the data of method dpo when none is set
RANDOM_DATA = "random"


class AddonsConfig(Section):
    """Pinned versions of the cluster add-ons (Helm chart versions)."""

    kuberay_version: str = "1.7.0"
    nvidia_device_plugin_version: str = "0.20.0"
    efa_device_plugin_version: str = "v0.5.30"

    @field_validator("*")
    @classmethod
    def _ver(cls, v: str) -> str:
        return check(VERSION, v, "a release version such as 1.7.0 or v0.5.30")


class RayConfig(Section):
    """The RayCluster: image (unchanged for head and workers), Ray version, namespace and worker pod size."""

    image: str = Field(
        "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1",
        description="pin a tag or a digest (@sha256:...), or follow a moving tag",
    )
    version: str = "2.58.0"
    namespace: str = "default"
    cluster_name: str = "ray-train"
    worker_cpu: int | None = Field(
        None,
        ge=1,
        description="CPU request = limit of each GPU worker pod (Guaranteed QoS); empty = 5/6 of the instance",
    )
    worker_memory_gib: int | None = Field(
        None, ge=1, description="memory request = limit of each GPU worker pod, GiB; empty = 5/6 of the instance"
    )
    head_cpu: int | None = Field(None, ge=1, description="CPU of the Ray head pod; empty = of the system node (eks), 2")
    head_memory_gib: int | None = Field(
        None, ge=1, description="memory of the Ray head pod, GiB; empty = of the system node (eks), 8"
    )
    shared_volume: str | None = Field(
        None,
        description=(
            "a ReadWriteMany PersistentVolumeClaim of ray.namespace (EFS, FSx for Lustre, NFS) mounted into every "
            "Ray pod; the checkpoints go there unless training.storage_path says otherwise"
        ),
    )
    shared_volume_path: str = Field("/mnt/shared", description="where every Ray pod mounts ray.shared_volume")
    offline: bool = Field(
        False, description="submit --offline: the job's packages from a wheelhouse in storage, no package index"
    )
    hf_token_secret: str = Field(
        "hf-token", description="Kubernetes Secret that holds HF_TOKEN (created from your environment, never written)"
    )
    job_deadline_s: int = Field(
        4 * 3600,
        ge=60,
        description=(
            "seconds the job may run: submit stops following it then; --mode rayjob: KubeRay also stops it "
            "and removes its GPU pods"
        ),
    )
    job_start_deadline_s: int = Field(
        1800,
        ge=60,
        description=(
            "seconds for the Ray pods to run (and for a deleted RayCluster's pods to go); --mode rayjob: "
            "KubeRay gives up on a job not running by then"
        ),
    )

    @field_validator("shared_volume")
    @classmethod
    def _claim(cls, v: str | None) -> str | None:
        return check_optional(DNS_LABEL, v, "a PersistentVolumeClaim name: lowercase letters, digits and '-'")

    @field_validator("shared_volume_path")
    @classmethod
    def _mount(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") in ("", "/tmp", "/dev", "/etc", "/proc", "/sys"):
            raise ValueError(f"{v!r}: give an absolute folder of its own, such as /mnt/shared")
        return v.rstrip("/")

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        return check(IMAGE, v, "REGISTRY/REPOSITORY:TAG or REGISTRY/REPOSITORY@sha256:DIGEST")

    @field_validator("version")
    @classmethod
    def _ver(cls, v: str) -> str:
        return check(VERSION, v, "a Ray release such as 2.58.0")

    @field_validator("namespace", "cluster_name", "hf_token_secret")
    @classmethod
    def _dns(cls, v: str) -> str:
        if len(v) > 63:
            raise ValueError("at most 63 characters")
        return check(DNS_LABEL, v, "lower-case letters, digits and '-', starting and ending with a letter or digit")


def _reference_network_env() -> dict[str, str]:
    return {"FI_PROVIDER": "efa", "NCCL_NET_PLUGIN": "ofi", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO"}


class NetworkConfig(Section):
    """Environment of the Ray workers that steers NCCL onto EFA."""

    env: dict[str, str] = Field(default_factory=_reference_network_env)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k)]
        if bad:
            raise ValueError(f"not environment variable names: {', '.join(bad)}")
        return v


def is_remote_storage(path: str | None) -> bool:
    """Whether ``path`` is a URI of storage outside every node (``s3://bucket/prefix``, ``gs://...``)."""
    return bool(path) and "://" in str(path) and not str(path).startswith("file://")


def check_storage_for_nodes(training: TrainingConfig, nodes: int, *, counted: str) -> None:
    """Raise :class:`ConfigError` when the workers span ``nodes`` > 1 and the checkpoints would stay on one disk.

    Ray Train writes every rank's checkpoint files, and the driver reads them back, through
    ``training.storage_path``: with workers on several nodes it must be storage all of them reach. ``counted``
    says where ``nodes`` came from, for the message. Example::

        check_storage_for_nodes(cfg.training, 2, counted="alive Ray nodes that can host a worker")
    """
    if nodes <= 1 or training.storage_reaches_every_node:
        return
    value = training.storage_path
    where = "the run folder on the driver's node" if not value else "a folder on each node's own disk"
    raise ConfigError(
        [
            f"training.storage_path = {value!r}: the training workers span {nodes} nodes ({counted}), so the "
            f"checkpoints would go to {where}, which the other nodes cannot read. Set training.storage_path to "
            "s3://BUCKET/PREFIX (--storage-path or STORAGE_PATH), or to a folder every node mounts together "
            "with training.storage_shared: true (--storage-shared or STORAGE_SHARED=true)"
        ]
    )


def check_sharding_for_nodes(training: TrainingConfig, nodes: int, workers: int | None, *, counted: str) -> None:
    """Raise :class:`ConfigError` when ``training.sharding`` cannot be had on ``nodes`` nodes with ``workers``
    workers (``None``: not known yet). ``counted`` says where ``nodes`` came from, for the message. The workers
    check again once they know where each of them runs (train/sharding.py). Example::

        check_sharding_for_nodes(cfg.training, 1, 2, counted="a local run: one node")
    """
    if training.sharding == "hsdp" and nodes <= 1:
        raise ConfigError(
            [
                f"training.sharding = 'hsdp' replicates across nodes, but the workers have {nodes} node ({counted}): "
                "set training.sharding to auto or fsdp (--sharding)"
            ]
        )
    if training.sharding == "none" and workers is not None and workers > 1:
        raise ConfigError(
            [
                f"training.sharding = 'none' needs a single worker, but the run has {workers}: set "
                "training.sharding to auto (--sharding), or training.num_workers to 1 (--num-workers)"
            ]
        )


PACKING_MODES = ("documents", "concat")  # whole rows kept apart in a block (their own positions), or run on as one text
OVERLONG_MODES = ("truncate", "drop")  # a row longer than seq_len under documents packing: its start kept, or left out
# The peak learning rate of a method when none is set: full fine-tuning moves every weight a little; LoRA's few adapters
# start at zero and take about ten times more (peft's and TRL's LoRA recipes use 1e-4 to 3e-4). DPO steps away from a
# reference it must stay near, so it takes a quarter of SFT's rate (TRL's DPOConfig defaults to 1e-6), with LoRA ten
# times that again. Keyed by :attr:`TrainingConfig.recipe`.
DEFAULT_LEARNING_RATES = {"full": 2e-5, "lora": 2e-4, "dpo": 5e-6, "dpo-lora": 5e-5}
_RECIPE_NAMES = {
    "full": "full fine-tuning's",
    "lora": "LoRA's",
    "dpo": "full DPO's",
    "dpo-lora": "DPO with LoRA's",
}
_RECIPE_OTHER = {"full": "lora", "lora": "full", "dpo": "dpo-lora", "dpo-lora": "dpo"}
_RECIPE_WORDS = {"full": "full", "lora": "lora", "dpo": "dpo with adapters none", "dpo-lora": "dpo with adapters lora"}
PREFERENCE_FORMAT = "preference"  # the one data format whose rows are pairs (chosen and rejected), read by method dpo
LORA_ALL_LINEAR: Literal["all-linear"] = "all-linear"  # peft's name for every linear layer of the decoder blocks
FLASH_ATTN_MIN = "2.3.3"  # the oldest flash-attn 2 transformers' is_flash_attn_2_available accepts


class LoraSettings(Section):
    """Low-rank adapters (peft's LoRA) trained on a frozen base model (``training.method: lora``)."""

    rank: int = Field(16, ge=1, le=4096, description="the adapters' rank r")
    alpha: float = Field(32, gt=0, description="scale of the adapters' output: alpha / rank")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapters' input while training")
    target_modules: list[str] | Literal["all-linear"] = Field(
        LORA_ALL_LINEAR,
        description="linear layers of the decoder blocks that get adapters, by name (q_proj, v_proj, ...); "
        "all-linear = every one of them",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_name(cls, v: Any) -> Any:
        """One layer's name (``target_modules: q_proj``) is the list of that one: ``[q_proj]``."""
        if isinstance(v, str) and v != LORA_ALL_LINEAR:
            return [v]
        if not isinstance(v, str | list):
            raise ValueError("give a layer's name (q_proj), a list of them ([q_proj, v_proj]) or all-linear")
        bad = [n for n in v if not isinstance(n, str)]
        if bad:
            raise ValueError(f"{', '.join(repr(n) for n in bad)}: a layer's name, such as q_proj")
        return v

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list):
            if not v:
                raise ValueError("name at least one linear layer, or all-linear")
            bad = [n for n in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)]
            if bad:
                raise ValueError(f"{', '.join(repr(n) for n in bad)}: a layer's name, such as q_proj")
        return v


class DpoSettings(Section):
    """Direct preference optimisation (``training.method: dpo``): the policy learns to rank each pair's chosen answer
    above its rejected one, measured against a reference model. Read only by method dpo (ignored otherwise)."""

    beta: float = Field(
        0.1, gt=0, description="how far the policy may move from the reference: the scale of the implicit reward"
    )
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="sigmoid (DPO's loss, -log sigmoid of beta x the margin) or ipo (IPO's squared loss)"
    )
    adapters: Literal["lora", "none"] = Field(
        "lora",
        description="lora: training.lora's adapters train and the reference is the same model with them off (no "
        "second copy); none: every weight trains and the reference is a frozen copy of the start weights, sharded "
        "like the model (its memory counted by the estimate)",
    )


def _recipe(method: str, dpo: DpoSettings) -> str:
    """The key of :data:`DEFAULT_LEARNING_RATES` of a method (and, for dpo, its adapters)."""
    return "dpo-lora" if method == "dpo" and dpo.adapters == "lora" else method


class TrainingConfig(Section):
    """The fine-tuning job run by every Ray Train worker."""

    model_id: str = Field(
        "Qwen/Qwen2.5-1.5B", description="Hugging Face hub id, a save_pretrained folder, or builtin:tiny-qwen2"
    )
    data: str = Field(
        RANDOM_DATA,
        description="'random' (synthetic ids), builtin:sample-instructions, builtin:sample-preferences, a .jsonl/"
        ".ndjson/.json/.parquet/.csv/.tsv/.arrow file or folder or s3:// URI, or a Hugging Face dataset: "
        "hf:OWNER/NAME[:SPLIT]; empty with method dpo = builtin:sample-preferences",
    )
    data_format: Literal[FORMAT_NAMES] = Field(  # type: ignore[valid-type]  # the registry's names
        "instruction",
        description=" | ".join(FORMAT_NAMES)
        + " (raytrain_eks.formats: "
        + formats_help()
        + "); empty with method dpo = preference, the only format dpo reads",
    )
    text_field: str = Field("text", description="the field read by the text format")
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template used instead of the tokenizer's (for a base model without one): a .jinja "
        "file, or the template itself",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="the format's fields read from other columns of the data, e.g. {instruction: question, "
        "output: answer}",
    )
    csv_delimiter: str = Field(",", description="the character between the fields of .csv files (.tsv: a tab)")
    packing: Literal[PACKING_MODES] = Field(  # type: ignore[valid-type]
        "documents",
        description="documents: whole rows are packed into blocks (best fit, longest first), each kept apart (its own "
        "positions, no attention across rows, no loss on its first token), the rest of a block padding; concat: rows "
        "run on as one text and are cut every seq_len tokens, for pre-training text only",
    )
    overlong: Literal[OVERLONG_MODES] = Field(  # type: ignore[valid-type]
        "truncate",
        description="a row longer than seq_len under documents packing: truncate (keep its first seq_len tokens) or "
        "drop it; either way counted and reported (method dpo: a pair is always dropped, never cut)",
    )
    method: Literal["full", "lora", "dpo"] = Field(
        "full",
        description="full: every weight trains; lora: low-rank adapters (training.lora) on the frozen base model; "
        "dpo: direct preference optimisation on preference pairs (training.dpo)",
    )
    lora: LoraSettings = Field(
        default_factory=LoraSettings, description="the adapters of method lora, and of dpo with dpo.adapters lora"
    )
    dpo: DpoSettings = Field(default_factory=DpoSettings, description="the settings of method dpo")
    steps: int = Field(100, ge=1)
    seq_len: int = Field(1024, ge=8, le=131072)
    batch_size: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        DEFAULT_BATCH_SIZE,
        description="packed samples per worker per micro-batch; auto = on GPUs the largest micro-batch the memory "
        f"estimate admits, up to {DEFAULT_BATCH_SIZE} x grad_accum_steps (the samples a step trains per worker, kept "
        f"by fewer accumulation steps); {DEFAULT_BATCH_SIZE} on a local run",
    )
    grad_accum_steps: int = Field(1, ge=1, le=1024)
    learning_rate: float = Field(
        default_factory=lambda data: DEFAULT_LEARNING_RATES[_recipe(data["method"], data["dpo"])],
        gt=0,
        le=1,
        description="peak learning rate; empty = the method's default: "
        + ", ".join(f"{rate!r} for {_RECIPE_WORDS[recipe]}" for recipe, rate in DEFAULT_LEARNING_RATES.items()),
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int | None = Field(
        None, ge=0, description="linear warm-up before the cosine decay; empty = 5% of the steps"
    )
    weight_decay: float = Field(0.01, ge=0, le=1)
    max_grad_norm: float = Field(1.0, gt=0)
    num_workers: int = Field(
        0, ge=0, le=4096, description="training workers; 0 = one per GPU in the cluster (2 CPU workers locally)"
    )
    # auto: bf16 where the device multiplies bf16 natively, else fp32 (resolved by the workers, train/precision.py)
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description=(
            "auto (bf16 where the GPU or CPU does bf16 natively, else fp32), bf16 (bf16 compute, fp32 "
            "gradient reduction) or fp32"
        ),
    )
    # Chosen by the workers from the nodes they run on (train/sharding.py); the run's output and summary say which.
    sharding: Literal["auto", "fsdp", "hsdp", "none"] = Field(
        "auto",
        description=(
            "auto (hsdp when the workers span several nodes, fsdp on one node, none for one fp32 worker), fsdp "
            "(one flat group), hsdp (shard inside a node, replicate across nodes) or none"
        ),
    )
    reduce_precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="dtype gradients are reduced in across ranks; bf16 halves those bytes but rounds the gradients "
        "(in fp32 runs too)",
    )
    activation_checkpointing: bool = False
    attention: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field(
        "auto",
        description="auto (flash_attention_2 on a bf16 CUDA run where flash-attn is installed and the model takes it, "
        "else sdpa), sdpa, flash_attention_2 (refused where it cannot run) or eager",
    )
    compile: layers.CompileSetting = Field(
        "auto",
        description="auto (on CUDA GPUs, not on CPUs, decided by the workers), on or off: compile each decoder layer "
        "with torch.compile before sharding; the first step takes longer while it compiles (summary: first_step_s)",
    )
    loss_kernel: Literal["auto", "fused", "chunked", "plain"] = Field(
        "auto",
        description="auto (fused on CUDA GPUs where Liger-Kernel or cut-cross-entropy is installed and computes the "
        "model's own loss, else plain where the full logits fit the memory estimate, else chunked), fused, chunked "
        "(a chunk of tokens' logits at a time) or plain (the full logits at once)",
    )
    seed: int = Field(0, ge=0)
    log_every: int = Field(10, ge=1, description="steps between metric records sent to the driver")
    checkpoint_every: int = Field(
        50, ge=0, description="steps between sharded checkpoints (one is always written at the end); 0 = end only"
    )
    keep_checkpoints: int = Field(
        2, ge=2, description="newest checkpoints kept (at least 2: one is always complete while the next is written)"
    )
    max_failures: int = Field(
        3, ge=0, description="worker-group restarts (from the last checkpoint) before the run fails"
    )
    export: bool = Field(True, description="write the trained model in Hugging Face format to RUN_DIR/model at the end")
    watchdog: bool = Field(
        True, description="end a run no rank advances in (Ray): name the rank and host, keep stacks in RUN_DIR/watchdog"
    )
    watchdog_factor: float = Field(
        10, gt=1, description="the watchdog acts after this many median step times without a step on any rank..."
    )
    watchdog_floor_s: float = Field(
        120, gt=0, description="...and never sooner than this (longer than a checkpoint or an evaluation takes)"
    )
    straggler_margin: float = Field(
        1.3, gt=1, description="a rank whose own work (its optimizer step) takes this many times the ranks' median..."
    )
    straggler_steps: int = Field(5, ge=1, description="...for this many steps in a row is named as a straggler")
    notice_poll_s: float = Field(
        5, gt=0, description="seconds between looks for a spot interruption notice (where instance metadata answers)"
    )
    on_rebalance: Literal["checkpoint", "ignore"] = Field(
        "checkpoint", description="an EC2 rebalance recommendation: checkpoint at once (and train on), or ignore it"
    )
    stop_at: datetime | None = Field(
        None,
        description="a time (UTC) by which the run checkpoints and ends as preempted; on EKS, submit sets a Capacity "
        "Block's drain time",
    )
    storage_path: str | None = Field(
        None, description="checkpoints: a folder every node reaches or s3://bucket/prefix; empty = run folder"
    )
    storage_shared: bool = Field(
        False,
        description="true: storage_path is a folder every node mounts (NFS, EFS, FSx); needed for a local path on "
        "more than one node",
    )
    output_dir: str | None = Field(None, description="run folder; empty = runs/<time>-<model>")
    eval_fraction: float | None = Field(
        None, ge=0, lt=1, description="share of the rows held out (seeded) for evaluation; empty = 0.05 of real data"
    )
    eval_data: str | None = Field(None, description="a separate evaluation file or folder in the data's format")
    eval_every: int = Field(
        50, ge=0, description="steps between evaluations (one is always run at the end); 0 = end only"
    )
    sample_prompts: list[str] | None = Field(
        None,
        description="prompts answered greedily at the end (RUN_DIR/samples.jsonl); empty = the data's first prompts",
    )
    sample_tokens: int = Field(32, ge=0, le=1024, description="new tokens per sample; 0 = no samples")
    eval_tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks scored on the exported model at the end (RUN_DIR/eval.json, as "
        "`raytrain-eks eval` does); empty = none",
    )

    @field_validator("model_id", "data", "text_field")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("stop_at")
    @classmethod
    def _utc(cls, v: datetime | None) -> datetime | None:
        """A time without a zone is read as UTC (the zone every time this tool prints is in)."""
        return v.replace(tzinfo=UTC) if v is not None and v.tzinfo is None else v

    @field_validator("csv_delimiter")
    @classmethod
    def _delimiter(cls, v: str) -> str:
        allowed = """one ASCII character, not '"' or a line break; quote it in YAML: ';', '|', "\\t" (a tab)"""
        return check(DELIMITER, v, allowed)

    @model_validator(mode="before")
    @classmethod
    def _preference_data(cls, data: Any) -> Any:
        """Method dpo reads preference pairs: with no data or format set, the built-in pairs in that format."""
        if isinstance(data, dict) and data.get("method") == "dpo":
            return {"data": BUILTIN_PREFERENCES, "data_format": PREFERENCE_FORMAT, **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _empty_learning_rate(cls, data: Any) -> Any:
        """An empty learning_rate (``learning_rate:`` in the file, ``LEARNING_RATE=``) is not set: the method's."""
        if isinstance(data, dict) and data.get("learning_rate") in (None, ""):
            return {k: v for k, v in data.items() if k != "learning_rate"}
        return data

    @model_validator(mode="after")
    def _warmup(self) -> TrainingConfig:
        if self.warmup_steps is not None and self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must not exceed steps ({self.steps})")
        if self.eval_data and self.eval_fraction:
            raise ValueError("set eval_data (a separate file) or eval_fraction (a share of data), not both")
        if self.eval_data and self.uses_random_data:
            raise ValueError("eval_data needs real training data; random token ids have nothing to compare it with")
        if self.eval_tasks and not self.export:
            raise ValueError("eval_tasks score the exported model: set export to true, or leave eval_tasks empty")
        return self

    @model_validator(mode="after")
    def _dpo_reads_pairs(self) -> TrainingConfig:
        """Method dpo's data: preference pairs, packed as documents; every problem of it in one message."""
        if self.method != "dpo":
            return self
        problems = []
        if self.data_format != PREFERENCE_FORMAT:
            problems.append(
                f"data_format is {self.data_format!r}: set data_format to {PREFERENCE_FORMAT} (--data-format "
                f"{PREFERENCE_FORMAT}; rows of prompt, chosen and rejected), or use method full or lora"
            )
        if self.packing != "documents":
            problems.append(
                f"packing is {self.packing!r}, but each pair's answers are packed as two documents side by side: set "
                "packing to documents, or leave it out"
            )
        if self.uses_random_data:
            problems.append(
                f"data is random token ids, which hold no pairs: set data to {BUILTIN_PREFERENCES} or a file of "
                "prompt, chosen and rejected rows (--data)"
            )
        if problems:
            raise ValueError("method dpo trains on preference pairs, but " + "; and ".join(problems))
        return self

    @model_validator(mode="after")
    def _sharding_fits_the_workers(self) -> TrainingConfig:
        if self.sharding == "none" and self.num_workers > 1:
            raise ValueError(
                f"sharding 'none' needs a single worker, not num_workers = {self.num_workers}: set sharding to auto "
                "(or fsdp/hsdp), or num_workers to 1"
            )
        if self.sharding == "hsdp" and self.num_workers == 1:
            raise ValueError("sharding 'hsdp' replicates across nodes, but num_workers = 1: use auto or fsdp")
        return self

    @model_validator(mode="after")
    def _columns_name_the_formats_fields(self) -> TrainingConfig:
        fields = data_format(self.data_format).fields
        if self.data_format == "text":
            fields = (self.text_field,)
        unknown = [k for k in self.columns if k not in fields]
        if unknown:
            raise ValueError(
                f"columns maps {', '.join(repr(k) for k in unknown)}, which the {self.data_format} format does not "
                f"read: its fields are {', '.join(fields)} (columns: {{format field: your column}})"
            )
        bad = [k for k, v in self.columns.items() if not isinstance(v, str) or not v]
        if bad:
            raise ValueError(f"columns: the column for {', '.join(bad)} must be a non-empty name")
        return self

    @model_validator(mode="after")
    def _shared_needs_a_path(self) -> TrainingConfig:
        if self.storage_shared and not self.storage_path:
            raise ValueError(
                "storage_shared is true but storage_path is empty: set storage_path to the folder every node mounts"
            )
        return self

    @property
    def storage_reaches_every_node(self) -> bool:
        """Whether checkpoints written on one node can be read on another: a remote URI, or a declared shared path."""
        return is_remote_storage(self.storage_path) or bool(self.storage_path and self.storage_shared)

    @property
    def effective_eval_fraction(self) -> float:
        """``eval_fraction`` when set, else 5% of real data held out (none with ``eval_data`` or random ids)."""
        if self.eval_fraction is not None:
            return self.eval_fraction
        return 0.0 if self.eval_data or self.uses_random_data else 0.05

    @property
    def learning_rate_reason(self) -> str:
        """Why ``learning_rate`` is what it is: ``LoRA's default; full fine-tuning's is 2e-05`` when the method chose
        it, ``as set`` (and the method's default, where it differs) when it was given."""
        recipe = _recipe(self.method, self.dpo)
        mine, default = _RECIPE_NAMES[recipe], DEFAULT_LEARNING_RATES[recipe]
        if "learning_rate" in self.model_fields_set:
            return "as set" + (f"; {mine} default is {default!r}" if self.learning_rate != default else "")
        other = _RECIPE_OTHER[recipe]
        return f"{mine} default; {_RECIPE_NAMES[other]} is {DEFAULT_LEARNING_RATES[other]!r}"

    @property
    def adapters(self) -> LoraSettings | None:
        """The LoRA settings when the model trains adapters (method lora, or dpo with ``dpo.adapters: lora``), else
        ``None``: every weight trains."""
        return self.lora if _recipe(self.method, self.dpo) in ("lora", "dpo-lora") else None

    @property
    def preference(self) -> bool:
        """Whether the run trains on preference pairs (method dpo)."""
        return self.method == "dpo"

    @property
    def effective_warmup_steps(self) -> int:
        """``warmup_steps`` when set, else 5% of the steps (rounded up)."""
        return self.warmup_steps if self.warmup_steps is not None else -(-self.steps // 20)

    @property
    def micro_batch(self) -> int:
        """``batch_size`` as a number: ``auto`` not resolved before the run (a local run's) is the default."""
        return DEFAULT_BATCH_SIZE if self.batch_size == "auto" else self.batch_size

    @property
    def uses_random_data(self) -> bool:
        return self.data == RANDOM_DATA


class FabricConfig(Section):
    """What the inter-node network of a run must be, checked from NCCL's own log lines.

    ``require``: ``efa`` (the reference), ``ib``, or ``any`` (no check: local runs, gloo). ``expected_gbps``: the
    line rate the bandwidth probe compares against; empty = the GPU instance type's network rate.
    ``require_full_efa``: stop, rather than warn, when EFA is used short of what the instance type offers.
    """

    require: Literal["efa", "ib", "any"] = "efa"
    expected_gbps: float | None = Field(None, gt=0)
    # A shortfall in the fabric's use (fewer EFA devices found or used than the GPU type has, GPUDirect RDMA off
    # where it supports it) is a warning of the in-job gate unless this asks for the run to stop on it.
    require_full_efa: bool = Field(
        False,
        description="stop the run when NCCL's lines show EFA used short of what the GPU instance type offers "
        "(fewer EFA devices, GPUDirect RDMA off); false = only warn",
    )
    # compare-fabric: the steps of each of its two runs (empty = training.steps), and the first steps left out of
    # the timing. The warm-up default is 10, not the reference's 3: metrics are sampled every log_every (10) steps,
    # and the sample at step 10 still carries NCCL's connection setup.
    compare_steps: int | None = Field(
        None, ge=1, description="compare-fabric: steps of each of its two runs; empty = training.steps"
    )
    compare_warmup_steps: int = Field(
        10, ge=0, description="compare-fabric: first steps of each run left out of the timing"
    )


@dataclass(frozen=True)
class Derived:
    """Values computed from the settings, in one place, so none is ever typed twice.

    ``cluster_gpus``: GPUs in the GPU node group. ``ray_gpus_per_worker_pod``: both Ray's ``num-gpus`` and the pod's
    ``nvidia.com/gpu`` request. ``world_size``: training workers on the cluster (``num_workers`` or, when 0, one
    per GPU). ``workers_per_node``: ranks on each GPU node. ``worker_nodes``: GPU nodes the ranks span.
    """

    cluster_gpus: int
    ray_gpus_per_worker_pod: int
    world_size: int
    workers_per_node: int
    worker_nodes: int


class Config(Section):
    """Every setting of every step. Build it with :func:`load_config`; derived values are on :attr:`derived`."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    addons: AddonsConfig = Field(default_factory=AddonsConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    fabric: FabricConfig = Field(default_factory=FabricConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    _given_in_command: frozenset[str] = PrivateAttr(default_factory=frozenset)  # dotted names; load_config sets it

    def __eq__(self, other: object) -> bool:  # the same settings, wherever they were given
        return isinstance(other, Config) and self.__dict__ == other.__dict__

    def given_in_command(self, name: str) -> bool:
        """Whether this command was given the setting ``name`` (``"cluster.gpu_node_type"``) in the environment, as a
        flag or with ``--set``: a file ``init`` wrote holds every default, so a default there says nothing of intent."""
        return name in self._given_in_command

    @property
    def derived(self) -> Derived:
        gpus = self.cluster.gpu_node_count * self.cluster.gpus_per_node
        world = self.training.num_workers or gpus
        per_node = -(-world // self.cluster.gpu_node_count)
        return Derived(
            cluster_gpus=gpus,
            ray_gpus_per_worker_pod=self.cluster.gpus_per_node,
            world_size=world,
            workers_per_node=per_node,
            worker_nodes=-(-world // per_node) if per_node else 0,
        )

    @model_validator(mode="after")
    def _on_demand_pod_size(self) -> Config:
        missing = [f"ray.{k}" for k in ("worker_cpu", "worker_memory_gib") if getattr(self.ray, k) is None]
        if self.cluster.gpu_nodes_on_demand and missing:
            raise ValueError(
                f"cluster.gpu_nodes_on_demand: set {' and '.join(missing)} (what each worker pod requests, within "
                "what one GPU node of the pool offers): nodes that do not exist yet cannot be read for it"
            )
        return self

    def check_cluster_storage(self) -> None:
        """:func:`check_storage_for_nodes` for the cluster this tool deploys (its GPU nodes the ranks span), before
        anything is submitted; a run that joins a Ray cluster counts that cluster's nodes instead (``--address``)."""
        check_storage_for_nodes(
            self.training, self.derived.worker_nodes, counted="cluster.gpu_node_count and training.num_workers"
        )

    def to_yaml(self) -> str:
        """The settings as YAML, the learning rate in force with a comment saying why."""
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
        why = f"  # {self.training.learning_rate_reason}"
        return re.sub(r"(?m)^  learning_rate: .*$", lambda line: line.group(0) + why, text, count=1)


def _method_data(tree: dict[str, Any], sources: Mapping[tuple[str, ...], str]) -> None:
    """Method dpo reads its own data: the preset's (supervised) data and format, where no layer set them, are left
    out of ``tree`` so that :class:`TrainingConfig` gives dpo's (the built-in pairs, the preference format)."""
    training = tree.get("training")
    if not isinstance(training, dict) or training.get("method") != "dpo":
        return
    if ("training", "data_format") not in sources:
        training.pop("data_format", None)
    if ("training", "data") not in sources and training.get("data") in (RANDOM_DATA, BUILTIN_DATA):
        training.pop("data", None)


def load_config(
    *,
    preset: Config | None = None,
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    sets: Sequence[str] | None = None,
) -> Config:
    """Build and validate the configuration from its layers; raise :class:`ConfigError` listing every problem.

    ``path=None`` reads ``raytrain-eks.yaml`` from the current folder when it exists; an explicit path must exist.
    ``environ`` defaults to ``os.environ``; only the names in ``layers.ENV_VARS`` are read. ``overrides`` are flag
    values, ``{"training": {"steps": 5}}``; ``None`` values are ignored. ``sets`` are ``--set`` items,
    ``"training.steps=5"``: any setting by its dotted name, the value read as YAML (as in the file), last of all.
    """
    base = preset or Config()
    tree = base.model_dump(mode="python")
    if "learning_rate" not in base.training.model_fields_set:  # the method's, once the layers have chosen the method
        del tree["training"]["learning_rate"]
    file = Path(path) if path is not None else Path(DEFAULT_CONFIG_FILE)
    if path is not None and not file.exists():
        raise ConfigError([f"config file {str(file)!r} does not exist; create one with `raytrain-eks init {file}`"])
    sources: dict[tuple[str, ...], str] = {}
    tree = layers.lay(tree, sources, Config, file if file.exists() else None, environ, overrides or {}, sets or ())
    _method_data(tree, sources)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as exc:
        problems = layers.format_errors(exc.errors(), sources, tree, Config)
        raise ConfigError(problems) from None
    from_file = str(file) if file.exists() else None
    cfg._given_in_command = frozenset(".".join(k) for k, origin in sources.items() if origin != from_file)
    return cfg
