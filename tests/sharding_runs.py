"""Several trainings one after another in one torchrun process group, for tests/test_sharding.py.

Started by torchrun on every rank (``torchrun ... tests/sharding_runs.py PLAN.json``). ``PLAN.json`` is a list of
``{"name", "training", "one_node"}``: each entry trains with :func:`raytrain_eks.train.torchrun_entry.run` into
``<plan folder>/<name>``, as the torchrun entry would, so the processes start (and import torch) once for all.
``one_node`` makes every rank report the same node, as if the agents ran on one machine. Rank 0 also writes
``<name>/collectives.json``: every ``all_reduce`` the run issued on a group smaller than the world, with its ranks
(the cross-node gradient reductions of HSDP). An entry ``{"name", "micro_batches"}`` instead accumulates the
gradients of a small HSDP model over that many micro-batches (:func:`accumulated_gradients`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raytrain_eks.config import TrainingConfig
from raytrain_eks.train.loop import quiet_libraries
from raytrain_eks.train.sharding import apply_fsdp, build_mesh, choose_sharding, set_gradient_sync
from raytrain_eks.train.torchrun_entry import run


def _record_all_reduces(log: list[dict[str, Any]]) -> None:
    plain = dist.all_reduce

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        if group is not None and dist.get_world_size(group) < dist.get_world_size():
            log.append({"ranks": dist.get_process_group_ranks(group), "bytes": tensor.numel() * tensor.element_size()})
        return plain(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


class _Sum(torch.nn.Module):
    """A model shaped as :func:`apply_fsdp` shards a causal LM (``model.layers``, then the root's own parameter)
    whose output is its input plus every parameter: ``(c * output).sum()`` gives every parameter the gradient ``c``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.bias = torch.nn.Parameter(torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.bias
        for layer in self.model.layers:
            x = layer(x)
        return x


def accumulated_gradients(out: Path, micro_batches: int, node: str, log: list[dict[str, Any]]) -> None:
    """Every gradient of :class:`_Sum`, sharded with HSDP (``node``: this rank's torchrun agent) in fp32, after
    ``micro_batches`` micro-batches stepped as the loop does (:func:`set_gradient_sync`), once per reduce precision:
    rank 0 writes ``<out>/gradients.json``: for each, ``{"gradients": [...], "all_reduces": [...]}``, the gradients
    flattened and rank 0's all-reduces across nodes (``log``, as :func:`_record_all_reduces` keeps it).

    The ``i``-th rank of node ``n``'s gradient is ``1 + (2i + 2n + 1) / 64`` on every micro-batch: 1/64 and 3/64 over
    1 on the first node, 3/64 and 5/64 on the second. The ranks', the nodes' means (1 + 1/32, 1 + 1/16) and the mean
    of all (1 + 3/64) are exact in bf16, so reducing one micro-batch rounds nothing: only a running sum over
    micro-batches can lose bits (past 16, bf16's step is 1/16 and more).
    """
    nodes: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    layout = choose_sharding("hsdp", [str(n) for n in nodes])
    mesh = build_mesh(layout, "cpu")
    rank = dist.get_rank()
    n, ranks = next((n, ranks) for n, (_, ranks) in enumerate(layout.nodes) if rank in ranks)
    c = 1 + (2 * ranks.index(rank) + 2 * n + 1) / 64
    runs = {}
    for reduce_precision in ("bf16", "fp32"):
        log.clear()
        model = apply_fsdp(_Sum(), precision="fp32", reduce_precision=reduce_precision, mesh=mesh)
        for step in range(micro_batches):
            set_gradient_sync(model, "hsdp", last=step == micro_batches - 1)
            (c * model(torch.zeros(4, 8))).sum().backward()
        full = [p.grad.full_tensor().flatten() for p in model.parameters()]
        runs[reduce_precision] = {"gradients": torch.cat(full).tolist(), "all_reduces": list(log)}
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gradients.json").write_text(json.dumps(runs))


def main(plan_file: Path) -> None:
    quiet_libraries()
    dist.init_process_group("gloo")
    log: list[dict[str, Any]] = []
    _record_all_reduces(log)
    node = os.environ["GROUP_RANK"]
    for entry in json.loads(plan_file.read_text()):
        out = plan_file.parent / entry["name"]
        if "micro_batches" in entry:
            accumulated_gradients(out, entry["micro_batches"], node, log)
            continue
        os.environ["GROUP_RANK"] = "0" if entry["one_node"] else node
        log.clear()
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
