"""``capacity``: offerings per zone, EFA, vCPU quota against running instances, spot score, the existing cluster's
private subnets, the ranked table and its JSON, ``--probe`` (create, cancel, and cancel on every exit path), and
bad input refused with one clear message before anything is created.

AWS is moto's server on a loopback port (real instance types, zone offerings, regions, zones, instances, VPCs,
EKS clusters), reached through boto3 with dummy credentials; never a real account. What moto 5.2 lacks sits
behind the interfaces of :mod:`raytrain_eks.aws.services` and is faked in fake_aws.py: EC2
vCPU quotas (moto's Service Quotas knows only ``vpc``), spot placement scores and capacity reservations. The
boto3 implementations of those three are checked with botocore's Stubber, which validates every request and
response against the real API model.
"""

from __future__ import annotations

import json
import subprocess
import sys

import boto3
import pytest
import typer
from botocore.stub import Stubber
from fake_aws import FakeQuotas, FakeReservations, FakeSpotScores
from typer.testing import CliRunner

from raytrain_eks.aws import capacity as cap
from raytrain_eks.aws.commands import register
from raytrain_eks.aws.services import (
    PROBE_TAG,
    Ec2Reservations,
    Ec2SpotScores,
    ExistingReservation,
    NoCapacity,
    QuotaLimit,
    ServiceQuotasLimits,
    Services,
    offered_zones,
)
from raytrain_eks.aws.session import Aws, AwsCredentialsError, AwsError, connect
from raytrain_eks.config import Config, load_config
from raytrain_eks.errors import ConfigError, UserError

REGION = "us-east-1"
G_QUOTA = "L-DB2E81BA"
STANDARD_QUOTA = "L-1216C47A"
# moto's offerings data: us-east-1 offers g6.12xlarge in a, b, c, d and f, not in e.
OFFERED = ["us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f"]
AMI = "ami-12c6146b"  # one of moto's built-in images (looking one up with DescribeImages costs about a second)


# ---------------------------------------------------------------- fixtures


def _client(service: str, region: str = REGION):
    return boto3.client(service, region_name=region)


def _run(instance_type: str, *, zone: str = "us-east-1a", spot: bool = False, stop: bool = False) -> None:
    ec2 = _client("ec2")
    extra = {"InstanceMarketOptions": {"MarketType": "spot"}} if spot else {}
    made = ec2.run_instances(
        ImageId=AMI, InstanceType=instance_type, MinCount=1, MaxCount=1, Placement={"AvailabilityZone": zone}, **extra
    )
    if stop:
        ec2.stop_instances(InstanceIds=[made["Instances"][0]["InstanceId"]])


def _services(
    limit: float | None = 192,
    scores: dict[str, int] | None = None,
    reservations: FakeReservations | None = None,
    standard: float | None = None,
    **more_limits: float,
) -> Services:
    limits = {(REGION, G_QUOTA): limit} if limit is not None else {}
    if standard is not None:
        limits[(REGION, STANDARD_QUOTA)] = standard
    limits.update({(r.replace("_", "-"), G_QUOTA): v for r, v in more_limits.items()})
    spot = {(REGION, zone_id): s for zone_id, s in (scores or {}).items()}
    return Services(FakeQuotas(limits), FakeSpotScores(spot), reservations or FakeReservations())


def _cli(services: Services) -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app, services=lambda _aws: services)
    return app


def _invoke(services: Services, *args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(_cli(services), ["capacity", *args], env=env)


def _check(cfg: Config | None = None, services: Services | None = None, **kw) -> cap.CapacityReport:
    cfg = cfg or load_config()
    return cap.check_capacity(cfg, connect(cfg.cluster.region), services or _services(), **kw)


def _row(report: cap.CapacityReport, zone: str) -> cap.Candidate:
    return next(c for c in report.candidates if c.zone == zone)


def _zone_ids() -> dict[str, str]:
    zones = _client("ec2").describe_availability_zones()["AvailabilityZones"]
    return {z["ZoneName"]: z["ZoneId"] for z in zones}


# ---------------------------------------------------------------- the library against moto


def test_zones_efa_and_quota_net_of_running_on_demand_instances(aws_env):
    _run("g6.12xlarge")  # 48 vCPUs of the G quota
    _run("g5.xlarge", zone="us-east-1b")  # 4 more
    _run("g6.12xlarge", spot=True)  # spot: not on the on-demand quota
    _run("g5.xlarge", stop=True)  # stopped: not counted
    _run("m7i.xlarge")  # standard family: another quota
    report = _check()
    assert (report.instance_type, report.count, report.vcpus_per_node, report.vcpus_needed) == (
        "g6.12xlarge",
        2,
        48,
        96,
    )
    assert (report.family, report.quota_code) == ("G", G_QUOTA)
    quota = report.quotas[REGION]
    assert (quota.limit, quota.used, quota.need, quota.free, quota.short) == (192, 52, 96, 140, 0)
    zones = {c.zone: c for c in report.candidates}
    assert sorted(z for z, c in zones.items() if c.offered) == OFFERED
    assert zones["us-east-1e"].problems == ["not offered here"]
    assert all(zones[z].efa_interfaces == 1 and zones[z].viable for z in OFFERED)
    assert [c.zone for c in report.candidates][-1] == "us-east-1e", "unusable zones rank last"
    assert report.problem() is None
    assert all(c.zone_id == _zone_ids()[c.zone] for c in report.candidates)


def test_spot_score_ranks_zones_and_is_only_a_signal(aws_env):
    ids = _zone_ids()
    report = _check(services=_services(scores={ids["us-east-1d"]: 9, ids["us-east-1b"]: 4}))
    assert [c.zone for c in report.candidates[:2]] == ["us-east-1d", "us-east-1b"]
    assert _row(report, "us-east-1d").spot_score == 9 and _row(report, "us-east-1a").spot_score is None
    assert _row(report, "us-east-1a").viable


def test_existing_cluster_needs_a_private_subnet_in_the_zone(aws_env):
    ec2 = _client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]

    def subnet(zone: str, cidr: str) -> str:
        return ec2.create_subnet(VpcId=vpc, CidrBlock=cidr, AvailabilityZone=zone)["Subnet"]["SubnetId"]

    public = subnet("us-east-1a", "10.0.0.0/24")
    private_b = subnet("us-east-1b", "10.0.1.0/24")
    private_c = subnet("us-east-1c", "10.0.2.0/24")
    igw = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=igw, VpcId=vpc)
    to_igw = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=to_igw, DestinationCidrBlock="0.0.0.0/0", GatewayId=igw)
    ec2.associate_route_table(RouteTableId=to_igw, SubnetId=public)
    eip = ec2.allocate_address(Domain="vpc")["AllocationId"]
    nat = ec2.create_nat_gateway(SubnetId=public, AllocationId=eip)["NatGateway"]["NatGatewayId"]
    to_nat = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=to_nat, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat)
    for s in (private_b, private_c):
        ec2.associate_route_table(RouteTableId=to_nat, SubnetId=s)
    _client("eks").create_cluster(
        name="ray-train-eks",
        roleArn="arn:aws:iam::123456789012:role/eks",
        resourcesVpcConfig={"subnetIds": [public, private_b, private_c]},
    )
    ids = _zone_ids()
    report = _check(services=_services(scores={ids["us-east-1a"]: 10, ids["us-east-1b"]: 3, ids["us-east-1c"]: 7}))
    assert [c.zone for c in report.candidates[:2]] == ["us-east-1c", "us-east-1b"]
    assert _row(report, "us-east-1b").private_subnets == (private_b,)
    assert _row(report, "us-east-1a").problems == ["cluster ray-train-eks has no private subnet here"]
    assert not _row(report, "us-east-1d").viable
    table = "\n".join(cap.table_lines(report))
    assert private_c in table and "none" in table


def test_p_family_uses_the_p_quota(aws_env, monkeypatch):
    monkeypatch.setenv("GPU_NODE_TYPE", "p5.48xlarge")
    monkeypatch.setenv("GPUS_PER_NODE", "8")
    report = _check(
        services=Services(FakeQuotas({(REGION, "L-417A185B"): 384}), FakeSpotScores({}), FakeReservations())
    )
    assert (report.family, report.quota_code, report.vcpus_needed) == ("P", "L-417A185B", 384)
    assert _row(report, "us-east-1e").efa_interfaces == 32 and report.problem() is None


def test_regions_compared_and_a_region_without_offering_is_one_row(aws_env):
    report = _check(services=_services(us_west_2=64), regions=["us-east-1", "us-west-2", "eu-west-1"])
    assert report.regions == ("us-east-1", "us-west-2", "eu-west-1")
    eu = [c for c in report.candidates if c.region == "eu-west-1"]
    assert len(eu) == 1 and eu[0].zone is None and eu[0].problems == ["not offered in any zone of the region"]
    west = [c for c in report.candidates if c.region == "us-west-2"]
    assert west and all(c.problems == [f"quota {G_QUOTA} short by 32 vCPUs"] for c in west)
    assert report.candidates[0].region == "us-east-1" and report.problem() is None, "us-east-1 is configured, and fine"
    assert [q.region for q in report.short_quotas()] == ["us-west-2"]


def test_quota_unknown_is_a_note_not_a_failure(aws_env):
    report = _check(services=_services(limit=None))
    assert report.problem() is None and report.quotas[REGION].limit is None
    assert any(
        "quota L-DB2E81BA unknown" in n and "aws service-quotas get-service-quota" in n and "--region us-east-1" in n
        for n in report.notes
    )
    see = f"`aws service-quotas get-service-quota --service-code ec2 --quota-code {G_QUOTA} --region us-east-1`"
    assert any(n.endswith(f"in us-east-1; see it with {see}") for n in report.notes)


# ---------------------------------------------------------------- the command


def test_cli_table_ranked_and_ok(aws_env):
    ids = _zone_ids()
    result = _invoke(_services(scores={ids["us-east-1f"]: 8}))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("2 x g6.12xlarge = 96 vCPUs of quota L-DB2E81BA")
    assert lines[1].split()[:4] == ["#", "region", "zone", "zone"]
    assert lines[2].split()[:3] == ["1", "us-east-1", "us-east-1f*"]
    assert "not offered here" in lines[-2] and lines[-1] == "ok: us-east-1f (us-east-1) can take the GPU node group"


def test_cli_json(aws_env):
    result = _invoke(_services(), "--json", "--regions", "us-east-1,eu-west-1")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["problem"] is None and data["quota_increase_commands"] == []
    assert (data["instance_type"], data["vcpus_needed"], data["quota_code"]) == ("g6.12xlarge", 96, G_QUOTA)
    first = data["candidates"][0]
    assert first["viable"] and first["quota"] == {
        "code": G_QUOTA, "limit": 192.0, "source": "applied", "used": 0, "need": 96, "free": 192.0
    }  # fmt: skip
    assert {c["region"] for c in data["candidates"]} == {"us-east-1", "eu-west-1"}


def test_cli_all_regions_are_the_enabled_ones_of_the_partition(aws_env):
    result = _invoke(_services(), "--all-regions", "--json")
    assert result.exit_code == 0, result.output
    regions = json.loads(result.stdout)["regions"]
    assert {"us-east-1", "us-west-2", "eu-west-1"} <= set(regions)
    assert not {"ap-east-1", "cn-north-1", "us-gov-west-1"} & set(regions), "opt-in, China and GovCloud left out"


def test_cli_quota_short_prints_the_exact_increase_command_and_creates_nothing(aws_env):
    _run("g6.12xlarge")
    reservations = FakeReservations()
    result = _invoke(_services(limit=96, reservations=reservations), "--probe")
    command = (
        "aws service-quotas request-service-quota-increase --service-code ec2 --quota-code L-DB2E81BA "
        "--desired-value 144 --region us-east-1"
    )
    err = result.exception
    assert isinstance(err, cap.CapacityError) and err.exit_code == 1
    assert err.message == (
        "quota short in us-east-1: 2 x g6.12xlarge need 96 vCPUs of 'Running On-Demand G and VT instances' "
        "(L-DB2E81BA); the quota is 96 and running on-demand instances use 48, so 48 are free (48 short)"
    )
    assert command in (err.hint or "") and command in result.stdout
    assert reservations.calls == [], "quota short: nothing probed, nothing created"


def test_cli_quota_short_names_a_better_region(aws_env):
    result = _invoke(_services(limit=64, us_west_2=400), "--regions", "us-east-1,us-west-2")
    assert isinstance(result.exception, cap.CapacityError)
    assert "Best alternative: us-west-2" in (result.exception.hint or "")


@pytest.mark.parametrize(
    ("env", "args", "error", "code", "expected"),
    [
        (
            {"GPU_NODE_TYPE": "g6.xlarge", "GPUS_PER_NODE": "1"},
            [],
            ConfigError,
            2,
            "cluster.gpu_node_type = 'g6.xlarge' (GPU_NODE_TYPE): does not support EFA (EC2 DescribeInstanceTypes in "
            "us-east-1), so NCCL would fall back to TCP sockets between nodes",
        ),
        (
            {"GPU_AZ": "us-east-1e"},
            [],
            ConfigError,
            2,
            "cluster.gpu_az = 'us-east-1e' (GPU_AZ): g6.12xlarge is not offered in that zone; zones of us-east-1 "
            "that offer it: us-east-1a, us-east-1b, us-east-1c, us-east-1d, us-east-1f",
        ),
        ({}, ["--regions", "us-east-1,eu-wset-1"], cap.RegionError, 2, "'eu-wset-1' is not an AWS region; did you"),
        ({"REGION": "us-east-9"}, [], ConfigError, 2, "cluster.region = 'us-east-9': not an AWS region; did you mean"),
        ({}, ["--regions", "ap-east-1"], cap.RegionError, 2, "region 'ap-east-1' is not enabled for this AWS account"),
        ({"GPU_NODE_TYPE": "m7i.xlarge"}, [], ConfigError, 2, "'m7i.xlarge' (GPU_NODE_TYPE): has no GPU"),
        ({"GPU_NODE_TYPE": "g6.13xlarge"}, [], ConfigError, 2, "EC2 does not know this instance type in us-east-1"),
    ],
    ids=["no-efa", "gpu-az-not-offered", "unknown-region", "unknown-config-region", "region-not-enabled", "no-gpu",
         "unknown-type"],
)  # fmt: skip
def test_cli_bad_input_one_message_nothing_created(aws_env, env, args, error, code, expected):
    reservations = FakeReservations()
    result = _invoke(_services(reservations=reservations), "--probe", *args, env=env)
    assert isinstance(result.exception, error), result.output
    assert result.exception.exit_code == code  # what main() exits with; CliRunner reports 1 for any exception
    assert expected in str(result.exception)
    if isinstance(result.exception, ConfigError):
        assert len(result.exception.problems) == 1
    assert reservations.calls == [] and result.stdout == ""


def test_cli_without_credentials_names_the_ways_to_give_them(aws_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    result = _invoke(_services())
    assert isinstance(result.exception, AwsCredentialsError) and result.exception.exit_code == 2
    text = f"{result.exception.message}\n{result.exception.hint}"
    assert "no AWS credentials found" in text
    assert all(s in text for s in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "aws configure"))
    monkeypatch.setenv("AWS_PROFILE", "nope")
    with pytest.raises(AwsCredentialsError, match="profile"):
        connect(REGION)


def test_cli_rejects_regions_with_all_regions(aws_env):
    result = _invoke(_services(), "--regions", "us-east-1", "--all-regions")
    assert "not both" in str(result.exception)
    assert result.exception.exit_code == 2, "bad input"
    result = _invoke(_services(), "--regions", " , ")
    assert "--regions is empty" in str(result.exception) and result.exception.exit_code == 2


# ---------------------------------------------------------------- --probe


def test_cli_probe_reserves_then_cancels(aws_env):
    ids = _zone_ids()
    reservations = FakeReservations()
    result = _invoke(_services(scores={ids["us-east-1c"]: 9}, reservations=reservations), "--probe")
    assert result.exit_code == 0, result.output
    assert [r.zone for r in reservations.created] == ["us-east-1c"], "the best zone only: it had the capacity"
    assert reservations.open == [] and reservations.created[0].state == "cancelled"
    assert reservations.created[0].instance_type == "g6.12xlarge" and reservations.created[0].count == 2
    first = result.stdout.splitlines()[2].split()
    assert first[:3] == ["1", "us-east-1", "us-east-1c*"] and "reserved" in first
    assert "probe: cancelled cr-" in result.stderr


def test_probe_moves_on_when_the_best_zone_has_no_capacity(aws_env):
    ids = _zone_ids()
    reservations = FakeReservations(free={(REGION, "us-east-1c"): 1})
    report = _check(
        services=_services(scores={ids["us-east-1c"]: 9, ids["us-east-1a"]: 5}, reservations=reservations), probe=True
    )
    assert reservations.calls[0] == "create us-east-1c" and [r.zone for r in reservations.created] == ["us-east-1a"]
    assert reservations.open == []
    assert report.candidates[0].zone == "us-east-1a" and report.candidates[0].probe.ok
    assert _row(report, "us-east-1c").problems == ["probe: InsufficientInstanceCapacity"]
    assert report.problem() is None


def test_probe_without_capacity_anywhere_fails_the_check(aws_env):
    reservations = FakeReservations(free={(REGION, z): 0 for z in OFFERED})
    result = _invoke(_services(reservations=reservations), "--probe")
    assert isinstance(result.exception, cap.CapacityError) and result.exception.exit_code == 1
    assert result.exception.message == (
        "2 x g6.12xlarge (96 vCPUs) cannot go to us-east-1a: probe: InsufficientInstanceCapacity"
    )
    assert reservations.created == [] and len([c for c in reservations.calls if c.startswith("create")]) == 5


def _probe(reservations: FakeReservations, say=lambda _line: None) -> cap.Probe:
    return cap.probe_zone(reservations, region=REGION, zone="us-east-1a", instance_type="g6.12xlarge", count=2, say=say)


@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError])
def test_probe_cancels_when_stopped_between_create_and_cancel(raised):
    """The error comes from the progress callback, which the probe calls after create and before cancel."""
    reservations = FakeReservations()

    def say(line: str) -> None:
        if line.startswith("probe: reserved"):
            raise raised("stopped right after the reservation was made")

    with pytest.raises(raised):
        _probe(reservations, say)
    assert len(reservations.created) == 1 and reservations.open == []


def test_probe_cancels_a_reservation_whose_create_answer_was_lost():
    reservations = FakeReservations(lose_create_answer=True)
    with pytest.raises(ConnectionError):
        _probe(reservations)
    assert len(reservations.created) == 1 and reservations.open == [], "found by its tag and cancelled"


def test_cli_ctrl_c_during_create_still_cancels(aws_env):
    def interrupt(_res) -> None:
        raise KeyboardInterrupt

    reservations = FakeReservations(on_create=interrupt)
    result = _invoke(_services(reservations=reservations), "--probe")
    assert result.exit_code == 130  # Ctrl-C's exit status
    assert len(reservations.created) == 1 and reservations.open == []


def test_probe_retries_a_failed_cancel():
    reservations = FakeReservations(failing_cancels=1)
    assert _probe(reservations).ok
    assert reservations.open == [] and reservations.calls.count(f"cancel {reservations.created[0].id}") == 2


def test_probe_cancel_that_succeeds_on_the_third_try_is_checked_not_reported_as_left():
    reservations = FakeReservations(failing_cancels=2)
    assert _probe(reservations).ok
    assert reservations.open == [] and reservations.calls[-1] == "list", "a last look found nothing open"


def test_probe_keeps_cancelling_through_ctrl_c_then_raises_it():
    reservations = FakeReservations(failing_cancels=1, cancel_error=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        _probe(reservations)
    assert reservations.open == []


def test_probe_says_what_to_cancel_when_cancelling_keeps_failing():
    reservations = FakeReservations(failing_cancels=100)
    with pytest.raises(cap.ReservationsLeftError) as info:
        _probe(reservations)
    rid = reservations.created[0].id
    assert "billed until cancelled" in info.value.message
    assert f"aws ec2 cancel-capacity-reservation --capacity-reservation-id {rid} --region us-east-1" in info.value.hint
    assert f"Name=tag:{PROBE_TAG},Values=raytrain-eks-probe-" in info.value.hint


# ---------------------------------------------------------------- boto3 implementations of the faked interfaces


@pytest.fixture
def offline_aws() -> Aws:
    """A session with dummy credentials whose clients are only ever stubbed (no network)."""
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)
    return Aws(session, REGION)


def test_service_quotas_applied_then_default(offline_aws):
    sq = offline_aws.client("service-quotas")
    quotas = ServiceQuotasLimits(offline_aws)
    with Stubber(sq) as stub:
        params = {"ServiceCode": "ec2", "QuotaCode": G_QUOTA}
        stub.add_response("get_service_quota", {"Quota": {"Value": 96.0}}, params)
        stub.add_client_error("get_service_quota", "NoSuchResourceException", "no applied value", 400, params)
        stub.add_response("get_aws_default_service_quota", {"Quota": {"Value": 64.0}}, params)
        stub.add_client_error("get_service_quota", "AccessDeniedException", "not authorized", 400, params)
        assert quotas.vcpu_limit(REGION, G_QUOTA).value == 96.0
        assert quotas.vcpu_limit(REGION, G_QUOTA) == QuotaLimit(64.0, "default")
        unknown = quotas.vcpu_limit(REGION, G_QUOTA)
        assert unknown.value is None and unknown.source.startswith("AccessDeniedException")


def test_service_quotas_against_moto_is_unknown(aws_env):
    """States why the quota is faked: moto answers GetServiceQuota for ec2 with NoSuchResource, and has no
    GetAWSDefaultServiceQuota at all."""
    limit = ServiceQuotasLimits(connect(REGION)).vcpu_limit(REGION, G_QUOTA)
    assert limit.value is None


def test_spot_scores_request_and_parse(offline_aws):
    ec2 = offline_aws.client("ec2")
    with Stubber(ec2) as stub:
        stub.add_response(
            "get_spot_placement_scores",
            {"SpotPlacementScores": [{"Region": REGION, "AvailabilityZoneId": "use1-az1", "Score": 9}]},
            {
                "InstanceTypes": ["g6.12xlarge"],
                "TargetCapacity": 2,
                "TargetCapacityUnitType": "units",
                "SingleAvailabilityZone": True,
                "RegionNames": [REGION],
            },
        )
        stub.add_client_error("get_spot_placement_scores", "UnauthorizedOperation", "not allowed", 403)
        assert Ec2SpotScores(offline_aws).scores(REGION, "g6.12xlarge", 2).scores == {"use1-az1": 9}
        denied = Ec2SpotScores(offline_aws).scores(REGION, "g6.12xlarge", 2)
        assert denied.scores is None and denied.note.startswith("UnauthorizedOperation")


def test_spot_scores_against_moto_are_unavailable(aws_env):
    """States why the score is faked: moto has no GetSpotPlacementScores."""
    assert Ec2SpotScores(connect(REGION)).scores(REGION, "g6.12xlarge", 2).scores is None


def test_reservations_requests(offline_aws):
    ec2 = offline_aws.client("ec2")
    reservations = Ec2Reservations(offline_aws)
    token = "raytrain-eks-probe-0123456789abcdef"
    create = {
        "ClientToken": token,
        "InstanceType": "g6.12xlarge",
        "InstancePlatform": "Linux/UNIX",
        "AvailabilityZone": "us-east-1a",
        "InstanceCount": 2,
        "InstanceMatchCriteria": "targeted",
        "EndDateType": "unlimited",
        "TagSpecifications": [
            {
                "ResourceType": "capacity-reservation",
                "Tags": [{"Key": PROBE_TAG, "Value": token}, {"Key": "created-by", "Value": "raytrain-eks"}],
            }
        ],
    }
    with Stubber(ec2) as stub:
        stub.add_response(
            "create_capacity_reservation",
            {"CapacityReservation": {"CapacityReservationId": "cr-0abc", "State": "active"}},
            create,
        )
        stub.add_client_error(
            "create_capacity_reservation", "InsufficientInstanceCapacity", "not enough capacity", 400, create
        )
        stub.add_response("cancel_capacity_reservation", {"Return": True}, {"CapacityReservationId": "cr-0abc"})
        stub.add_client_error("cancel_capacity_reservation", "InvalidCapacityReservationId.NotFound", "gone", 400)
        stub.add_response(
            "describe_capacity_reservations",
            {"CapacityReservations": [{"CapacityReservationId": "cr-0def"}]},
            {
                "Filters": [
                    {"Name": f"tag:{PROBE_TAG}", "Values": [token]},
                    {"Name": "state", "Values": ["active", "pending"]},
                ]
            },
        )
        kw = {"region": REGION, "instance_type": "g6.12xlarge", "zone": "us-east-1a", "count": 2, "token": token}
        assert reservations.create(**kw).id == "cr-0abc"
        with pytest.raises(NoCapacity) as info:
            reservations.create(**kw)
        assert info.value.code == "InsufficientInstanceCapacity"
        reservations.cancel(region=REGION, reservation_id="cr-0abc")
        reservations.cancel(region=REGION, reservation_id="cr-0abc")  # already gone: fine
        assert reservations.open_ids(region=REGION, token=token) == ["cr-0def"]
        stub.assert_no_pending_responses()


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("g6.12xlarge", "G"),
        ("g6e.48xlarge", "G"),
        ("gr6.4xlarge", "G"),
        ("vt1.3xlarge", "G"),
        ("p5.48xlarge", "P"),
        ("p6-b200.48xlarge", "P"),
        ("m7i.xlarge", "standard"),
        ("c7gn.large", "standard"),
        ("z1d.large", "standard"),
        ("im4gn.large", "standard"),
        ("mac2.metal", None),
        ("hpc7g.16xlarge", None),
        ("inf2.xlarge", None),
        ("trn1.32xlarge", None),
        ("x2idn.16xlarge", None),
        ("u-6tb1.metal", None),
        ("dl1.24xlarge", None),
    ],
)
def test_quota_family(name, family):
    assert cap.quota_family(name) == family


def _cand(zone: str, **kw) -> cap.Candidate:
    quota = kw.pop("quota", cap.Quota(REGION, "G", 192, "applied", 0, 96))
    return cap.Candidate(REGION, zone, None, kw.pop("offered", True), kw.pop("efa", 1), quota, **kw)


def test_rank_order():
    short = cap.Quota(REGION, "G", 64, "applied", 0, 96)
    ranked = cap.rank(
        [
            _cand("z-short", quota=short),
            _cand("z-plain"),
            _cand("z-spot", spot_score=7),
            _cand("z-cluster", cluster="c", private_subnets=("subnet-1",)),
            _cand("z-no-subnet", cluster="c"),
            _cand("z-probed", probe=cap.Probe(True, "cr-1 active")),
            _cand("z-noefa", efa=0),
            _cand("z-unoffered", offered=False, efa=0),
        ]
    )
    assert [c.zone for c in ranked] == [
        "z-probed", "z-cluster", "z-spot", "z-plain", "z-no-subnet", "z-noefa", "z-short", "z-unoffered"
    ]  # fmt: skip
    assert short.short == 32 and short.increase_argv()[-4:] == ["--desired-value", "96", "--region", REGION]


def test_capacity_modules_import_no_aws_sdk():
    code = (
        "import sys, typer\n"
        "from raytrain_eks.aws.commands import register\n"
        "register(typer.Typer())\n"
        "assert not {'boto3', 'botocore'} & set(sys.modules), sorted(m for m in sys.modules if 'boto' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    ("code", "error", "expected"),
    [
        ("UnauthorizedOperation", AwsError, "Grant the IAM permission for DescribeInstanceTypeOfferings"),
        ("AuthFailure", AwsCredentialsError, "AWS_ACCESS_KEY_ID"),
        ("RequestLimitExceeded", AwsError, "AWS failed while reading the offerings of g6.12xlarge in us-east-1"),
    ],
)
def test_aws_errors_become_one_message(offline_aws, code, error, expected):
    with Stubber(offline_aws.client("ec2")) as stub:
        stub.add_client_error("describe_instance_type_offerings", code, "refused", 400)
        with pytest.raises(error) as info:
            offered_zones(offline_aws, REGION, "g6.12xlarge")
    assert expected in str(info.value)


def test_up_places_the_gpu_group_by_the_capacity_check(aws_env):
    from raytrain_eks.eks import nodegroups

    ids = _zone_ids()
    found = nodegroups.placement_zones(load_config(), services=_services(scores={ids["us-east-1d"]: 9}))
    zones = found.zones
    assert sorted(zones) == OFFERED and zones[0] == "us-east-1d", "offered zones only, best spot score first"
    assert found.reservations == {} and sorted(found.offered) == OFFERED
    _run("g6.12xlarge")
    reservations = FakeReservations()
    with pytest.raises(cap.CapacityError, match="quota short in us-east-1"):
        nodegroups.placement_zones(load_config(), services=_services(limit=96, reservations=reservations))
    assert reservations.calls == [], "nothing created"


# ---------------------------------------------------------------- the system node's quota and existing reservations


def _reservation(zone: str, available: int = 2, **kw) -> ExistingReservation:
    kw.setdefault("id", f"cr-0{zone[-1] * 16}")
    return ExistingReservation(
        instance_type=kw.pop("instance_type", "g6.12xlarge"),
        zone=zone,
        total=kw.pop("total", 2),
        available=available,
        **kw,
    )


def _make_cluster() -> None:
    """An EKS cluster of the configured name (its system node group comes with it)."""
    ec2 = _client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.1.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.1.0.0/24", AvailabilityZone="us-east-1a")["Subnet"]
    _client("eks").create_cluster(
        name="ray-train-eks",
        roleArn="arn:aws:iam::123456789012:role/eks",
        resourcesVpcConfig={"subnetIds": [subnet["SubnetId"]]},
    )


def test_the_system_node_needs_standard_quota_too(aws_env):
    _run("m7i.2xlarge")  # 8 vCPUs of the standard quota already in use
    report = _check(services=_services(limit=192, standard=10))
    quota = _row(report, "us-east-1a").system_quota
    assert (quota.code, quota.limit, quota.used, quota.need, quota.short) == (STANDARD_QUOTA, 10, 8, 4, 2)
    err = report.problem()
    assert err is not None and err.message.startswith(
        "quota short in us-east-1: the system node group (m7i.xlarge) needs 4 vCPUs of"
    )
    assert f"--quota-code {STANDARD_QUOTA} --desired-value 12 --region us-east-1" in (err.hint or "")
    assert "(system node)" in "; ".join(_row(report, "us-east-1a").problems)
    # Enough standard quota: nothing to say. An existing cluster already runs its system node: nothing needed.
    assert _check(services=_services(limit=192, standard=12)).problem() is None
    _make_cluster()
    assert _row(_check(services=_services(limit=192, standard=0)), "us-east-1a").system_quota is None


def test_an_existing_reservation_holds_the_nodes_where_the_quota_is_used_up(aws_env):
    # The G quota of 96 is all held by a reservation of 2 x g6.12xlarge in us-east-1c: no zone but that one can
    # take the nodes, and there they need no new quota and no probe.
    held = _reservation("us-east-1c", id="cr-0123456789abcdef0", match="targeted")
    reservations = FakeReservations(existing={REGION: [held]})
    report = _check(services=_services(limit=96, reservations=reservations), probe=True)
    best = report.candidates[0]
    assert (best.zone, best.covered, best.reservation, best.reserved, best.quota.need) == (
        "us-east-1c",
        True,
        held,
        2,
        0,
    )
    assert best.quota.held == 96 and best.viable and report.problem() is None
    assert _row(report, "us-east-1a").problems == [f"quota {G_QUOTA} short by 96 vCPUs"]
    assert reservations.created == [], "an existing reservation is not probed"
    assert report.short_quotas() == [], "no increase to ask for: one zone can take the nodes"
    lines = cap.table_lines(report)
    assert "2 (cr-0123456789abcdef0)" in lines[2]
    assert report.to_dict()["candidates"][0]["reservation"] == "cr-0123456789abcdef0"


def test_open_reservations_cover_part_of_the_need(aws_env):
    # One g6.12xlarge free in an open reservation of us-east-1b: that zone needs 48 vCPUs of new quota, not 96.
    reservations = FakeReservations(existing={REGION: [_reservation("us-east-1b", available=1, total=1)]})
    report = _check(services=_services(limit=96, reservations=reservations))
    b, a = _row(report, "us-east-1b"), _row(report, "us-east-1a")
    assert (b.reservation, b.reserved, b.quota.need, b.quota.used, b.viable) == (None, 1, 48, 48, True)
    assert (a.quota.need, a.viable) == (96, False)
    assert report.candidates[0].zone == "us-east-1b"


def test_unusable_reservations_are_not_counted_as_capacity(aws_env):
    windows = _reservation("us-east-1a", platform="Windows")
    block = _reservation("us-east-1b", kind="capacity-block")
    other = _reservation("us-east-1c", instance_type="g6.48xlarge")
    reservations = FakeReservations(existing={REGION: [windows, block, other]})
    report = _check(services=_services(limit=1000, reservations=reservations))
    assert all(c.reserved == 0 and c.reservation is None for c in report.candidates)


def test_up_targets_the_reservation_that_holds_the_nodes(aws_env):
    from raytrain_eks.eks import nodegroups

    held = _reservation("us-east-1d", id="cr-0fedcba9876543210")
    found = nodegroups.placement_zones(
        load_config(), services=_services(limit=96, reservations=FakeReservations(existing={REGION: [held]}))
    )
    assert found.zones == ["us-east-1d"] and found.reservations == {"us-east-1d": "cr-0fedcba9876543210"}


def test_a_reservation_holding_the_gpu_nodes_is_targeted_when_the_system_node_shares_the_quota(aws_env):
    # A G-family system node (4 vCPUs) adds to the G quota's need, which the reservation does not cover; the
    # reservation still holds every GPU node, so up must target it and the probe must not reserve more.
    from raytrain_eks.eks import nodegroups

    held = _reservation("us-east-1d", id="cr-0fedcba9876543210", match="targeted")
    cfg = load_config(environ={"SYSTEM_NODE_TYPE": "g5.xlarge"})
    reservations = FakeReservations(existing={REGION: [held]})
    report = _check(cfg, _services(limit=100, reservations=reservations), probe=True)
    d = _row(report, "us-east-1d")
    assert (d.quota.need, d.quota.free, d.covered, d.viable) == (4, 4, True, True)
    assert report.candidates[0] is d and reservations.created == [], "held already: nothing probed"
    found = nodegroups.placement_zones(cfg, services=_services(limit=100, reservations=reservations))
    assert found.reservations == {"us-east-1d": "cr-0fedcba9876543210"}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {},
            "no active capacity reservation with this id in us-east-1; yours are listed by `aws ec2 describe-capacity",
        ),
        (
            {"id": "cr-0aaaaaaaaaaaaaaa1", "instance_type": "p5.48xlarge"},
            "it reserves p5.48xlarge, the GPU node type is g6",
        ),
        ({"id": "cr-0aaaaaaaaaaaaaaa1", "zone": "us-east-1b"}, "it is in us-east-1b, cluster.gpu_az is us-east-1a"),
        ({"id": "cr-0aaaaaaaaaaaaaaa1", "tenancy": "dedicated"}, "its tenancy is dedicated"),
    ],
    ids=["unknown", "other-type", "other-zone", "dedicated"],
)
def test_a_configured_reservation_that_cannot_hold_the_nodes_is_refused(aws_env, overrides, expected):
    kw = {"id": "cr-0bbbbbbbbbbbbbbb2", "zone": "us-east-1a", **overrides}
    reservations = FakeReservations(existing={REGION: [_reservation(kw.pop("zone"), **kw)]})
    cfg = load_config(
        environ={"GPU_AZ": "us-east-1a"}, overrides={"cluster": {"capacity_reservation_id": "cr-0aaaaaaaaaaaaaaa1"}}
    )
    with pytest.raises(ConfigError) as err:
        _check(cfg, _services(reservations=reservations))
    assert len(err.value.problems) == 1 and expected in err.value.problems[0]
    assert err.value.problems[0].startswith("cluster.capacity_reservation_id = 'cr-0aaaaaaaaaaaaaaa1'")
    assert reservations.created == []


def test_a_configured_reservation_picks_the_zone_and_must_have_room(aws_env):
    mine = _reservation("us-east-1f", id="cr-0aaaaaaaaaaaaaaa1", available=2)
    bigger = _reservation("us-east-1b", id="cr-0ccccccccccccccc3", available=4, total=4)
    cfg = load_config(overrides={"cluster": {"capacity_reservation_id": "cr-0aaaaaaaaaaaaaaa1"}})
    report = _check(cfg, _services(limit=0, reservations=FakeReservations(existing={REGION: [mine, bigger]})))
    assert [c.zone for c in report.targets] == ["us-east-1f"] and report.targets[0].covered
    assert report.problem() is None
    # One instance of the two already running in it: one short, said so, and the quota cannot make up for it.
    full = _reservation("us-east-1f", id="cr-0aaaaaaaaaaaaaaa1", available=1)
    report = _check(cfg, _services(limit=0, reservations=FakeReservations(existing={REGION: [full]})))
    err = report.problem()
    assert err is not None and "reservation cr-0aaaaaaaaaaaaaaa1 has 1 of 2 instances free" in err.message


def test_a_configured_reservation_with_no_instance_free_stops_the_check(aws_env):
    # Every instance of it already running: the node group would be launched into a full reservation. Quota is
    # plenty, so only the reservation can say why its zone cannot take the nodes.
    full = _reservation("us-east-1f", id="cr-0aaaaaaaaaaaaaaa1", available=0)
    cfg = load_config(overrides={"cluster": {"capacity_reservation_id": "cr-0aaaaaaaaaaaaaaa1"}})
    report = _check(cfg, _services(limit=1000, reservations=FakeReservations(existing={REGION: [full]})))
    assert [c.zone for c in report.targets] == ["us-east-1f"]
    assert _row(report, "us-east-1f").problems == ["reservation cr-0aaaaaaaaaaaaaaa1 has 0 of 2 instances free"]
    err = report.problem()
    assert err is not None and "reservation cr-0aaaaaaaaaaaaaaa1 has 0 of 2 instances free" in err.message


def test_ec2_reservations_lists_the_active_ones_but_not_the_probes(offline_aws):
    ec2 = offline_aws.client("ec2")
    listed = {
        "CapacityReservations": [
            {
                "CapacityReservationId": "cr-0123456789abcdef0",
                "InstanceType": "g6.12xlarge",
                "InstancePlatform": "Linux/UNIX",
                "AvailabilityZone": "us-east-1c",
                "Tenancy": "default",
                "TotalInstanceCount": 2,
                "AvailableInstanceCount": 1,
                "InstanceMatchCriteria": "targeted",
                "State": "active",
                "ReservationType": "default",
                "Tags": [{"Key": "team", "Value": "ml"}],
            },
            {
                "CapacityReservationId": "cr-0fffffffffffffff0",
                "InstanceType": "g6.12xlarge",
                "AvailabilityZone": "us-east-1a",
                "TotalInstanceCount": 2,
                "AvailableInstanceCount": 2,
                "State": "active",
                "Tags": [{"Key": PROBE_TAG, "Value": "raytrain-eks-probe-1"}],
            },
        ]
    }
    with Stubber(ec2) as stub:
        stub.add_response(
            "describe_capacity_reservations", listed, {"Filters": [{"Name": "state", "Values": ["active"]}]}
        )
        found = Ec2Reservations(offline_aws).active(region=REGION)
    assert found == [
        ExistingReservation("cr-0123456789abcdef0", "g6.12xlarge", "us-east-1c", 2, 1, "targeted", "Linux/UNIX")
    ]


def test_reservations_that_cannot_be_listed_are_left_out_and_said(aws_env):
    denied = AwsError("AWS refused DescribeCapacityReservations (UnauthorizedOperation)")
    report = _check(services=_services(reservations=FakeReservations(active_error=denied)))
    assert report.problem() is None
    assert any(n.startswith("existing capacity reservations not counted (AWS refused") for n in report.notes)
    cfg = load_config(overrides={"cluster": {"capacity_reservation_id": "cr-0aaaaaaaaaaaaaaa1"}})
    with pytest.raises(UserError, match="could not be listed: AWS refused DescribeCapacityReservations"):
        _check(cfg, _services(reservations=FakeReservations(active_error=denied)))


def test_every_session_shares_one_loader_of_the_api_models_and_keeps_its_own_region(aws_env):
    from raytrain_eks.aws.session import connect

    east, west = connect("us-east-1"), connect("us-west-2")
    loader = east.session._session.get_component("data_loader")
    assert west.session._session.get_component("data_loader") is loader  # the models are parsed once per process
    paths = list(loader.search_paths)
    connect("us-east-1")
    assert loader.search_paths == paths  # boto3's data folder is not added again with each session
    assert (east.session.region_name, west.session.region_name) == ("us-east-1", "us-west-2")
    assert west.client("ec2").meta.region_name == "us-west-2"
