"""``raytrain-eks check``, and the same checks at the start of ``submit``: each GPU node proven in its Ray worker pod
(:mod:`raytrain_eks.health.node`) before a long run is paid for on it, and a failing node named with the evidence.
``check`` also runs the collective probe between each pair of GPU nodes, as a Ray job in the head pod
(``raytrain-eks probe --pairs``), and holds each pair's bus bandwidth against the nodes' line rate
(:mod:`raytrain_eks.health.pairs`, which says which node a slow pair blames).

With ``exclude``, each failing node is taken out of the job's way through its target
(:meth:`~raytrain_eks.deploy.target.ClusterTarget.exclude_node`: cordoned; on EKS the node group also replaces its
instance). Example::

    result = check_cluster(d, target_for(d.cfg), exclude=False, pairs=PairOptions(), upload=_upload_package)
    print("\\n".join(result.lines())); raise SystemExit(0 if result.ok else 1)
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from raytrain_eks.errors import UserError
from raytrain_eks.fabric.probe import ProbeSpec
from raytrain_eks.folders import NODE_CHECKS_ENV
from raytrain_eks.health.node import Expectation, NodeHealth, check_node, table
from raytrain_eks.health.pairs import MIN_BANDWIDTH_FRACTION, PairCheck, PairFigure, judge_pairs
from raytrain_eks.instances import INSTANCE_TYPES
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.cluster import ExecResult, Pod
from raytrain_eks.k8s.cuda import IMAGE_CUDA, MIN_DRIVER
from raytrain_eks.k8s.job import DASHBOARD, known_image_packages, runtime_env

if TYPE_CHECKING:
    from raytrain_eks.deploy.target import ClusterTarget
    from raytrain_eks.k8s.state import Deployment

#: Seconds one check command may take in a pod: ``dcgmi diag -r 1`` takes seconds, the rest less.
CHECK_TIMEOUT_S = 180.0
#: Seconds the pair probe's job may take in all: a Ray Train start (seconds to a minute) and the timed calls per pair.
PAIRS_TIMEOUT_S = 1800.0
#: The well-known label kubelet sets from the cloud provider: the node's instance type, hence its line rate.
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"

#: Puts the raytrain_eks package into the head pod and returns its folder there (``submit``'s upload).
Upload = Callable[["Deployment", Pod], str]


@dataclass(frozen=True)
class PairOptions:
    """How ``check`` measures each pair: the share of the line rate a pair must reach, the line rate when given
    (else ``fabric.expected_gbps``, else the nodes' instance type), and the probe's sizes: all_reduce (the gradient
    reduction's collective) from a quarter of ``max_bytes`` to ``max_bytes``, ``iters`` timed calls each."""

    fraction: float = MIN_BANDWIDTH_FRACTION
    expected_gbps: float | None = None
    max_bytes: int = 1 << 30
    iters: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise UserError(
                f"--min-bandwidth-fraction {self.fraction} is not a share of the line rate",
                hint="Give a number above 0 and at most 1, e.g. 0.5.",
            )
        if self.expected_gbps is not None and self.expected_gbps <= 0:
            raise UserError(f"--expected-gbps {self.expected_gbps} must be positive", hint="E.g. --expected-gbps 40.")
        self.spec()  # sizes and iterations: a ProbeError (a UserError) names a bad one

    def spec(self) -> ProbeSpec:
        return ProbeSpec(
            ops=("all_reduce",),
            min_bytes=max(1, self.max_bytes // 4),
            max_bytes=self.max_bytes,
            iters=self.iters,
            warmup=1,
        )


@dataclass
class ClusterHealth:
    """The checks of every GPU node, and what was done to the failing ones."""

    nodes: list[NodeHealth]
    excluded: list[str] = field(default_factory=list)
    pairs: PairCheck | None = None  # None: not measured (skipped, or fewer than two GPU nodes)

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.nodes) and (self.pairs is None or self.pairs.ok)

    @property
    def bad_nodes(self) -> list[str]:
        """The nodes that failed a check of their own, then those the slow pairs point at; a slow pair that holds a
        node failing its own checks is put down to that node, not to its other end."""
        named = [h.node for h in self.nodes if not h.ok]
        if self.pairs is None:
            return named
        failing = self.pairs.failing

        def explained(node: str) -> bool:
            return all(set(f.nodes) & (set(named) - {node}) for f in failing if node in f.nodes)

        return named + [n for n in self.pairs.suspects if n not in named and not explained(n)]

    def lines(self) -> list[str]:
        if self.ok:
            verdict = "every GPU node passed"
        elif self.bad_nodes:
            verdict = f"failing nodes: {', '.join(self.bad_nodes)}"
        elif self.pairs is not None and self.pairs.error:
            verdict = "the bandwidth between the nodes could not be measured"
        else:
            verdict = "a pair of nodes is slow, no one node is to blame"
        pairs = self.pairs.lines() if self.pairs else []
        return [*table(self.nodes), *pairs, *self.excluded, f"check: {verdict}"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "bad_nodes": self.bad_nodes,
            "nodes": [asdict(h) for h in self.nodes],
            "pairs": self.pairs.to_dict() if self.pairs else None,
            "excluded": self.excluded,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def expectation(d: Deployment) -> Expectation:
    """What each worker pod should see: the GPUs it requests, the EFA devices it requests (the type's interfaces
    on EKS, ``cluster.efa_per_node`` when set), and the driver the image's CUDA needs where the image is known."""
    known = known_image_packages(d.cfg.ray.image) is not None
    return Expectation(
        gpus=d.cfg.derived.ray_gpus_per_worker_pod,
        efa=m.efa_per_pod(d.cfg),
        min_driver=MIN_DRIVER if known else None,
        image_cuda=IMAGE_CUDA if known else None,
    )


def check_pods(d: Deployment, workers: Sequence[Pod]) -> list[NodeHealth]:
    """Every check, in each worker pod (one per GPU node), in node order."""
    expect = expectation(d)
    found = []
    for pod in sorted(workers, key=lambda p: p.node_name or p.name):

        def run(argv: list[str], pod: Pod = pod) -> ExecResult:
            return d.kube.exec(pod.namespace, pod.name, argv, timeout=CHECK_TIMEOUT_S)

        found.append(check_node(pod.node_name or "?", pod.name, run, expect))
    return found


def running_workers(d: Deployment) -> list[Pod]:
    """The running Ray worker pods of the deployment's RayCluster; a :class:`UserError` when there is none."""
    ns, name = d.cfg.ray.namespace, d.cfg.ray.cluster_name
    pods = d.kube.pods(ns, {"ray.io/cluster": name, "ray.io/node-type": "worker"})
    up = [p for p in pods if p.phase == "Running" and p.ready]
    if not up:
        raise UserError(
            f"no Ray worker pod of RayCluster {ns}/{name} is running: the checks run inside them, on each GPU node.",
            hint="Start the Ray pods with `raytrain-eks submit` (the checks run at its start), or see "
            "`raytrain-eks status`.",
        )
    return up


def check_cluster(
    d: Deployment,
    target: ClusterTarget,
    *,
    exclude: bool,
    pairs: PairOptions | None = None,
    upload: Upload | None = None,
) -> ClusterHealth:
    """Check every GPU node through its running worker pod and, with ``pairs`` (and ``upload``, how the package
    reaches the head pod), the bandwidth between each pair of them; with ``exclude``, take each failing node out
    through ``target``."""
    workers = running_workers(d)
    result = ClusterHealth(check_pods(d, workers))
    if pairs is not None and upload is not None and len(workers) > 1:
        result.pairs = measure_pairs(d, workers, pairs, upload)
    if exclude:
        _exclude(d, target, result)
    return result


def _exclude(d: Deployment, target: ClusterTarget, result: ClusterHealth) -> None:
    """Each failing node out through its target, then its worker pod deleted: cordoning leaves a running pod where it
    is, and KubeRay replaces a deleted worker on a node that can take it."""
    pods = {h.node: h.pod for h in result.nodes}
    for node in result.bad_nodes:
        result.excluded.extend(target.exclude_node(d, node))
        if node in pods and d.kube.delete("v1", "Pod", pods[node], d.cfg.ray.namespace):
            result.excluded.append(
                f"deleted worker pod {pods[node]}: KubeRay starts a new one on a node that can take it"
            )


def line_rate(d: Deployment, workers: Sequence[Pod], given: float | None) -> tuple[float | None, str | None]:
    """(Gbit/s, its source): ``given``, else ``fabric.expected_gbps``, else the network rate of the workers' instance
    type as its nodes' label names it (:data:`raytrain_eks.instances.INSTANCE_TYPES`, the EC2 figures of
    docs/reference/infra-facts.md: 40 Gbit/s for a g6.12xlarge, 3200 for a p5.48xlarge)."""
    if given is not None:
        return given, "--expected-gbps"
    if d.cfg.fabric.expected_gbps is not None:
        return d.cfg.fabric.expected_gbps, "fabric.expected_gbps"
    names = {p.node_name for p in workers}
    types = {n.labels.get(INSTANCE_TYPE_LABEL) for n in d.kube.nodes() if n.name in names}
    known = [INSTANCE_TYPES[t] for t in types if t in INSTANCE_TYPES]
    if len(known) != len(types) or not known:
        return None, None
    slowest = min(known, key=lambda it: it.network_gbps)  # a pair is as fast as its slower end
    return slowest.network_gbps, f"{slowest.name} network rate"


def pair_probe_argv(code_dir: str, spec: ProbeSpec) -> list[str]:
    """``ray job submit`` (waiting, its logs on stdout) of ``raytrain-eks probe --pairs --json`` in the head pod: the
    package travels in ``py_modules`` as the training job's does, and the image's torch and Ray are all it needs."""
    probe = [m.IMAGE_PYTHON, "-m", "raytrain_eks.cli", "probe", "--pairs", "--address", "auto", "--json"]
    probe += ["--ops", ",".join(spec.ops), "--min-bytes", str(spec.min_bytes), "--max-bytes", str(spec.max_bytes)]
    probe += ["--iters", str(spec.iters), "--warmup", str(spec.warmup)]
    env = json.dumps(runtime_env(code_dir, pip=[]))
    return ["ray", "job", "submit", "--address", DASHBOARD, "--runtime-env-json", env, "--", *probe]


def pairs_json(text: str) -> dict[str, Any] | None:
    """The probe's JSON within ``ray job submit``'s output (Ray's own lines above and below it), else ``None``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.rstrip() == "{"]
    ends = [i for i, line in enumerate(lines) if line.rstrip() == "}"]
    if not starts or not ends or ends[-1] < starts[0]:
        return None
    try:
        found = json.loads("\n".join(lines[starts[0] : ends[-1] + 1]))
    except ValueError:
        return None
    return found if isinstance(found, dict) and "pairs" in found else None


def measure_pairs(d: Deployment, workers: Sequence[Pod], opts: PairOptions, upload: Upload) -> PairCheck:
    """The pair probe's job in the head pod, its figures named by node (each Ray node's IP is its pod's), judged
    against the line rate."""
    ns, name = d.cfg.ray.namespace, d.cfg.ray.cluster_name
    heads = [p for p in d.kube.pods(ns, {"ray.io/cluster": name, "ray.io/node-type": "head"}) if p.phase == "Running"]
    rate, source = line_rate(d, workers, opts.expected_gbps)
    if not heads:
        return PairCheck([], rate, source, opts.fraction, error=f"no running head pod of RayCluster {ns}/{name}")
    d.say(f"Measuring the bandwidth between each pair of the {len(workers)} GPU nodes (skip with --skip-pairs)")
    head = heads[0]
    argv = pair_probe_argv(upload(d, head), opts.spec())
    res = d.kube.exec(head.namespace, head.name, argv, timeout=PAIRS_TIMEOUT_S, container="ray-head")
    found = pairs_json(res.stdout)
    if found is None:
        said = (res.stderr or res.stdout).strip().splitlines()
        error = f"the pair probe gave no result: {said[-1] if said else f'exit {res.returncode}'}"
        return PairCheck([], rate, source, opts.fraction, error=error)
    # Each Ray node goes by its pod's IP; the pods are read again, as the probe's nodes are those of now.
    pods = d.kube.pods(ns, {"ray.io/cluster": name, "ray.io/node-type": "worker"})
    node_of = {p.ip: p.node_name for p in [*workers, *pods] if p.ip and p.node_name}
    figures = [
        PairFigure(
            (node_of.get(pair["nodes"][0], pair["nodes"][0]), node_of.get(pair["nodes"][1], pair["nodes"][1])),
            pair.get("best_busbw_gbps"),
            None if pair.get("best_busbw_gbps") is not None else pair.get("reason"),
        )
        for pair in found["pairs"]
    ]
    return judge_pairs(figures, expected_gbps=rate, source=source, fraction=opts.fraction)


def before_job(
    d: Deployment,
    target: ClusterTarget,
    workers: Sequence[Pod],
    *,
    exclude: bool = False,
    upload: Upload | None = None,
) -> ClusterHealth:
    """``submit``'s gate: the checks in the job's worker pods and, with ``upload`` and more than one node, the
    bandwidth between each pair at ``check``'s defaults (:class:`PairOptions`), returned when all passed (the run
    folder keeps them: :func:`record_health`); a :class:`UserError` naming each failing node or slow pair and its
    evidence, so no run starts on it. Only the node checks run when one of them fails."""
    d.say(f"Checking the {len(workers)} GPU nodes before the job (skip with --skip-checks)")
    result = ClusterHealth(check_pods(d, workers))
    if result.ok and upload is not None and len(workers) > 1:
        result.pairs = measure_pairs(d, workers, PairOptions(), upload)
    if result.ok:
        d.say(f"check: every GPU node passed ({len(result.nodes)} nodes)")
        return result
    if exclude:
        _exclude(d, target, result)
    failing = [f"{h.node}: {f.line()}" for h in result.nodes for f in h.failures()]
    if result.pairs is not None and not result.pairs.ok:
        failing += [line.strip() for line in result.pairs.lines()]
    raise UserError(
        "GPU node checks failed, the job was not submitted:\n  " + "\n  ".join([*failing, *result.excluded]),
        hint="Take the node out of the job with `raytrain-eks check --exclude-bad-nodes`, then submit again; or "
        "submit with --skip-checks to run on it anyway.",
    )


# Writes stdin to the file named by its argument, making its folder: run by the head pod's python3.
_WRITE = (
    "import os, sys; os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True); "
    "open(sys.argv[1], 'w').write(sys.stdin.read())"
)


def hand_over_health(d: Deployment, head: Pod, health: ClusterHealth) -> dict[str, str]:
    """Leave the gate's checks in the head pod for the job about to start, and return the job's environment that
    names them (:data:`~raytrain_eks.folders.NODE_CHECKS_ENV`): its driver keeps them in the run folder
    (:data:`~raytrain_eks.folders.NODE_CHECKS`) before it trains, so its report and bundle have them. Empty
    (said) when they cannot be written."""
    path = f"/tmp/raytrain-eks/node-checks-{secrets.token_hex(4)}.json"
    argv = [m.IMAGE_PYTHON, "-c", _WRITE, path]
    res = d.kube.exec(
        head.namespace, head.name, argv, timeout=CHECK_TIMEOUT_S, stdin=health.to_json(), container="ray-head"
    )
    if not res.ok:
        d.say(f"the node checks were not handed to the job: {(res.stderr or res.stdout).strip()[-200:]}")
        return {}
    return {NODE_CHECKS_ENV: path}


def cordon(d: Deployment, node: str) -> str:
    """Mark ``node`` unschedulable (``kubectl cordon``: ``spec.unschedulable``), so no new pod is placed on it."""
    if not d.kube.merge_patch("v1", "Node", node, None, {"spec": {"unschedulable": True}}):
        return f"node {node} was not found to cordon (already gone?)"
    return f"cordoned node {node}: no new pod will be placed on it"
