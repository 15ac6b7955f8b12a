"""The two-host tier: a real two-node Ray cluster in network namespaces on this machine (see tests/twohost.py).

Each host has its own private ``/tmp`` (Ray's session folder, run folders); what they share goes through moto's
S3 server on host 0's address. Covers: a ``train --address`` run with ``s3://`` storage places its ranks on both
hosts and completes (placement proven from each host's own Ray Train logs), and ``--resume`` continues it from
S3, and the other host (no run folder there) exports the model from S3; a local storage folder not declared
shared is refused with one message before anything starts; the bandwidth probe reports ranks on two nodes and a
bandwidth figure, and with one host's link capped by ``tc`` it reports the lower figure and a ``degraded``
verdict against the configured line rate. Needs root and iproute2; skipped otherwise, with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from twohost import BUCKET, HOST_IPS, TwoHostCluster, requirement_missing, tool

_MISSING = requirement_missing()
pytestmark = [pytest.mark.twohost, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]

CAP = "100mbit"
EXPECTED_GBPS = 0.6  # the configured line rate: well below the veth's 1.5-6 Gbit/s here, six times the cap
PROBE_SIZES = ["--min-bytes", "1M", "--max-bytes", "4M", "--iters", "3", "--warmup", "1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One two-host cluster per module (about 20 s to start); torn down even when a test fails."""
    with TwoHostCluster(logs_to=tmp_path_factory.mktemp("twohost-ray-logs"), s3=True) as c:
        yield c


def test_teardown_removes_namespaces_and_processes_even_after_an_error():
    c = TwoHostCluster(start_ray=False)
    with pytest.raises(RuntimeError, match="boom"), c:
        sleeper = subprocess.Popen(["ip", "netns", "exec", c.host_ns[1], "sleep", "600"])
        # The hosts reach each other over the bridge, and only through it.
        proc = c.run([sys.executable, "-c", _CONNECT % (HOST_IPS[1], 22)], host=0, timeout=30)
        assert proc.stdout.strip() == "refused", proc.stderr
        raise RuntimeError("boom")
    assert sleeper.wait(timeout=30) != 0
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(ns in names for ns in (*c.host_ns, c.bridge_ns))


# Connects to HOST:PORT: "refused" means the host answered (nothing listens there), "unreachable" means no route.
_CONNECT = """
import socket
try:
    socket.create_connection((%r, %d), timeout=5)
except ConnectionRefusedError:
    print("refused")
except OSError:
    print("unreachable")
"""


def test_train_places_ranks_on_both_hosts_and_resumes_from_s3(cluster, builtin_model):
    before = {w.job_id for w in cluster.train_workers()}
    cmd = [tool("raytrain-eks"), "train", "--address", cluster.address, "--preset", "local-tiny"]
    storage = f"s3://{BUCKET}/runs"
    proc = cluster.run([*cmd, "--steps", "5", "--storage-path", storage, "--output-dir", "run"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = cluster.host_path(0, "/tmp/work/run")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["world_size"] == 2
    assert summary["sharding"] == "hsdp"  # auto: one rank on each of two nodes, replicated across them
    assert "sharding: hsdp: 2 nodes x 1 rank," in proc.stdout + proc.stderr
    assert summary["checkpoints"] == [f"{storage}/run/ray/checkpoint_00000005"]
    # Host 1 wrote its shard to S3 only: nothing of the run is on its own disk, nor in host 0's run folder.
    assert not cluster.host_path(1, "/tmp/work/run").exists() and not (run / "ray").exists()

    workers = [w for w in cluster.train_workers() if w.job_id not in before]
    # Each host's own Ray logs show one of the two ranks (which one is Ray's choice), each on its own node.
    assert sorted(w.host for w in workers) == [0, 1]
    assert sorted((w.world_rank, w.node_rank) for w in workers) == [(0, 0), (1, 1)]
    assert workers[0].node_id != workers[1].node_id

    # The run folder's config.yaml names the S3 storage: the resume reads the checkpoint from there.
    proc = cluster.run([*cmd, "--resume", "/tmp/work/run", "--steps", "7"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"from {storage}/run/ray/checkpoint_00000005" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["resumed_from_step"], summary["steps"]) == (5, 7)
    assert (run / "model" / "model.safetensors").is_file()

    # Host 1 has no run folder: it exports the newest checkpoint straight from the S3 storage folder.
    out = "/tmp/work/exported"
    proc = cluster.run([tool("raytrain-eks"), "export", f"{storage}/run", out], host=1, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    exported = load_file(cluster.host_path(1, out) / "model.safetensors")
    at_end = load_file(run / "model" / "model.safetensors")
    assert exported.keys() == at_end.keys() and all(torch.equal(exported[k], at_end[k]) for k in at_end)
    marker = json.loads((cluster.host_path(1, out) / ".raytrain-eks-export").read_text())
    assert marker["checkpoint"] == f"{storage}/run/ray/checkpoint_00000007"


def test_local_storage_on_two_hosts_is_refused_before_anything_starts(cluster):
    cmd = [tool("raytrain-eks"), "train", "--address", cluster.address, "--preset", "local-tiny"]
    proc = cluster.run([*cmd, "--storage-path", "/tmp/work/store", "--output-dir", "refused"], timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    assert "training.storage_path = '/tmp/work/store'" in err and "span 2 nodes" in err, err
    assert "s3://BUCKET/PREFIX" in err and "training.storage_shared: true" in err and "Traceback" not in err
    assert not cluster.host_path(0, "/tmp/work/refused").exists()
    assert not cluster.host_path(0, "/tmp/work/store").exists()


def _probe(cluster, config) -> dict:
    cmd = [tool("raytrain-eks"), "probe", "--address", cluster.address, "--config", config, "--json"]
    proc = cluster.run([*cmd, *PROBE_SIZES], timeout=300)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert proc.returncode == (0 if report["verdict"] == "healthy" else 1)
    return report


def test_probe_measures_the_link_and_sees_a_cap(cluster):
    config = "/tmp/work/probe.yaml"  # on host 0, where the probe's driver runs
    cluster.host_path(0, config).write_text(f"fabric:\n  expected_gbps: {EXPECTED_GBPS}\n")

    free = _probe(cluster, config)
    assert free["num_nodes"] == 2 and free["world_size"] == 2 and free["backend"] == "gloo"
    # One rank on each host (which one gets rank 0 is Ray's choice).
    assert sorted(free["nodes"]) == sorted(HOST_IPS) and sorted(free["nodes"].values()) == [[0], [1]]
    assert sorted((r["rank"], r["node_rank"]) for r in free["ranks"]) == [(0, 0), (1, 1)]
    assert {r["op"] for r in free["results"]} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert (free["expected_gbps"], free["expected_source"]) == (EXPECTED_GBPS, "fabric.expected_gbps")
    assert free["verdict"] == "healthy", free["reason"]

    with cluster.capped(1, CAP):
        capped = _probe(cluster, config)
    assert capped["num_nodes"] == 2
    assert capped["verdict"] == "degraded", capped["reason"]
    assert capped["best_busbw_gbps"] <= 0.1 * 1.1, "busbw cannot beat the 100 Mbit/s cap (10% slack)"
    assert capped["best_busbw_gbps"] < free["best_busbw_gbps"] / 3
    # Print the figures (pytest -s shows them): the benchmark reports the same with more sizes.
    print(f"\nprobe busbw: {free['best_busbw_gbps']:.3f} Gbit/s free, {capped['best_busbw_gbps']:.3f} capped at {CAP}")
