"""Checkpoint files and export folders, without Ray: what a resume unpickles, and which folder an export replaces.

Checkpoints can come from shared storage, so the per-rank trainer state is read as data only. An export replaces
its target folder as a whole, so it only ever replaces a folder an earlier export wrote (it carries a marker).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from raytrain_eks.cli import main
from raytrain_eks.errors import UserError
from raytrain_eks.train.checkpoint import EXPORT_MARKER, load_trainer_state, save_trainer_state
from raytrain_eks.train.export import check_export_target


def _scheduler() -> torch.optim.lr_scheduler.LambdaLR:
    opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=1e-3)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


class _RunsCode:
    """Unpickling this object runs a program (here: creates a file); a checkpoint must never do that."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (str(self.target),))


def test_trainer_state_round_trips_as_plain_data(tmp_path):
    sched = _scheduler()
    for _ in range(3):
        sched.optimizer.step()
        sched.step()
    save_trainer_state(tmp_path, rank=1, step=3, scheduler=sched, data_position={"epoch": 0, "batch": 3})
    state = load_trainer_state(tmp_path, 1)
    assert state["step"] == 3 and state["data"] == {"epoch": 0, "batch": 3}
    assert torch.equal(state["rng"]["cpu"], torch.get_rng_state())
    fresh = _scheduler()
    fresh.load_state_dict(state["scheduler"])
    assert fresh.get_last_lr() == sched.get_last_lr() != [1e-3]
    # A rank that did not exist in the saved run takes rank 0's file; here rank 0 has none, so rank 1 is it.
    save_trainer_state(tmp_path, rank=0, step=3, scheduler=sched, data_position={"epoch": 0, "batch": 3})
    assert load_trainer_state(tmp_path, 7)["step"] == 3


def test_trainer_state_holding_an_arbitrary_object_is_refused(tmp_path):
    proof = tmp_path / "code-ran"
    torch.save({"step": 1, "scheduler": _RunsCode(proof), "data": {}, "rng": {}}, tmp_path / "trainer_rank00000.pt")
    with pytest.raises(UserError, match="holds objects other than tensors and plain values, so it is not loaded"):
        load_trainer_state(tmp_path, 0)
    assert not proof.exists(), "the pickled object's code ran"


def _downloaded_model(folder: Path) -> dict[str, bytes]:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 1536}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_export_refuses_a_model_folder_it_did_not_write(tmp_path, monkeypatch, capsys):
    base = tmp_path / "Qwen2.5-1.5B"
    before = _downloaded_model(base)
    monkeypatch.chdir(tmp_path)
    # Refused before the checkpoint is even looked at: the check comes first.
    for target in (str(base), "./Qwen2.5-1.5B"):
        with pytest.raises(SystemExit) as info:
            main(["export", str(tmp_path / "some-run"), target])
        assert info.value.code == 1
        err = capsys.readouterr().err
        assert f"{base} already exists and is not an earlier export (it has no {EXPORT_MARKER})" in err
        assert "left untouched" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before


def test_export_targets_it_may_replace(tmp_path):
    check_export_target(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_export_target(tmp_path / "empty")
    earlier = tmp_path / "earlier"
    _downloaded_model(earlier)
    (earlier / EXPORT_MARKER).write_text("{}")
    check_export_target(earlier)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match="already exists and is not a folder"):
        check_export_target(tmp_path / "a-file")


def test_bfloat16_export_is_filled_in_bfloat16_from_an_fp32_checkpoint(tmp_path, builtin_model):
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from raytrain_eks.train.checkpoint import HF_DIR, mark_complete
    from raytrain_eks.train.export import export_hf

    model = AutoModelForCausalLM.from_pretrained(builtin_model, dtype=torch.float32)
    folder = tmp_path / "ray" / "checkpoint_00000001"
    with warnings.catch_warnings():  # one process without a process group, as export itself loads
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(folder), no_dist=True)
    model.config.save_pretrained(folder / HF_DIR)
    mark_complete(folder, step=1, world_size=1)

    full = load_file(export_hf(folder, tmp_path / "fp32") / "model.safetensors")
    half = load_file(export_hf(folder, tmp_path / "bf16", dtype="bfloat16") / "model.safetensors")
    assert full.keys() == half.keys() and all(t.dtype == torch.float32 for t in full.values())
    for name, tensor in half.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, full[name].to(torch.bfloat16)), name
    assert torch.equal(full["model.embed_tokens.weight"], model.model.embed_tokens.weight.detach())


def test_the_temporary_folders_of_workers_that_are_gone_are_removed_and_others_kept(tmp_path):
    import subprocess
    import sys

    from raytrain_eks.train.checkpoint import TEMP_PREFIX
    from raytrain_eks.train.context import remove_stale_folders

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a worker killed mid-run: its process has exited
    stale = [tmp_path / f"{TEMP_PREFIX}resume-r1-p{dead}-x1y2z3", tmp_path / f"{TEMP_PREFIX}ckpt-40-r0-p{dead}-q9w8"]
    live = tmp_path / f"{TEMP_PREFIX}resume-r0-p{os.getpid()}-abcd"  # a worker still running
    other = tmp_path / f"{TEMP_PREFIX}resume-k2j3h4"  # the CLI's own copy of a storage folder's config: not ours
    for folder in [*stale, live, other]:
        (folder / "checkpoint").mkdir(parents=True)
        (folder / "checkpoint" / "__0_0.distcp").write_bytes(b"\0" * 1024)
    assert sorted(remove_stale_folders(tmp_path)) == sorted(stale)
    assert not any(p.exists() for p in stale) and live.is_dir() and other.is_dir()
