"""The eksctl side of the EKS path, checked against eksctl v0.230.0's own source (vendored in fixtures/eksctl/).

- The reader of eksctl's flag definitions (eksctl_source.py) finds each command the tool runs, every flag of it,
  and fails on what it cannot find.
- Every eksctl command line ``up``, ``status``, ``submit --mode rayjob``, ``down`` and the plan build is one eksctl
  accepts: the command exists, each flag is defined for it, none it refuses with (or without) a config file, none
  deprecated; every create, delete and scale waits (``--timeout``) less than the runner lets it run.
- Every eksctl command line a message or hint quotes for the user to run is one eksctl accepts, with a
  ``--timeout`` where it waits; the missing-program message names the helm commands ``up`` and ``down`` run.
- eksctl's own wait ending is a launch failure of that zone (the next zone is tried); a stack a failed create left
  is removed by ``up`` and by ``down``; zones EKS cannot take a cluster in are never passed; ``create cluster``
  writes only this folder's kubeconfig.

eksctl runs as tests/test_deploy.py's FakeTools (which reads every command line as eksctl's source does); its
CloudFormation stacks and the EC2 zones are moto's.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path
from typing import Any

import eksctl_source
import fake_eksctl_stacks as cfn
import jsonschema
import pytest
from fake_aws import FakeQuotas, FakeReservations, FakeSpotScores
from test_deploy import ZONES, World

from raytrain_eks.aws import eksctl, stacks
from raytrain_eks.aws.services import Services
from raytrain_eks.config import Config, load_config
from raytrain_eks.eks import irsa, lifecycle, nodegroups, programs
from raytrain_eks.eks.plan import write_plan
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.k8s.runner import CommandError, MissingToolsError
from raytrain_eks.k8s.state import StateStore

REGION = "us-east-1"
# The commands the EKS path runs (besides the IAM service account's, checked when it runs them too).
COMMANDS = {
    ("create", "cluster"),
    ("create", "nodegroup"),
    ("delete", "cluster"),
    ("delete", "nodegroup"),
    ("scale", "nodegroup"),
    ("get", "cluster"),
    ("get", "nodegroup"),
    ("utils", "write-kubeconfig"),
}
WAITING = {("create", "cluster"), ("create", "nodegroup"), ("delete", "cluster"), ("delete", "nodegroup")}
WAITING |= {("scale", "nodegroup"), ("create", "iamserviceaccount"), ("update", "iamserviceaccount")}
WAITING |= {("delete", "iamserviceaccount")}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    monkeypatch.chdir(tmp_path)
    return World(tmp_path, load_config(environ={}, path=None))


def eksctl_calls(w: World) -> list[tuple[list[str], float]]:
    return [(argv, limit) for argv, limit in zip(w.tools.calls, w.tools.timeouts, strict=True) if argv[0] == "eksctl"]


def quoted_eksctl(text: str) -> list[list[str]]:
    """Every eksctl command line ``text`` quotes for the user to run (between backticks), split as a shell would."""
    return [shlex.split(q) for q in re.findall(r"`(eksctl [^`]*)`", text)]


def check_argv(argv: list[str]) -> tuple[eksctl_source.Command, dict[str, Any]]:
    """The command and its flags, as eksctl's source reads them; fails on anything eksctl would refuse or warn of."""
    try:
        cmd, given = eksctl_source.parse_argv(argv)
    except eksctl_source.ArgvError as exc:
        raise AssertionError(f"eksctl refuses `{' '.join(argv)}`: {exc}") from None
    deprecated = [f"--{n}" for n in given if cmd.flags[n].deprecated]
    assert not deprecated, f"`{' '.join(argv)}` uses deprecated {deprecated}"
    return cmd, given


# ------------------------------------------------------------------------------------------------------------------
# The reader of eksctl's source
# ------------------------------------------------------------------------------------------------------------------


def test_the_reader_finds_every_flag_a_command_file_defines():
    """Each pflag call in pkg/ctl/create/cluster.go is one flag of `create cluster`, and the helpers' flags come
    with it, each with the type and default its definition gives."""
    source = (eksctl_source.CTL / "create" / "cluster.go").read_text()
    definitions = re.findall(r"\bfs\.(?:Bool|String|Int|IPNet|StringSlice|Duration)\w*\(", source)
    create = eksctl_source.command("create", "cluster")
    own = {n for n, f in create.flags.items() if f.origin == "pkg/ctl/create/cluster.go"}
    assert len(definitions) == len(own) == 16 and {"name", "with-oidc", "write-kubeconfig", "vpc-nat-mode"} <= own
    assert create.flags["config-file"].shorthand == "f" and create.flags["timeout"].kind == "Duration"
    assert create.flags["install-nvidia-plugin"].is_bool and create.flags["install-nvidia-plugin"].default == "true"
    # AddCommonFlagsForAWS(cmd, p, addCfnOptions): the CloudFormation flags only where the caller passes true.
    assert "cfn-role-arn" in create.flags and "cfn-role-arn" not in eksctl_source.command("get", "cluster").flags
    assert eksctl_source.command("utils", "write-kubeconfig").flags["name"].deprecated  # AddClusterFlagWithDeprecated
    assert eksctl_source.command("get", "ng").resource == "nodegroup"  # an alias


def test_the_reader_fails_loudly_instead_of_finding_nothing():
    with pytest.raises(eksctl_source.SourceError, match="no such command"):
        eksctl_source.command("create", "no-such-thing")
    with pytest.raises(eksctl_source.SourceError, match="is not vendored"):
        eksctl_source.command("upgrade", "cluster")
    with pytest.raises(eksctl_source.SourceError, match="not an eksctl command"):
        eksctl_source.parse_argv(["helm", "list"])
    with pytest.raises(eksctl_source.ArgvError, match="unknown flag: --no-such-flag"):
        eksctl_source.parse_argv(["eksctl", "get", "cluster", "--no-such-flag"])


def test_the_config_loaders_refuse_what_eksctl_refuses():
    """pkg/ctl/cmdutils/configfile.go: --region with -f, and --include without it, are errors."""
    with pytest.raises(eksctl_source.ArgvError, match="cannot use --region when --config-file/-f is set"):
        eksctl_source.parse_argv(["eksctl", "create", "nodegroup", "-f", "x.yaml", "--region", REGION])
    with pytest.raises(eksctl_source.ArgvError, match="cannot use --include unless a config file"):
        eksctl_source.parse_argv(["eksctl", "delete", "nodegroup", "--cluster", "c", "--include", "x"])
    create = eksctl_source.command("create", "cluster")
    assert {"zones", "tags", "nodes", "region"} <= create.refused_with_config_file
    assert "kubeconfig" not in create.refused_with_config_file and "timeout" not in create.refused_with_config_file


# ------------------------------------------------------------------------------------------------------------------
# Every eksctl command line the tool builds
# ------------------------------------------------------------------------------------------------------------------


def test_every_eksctl_command_the_tool_builds_is_one_eksctl_accepts(world: World, tmp_path: Path):
    """Each is a command of eksctl, with flags it defines, none it refuses or deprecates; and each create, delete
    and scale says how long eksctl waits (its default, DefaultWaitTimeout, is 25 minutes), less than the runner
    lets it run, so eksctl's own message is the one seen."""
    w = world
    w.tools.no_capacity = {"us-east-1a"}  # one zone fails: the failed group is deleted, the next zone tried
    w.up()
    lifecycle.status(w.d)
    assert w.submit(mode="rayjob").exit_code == 0  # scales the GPU group to 0 after the job
    lifecycle.down(w.d, confirm=lambda q: True)
    # A cluster EKS never made, whose stack is left: down deletes it through CloudFormation (eksctl would die).
    w2 = World(tmp_path / "failed", w.d.cfg)
    w2.tools.cluster_fails = "ROLLBACK_COMPLETE"
    with pytest.raises(CommandError) as failed:
        w2.up()
    lifecycle.down(w2.d, confirm=lambda q: True)
    run = eksctl_calls(w) + eksctl_calls(w2)
    # What the user is told to run: every line said, the failure's message and hint, up --plan's words.
    told = [w.said(), w2.said(), str(failed.value), failed.value.hint or ""]
    told += [a.what for a in lifecycle.planned_actions(w.d.cfg)]
    told.append(nodegroups.gpu_node_spec(w.d.cfg, ZONES[0]).missing_hint)
    default = eksctl_source.go_constant("pkg/apis/eksctl.io/v1alpha5/types.go", "DefaultWaitTimeout")
    assert default == "25 * time.Minute"
    waiting = 0
    for argv, limit in run:
        cmd, given = check_argv(argv)
        if (cmd.verb, cmd.resource) in WAITING:
            assert "timeout" in given, f"`{' '.join(argv)}` waits eksctl's default {default}"
            assert eksctl_source.wait_seconds(cmd, given) < limit, argv
            waiting += 1
    assert waiting >= 8
    built = [argv for argv, _ in run]
    # What `up --plan` shows and what the plan's files say to run.
    built += [a.argv for a in lifecycle.planned_actions(w.d.cfg) if a.argv and a.argv[0] == "eksctl"]
    plan_dir = tmp_path / "plan"
    write_plan(w.d.cfg, plan_dir, mode="rayjob")
    steps = json.loads((plan_dir / "plan.json").read_text())["steps"]
    built += [s["command"] for s in steps if s.get("command") and s["command"][0] == "eksctl"]

    quoted = [argv for text in told for argv in quoted_eksctl(text)]
    assert quoted, "the messages quote eksctl commands"
    for argv in quoted:  # a command named alone (`eksctl update iamserviceaccount`) is a name, not one to run
        cmd, given = check_argv(argv)
        if (cmd.verb, cmd.resource) in WAITING and len(argv) > 3:
            assert "timeout" in given, f"`{' '.join(argv)}` (quoted to the user) waits eksctl's default {default}"

    seen = set()
    for argv in built:
        cmd, given = check_argv(argv)
        seen.add((cmd.verb, cmd.resource))
        if "config-file" in given:  # the file is a ClusterConfig naming the cluster and region itself
            assert not {"cluster", "name", "region"} & set(given), argv
    assert seen >= COMMANDS, f"not exercised: {sorted(COMMANDS - seen)}"
    assert not any("--force" in a for a in built if a[1:3] == ["delete", "cluster"]), "eksctl dies on a missing cluster"


def test_scaling_the_gpu_group_waits_until_eks_has_scaled_it():
    """eksctl's --wait on `scale nodegroup` is off by default (AddWaitFlag binds cmd.Wait, false): without it eksctl
    returns once EKS accepts the update, and a RayJob submitted straight after meets a scale in progress. With it,
    eksctl waits for the node group (--timeout, below the runner's limit)."""
    cfg = load_config(environ={}, path=None)
    for nodes in (0, cfg.cluster.gpu_node_count):
        cmd, given = check_argv(eksctl.scale_gpu_nodegroup_argv(cfg, nodes))
        assert (cmd.verb, cmd.resource) == ("scale", "nodegroup") and cmd.flags["wait"].is_bool
        assert given.get("wait") is True, given
        assert eksctl_source.wait_seconds(cmd, given) < nodegroups.NODEGROUP_TIMEOUT_S


def test_the_missing_helm_message_names_the_helm_commands_up_and_down_run(world: World):
    world.up()
    world.tools.missing = {"helm"}
    with pytest.raises(MissingToolsError) as err:
        programs.require_programs(world.d, "up", "down", steps_of=programs.command_steps)
    named = re.search(r"\(helm ([^)]*)\)", err.value.message)
    assert named is not None, err.value.message
    world.tools.missing = set()
    lifecycle.down(world.d, confirm=lambda q: True)
    ran = {" ".join(c[1:3]) if c[1] == "get" else c[1] for c in world.tools.commands("helm")}
    assert set(named.group(1).split("/")) == ran == {"get metadata", "upgrade", "uninstall"}


# ------------------------------------------------------------------------------------------------------------------
# eksctl's own wait ends: a launch failure of that zone
# ------------------------------------------------------------------------------------------------------------------


def test_a_gpu_launch_slower_than_eksctls_wait_moves_on_to_the_next_zone(world: World):
    world.tools.launch_minutes = {"us-east-1a": 60}  # never Ready within any wait
    result = world.up()
    assert result.gpu_az == "us-east-1b"
    said = world.said()
    assert "could not launch in us-east-1a: no Ready instances within eksctl's 35-minute wait" in said
    assert "exceeded max wait time for StackCreateComplete waiter" in said
    deletes = world.tools.commands("eksctl", "delete", "nodegroup")
    assert [c[c.index("--name") + 1] for c in deletes] == ["gpu-efa"], "the CREATING group is removed first"
    assert world.store.get("zone_failures")["us-east-1a"].startswith("no Ready instances within eksctl's")


def test_eksctls_wait_ended_is_read_as_a_launch_failure():
    line = "2026-01-01 10:00:00 [✖]  exceeded max wait time for StackCreateComplete waiter"
    assert "35-minute wait" in (nodegroups.launch_failure(f"other\n{line}\n") or "")
    assert nodegroups.launch_failure("[✖]  waiter state transitioned to Failure") is None


# ------------------------------------------------------------------------------------------------------------------
# The stack a failed create leaves
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "stale", "busy"),
    [
        ("ROLLBACK_COMPLETE", True, False),
        ("CREATE_FAILED", True, False),
        ("ROLLBACK_FAILED", True, False),
        ("DELETE_FAILED", True, False),
        ("CREATE_IN_PROGRESS", False, True),
        ("ROLLBACK_IN_PROGRESS", False, True),
        ("DELETE_IN_PROGRESS", False, True),
        ("CREATE_COMPLETE", False, False),
        ("UPDATE_COMPLETE", False, False),
        (None, False, False),
    ],
)
def test_which_stacks_are_left_by_a_failed_create(status: str | None, stale: bool, busy: bool):
    assert (stacks.stale_stack(status), stacks.busy_stack(status)) == (stale, busy)


def test_the_cluster_stack_is_named_as_eksctl_names_it():
    source = (eksctl_source.ROOT / "pkg" / "cfn" / "manager" / "cluster.go").read_text()
    assert 'return "eksctl-" + name + "-cluster"' in source
    assert stacks.cluster_stack_name("ray-train-eks") == "eksctl-ray-train-eks-cluster"


def test_up_removes_the_stack_a_failed_create_left_then_creates_the_cluster(world: World):
    world.tools.cluster_fails = "ROLLBACK_COMPLETE"
    with pytest.raises(CommandError, match='failed to create cluster "ray-train-eks"'):
        world.up()
    assert cfn.stack_status("ray-train-eks", REGION) == "ROLLBACK_COMPLETE" and world.tools.cluster is None
    world.tools.cluster_fails = None
    world.lines.clear()
    assert world.up().gpu_az == ZONES[0]
    assert "eksctl-ray-train-eks-cluster is ROLLBACK_COMPLETE, left by a create that failed" in world.said()
    assert cfn.stack_status("ray-train-eks", REGION) == "CREATE_COMPLETE", "the new cluster's own stack"


def test_up_stops_at_a_stack_of_the_clusters_name_that_is_in_use(world: World):
    assert cfn.create_cluster_stack("ray-train-eks", REGION) is None  # made outside this folder, EKS has no cluster
    with pytest.raises(UserError, match="exists \\(CREATE_COMPLETE\\) in us-east-1, but EKS has no cluster") as err:
        world.up()
    assert "delete-stack --stack-name eksctl-ray-train-eks-cluster" in (err.value.hint or "")
    assert not world.tools.commands("eksctl", "create")
    assert cfn.stack_status("ray-train-eks", REGION) == "CREATE_COMPLETE"


def test_down_deletes_the_stack_of_a_cluster_eks_never_made(world: World):
    world.tools.cluster_fails = "ROLLBACK_COMPLETE"
    with pytest.raises(CommandError):
        world.up()
    result = lifecycle.down(world.d, confirm=lambda q: True)
    assert cfn.stack_status("ray-train-eks", REGION) is None, "nothing of the failed create is left"
    assert any(d.startswith("EKS cluster ray-train-eks") for d in result.deleted)
    assert not world.tools.commands("eksctl", "delete", "cluster") and not world.store.created
    assert "eksctl-ray-train-eks-cluster is ROLLBACK_COMPLETE, while EKS has no cluster ray-train-eks" in world.said()


def test_down_without_cluster_or_stack_deletes_nothing_of_the_cluster(world: World):
    world.tools.cluster_fails = "ROLLBACK_COMPLETE"
    with pytest.raises(CommandError):
        world.up()
    cfn.delete_cluster_stack("ray-train-eks", REGION)  # someone removed it in the console
    lifecycle.down(world.d, confirm=lambda q: True)
    assert not world.tools.commands("eksctl", "delete", "cluster") and not world.store.created


# ------------------------------------------------------------------------------------------------------------------
# Zones EKS cannot take a cluster in
# ------------------------------------------------------------------------------------------------------------------


def test_the_avoided_zones_are_eksctls():
    """pkg/az/az.go's zoneIDsToAvoid, its region constants resolved in pkg/apis/eksctl.io/v1alpha5/types.go."""
    source = (eksctl_source.ROOT / "pkg" / "az" / "az.go").read_text()
    block = re.search(r"zoneIDsToAvoid = map\[string\]\[\]string\{(.*?)\n\}", source, re.S)
    assert block is not None
    found = {}
    for const, ids in re.findall(r"api\.(\w+):\s*\{([^}]*)\}", block.group(1)):
        region = eksctl_source.go_constant("pkg/apis/eksctl.io/v1alpha5/types.go", const).strip('"')
        found[region] = tuple(re.findall(r'"([\w-]+)"', ids))
    assert found == eksctl.AVOIDED_ZONE_IDS and found


P5 = {"GPU_NODE_TYPE": "p5.48xlarge", "GPUS_PER_NODE": "8"}  # moto offers it in every zone of us-east-1


def p5_services(scores: dict[str, int] | None = None) -> Services:
    spot = FakeSpotScores({(REGION, z): s for z, s in (scores or {}).items()})
    return Services(FakeQuotas({(REGION, "L-417A185B"): 1536, (REGION, "L-1216C47A"): 64}), spot, FakeReservations())


def p5_config(**cluster: Any) -> Config:
    cfg = load_config(environ=dict(P5), path=None)
    return cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update=cluster)}) if cluster else cfg


def test_the_zone_eksctl_avoids_is_never_a_cluster_zone_though_it_ranks_best(aws_env: str, tmp_path: Path):
    cfg = p5_config()
    ids = {"us-east-1e": "use1-az3", "us-east-1b": "use1-az1"}  # moto's zone IDs
    services = p5_services({ids["us-east-1e"]: 9, ids["us-east-1b"]: 8})
    found = nodegroups.placement_zones(cfg, services)
    plan = nodegroups.choose_zones(cfg, StateStore(tmp_path / "s"), lambda: found)
    assert plan.candidates[0] == "us-east-1b" and "us-east-1e" not in plan.cluster_azs
    assert "us-east-1e" not in found.zones and "us-east-1e" not in found.offered
    assert found.avoided == {"us-east-1e": "use1-az3"}


def test_a_configured_zone_eksctl_avoids_is_left_out_with_a_note(aws_env: str, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = p5_config(availability_zones=["us-east-1a", "us-east-1e", "us-east-1c"])
    w = World(tmp_path, cfg)
    plan = nodegroups.choose_zones(cfg, w.store, lambda: nodegroups.placement_zones(cfg, p5_services()))
    nodegroups.ensure_cluster(w.d, plan)
    assert w.tools.cluster["azs"] == ["us-east-1a", "us-east-1c"]
    assert "Left out us-east-1e of cluster.availability_zones: it is zone use1-az3" in w.said()


def test_a_configured_gpu_zone_eksctl_avoids_stops_up_before_anything(aws_env: str, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = p5_config(gpu_az="us-east-1e")
    w = World(tmp_path, cfg)
    with pytest.raises(ConfigError, match="us-east-1e' \\(GPU_AZ\\): it is zone use1-az3, where EKS cannot create"):
        w.up(offered_zones=lambda: nodegroups.placement_zones(cfg, p5_services()))
    assert w.tools.calls == [] and w.store.created == []
    found = dataclasses.replace(nodegroups.Placement(["us-east-1e"]), avoided={"us-east-1e": "use1-az3"})
    with pytest.raises(UserError, match="GPU_AZ.*use1-az3"):
        nodegroups.choose_zones(cfg, StateStore(tmp_path / "s"), lambda: found)


def test_configured_zones_that_leave_one_eksctl_can_use_are_refused(tmp_path: Path):
    cfg = p5_config(availability_zones=["us-east-1a", "us-east-1e"])
    found = nodegroups.Placement(["us-east-1a"], avoided={"us-east-1e": "use1-az3"})
    with pytest.raises(UserError, match="leave 1 zone\\(s\\) EKS can create a cluster in"):
        nodegroups.choose_zones(cfg, StateStore(tmp_path / "s"), lambda: found)


# ------------------------------------------------------------------------------------------------------------------
# The kubeconfig: this folder's, never the user's
# ------------------------------------------------------------------------------------------------------------------


def test_create_cluster_writes_only_this_folders_kubeconfig(world: World):
    create = eksctl_source.command("create", "cluster")
    # eksctl's defaults (pkg/ctl/cmdutils/cmdutils.go AddCommonFlagsForKubeconfig, pkg/ctl/create/cluster.go):
    # it writes a kubeconfig, to $KUBECONFIG or ~/.kube/config, and switches its current context.
    assert create.value({}, "write-kubeconfig") is True and create.value({}, "set-kubeconfig-context") is True
    assert create.value({}, "kubeconfig") == "kubeconfig.DefaultPath()"
    assert create.value({}, "auto-kubeconfig") is False
    world.up()
    assert world.tools.kubeconfig_writes == [world.store.kubeconfig], "nothing but this folder's kubeconfig"
    (argv,) = world.tools.commands("eksctl", "create", "cluster")
    assert check_argv(argv)[1]["kubeconfig"] == str(world.store.kubeconfig)


# ------------------------------------------------------------------------------------------------------------------
# The cluster's IAM OIDC provider: what eksctl says when it makes one, and when its delete leaves one
# ------------------------------------------------------------------------------------------------------------------


def test_the_oidc_provider_facts_the_tool_reads_are_eksctls():
    pkg = eksctl_source.ROOT / "pkg"
    utils = (pkg / "ctl" / "utils" / "associate_iam_oidc_provider.go").read_text()
    created = re.search(r'logger\.Success\("(created IAM Open ID Connect provider[^"]*)"', utils)
    intended = re.search(r'LogIntendedAction\(cmd\.Plan, "([^"]*)"', utils)
    existing = re.search(r'logger\.Info\("(IAM Open ID Connect provider is already[^"]*)"', utils)
    assert created and intended and existing
    assert irsa.OIDC_CREATED.search(created.group(1).replace("%q", '"ray-train-eks"', 1).replace("%q", '"us-east-1"'))
    # LogIntendedAction prefixes "will " (or "(plan) would "): neither that line nor the one for an existing
    # provider reads as made.
    assert not irsa.OIDC_CREATED.search("will " + intended.group(1))
    assert not irsa.OIDC_CREATED.search("(plan) would " + intended.group(1))
    assert not irsa.OIDC_CREATED.search(existing.group(1))
    # The provider is named by the issuer's host and path (api.go), and deleted with a cluster eksctl can operate:
    # delete_tasks.go's task, and CanOperate's states in eks.go.
    api = (pkg / "iam" / "oidc" / "api.go").read_text()
    assert "m.issuerURL.Hostname() + m.issuerURL.Path" in api and 'const defaultAudience = "sts.amazonaws.com"' in api
    assert 'info: "delete IAM OIDC provider"' in (pkg / "cfn" / "manager" / "delete_tasks.go").read_text()
    states = re.findall(r"ekstypes\.ClusterStatus(\w+)", (pkg / "eks" / "eks.go").read_text().split("CanOperate(")[1])
    assert {s.upper() for s in states[:3]} == irsa.NOT_OPERABLE
    cluster = "arn:aws-cn:eks:cn-north-1:111122223333:cluster/c"
    issuer = "https://oidc.eks.cn-north-1.amazonaws.com.cn/id/AB"
    expected = "arn:aws-cn:iam::111122223333:oidc-provider/oidc.eks.cn-north-1.amazonaws.com.cn/id/AB"
    assert irsa.provider_arn(cluster, issuer) == expected


# ------------------------------------------------------------------------------------------------------------------
# The system node's root volume
# ------------------------------------------------------------------------------------------------------------------


def test_the_system_node_group_gets_a_root_volume_sized_for_the_image_and_the_heads_run_folder(cfg_for):
    types = (eksctl_source.ROOT / "pkg" / "apis" / "eksctl.io" / "v1alpha5" / "types.go").read_text()
    # eksctl's default, which the system node had, and the field a managed node group sets it with.
    default = int(re.search(r"DefaultNodeVolumeSize = (\d+)", types).group(1))
    base = types[types.index("type NodeGroupBase struct") :]
    assert 'VolumeSize *int `json:"volumeSize,omitempty"`' in base[: base.index("\n}\n")]
    path = Path(__file__).parent / "schemas" / "eksctl" / "clusterconfig.v1alpha5.schema.json"
    schema = json.loads(path.read_text())
    field = schema["definitions"]["ManagedNodeGroup"]["properties"]["volumeSize"]
    assert (field["type"], field["default"]) == ("integer", default) == ("integer", 80)
    assert default < eksctl.SYSTEM_VOLUME_GIB
    # The ClusterConfig up writes (whole, and one node group at a time) carries it, and validates.
    cfg = cfg_for()
    doc = eksctl.cluster_config(cfg, eksctl.planned_zones(cfg), bucket="b")
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert not [e.message for e in validator.iter_errors(doc)]
    system, gpu = doc["managedNodeGroups"]
    assert (system["name"], system["volumeSize"], system["volumeType"]) == ("system", eksctl.SYSTEM_VOLUME_GIB, "gp3")
    assert gpu["volumeSize"] == cfg.cluster.gpu_volume_gib  # the GPU nodes keep their own setting
