"""Greedy samples on two real gloo ranks whose models disagree: every rank returns rank 0's tokens and stops at the
same forward (a rank that stopped alone would leave the other waiting in its next collective for ever)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from raytrain_eks.train.builtin import ensure_builtin_model

PROMPTS = [
    "### Instruction:\nName a colour.\n\n### Response:\n",
    "### Instruction:\nCount to three.\n\n### Response:\n",
]


def _rank(rank: int, model_dir: str, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from raytrain_eks.train.evaluation import greedy_samples
    from raytrain_eks.train.model import load_model, output_projection_deferred

    torch.manual_seed(0)
    model = load_model(model_dir, activation_checkpointing=False)
    head = output_projection_deferred(model)
    if rank == 1:  # this rank's model would answer otherwise
        with torch.no_grad():
            weight = head()
            weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)) * weight.std())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kwargs = {"max_new_tokens": 6, "device": torch.device("cpu")}
    alone = greedy_samples(model, head, tokenizer, PROMPTS, **kwargs)  # no process group yet: its own answers
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    together = greedy_samples(model, head, tokenizer, PROMPTS, **kwargs)
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"alone": alone, "together": together}))


def test_every_rank_returns_rank_0s_greedy_tokens_and_stops_with_it(tmp_path: Path) -> None:
    model_dir = str(ensure_builtin_model())
    ctx = multiprocessing.get_context("spawn")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, model_dir, str(tmp_path / "store"), str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        p.kill()
    assert not hung, "a rank never returned: the ranks stopped at different forwards"
    assert [p.exitcode for p in procs] == [0, 0]
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    assert r0["alone"] != r1["alone"]  # the premise: left to itself, rank 1 answers otherwise
    assert r0["together"] == r1["together"] == r0["alone"]
