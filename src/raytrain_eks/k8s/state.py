"""What ``up`` created and where: the :class:`StateStore` under ``.raytrain-eks/`` of the working folder, and the
:class:`Deployment` every step of the EKS path works on.

Every step records what it is about to create *before* creating it, so re-running after a failure resumes and
``down`` finds even what a crash left half made. Example::

    store = StateStore(".raytrain-eks")
    store.record(cluster_item(cfg))
    [describe(item) for item in store.created]   # ["EKS cluster ray-train-eks (us-east-1) with its VPC ..."]
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Required, TypedDict

from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.k8s.cluster import KubeApi
from raytrain_eks.k8s.runner import Runner, require_tool
from raytrain_eks.k8s.wait import POLL_S, T, poll

STATE_DIR = ".raytrain-eks"
STATE_FILE = "state.json"
KUBECONFIG_FILE = "kubeconfig"


class Item(TypedDict, total=False):
    """Something raytrain-eks created, as the state file lists it: its ``type`` (cluster, nodegroup, bucket, helm,
    object, iamserviceaccount), its ``name``, and by type what else finds it again; ``restore``: what an IAM service
    account that existed before had, given back by ``down``."""

    type: Required[str]
    name: Required[str]
    region: str
    namespace: str | None
    apiVersion: str
    kind: str
    restore: dict[str, dict[str, str | None]]


class UnreadableAnswer(UserError):
    """eksctl answered, but not in a form that says what exists: nothing is assumed, nothing is changed."""


class Cancelled(UserError):
    """The user answered no to the confirmation: nothing was changed."""


# ----------------------------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------------------------


class StateStore:
    """What this working folder deployed: ``state.json`` (plus the kubeconfig and generated files) under ``root``.

    ``created`` is the ordered list of things raytrain-eks created, each recorded before it is created; ``down``
    deletes them in reverse. Example: ``StateStore(".raytrain-eks").get("gpu_az")``.
    """

    def __init__(self, root: str | Path = STATE_DIR) -> None:
        self.root = Path(root)
        self.path = self.root / STATE_FILE
        self.data: dict[str, Any] = {}
        if self.path.exists():
            try:
                self.data = json.loads(self.path.read_text())
            except ValueError:
                raise UserError(
                    f"{self.path} is not valid JSON",
                    hint="Restore it, or move it away if nothing is deployed from this folder.",
                ) from None

    @property
    def kubeconfig(self) -> Path:
        return self.root / KUBECONFIG_FILE

    @property
    def created(self) -> list[Item]:
        return list(self.data.get("created", []))

    def get(self, key: str, default: object = None) -> Any:
        return self.data.get(key, default)

    def update(self, **values: object) -> None:
        for key, value in values.items():
            if value is None:
                self.data.pop(key, None)
            else:
                self.data[key] = value
        self.save()

    def has(self, item: Item) -> bool:
        return item in self.data.get("created", [])

    def record(self, item: Item) -> None:
        """Remember ``item`` as created by raytrain-eks (idempotent)."""
        if not self.has(item):
            self.data.setdefault("created", []).append(item)
            self.save()

    def forget(self, item: Item) -> None:
        if self.has(item):
            self.data["created"].remove(item)
            self.save()

    def write_file(self, name: str, text: str) -> Path:
        """Write a generated file (eksctl config, Helm values) under ``root``; :meth:`clear` removes it again."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        files = self.data.setdefault("files", [])
        if name not in files:
            files.append(name)
            self.save()
        return path

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path)  # never a half-written state file

    def clear(self) -> None:
        """Forget the deployment (after ``down``): remove the state, the kubeconfig and the files written here, and
        nothing else (``--state-dir`` may point at a folder that holds other files too)."""
        names = [*self.data.get("files", []), KUBECONFIG_FILE, STATE_FILE]
        self.data = {}
        for name in names:
            path = self.root / name
            path.unlink(missing_ok=True)
            for parent in path.relative_to(self.root).parents:
                folder = self.root / parent
                if folder != self.root and folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        if self.root.is_dir() and not any(self.root.iterdir()):
            self.root.rmdir()


def cluster_item(cfg: Config) -> Item:
    return {"type": "cluster", "name": cfg.cluster.name, "region": cfg.cluster.region}


def nodegroup_item(name: str) -> Item:
    return {"type": "nodegroup", "name": name}


def object_item(obj: Mapping[str, Any]) -> Item:
    meta = obj["metadata"]
    return {
        "type": "object",
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": meta["name"],
        "namespace": meta.get("namespace") if obj["kind"] != "Namespace" else None,
    }


def describe(item: Item) -> str:
    """A created item as words: ``EKS cluster ray-train-eks (us-east-1)``."""
    kind = item["type"]
    if kind == "cluster":
        return f"EKS cluster {item['name']} ({item['region']}) with its VPC and NAT gateway"
    if kind == "nodegroup":
        return f"node group {item['name']}"
    if kind == "bucket":
        return f"S3 bucket {item['name']} (checkpoints and exports)"
    if kind == "helm":
        return f"Helm release {item['namespace']}/{item['name']}"
    where = f"{item['namespace']}/" if item.get("namespace") else ""
    return f"{item['kind']} {where}{item['name']}"


RUNS_PREFIX = "runs"


def storage_uri(bucket: str) -> str:
    """Where the jobs on the cluster keep their checkpoints: a prefix of the checkpoint bucket."""
    return f"s3://{bucket}/{RUNS_PREFIX}"


def with_bucket_storage(cfg: Config, bucket: str | None) -> Config:
    """``cfg`` with the job's checkpoints in ``bucket`` (:func:`storage_uri`), which every node of the cluster
    reaches, unless ``training.storage_path`` is set (or there is no bucket)."""
    if not bucket or cfg.training.storage_path:
        return cfg
    return cfg.model_copy(update={"training": cfg.training.model_copy(update={"storage_path": storage_uri(bucket)})})


def with_shared_volume(cfg: Config) -> Config:
    """``cfg`` with its checkpoints on ``ray.shared_volume`` (``SHARED_PATH/runs``, storage every node reaches) when
    one is mounted and ``training.storage_path`` is unset; a storage path under the mount counts as shared."""
    r, t = cfg.ray, cfg.training
    if not r.shared_volume:
        return cfg
    if not t.storage_path:
        update: dict[str, object] = {"storage_path": f"{r.shared_volume_path}/{RUNS_PREFIX}", "storage_shared": True}
    elif t.storage_path == r.shared_volume_path or t.storage_path.startswith(f"{r.shared_volume_path}/"):
        update = {"storage_shared": True}
    else:
        return cfg
    return cfg.model_copy(update={"training": t.model_copy(update=update)})


def apply_state(cfg: Config, store: StateStore) -> Config:
    """``cfg`` with the cluster name, region and GPU zone remembered by ``up``, so later commands (``submit``,
    ``status``, ``down``) act on the cluster that was created even when the shell's REGION or GPU_AZ changed; and
    with the checkpoints in the cluster's bucket (:func:`with_bucket_storage`)."""
    cfg = with_shared_volume(cfg)
    remembered = {k: store.get(s) for k, s in (("name", "cluster"), ("region", "region"), ("gpu_az", "gpu_az"))}
    remembered = {k: v for k, v in remembered.items() if v}
    if not remembered:
        return cfg
    cluster = cfg.cluster.model_copy(update=remembered)
    if cluster.gpu_az and cluster.availability_zones and cluster.gpu_az not in cluster.availability_zones:
        cluster = cluster.model_copy(update={"availability_zones": []})
    return with_bucket_storage(cfg.model_copy(update={"cluster": cluster}), store.get("bucket"))


def remembered_config(cfg: Config, store: StateStore, say: Callable[[str], None]) -> Config:
    """``cfg`` with the cluster, region and zone this folder's state remembers; ``say`` tells when they differ
    from the configured ones."""
    remembered = apply_state(cfg, store)
    was, now = cfg.cluster, remembered.cluster
    if (was.name, was.region, was.gpu_az) != (now.name, now.region, now.gpu_az):
        zone = now.gpu_az or "not chosen yet"
        say(f"Using cluster {now.name} in {now.region} (zone {zone}) as remembered in {store.path}")
    return remembered


# ----------------------------------------------------------------------------------------------------------------
# The deployment
# ----------------------------------------------------------------------------------------------------------------


def _quiet(_: str) -> None:
    pass


@dataclass
class Deployment:
    """Everything a step needs. ``say`` prints one progress line; ``sleep`` and ``clock`` are injectable so the
    tests' fake cluster can run the waits in simulated time; ``require_tool`` checks that a program is installed."""

    cfg: Config
    kube: KubeApi
    run: Runner
    state: StateStore
    say: Callable[[str], None] = _quiet
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    require_tool: Callable[[str], object] = require_tool
    # The kubeconfig (and its context) helm and kubectl are given: this folder's own, written by eksctl (eks), else
    # the user's (the kubernetes target).
    kubeconfig_file: str | None = None
    context: str | None = None

    @property
    def kubeconfig(self) -> str:
        return self.kubeconfig_file or str(self.state.kubeconfig)

    def kube_flags(self, context_flag: str = "--context") -> list[str]:
        """``--kubeconfig FILE`` and, with a context, ``context_flag CONTEXT`` (helm: ``--kube-context``)."""
        return ["--kubeconfig", self.kubeconfig, *([context_flag, self.context] if self.context else [])]

    def wait(
        self,
        probe: Callable[[], tuple[T | None, str]],
        *,
        what: str,
        timeout: float,
        on_timeout: Callable[[str, float], Exception] | None = None,
        interval: float = POLL_S,
    ) -> T:
        """:func:`raytrain_eks.k8s.wait.poll` on this deployment's clock, sleep and progress lines."""
        return poll(
            probe,
            what=what,
            timeout=timeout,
            clock=self.clock,
            sleep=self.sleep,
            say=self.say,
            interval=interval,
            on_timeout=on_timeout,
        )
