"""The parts of the written plan every target shares: pure, offline, no credentials.

A target's plan (``ClusterTarget.plan``: :mod:`raytrain_eks.eks.plan`, :mod:`raytrain_eks.kubernetes.plan`) is a
:class:`Plan`: the ordered steps, the pinned Helm releases, the Kubernetes objects and the hourly cost. Here are its
shape, the job's steps and objects (:func:`job_steps`, :func:`job_objects`), what the kept checkpoints take
(:func:`checkpoint_storage`) and :func:`write_files`, which dumps a built plan to a folder. Example::

    plan = target_for(cfg).plan(cfg, state_dir=".raytrain-eks", mode="rayjob", hf_token=False)
    write_files(plan, Path("plan-out"))  # raycluster.yaml, helm/..., plan.json
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

from raytrain_eks.config import Config
from raytrain_eks.deploy.fit import sharding_line
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import job as job_files
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s import wheelhouse
from raytrain_eks.k8s.addons import HelmRelease, node_words
from raytrain_eks.k8s.manifests import to_yaml
from raytrain_eks.train.memory import planned_layout

Mode = Literal["raycluster", "rayjob"]
MODES: tuple[Mode, ...] = ("raycluster", "rayjob")

PLAN_FILE = "plan.json"
HELM_FILE = "helm-releases.yaml"
NAMESPACE_FILE = "namespace.yaml"
JOB_CONFIG_FILE = "job-config.yaml"
MANIFEST_FILE: dict[Mode, str] = {"raycluster": "raycluster.yaml", "rayjob": "rayjob.yaml"}
CODE_CONFIG_MAP_FILE = "code-configmap.yaml"  # --mode rayjob: the package, mounted into the submitter pod
PACKAGE_ARCHIVE_FILE = "raytrain_eks-package.tar.gz.b64"  # --mode raycluster: the package, unpacked in the head pod


@dataclass(frozen=True)
class Step:
    """One step of the deploy, in order: its ``name``, what it would do, and the command when it is one."""

    name: str
    action: str
    command: list[str] | None = None
    files: list[str] = field(default_factory=list)
    stdin: str | None = None  # a file of the plan folder the command reads on its standard input

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name,
            "action": self.action,
            "command": self.command,
            "files": self.files,
        }
        if self.stdin is not None:
            out["stdin"] = self.stdin
        return out


@dataclass(frozen=True)
class Plan:
    """Everything ``deploy`` would do. ``files`` maps a relative path to the documents written there, ``texts`` a
    relative path to a file's text (the package archive a command reads on stdin)."""

    mode: Mode
    steps: list[Step]
    helm_releases: list[HelmRelease]
    cost: dict[str, Any]
    files: dict[str, list[dict[str, Any]]]
    assumptions: list[str]
    summary: dict[str, Any]
    texts: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "commands_run_in": "the plan folder: file paths in commands are relative to it",
            "summary": self.summary,
            "assumptions": self.assumptions,
            "steps": [s.to_dict() for s in self.steps],
            "helm_releases": [r.to_dict() for r in self.helm_releases],
            "cost_per_hour": self.cost,
            "files": sorted([*self.files, *self.texts, PLAN_FILE]),
        }


def _job_packages(cfg: Config) -> str:
    """The packages the job needs beyond the image (with its extras: lm-eval for ``training.eval_tasks``), listed."""
    return ", ".join(job_files.job_requirements(job_files.job_extras(cfg.training)))


def job_steps(
    cfg: Config,
    mode: Mode,
    *,
    hf_token: bool,
    code_dir: str,
    kubectl: tuple[str, ...] = ("kubectl",),
    after_namespace: tuple[Step, ...] = (),
) -> list[Step]:
    """The steps of ``submit`` on any target, in order: the namespace (when not ``default``), ``after_namespace``
    (a target's own objects there), the token's Secret, the job's ConfigMap, then the RayCluster or RayJob and what
    runs the job on it; ``--offline``'s wheelhouse comes before the Secret and the ConfigMap. ``kubectl``: the
    program and flags the command lines start with."""
    c, r, d = cfg.cluster, cfg.ray, cfg.derived
    head_where = node_words(m.head_node_selector(cfg))
    ns = r.namespace
    steps: list[Step] = []
    if ns != "default":
        steps.append(
            Step("namespace", f"Create namespace {ns}.", [*kubectl, "apply", "-f", NAMESPACE_FILE], [NAMESPACE_FILE])
        )
    steps += after_namespace
    if hf_token:
        steps.append(
            Step(
                "hf-token-secret",
                f"Create Secret {ns}/{r.hf_token_secret} (key {m.HF_TOKEN_KEY}) from the HF_TOKEN environment "
                "variable of this shell, through the Kubernetes API. The value is never written to a file, a "
                "command line or a log; the pods read it with secretKeyRef.",
            )
        )
    steps.append(
        Step(
            "job-config",
            f"Store the resolved configuration as ConfigMap {ns}/{m.config_map_name(cfg)}, mounted in the head pod "
            f"at {m.CONFIG_DIR}: training.method {cfg.training.method}, learning_rate {cfg.training.learning_rate!r} "
            f"({cfg.training.learning_rate_reason}).",
            [*kubectl, "apply", "-f", JOB_CONFIG_FILE],
            [JOB_CONFIG_FILE],
        )
    )
    manifest = MANIFEST_FILE[mode]
    sharding = sharding_line(cfg)
    head_exec = [*kubectl, "exec", "--namespace", ns, f"service/{r.cluster_name}-head-svc", "-c", "ray-head"]
    workers = f"{c.gpu_node_count} worker pods (one per GPU node, {d.ray_gpus_per_worker_pod} GPUs each)"
    if mode == "raycluster":
        steps += [
            Step(
                "apply-raycluster",
                f"Apply RayCluster {ns}/{r.cluster_name}: a GPU-less head {head_where} and {workers}.",
                [*kubectl, "apply", "-f", manifest],
                [manifest],
            ),
            Step("wait-raycluster", f"Wait until the head and the {c.gpu_node_count} worker pods are running."),
            Step(
                "upload-package",
                f"Unpack the raytrain_eks package ({PACKAGE_ARCHIVE_FILE}, a base64 tar.gz read on stdin) into "
                f"{code_dir} in the head pod: the image has no copy of it, and the job's runtime_env ships it to "
                "every worker from there (py_modules). Packages the image lacks that travel unpacked (below) are "
                f"unpacked the same way into {job_files.HEAD_CODE_ROOT}/packages-DIGEST by submit.",
                [*head_exec, "-i", "--", *job_files.unpack_argv(code_dir)],
                [PACKAGE_ARCHIVE_FILE],
                stdin=PACKAGE_ARCHIVE_FILE,
            ),
            Step(
                "submit",
                f"Run the job from inside the head pod (the dashboard port stays inside the cluster): "
                f"{shlex.join(m.train_argv())} on {d.world_size} workers; {sharding}; with a runtime_env that ships "
                f"the package unpacked above and brings those of {_job_packages(cfg)} the "
                "image does not have in range (asked of the head pod's python3 first): unpacked beside it, each "
                "top-level folder one more py_modules entry, else pip (the command below lists them all for pip). "
                + image_installs(cfg)["how"],
                [*head_exec, "--", *job_files.ray_job_submit_argv(code_dir)],
            ),
        ]
    else:
        steps += [
            Step(
                "check-no-raycluster",
                f"Refuse while RayCluster {ns}/{r.cluster_name} (of --mode raycluster) exists: its worker pods hold "
                "the GPU nodes, and the RayJob's own RayCluster would wait for GPUs until its start deadline. "
                "Nothing is deleted; the message names the command that deletes it.",
            ),
            Step(
                "code-configmap",
                f"Store the raytrain_eks package (a tar.gz) as ConfigMap {ns}/{r.cluster_name}-code; the RayJob's "
                f"submitter pod mounts it at {job_files.SUBMITTER_ARCHIVE_DIR} and unpacks it into "
                f"{job_files.SUBMITTER_CODE_DIR}, where the job's runtime_env ships it to every worker from "
                "(py_modules). Server-side apply: the package is too large for kubectl's last-applied annotation. "
                f"Packages that travel unpacked (below) go as ConfigMap {ns}/{r.cluster_name}-packages, unpacked by "
                f"the submitter pod into {job_files.SUBMITTER_PACKAGES_DIR}.",
                [*kubectl, "apply", "--server-side", "-f", CODE_CONFIG_MAP_FILE],
                [CODE_CONFIG_MAP_FILE],
            ),
            Step(
                "apply-rayjob",
                f"Apply RayJob {ns}/{r.cluster_name}: its own RayCluster ({workers}) runs "
                f"{shlex.join(m.train_argv())}, submitted by its submitter pod under {m.IMAGE_PYTHON}; {sharding}; "
                f"the job is stopped after {r.job_deadline_s} s, or if it is not running within "
                f"{r.job_start_deadline_s} s. "
                f"KubeRay deletes the cluster {m.RAYJOB_TTL_S} s after the job ended unless submit has (below). "
                "Its runtime_env is fixed before a pod exists, so submit first asks the image which of "
                + _job_packages(cfg)
                + " it has in range (what an earlier submit remembered of it, else a short-lived pod of the image on "
                "a node the workers use) and applies the RayJob with only the others; the file here lists them all "
                "for pip. " + image_installs(cfg)["how"],
                [*kubectl, "apply", "-f", manifest],
                [manifest],
            ),
            Step("wait-rayjob", "Follow the job until it succeeds or fails."),
        ]
    if cfg.ray.offline:  # before the token's Secret, the job's ConfigMap and any Ray object
        at = next(i for i, s in enumerate(steps) if s.name in ("hf-token-secret", "job-config"))
        steps.insert(at, Step("offline-wheelhouse", _offline_step(cfg, mode)))
    return steps


def planned_sharding(cfg: Config) -> dict[str, object]:
    """For plan.json: the sharding the job's ``training.sharding`` gives on the planned GPUs, the one the memory
    estimate assumes: ``mode``, ``mesh_shape`` (``[nodes, ranks per node]`` for hsdp, ``[ranks]`` for fsdp, ``[]``
    for none) and ``line`` (:func:`~raytrain_eks.deploy.fit.sharding_line`, which the job's step says too)."""
    layout = planned_layout(cfg)
    return {"mode": layout.mode, "mesh_shape": list(layout.mesh_shape), "line": sharding_line(cfg)}


class ImageInstalls(TypedDict):
    """How the job's packages beyond the image reach it (:func:`image_installs`)."""

    installs: list[str] | None
    ships: list[str] | None
    local_only: list[str]
    how: str


# How submit brings what the image lacks, in words (deploy/offline.py's choose).
_PACKAGES_RULE = (
    "submit downloads here the wheels of what the image lacks in range, for its Python: pure-Python ones travel "
    "unpacked beside the package (py_modules), so the runtime_env has no pip and no node copies the image's Python; "
    "compiled ones (or more than {max} packages) pip installs, after Ray copies the image's whole virtualenv on every "
    "node"
)


def image_installs(cfg: Config) -> ImageInstalls:
    """How the job's packages beyond ``ray.image`` reach it, where this tool knows the image's packages
    (:func:`~raytrain_eks.k8s.job.planned_installs`): ``installs``, what pip installs, and ``ships``, what travels
    unpacked in py_modules (:func:`~raytrain_eks.k8s.job.expected_not_shipped`; both ``None`` for an image not
    known); ``local_only``, what the job never gets on the cluster; ``how``, that in words. Example (the DLC):
    ``{"installs": [], "ships": ["peft>=0.21.2,<0.22"], "local_only": ["matplotlib"], "how": "The image has 9 of
    ..."}``."""
    local = sorted(job_files.LOCAL_ONLY)
    kept = " ".join(
        f"{name} is not shipped: on an image without it {job_files.WITHOUT_LOCAL_ONLY[name]}." for name in local
    )
    rule = _PACKAGES_RULE.format(max=job_files.MAX_SHIPPED)
    known = job_files.planned_installs(cfg.ray.image)
    if known is None:
        how = f"Which of them {cfg.ray.image} has is known only once it runs (submit says so): {rule}. {kept}"
        return {"installs": None, "ships": None, "local_only": local, "how": how}
    left, said = known
    if not left:
        return {"installs": [], "ships": [], "local_only": local, "how": f"{said}: the job adds nothing. {kept}"}
    why = job_files.expected_not_shipped(cfg.ray.image, left)
    if why is None:
        how = (
            f"{said}: {', '.join(left)} {'travels' if len(left) == 1 else 'travel'} unpacked beside the package "
            "(py_modules), as pure-Python wheels whose dependencies the image has (so are the copies installed "
            "here; submit checks the wheels it downloads for the image's Python): the runtime_env has no pip, and "
            f"no node copies the image's Python. {kept}"
        )
        return {"installs": [], "ships": left, "local_only": local, "how": how}
    how = (
        f"{said}: pip installs {', '.join(left)} there ({why}), after Ray copies the image's whole virtualenv on "
        f"every node. {kept}"
    )
    return {"installs": left, "ships": [], "local_only": local, "how": how}


def _offline_step(cfg: Config, mode: Mode) -> str:
    """What ``submit --offline`` does; the wheels and their size are known only once the image is asked."""
    sources = ["the Ray head pod's python3 when this RayCluster already runs"] if mode == "raycluster" else []
    if not wheelhouse.on_volume(cfg):  # a wheelhouse for the volume is written through a pod: one is always asked
        sources.append("what an earlier `submit --offline` remembered of this image")
    sources.append(
        f"a short-lived pod {cfg.ray.namespace}/{cfg.ray.cluster_name}{wheelhouse.PROBE_POD_SUFFIX} of the image on a "
        "node the workers use (deleted again)"
    )
    return (
        "--offline, before any Ray object: read the image's Python, platform tags and packages from "
        + ", else from ".join(sources)
        + ". Download here wheels (`pip download --no-deps --only-binary=:all:` for that Python "
        "and platform) of those of " + _job_packages(cfg) + " the image lacks in range and of "
        "their dependencies the image does not meet; submit prints each wheel and the total size, and stops "
        "(exit 2) naming a package without a wheel. When every one is pure Python they travel unpacked beside the "
        "package (py_modules), and what follows is not done. "
        + (
            f"Write them through that pod onto ray.shared_volume {cfg.ray.shared_volume} at "
            f"{wheelhouse.storage_location(cfg)}/DIGEST (in pieces, each file checked against the manifest, which is "
            "written last); every Ray pod mounts it, and the runtime_env installs with --no-index --find-links there."
            if wheelhouse.on_volume(cfg)
            else "Upload them with a manifest (names, sizes, sha256; written last) to "
            f"{cfg.training.storage_path or 'training.storage_path'}/{wheelhouse.STORAGE_FOLDER}/DIGEST; every Ray "
            f"pod copies them into {wheelhouse.WHEELS_DIR}/DIGEST (an init container"
            + (", and an exec in pods of an earlier RayCluster" if mode == "raycluster" else "")
            + "), and the runtime_env installs with --no-index --find-links there."
        )
    )


def job_objects(
    cfg: Config, mode: Mode, *, hf_token: bool
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], str]:
    """What :func:`job_steps` applies and reads, on any target: the files (the job's ConfigMap, the RayCluster or
    the RayJob with its code ConfigMap, the namespace when not ``default``), the texts (the package archive of
    ``--mode raycluster``), and the folder of the head pod the package is unpacked into."""
    shipped = job_files.package_files()
    texts: dict[str, str] = {}
    files: dict[str, list[dict[str, Any]]] = {JOB_CONFIG_FILE: [m.job_config_map(cfg)]}
    if mode == "raycluster":
        files[MANIFEST_FILE[mode]] = [m.raycluster(cfg, hf_token=hf_token)]
        texts[PACKAGE_ARCHIVE_FILE] = job_files.package_archive(shipped)
    else:
        code_map, items = job_files.code_config_map(cfg, shipped)
        job = job_files.rayjob_manifest(cfg, hf_token=hf_token, code_map=code_map, items=items)
        files[MANIFEST_FILE[mode]] = [job]
        files[CODE_CONFIG_MAP_FILE] = [code_map]
    if cfg.ray.namespace != "default":
        files[NAMESPACE_FILE] = [m.namespace(cfg)]
    return files, texts, job_files.head_code_dir(shipped)


def helm_files(releases: list[HelmRelease]) -> dict[str, list[dict[str, Any]]]:
    """``helm-releases.yaml`` (every pinned release) and each release's values file."""
    files: dict[str, list[dict[str, Any]]] = {HELM_FILE: [{"releases": [r.to_dict() for r in releases]}]}
    files.update({r.values_file: [r.values] for r in releases})
    return files


# S3 Standard in us-east-1, per GB-month (first 50 TB); what the kept checkpoints cost while they are kept.
S3_STANDARD_USD_PER_GB_MONTH = 0.023
# One sharded checkpoint holds, for each trained parameter, its fp32 weight and AdamW's two fp32 moments.
CHECKPOINT_BYTES_PER_PARAM = 12


def storage_estimate(cfg: Config, *, where: str = "S3") -> dict[str, Any] | None:
    """What the kept checkpoints of one run take, and in S3 what they cost a month (S3 Standard, us-east-1):
    ``where`` names the storage, and only ``"S3"`` is priced. ``None`` for a model whose shape is not known here
    (:func:`raytrain_eks.train.memory.model_shape`). A full fine-tune keeps every parameter, a LoRA run its adapters
    only (the frozen base is never saved). Qwen2.5-1.5B, 2 kept: 37.0 GB, $0.85 a month."""
    from raytrain_eks.train.memory import lora_params, model_shape

    t = cfg.training
    shape = model_shape(t.model_id)
    if shape is None:
        return None
    lora = t.adapters is not None
    params = lora_params(shape, t.lora) if lora else shape.params
    gb = params * CHECKPOINT_BYTES_PER_PARAM * t.keep_checkpoints / 1e9
    trained = (
        f"the {params:,} adapter parameters of LoRA rank {t.lora.rank} (the frozen base is never saved)"
        if lora
        else f"all {params:,} parameters"
    )
    priced = where == "S3"
    return {
        "kept_checkpoints": t.keep_checkpoints,
        "trained_parameters": params,
        "bytes_per_checkpoint": params * CHECKPOINT_BYTES_PER_PARAM,
        "gb": round(gb, 3 if gb < 1 else 1),
        "where": where,
        "usd_per_month": round(gb * S3_STANDARD_USD_PER_GB_MONTH, 2) if priced else None,
        "basis": f"{CHECKPOINT_BYTES_PER_PARAM} bytes (fp32 weight and AdamW moments) for each of {trained} per "
        "checkpoint"
        + (
            f", S3 Standard ${S3_STANDARD_USD_PER_GB_MONTH}/GB-month"
            if priced
            else f"; the price of {where} is not known here"
        )
        + "; exports add 2-4 bytes a parameter each",
    }


def checkpoints_on_volume(cfg: Config) -> bool:
    """Whether ``training.storage_path`` is on ``ray.shared_volume`` (its mount path or a folder under it)."""
    stored, mount = cfg.training.storage_path or "", cfg.ray.shared_volume_path
    return bool(cfg.ray.shared_volume) and (stored == mount or stored.startswith(f"{mount}/"))


def checkpoint_storage(cfg: Config) -> dict[str, Any] | None:
    """:func:`storage_estimate` for where the checkpoints go: S3 (priced), the shared
    volume, or another place (size only)."""
    stored = cfg.training.storage_path or ""
    if checkpoints_on_volume(cfg):
        where = f"ray.shared_volume {cfg.ray.shared_volume}"
    else:
        where = "S3" if stored.startswith("s3://") else stored or "the run folder"
    return storage_estimate(cfg, where=where)


def write_files(plan: Plan, out_dir: str | Path) -> list[Path]:
    """Write a built ``plan``'s files and ``plan.json`` under ``out_dir`` (created); returns the paths written.
    Example: ``write_files(plan, "plan-out")[-1].name == "plan.json"``."""
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise UserError(f"--output-dir {str(root)!r} is a file", hint="Give a folder (it is created if missing).")
    written = []
    for rel, docs in sorted(plan.files.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(to_yaml(docs))
        written.append(path)
    for rel, text in sorted(plan.texts.items()):
        path = root / rel
        path.write_text(text)
        written.append(path)
    path = root / PLAN_FILE
    path.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    written.append(path)
    return written
