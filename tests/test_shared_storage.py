"""Checkpoint storage when the training workers span nodes: a real Ray cluster of two nodes on this machine.

``ray.cluster_utils.Cluster`` starts two raylets (each a Ray node with its own resources). ``train --address`` on
it with checkpoints in a local folder, not declared shared, is refused with one message (exit 2) before anything
is created or started; the one-node local runs (every other integration test) are not affected.
"""

from __future__ import annotations

import procs
import pytest

from raytrain_eks.cli import main

pytestmark = pytest.mark.usefixtures("starts_ray")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_local_storage_on_two_nodes_is_refused_before_anything_starts(two_nodes, tmp_path, monkeypatch, capsys):
    import ray

    monkeypatch.chdir(tmp_path)
    base = ["train", "--address", two_nodes.address, "--preset", "local-tiny", "--num-workers", "2"]
    for extra, value in (([], "None"), (["--storage-path", str(tmp_path / "store")], repr(str(tmp_path / "store")))):
        with pytest.raises(SystemExit) as info:
            main([*base, *extra, "--output-dir", str(tmp_path / "run")])
        assert info.value.code == 2
        out, err = capsys.readouterr()
        err = err.replace("\n", " ")
        assert "Invalid configuration: 1 problem" in err and "Traceback" not in err
        assert f"training.storage_path = {value}" in err and "span 2 nodes" in err
        assert "s3://BUCKET/PREFIX" in err and "training.storage_shared: true" in err
        # Refused before the run folder, the data and the trainer: nothing was created, no worker started.
        assert "run folder" not in out and "ray:" not in out and "data:" not in out
        assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
        assert not ray.is_initialized(), "the driver lets go of the cluster it joined"
        assert procs.train_workers() == []
