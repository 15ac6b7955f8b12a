"""Every ``--json`` output is JSON and nothing else, read from stdout of the console entry (``raytrain_eks.cli.main``,
what the ``raytrain-eks`` script calls): progress, notices and errors go to stderr. compare-fabric's is in
test_fabric_compare.py (it needs the fake cluster there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_aws import FakeQuotas, FakeReservations, FakeSpotScores

from raytrain_eks.cli import main

NCCL = Path(__file__).parent / "fixtures" / "nccl"


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The console entry run with ``args``: its exit status, stdout and stderr."""
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("log", "code", "verdict"),
    [("efa_2node_nccl2.29_ray.log", 0, "efa"), ("socket_fallback_nccl2.27_kubectl.log", 1, "socket")],
)
def test_verify_transport_json(capsys, log, code, verdict):
    got, out, _ = run_cli(["verify-transport", "--json", str(NCCL / log)], capsys)
    assert got == code
    assert json.loads(out)["verdict"] == verdict


@pytest.mark.parametrize(("quota", "code"), [(192.0, 0), (48.0, 1)])
def test_capacity_json(aws_env, capsys, monkeypatch, quota, code):
    # EC2 offerings from moto's server; the quota and spot-score services, which moto does not answer, are the
    # fakes. Too little quota: the problem goes to stderr and the exit status, the JSON still stands alone.
    from raytrain_eks.aws import services

    fakes = services.Services(FakeQuotas({("us-east-1", "L-DB2E81BA"): quota}), FakeSpotScores({}), FakeReservations())
    monkeypatch.setattr(services, "boto3_services", lambda _aws: fakes)
    got, out, err = run_cli(["capacity", "--json", "--regions", "us-east-1"], capsys)
    assert got == code
    data = json.loads(out)
    assert data["instance_type"] == "g6.12xlarge" and data["ok"] is (code == 0)
    assert "checking 2 x g6.12xlarge" in err
