"""The S3 bucket that every node of the cluster reaches: checkpoints and exports of the jobs run on EKS.

``up`` creates it before the cluster (or adopts ``cluster.checkpoint_bucket`` as it is): public access blocked,
encrypted at rest (SSE-S3), tagged with the cluster. Its name is made once and remembered in the state file, so a
later ``up`` finds the same bucket. The Ray pods reach it through an IAM role for their service account, limited
to this bucket (:func:`raytrain_eks.aws.eksctl.bucket_policy`) and, when a KMS key encrypts it, to that key
(:func:`bucket_kms_key`, remembered as ``bucket_kms_key``). ``down`` deletes a bucket it created only when it is
empty or when asked to (``--delete-checkpoints``); nothing a job wrote is lost by default. Example::

    name = ensure_bucket(d)          # "ray-train-eks-checkpoints-3f9a1c2e"
    storage_uri(name)                # (raytrain_eks.k8s.state) "s3://ray-train-eks-checkpoints-3f9a1c2e/runs"
"""

from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING

from raytrain_eks.aws import eksctl
from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.k8s.state import Deployment, Item, StateStore

if TYPE_CHECKING:  # the session type only: boto3 is imported when AWS is first called
    from botocore.client import BaseClient

    from raytrain_eks.aws.session import Aws


def bucket_item(name: str) -> Item:
    return {"type": "bucket", "name": name}


def planned_bucket(cfg: Config, store: StateStore | None = None, *, suffix: str | None = None) -> str:
    """The bucket ``up`` uses: the configured one, the one remembered in the state file, or a new name (the cluster's
    name and a random suffix, since bucket names are global across every AWS account; ``suffix`` fixes it)."""
    if cfg.cluster.checkpoint_bucket:
        return cfg.cluster.checkpoint_bucket
    if store is not None and store.get("bucket"):
        return str(store.get("bucket"))
    stem = cfg.cluster.name.lower().replace("_", "-")[:40].strip("-") or "raytrain-eks"
    return f"{stem}-checkpoints-{suffix or secrets.token_hex(4)}"


def _s3(d: Deployment, aws: Aws | None = None) -> BaseClient:
    """The S3 client of the cluster's region: of ``aws`` (a :class:`raytrain_eks.aws.session.Aws` already made),
    else of a new session."""
    from raytrain_eks.aws.session import connect

    return (aws or connect(d.cfg.cluster.region)).client("s3", d.cfg.cluster.region)


def _exists(s3: BaseClient, name: str) -> bool:
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
        _remember_kms_key(d, name)
        d.say(f"Checkpoints and exports go to the existing bucket s3://{name} (kept by `down`)")
        return name
    if _exists(s3, name):
        _remember_kms_key(d, name)  # its encryption may have been changed since up created it
        return name
    d.state.update(bucket_kms_key=None)
    d.state.record(bucket_item(name))
    with aws_errors(f"creating the S3 bucket {name} in {c.region}"):
        kwargs: dict[str, object] = {"Bucket": name}
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


# How a bucket's default encryption names its KMS key: a key ARN is used as it is; a key id or an alias (or an
# alias's ARN) is resolved to the key's ARN through KMS, since an IAM policy grants the use of a key by its ARN.
_KEY_ARN = re.compile(r"^arn:aws[a-z-]*:kms:[a-z0-9-]+:\d{12}:key/[A-Za-z0-9-]+$")
_KMS_ALGORITHMS = ("aws:kms", "aws:kms:dsse")


def bucket_kms_key(d: Deployment, name: str, aws: Aws | None = None) -> str | None:
    """The ARN of the KMS key the bucket's default encryption uses (SSE-KMS), or ``None`` when it uses none of its
    own: SSE-S3, or ``aws:kms`` without a key named (S3's AWS managed key ``aws/s3``, whose key policy lets every
    principal of the account that may use S3 use it through S3, so no IAM grant is needed).

    A key named by id or alias is resolved through KMS; when that fails, one :class:`UserError` names the key, since
    the Ray pods' role cannot be given the use of a key whose ARN is not known. Example: ``bucket_kms_key(d,
    "team-ckpt")`` -> ``"arn:aws:kms:us-east-1:123456789012:key/1234abcd-..."``. ``aws``: the session to use
    (a new one by default).
    """
    import botocore.exceptions

    from raytrain_eks.aws.session import aws_errors, connect, short_reason

    try:
        with aws_errors(
            f"reading the default encryption of the S3 bucket {name}",
            expected=("ServerSideEncryptionConfigurationNotFoundError",),
        ):
            s3 = _s3(d, aws)
            rules = s3.get_bucket_encryption(Bucket=name)["ServerSideEncryptionConfiguration"].get("Rules", [])
    except botocore.exceptions.ClientError:  # no default encryption configured (buckets made before 2023)
        return None
    for rule in rules:
        default = rule.get("ApplyServerSideEncryptionByDefault") or {}
        key = default.get("KMSMasterKeyID")
        if default.get("SSEAlgorithm") not in _KMS_ALGORITHMS or not key:
            continue
        if _KEY_ARN.match(key):
            return str(key)
        try:
            region = key.split(":")[3] if key.startswith("arn:") else _bucket_region(s3, name)  # keys are regional
            kms = (aws or connect(region)).client("kms", region)
            return str(kms.describe_key(KeyId=key)["KeyMetadata"]["Arn"])
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            reason = short_reason(exc) if isinstance(exc, botocore.exceptions.ClientError) else str(exc)
            raise UserError(
                f"the checkpoint bucket s3://{name} is encrypted with the KMS key {key!r}, and KMS could not tell "
                f"which key that is ({reason}): the Ray pods' IAM role needs kms:GenerateDataKey and kms:Decrypt on "
                "that key's ARN, or every checkpoint it writes is refused",
                hint="Allow these credentials kms:DescribeKey on the key (or name the key by its ARN in the bucket's "
                "default encryption), or use a bucket encrypted with SSE-S3; then run the same command again.",
            ) from None
    return None


def _bucket_region(s3: BaseClient, name: str) -> str:
    """The bucket's region (S3 answers no location constraint for us-east-1)."""
    return str(s3.get_bucket_location(Bucket=name).get("LocationConstraint") or "us-east-1")


def _remember_kms_key(d: Deployment, name: str) -> None:
    """Keep the bucket's KMS key in the state file, for the Ray pods' role (see :func:`bucket_kms_key`)."""
    key = bucket_kms_key(d, name)
    d.state.update(bucket_kms_key=key)
    if key:
        d.say(f"s3://{name} is encrypted with the KMS key {key}: the Ray pods' role may use that key too")


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
