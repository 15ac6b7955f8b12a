"""The deploy steps of ``up``, ``status`` and ``down``, as functions over one :class:`Deployment`.

A :class:`Deployment` bundles the configuration, the Kubernetes interface (:class:`~raytrain_eks.k8s.cluster.KubeApi`),
the runner for eksctl and helm (:class:`~raytrain_eks.k8s.runner.Runner`) and the :class:`StateStore` that remembers,
in ``.raytrain-eks/state.json`` of the working folder, the region and zones chosen and everything created. Every
step looks before it acts, and records what it is about to create *before* creating it, so re-running after a
failure resumes and ``down`` finds even what a crash left half made. Example::

    d = Deployment(cfg, kube=KubernetesApi(store.kubeconfig), run=runner.run, state=StateStore(".raytrain-eks"))
    up(d, confirm=lambda question: True)        # cluster -> node groups -> device plugins -> KubeRay
    down(d, confirm=lambda question: True)      # everything up and submit created, in reverse order

``up``: the cluster (eksctl, private subnets behind one NAT gateway), the system node group, the EFA GPU node group
in one zone (the next zone when one cannot launch the instances, after removing the failed group), the pinned
device-plugin and KubeRay charts (helm), and then the proof: the plugins' DaemonSets Ready on every GPU node and
every GPU node advertising ``nvidia.com/gpu`` and ``vpc.amazonaws.com/efa``, not merely helm's exit status. On an
existing cluster (``cluster.existing``) the device plugins and KubeRay it already runs are kept, and only what it
lacks is installed and recorded, so ``down`` removes only that (:func:`kept_addons`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from raytrain_eks.aws import eksctl
from raytrain_eks.aws.stacks import NotEksctlStack
from raytrain_eks.config import Config
from raytrain_eks.deploy.fit import fit_on_image
from raytrain_eks.eks.buckets import bucket_exists, bucket_objects, delete_bucket, ensure_bucket, kept_note
from raytrain_eks.eks.irsa import CONFIG_FILE as SERVICE_ACCOUNT_FILE
from raytrain_eks.eks.irsa import OIDC_ITEM, delete_oidc_provider, ensure_service_account
from raytrain_eks.eks.irsa import create_argv as create_service_account_argv
from raytrain_eks.eks.irsa import delete_created as delete_service_account
from raytrain_eks.eks.nodegroups import (
    CLUSTER_TIMEOUT_S,
    NODEGROUP_TIMEOUT_S,
    Placement,
    as_after_gpu_nodegroup,
    choose_zones,
    cluster_status,
    create_nodegroup_argv,
    created_gpu_node_labels,
    delete_cluster_argv,
    delete_cluster_stack,
    delete_nodegroup_argv,
    eksctl_copies,
    ensure_cluster,
    ensure_gpu_nodegroup,
    ensure_system_nodegroup,
    gpu_node_spec,
    gpu_node_taints,
    kubeconfig_argv,
    leftover_cluster_stack,
    no_existing_cluster,
    nodegroup_statuses,
    remove_eksctl_device_plugins,
)
from raytrain_eks.eks.pricing import check_deployable, cost_per_hour
from raytrain_eks.eks.programs import command_steps, declared_programs, require_programs
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import (
    KUBERAY_RELEASE,
    RAYCLUSTER_CRD,
    delete_recorded,
    ensure_release,
    gpu_node_lines,
    helm_releases,
    install_argv,
    placement_refusal,
    running_plugins,
    wait_gpu_nodes,
    wait_kuberay,
)
from raytrain_eks.k8s.kuberay_fields import check_kuberay_fields
from raytrain_eks.k8s.raypods import ray_lines
from raytrain_eks.k8s.runner import Interrupted
from raytrain_eks.k8s.state import KUBECONFIG_FILE, STATE_DIR, Cancelled, Deployment, Item, describe


@dataclass(frozen=True)
class Action:
    """One thing ``up`` does, for ``up --plan``: a name, what it does, and the command when it is one."""

    name: str
    what: str
    argv: list[str] | None = None


@dataclass
class UpResult:
    gpu_az: str
    gpu_nodes: list[str]
    created: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------
# up
# ----------------------------------------------------------------------------------------------------------------


def _check_state_matches(d: Deployment) -> None:
    c, s = d.cfg.cluster, d.state
    if s.created and (s.get("cluster"), s.get("region")) != (c.name, c.region):
        raise UserError(
            f"this folder's {s.path} belongs to cluster {s.get('cluster')} in {s.get('region')}, not {c.name} in "
            f"{c.region}",
            hint="Run `raytrain-eks down` for that cluster first, or work in another folder.",
        )


def planned_actions(cfg: Config) -> list[Action]:
    """What ``up`` does when nothing exists yet, in order, for ``up --plan``. Needs no credentials, creates nothing."""
    gpu, _ = check_deployable(cfg)
    c = cfg.cluster
    if c.gpu_az:
        zones = f"zone {c.gpu_az}"
    elif c.availability_zones:
        zones = f"the first of {', '.join(c.availability_zones)} that can launch it"
    else:
        zones = f"the first zone of {c.region} offering {gpu.name} that can launch it (EC2 is asked at deploy)"
    state = f"{STATE_DIR}/"
    actions = [
        Action(
            "preflight",
            f"Check the configuration, that the programs up runs are installed ({declared_programs('up')}), and the "
            f"zones ({zones}).",
        ),
        Action(
            "create-cluster",
            f"Create EKS cluster {c.name} (Kubernetes {c.k8s_version}, private subnets behind one NAT gateway) "
            "without node groups.",
            eksctl.create_cluster_argv(f"{state}eksctl-cluster.yaml", kubeconfig=f"{state}{KUBECONFIG_FILE}"),
        ),
        Action(
            "kubeconfig",
            "Write the cluster's kubeconfig into this folder; helm and the Kubernetes client use only that file.",
            kubeconfig_argv(cfg, f"{state}{KUBECONFIG_FILE}"),
        ),
        Action(
            "iam-service-account",
            f"Make sure the Ray pods' service account {cfg.ray.namespace}/{m.RAY_SERVICE_ACCOUNT} exists with an IAM "
            "role that may use the checkpoint bucket (and its KMS key, when one encrypts it), on a cluster this "
            "folder did not create too; nothing is run when it does. Else the cluster gets its IAM OIDC provider "
            "when it has none (`eksctl utils associate-iam-oidc-provider`), then this; an existing role whose policy "
            "does not fit is updated with `eksctl update iamserviceaccount` instead.",
            create_service_account_argv(f"{state}{SERVICE_ACCOUNT_FILE}"),
        ),
        Action(
            "nodegroup-system",
            f"Create node group {eksctl.SYSTEM_NODEGROUP} ({c.system_node_count} x {c.system_node_type}).",
            create_nodegroup_argv(Path(f"{state}eksctl-nodegroup-{eksctl.SYSTEM_NODEGROUP}.yaml")),
        ),
        Action(
            "nodegroup-gpu",
            f"Create EFA node group {c.gpu_nodegroup_name} ({c.gpu_node_count} x {gpu.name}) in {zones}; when a "
            "zone cannot launch the instances, say why, remove the failed group and try the next zone.",
            create_nodegroup_argv(Path(f"{state}eksctl-nodegroup-{c.gpu_nodegroup_name}.yaml")),
        ),
        Action(
            "remove-eksctl-device-plugins",
            f"Delete the device-plugin DaemonSets eksctl applies by itself ({eksctl.EKSCTL_EFA_PLUGIN_DAEMONSET}, "
            f"{eksctl.EKSCTL_NVIDIA_PLUGIN_DAEMONSET}) unless Helm's metadata shows one is the pinned chart's own "
            "(the EFA chart's DaemonSet has eksctl's name), so only the pinned charts run; a chart whose DaemonSet "
            "eksctl replaced is installed again.",
        ),
    ]
    for rel in helm_releases(cfg):
        argv = install_argv(rel, f"{state}{rel.values_file}", f"{state}{KUBECONFIG_FILE}")
        actions.append(Action(f"helm-{rel.name}", f"Install {rel.chart} {rel.version}: {rel.purpose}.", argv))
    actions += [
        Action(
            "check-gpu-nodes",
            f"Wait until both device-plugin DaemonSets are Ready on every GPU node and each node advertises "
            f"{m.GPU_RESOURCE}={cfg.derived.ray_gpus_per_worker_pod} and {m.EFA_RESOURCE}={gpu.efa_interfaces}.",
        ),
        Action("check-kuberay", "Wait for the RayCluster CRD and a Ready KubeRay operator pod."),
    ]
    return actions


def kept_addons(d: Deployment) -> dict[str, str]:
    """On an existing cluster: the add-ons it already runs, which ``up`` keeps and does not install (release name ->
    what was found); ``{}`` on a cluster this folder creates. A :class:`UserError`, before anything is made, when
    a kept device plugin's pods would not run on the GPU node group's nodes.

    A device plugin counts as there when a DaemonSet of its image runs in any namespace (a Helm release of any name,
    eksctl's manifest, the GPU operator; :func:`~raytrain_eks.k8s.addons.running_plugins`); KubeRay when the CRD
    exists (the ``kubernetes`` target's rule). What this folder installed itself, and eksctl's copy applied for its
    own node group (:func:`~raytrain_eks.eks.nodegroups.eksctl_copies`), does not count. Whether a plugin's pods
    would run on the new nodes is read from its node selector, required node affinity and tolerations against the
    labels and taints the node group gives its nodes.
    """
    cfg = d.cfg
    if not cfg.cluster.existing:
        return {}
    ours = {i["name"] for i in d.state.created if i["type"] == "helm"}
    releases = helm_releases(cfg)
    ignore = {(r.namespace, r.workload[1]) for r in releases if r.name in ours}
    ignore |= {("kube-system", name) for name in eksctl_copies(d)}
    found = running_plugins(d, ignore)
    labels, taints = created_gpu_node_labels(cfg), gpu_node_taints(cfg)
    kept: dict[str, str] = {}
    problems: list[str] = []
    for rel in releases:
        if rel.name in ours:
            continue
        if rel.name == KUBERAY_RELEASE:
            if d.kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", RAYCLUSTER_CRD) is not None:
                check_kuberay_fields(d)
                kept[rel.name] = f"KubeRay (CRD {RAYCLUSTER_CRD})"
            continue
        plugins = found.get(rel.name, [])
        if not plugins:
            continue
        kept[rel.name] = ", ".join(p.where for p in plugins)
        refusals = []
        for p in plugins:
            after = as_after_gpu_nodegroup(d, p.namespace, p.name, p.pod_spec)
            why = placement_refusal(after, labels, taints)
            if why is not None and after is not p.pod_spec:
                why += " once eksctl has applied its own EFA manifest over it, as it does for every EFA node group"
            refusals.append((p, why))
        if all(why is not None for _, why in refusals):
            problems += [f"{p.where} (the cluster's {rel.name}): {why}" for p, why in refusals]
    if problems:
        shown = ", ".join(f"{k}={v}" for k, v in m.GPU_NODE_LABELS.items())
        taint = ", ".join(f"{t['key']}={t['value']}:{t['effect']}" for t in taints)
        raise UserError(
            f"cluster {cfg.cluster.name} already runs device plugins whose pods would not run on the new GPU nodes "
            f"(labels {shown}, taint {taint}); nothing was created:\n" + "\n".join(f"  - {p}" for p in problems),
            hint="Let that DaemonSet select those nodes and tolerate that taint (its chart's values: nodeSelector or "
            "affinity, tolerations); for eksctl's EFA DaemonSet, which eksctl replaces, run AWS's EFA chart under "
            "another release name instead (tolerating the taint) and delete eksctl's. Then run `raytrain-eks up` "
            "again: it keeps the cluster's plugins and installs only what the cluster lacks.",
        )
    return kept


@contextlib.contextmanager
def _say_state_when_interrupted(d: Deployment) -> Iterator[None]:
    """An :class:`~raytrain_eks.k8s.runner.Interrupted` (Ctrl-C or SIGTERM during eksctl or helm) leaves with what the
    state file records, so the user knows what exists before running the command again."""
    try:
        yield
    except Interrupted as exc:
        recorded = [describe(i) for i in d.state.created]
        if recorded:
            state = f"{d.state.path} records (some may be half made): " + "; ".join(recorded) + "."
        else:
            state = f"{d.state.path} records nothing created yet."
        raise exc.with_state(state) from None


def up(
    d: Deployment,
    *,
    confirm: Callable[[str], bool],
    offered_zones: Callable[[], Placement] | None = None,
) -> UpResult:
    """Create or resume the whole infrastructure; returns the GPU zone and nodes. Asks ``confirm`` once.

    Order: preflight -> cluster -> the Ray pods' service account and IAM role -> system node group -> GPU node
    group (zone by zone) -> eksctl's own plugins removed -> pinned charts -> GPU nodes proven ready -> KubeRay
    Ready. Each step skips what exists. Ctrl-C or SIGTERM stops the running eksctl or helm and raises
    :class:`~raytrain_eks.k8s.runner.Interrupted` naming what the state file records.
    """
    with _say_state_when_interrupted(d):
        return _up(d, confirm=confirm, offered_zones=offered_zones)


def _up(d: Deployment, *, confirm: Callable[[str], bool], offered_zones: Callable[[], Placement] | None) -> UpResult:
    cfg = d.cfg
    c = cfg.cluster
    gpu, system = check_deployable(cfg)
    _, memory = fit_on_image(cfg, gpu)  # DoesNotFit: a run that cannot fit the GPUs is stopped before any node
    if memory is not None:
        d.say(memory.line)
    require_programs(d, "up", steps_of=command_steps)  # every program up runs, all the missing ones named at once
    _check_state_matches(d)
    if c.existing and cluster_status(d) is None:
        raise no_existing_cluster(cfg)  # before anything is asked or made (the bucket comes first)
    kept = kept_addons(d)
    plan = choose_zones(cfg, d.state, offered_zones)
    cost = cost_per_hour(cfg, gpu, system)["total_usd"]
    where = f"cluster {c.name} in {c.region}"
    nat = "" if c.existing else ", a NAT gateway"
    question = (
        (f"Use existing {where}, adding" if c.existing else f"Create (or resume) {where}:")
        + f" {c.gpu_node_count} x {gpu.name} in {' or '.join(plan.candidates)}, {c.system_node_count} x "
        f"{system.name}{nat}; about ${cost:.2f} per hour until `raytrain-eks down`."
        + "".join(f" Keeping the cluster's {rel} ({what})." for rel, what in kept.items())
        + " Continue?"
    )
    if not confirm(question):
        raise Cancelled("cancelled: nothing was created")
    d.state.update(
        cluster=c.name, region=c.region, cluster_azs=list(plan.cluster_azs), reservations=plan.reservations or None
    )
    ensure_bucket(d)  # first: the cluster's IAM role for the Ray pods names it
    ensure_cluster(d, plan)
    ensure_service_account(d)  # on any cluster: one this folder did not create, or an up resumed after the cluster
    ensure_system_nodegroup(d, plan)
    az = ensure_gpu_nodegroup(d, plan)
    remove_eksctl_device_plugins(d)
    for rel in helm_releases(cfg):
        if rel.name in kept:
            d.say(f"Keeping the cluster's {rel.name}: {kept[rel.name]}")
        else:
            ensure_release(d, rel)
    spec = gpu_node_spec(cfg, az)  # the kept plugins are proven by what the nodes advertise
    nodes = wait_gpu_nodes(d, dataclasses.replace(spec, plugins=tuple(p for p in spec.plugins if p not in kept)))
    if KUBERAY_RELEASE not in kept:
        wait_kuberay(d)
    d.state.update(phase="up")
    d.say(f"Ready: cluster {c.name} in {c.region}, GPU nodes in {az}. Next: `raytrain-eks submit`.")
    return UpResult(gpu_az=az, gpu_nodes=[n.name for n in nodes], created=[describe(i) for i in d.state.created])


# ----------------------------------------------------------------------------------------------------------------
# down
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class DownResult:
    deleted: list[str]
    leftovers: list[str] | None  # None: AWS could not be asked
    kept: list[str] = field(default_factory=list)  # what down keeps on purpose (a bucket holding checkpoints)


def _delete(d: Deployment, item: Item, cluster: str | None) -> bool:
    """Delete one created item if it still exists; ``True`` when something was deleted. ``cluster``: the EKS
    cluster's status, ``None`` when EKS has no such cluster."""
    kind, cluster_exists = item["type"], cluster is not None
    if kind == "bucket":
        if not bucket_exists(d, item["name"]):
            return False
        delete_bucket(d, item["name"])
        return True
    if kind == "iamserviceaccount":  # made by `eksctl create iamserviceaccount` (on a cluster up did not create)
        return delete_service_account(d, cluster_exists, item)
    if kind == OIDC_ITEM:  # made by `eksctl utils associate-iam-oidc-provider` for that service account
        return delete_oidc_provider(d, item, cluster)
    if kind in ("object", "helm"):
        return cluster_exists and delete_recorded(d, item)
    if kind == "nodegroup":
        if not cluster_exists or item["name"] not in nodegroup_statuses(d):
            return False
        d.run(delete_nodegroup_argv(d.cfg, item["name"]), timeout=NODEGROUP_TIMEOUT_S, on_output=d.say)
        return True
    if kind == "cluster":
        c = d.cfg.cluster
        if cluster_exists:
            d.run(
                delete_cluster_argv(d.cfg),
                timeout=CLUSTER_TIMEOUT_S,
                on_output=d.say,
                hint="Run `raytrain-eks down` again; if it keeps failing, the CloudFormation console shows which "
                f"resource of the stacks eksctl-{c.name}-* could not be deleted.",
            )
            return True
        # A create that failed: EKS has no cluster, its stack holds the name (and maybe a VPC). eksctl cannot delete
        # it (`eksctl delete cluster` stops at the missing cluster, and with --force dies on it), so CloudFormation
        # does, once the stack's termination protection is off.
        if leftover_cluster_stack(d) is None:
            return False
        try:
            return delete_cluster_stack(d, f"while EKS has no cluster {c.name}")
        except NotEksctlStack as exc:
            d.say(f"{exc.message}. {exc.hint}")
            return False
    raise ValueError(f"unknown item in the state file: {item}")


def billable_leftovers(d: Deployment) -> list[str] | None:
    """Things that still cost money after ``down`` (NAT gateways, Elastic IPs, instances tagged with the cluster's
    name), each with the command that deletes it, looked up through boto3 in the cluster's region (see
    :func:`raytrain_eks.aws.services.billable_leftovers`); ``None`` when AWS could not be asked (the reason is said).
    """
    from raytrain_eks.aws.services import billable_leftovers as lookup
    from raytrain_eks.aws.session import connect

    c = d.cfg.cluster
    try:
        found = lookup(connect(c.region), c.region, c.name)
    except UserError as exc:
        d.say(f"Could not check for leftover NAT gateways, Elastic IPs or instances: {exc.message}")
        return None
    return [x.describe() for x in found]


def down(d: Deployment, *, confirm: Callable[[str], bool], delete_checkpoints: bool = False) -> DownResult:
    """Delete everything ``up`` and ``submit`` created from this folder, newest first, after one confirmation;
    then check that nothing billable is left. A second ``down`` finds nothing recorded and does nothing. Ctrl-C or
    SIGTERM stops the running eksctl or helm; what is not deleted yet stays recorded."""
    with _say_state_when_interrupted(d):
        return _down(d, confirm=confirm, delete_checkpoints=delete_checkpoints)


def _kept_buckets(d: Deployment, created: list[Item], delete_checkpoints: bool) -> dict[str, str]:
    """Buckets this folder created that down keeps: those holding anything, unless ``delete_checkpoints``."""
    if delete_checkpoints:
        return {}
    kept = {}
    for item in created:
        if item["type"] == "bucket":
            try:
                objects = bucket_objects(d, item["name"])
            except UserError as exc:  # never delete what cannot be looked into
                kept[item["name"]] = (
                    f"Kept s3://{item['name']}: could not look into it ({exc.message.splitlines()[0]}). "
                    "Run `raytrain-eks down` again once AWS can be asked."
                )
                continue
            if objects:
                kept[item["name"]] = kept_note(item["name"], objects)
    return kept


def _down(d: Deployment, *, confirm: Callable[[str], bool], delete_checkpoints: bool = False) -> DownResult:
    require_programs(d, "down", steps_of=command_steps)  # what deleting the recorded items runs, before asking
    created = d.state.created
    kept = _kept_buckets(d, created, delete_checkpoints)
    keep = [i for i in created if i["type"] == "bucket" and i["name"] in kept]
    created = [i for i in created if i not in keep]
    if not created and keep:
        for note in kept.values():
            d.say(note)
        return DownResult(deleted=[], leftovers=[], kept=list(kept.values()))
    if not created and d.state.get("leftovers"):
        # The last down deleted everything it had made but found things still billed: look again.
        return DownResult(deleted=[], leftovers=_check_leftovers(d))
    if not created:
        d.say(f"Nothing to delete: no deployment is recorded in {d.state.path}.")
        return DownResult(deleted=[], leftovers=[])
    listing = "\n".join(f"  - {describe(i)}" for i in reversed(created))
    keeping = "".join(f"\nKeep: {note}" for note in kept.values())
    if not confirm(f"Delete, in this order:\n{listing}{keeping}\nContinue?"):
        raise Cancelled("cancelled: nothing was deleted")
    cluster = cluster_status(d)
    deleted = []
    for item in reversed(created):
        if _delete(d, item, cluster):
            d.say(f"Deleted {describe(item)}")
            deleted.append(describe(item))
        d.state.forget(item)
    leftovers = _check_leftovers(d)
    for item in keep:  # remembered, so that `down --delete-checkpoints` finds it later
        d.state.record(item)
        d.state.update(bucket=item["name"])
        d.say(kept[item["name"]])
    return DownResult(deleted=deleted, leftovers=leftovers, kept=list(kept.values()))


def _check_leftovers(d: Deployment) -> list[str] | None:
    """After the deletes: raise, keeping the state, while something billable is left, or while AWS cannot be asked
    about what the last ``down`` found left; else clear the state."""
    leftovers = billable_leftovers(d)
    recorded = d.state.get("leftovers")
    if leftovers is None and recorded:
        raise UserError(
            "these still cost money at the last `raytrain-eks down`, and AWS could not be asked now whether they "
            "are gone:\n" + "\n".join(f"  - {x}" for x in recorded),
            hint="Fix the AWS access named above, then run `raytrain-eks down` again to check.",
        )
    if leftovers:
        d.state.update(leftovers=leftovers)
        raise UserError(
            "these still cost money after the cluster was deleted:\n" + "\n".join(f"  - {x}" for x in leftovers),
            hint="Delete them with the commands shown, then run `raytrain-eks down` again to check.",
        )
    d.state.clear()
    if leftovers is not None:
        d.say("Nothing billable is left from this deployment.")
    return leftovers


# ----------------------------------------------------------------------------------------------------------------
# status
# ----------------------------------------------------------------------------------------------------------------


def status(d: Deployment) -> list[str]:
    """Readable lines: what this folder deployed, the cluster, the GPU nodes and the Ray pods and job."""
    s, c = d.state, d.cfg.cluster
    if not s.created and not s.get("cluster"):
        return [f"Nothing deployed from this folder ({s.path} does not exist). Start with `raytrain-eks up`."]
    require_programs(d, "status", steps_of=command_steps)
    lines = [f"Cluster {c.name} in {c.region}, GPU zone {s.get('gpu_az') or 'not chosen yet'}"]
    lines += [f"  created: {describe(i)}" for i in s.created]
    cluster = cluster_status(d)
    lines.append(f"EKS cluster: {cluster or 'does not exist'}")
    if cluster != "ACTIVE":
        return lines
    for name, st in sorted(nodegroup_statuses(d).items()):
        lines.append(f"Node group {name}: {st}")
    return lines + gpu_node_lines(d, gpu_node_spec(d.cfg, s.get("gpu_az"))) + ray_lines(d)
