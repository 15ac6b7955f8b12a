"""Greedy samples on two real gloo ranks whose models disagree: every rank returns rank 0's tokens and stops at the
same forward (a rank that stopped alone would leave the other waiting in its next collective for ever)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from raytrain_eks.train.builtin import ensure_builtin_model

PROMPTS = [
    "### Instruction:\nName a colour.\n\n### Response:\n",
    "### Instruction:\nCount to three.\n\n### Response:\n",
]


RANK = """
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from raytrain_eks.train.evaluation import greedy_samples
from raytrain_eks.train.model import load_model, output_projection_deferred

rank, model_dir, store, out, prompts = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
torch.manual_seed(0)
model = load_model(model_dir, activation_checkpointing=False)
head = output_projection_deferred(model)
if rank == 1:  # this rank's model would answer otherwise
    with torch.no_grad():
        weight = head()
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)) * weight.std())
tokenizer = AutoTokenizer.from_pretrained(model_dir)
kwargs = {"max_new_tokens": 6, "device": torch.device("cpu")}
alone = greedy_samples(model, head, tokenizer, prompts, **kwargs)  # no process group yet: its own answers
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
together = greedy_samples(model, head, tokenizer, prompts, **kwargs)
dist.barrier()
dist.destroy_process_group()
Path(out).write_text(json.dumps({"alone": alone, "together": together}))
"""


def test_every_rank_returns_rank_0s_greedy_tokens_and_stops_with_it(tmp_path: Path, starts_process_group: None) -> None:
    model_dir = str(ensure_builtin_model())
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), model_dir, str(tmp_path / "store"), str(outs[r]), json.dumps(PROMPTS)]
        )
        for r in range(2)
    ]
    hung = []
    for p in procs:
        try:
            p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            hung.append(p.pid)
    for p in procs:
        p.kill()
        p.wait()
    assert not hung, "a rank never returned: the ranks stopped at different forwards"
    assert [p.returncode for p in procs] == [0, 0]
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    assert r0["alone"] != r1["alone"]  # the premise: left to itself, rank 1 answers otherwise
    assert r0["together"] == r1["together"] == r0["alone"]
