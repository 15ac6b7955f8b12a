"""The S3 bucket that every node of the cluster reaches: checkpoints and exports of the jobs run on EKS.

``up`` creates it before the cluster (or adopts ``cluster.checkpoint_bucket`` as it is): public access blocked,
encrypted at rest (SSE-S3), tagged with the cluster. Its name is made once and remembered in the state file, so a
later ``up`` finds the same bucket. The Ray pods reach it through an IAM role for their service account, limited
to this bucket (:func:`raytrain_eks.aws.eksctl.bucket_policy`). ``down`` deletes a bucket it created only when it
is empty or when asked to (``--delete-checkpoints``); nothing a job wrote is lost by default. Example::

    name = ensure_bucket(d)          # "ray-train-eks-checkpoints-3f9a1c2e"
    storage_uri(name)                # (raytrain_eks.eks.state) "s3://ray-train-eks-checkpoints-3f9a1c2e/runs"
"""

from __future__ import annotations

import secrets
from typing import Any

from raytrain_eks.aws import eksctl
from raytrain_eks.config import Config
from raytrain_eks.eks.state import Deployment, StateStore
from raytrain_eks.errors import UserError

# S3 Standard in us-east-1, per GB-month (first 50 TB); what the kept checkpoints cost while they are kept.
S3_STANDARD_USD_PER_GB_MONTH = 0.023


def bucket_item(name: str) -> dict[str, Any]:
    return {"type": "bucket", "name": name}


# Parameters of the models whose checkpoint size the plan can tell; others show no storage estimate.
MODEL_PARAMS = {"Qwen/Qwen2.5-0.5B": 494_032_768, "Qwen/Qwen2.5-1.5B": 1_543_714_304, "Qwen/Qwen2.5-3B": 3_085_938_688}
# One sharded checkpoint: fp32 weights and AdamW's two fp32 moments, 12 bytes a parameter.
CHECKPOINT_BYTES_PER_PARAM = 12


def planned_bucket(cfg: Config, store: StateStore | None = None, *, suffix: str | None = None) -> str:
    """The bucket ``up`` uses: the configured one, the one remembered in the state file, or a new name (the cluster's
    name and a random suffix, since bucket names are global across every AWS account; ``suffix`` fixes it)."""
    if cfg.cluster.checkpoint_bucket:
        return cfg.cluster.checkpoint_bucket
    if store is not None and store.get("bucket"):
        return str(store.get("bucket"))
    stem = cfg.cluster.name.lower().replace("_", "-")[:40].strip("-") or "raytrain-eks"
    return f"{stem}-checkpoints-{suffix or secrets.token_hex(4)}"


def storage_estimate(cfg: Config) -> dict[str, Any] | None:
    """What the kept checkpoints of one run take in S3 and cost a month (S3 Standard, us-east-1); ``None`` for a
    model whose size is not known here. Qwen2.5-1.5B, 2 kept: 37.0 GB, $0.85 a month."""
    params = MODEL_PARAMS.get(cfg.training.model_id)
    if params is None:
        return None
    gb = params * CHECKPOINT_BYTES_PER_PARAM * cfg.training.keep_checkpoints / 1e9
    return {
        "kept_checkpoints": cfg.training.keep_checkpoints,
        "gb": round(gb, 1),
        "usd_per_month": round(gb * S3_STANDARD_USD_PER_GB_MONTH, 2),
        "basis": f"{CHECKPOINT_BYTES_PER_PARAM} bytes a parameter (fp32 weights and AdamW moments) per checkpoint, "
        f"S3 Standard ${S3_STANDARD_USD_PER_GB_MONTH}/GB-month; exports add 2-4 bytes a parameter each",
    }


def _s3(d: Deployment) -> Any:
    from raytrain_eks.aws.session import connect

    return connect(d.cfg.cluster.region).client("s3", d.cfg.cluster.region)


def _exists(s3: Any, name: str) -> bool:
    """Whether ``name`` exists and this account may use it; a bucket of another account is one clear error."""
    import botocore.exceptions

    from raytrain_eks.aws.session import aws_errors

    try:
        with aws_errors(f"looking up the S3 bucket {name}", expected=("404", "NoSuchBucket", "403", "Forbidden")):
            s3.head_bucket(Bucket=name)
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchBucket"):
            return False
        raise UserError(
            f"the S3 bucket {name} exists but these credentials may not use it (another account's, or no access)",
            hint="Set cluster.checkpoint_bucket (CHECKPOINT_BUCKET) to a bucket of this account, or leave it "
            "empty for a new one.",
        ) from None
    return True


def ensure_bucket(d: Deployment) -> str:
    """The checkpoint bucket, created (recorded first, then made private, encrypted and tagged) unless it exists."""
    from raytrain_eks.aws.session import aws_errors

    c = d.cfg.cluster
    name = planned_bucket(d.cfg, d.state)
    d.state.update(bucket=name)
    s3 = _s3(d)
    if c.checkpoint_bucket:
        if not _exists(s3, name):
            raise UserError(
                f"cluster.checkpoint_bucket = {name!r}: no such bucket",
                hint="Create it first, or leave CHECKPOINT_BUCKET empty and `up` creates one.",
            )
        d.say(f"Checkpoints and exports go to the existing bucket s3://{name} (kept by `down`)")
        return name
    if _exists(s3, name):
        return name
    d.state.record(bucket_item(name))
    with aws_errors(f"creating the S3 bucket {name} in {c.region}"):
        kwargs: dict[str, Any] = {"Bucket": name}
        if c.region != "us-east-1":  # us-east-1 takes no location constraint
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": c.region}
        s3.create_bucket(**kwargs)
        s3.put_public_access_block(
            Bucket=name,
            PublicAccessBlockConfiguration={
                "BlockPublicAcls": True,
                "IgnorePublicAcls": True,
                "BlockPublicPolicy": True,
                "RestrictPublicBuckets": True,
            },
        )
        s3.put_bucket_encryption(
            Bucket=name,
            ServerSideEncryptionConfiguration={
                "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]
            },
        )
        s3.put_bucket_tagging(
            Bucket=name,
            Tagging={"TagSet": [{"Key": k, "Value": v} for k, v in eksctl.cluster_tags(d.cfg).items()]},
        )
    d.say(f"Created the checkpoint bucket s3://{name} (private, encrypted)")
    return name


def bucket_objects(d: Deployment, name: str) -> int | None:
    """How many objects the bucket holds (counting stops at 1,000); ``None`` when it no longer exists."""
    from raytrain_eks.aws.session import aws_errors

    s3 = _s3(d)
    if not _exists(s3, name):
        return None
    with aws_errors(f"listing the S3 bucket {name}"):
        return int(s3.list_objects_v2(Bucket=name, MaxKeys=1000).get("KeyCount", 0))


def bucket_exists(d: Deployment, name: str) -> bool:
    return _exists(_s3(d), name)


def delete_bucket(d: Deployment, name: str) -> None:
    """Delete every object and then the bucket. Listing versions lists every object, versioned or not (an object of
    a bucket without versioning is its one version, "null"), so one pass empties the bucket."""
    from raytrain_eks.aws.session import aws_errors

    s3 = _s3(d)
    with aws_errors(f"deleting the S3 bucket {name}"):
        for page in s3.get_paginator("list_object_versions").paginate(Bucket=name):
            keys = [
                {"Key": v["Key"], "VersionId": v["VersionId"]}
                for v in page.get("Versions", []) + page.get("DeleteMarkers", [])
            ]
            if keys:
                s3.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        s3.delete_bucket(Bucket=name)


def kept_note(name: str, objects: int) -> str:
    more = "+" if objects >= 1000 else ""
    return (
        f"Kept s3://{name} ({objects}{more} objects: checkpoints and exports). Delete it with "
        f"`raytrain-eks down --delete-checkpoints` (or `aws s3 rb s3://{name} --force`)."
    )
