"""Several trainings one after another in one torchrun process group, for tests/test_sharding.py.

Started by torchrun on every rank (``torchrun ... tests/sharding_runs.py PLAN.json``). ``PLAN.json`` is a list of
``{"name", "training", "one_node"}``: each entry trains with :func:`raytrain_eks.train.torchrun_entry.run` into
``<plan folder>/<name>``, as the torchrun entry would, so the processes start (and import torch) once for all.
``one_node`` makes every rank report the same node, as if the agents ran on one machine. Rank 0 also writes
``<name>/collectives.json``: every ``all_reduce`` the run issued on a group smaller than the world, with its ranks
(the cross-node gradient reductions of HSDP).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from raytrain_eks.config import TrainingConfig
from raytrain_eks.train.loop import quiet_libraries
from raytrain_eks.train.torchrun_entry import run


def _record_all_reduces(log: list[dict[str, Any]]) -> None:
    plain = dist.all_reduce

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        if group is not None and dist.get_world_size(group) < dist.get_world_size():
            log.append({"ranks": dist.get_process_group_ranks(group), "bytes": tensor.numel() * tensor.element_size()})
        return plain(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce


def main(plan_file: Path) -> None:
    quiet_libraries()
    dist.init_process_group("gloo")
    log: list[dict[str, Any]] = []
    _record_all_reduces(log)
    node = os.environ["GROUP_RANK"]
    for entry in json.loads(plan_file.read_text()):
        os.environ["GROUP_RANK"] = "0" if entry["one_node"] else node
        log.clear()
        out = plan_file.parent / entry["name"]
        run(TrainingConfig.model_validate(entry["training"]), out)
        if dist.get_rank() == 0:
            (out / "collectives.json").write_text(json.dumps(log))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the torchrun entry does: no interpreter shutdown racing gloo's threads
