"""Where the GPU nodes come from (``cluster.gpu_capacity``): on-demand, an on-demand capacity reservation, a Capacity
Block for ML, spot, and a fallback order among them.

- The configuration: the default keeps old configs (an ODCR id alone means ``[reservation]``), and each impossible
  combination is one clear message.
- The GPU node group of each source validates against eksctl v0.230.0's JSON schema and passes the rules of its
  validation.go; the launch template eksctl makes from it (managed_launch_template.go, managed_nodegroup.go, both
  vendored in fixtures/eksctl) is the one the EKS user guide asks for a Capacity Block ("Create a managed node group
  with Capacity Blocks for ML": InstanceMarketOptions.MarketType ``capacity-block``, the block as
  CapacityReservationTarget, capacity type ``CAPACITY_BLOCK``) and equals eksctl's own test data for one. A block
  not yet started gives a group of size 0, in the block's zone only; spot lists only same-shape types.
- ``capacity --blocks`` lists the offerings (fake_aws.FakeCapacityBlocks: moto has no Capacity Blocks), refuses a
  type without any naming those with some, buys one only with --buy-block and a yes, and records the block's end.
  The boto3 calls are checked with botocore's Stubber against EC2's API model. Spot prices come from moto's
  DescribeSpotPriceHistory.
- ``plan`` prices the GPU nodes of the first source: a spot range, a block's whole fee, else on-demand.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import jsonschema
import pytest
import typer
import yaml
from botocore.stub import ANY, Stubber
from fake_aws import FakeCapacityBlocks, FakeQuotas, FakeReservations, FakeSpotScores
from schema_errors import schema_errors
from typer.testing import CliRunner

from raytrain_eks.aws import eksctl
from raytrain_eks.aws import market as mk
from raytrain_eks.aws.commands import register
from raytrain_eks.aws.services import Services
from raytrain_eks.aws.session import connect
from raytrain_eks.config import Config, load_config
from raytrain_eks.eks import nodegroups
from raytrain_eks.eks.plan import build_plan
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.instances import INSTANCE_TYPES, InstanceType, same_shape
from raytrain_eks.k8s.state import Cancelled, StateStore

REGION = "us-east-1"
BLOCK = "cr-0b10c4b10c4b10c41"
ODCR = "cr-0123456789abcdef0"
EKSCTL = Path(__file__).parent / "fixtures" / "eksctl" / "pkg"
SCHEMA = Path(__file__).parent / "schemas" / "eksctl" / "clusterconfig.v1alpha5.schema.json"
P5 = {"gpu_node_type": "p5.48xlarge", "gpus_per_node": 8}


def _cfg(**cluster: Any) -> Config:
    return load_config(environ={}, path=None, overrides={"cluster": cluster})


@pytest.fixture(scope="module")
def schema() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))


# ---------------------------------------------------------------- the configuration


def test_the_default_keeps_old_configs_working():
    assert _cfg().cluster.capacity_order == ("on-demand",)
    assert _cfg(capacity_reservation_id=ODCR).cluster.capacity_order == ("reservation",)
    both = _cfg(gpu_capacity=["capacity-block", "spot", "on-demand"], capacity_block_id=BLOCK, **P5)
    assert both.cluster.capacity_order == ("capacity-block", "spot", "on-demand")


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [
        ({"gpu_capacity": ["reservation"]}, "gpu_capacity has reservation, but capacity_reservation_id is empty"),
        ({"gpu_capacity": ["capacity-block"]}, "raytrain-eks capacity --blocks"),
        ({"capacity_block_id": BLOCK}, "does not list capacity-block: add capacity-block where it falls in the order"),
        (
            {"gpu_capacity": ["spot"], "capacity_reservation_id": ODCR},
            f"capacity_reservation_id = '{ODCR}' is set, but gpu_capacity (spot) does not list reservation",
        ),
        ({"gpu_capacity": ["spot", "on-demand", "spot"]}, "gpu_capacity lists spot more than once"),
        ({"gpu_capacity": ["spot"], "target": "kubernetes"}, "gpu_capacity (spot) applies to target eks"),
        ({"gpu_capacity": ["cheap"]}, "'on-demand', 'reservation', 'capacity-block' or 'spot'"),
    ],
    ids=["reservation-without-id", "block-without-id", "block-id-unused", "odcr-id-unused", "twice", "kubernetes",
         "unknown"],
)  # fmt: skip
def test_an_impossible_capacity_setting_is_one_clear_message(cluster: dict[str, Any], expected: str):
    with pytest.raises(ConfigError) as err:
        _cfg(**cluster)
    assert len(err.value.problems) == 1 and expected in err.value.problems[0], err.value.problems


# ---------------------------------------------------------------- eksctl's reading of the GPU node group


def _go(path: str) -> str:
    return (EKSCTL / path).read_text()


def eksctl_launch_template(ng: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """What eksctl v0.230.0 puts in the launch template it makes for managed node group ``ng``, of the reservation
    and market (pkg/cfn/builder/managed_launch_template.go, ``makeLaunchTemplateData``), and the node group's
    capacity type (managed_nodegroup.go: ``SPOT`` for ``spot``, ``CAPACITY_BLOCK`` for marketType capacity-block,
    else EKS's default ``ON_DEMAND``). :func:`test_the_mirror_of_eksctls_builder_is_what_its_source_says` checks
    the source still says so."""
    data: dict[str, Any] = {}
    reservation = ng.get("capacityReservation")
    if reservation is not None:
        spec: dict[str, Any] = {}
        if "capacityReservationPreference" in reservation:
            spec["CapacityReservationPreference"] = reservation["capacityReservationPreference"]
        target = reservation.get("capacityReservationTarget")
        if target is not None:
            spec["CapacityReservationTarget"] = {"CapacityReservationId": target["capacityReservationID"]}
        data["CapacityReservationSpecification"] = spec
        if "instanceMarketOptions" in ng:
            data["InstanceMarketOptions"] = {"MarketType": ng["instanceMarketOptions"]["marketType"]}
    market = ng.get("instanceMarketOptions", {}).get("marketType")
    kind = "CAPACITY_BLOCK" if market == "capacity-block" else "SPOT" if ng.get("spot") else "ON_DEMAND"
    if kind == "CAPACITY_BLOCK":
        data["InstanceType"] = ng["instanceType"]  # eksctl moves the one type into the template
    return data, kind


def eksctl_rules(ng: dict[str, Any]) -> list[str]:
    """The errors eksctl v0.230.0 stops with for a managed node group, of those its settings here touch
    (pkg/apis/eksctl.io/v1alpha5/validation.go ``validateNodeGroupBase`` and ``ValidateManagedNodeGroup``;
    pkg/cfn/builder/managed_nodegroup.go for a block's instance types), in eksctl's words."""
    out = []
    reservation, market = ng.get("capacityReservation"), ng.get("instanceMarketOptions")
    if reservation is None and market is not None:
        out.append("instanceMarketOptions cannot be set without capacityReservation")
    if reservation is not None and {"capacityReservationPreference", "capacityReservationTarget"} <= set(reservation):
        out.append("only one of CapacityReservationPreference or CapacityReservationTarget may be specified at a time")
    if market is not None and reservation is not None and market.get("marketType") != "capacity-block":
        out.append('only accepted value is "capacity-block"')
    if ng.get("instanceType") and ng.get("instanceTypes"):
        out.append("only one of instanceType or instanceTypes can be specified")
    if ng.get("efaEnabled") and (len(ng.get("availabilityZones", [])) > 1 or len(ng.get("subnets", [])) > 1):
        out.append("efaEnabled nodegroups must have only one subnet or one availability zone")
    if market and market.get("marketType") == "capacity-block" and len(ng.get("instanceTypes", [])) > 1:
        out.append("cannot specify multiple instance types when using capacity block")
    return out


def test_the_mirror_of_eksctls_builder_is_what_its_source_says():
    template, group, rules = (
        _go("cfn/builder/managed_launch_template.go"),
        _go("cfn/builder/managed_nodegroup.go"),
        _go("apis/eksctl.io/v1alpha5/validation.go"),
    )
    assert "launchTemplateData.CapacityReservationSpecification.CapacityReservationTarget" in template
    assert (
        "CapacityReservationId:               valueOrNil(mng.CapacityReservation.CapacityReservationTarget" in template
    )
    assert "MarketType: valueOrNil(mng.InstanceMarketOptions.MarketType)" in template
    assert "if mng.Placement == nil && mng.CapacityReservation == nil {" in template, "no placement group then"
    assert 'managedResource.CapacityType = gfnt.NewString("SPOT")' in group
    assert 'managedResource.CapacityType = gfnt.NewString("CAPACITY_BLOCK")' in group
    assert "launchTemplateData.InstanceType = gfnt.NewString(instanceTypes[0])" in group
    for message in [
        "instanceMarketOptions cannot be set without capacityReservation",
        "only one of CapacityReservationPreference or CapacityReservationTarget may be specified at a time",
        'only accepted value is \\"capacity-block\\"',
        "only one of instanceType or instanceTypes can be specified",
        "efaEnabled nodegroups must have only one subnet or one availability zone",
    ]:
        assert message.replace('\\"', '"') in rules or message in rules, message
    assert "cannot specify multiple instance types when using capacity block" in group
    # The checker is not blind: it refuses what eksctl refuses.
    assert eksctl_rules({"instanceMarketOptions": {"marketType": "spot"}, "instanceType": "p5.48xlarge"}) == [
        "instanceMarketOptions cannot be set without capacityReservation"
    ]


def _gpu_group(cfg: Config, zones: eksctl.Zones, schema: jsonschema.Draft7Validator) -> dict[str, Any]:
    doc = eksctl.cluster_config(cfg, zones)
    assert schema_errors(schema, doc) == []
    gpu = next(g for g in doc["managedNodeGroups"] if g["name"] == cfg.cluster.gpu_nodegroup_name)
    assert eksctl_rules(gpu) == []
    return gpu


def test_an_on_demand_and_a_reservation_group_launch_on_demand(schema):
    gpu = _gpu_group(_cfg(), eksctl.planned_zones(_cfg()), schema)
    assert eksctl_launch_template(gpu) == ({}, "ON_DEMAND") and gpu["instanceType"] == "g6.12xlarge"
    cfg = _cfg(capacity_reservation_id=ODCR, gpu_az="us-east-1c")
    gpu = _gpu_group(cfg, eksctl.planned_zones(cfg), schema)
    spec = {"CapacityReservationSpecification": {"CapacityReservationTarget": {"CapacityReservationId": ODCR}}}
    assert eksctl_launch_template(gpu) == (spec, "ON_DEMAND") and gpu["availabilityZones"] == ["us-east-1c"]


def test_a_capacity_block_group_is_the_launch_template_eks_documents(schema):
    cfg = _cfg(gpu_capacity=["capacity-block"], capacity_block_id=BLOCK, gpu_az="us-east-1b", **P5)
    zones = eksctl.planned_zones(cfg)
    assert (zones.capacity, zones.reservation, zones.gpu_az) == ("capacity-block", BLOCK, "us-east-1b")
    gpu = _gpu_group(cfg, zones, schema)
    template, kind = eksctl_launch_template(gpu)
    # EKS user guide, "Create a managed node group with Capacity Blocks for ML": the launch template's
    # LaunchTemplateData has InstanceMarketOptions with MarketType "capacity-block" and
    # CapacityReservationSpecification: CapacityReservationTarget with CapacityReservationId the block; the managed
    # node group's capacity type is CAPACITY_BLOCK; its subnets are in the block's zone only.
    assert template["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert template["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {"CapacityReservationId": BLOCK}
    }
    assert kind == "CAPACITY_BLOCK" and gpu["availabilityZones"] == ["us-east-1b"] and "subnets" not in gpu
    # eksctl's own rendering of a block group (its test data) has the same fields, the id and type aside.
    upstream = json.loads((EKSCTL / "cfn/builder/testdata/launch_template/capacity_block.json").read_text())
    theirs = upstream["LaunchTemplate"]["Properties"]["LaunchTemplateData"]
    fields = ("CapacityReservationSpecification", "InstanceMarketOptions")
    assert {k: theirs[k] for k in fields} == {
        k: json.loads(json.dumps(template[k]).replace(BLOCK, "res-id")) for k in fields
    }
    assert upstream["ManagedNodeGroup"]["Properties"]["CapacityType"] == kind
    assert gpu["desiredCapacity"] == gpu["minSize"] == gpu["maxSize"] == 2


def test_a_block_not_yet_started_gives_a_group_of_size_zero(schema, tmp_path: Path):
    cfg = _cfg(gpu_capacity=["capacity-block"], capacity_block_id=BLOCK, **P5)
    store = StateStore(tmp_path)
    plan = nodegroups.ZonePlan(("us-east-1b",), ("us-east-1b", "us-east-1a"))
    now = datetime.now(UTC)
    for start, at_zero in [(now + timedelta(days=2), True), (now - timedelta(hours=1), False)]:
        block = mk.Block(BLOCK, "p5.48xlarge", "us-east-1b", 2, start, start + timedelta(hours=24), "scheduled")
        store.update(**{mk.BLOCK_KEY: block.to_state()})
        zones = nodegroups._zones(cfg, plan, "us-east-1b", None, store)
        assert zones.at_zero is at_zero
        gpu = _gpu_group(cfg, zones, schema)
        size = 0 if at_zero else 2
        assert (gpu["desiredCapacity"], gpu["minSize"], gpu["maxSize"]) == (size, size, 2)
    assert store.get(mk.BLOCK_KEY)["drain_by"] == (block.end - timedelta(minutes=30)).isoformat()


def test_a_spot_group_lists_only_types_of_the_same_shape(schema):
    cfg = _cfg(gpu_capacity=["spot"], gpu_node_type="g6e.8xlarge", gpus_per_node=1)
    gpu = _gpu_group(cfg, eksctl.planned_zones(cfg), schema)
    assert gpu["spot"] is True and gpu["instanceTypes"] == ["g6e.8xlarge", "g6e.16xlarge"]
    assert "instanceType" not in gpu and "capacityReservation" not in gpu
    assert eksctl_launch_template(gpu) == ({}, "SPOT")
    reference = _cfg(gpu_capacity=["spot"])
    assert _gpu_group(reference, eksctl.planned_zones(reference), schema)["instanceTypes"] == ["g6.12xlarge"]


def test_same_shape_means_same_gpus_same_efa_and_room_for_the_pod():
    assert same_shape("p5.48xlarge") == ("p5.48xlarge",), "p5e has H200s"
    assert same_shape("p5e.48xlarge") == ("p5e.48xlarge",), "p5en has 16 EFA interfaces, not 32"
    assert same_shape("g6.12xlarge") == ("g6.12xlarge",), "g6e has L40S, g6.48xlarge 8 GPUs"
    assert same_shape("p4d.24xlarge") == ("p4d.24xlarge",), "p4de has 80 GB A100s"
    assert same_shape("g6e.16xlarge") == ("g6e.16xlarge",), "g6e.8xlarge is smaller than the pod sized for it"
    assert same_shape("x9.large") == ("x9.large",)
    bigger = InstanceType("g6.24xlarge", 4, "L4", 22888, 96, 384, 50, 1, 6.68)
    table = {**INSTANCE_TYPES, bigger.name: bigger}
    assert same_shape("g6.12xlarge", table) == ("g6.12xlarge", "g6.24xlarge")


# ---------------------------------------------------------------- capacity: Capacity Blocks and spot prices


def _offer(oid: str, itype: str, zone: str, start: datetime, fee: str, hours: int = 24, count: int = 2) -> dict:
    """A ``CapacityBlockOffering`` as DescribeCapacityBlockOfferings returns it (EC2 API Reference)."""
    return {
        "CapacityBlockOfferingId": oid,
        "InstanceType": itype,
        "AvailabilityZone": zone,
        "InstanceCount": count,
        "StartDate": start,
        "EndDate": start + timedelta(hours=hours),
        "CapacityBlockDurationHours": hours,
        "UpfrontFee": fee,
        "CurrencyCode": "USD",
    }


@pytest.fixture
def blocks() -> FakeCapacityBlocks:
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(days=3)
    return FakeCapacityBlocks(
        offered=[
            _offer("cb-0aaaaaaaaaaaaaaa1", "p5.48xlarge", "us-east-1b", start, "1890.00"),
            _offer("cb-0aaaaaaaaaaaaaaa2", "p5.48xlarge", "us-east-1d", start + timedelta(days=1), "1750.50"),
            _offer("cb-0aaaaaaaaaaaaaaa3", "p5.48xlarge", "us-east-1d", start + timedelta(days=20), "900.00"),
            _offer("cb-0aaaaaaaaaaaaaaa4", "p4d.24xlarge", "us-east-1a", start, "700.00"),
        ]
    )


def _capacity(
    tmp_path: Path, blocks: FakeCapacityBlocks, cluster: dict[str, Any], *args: str, prices: Any = None, **kw: Any
):
    config = tmp_path / "raytrain-eks.yaml"
    config.write_text(yaml.safe_dump({"cluster": cluster}))
    services = Services(
        FakeQuotas({(REGION, "L-417A185B"): 4000, (REGION, "L-DB2E81BA"): 4000}),
        FakeSpotScores({}),
        FakeReservations(),
    )
    market = mk.Market(blocks=blocks, spot_prices=prices or mk.Ec2SpotPrices(connect(REGION)))
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app, services=lambda _aws: services, market=lambda _aws: market)
    argv = ["capacity", "--config", str(config), "--state-dir", str(tmp_path / "state"), *args]
    return CliRunner().invoke(app, argv, **kw)


def test_capacity_lists_the_block_offerings_cheapest_first(aws_env, tmp_path: Path, blocks):
    result = _capacity(tmp_path, blocks, P5, "--blocks", "--block-hours", "24", "--block-days", "14")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["offering", "id", "zone", "nodes", "start", "(UTC)", "end", "(UTC)", "hours",
                                "upfront", "fee"]  # fmt: skip
    assert [line.split()[0] for line in lines[1:]] == ["cb-0aaaaaaaaaaaaaaa2", "cb-0aaaaaaaaaaaaaaa1"], "in window"
    assert "us-east-1d  2 x p5.48xlarge" in lines[1] and lines[1].split()[-3:] == ["24", "1,750.50", "USD"]
    assert blocks.bought == {} and not (tmp_path / "state" / "state.json").exists()


def test_a_type_without_offerings_is_refused_naming_the_types_with_some(aws_env, tmp_path: Path, blocks):
    result = _capacity(tmp_path, blocks, {}, "--blocks")
    err = result.exception
    assert isinstance(err, mk.CapacityBlockError) and err.exit_code == 1, result.output
    assert err.message.startswith("cluster.gpu_node_type = 'g6.12xlarge': EC2 offers no Capacity Block of 2 x ")
    assert err.message.endswith("types with offerings for that count and window: p4d.24xlarge, p5.48xlarge")
    assert "GPU_NODE_TYPE" in (err.hint or "") and blocks.bought == {}


def test_a_block_is_bought_only_with_the_flag_and_a_yes(aws_env, tmp_path: Path, blocks):
    offer = "cb-0aaaaaaaaaaaaaaa1"
    declined = _capacity(tmp_path, blocks, P5, "--blocks", "--buy-block", offer, input="n\n")
    assert isinstance(declined.exception, Cancelled) and blocks.bought == {}
    assert "for 1,890.00 USD charged now (not refundable)?" in declined.output
    unknown = _capacity(tmp_path, blocks, P5, "--blocks", "--buy-block", "cb-0aaaaaaaaaaaaaaa3", "--yes")
    assert isinstance(unknown.exception, mk.CapacityBlockError) and blocks.bought == {}
    assert "is not among the offerings for 2 x p5.48xlarge in this window" in unknown.exception.message
    bought = _capacity(tmp_path, blocks, P5, "--blocks", "--buy-block", offer, "--yes")
    assert bought.exit_code == 0, bought.output
    (block,) = blocks.bought.values()
    record = json.loads((tmp_path / "state" / "state.json").read_text())[mk.BLOCK_KEY]
    assert record == {**block.to_state(), "upfront_usd": 1890.0}
    assert record["drain_by"] == (block.end - timedelta(minutes=30)).isoformat(), "what the job will be told"
    assert f"cluster.capacity_block_id to {block.id}" in bought.stdout


def test_capacity_reads_the_configured_block_and_records_its_window(aws_env, tmp_path: Path, blocks):
    assert _capacity(tmp_path, blocks, P5, "--blocks", "--buy-block", "cb-0aaaaaaaaaaaaaaa2", "-y").exit_code == 0
    (block,) = blocks.bought.values()
    cluster = {**P5, "gpu_capacity": ["capacity-block", "on-demand"], "capacity_block_id": block.id}
    result = _capacity(tmp_path, blocks, cluster)
    assert result.exit_code == 0, result.output
    assert "gpu_capacity: capacity-block then on-demand" in result.stdout
    assert f"capacity block {block.id} (scheduled): 2 x p5.48xlarge in us-east-1d" in result.stdout
    assert f"fee 1,750.50 USD); the job should stop by {block.drain_by:%Y-%m-%d %H:%M} UTC" in result.stdout
    with pytest.raises(mk.CapacityBlockError) as wrong:
        mk.configured_block(_cfg(**{**cluster, "gpu_node_count": 3, "gpu_az": "us-east-1a"}), blocks, None)
    assert wrong.value.message == (
        f"cluster.capacity_block_id = '{block.id}': it holds 2 instances, the GPU node group needs 3; it is in "
        "us-east-1d, cluster.gpu_az is us-east-1a; leave gpu_az empty or make them agree"
    )


def test_spot_price_ranges_by_type_and_zone():
    class Stated:
        def history(self, *, region: str, instance_types, since) -> list[tuple[str, str, float]]:
            assert list(instance_types) == ["g6e.8xlarge", "g6e.16xlarge"]
            return [("g6e.8xlarge", "us-east-1a", 1.5), ("g6e.8xlarge", "us-east-1a", 2.25),
                    ("g6e.8xlarge", "us-east-1c", 1.25), ("g6e.16xlarge", "us-east-1b", 3.0)]  # fmt: skip

    cfg = _cfg(gpu_capacity=["spot"], gpu_node_type="g6e.8xlarge", gpus_per_node=1)
    ranges = mk.spot_prices(cfg, Stated(), days=7)
    assert [(r.instance_type, r.low, r.high) for r in ranges] == [("g6e.8xlarge", 1.25, 2.25), ("g6e.16xlarge", 3, 3)]
    assert ranges[0].zones == {"us-east-1a": (1.5, 2.25), "us-east-1c": (1.25, 1.25)}


def test_capacity_shows_and_records_the_spot_range_moto_answers(aws_env, tmp_path: Path, blocks):
    result = _capacity(tmp_path, blocks, {"gpu_capacity": ["spot", "on-demand"]}, "--spot-days", "3")
    assert result.exit_code == 0, result.output
    # moto's DescribeSpotPriceHistory: one price (0.00001) per zone offering the type.
    line = next(x for x in result.stdout.splitlines() if x.startswith("spot g6.12xlarge"))
    assert line.startswith("spot g6.12xlarge: $0.0000-0.0000 per hour over 3 days (us-east-1a $0.0000-0.0000")
    record = json.loads((tmp_path / "state" / "state.json").read_text())[mk.SPOT_KEY]
    seen = {"g6.12xlarge": {"low": 1e-05, "high": 1e-05}}
    assert (record["region"], record["days"], record["types"]) == (REGION, 3, seen)


def test_the_boto3_calls_are_the_ones_ec2s_api_model_accepts():
    ec2 = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")

    class OneClient:
        region = REGION

        def client(self, service: str, region: str) -> Any:
            return ec2

    start = datetime(2026, 12, 10, 11, 30, tzinfo=UTC)
    window = mk.Window(24, start, start + timedelta(days=14))
    offer = _offer("cb-0aaaaaaaaaaaaaaa1", "p5.48xlarge", "us-east-1b", start, "1890.00")
    made = {"CapacityReservationId": BLOCK, "InstanceType": "p5.48xlarge", "AvailabilityZone": "us-east-1b",
            "TotalInstanceCount": 2, "StartDate": start, "EndDate": offer["EndDate"], "State": "scheduled",
            "ReservationType": "capacity-block"}  # fmt: skip
    asked = {"InstanceType": "p5.48xlarge", "InstanceCount": 2, "CapacityDurationHours": 24,
             "StartDateRange": start, "EndDateRange": window.end}  # fmt: skip
    with Stubber(ec2) as stub:
        stub.add_response("describe_capacity_block_offerings", {"CapacityBlockOfferings": [offer]}, asked)
        stub.add_client_error("describe_capacity_block_offerings", "InvalidParameterValue", "not supported", 400)
        stub.add_response(
            "purchase_capacity_block",
            {"CapacityReservation": made},
            {"CapacityBlockOfferingId": offer["CapacityBlockOfferingId"], "InstancePlatform": "Linux/UNIX",
             "TagSpecifications": ANY},
        )  # fmt: skip
        stub.add_response("describe_capacity_reservations", {"CapacityReservations": [made]},
                          {"CapacityReservationIds": [BLOCK]})  # fmt: skip
        blocks = mk.Ec2CapacityBlocks(OneClient())  # type: ignore[arg-type]
        (found,) = blocks.offerings(region=REGION, instance_type="p5.48xlarge", count=2, window=window)
        assert (found.zone, found.upfront_usd, found.hours) == ("us-east-1b", 1890.0, 24)
        assert blocks.offerings(region=REGION, instance_type="g6.12xlarge", count=2, window=window) == []
        bought = blocks.purchase(region=REGION, offering_id=offer["CapacityBlockOfferingId"])
        assert (bought.id, bought.state, bought.end) == (BLOCK, "scheduled", offer["EndDate"])
        assert blocks.describe(region=REGION, block_id=BLOCK) == bought


# ---------------------------------------------------------------- plan: the price of each source


def test_plan_prices_spot_as_the_range_capacity_read():
    cfg = _cfg(gpu_capacity=["spot", "on-demand"])
    unread = build_plan(cfg).cost
    assert unread["items"][0]["usd_per_hour"] == pytest.approx(2 * 4.6016), "at most on-demand, said so"
    assert any("Spot price range not read yet: `raytrain-eks capacity`" in n for n in unread["notes"])
    record = {"region": REGION, "days": 7, "read_at": "2026-12-07T20:00:00+00:00",
              "types": {"g6.12xlarge": {"low": 1.1, "high": 1.9}}}  # fmt: skip
    cost = build_plan(cfg, market={mk.SPOT_KEY: record}).cost
    gpu = cost["items"][0]
    assert gpu["what"] == "g6.12xlarge, spot $1.1000-1.9000 each (the 7 days to 2026-12-07)"
    assert gpu["range_usd"] == [2.2, 3.8] and gpu["usd_per_hour"] == 3.8
    rest = cost["total_usd"] - 3.8
    assert cost["total_usd_range"] == [pytest.approx(rest + 2.2), cost["total_usd"]]
    assert cost["priced_as"] == "GPU nodes spot, the rest us-east-1 on-demand"
    steps = {s.name: s.action for s in build_plan(cfg).steps}
    assert (
        "spot (capacity type SPOT), any of g6.12xlarge; when they cannot launch, on-demand)." in steps["create-cluster"]
    )


def test_plan_prices_a_block_by_its_whole_fee(tmp_path: Path):
    cfg = _cfg(gpu_capacity=["capacity-block"], capacity_block_id=BLOCK, gpu_az="us-east-1b", **P5)
    start = datetime(2026, 12, 10, 11, 30, tzinfo=UTC)
    block = mk.Block(BLOCK, "p5.48xlarge", "us-east-1b", 2, start, start + timedelta(hours=48), "scheduled", 3600.0)
    cost = build_plan(cfg, market={mk.BLOCK_KEY: block.to_state()}).cost
    gpu = cost["items"][0]
    assert gpu["what"] == f"p5.48xlarge in Capacity Block {BLOCK}, 48 h for $3,600.00 paid upfront"
    assert gpu["fee_usd"] == 3600.0 and gpu["usd_per_hour"] == pytest.approx(75.0)
    assert f"Capacity Block {BLOCK}: $3,600.00 in all, paid when bought, used or not." in cost["notes"]
    unknown = build_plan(cfg).cost
    assert unknown["items"][0]["usd_per_hour"] is None and not unknown["complete"]


# ---------------------------------------------------------------- up: the order the sources are tried in


def test_up_tries_each_source_in_order_and_a_block_in_its_zone_only(tmp_path: Path):
    store = StateStore(tmp_path)
    plan = nodegroups.ZonePlan(("us-east-1a", "us-east-1b"), ("us-east-1a", "us-east-1b"))
    order = nodegroups._attempts(_cfg(gpu_capacity=["spot", "on-demand"]), plan, store)
    assert order == [("spot", "us-east-1a"), ("spot", "us-east-1b"), ("on-demand", "us-east-1a"),
                     ("on-demand", "us-east-1b")]  # fmt: skip
    cfg = _cfg(gpu_capacity=["capacity-block", "on-demand"], capacity_block_id=BLOCK, **P5)
    start = datetime.now(UTC) + timedelta(days=1)
    block = mk.Block(BLOCK, "p5.48xlarge", "us-east-1b", 2, start, start + timedelta(hours=24), "scheduled")
    store.update(**{mk.BLOCK_KEY: block.to_state()})
    assert nodegroups._attempts(cfg, plan, store)[:2] == [("capacity-block", "us-east-1b"), ("on-demand", "us-east-1a")]
    zones = nodegroups.choose_zones(cfg, store)
    assert zones.candidates == ("us-east-1b",), "the block's zone is the GPU zone"


def test_up_creates_a_block_group_at_size_zero_and_stops_until_the_block_starts(aws_env, tmp_path, monkeypatch):
    from test_deploy import World

    monkeypatch.chdir(tmp_path)
    cfg = _cfg(gpu_capacity=["capacity-block", "on-demand"], capacity_block_id=BLOCK, **P5)
    world = World(tmp_path, cfg)
    start = datetime.now(UTC).replace(microsecond=0) + timedelta(days=2)
    block = mk.Block(BLOCK, "p5.48xlarge", "us-east-1b", 2, start, start + timedelta(hours=24), "scheduled")
    world.store.update(**{mk.BLOCK_KEY: block.to_state()})
    with pytest.raises(nodegroups.BlockNotStarted) as err:
        world.up()
    assert err.value.message == (
        f"node group gpu-efa is in us-east-1b at size 0: Capacity Block {BLOCK} starts at "
        f"{start:%Y-%m-%d %H:%M} UTC (it ends {block.end:%Y-%m-%d %H:%M} UTC)"
    )
    assert "Run `raytrain-eks up` again once the block has started" in (err.value.hint or "")
    written = yaml.safe_load((world.store.root / "eksctl-nodegroup-gpu-efa.yaml").read_text())
    (gpu,) = written["managedNodeGroups"]
    assert (gpu["desiredCapacity"], gpu["minSize"], gpu["availabilityZones"]) == (0, 0, ["us-east-1b"])
    assert gpu["instanceMarketOptions"] == {"marketType": "capacity-block"}
    assert (world.store.get("gpu_capacity_used"), world.store.get("gpu_scaled_to")) == ("capacity-block", 0)
    assert "Creating node group gpu-efa (0 (until the block starts) x p5.48xlarge, capacity-block" in world.said()


def test_a_short_on_demand_quota_stops_up_only_when_on_demand_comes_first(aws_env):
    services = Services(FakeQuotas({(REGION, "L-DB2E81BA"): 0}), FakeSpotScores({}), FakeReservations())
    with pytest.raises(UserError, match="quota short in us-east-1"):
        nodegroups.placement_zones(_cfg(gpu_capacity=["on-demand", "spot"]), services=services)
    found = nodegroups.placement_zones(_cfg(gpu_capacity=["spot", "on-demand"]), services=services)
    assert found.zones and "us-east-1e" not in found.zones, "zones offering the type, quota aside"


def test_plan_says_the_spot_range_capacity_recorded(tmp_path: Path, monkeypatch):
    from raytrain_eks.deploy.commands import register as register_eks

    monkeypatch.chdir(tmp_path)
    (tmp_path / "raytrain-eks.yaml").write_text(yaml.safe_dump({"cluster": {"gpu_capacity": ["spot"]}}))
    record = {"region": REGION, "days": 7, "read_at": "2026-12-07T20:00:00+00:00",
              "types": {"g6.12xlarge": {"low": 1.1, "high": 1.9}}}  # fmt: skip
    StateStore(tmp_path / ".raytrain-eks").update(**{mk.SPOT_KEY: record})
    app = typer.Typer()
    app.callback()(lambda: None)
    register_eks(app)
    result = CliRunner().invoke(app, ["plan", "--config", "raytrain-eks.yaml"], env={"HF_TOKEN": ""})
    assert result.exit_code == 0, result.output
    cost = next(line for line in result.stdout.splitlines() if line.startswith("Cost per hour"))
    low, high = build_plan(
        load_config(environ={}, path=tmp_path / "raytrain-eks.yaml"), market={mk.SPOT_KEY: record}
    ).cost["total_usd_range"]
    assert (
        cost
        == f"Cost per hour (GPU nodes spot, the rest us-east-1 on-demand): ${high:.2f} (spot: ${low:.2f}-{high:.2f})"
    )
    assert (
        "GPU instances: 2 x g6.12xlarge, spot $1.1000-1.9000 each (the 7 days to 2026-12-07) = $3.8000" in result.stdout
    )


def test_up_falls_back_to_the_next_source_when_spot_cannot_launch_anywhere(aws_env, tmp_path, monkeypatch):
    import fake_eksctl_stacks as cfn
    from test_deploy import World

    monkeypatch.chdir(tmp_path)
    world = World(tmp_path, _cfg(gpu_capacity=["spot", "on-demand"]))
    on_demand = world.tools._create_nodegroup

    def create(doc: dict[str, Any]) -> tuple[int, str, str]:
        """eksctl's answer when EC2 has no spot capacity for the group in its zone; on-demand launches."""
        (group,) = doc["managedNodeGroups"]
        if not group.get("spot"):
            return on_demand(doc)
        az = group["availabilityZones"][0]
        world.tools.nodegroups[group["name"]] = {"status": "CREATE_FAILED", "az": az}
        meta = doc["metadata"]
        return 1, *cfn.nodegroup_launch_failed(meta["name"], meta["region"], group["name"], az, "g6.12xlarge")

    monkeypatch.setattr(world.tools, "_create_nodegroup", create)
    result = world.up(offered_zones=lambda: nodegroups.Placement(["us-east-1a", "us-east-1b"]))
    assert result.gpu_az == "us-east-1a" and world.store.get("gpu_capacity_used") == "on-demand"
    said = world.said()
    assert "g6.12xlarge (spot) could not launch in us-east-1a" in said
    assert "Removing the failed node group gpu-efa; trying us-east-1b (spot) next" in said
    assert "Removing the failed node group gpu-efa; trying us-east-1a (on-demand) next" in said
    written = yaml.safe_load((world.store.root / "eksctl-nodegroup-gpu-efa.yaml").read_text())
    assert written["managedNodeGroups"][0]["instanceType"] == "g6.12xlarge", "the last file is the on-demand group"


def test_a_run_in_a_capacity_block_is_told_to_stop_by_its_drain_time(aws_env, tmp_path, monkeypatch):
    # EKS advises draining more than 30 minutes before a block ends: submit puts the recorded block's drain time in
    # the job's settings (training.stop_at), where the run's own watch ends it, checkpointed, as preempted.
    from test_deploy import World

    monkeypatch.chdir(tmp_path)
    cfg = _cfg(gpu_capacity=["capacity-block", "on-demand"], capacity_block_id=BLOCK, **P5)
    world = World(tmp_path, cfg)
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)  # running now
    block = mk.Block(BLOCK, "p5.48xlarge", "us-east-1b", 2, start, start + timedelta(hours=24), "active")
    world.store.update(**{mk.BLOCK_KEY: block.to_state()})
    world.up()
    assert world.store.get("gpu_capacity_used") == "capacity-block"
    world.submit()
    job = world.kube.get("v1", "ConfigMap", cfg.ray.cluster_name + "-config", cfg.ray.namespace)
    training = yaml.safe_load(job["data"]["raytrain-eks.yaml"])["training"]
    assert datetime.fromisoformat(str(training["stop_at"])) == block.drain_by == block.end - timedelta(minutes=30)
    assert f"the run checkpoints and stops by {block.drain_by:%Y-%m-%d %H:%M} UTC" in world.said()


def test_on_demand_nodes_give_the_run_no_stop_time(aws_env, tmp_path, monkeypatch):
    from test_deploy import World

    monkeypatch.chdir(tmp_path)
    world = World(tmp_path, _cfg(**P5))
    world.up()
    world.submit()
    cfg = world.d.cfg
    job = world.kube.get("v1", "ConfigMap", cfg.ray.cluster_name + "-config", cfg.ray.namespace)
    assert yaml.safe_load(job["data"]["raytrain-eks.yaml"])["training"].get("stop_at") is None
