"""The step logic of ``up``, ``submit``, ``status``, ``logs`` and ``down``, against fakes; fast and hermetic.

Kubernetes is FakeKube (fake_kube.py) (stateful: nodes, DaemonSets that make nodes advertise
resources, KubeRay creating pods from the RayCluster's own templates, a scheduler recording ``FailedScheduling``).
eksctl and helm are :class:`FakeTools`, a recording runner whose commands change a small simulated AWS (cluster,
node groups per zone, Helm releases) and the fake cluster the way the real tools would; ``down``'s boto3 look for
leftovers goes to moto's server. Inside the pods, :class:`FakeRay` answers ``ray job`` commands, and the scripts
the steps run in the pods (unpacking the package, collecting NCCL lines) really run, against temporary folders and
the NCCL fixtures. Covered: the order of ``up``, the next zone after a launch failure, resuming after a failure,
device plugins proven on every node, ``up --plan`` creating nothing, allocatable missing -> fail fast with the fix,
Pending pods -> events shown on timeout, the runtime_env and the token kept out of argv and logs, EFA missing from
NCCL's lines -> non-zero exit, RayJob mode, ``down`` in reverse order and twice, leftovers, status, logs, and the
runner's errors."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import boto3
import eksctl_source
import fake_eksctl_stacks as cfn
import jsonschema
import pytest
import typer
import yaml
from charts import crds, eksctl_efa_daemon_set, rendered, values_path, vendored
from fake_aws import keep_termination_protection
from fake_eksctl_auth import NOT_OPERABLE, FakeIamServiceAccounts, kubeconfig
from fake_kube import CLUSTER_SCOPED, PULL_NO_CREDENTIALS, PULL_NOT_FOUND, FakeKube, parse_quantity
from gpu_node_tools import GpuNodeTools
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from raytrain_eks.config import Config, load_config
from raytrain_eks.deploy import commands as deploy_commands
from raytrain_eks.deploy import submit as sub
from raytrain_eks.eks import lifecycle, nodegroups
from raytrain_eks.eks.plan import write_plan
from raytrain_eks.errors import UserError
from raytrain_eks.k8s import addons, runner, state
from raytrain_eks.k8s import job as shipping
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.addons import NodesNotReady
from raytrain_eks.k8s.cluster import Event, ExecResult, Pod, _exec_returncode
from raytrain_eks.k8s.runner import CommandError, Completed, MissingToolError
from raytrain_eks.k8s.state import Cancelled, Deployment, StateStore, apply_state
from raytrain_eks.train.memory import DoesNotFit

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"
RECORDED = Path(__file__).parent / "fixtures" / "recorded"  # real tool output; fixtures/recorded/SOURCES.md
SCHEMAS = Path(__file__).parent / "schemas"  # copies of the upstream schemas, see schemas/README.md
ZONES = ["us-east-1a", "us-east-1b", "us-east-1c"]
TOKEN = "hf_SECRETtoken1234567890"
# What the kubelet offers pods: the instance's vCPUs and memory less the EKS AMI's reservations (kube-reserved CPU:
# 6% of the first core, 1% of the second, 0.5% of the next two, 0.25% of the rest; memory 255Mi + 11Mi per pod, and
# the eviction threshold), rounded down. p5.48xlarge: 192 vCPUs, 2,048 GiB (docs/reference/infra-facts.md §5).
ALLOCATABLE = {
    "g6.12xlarge": {"cpu": "47", "memory": "185Gi"},
    "m7i.xlarge": {"cpu": "3920m", "memory": "14Gi"},
    "p5.48xlarge": {"cpu": "191", "memory": "1980Gi"},
}


# ------------------------------------------------------------------------------------------------------------------
# Fakes of the world outside Kubernetes (eksctl, helm, aws) and of Ray inside the pods
# ------------------------------------------------------------------------------------------------------------------


class FakeTools:
    """A recording :class:`~raytrain_eks.k8s.runner.Runner` simulating eksctl and helm.

    ``no_capacity``: zones where the GPU instances cannot launch. ``fail_once``: argv prefix (joined) -> stderr of
    one failure. ``crash_plugins``: releases whose DaemonSet pods never become ready. ``missing``: tools not
    installed. ``iam``: eksctl's IAM service accounts (their roles in moto's IAM, see fake_eksctl_auth.py).
    """

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube
        self.calls: list[list[str]] = []
        self.cluster: dict[str, Any] | None = None
        self.nodegroups: dict[str, dict[str, Any]] = {}
        self.releases: dict[tuple[str, str], dict[str, str]] = {}
        self.no_capacity: set[str] = set()
        self.fail_once: dict[str, str] = {}
        self.crash_plugins: set[str] = set()
        self.missing: set[str] = set()
        self.iam = FakeIamServiceAccounts(kube)
        # eksctl: every command line is read as eksctl v0.230.0's own source reads it (eksctl_source.py), and one it
        # would refuse gets its error. ``timeouts``: the runner's limit of each call. ``launch_minutes``: zone ->
        # minutes until the GPU instances there are Ready (eksctl's --timeout, or the runner, may end first).
        # ``cluster_fails``: the status a failed create leaves the cluster's stack in. ``kubeconfig_writes``: every
        # file eksctl writes a kubeconfig into (the default one is recorded, never written: it is the user's own).
        self.timeouts: list[float] = []
        self.launch_minutes: dict[str, float] = {}
        self.cluster_fails: str | None = None
        self.kubeconfig_writes: list[Path] = []
        # The objects a chart creates: (release, namespace, values file) -> its `helm template` output.
        self.render: Callable[[str, str, Path], list[dict[str, Any]]] = self._rendered_fixture

    @staticmethod
    def _rendered_fixture(name: str, ns: str, values: Path) -> list[dict[str, Any]]:
        """The EKS target's values only: the output kept in fixtures/charts/rendered/ (test_charts.py checks it
        against real Helm)."""
        assert values.read_text() == values_path(name).read_text(), f"{values_path(name)} was rendered with others"
        return rendered(name)

    def require(self, name: str) -> str:
        if name in self.missing:
            raise MissingToolError(name)
        return f"/usr/local/bin/{name}"

    def commands(self, *prefix: str) -> list[list[str]]:
        return [c for c in self.calls if c[: len(prefix)] == list(prefix)]

    def __call__(
        self,
        argv: Any,
        *,
        timeout: float,
        input: str | None = None,
        check: bool = True,
        hint: str | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> Completed:
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), "argv must be a list of strings"
        assert timeout > 0
        self.require(argv[0])
        self.calls.append(list(argv))
        self.timeouts.append(timeout)
        joined = " ".join(argv)
        for prefix, stderr in list(self.fail_once.items()):
            if joined.startswith(prefix):
                del self.fail_once[prefix]
                return self._done(argv, 1, "", stderr, check, hint)
        code, out, err = self._dispatch(argv)
        return self._done(argv, code, out, err, check, hint)

    def _done(self, argv: list[str], code: int, out: str, err: str, check: bool, hint: str | None) -> Completed:
        if check and code:
            raise CommandError(argv, code, err, hint=hint)
        return Completed(tuple(argv), code, out, err)

    @staticmethod
    def _opt(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    def _dispatch(self, argv: list[str]) -> tuple[int, str, str]:
        verb = tuple(argv[:3])
        if argv[0] == "eksctl":
            try:
                eksctl_source.parse_argv(argv)
            except eksctl_source.ArgvError as exc:  # cobra prints a flag's or a loader's error as "Error: ..."
                return 1, "", f"Error: {exc}\n"
        if verb == ("eksctl", "get", "cluster"):
            if self.cluster is None:
                name = self._opt(argv, "--name")
                return 1, "", cfn.no_cluster(name, wrap=f'unable to describe control plane "{name}"')
            return 0, json.dumps([{"Name": self.cluster["name"], "Status": self.cluster.get("status", "ACTIVE")}]), ""
        if verb == ("eksctl", "create", "cluster"):
            doc = yaml.safe_load(Path(self._opt(argv, "-f")).read_text())
            assert doc["managedNodeGroups"] == [], "the cluster is created without node groups"
            name, region = doc["metadata"]["name"], doc["metadata"]["region"]
            refused = cfn.create_cluster_stack(name, region)
            if refused is not None:
                return 1, *cfn.create_stack_refused(name, region, refused)
            if self.cluster_fails is not None:
                cfn.fail_cluster_stack(name, region, self.cluster_fails)
                return 1, *cfn.create_cluster_failed(name, region, self.cluster_fails)
            self._write_kubeconfig(argv, name, region)
            self.cluster = {"name": doc["metadata"]["name"], "azs": doc["availabilityZones"]}
            # fixtures/eksctl/pkg/eks/tasks.go: with iam.withOIDC, the OIDC provider and then iam.serviceAccounts.
            if not doc["iam"].get("withOIDC"):
                self.iam.without_oidc.add(doc["metadata"]["name"])
            for sa in doc["iam"].get("serviceAccounts", []) if doc["iam"].get("withOIDC") else []:
                self.iam.make(doc["metadata"]["name"], doc["metadata"]["region"], sa)
            return 0, "", "[✔]  EKS cluster ready\n"
        if verb == ("eksctl", "utils", "write-kubeconfig"):
            config = kubeconfig(self._opt(argv, "--cluster"), self._opt(argv, "--region"), self.missing)
            Path(self._opt(argv, "--kubeconfig")).write_text(yaml.safe_dump(config))
            return 0, "", ""
        if verb in (
            ("eksctl", "create", "iamserviceaccount"),
            ("eksctl", "update", "iamserviceaccount"),
            ("eksctl", "utils", "associate-iam-oidc-provider"),
        ):
            path = self._opt(argv, "--config-file" if "--config-file" in argv else "-f")
            doc = yaml.safe_load(Path(path).read_text())
            name, region = doc["metadata"]["name"], doc["metadata"]["region"]
            if self.cluster is None or self.cluster["name"] != name:
                return 1, "", f"Error: ResourceNotFoundException: No cluster found for name: {name}."
            if argv[1] == "update":
                return self.iam.update(name, region, doc, approve="--approve" in argv)
            if argv[1] == "utils":
                return self.iam.associate_oidc(name, region, approve="--approve" in argv)
            include = self._opt(argv, "--include").split(",") if "--include" in argv else []
            override = "--override-existing-serviceaccounts" in argv
            return self.iam.create(name, region, doc, approve="--approve" in argv, override=override, include=include)
        if verb == ("eksctl", "delete", "iamserviceaccount"):
            cmd, given = eksctl_source.parse_argv(argv)
            assert "config-file" not in given, "a delete by config file (a plan unless --approve) is not modelled"
            name = str(given["cluster"])
            if self.cluster is None or self.cluster["name"] != name:  # NewProviderForExistingCluster
                return 1, "", cfn.no_cluster(name, wrap="unable to describe cluster control plane")
            ns = str(cmd.value(given, "namespace")).strip('"')  # its default: "default"
            wait = cmd.value(given, "wait") is True
            return self.iam.delete(name, str(given["region"]), ns, str(given["name"]), wait=wait)
        if verb == ("eksctl", "get", "nodegroup"):
            if self.cluster is None:  # pkg/ctl/get/nodegroup.go: NewProviderForExistingCluster
                name = self._opt(argv, "--cluster")
                return 1, "", cfn.no_cluster(name, wrap="unable to describe cluster control plane")
            return 0, json.dumps([{"Name": n, "Status": g["status"]} for n, g in self.nodegroups.items()]), ""
        if verb == ("eksctl", "create", "nodegroup"):
            doc = yaml.safe_load(Path(self._opt(argv, "-f")).read_text())
            return self._slow_launch(argv, doc) or self._create_nodegroup(doc)
        if verb == ("eksctl", "scale", "nodegroup"):
            name, nodes = self._opt(argv, "--name"), int(self._opt(argv, "--nodes"))
            self.kube.remove_nodes({"alpha.eksctl.io/nodegroup-name": name})
            self._add_nodes(name, nodes)
            return 0, "", ""
        if verb == ("eksctl", "delete", "nodegroup"):
            name = self._opt(argv, "--name")
            cfn.delete_nodegroup_stack(self._opt(argv, "--cluster"), self._opt(argv, "--region"), name)
            self.nodegroups.pop(name, None)
            self.kube.remove_nodes({"alpha.eksctl.io/nodegroup-name": name})
            return 0, "", ""
        if verb == ("eksctl", "delete", "cluster"):
            name, region = self._opt(argv, "--name"), self._opt(argv, "--region")
            if self.cluster is None:
                # pkg/ctl/delete/cluster.go: describing the missing cluster fails, and only --force goes on; then
                # pkg/actions/cluster/cluster.go New dies on the missing cluster's status, before any stack.
                if "--force" not in argv:
                    return 1, "", cfn.no_cluster(name, wrap="unable to describe cluster control plane")
                return 2, *cfn.delete_cluster_panics(name)
            cfn.delete_cluster_stack(name, region)
            self.iam.delete_cluster(name, operable=self.cluster.get("status", "ACTIVE") not in NOT_OPERABLE)
            self.cluster, self.nodegroups, self.releases = None, {}, {}
            self.kube.remove_nodes({})
            return 0, "", ""
        if argv[0] == "helm":
            assert Path(self._opt(argv, "--kubeconfig")).is_file(), "helm uses this folder's kubeconfig"
        if argv[:3] == ["helm", "get", "metadata"]:
            return self._helm_metadata(argv)
        if argv[:3] == ["helm", "upgrade", "--install"]:
            return self._helm_install(argv)
        if argv[:2] == ["helm", "uninstall"]:
            return self._helm_uninstall(argv)
        raise AssertionError(f"unexpected command: {shlex.join(argv)}")

    def _write_kubeconfig(self, argv: list[str], cluster: str, region: str) -> None:
        """What ``eksctl create cluster`` does with the kubeconfig (pkg/ctl/create/cluster.go, flags' defaults as
        eksctl's source sets them): with --write-kubeconfig, the file of --kubeconfig (--auto-kubeconfig:
        kubeconfig.AutoPath) gets the cluster, and becomes its current context with --set-kubeconfig-context."""
        cmd, given = eksctl_source.parse_argv(argv)
        if cmd.value(given, "write-kubeconfig") is not True:
            return
        path = cmd.value(given, "kubeconfig")
        target = cfn.default_kubeconfig() if path == "kubeconfig.DefaultPath()" else Path(str(path))
        if cmd.value(given, "auto-kubeconfig") is True:
            target = cfn.auto_kubeconfig(cluster)
        self.kubeconfig_writes.append(target)
        if "kubeconfig" in given and cmd.value(given, "auto-kubeconfig") is not True:
            target.write_text(yaml.safe_dump(kubeconfig(cluster, region, self.missing)))

    def _slow_launch(self, argv: list[str], doc: dict[str, Any]) -> tuple[int, str, str] | None:
        """The GPU instances of ``launch_minutes``' zone are not Ready before a wait ends: the runner's (it stops
        eksctl: the CommandError runner.run raises) or eksctl's own --timeout, whose error eksctl logs
        (pkg/eks/nodegroup_service.go DoAllNodegroupStackTasks; the wording is the SDK's CloudFormation waiter's,
        which eksctl itself matches in pkg/actions/addon/addon.go). The node group stays CREATING either way."""
        (group,) = doc["managedNodeGroups"]
        az = (group.get("availabilityZones") or doc["availabilityZones"])[0]
        minutes = self.launch_minutes.get(az) if group.get("efaEnabled") else None
        if minutes is None:
            return None
        cmd, given = eksctl_source.parse_argv(argv)
        waited = min(eksctl_source.wait_seconds(cmd, given), self.timeouts[-1])
        if minutes * 60 <= waited:
            return None
        self.nodegroups[group["name"]] = {"status": "CREATING", "az": az}
        if self.timeouts[-1] <= eksctl_source.wait_seconds(cmd, given):
            raise CommandError(argv, None, "", timeout=self.timeouts[-1])
        cluster, region = doc["metadata"]["name"], doc["metadata"]["region"]
        out = (
            f'[ℹ]  waiting for CloudFormation stack "eksctl-{cluster}-nodegroup-{group["name"]}"\n'
            "[ℹ]  1 error(s) occurred and nodegroups haven't been created properly, you may wish to check "
            f"CloudFormation console\n[ℹ]  to cleanup resources, run 'eksctl delete nodegroup --region={region} "
            f"--cluster={cluster} --name=<name>' for each of the failed nodegroup\n"
            "[✖]  exceeded max wait time for StackCreateComplete waiter\n"
        )
        return 1, out, f'Error: failed to create nodegroups for cluster "{cluster}"\n'

    def _create_nodegroup(self, doc: dict[str, Any]) -> tuple[int, str, str]:
        (group,) = doc["managedNodeGroups"]
        name = group["name"]
        az = (group.get("availabilityZones") or doc["availabilityZones"])[0]
        assert az in self.cluster["azs"], "a node group's zone must have a subnet of the cluster"
        if group.get("efaEnabled") and az in self.no_capacity:  # eksctl's output and the stack's events
            self.nodegroups[name] = {"status": "CREATE_FAILED", "az": az}
            cluster, region = doc["metadata"]["name"], doc["metadata"]["region"]
            return 1, *cfn.nodegroup_launch_failed(cluster, region, name, az, group["instanceType"])
        self.nodegroups[name] = {"status": "ACTIVE", "az": az, "group": group}
        self._add_nodes(name, group["desiredCapacity"])
        if group.get("efaEnabled"):
            # eksctl applies its own EFA plugin, creating or replacing the DaemonSet of its embedded asset
            # (fixtures/eksctl: pkg/eks/tasks.go, pkg/addons/device_plugin.go CreateOrReplace): `up` must remove it.
            self.kube.put(eksctl_efa_daemon_set())
            self.kube.tick()
        return 0, "", ""

    def _add_nodes(self, name: str, count: int) -> None:
        group, az = self.nodegroups[name]["group"], self.nodegroups[name]["az"]
        for i in range(count):
            labels = {
                **group["labels"],
                "alpha.eksctl.io/nodegroup-name": name,
                "eks.amazonaws.com/nodegroup": name,
                "topology.kubernetes.io/zone": az,
                "node.kubernetes.io/instance-type": group["instanceType"],
            }
            self.kube.add_node(
                f"ip-{name}-{i}", labels=labels, allocatable=ALLOCATABLE[group["instanceType"]],
                taints=group.get("taints", []),
            )  # fmt: skip

    # -- helm: answers as Helm 3.17.3 and 4.1.4 do (github.com/helm/helm at those tags; files named below). The
    # objects a chart creates are its `helm template` output with the tool's values, fixtures/charts/rendered/
    # (charts.py; test_charts.py renders them again with real Helm). `--wait` is not simulated: helm returns at once.

    def _helm_metadata(self, argv: list[str]) -> tuple[int, str, str]:
        """``helm get metadata NAME -o json``: cmd/helm/get_metadata.go and pkg/action/get_metadata.go (Metadata,
        its JSON in the struct's order); a missing release: pkg/storage/driver/driver.go ErrReleaseNotFound."""
        name, ns = argv[3], self._opt(argv, "--namespace")
        assert self._opt(argv, "--output") == "json"
        rel = self.releases.get((ns, name))
        if rel is None:
            return 1, "", "Error: release: not found\n"
        meta = {
            "name": name,
            "chart": rel["chart"],
            "version": rel["version"],
            "appVersion": rel["appVersion"],
            "namespace": ns,
            "revision": rel["revision"],
            "status": rel["status"],
            "deployedAt": rel["deployedAt"],
        }
        return 0, json.dumps(meta, separators=(",", ":")) + "\n", ""

    def _helm_install(self, argv: list[str]) -> tuple[int, str, str]:
        """``helm upgrade --install``: cmd/helm/upgrade.go runs an install when the release has no history, else an
        upgrade; pkg/action/install.go creates the namespace (--create-namespace) and the chart's crds/, refuses
        every object that exists without the release's ownership metadata (validate.go existingResourceConflict),
        then creates the objects with that metadata (setMetadataVisitor); pkg/action/upgrade.go checks only the
        objects new to the release, and creates any that are missing (pkg/kube/client.go Update)."""
        name, chart_name = argv[3], argv[4]
        ns, version, repo = self._opt(argv, "--namespace"), self._opt(argv, "--version"), self._opt(argv, "--repo")
        values = Path(self._opt(argv, "--values"))
        assert values.is_file(), "the values file is written before helm runs"
        chart = vendored(chart_name, version)
        if chart is None or chart.repo_url != repo:  # pkg/repo/chartrepo.go FindChartInAuthAndTLSAndPassRepoURL
            return 1, "", f'Error: chart "{chart_name}" version "{version}" not found in {repo} repository\n'
        objects = [self._helm_owned(o, name, ns) for o in self.render(name, ns, values)]
        old = self.releases.get((ns, name))
        installing = old is None
        new = objects if installing else [o for o in objects if _object_key(o) not in old["objects"]]
        for obj in new:
            found = self.kube.get(*_object_key(obj))
            if found is not None and not _helm_owns(found, name, ns):
                verb = "install" if installing else "update"
                return 1, "", f"Error: Unable to continue with {verb}: {_not_importable(found, name, ns)}\n"
        if installing:
            if "--create-namespace" in argv and self.kube.get("v1", "Namespace", ns) is None:
                self.kube.put(
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {"name": ns}}}
                )
            for crd in crds(chart):  # created as they are, and kept when the release goes
                if not self.kube.has(crd["apiVersion"], crd["kind"], crd["metadata"]["name"]):
                    self.kube.put(crd)
        if name in self.crash_plugins:
            self.kube.crashing |= {(ns, o["metadata"]["name"]) for o in objects if o["kind"] == "DaemonSet"}
        for obj in objects:
            self.kube.put(obj)
        app_version = yaml.safe_load(chart.file("Chart.yaml")).get("appVersion", "")
        revision = 1 if installing else old["revision"] + 1
        self.releases[(ns, name)] = {
            "status": "deployed", "chart": chart_name, "version": version, "appVersion": str(app_version),
            "revision": revision, "deployedAt": f"2026-12-02T10:{int(self.kube.time) // 60 % 60:02d}:00Z",
            "objects": [_object_key(o) for o in objects],
        }  # fmt: skip
        self.kube.tick()
        # cmd/helm/upgrade.go, then its statusPrinter (cmd/helm/status.go) for the table output.
        first = f'Release "{name}" does not exist. Installing it now.\n' if installing else (
            f'Release "{name}" has been upgraded. Happy Helming!\n'
        )  # fmt: skip
        status = f"NAME: {name}\nNAMESPACE: {ns}\nSTATUS: deployed\nREVISION: {revision}\nTEST SUITE: None\n"
        return 0, first + status, ""

    def _helm_owned(self, obj: dict[str, Any], release: str, ns: str) -> dict[str, Any]:
        """A rendered object as Helm creates it: in the release's namespace when the kind is namespaced, with
        the label and annotations of pkg/action/validate.go setMetadataVisitor."""
        meta = obj["metadata"]
        if obj["kind"] not in CLUSTER_SCOPED:
            meta.setdefault("namespace", ns)
        meta["labels"] = {**meta.get("labels", {}), "app.kubernetes.io/managed-by": "Helm"}
        meta["annotations"] = {
            **meta.get("annotations", {}), "meta.helm.sh/release-name": release, "meta.helm.sh/release-namespace": ns
        }  # fmt: skip
        return obj

    def _helm_uninstall(self, argv: list[str]) -> tuple[int, str, str]:
        """``helm uninstall NAME``: cmd/helm/uninstall.go; pkg/action/uninstall.go deletes the release's objects
        (not its CRDs), and answers a missing release with "uninstall: Release not loaded"."""
        ns, name = self._opt(argv, "--namespace"), argv[2]
        rel = self.releases.pop((ns, name), None)
        if rel is None:
            return 1, "", f"Error: uninstall: Release not loaded: {name}: release: not found\n"
        for key in reversed(rel["objects"]):
            self.kube.remove(*key)
        self.kube.tick()
        return 0, f'release "{name}" uninstalled\n', ""


def _object_key(obj: dict[str, Any]) -> tuple[str, str, str, str | None]:
    meta = obj["metadata"]
    return obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace")


def _helm_owns(obj: dict[str, Any], release: str, ns: str) -> bool:
    meta = obj.get("metadata", {})
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    return (labels.get("app.kubernetes.io/managed-by"), annotations.get("meta.helm.sh/release-name")) == (
        "Helm", release
    ) and annotations.get("meta.helm.sh/release-namespace") == ns  # fmt: skip


def _not_importable(obj: dict[str, Any], release: str, ns: str) -> str:
    """Helm's refusal of an object it did not create for this release: pkg/action/validate.go
    (existingResourceConflict, checkOwnership, requireValue, resourceString), v3.17.3."""
    meta = obj.get("metadata", {})
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    wanted = [
        ("label", labels, "app.kubernetes.io/managed-by", "Helm"),
        ("annotation", annotations, "meta.helm.sh/release-name", release),
        ("annotation", annotations, "meta.helm.sh/release-namespace", ns),
    ]
    errors = []
    for what, found, key, value in wanted:
        if key not in found:
            errors.append(f'{what} validation error: missing key "{key}": must be set to "{value}"')
        elif found[key] != value:
            errors.append(f'{what} validation error: key "{key}" must equal "{value}": current value is "{found[key]}"')
    where = f'{obj["kind"]} "{meta["name"]}" in namespace "{meta.get("namespace", "")}"'
    return f"{where} exists and cannot be imported into the current release: invalid ownership metadata; " + "; ".join(
        errors
    )


# The end of what `ray job submit` (Ray 2.60) prints when the dashboard found no job agent within its 10 s.
AGENT_BUSY = """  File ".../ray/dashboard/modules/dashboard_sdk.py", line 305, in _raise_error
    raise RuntimeError(
RuntimeError: Request failed with status code 500: No available agent to submit job, please try again later..
"""


class FakeRay:
    """Answers the commands the steps run inside the Ray pods.

    ``worker_logs``: the NCCL fixture folder (or file) each worker's Ray session logs hold, by worker index.
    ``outcome``: the final status of a submitted job. ``efa``: whether ``fi_info -p efa`` finds the provider.
    """

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.jobs: dict[str, str] = {}
        self.submitted: list[list[str]] = []
        self.outcome = "SUCCEEDED"
        self.efa = True
        self.worker_logs: list[Path] = [
            FIXTURES / "ray_session_logs" / "node-0",
            FIXTURES / "ray_session_logs" / "node-1",
        ]
        self.unpacked: Path | None = None
        # The first ``agent_busy`` submits get the dashboard's 500 while its job agent is not ready; with
        # ``agent_took_it`` the agent took the job all the same (the dashboard stopped waiting for its answer).
        self.agent_busy = 0
        self.agent_took_it = False
        # The distributions the image has, by name, as its python3 reports them (none of the job's by default).
        self.image: dict[str, str] = {}
        self.node_tools = GpuNodeTools(RECORDED)  # what the GPU node checks read: a healthy g6.12xlarge by default

    def __call__(self, ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:3] == ["ray", "job", "submit"]:
            self.submitted.append(argv)
            sid = argv[argv.index("--submission-id") + 1]
            if sid in self.jobs:
                return ExecResult(1, "", f"RuntimeError: Request failed with status code 400: Job {sid} exists.\n")
            if len(self.submitted) <= self.agent_busy:
                if self.agent_took_it:
                    self.jobs[sid] = "RUNNING"
                return ExecResult(1, "", AGENT_BUSY)
            self.jobs[sid] = "RUNNING"
            return ExecResult(0, f"Job '{sid}' submitted successfully\n")
        if argv[:3] == ["ray", "job", "logs"]:
            sid = argv[-1]
            if "--follow" in argv:
                self.jobs[sid] = self.outcome
            return ExecResult(0, "step 10 loss 2.31\nstep 20 loss 1.87\n")
        if argv[:3] == ["ray", "job", "status"]:
            # As Ray's job CLI prints it: the status while pending or running, a sentence once the job has ended.
            sid = argv[-1]
            if sid not in self.jobs:
                return ExecResult(1, "", f"RuntimeError: Request failed with status code 404: no job {sid}.\n")
            status = self.jobs[sid]
            ended = {"SUCCEEDED": "succeeded", "FAILED": "failed", "STOPPED": "was stopped"}
            if status in ended:
                return ExecResult(0, f"-----\nJob '{sid}' {ended[status]}\n-----\n")
            return ExecResult(0, f"Status for job '{sid}': {status}\n")
        if argv[:1] == ["test"]:
            local = self.tmp / "head" / argv[-1].lstrip("/")
            return ExecResult(0 if local.is_file() else 1, "")
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] == shipping._UNPACK:
            dest = self.tmp / "head" / argv[3].lstrip("/")
            self.unpacked = dest
            return run_script(argv[2], [str(dest)], stdin)
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] == shipping.IMAGE_VERSIONS:
            # importlib.metadata.version finds a distribution by its normalized name (lower case, runs of "-_."
            # as one), so "PyYAML" and "pyyaml" both find PyYAML.
            have = {canonicalize_name(n): v for n, v in self.image.items()}
            return ExecResult(0, json.dumps({name: have.get(canonicalize_name(name)) for name in argv[3:]}) + "\n")
        if argv[:2] == [m.IMAGE_PYTHON, "-c"] and argv[2] == sub._NCCL_LINES:
            index = int(pod.rsplit("-", 1)[1])
            source = self.worker_logs[index]
            if source.is_file():  # a single log file: stands in for the whole session folder
                folder = self.tmp / f"logs-{index}"
                folder.mkdir(exist_ok=True)
                (folder / "worker-1.out").write_text(source.read_text())
                source = folder
            return run_script(argv[2], [str(source)])
        if argv[1:] == ["-p", "efa"]:
            if self.efa:  # fixtures/recorded/fi_info_efa.txt: entries on stdout, exit status 0 (util/info.c)
                return ExecResult(0, (RECORDED / "fi_info_efa.txt").read_text())
            # fixtures/recorded/fi_info_no_efa.txt: the line goes to stderr and fi_info exits with 61, -FI_ENODATA
            # negated (libfabric's util/info.c, see SOURCES.md).
            return ExecResult(61, "", (RECORDED / "fi_info_no_efa.txt").read_text())
        found = self.node_tools.answer(pod, argv)  # nvidia-smi, dmesg, dcgmi: fixtures/recorded/ (GpuNodeTools)
        if found is not None:
            return found
        raise AssertionError(f"unexpected exec in {pod}: {argv[:3]}")


def run_script(code: str, args: list[str], stdin: str | None = None) -> ExecResult:
    """Run a ``python -c`` script the steps send into a pod, here and in-process (a subprocess costs 0.2 s)."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, sys.stdin
    sys.argv, sys.stdin = ["-c", *args], io.StringIO(stdin or "")
    code_ = 0
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<pod>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        code_ = exc.code if isinstance(exc.code, int) else 1
        if exc.code is not None and not isinstance(exc.code, int):  # sys.exit("why"): Python prints it to stderr
            err.write(f"{exc.code}\n")
    finally:
        sys.argv, sys.stdin = saved
    return ExecResult(code_, out.getvalue(), err.getvalue())


class World:
    """One deployment against the fakes: ``d`` (the Deployment), ``kube``, ``tools``, ``ray`` and ``lines`` said."""

    def __init__(self, tmp: Path, cfg: Config) -> None:
        keep_termination_protection()  # moto's CloudFormation refuses to delete a protected stack, as AWS does
        self.kube = FakeKube()
        self.tools = FakeTools(self.kube)
        self.ray = FakeRay(tmp)
        self.kube.exec_handler = self.ray
        self.kube.ray_job_status = self.ray.jobs.get  # what a RayJob's dashboard tells the KubeRay fake
        self.lines: list[str] = []
        self.store = StateStore(tmp / ".raytrain-eks")
        self.d = Deployment(
            cfg=cfg,
            kube=self.kube,
            run=self.tools,
            state=self.store,
            say=self.lines.append,
            sleep=self.kube.sleep,
            clock=self.kube.monotonic,
            require_tool=self.tools.require,
        )

    def up(self, **kw: Any) -> lifecycle.UpResult:
        kw.setdefault("offered_zones", lambda: nodegroups.Placement(list(ZONES)))
        return lifecycle.up(self.d, confirm=lambda q: True, **kw)

    def submit(self, **kw: Any) -> sub.SubmitResult:
        """Submit as the commands do: with what ``up`` remembered applied (the checkpoint bucket among it)."""
        return sub.submit(dataclasses.replace(self.d, cfg=apply_state(self.d.cfg, self.store)), **kw)

    def said(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def cfg() -> Config:
    return load_config(environ={}, path=None)


@pytest.fixture
def world(tmp_path: Path, cfg: Config, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    """A deployment whose AWS reads (what ``down`` leaves behind) go to moto's server, never to an account."""
    monkeypatch.chdir(tmp_path)  # no raytrain-eks.yaml of the repository is read
    return World(tmp_path, cfg)


@pytest.fixture
def ready(world: World) -> World:
    world.up()
    world.lines.clear()
    return world


# ------------------------------------------------------------------------------------------------------------------
# runner
# ------------------------------------------------------------------------------------------------------------------


def test_runner_runs_an_argv_list_and_captures_output():
    lines: list[str] = []
    done = runner.run(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
        timeout=30,
        on_output=lines.append,
    )
    assert done.ok and done.stdout == "out\n" and done.stderr == "err\n"
    assert sorted(lines) == ["err", "out"]
    assert (
        runner.run([sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1])"], timeout=30, input="abc").stdout
        == "cba\n"
    )
    with pytest.raises(TypeError):
        runner.run("echo hi", timeout=5)  # type: ignore[arg-type]


def test_runner_failure_names_command_status_stderr_and_next_step():
    script = "import sys; print('\\n'.join(f'line {i}' for i in range(40)), file=sys.stderr); sys.exit(3)"
    with pytest.raises(CommandError) as err:
        runner.run([sys.executable, "-c", script], timeout=30, hint="Do the next thing.")
    e = err.value
    assert e.returncode == 3 and e.argv[0] == sys.executable and isinstance(e, UserError)
    assert e.stderr_tail.splitlines() == [f"line {i}" for i in range(20, 40)]
    assert "failed with exit status 3" in e.message and "line 39" in e.message and e.hint == "Do the next thing."
    assert runner.run([sys.executable, "-c", "raise SystemExit(4)"], timeout=30, check=False).returncode == 4


def test_runner_timeout_stops_the_command():
    with pytest.raises(CommandError) as err:
        runner.run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert err.value.timed_out and "timed out after" in err.value.message


@pytest.mark.parametrize("tool", ["eksctl", "helm", "kubectl"])
def test_missing_tool_is_named_with_how_to_install_it(tool: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MissingToolError) as err:
        runner.require_tool(tool)
    assert f"`{tool}` is not installed" in str(err.value) and "Install" in (err.value.hint or "")
    with pytest.raises(MissingToolError):
        runner.run([tool, "version"], timeout=5)


# ------------------------------------------------------------------------------------------------------------------
# up
# ------------------------------------------------------------------------------------------------------------------


def test_up_creates_cluster_node_groups_plugins_and_kuberay_in_order(world: World):
    result = world.up()
    t = world.tools
    verbs = [" ".join(c[:3]) for c in t.calls if c[1] in ("create", "upgrade", "utils")]
    assert verbs == [
        "eksctl create cluster",
        "eksctl utils write-kubeconfig",
        "eksctl create nodegroup",
        "eksctl create nodegroup",
        "helm upgrade --install",
        "helm upgrade --install",
        "helm upgrade --install",
    ]
    assert [c[3] for c in t.commands("helm", "upgrade")] == [
        "nvidia-device-plugin",
        "aws-efa-k8s-device-plugin",
        "kuberay-operator",
    ]
    # eksctl's own EFA plugin is gone: only the pinned charts' DaemonSets (the NVIDIA chart's MPS daemon, for nodes
    # labelled nvidia.com/mps.capable, among them) advertise devices.
    assert [ds.name for ds in world.kube.daemon_sets("kube-system")] == [
        "nvidia-device-plugin",
        "nvidia-device-plugin-mps-control-daemon",
        "aws-efa-k8s-device-plugin",
    ]
    nodes = world.kube.nodes({"role": "gpu-worker"})
    assert result.gpu_nodes == [n.name for n in nodes] and len(nodes) == 2
    assert all(n.allocatable[m.GPU_RESOURCE] == "4" and n.allocatable[m.EFA_RESOURCE] == "1" for n in nodes)
    # The region and zone are remembered for later commands; everything created is listed for down.
    state = json.loads(world.store.path.read_text())
    assert (state["region"], state["gpu_az"], state["phase"]) == ("us-east-1", "us-east-1a", "up")
    assert [i["type"] for i in state["created"]] == [
        "bucket",
        "cluster",
        "nodegroup",
        "nodegroup",
        "helm",
        "helm",
        "helm",
    ]
    assert t.cluster["azs"] == ZONES
    gpu_file = yaml.safe_load((world.store.root / "eksctl-nodegroup-gpu-efa.yaml").read_text())
    assert gpu_file["managedNodeGroups"][0]["availabilityZones"] == ["us-east-1a"]
    assert all("--install-nvidia-plugin=false" in c for c in t.commands("eksctl", "create", "nodegroup"))
    assert "Ready: cluster ray-train-eks" in world.said()


def test_up_tries_the_next_zone_and_says_why_the_launch_failed(world: World):
    world.tools.no_capacity = {"us-east-1a"}
    result = world.up()
    assert result.gpu_az == "us-east-1b"
    said = world.said()
    assert "g6.12xlarge could not launch in us-east-1a" in said and "InsufficientInstanceCapacity" in said
    assert "Removing the failed node group gpu-efa; trying us-east-1b next" in said
    # The failed group is deleted before the next zone is tried.
    t = world.tools
    idx = [
        i
        for i, c in enumerate(t.calls)
        if c[:3] in (["eksctl", "create", "nodegroup"], ["eksctl", "delete", "nodegroup"])
    ]
    kinds = [(t.calls[i][1], Path(t.calls[i][4]).name if t.calls[i][1] == "create" else t.calls[i][-2]) for i in idx]
    assert kinds == [
        ("create", "eksctl-nodegroup-system.yaml"),
        ("create", "eksctl-nodegroup-gpu-efa.yaml"),
        ("delete", "gpu-efa"),
        ("create", "eksctl-nodegroup-gpu-efa.yaml"),
    ]
    assert {n.zone for n in world.kube.nodes({"role": "gpu-worker"})} == {"us-east-1b"}
    assert world.store.get("gpu_az") == "us-east-1b"
    assert "us-east-1a" in world.store.get("zone_failures")


def test_up_fails_with_every_zone_reason_when_none_can_launch(world: World):
    world.tools.no_capacity = set(ZONES)
    with pytest.raises(UserError) as err:
        world.up()
    assert all(z in err.value.message for z in ZONES) and "Capacity Reservation" in (err.value.hint or "")
    assert len(world.tools.commands("eksctl", "delete", "nodegroup")) == 3
    # The cluster stays recorded, so down still deletes it.
    assert [i["type"] for i in world.store.created] == ["bucket", "cluster", "nodegroup"]


def test_rerunning_up_after_a_failure_resumes(world: World):
    world.tools.fail_once["helm upgrade --install aws-efa-k8s-device-plugin"] = "Error: context deadline exceeded"
    with pytest.raises(CommandError) as err:
        world.up()
    assert "context deadline exceeded" in err.value.message and "raytrain-eks up" in (err.value.hint or "")
    first = len(world.tools.calls)
    world.up()
    again = world.tools.calls[first:]
    assert not [c for c in again if c[1] == "create"], "nothing is created twice"
    assert [c[3] for c in again if c[:2] == ["helm", "upgrade"]] == ["aws-efa-k8s-device-plugin", "kuberay-operator"]
    assert "Helm release nvidia-device-plugin (nvidia-device-plugin 0.20.0) is installed" in world.said()
    assert len(world.store.created) == 7


def test_rerun_removes_a_failed_node_group_first(world: World):
    world.tools.fail_once["eksctl create nodegroup"] = "Error: AccessDenied: not authorized to perform iam:PassRole"
    with pytest.raises(CommandError):
        world.up()  # the system group: not a launch failure, so no zone hopping
    world.tools.nodegroups["system"] = {"status": "CREATE_FAILED", "az": "us-east-1a"}
    world.up()
    deletes = world.tools.commands("eksctl", "delete", "nodegroup")
    assert [c[-2] for c in deletes] == ["system"] and "is CREATE_FAILED" in world.said()


def test_up_does_not_trust_helm_device_plugins_must_be_ready_on_every_node(world: World):
    world.tools.crash_plugins = {"aws-efa-k8s-device-plugin"}
    with pytest.raises(NodesNotReady) as err:
        world.up()
    text = str(err.value)
    assert "vpc.amazonaws.com/efa=0, a worker pod needs 1" in text and "CrashLoopBackOff" in text
    assert "raytrain-eks up" in (err.value.hint or "")
    assert world.kube.time >= addons.GPU_READY_TIMEOUT_S  # it waited (in simulated time) before giving up


def test_up_asks_once_and_creates_nothing_when_declined(world: World):
    questions: list[str] = []
    with pytest.raises(Cancelled):
        lifecycle.up(
            world.d, confirm=lambda q: questions.append(q) or False, offered_zones=lambda: nodegroups.Placement(ZONES)
        )
    assert len(questions) == 1 and "$9.55 per hour" in questions[0]
    assert world.tools.calls == [] and world.store.created == []


def test_up_needs_a_zone_source(world: World):
    with pytest.raises(UserError) as err:
        world.up(offered_zones=None)
    assert "GPU_AZ" in (err.value.hint or "") and world.tools.calls == []


def test_pinned_zone_is_the_only_one_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str):
    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1c"}, path=None))
    w.tools.no_capacity = {"us-east-1c"}
    with pytest.raises(UserError, match="us-east-1c"):
        w.up()
    assert w.tools.cluster["azs"] == ["us-east-1c", "us-east-1a"]
    assert len(w.tools.commands("eksctl", "create", "nodegroup")) == 2  # system + the one GPU zone


def test_up_launches_into_the_reservation_the_capacity_check_found(world: World):
    placement = nodegroups.Placement(["us-east-1b", "us-east-1a"], {"us-east-1b": "cr-0123456789abcdef0"})
    result = world.up(offered_zones=lambda: placement)
    assert result.gpu_az == "us-east-1b"
    doc = yaml.safe_load((world.store.root / "eksctl-nodegroup-gpu-efa.yaml").read_text())
    schema = json.loads((SCHEMAS / "eksctl" / "clusterconfig.v1alpha5.schema.json").read_text())
    assert not list(jsonschema.validators.validator_for(schema)(schema).iter_errors(doc))
    (gpu,) = doc["managedNodeGroups"]
    assert gpu["capacityReservation"] == {
        "capacityReservationTarget": {"capacityReservationID": "cr-0123456789abcdef0"}
    }
    assert gpu["availabilityZones"] == ["us-east-1b"] and "placement" not in gpu
    system = yaml.safe_load((world.store.root / "eksctl-nodegroup-system.yaml").read_text())["managedNodeGroups"][0]
    assert "capacityReservation" not in system, "the system node is not in the GPU reservation"
    assert "in us-east-1b, into capacity reservation cr-0123456789abcdef0" in world.said()


def test_a_configured_zone_is_checked_before_anything_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from raytrain_eks.aws.capacity import CapacityError

    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1c"}, path=None))

    def quota_short() -> nodegroups.Placement:
        raise CapacityError("quota short in us-east-1: 2 x g6.12xlarge need 96 vCPUs ...")

    with pytest.raises(CapacityError, match="quota short"):
        w.up(offered_zones=quota_short)
    with pytest.raises(
        UserError, match="cannot go to us-east-1c now; the capacity check finds room only in us-east-1a"
    ):
        w.up(offered_zones=lambda: nodegroups.Placement(["us-east-1a"]))
    assert w.tools.calls == [] and w.store.created == []


def test_the_clusters_second_zone_also_offers_the_gpu_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str
):
    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1c"}, path=None))
    w.up(offered_zones=lambda: nodegroups.Placement(["us-east-1c"], offered=["us-east-1b", "us-east-1c"]))
    assert w.tools.cluster["azs"] == ["us-east-1c", "us-east-1b"], "not the alphabetical default us-east-1a"


def test_a_pinned_zone_keeps_the_configured_availability_zones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str
):
    monkeypatch.chdir(tmp_path)
    azs = ["us-east-1a", "us-east-1b", "us-east-1c"]
    cfg = load_config(environ={}, path=None, overrides={"cluster": {"gpu_az": "us-east-1b", "availability_zones": azs}})
    w = World(tmp_path, cfg)
    result = w.up(offered_zones=lambda: nodegroups.Placement(["us-east-1b"], offered=["us-east-1b", "us-east-1d"]))
    assert result.gpu_az == "us-east-1b"
    assert w.tools.cluster["azs"] == ["us-east-1b", "us-east-1a", "us-east-1c"], "the configured zones, as plan shows"


def test_missing_eksctl_stops_up_before_anything(world: World):
    world.tools.missing = {"eksctl"}
    with pytest.raises(MissingToolError, match="eksctl"):
        world.up()
    assert world.tools.calls == []


def test_up_plan_prints_every_action_and_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)

    def forbidden(*a: Any, **k: Any) -> None:
        raise AssertionError("up --plan must not build a deployment")

    monkeypatch.setattr(deploy_commands, "make_deployment", forbidden)
    app = typer.Typer()
    deploy_commands.register(app)
    result = CliRunner().invoke(app, ["up", "--plan", "--train"])
    assert result.exit_code == 0, result.output
    for name in ("create-cluster", "nodegroup-gpu", "helm-kuberay-operator", "check-gpu-nodes"):
        assert name in result.output
    assert "$ eksctl create cluster -f .raytrain-eks/eksctl-cluster.yaml" in result.output
    assert "about $9.55 per hour" in result.output
    assert not (tmp_path / ".raytrain-eks").exists()


def test_up_train_runs_the_job_with_its_checkpoints_in_the_bucket_up_created(
    world: World, monkeypatch: pytest.MonkeyPatch
):
    # The command builds its deployment before up creates the bucket; the job it then submits must still keep its
    # checkpoints there (node-local storage across two GPU nodes is refused before any job is submitted).
    def make_deployment(cfg: Config, state_dir: Path, say: Callable[[str], None] | None = None) -> Deployment:
        world.d = dataclasses.replace(world.d, cfg=state.remembered_config(cfg, world.store, world.d.say))
        return world.d

    from test_health import PairProbeJob  # submit's gate on EKS: the head pod answers the pair probe's job too

    monkeypatch.setattr(deploy_commands, "make_deployment", make_deployment)
    monkeypatch.setattr(nodegroups, "placement_zones", lambda cfg: nodegroups.Placement(list(ZONES)))
    world.kube.exec_handler = PairProbeJob(world)
    app = typer.Typer()
    deploy_commands.register(app)
    result = CliRunner().invoke(app, ["up", "--train", "-y"])
    assert result.exit_code == 0, f"{result.output}\n{world.said()}\n{result.exception!r}"
    bucket = world.store.get("bucket")
    assert bucket and len(world.ray.submitted) == 1
    cfg = world.d.cfg
    job = world.kube.get("v1", "ConfigMap", cfg.ray.cluster_name + "-config", cfg.ray.namespace)
    assert yaml.safe_load(job["data"]["raytrain-eks.yaml"])["training"]["storage_path"] == f"s3://{bucket}/runs"


def test_submit_refuses_node_local_checkpoints_across_nodes_before_anything(ready: World):
    calls = (len(ready.kube.applied), len(ready.kube.exec_calls))
    local = ready.d.cfg.model_copy(
        update={"training": ready.d.cfg.training.model_copy(update={"storage_path": "/home/ray/ckpt"})}
    )
    with pytest.raises(UserError, match="storage_path = '/home/ray/ckpt'.*span 2 nodes") as err:
        sub.submit(dataclasses.replace(ready.d, cfg=local))
    assert err.value.exit_code == 2 and "s3://BUCKET/PREFIX" in str(err.value)
    assert (len(ready.kube.applied), len(ready.kube.exec_calls)) == calls and ready.ray.submitted == []


def test_up_plan_shows_the_helm_commands_up_runs(world: World):
    world.up()
    ran = [
        shlex.join(c).replace(f"{world.store.root}/", ".raytrain-eks/") for c in world.tools.commands("helm", "upgrade")
    ]
    planned = [shlex.join(a.argv or []) for a in lifecycle.planned_actions(world.d.cfg) if a.name.startswith("helm-")]
    assert len(ran) == 3 and ran == planned


# ------------------------------------------------------------------------------------------------------------------
# submit
# ------------------------------------------------------------------------------------------------------------------


def test_submit_waits_for_the_job_agent_of_a_head_that_has_just_started(ready: World):
    ready.ray.agent_busy = 2
    start = ready.kube.time
    result = ready.submit(hf_token=TOKEN)
    assert result.exit_code == 0 and result.job_status == "SUCCEEDED"
    # The same submission three times, five seconds apart, and one job.
    ids = [argv[argv.index("--submission-id") + 1] for argv in ready.ray.submitted]
    assert len(ids) == 3 and set(ids) == {result.submission_id} and list(ready.ray.jobs) == ids[:1]
    assert ready.said().count("job agent in ray-train-head-0 is not ready yet; submitting again in 5 s") == 2
    assert ready.kube.time - start >= 2 * sub.AGENT_RETRY_S


def test_submit_does_not_submit_twice_a_job_the_busy_agent_took(ready: World):
    ready.ray.agent_busy, ready.ray.agent_took_it = 1, True
    result = ready.submit(hf_token=TOKEN)
    assert result.exit_code == 0 and result.job_status == "SUCCEEDED"
    assert len(ready.ray.submitted) == 1 and list(ready.ray.jobs) == [result.submission_id]
    assert "not ready yet" not in ready.said()


def test_submit_gives_up_when_the_job_agent_never_comes(ready: World):
    ready.ray.agent_busy = 10**6
    with pytest.raises(CommandError) as err:
        ready.submit(hf_token=TOKEN)
    assert "No available agent to submit job" in err.value.message
    assert f"still not ready after {sub.AGENT_WAIT_S:.0f} s" in (err.value.hint or "")
    tries = sub.AGENT_WAIT_S / sub.AGENT_RETRY_S  # one every 5 s for 3 minutes, then no more
    assert tries <= len(ready.ray.submitted) <= tries + 2
    assert not ready.ray.jobs


def test_submit_does_not_retry_other_errors(ready: World):
    real = ready.ray.__call__

    def refuse(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:3] == ["ray", "job", "submit"]:
            ready.ray.submitted.append(argv)
            return ExecResult(1, "", "RuntimeError: Request failed with status code 400: runtime_env is invalid\n")
        return real(ns, pod, argv, stdin)

    ready.kube.exec_handler = refuse
    with pytest.raises(CommandError) as err:
        ready.submit(hf_token=TOKEN)
    assert "runtime_env is invalid" in err.value.message and len(ready.ray.submitted) == 1
    assert "not ready" not in (err.value.hint or "")


def test_submit_runs_the_job_from_the_head_pod_and_checks_efa(ready: World):
    result = ready.submit(hf_token=TOKEN)
    assert result.exit_code == 0 and result.job_status == "SUCCEEDED"
    assert result.report is not None and result.report.verdict == "efa" and result.efa_provider is True
    assert result.versions == {"driver": "580.126.09", "cuda": "13.0"}  # fixtures/recorded/nvidia_smi_4xl40s_580.txt
    # Submitted through exec in the head pod, to the dashboard on the pod's own loopback.
    (argv,) = ready.ray.submitted
    head_calls = [c for c in ready.kube.exec_calls if c[2][:3] == ["ray", "job", "submit"]]
    assert head_calls[0][1] == "ray-train-head-0"
    assert argv[argv.index("--address") + 1] == "http://127.0.0.1:8265"
    assert argv[argv.index("--") + 1 :] == [
        "python3",
        "-m",
        "raytrain_eks.cli",
        "train",
        "--address",
        "auto",
        "--config",
        "/etc/raytrain-eks/raytrain-eks.yaml",
    ]
    env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    names = [p.split("=")[0].split(">")[0].split("[")[0] for p in env["pip"]]
    assert "transformers" in names and "torch" not in names and "ray" not in names and "kubernetes" not in names
    (module,) = env["py_modules"]
    assert module.startswith(shipping.HEAD_CODE_ROOT) and module.endswith("/raytrain_eks")
    # The package really arrived in the "head pod" (the unpack script ran on its stdin).
    assert ready.ray.unpacked is not None and (ready.ray.unpacked / "raytrain_eks" / "__init__.py").is_file()
    assert (ready.ray.unpacked / "raytrain_eks" / "resources" / "sample_instructions.jsonl").is_file()
    # Logs were streamed; NCCL lines were read in every worker pod.
    assert "step 20 loss 1.87" in ready.said()
    nccl = [c[1] for c in ready.kube.exec_calls if c[2][:2] == [m.IMAGE_PYTHON, "-c"] and c[2][2] == sub._NCCL_LINES]
    assert nccl == ["ray-train-gpu-workers-worker-0", "ray-train-gpu-workers-worker-1"]
    assert "OK: the job succeeded" in ready.said()


def test_the_token_reaches_only_the_secret(ready: World):
    ready.submit(hf_token=TOKEN)
    secrets = [o for o in ready.kube.applied if o["kind"] == "Secret"]
    assert secrets and secrets[0]["stringData"][m.HF_TOKEN_KEY] == TOKEN
    elsewhere = [o for o in ready.kube.applied if o["kind"] != "Secret"]
    assert TOKEN not in json.dumps(elsewhere)
    assert TOKEN not in json.dumps([c[2] for c in ready.kube.exec_calls]) + json.dumps(ready.tools.calls)
    assert TOKEN not in ready.said() and TOKEN not in ready.store.path.read_text()
    raycluster = next(o for o in ready.kube.applied if o["kind"] == "RayCluster")
    assert (
        m.hf_token_env(ready.d.cfg)
        in raycluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    )


def test_submit_fails_fast_with_the_fix_when_a_node_lacks_efa(ready: World):
    node = ready.kube.nodes({"role": "gpu-worker"})[1].name
    ready.kube.set_allocatable(node, m.EFA_RESOURCE, None)
    before = ready.kube.time
    with pytest.raises(NodesNotReady) as err:
        ready.submit()
    assert f"node {node} advertises vpc.amazonaws.com/efa=0, a worker pod needs 1" in str(err.value)
    assert "raytrain-eks up" in (err.value.hint or "")
    assert ready.kube.time == before, "no waiting"
    assert not ready.kube.objects("RayCluster") and not ready.kube.exec_calls


def test_submit_fails_fast_when_a_node_has_too_few_gpus(ready: World):
    node = ready.kube.nodes({"role": "gpu-worker"})[0].name
    ready.kube.set_allocatable(node, m.GPU_RESOURCE, "2")
    with pytest.raises(NodesNotReady, match="nvidia.com/gpu=2, a worker pod needs 4"):
        ready.submit()


def test_pending_pods_time_out_with_the_events_that_explain_them(ready: World):
    for node in ready.kube.nodes({"role": "gpu-worker"}):
        ready.kube.set_allocatable(node.name, "cpu", "32")  # the worker pod requests 40
    with pytest.raises(sub.PodsNotReady) as err:
        ready.submit()
    text = str(err.value)
    assert "ray-train-gpu-workers-worker-0: Pending" in text
    assert "Warning FailedScheduling: 0/3 nodes are available:" in text and "Insufficient cpu" in text
    assert "ray-train-head-0: Running" in text
    assert "FailedScheduling" in (err.value.hint or "")
    assert ready.kube.time >= ready.d.cfg.ray.job_start_deadline_s
    assert "workers 0/2 running" in ready.said()  # progress while waiting


def test_image_pull_errors_that_may_pass_are_waited_for_and_shown_on_timeout(ready: World):
    ready.kube.image_pull_error = PULL_NO_CREDENTIALS
    with pytest.raises(sub.PodsNotReady) as err:
        ready.submit()
    assert "ImagePullBackOff" in str(err.value) and "no basic auth credentials" in str(err.value)
    assert ready.kube.time >= ready.d.cfg.ray.job_start_deadline_s  # kubelet tries again; it may pass


def test_an_image_the_registry_does_not_have_stops_submit_at_once_with_the_registry_answer(ready: World):
    ready.kube.image_pull_error = PULL_NOT_FOUND
    started = ready.kube.time
    with pytest.raises(sub.PodsNotReady) as err:
        ready.submit()
    text = str(err.value)
    assert "will not start: the registry has no such image" in text and "code = NotFound" in text
    assert "ray-train-head-0: ImagePullBackOff" in text
    assert err.value.hint and "ray.image" in err.value.hint and "down" in err.value.hint
    assert ready.kube.time - started < 120  # not the 1800 s deadline, with the GPU nodes billing


def test_efa_missing_from_the_nccl_lines_gives_a_non_zero_exit(ready: World):
    log = FIXTURES / "socket_fallback_nccl2.27_kubectl.log"
    ready.ray.worker_logs = [log, log]
    result = ready.submit()
    assert result.job_status == "SUCCEEDED" and result.report is not None and result.report.verdict == "socket"
    assert result.exit_code == 1
    assert "does not meet fabric.require = efa" in ready.said()


def test_no_nccl_lines_is_inconclusive_exit_2(ready: World, tmp_path: Path):
    empty = tmp_path / "empty-logs"
    empty.mkdir()
    ready.ray.worker_logs = [empty, empty]
    assert ready.submit().exit_code == 2


def test_fi_info_without_efa_fails_the_run(ready: World):
    ready.ray.efa = False
    result = ready.submit()
    assert result.exit_code == 1 and result.efa_provider is False
    assert "fi_info -p efa on ray-train-gpu-workers-worker-0: no EFA (fi_getinfo: -61)" in ready.said()


def _pod_answering(result: ExecResult) -> tuple[Any, Pod]:
    """A deployment whose pod answers every exec with ``result`` (all ``check_efa_provider`` and ``gpu_versions``
    use of it), and that pod."""

    class Kube:
        def exec(self, namespace: str, pod: str, argv: list[str], timeout: float | None = None) -> ExecResult:
            return result

    class Answering:
        kube = Kube()

    return Answering(), Pod(name="ray-train-gpu-workers-worker-0", namespace="default", phase="Running")


@pytest.mark.parametrize("recording", ["fi_info_efa.txt", "fi_info_efa_rdm_p4de.txt"])
def test_check_efa_provider_accepts_the_recorded_efa_output(recording: str):
    # fixtures/recorded/: fi_info -p efa on an hpc6a node (libfabric 1.13 era) and fi_info -p efa -t FI_EP_RDM on a
    # p4de (libfabric 1.19); entries on stdout, exit status 0.
    d, worker = _pod_answering(ExecResult(0, (RECORDED / recording).read_text()))
    assert sub.check_efa_provider(d, worker) == (True, "provider: efa")


@pytest.mark.parametrize(
    ("recording", "line"),
    [
        ("fi_info_no_efa.txt", "fi_getinfo: -61"),  # recorded, libfabric before 1.19
        ("fi_info_no_efa_from_source.txt", "fi_getinfo: -61 (No data available)"),  # libfabric 1.19+, its source
    ],
)
def test_check_efa_provider_refuses_the_no_efa_output(recording: str, line: str):
    # fixtures/recorded/SOURCES.md: util/info.c writes the line to stderr and exits with 61.
    d, worker = _pod_answering(ExecResult(61, "", (RECORDED / recording).read_text()))
    assert sub.check_efa_provider(d, worker) == (False, line)


def test_gpu_versions_reads_the_recorded_nvidia_smi():
    # fixtures/recorded/nvidia_smi.txt: "| NVIDIA-SMI 535.230.02   Driver Version: 535.230.02   CUDA Version: 12.2 |"
    d, worker = _pod_answering(ExecResult(0, (RECORDED / "nvidia_smi.txt").read_text()))
    assert sub.gpu_versions(d, worker) == {"driver": "535.230.02", "cuda": "12.2"}


def test_a_failed_job_fails_the_run(ready: World):
    ready.ray.outcome = "FAILED"
    result = ready.submit()
    assert result.exit_code == 1 and "the job ended FAILED" in ready.said()


def test_resubmitting_follows_a_job_still_running_instead_of_submitting_twice(ready: World):
    ready.ray.outcome = "RUNNING"  # the log stream ends (a dropped connection) while the job runs
    ready.d.cfg = ready.d.cfg.model_copy(update={"ray": ready.d.cfg.ray.model_copy(update={"job_deadline_s": 60})})
    first = ready.submit()
    assert first.job_status == "RUNNING" and first.exit_code == 1
    ready.ray.outcome = "SUCCEEDED"
    second = ready.submit()
    assert len(ready.ray.submitted) == 1 and second.submission_id == first.submission_id
    assert second.exit_code == 0 and "following it instead of submitting again" in ready.said()


def test_a_broken_log_stream_is_followed_again(ready: World):
    from raytrain_eks.k8s.cluster import KubeApiError

    answer, broken = ready.kube.exec_handler, []

    def breaks_once(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult | None:
        if argv[:3] == ["ray", "job", "logs"] and not broken:
            broken.append(argv)
            raise KubeApiError(f"Kubernetes API: exec in {ns}/{pod} failed: the connection broke (reset)")
        return answer(ns, pod, argv, stdin)

    ready.kube.exec_handler = breaks_once
    result = ready.submit()
    assert broken and result.exit_code == 0 and result.job_status == "SUCCEEDED"
    said = ready.said()
    assert "The log stream broke: Kubernetes API: exec in default/ray-train-head-0 failed" in said
    assert "following it again" in said and "step 20 loss 1.87" in said
    assert len(ready.ray.submitted) == 1, "followed again, not submitted again"


def test_a_job_that_ends_after_its_stream_was_cut_shows_the_rest_of_its_log(ready: World):
    """The stream reached the job's deadline (exit 124, as KubernetesApi.exec gives) while the job still printed;
    it ended right after: what the stream missed is shown once, nothing twice."""
    answer = ready.kube.exec_handler

    def cut_at_the_deadline(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult | None:
        if argv[:3] == ["ray", "job", "logs"] and "--follow" in argv:
            answer(ns, pod, argv, stdin)  # the job ends
            return ExecResult(124, "step 10 loss 2.31\n")
        return answer(ns, pod, argv, stdin)

    ready.kube.exec_handler = cut_at_the_deadline
    result = ready.submit()
    assert result.exit_code == 0 and result.job_status == "SUCCEEDED"
    said = ready.said()
    assert said.count("step 10 loss 2.31") == 1 and said.count("step 20 loss 1.87") == 1, said


def test_a_cut_log_whose_rest_cannot_be_read_says_so(ready: World):
    answer = ready.kube.exec_handler

    def cut_and_gone(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult | None:
        if argv[:3] == ["ray", "job", "logs"]:
            if "--follow" in argv:
                answer(ns, pod, argv, stdin)  # the job ends
                return ExecResult(124, "step 10 loss 2.31\n")
            return ExecResult(1, "", "RuntimeError: Request failed with status code 500: no log\n")
        return answer(ns, pod, argv, stdin)

    ready.kube.exec_handler = cut_and_gone
    result = ready.submit()
    assert result.exit_code == 0 and "step 20 loss 1.87" not in ready.said()
    assert (
        "The rest of the job's log could not be read (RuntimeError: Request failed with status code 500: no log); "
        "`raytrain-eks logs` shows it" in ready.said()
    )


def test_package_is_uploaded_once(ready: World):
    ready.submit()
    ready.submit()
    unpacks = [c for c in ready.kube.exec_calls if c[2][:2] == [m.IMAGE_PYTHON, "-c"] and c[2][2] == shipping._UNPACK]
    assert len(unpacks) == 1 and len(ready.ray.submitted) == 2


def test_rayjob_mode_renders_a_rayjob_that_ships_the_code(ready: World):
    result = ready.submit(mode="rayjob")
    assert result.exit_code == 0
    (job,) = ready.kube.objects("RayJob")
    schema = json.loads((SCHEMAS / "kuberay" / "rayjob.v1.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate({k: v for k, v in job.items() if k != "status"})
    spec = job["spec"]
    assert shlex.split(spec["entrypoint"]) == m.train_argv()
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert env["py_modules"] == [f"{shipping.SUBMITTER_CODE_DIR}/raytrain_eks"] and env["pip"]
    submitter = spec["submitterPodTemplate"]["spec"]
    container = submitter["containers"][0]
    assert container["volumeMounts"][0]["mountPath"] == shipping.SUBMITTER_ARCHIVE_DIR
    # The submitter unpacks the mounted archive where py_modules points, then submits.
    assert container["command"][-2:] == [
        f"{shipping.SUBMITTER_ARCHIVE_DIR}/{shipping.ARCHIVE_KEY}",
        shipping.SUBMITTER_CODE_DIR,
    ]
    code = next(o for o in ready.kube.objects("ConfigMap") if o["metadata"]["name"] == "ray-train-code")
    assert len(json.dumps(code["binaryData"]).encode()) < 1 << 20, "a ConfigMap holds at most 1 MiB"
    items = submitter["volumes"][0]["configMap"]["items"]
    assert items == [{"key": shipping.ARCHIVE_KEY, "path": shipping.ARCHIVE_KEY}]
    assert set(code["binaryData"]) == {shipping.ARCHIVE_KEY}
    assert not ready.ray.submitted, "KubeRay's submitter submits a RayJob, not raytrain-eks"
    job_id = ready.kube.get("ray.io/v1", "RayJob", "ray-train", "default")["status"]["jobId"]
    assert ready.store.get("job")["id"] == job_id  # KubeRay's own id for it, remembered for `logs` and `status`


def _after_dashdash(argv: list[str]) -> list[str]:
    return argv[argv.index("--") + 1 :]


def test_the_plans_submit_commands_are_what_submit_runs_in_the_head_pod(ready: World, tmp_path: Path):
    # What `plan -o DIR` writes for --mode raycluster, run as written, must be what `submit` does: unpack the same
    # package into the same folder, then `ray job submit` with the same runtime_env and entrypoint.
    plan, _ = write_plan(ready.d.cfg, tmp_path / "plan-out")
    steps = {s.name: s for s in plan.steps}
    ready.submit()
    (_, pod, unpack, stdin), *_ = [c for c in ready.kube.exec_calls if c[2][:2] == [m.IMAGE_PYTHON, "-c"]]
    assert pod == "ray-train-head-0"
    assert _after_dashdash(steps["upload-package"].command) == unpack
    assert (tmp_path / "plan-out" / steps["upload-package"].stdin).read_text() == stdin
    (sent,) = ready.ray.submitted
    planned = _after_dashdash(steps["submit"].command)
    # submit names its job and returns at once (it follows the logs itself); everything else is the same argv.
    sid = sent.index("--submission-id")
    assert [a for i, a in enumerate(sent) if i not in (sid, sid + 1) and a != "--no-wait"] == planned
    env = json.loads(planned[planned.index("--runtime-env-json") + 1])
    assert env["pip"] and env["py_modules"] == [f"{unpack[-1]}/raytrain_eks"]
    assert _after_dashdash(planned) == m.train_argv()


def test_the_plans_rayjob_is_the_one_submit_applies(ready: World, tmp_path: Path):
    out = tmp_path / "plan-out"
    write_plan(ready.d.cfg, out, mode="rayjob")
    assert ready.submit(mode="rayjob").exit_code == 0
    (applied,) = [o for o in ready.kube.applied if o["kind"] == "RayJob"]
    (planned,) = yaml.safe_load_all((out / "rayjob.yaml").read_text())
    assert planned == applied
    assert yaml.safe_load(planned["spec"]["runtimeEnvYAML"])["py_modules"] == [
        f"{shipping.SUBMITTER_CODE_DIR}/raytrain_eks"
    ]
    code = next(o for o in ready.kube.applied if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "ray-train-code")
    assert list(yaml.safe_load_all((out / "code-configmap.yaml").read_text())) == [code]


def test_rayjob_scales_the_gpu_group_to_zero_after_the_job_and_back_for_the_next(ready: World):
    assert ready.submit(mode="rayjob").exit_code == 0
    scale = ready.tools.commands("eksctl", "scale", "nodegroup")
    assert [c[c.index("--nodes") + 1] for c in scale] == ["0"]
    assert not ready.kube.nodes({"role": "gpu-worker"}), "no GPU instance left billing after the RayJob"
    assert "scaling GPU node group gpu-efa to 0" in ready.said()
    ready.kube.set_status("ray.io/v1", "RayJob", "ray-train", "default", {"jobDeploymentStatus": "Complete"})
    assert ready.submit(mode="rayjob").exit_code == 0
    scale = ready.tools.commands("eksctl", "scale", "nodegroup")
    assert [c[c.index("--nodes") + 1] for c in scale] == ["0", "2", "0"]
    ready.up()  # `up` too brings the group back to its size
    assert len(ready.kube.nodes({"role": "gpu-worker"})) == 2
    assert ready.store.get("gpu_scaled_to") == 2


def test_finished_rayjob_is_replaced_on_resubmit(ready: World):
    ready.submit(mode="rayjob")
    ready.kube.set_status("ray.io/v1", "RayJob", "ray-train", "default", {"jobDeploymentStatus": "Complete"})
    ready.submit(mode="rayjob")
    assert ("ray.io/v1", "RayJob", "ray-train", "default") in ready.kube.deleted


def test_image_missing_requirements_are_the_pinned_deps_minus_the_image():
    reqs = shipping.image_missing_requirements()
    assert "transformers==5.23.0" in reqs and "pydantic==2.14.3" in reqs
    assert not [r for r in reqs if r.startswith(("torch", "ray", "pyarrow", "kubernetes", "boto3", "s3fs"))]


def test_a_job_that_scores_eval_tasks_brings_lm_eval_and_no_other_extra():
    plain = load_config(environ={}, path=None).training
    scoring = plain.model_copy(update={"eval_tasks": ["raytrain_sample_mc"]})
    assert shipping.job_extras(plain) == () and shipping.job_extras(scoring) == ("eval",)
    without, with_eval = shipping.job_requirements(), shipping.job_requirements(shipping.job_extras(scoring))
    assert not [r for r in without if r.startswith(("lm-eval", "mlflow", "wandb"))]
    assert set(with_eval) - set(without) == {"lm-eval>=0.4.13,<0.5"}


# ------------------------------------------------------------------------------------------------------------------
# down, status, logs
# ------------------------------------------------------------------------------------------------------------------


def test_down_deletes_everything_in_reverse_order_and_twice_is_safe(ready: World):
    ready.submit(hf_token=TOKEN)
    created = ready.store.created
    first = len(ready.tools.calls)
    questions: list[str] = []
    result = lifecycle.down(ready.d, confirm=lambda q: questions.append(q) or True)
    assert len(questions) == 1 and "RayCluster default/ray-train" in questions[0]
    assert len(result.deleted) == len(created) and result.leftovers == []
    kinds = [k for (_, k, _, _) in ready.kube.deleted if k != "DaemonSet"]
    assert kinds == ["RayCluster", "ConfigMap", "Secret"]
    tools = [shlex.join(c[:4]) for c in ready.tools.calls[first:] if c[1] in ("uninstall", "delete")]
    assert tools == [
        "helm uninstall kuberay-operator --namespace",
        "helm uninstall aws-efa-k8s-device-plugin --namespace",
        "helm uninstall nvidia-device-plugin --namespace",
        "eksctl delete nodegroup --cluster",
        "eksctl delete nodegroup --cluster",
        "eksctl delete cluster --name",
    ]
    assert [c[-2] for c in ready.tools.commands("eksctl", "delete", "nodegroup")] == ["gpu-efa", "system"]
    assert "Nothing billable is left from this deployment." in ready.said()
    assert ready.tools.cluster is None and not ready.kube.nodes()
    assert not ready.store.path.exists() and not ready.store.kubeconfig.exists()
    # The second down: nothing recorded, nothing run.
    calls = len(ready.tools.calls)
    again = lifecycle.down(StateDeployment(ready), confirm=lambda q: pytest.fail("no question when nothing is left"))
    assert again.deleted == [] and len(ready.tools.calls) == calls
    assert "Nothing to delete" in ready.said()


def StateDeployment(w: World) -> Deployment:  # noqa: N802 - reads like a constructor in the test
    """A fresh Deployment on the same folder, as a new `raytrain-eks down` process would build."""
    w.d.state = StateStore(w.store.root)
    return w.d


def test_down_resumes_after_a_failure(ready: World):
    ready.tools.fail_once["eksctl delete cluster"] = "Error: DELETE_FAILED: eksctl-ray-train-eks-cluster"
    with pytest.raises(CommandError):
        lifecycle.down(ready.d, confirm=lambda q: True)
    assert [i["type"] for i in ready.store.created] == ["bucket", "cluster"]
    lifecycle.down(ready.d, confirm=lambda q: True)
    assert len(ready.tools.commands("eksctl", "delete", "cluster")) == 2
    assert len(ready.tools.commands("eksctl", "delete", "nodegroup")) == 2, "node groups are not deleted twice"


def _leave_behind(cluster: str) -> dict[str, str]:
    """In moto: a NAT gateway and its Elastic IP tagged as eksctl's VPC stack tags them, and a managed node's
    instance tagged as EKS tags it, all of ``cluster``."""
    ec2 = boto3.client("ec2", region_name="us-east-1")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24", AvailabilityZone="us-east-1a")["Subnet"]
    eksctl_tags = [{"Key": "alpha.eksctl.io/cluster-name", "Value": cluster}]
    eip = ec2.allocate_address(Domain="vpc", TagSpecifications=[{"ResourceType": "elastic-ip", "Tags": eksctl_tags}])[
        "AllocationId"
    ]
    nat = ec2.create_nat_gateway(
        SubnetId=subnet["SubnetId"],
        AllocationId=eip,
        TagSpecifications=[{"ResourceType": "natgateway", "Tags": eksctl_tags}],
    )["NatGateway"]["NatGatewayId"]
    node = ec2.run_instances(
        ImageId="ami-12c6146b",
        InstanceType="m7i.xlarge",
        MinCount=1,
        MaxCount=1,
        SubnetId=subnet["SubnetId"],
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "eks:cluster-name", "Value": cluster}]}],
    )["Instances"][0]["InstanceId"]
    return {"nat": nat, "eip": eip, "instance": node}


def test_down_reports_what_still_costs_money_and_checks_again(ready: World):
    mine, other = _leave_behind("ray-train-eks"), _leave_behind("someone-elses-cluster")
    with pytest.raises(UserError) as err:
        lifecycle.down(ready.d, confirm=lambda q: True)
    message = err.value.message
    assert f"NAT gateway {mine['nat']}: `aws ec2 delete-nat-gateway --region us-east-1 --nat-gateway-id" in message
    assert f"Elastic IP {mine['eip']}: `aws ec2 release-address" in message
    assert f"instance {mine['instance']}: `aws ec2 terminate-instances" in message
    assert not any(i in message for i in other.values()), "another cluster's resources are not ours to report"
    assert ready.store.get("leftovers") and ready.tools.cluster is None
    # The user deletes them; the next down finds nothing more to delete, looks again, and forgets the deployment.
    ec2 = boto3.client("ec2", region_name="us-east-1")
    ec2.delete_nat_gateway(NatGatewayId=mine["nat"])
    ec2.release_address(AllocationId=mine["eip"])
    ec2.terminate_instances(InstanceIds=[mine["instance"]])
    again = lifecycle.down(StateDeployment(ready), confirm=lambda q: pytest.fail("nothing is left to confirm"))
    assert again.leftovers == [] and not ready.store.path.exists()
    assert "Nothing billable is left from this deployment." in ready.said()


def test_a_second_down_without_aws_credentials_keeps_the_leftovers_it_cannot_check(
    ready: World, monkeypatch: pytest.MonkeyPatch
):
    mine = _leave_behind("ray-train-eks")
    with pytest.raises(UserError):
        lifecycle.down(ready.d, confirm=lambda q: True)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    with pytest.raises(UserError) as err:
        lifecycle.down(StateDeployment(ready), confirm=lambda q: pytest.fail("nothing is left to confirm"))
    assert "AWS could not be asked now whether they are gone" in err.value.message and mine["nat"] in err.value.message
    assert "Could not check for leftover NAT gateways" in ready.said()
    assert ready.store.path.exists() and ready.store.get("leftovers"), "the record of what still costs money is kept"


def test_down_without_aws_credentials_says_it_could_not_check(ready: World, monkeypatch: pytest.MonkeyPatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    result = lifecycle.down(ready.d, confirm=lambda q: True)
    assert result.leftovers is None and ready.tools.cluster is None
    assert "Could not check for leftover NAT gateways, Elastic IPs or instances: no AWS credentials" in ready.said()
    bucket = ready.store.get("bucket")
    assert f"Kept s3://{bucket}: could not look into it (no AWS credentials found)" in ready.said()
    assert [i["type"] for i in ready.store.created] == ["bucket"], "remembered for a later down"


def test_down_keeps_every_record_when_eksctl_fails_with_another_not_found(ready: World):
    # A missing AWS profile is "not found" too, but says nothing about the cluster: it is not taken as deleted.
    ready.tools.fail_once["eksctl get cluster"] = "Error: failed to get shared config profile, dev: not found"
    created = list(ready.store.created)
    with pytest.raises(CommandError, match="profile, dev: not found"):
        lifecycle.down(ready.d, confirm=lambda q: True)
    assert ready.store.created == created and ready.tools.cluster is not None
    assert not ready.tools.commands("eksctl", "delete")


def _answer(w: World, prefix: list[str], stdout: str) -> None:
    """Make the next commands starting with ``prefix`` succeed with ``stdout`` (another eksctl release's output)."""
    real = w.d.run

    def run(argv: Any, **kw: Any) -> Completed:
        if list(argv[: len(prefix)]) == prefix:
            w.tools.calls.append(list(argv))
            return Completed(tuple(argv), 0, stdout, "")
        return real(argv, **kw)

    w.d.run = run


@pytest.mark.parametrize(
    ("prefix", "stdout", "what"),
    [
        (["eksctl", "get", "cluster"], json.dumps([{"Name": "ray-train-eks"}]), "gave no Status"),
        (["eksctl", "get", "cluster"], "ray-train-eks  ACTIVE", "printed no JSON list"),
        (["eksctl", "get", "nodegroup"], json.dumps([{"Name": "gpu-efa"}]), "gave no Status"),
    ],
)
def test_an_answer_without_a_status_is_unknown_not_active(ready: World, prefix, stdout, what):
    eks_items = [i for i in ready.store.created if i["type"] in ("cluster", "nodegroup")]
    _answer(ready, prefix, stdout)
    with pytest.raises(state.UnreadableAnswer, match=what) as err:
        lifecycle.down(ready.d, confirm=lambda q: True)
    assert "nothing recorded was forgotten" in err.value.message
    kept = [i for i in ready.store.created if i["type"] in ("cluster", "nodegroup")]
    assert kept == eks_items and len(kept) == 3, "the record of the cluster and its node groups is kept"
    assert not ready.tools.commands("eksctl", "delete")
    with pytest.raises(state.UnreadableAnswer):
        lifecycle.status(ready.d)


def test_down_leaves_a_cluster_it_did_not_create(world: World):
    world.tools.cluster = {"name": "ray-train-eks", "azs": ZONES}
    world.up()
    assert "was not created from this folder" in world.said()
    lifecycle.down(world.d, confirm=lambda q: True)
    assert not world.tools.commands("eksctl", "delete", "cluster") and world.tools.cluster is not None


def test_declining_down_deletes_nothing(ready: World):
    with pytest.raises(Cancelled):
        lifecycle.down(ready.d, confirm=lambda q: False)
    assert len(ready.store.created) == 7 and ready.tools.cluster is not None


def test_status_shows_nodes_pods_and_job(ready: World):
    ready.submit()
    text = "\n".join(lifecycle.status(ready.d))
    assert "Cluster ray-train-eks in us-east-1, GPU zone us-east-1a" in text and "EKS cluster: ACTIVE" in text
    assert "Node group gpu-efa: ACTIVE" in text and "nvidia.com/gpu=4 vpc.amazonaws.com/efa=1 Ready" in text
    assert "Ray pod ray-train-head-0: Running Ready" in text and "SUCCEEDED" in text


def test_a_namespace_of_its_own_is_created_first_and_deleted_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str
):
    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, load_config(environ={"NAMESPACE": "training"}, path=None))
    w.up()
    assert w.submit().exit_code == 0
    objects = [i for i in w.store.created if i["type"] == "object"]
    assert [o["kind"] for o in objects] == ["Namespace", "ConfigMap", "RayCluster"]
    assert all(o["namespace"] == "training" for o in objects[1:]) and objects[0]["namespace"] is None
    lifecycle.down(w.d, confirm=lambda q: True)
    assert [k for (_, k, _, _) in w.kube.deleted if k != "DaemonSet"] == ["RayCluster", "ConfigMap", "Namespace"]


def test_status_without_a_deployment(world: World):
    assert "Nothing deployed from this folder" in lifecycle.status(world.d)[0]


def test_logs_come_from_inside_the_head_pod(ready: World):
    with pytest.raises(UserError, match="no job was submitted"):
        sub.logs(ready.d)
    ready.submit()
    out: list[str] = []
    assert sub.logs(ready.d, follow=True, on_output=out.append) == 0
    assert "step 10 loss 2.31" in out
    assert ready.kube.exec_calls[-1][2][:4] == ["ray", "job", "logs", "--address"]


def test_logs_and_metrics_of_a_job_whose_head_pod_is_gone_say_so(ready: World):
    ready.submit()
    ready.kube.delete("ray.io/v1", "RayCluster", "ray-train", "default")  # its pods go with it
    with pytest.raises(UserError, match="the head pod of ray-train is not running, so the job's logs are gone"):
        sub.logs(ready.d)
    with pytest.raises(UserError, match="so the job's metrics are gone with it") as err:
        sub.read_metrics(ready.d, "/tmp/raytrain-eks/runs/x")
    assert "raytrain-eks status" in (err.value.hint or "")


def test_later_commands_use_the_remembered_region_and_zone(ready: World, cfg: Config):
    moved = load_config(environ={"REGION": "us-west-2"}, path=None)
    again = state.apply_state(moved, StateStore(ready.store.root))
    assert (again.cluster.region, again.cluster.gpu_az) == ("us-east-1", "us-east-1a")
    assert state.apply_state(cfg, StateStore(ready.store.root / "elsewhere")) is cfg


def _with_training(cfg: Config, **training: Any) -> Config:
    return cfg.model_copy(update={"training": cfg.training.model_copy(update=training)})


def test_up_refuses_a_run_that_cannot_fit_the_gpus_before_anything_is_created(world: World):
    world.d.cfg = _with_training(world.d.cfg, model_id="Qwen/Qwen2.5-1.5B", seq_len=32768, batch_size=32)
    with pytest.raises(DoesNotFit, match="Qwen/Qwen2.5-1.5B does not fit: memory: about .* even with activation"):
        world.up()
    assert world.tools.calls == [] and world.store.get("cluster") is None and world.kube.applied == []


def test_submit_switches_activation_checkpointing_on_in_the_jobs_config_when_it_must(ready: World):
    bucket = f"s3://{ready.store.get('bucket')}/runs"
    wide = _with_training(ready.d.cfg, model_id="Qwen/Qwen2.5-1.5B", seq_len=2048, batch_size=8, storage_path=bucket)
    assert wide.training.activation_checkpointing is False
    sub.submit(dataclasses.replace(ready.d, cfg=wide))
    cfg = ready.d.cfg
    job = ready.kube.get("v1", "ConfigMap", cfg.ray.cluster_name + "-config", cfg.ray.namespace)
    training = yaml.safe_load(job["data"]["raytrain-eks.yaml"])["training"]
    assert training["activation_checkpointing"] is True and training["seq_len"] == 2048
    said = ready.said()
    assert "activation checkpointing switched on (without it " in said
    # without it, what the GPU would have to hold: the reserved peak and the fixed terms, over the GPU
    assert re.search(r"without it \d+\.\d GiB reserved \(the peak x [\d.]+ for the allocator; .*\), over the GPU", said)


def test_up_refuses_a_folder_that_belongs_to_another_cluster(ready: World):
    other = load_config(environ={"CLUSTER_NAME": "other"}, path=None)
    ready.d.cfg = other
    with pytest.raises(UserError, match="belongs to cluster ray-train-eks"):
        ready.up()


# ------------------------------------------------------------------------------------------------------------------
# CLI wiring
# ------------------------------------------------------------------------------------------------------------------


def test_cli_submit_exit_code_and_down_twice(ready: World, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(deploy_commands, "make_deployment", lambda cfg, state_dir, *say: StateDeployment(ready))
    log = FIXTURES / "socket_fallback_nccl2.27_kubectl.log"
    ready.ray.worker_logs = [log, log]
    app = typer.Typer()
    deploy_commands.register(app)
    cli = CliRunner()
    assert cli.invoke(app, ["submit"]).exit_code == 1
    assert cli.invoke(app, ["down", "-y"]).exit_code == 0
    second = cli.invoke(app, ["down"])  # no -y: nothing to confirm when nothing is left
    assert second.exit_code == 0
    assert "Nothing to delete" in ready.said()


@pytest.mark.parametrize(("assume_yes", "asked"), [("1", False), ("", True), ("0", True)])
def test_assume_yes_of_env_sh_answers_downs_question(ready: World, monkeypatch, assume_yes, asked):
    monkeypatch.setattr(deploy_commands, "make_deployment", lambda cfg, state_dir, *say: StateDeployment(ready))
    app = typer.Typer()
    deploy_commands.register(app)
    result = CliRunner().invoke(app, ["down"], input="n\n", env={"ASSUME_YES": assume_yes})
    assert ("Continue?" in result.output) is asked
    assert (ready.tools.cluster is None) is not asked, "deleted only when ASSUME_YES=1 answered for the user"


# ------------------------------------------------------------------------------------------------------------------
# Small pieces
# ------------------------------------------------------------------------------------------------------------------


def test_exec_status_channel_parsing():
    assert _exec_returncode("") == 0
    assert _exec_returncode('{"status": "Success"}') == 0
    failure = {"status": "Failure", "details": {"causes": [{"reason": "ExitCode", "message": "3"}]}}
    assert _exec_returncode(json.dumps(failure)) == 3
    missing = {"status": "Failure", "message": 'exec: "fi_info": executable file not found in $PATH'}
    assert _exec_returncode(json.dumps(missing)) == 127


def test_kubernetes_api_is_lazy_and_names_a_bad_kubeconfig(tmp_path: Path):
    from raytrain_eks.k8s.cluster import KubeApiError, KubernetesApi

    api = KubernetesApi(tmp_path / "no-such-kubeconfig")  # building it before the cluster exists is fine
    with pytest.raises(KubeApiError) as err:
        api.nodes()
    assert "no-such-kubeconfig" in err.value.message and "raytrain-eks up" in (err.value.hint or "")


def test_quantities_and_events():
    assert parse_quantity("500m") == 0.5 and parse_quantity("2Gi") == 2 * 2**30 and parse_quantity(4) == 4
    with pytest.raises(ValueError):
        parse_quantity("lots")
    assert str(Event("Warning", "FailedScheduling", "0/3 nodes", 4)) == "Warning FailedScheduling: 0/3 nodes (x4)"


def test_launch_failure_reason_is_the_line_that_says_why():
    reason = cfn.no_capacity_reason("gpu-efa", "us-east-1a", "g6.12xlarge")  # the node group stack's event
    text = f"[✖]  waiter state transitioned to Failure\n{reason}"
    assert nodegroups.launch_failure(text).startswith('Resource handler returned message: "[Issue(Code=AsgInstance')
    assert nodegroups.launch_failure("Error: AccessDenied") is None


# -- the checkpoint bucket ---------------------------------------------------------------------------------------


def test_up_creates_a_private_encrypted_bucket_the_ray_pods_may_use(world: World):
    world.up()
    bucket = world.store.get("bucket")
    s3 = boto3.client("s3", region_name="us-east-1")
    block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert all(block.values()) and len(block) == 4
    rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    tags = {t["Key"]: t["Value"] for t in s3.get_bucket_tagging(Bucket=bucket)["TagSet"]}
    assert tags == {"created-by": "raytrain-eks", "raytrain-eks/cluster": "ray-train-eks"}
    # The cluster's eksctl config gives the Ray pods' service account a role limited to that bucket, and validates.
    doc = yaml.safe_load((world.store.root / "eksctl-cluster.yaml").read_text())
    (account,) = doc["iam"]["serviceAccounts"]
    assert account["metadata"] == {"name": m.RAY_SERVICE_ACCOUNT, "namespace": world.d.cfg.ray.namespace}
    resources = {r for st in account["attachPolicy"]["Statement"] for r in st["Resource"]}
    assert resources == {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"}
    schema = json.loads((SCHEMAS / "eksctl" / "clusterconfig.v1alpha5.schema.json").read_text())
    assert not list(jsonschema.validators.validator_for(schema)(schema).iter_errors(doc))
    # Later commands put the checkpoints there, and the Ray pods run as that service account.
    cfg = state.apply_state(load_config(environ={}, path=None), StateStore(world.store.root))
    assert cfg.training.storage_path == f"s3://{bucket}/runs"
    assert {t["spec"]["serviceAccountName"] for t in m.pod_templates(m.raycluster(cfg))} == {m.RAY_SERVICE_ACCOUNT}
    # Running up again finds the same bucket.
    world.up()
    assert world.store.get("bucket") == bucket and [i["type"] for i in world.store.created].count("bucket") == 1


def test_a_configured_bucket_is_used_as_it_is_and_never_deleted(tmp_path: Path, aws_env: str):
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="team-checkpoints")
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1a", "CHECKPOINT_BUCKET": "team-checkpoints"}))
    w.up()
    assert w.store.get("bucket") == "team-checkpoints" and "bucket" not in [i["type"] for i in w.store.created]
    lifecycle.down(w.d, confirm=lambda q: True, delete_checkpoints=True)
    assert boto3.client("s3", region_name="us-east-1").head_bucket(Bucket="team-checkpoints")


def test_a_configured_bucket_that_does_not_exist_stops_up_before_the_cluster(tmp_path: Path, aws_env: str):
    w = World(tmp_path, load_config(environ={"GPU_AZ": "us-east-1a", "CHECKPOINT_BUCKET": "no-such-bucket-here"}))
    with pytest.raises(UserError, match="cluster.checkpoint_bucket = 'no-such-bucket-here': no such bucket"):
        w.up()
    assert not w.tools.commands("eksctl", "create")


def test_down_keeps_a_bucket_that_holds_checkpoints_until_asked(ready: World):
    bucket = ready.store.get("bucket")
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.put_object(Bucket=bucket, Key="runs/run-1/checkpoint_000050/model.pt", Body=b"weights")
    questions: list[str] = []
    result = lifecycle.down(ready.d, confirm=lambda q: questions.append(q) or True)
    assert ready.tools.cluster is None, "everything else is deleted"
    assert f"Keep: Kept s3://{bucket} (1 objects" in questions[0]
    assert result.kept and "raytrain-eks down --delete-checkpoints" in result.kept[0]
    assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] == 1, "nothing a job wrote is lost"
    assert StateStore(ready.store.root).created == [{"type": "bucket", "name": bucket}]
    # A plain down again keeps it and asks nothing; --delete-checkpoints deletes it.
    again = lifecycle.down(StateDeployment(ready), confirm=lambda q: pytest.fail("nothing to confirm"))
    assert again.kept and not again.deleted
    gone = lifecycle.down(StateDeployment(ready), confirm=lambda q: True, delete_checkpoints=True)
    assert gone.deleted == [f"S3 bucket {bucket} (checkpoints and exports)"]
    assert bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert not (ready.store.root / "state.json").exists()


def test_down_deletes_an_empty_bucket_it_created(ready: World):
    bucket = ready.store.get("bucket")
    result = lifecycle.down(ready.d, confirm=lambda q: True)
    assert f"S3 bucket {bucket} (checkpoints and exports)" in result.deleted and not result.kept
    assert bucket not in [b["Name"] for b in boto3.client("s3", region_name="us-east-1").list_buckets()["Buckets"]]


def test_efa_only_selected_after_a_two_node_job_fails_with_the_reason(ready: World):
    # Real output (NVIDIA/nccl#1597): both hosts selected aws-ofi-nccl's efa provider, no connection line followed.
    log = FIXTURES / "real" / "nccl1597_p5en_efa_selected.log"
    ready.ray.worker_logs = [log, log]
    result = ready.submit()
    assert ready.d.cfg.derived.worker_nodes == 2
    assert result.report is not None and (result.report.verdict, result.report.basis) == ("efa", "selected")
    assert result.job_status == "SUCCEEDED" and result.efa_provider is True
    assert result.exit_code == 1
    assert "FAILED: NCCL's inter-node transport does not meet fabric.require = efa" in result.summary
    assert "still do not prove that 'efa' carries the inter-node links of this 2-node job" in ready.said()


def test_submit_tells_the_job_its_cluster_and_price_only_when_up_made_it(world: World, tmp_path: Path):
    from raytrain_eks.eks.pricing import check_deployable, cost_per_hour, job_price
    from raytrain_eks.fabric.deployment import DEPLOYMENT_RECORD

    cfg = world.d.cfg
    name, ns = m.config_map_name(cfg), cfg.ray.namespace
    # From a folder where `up` did not run, the state does not say the cluster is this tool's: no record.
    sub.apply_job_config(dataclasses.replace(world.d, state=StateStore(tmp_path / "elsewhere")), None)
    assert list(world.kube.get("v1", "ConfigMap", name, ns)["data"]) == [m.CONFIG_FILE]

    world.up()
    world.submit()
    data = world.kube.get("v1", "ConfigMap", name, ns)["data"]
    hourly = cost_per_hour(cfg, *check_deployable(cfg))["total_usd"]
    record = json.loads(data[DEPLOYMENT_RECORD])
    assert (record["cluster"], record["gpu_node_type"]) == (cfg.cluster.name, "g6.12xlarge")
    assert record["usd_per_hour"] == hourly
    # What the head pod's volume shows of the ConfigMap (the kubelet's part), read as `train --config` reads it.
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for key, text in data.items():
        (mounted / key).write_text(text)
    price, why_not = job_price(mounted / m.CONFIG_FILE)
    assert price is not None and why_not is None
    cost = price({"wall_s": 1800.0, "trained_tokens": 1_000_000})
    assert cost["usd"] == pytest.approx(hourly / 2, abs=1e-4) and cost["cluster"] == cfg.cluster.name
    # A price the user configured (their discounts) is taken over the on-demand price of the record.
    price, _ = job_price(mounted / m.CONFIG_FILE, 3.0)
    cost = price({"wall_s": 1800.0, "trained_tokens": 1_000_000})
    assert (cost["usd"], cost["source"], cost["cluster"]) == (1.5, "configured", cfg.cluster.name)


def test_rayjob_is_refused_while_the_rayclusters_pods_hold_the_gpus(ready: World):
    assert ready.submit().exit_code == 0  # --mode raycluster: its RayCluster stays, its workers on both GPU nodes
    applied = len(ready.kube.applied)
    with pytest.raises(UserError) as info:
        ready.submit(mode="rayjob")
    assert info.value.message.startswith(
        "RayCluster default/ray-train (of `submit --mode raycluster`) still holds the GPU nodes (2 of its 2 worker "
        "pods placed): the RayJob's own RayCluster would wait for their GPUs"
    )
    delete = f"kubectl --kubeconfig {ready.d.kubeconfig} -n default delete raycluster ray-train"
    assert f"`{delete}`" in (info.value.hint or "")
    assert len(ready.kube.applied) == applied and not ready.kube.objects("RayJob"), "nothing was applied"
    assert ready.kube.get("ray.io/v1", "RayCluster", "ray-train", "default"), "nothing was deleted"


def test_rayjob_evidence_is_read_before_its_cluster_is_deleted(ready: World):
    # Reading a long job's Ray session logs in a worker pod takes a while: 45 s per pod here. KubeRay deletes a
    # finished RayJob's cluster ttlSecondsAfterFinished after the job's end, whatever submit is still reading.
    def slow_logs(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        result = ready.ray(ns, pod, argv, stdin)
        if argv[:3] == [m.IMAGE_PYTHON, "-c", sub._NCCL_LINES]:
            ready.kube.sleep(45)
        return result

    ready.kube.exec_handler = slow_logs
    result = ready.submit(mode="rayjob")
    assert result.exit_code == 0, result.summary
    assert result.report is not None and result.report.verdict == "efa"
    assert result.efa_provider is True and result.versions == {"driver": "580.126.09", "cuda": "13.0"}
    # Then submit deletes the cluster itself, before the GPU nodes go.
    status = ready.kube.get("ray.io/v1", "RayJob", "ray-train", "default")["status"]
    cluster = status["rayClusterName"]  # KubeRay's: the RayJob's name and five random characters
    assert re.fullmatch(r"ray-train-[a-z0-9]{5}", cluster)
    assert ("ray.io/v1", "RayCluster", cluster, "default") in ready.kube.deleted
    assert not ready.kube.pods("default", {"ray.io/cluster": cluster})
    assert status["jobDeploymentStatus"] == "Complete"
    said = ready.said()
    assert said.index(f"Deleted RayCluster default/{cluster}") < said.index("scaling GPU node group")


def test_ctrl_c_while_following_a_rayjob_deletes_it_and_scales_the_gpu_group_to_zero(ready: World):
    def interrupted(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:3] == ["ray", "job", "logs"] and "--follow" in argv:
            raise KeyboardInterrupt  # Ctrl-C while submit streams the job's log
        return ready.ray(ns, pod, argv, stdin)

    ready.kube.exec_handler = interrupted
    with pytest.raises((UserError, KeyboardInterrupt)) as stopped:
        ready.submit(mode="rayjob")
    assert isinstance(stopped.value, UserError), "Ctrl-C left the RayJob running"
    job = ready.store.get("job")
    assert stopped.value.exit_code == 130 and job["status"] == "STOPPED"
    assert stopped.value.message.startswith(
        f"stopped by Ctrl-C: job {job['id']} is stopped, its RayJob default/ray-train deleted with its RayCluster and "
        "pods, so nothing of it runs or holds GPU nodes any more"
    )
    assert "raytrain-eks submit --mode rayjob" in (stopped.value.hint or "")
    assert ready.kube.get("ray.io/v1", "RayJob", "ray-train", "default") is None
    assert not ready.kube.objects("RayCluster") and not ready.kube.pods("default", {})
    scale = ready.tools.commands("eksctl", "scale", "nodegroup")
    assert [c[c.index("--nodes") + 1] for c in scale] == ["0"]
    assert not ready.kube.nodes({"role": "gpu-worker"}), "no GPU instance left billing"
    said = ready.said()
    assert said.index("Ctrl-C: stopping job") < said.index("scaling GPU node group gpu-efa to 0")


def test_ctrl_c_while_submit_waits_for_the_rayjobs_pods_deletes_it_too(ready: World):
    listings = ready.kube.pods

    def interrupted(namespace: str, selector: Mapping[str, str] | None = None) -> list[Pod]:
        if "ray.io/cluster" in (selector or {}) and ready.kube.objects("RayJob"):
            raise KeyboardInterrupt  # Ctrl-C while submit waits for the RayJob's pods to run
        return listings(namespace, selector)

    ready.kube.pods = interrupted  # type: ignore[method-assign]
    with pytest.raises((UserError, KeyboardInterrupt)) as stopped:
        ready.submit(mode="rayjob")
    ready.kube.pods = listings  # type: ignore[method-assign]
    assert isinstance(stopped.value, UserError), "Ctrl-C left the RayJob running"
    assert stopped.value.exit_code == 130 and ("ray.io/v1", "RayJob", "ray-train", "default") in ready.kube.deleted
    assert stopped.value.message.startswith("stopped by Ctrl-C: job "), stopped.value.message
    assert "its RayJob default/ray-train deleted with its RayCluster and pods" in stopped.value.message
    assert ready.kube.get("ray.io/v1", "RayJob", "ray-train", "default") is None
    assert not ready.kube.objects("RayCluster") and not ready.kube.pods("default", {})
    scale = ready.tools.commands("eksctl", "scale", "nodegroup")
    assert [c[c.index("--nodes") + 1] for c in scale] == ["0"]
    assert not ready.kube.nodes({"role": "gpu-worker"}), "no GPU instance left billing"
    assert ready.store.get("job")["status"] == "STOPPED"


def test_ctrl_c_again_before_the_rayjob_is_deleted_names_the_command_that_deletes_it(ready: World):
    def interrupted(ns: str, pod: str, argv: list[str], stdin: str | None) -> ExecResult:
        if argv[:3] == ["ray", "job", "logs"] and "--follow" in argv:
            raise KeyboardInterrupt
        return ready.ray(ns, pod, argv, stdin)

    def delete(api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        if kind == "RayJob":
            raise KeyboardInterrupt  # the second Ctrl-C, while submit deletes the RayJob
        return deletes(api_version, kind, name, namespace)

    ready.kube.exec_handler, deletes = interrupted, ready.kube.delete
    ready.kube.delete = delete  # type: ignore[method-assign]
    with pytest.raises((UserError, KeyboardInterrupt)) as stopped:
        ready.submit(mode="rayjob")
    assert isinstance(stopped.value, UserError) and stopped.value.exit_code == 130
    assert "before RayJob default/ray-train was deleted" in stopped.value.message
    assert f"`kubectl --kubeconfig {ready.d.kubeconfig} -n default delete rayjob ray-train`" in stopped.value.hint
    assert ready.kube.get("ray.io/v1", "RayJob", "ray-train", "default") is not None


KUBERAY_CONTROLLER = Path(__file__).parent / "fixtures/kuberay/ray-operator/controllers/ray/rayjob_controller.go"


def test_the_kuberay_fake_deletes_a_finished_rayjobs_cluster_after_its_ttl(cfg: Config):
    # What the fake plays, as KubeRay v1.7.0's RayJob controller has it.
    source = KUBERAY_CONTROLLER.read_text()
    assert "RayJobDefaultRequeueDuration    = 3 * time.Second" in source
    from fake_kube import KUBERAY_REQUEUE_S

    assert KUBERAY_REQUEUE_S == 3.0
    assert "newRayJob.Status.EndTime = &metav1.Time{Time: time.Now()}" in source  # when it turns Complete/Failed
    shutdown = source[source.index("func (r *RayJobReconciler) handleShutdownAfterJobFinishes(") :]
    shutdown = shutdown[: shutdown.index("\n}\n")]
    assert "shutdownTime := rayJob.Status.EndTime.Add(time.Duration(ttlSeconds) * time.Second)" in shutdown
    assert "r.deleteClusterResources(ctx, rayJob)" in shutdown

    for shutdown_after in (True, False):
        kube = FakeKube()
        jobs: dict[str, str] = {}
        kube.ray_job_status = jobs.get
        doc = m.rayjob(cfg)
        # KubeRay v1.7.0 refuses a TTL without shutdownAfterJobFinishes (ray-operator/controllers/ray/utils/
        # validation.go, validateDeletionConfiguration): none then.
        ttl = 100 if shutdown_after else 0
        doc["spec"].update(shutdownAfterJobFinishes=shutdown_after, ttlSecondsAfterFinished=ttl)
        kube.apply(doc)
        kube.sleep(1)
        status = kube.get("ray.io/v1", "RayJob", "ray-train", "default")["status"]
        cluster = ("ray.io/v1", "RayCluster", status["rayClusterName"], "default")
        assert kube.get(*cluster) and kube.pods("default", {"ray.io/cluster": cluster[2]})
        jobs[status["jobId"]] = "RUNNING"
        kube.sleep(30)
        assert kube.get("ray.io/v1", "RayJob", "ray-train", "default")["status"]["jobDeploymentStatus"] == "Running"
        jobs[status["jobId"]] = "SUCCEEDED"
        kube.sleep(1)  # within one requeue: endTime is now
        assert kube.get("ray.io/v1", "RayJob", "ray-train", "default")["status"]["jobDeploymentStatus"] == "Complete"
        kube.sleep(98)
        assert kube.get(*cluster), "before the TTL"
        kube.sleep(2)
        assert (kube.get(*cluster) is None) is shutdown_after
        assert bool(kube.pods("default", {"ray.io/cluster": cluster[2]})) is not shutdown_after


# -- the device plugins eksctl applies by itself, and Helm's ownership of the charts' objects ---------------------


def _efa_daemon_set(w: World) -> dict[str, Any]:
    found = w.kube.get("apps/v1", "DaemonSet", "aws-efa-k8s-device-plugin", "kube-system")
    assert found is not None
    return found


def _owned_by_the_efa_release(obj: dict[str, Any]) -> bool:
    meta = obj["metadata"]
    annotations = meta.get("annotations", {})
    return (
        meta.get("labels", {}).get("app.kubernetes.io/managed-by") == "Helm"
        and annotations.get("meta.helm.sh/release-name") == "aws-efa-k8s-device-plugin"
        and annotations.get("meta.helm.sh/release-namespace") == "kube-system"
    )


def test_eksctls_efa_plugin_gives_way_to_the_charts_own(world: World):
    # eksctl applies its EFA DaemonSet under the very name of the chart's: up deletes it, and Helm installs its own.
    world.up()
    assert "Removed eksctl's own DaemonSet kube-system/aws-efa-k8s-device-plugin" in world.said()
    ds = _efa_daemon_set(world)
    assert _owned_by_the_efa_release(ds)
    assert ds["metadata"]["labels"]["helm.sh/chart"] == "aws-efa-k8s-device-plugin-v0.5.30"
    gpus = world.kube.nodes({"role": "gpu-worker"})
    pods = world.kube.pods("kube-system", {"name": "aws-efa-k8s-device-plugin"})
    assert sorted(p.node_name for p in pods if p.ready) == sorted(n.name for n in gpus)
    assert all(n.allocatable[m.EFA_RESOURCE] == "1" for n in gpus)
    # Running up again keeps the chart's own DaemonSet and installs nothing again.
    calls = len(world.tools.calls)
    world.up()
    assert _owned_by_the_efa_release(_efa_daemon_set(world))
    assert not [c for c in world.tools.calls[calls:] if c[:2] == ["helm", "upgrade"]]


def test_a_gpu_node_group_made_again_gets_the_efa_chart_installed_again(ready: World):
    # The GPU group is made again (here after it degraded): eksctl applies its DaemonSet over the chart's, whose
    # release Helm still calls deployed. up must see that the DaemonSet is no longer the release's and reinstall.
    ready.tools.nodegroups["gpu-efa"]["status"] = "DEGRADED"
    calls = len(ready.tools.calls)
    ready.up()
    again = ready.tools.calls[calls:]
    assert [c[:2] for c in again if c[:3] == ["eksctl", "create", "nodegroup"]] == [["eksctl", "create"]]
    assert [c[3] for c in again if c[:2] == ["helm", "upgrade"]] == ["aws-efa-k8s-device-plugin"]
    said = ready.said()
    assert "Removed eksctl's own DaemonSet kube-system/aws-efa-k8s-device-plugin" in said
    assert "Helm release aws-efa-k8s-device-plugin is deployed but its DaemonSet kube-system/" in said
    assert _owned_by_the_efa_release(_efa_daemon_set(ready))
    assert all(n.allocatable[m.EFA_RESOURCE] == "1" for n in ready.kube.nodes({"role": "gpu-worker"}))
    assert ready.tools.releases[("kube-system", "aws-efa-k8s-device-plugin")]["revision"] == 2


def test_helm_refuses_to_install_the_efa_chart_over_eksctls_daemonset(ready: World):
    # What real Helm answers when the chart's DaemonSet exists without the release's ownership metadata: the fake
    # helm says it as Helm does (its refusal is what up must avoid).
    (install,) = [c for c in ready.tools.commands("helm", "upgrade") if c[3] == "aws-efa-k8s-device-plugin"]
    ready.tools(["helm", "uninstall", "aws-efa-k8s-device-plugin", "--namespace", "kube-system", "--kubeconfig",
                 ready.d.kubeconfig], timeout=60)  # fmt: skip
    ready.kube.put(eksctl_efa_daemon_set())
    done = ready.tools(install, timeout=60, check=False)
    assert done.returncode == 1 and done.stderr == (
        'Error: Unable to continue with install: DaemonSet "aws-efa-k8s-device-plugin" in namespace "kube-system" '
        "exists and cannot be imported into the current release: invalid ownership metadata; label validation error: "
        'missing key "app.kubernetes.io/managed-by": must be set to "Helm"; annotation validation error: missing key '
        '"meta.helm.sh/release-name": must be set to "aws-efa-k8s-device-plugin"; annotation validation error: '
        'missing key "meta.helm.sh/release-namespace": must be set to "kube-system"\n'
    )
    assert not _owned_by_the_efa_release(_efa_daemon_set(ready))


def test_release_lookups_are_helm_get_metadata_and_a_missing_release_is_none(ready: World):
    # `helm list --all` is gone in Helm 4 ("Error: unknown flag: --all"); both majors have `helm get metadata`.
    looked = [c for c in ready.tools.calls if c[0] == "helm" and c[1] not in ("upgrade", "uninstall")]
    assert looked and all(c[:3] == ["helm", "get", "metadata"] for c in looked)
    assert addons.release_info(ready.d, "kuberay-operator", "kuberay-system")["version"] == "1.7.0"
    assert addons.release_info(ready.d, "no-such-release", "kube-system") is None
    lifecycle.down(ready.d, confirm=lambda q: True)
    assert not [c for c in ready.tools.calls if c[:2] == ["helm", "list"]]


def test_an_existing_cluster_is_used_and_never_created_or_deleted(world: World):
    existing = dataclasses.replace(
        world.d,
        cfg=world.d.cfg.model_copy(update={"cluster": world.d.cfg.cluster.model_copy(update={"existing": True})}),
    )
    questions: list[str] = []
    with pytest.raises(UserError, match="cluster.existing is true: up does not create one"):
        lifecycle.up(existing, confirm=questions.append, offered_zones=lambda: nodegroups.Placement(list(ZONES)))
    assert questions == [] and not world.store.created and not world.tools.commands("eksctl", "create")
    assert not boto3.client("s3").list_buckets()["Buckets"]  # not even the checkpoint bucket
    world.tools.cluster = {"name": "ray-train-eks", "azs": ZONES}
    lifecycle.up(
        existing, confirm=lambda q: questions.append(q) or True, offered_zones=lambda: nodegroups.Placement(list(ZONES))
    )
    assert questions[0].startswith("Use existing cluster ray-train-eks in us-east-1, adding 2 x g6.12xlarge")
    assert not world.tools.commands("eksctl", "create", "cluster")
    assert world.tools.commands("eksctl", "create", "nodegroup")
    lifecycle.down(existing, confirm=lambda q: True)
    assert not world.tools.commands("eksctl", "delete", "cluster") and world.tools.cluster is not None
