"""Start-up of a sharded model, two gloo processes on CPU: each rank builds the model on the meta device (no memory)
and reads only its own shard of the weights from the model's safetensors files; when the files cannot be read by
shard, rank 0 reads them whole and sends each rank its shard and every buffer from the loaded tensors themselves,
sharding a model that holds no weights, as the other ranks do; a full fine-tune that resumes reads no weight from the
model's files at all. LoRA's adapters start the same on every rank."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
from test_loss_architectures import ARCHITECTURES, SMALL

from raytrain_eks.train.model import load_model, load_model_shell

pytestmark = pytest.mark.usefixtures("starts_ray")


def _two_ranks(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen([sys.executable, __file__, str(r), "2", *args], env=env, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    errors = [p.communicate(timeout=300)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(e[-3000:] for e in errors)


class _Ctx:
    """What prepare_model reads of a worker's context: its rank, world size and notes."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size, self.node, self.device = rank, world, "one-node", torch.device("cpu")
        self.notes: list[str] = []

    def emit(self, record) -> None:
        self.notes.append(record.text)  # prepare_model sends notes only


@contextlib.contextmanager
def _watched(seen: dict) -> Iterator[None]:
    """Rank 0's start watched, into ``seen``: the calls to the ``to`` of the model ``from_pretrained`` loaded (a move
    of the whole model, no copy on the CPU), which tensors the model held when sharded, and how many of the loaded
    weights were not broadcast from their own storage (a copy of them was)."""
    import raytrain_eks.train.loop as loop

    load_model, shard_model, broadcast = loop.load_model, loop.shard_model, dist.broadcast
    loaded: list[torch.Tensor] = []  # held, so that no other tensor takes their place in memory
    sent: set[int] = set()
    seen.update(moved=[], held_when_sharded=[])

    def loading(*args, **kwargs):
        model = load_model(*args, **kwargs)
        loaded.extend(model.state_dict().values())
        model.to = lambda *a, **kw: seen["moved"].append(repr((a, kw)))
        return model

    def sharding(model, *args, **kwargs):
        own = [*model.named_parameters(), *model.named_buffers()]
        seen["held_when_sharded"] = [name for name, t in own if not t.is_meta]
        return shard_model(model, *args, **kwargs)

    def sending(tensor, *args, **kwargs):
        sent.add(tensor.untyped_storage().data_ptr())
        return broadcast(tensor, *args, **kwargs)

    with (
        patch.object(loop, "load_model", loading),
        patch.object(loop, "shard_model", sharding),
        patch.object(dist, "broadcast", sending),
    ):
        yield
    seen["copied"] = len({t.untyped_storage().data_ptr() for t in loaded} - sent)


def _prepare_rank(rank: int, world: int, store: str, plan: str) -> None:
    """Each case of ``plan`` (JSON): prepare_model as the loop calls it, on an FSDP layout over both ranks; this
    rank's full weights, buffers and notes saved to the case's file (and, when asked, a checkpoint written, or what
    rank 0's start did with the loaded model watched)."""
    from raytrain_eks.config import TrainingConfig
    from raytrain_eks.train.checkpoint import load_sharded, save_sharded
    from raytrain_eks.train.loop import build_optimizer, prepare_model
    from raytrain_eks.train.sharding import choose_sharding

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for case in json.loads(plan):
            torch.manual_seed(rank)  # a start that depended on the ranks' random state would differ between them
            cfg = TrainingConfig(model_id=case["model"], method=case.get("method", "full"), steps=4)
            ctx = _Ctx(rank, world)
            seen: dict = {}
            with _watched(seen) if case.get("watch") and rank == 0 else contextlib.nullcontext():
                prepared = prepare_model(
                    cfg,
                    case["model"],
                    ctx,
                    layout=choose_sharding("fsdp", ["one-node"] * world),
                    precision="fp32",
                    checkpointing=False,
                    device=torch.device("cpu"),
                    resuming=bool(case.get("resume")),
                )
            model = prepared.model
            optimizer, scheduler = build_optimizer(model, cfg)
            if case.get("resume"):
                load_sharded(Path(case["resume"]), model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
            if case.get("save"):
                kw = dict(model=model, optimizer=optimizer, scheduler=scheduler, step=1, data_position={})
                save_sharded(Path(case["save"]), **kw, rank=rank, tokenizer_path=None)
            state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
            buffers = {k: b.clone() for k, b in model.named_buffers()}
            torch.save({"state": state, "buffers": buffers, "notes": ctx.notes, "seen": seen}, f"{case['out']}.{rank}")
        dist.barrier()  # both ranks leave the group together
    finally:
        dist.destroy_process_group()


def _same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{what}: {name}"


def _saved(arch: str, folder: Path, **changes: object) -> Path:
    """A small model of ``arch`` (test_loss_architectures' sizes) saved by ``save_pretrained``, in the files' layout of
    the Hub (Mixture-of-Experts layers with one tensor per expert, GPT-NeoX's output layer as ``embed_out``)."""
    import transformers

    name, extra = ARCHITECTURES[arch]
    torch.manual_seed(0)
    config = getattr(transformers, name)(**{**SMALL, **extra, **changes})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _as_bin(model: torch.nn.Module, path: str, folder: Path) -> Path:
    """``model`` (read from ``path``) saved as weights only a whole read can take: ``pytorch_model.bin``, the older
    format ``from_pretrained`` still reads, no safetensors."""
    folder.mkdir()
    shutil.copy(Path(path) / "config.json", folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def test_rank_0s_start_sends_the_loaded_weights_from_the_cpu_and_no_device_holds_the_whole_model(
    tmp_path: Path, builtin_model: str
):
    # Files that cannot be read by shard: rank 0 reads the whole model. Its weights are sent from the tensors
    # from_pretrained loaded, on the CPU, not from a copy of them (the host would hold the model twice), and the model
    # it shards holds none (a model moved whole to a GPU first can run it out of memory before training begins).
    want = load_model(builtin_model, activation_checkpointing=False)
    out = tmp_path / "bin"
    case = {"model": str(_as_bin(want, builtin_model, tmp_path / "bin-model")), "out": str(out), "watch": True}
    _two_ranks(str(tmp_path / "store"), "prepare", json.dumps([case]))
    got = [torch.load(f"{out}.{rank}") for rank in range(2)]
    assert any("rank 0 reads the whole model" in n and "safetensors" in n for n in got[0]["notes"]), got[0]
    for rank in range(2):  # rank 1 read nothing: its shard and every buffer came from rank 0
        _same(got[rank]["state"], want.state_dict(), f"rank 0's start, rank {rank}")
        _same(got[rank]["buffers"], dict(want.named_buffers()), f"rank 0's start's buffers, rank {rank}")
    seen = got[0]["seen"]
    assert seen["copied"] == 0, seen  # every loaded weight was sent from its own storage
    assert seen["moved"] == [], seen
    assert seen["held_when_sharded"] == [], seen


def test_each_rank_reads_its_own_shard_and_a_resume_reads_no_weights_of_the_model(tmp_path: Path, builtin_model: str):
    from safetensors import safe_open

    from raytrain_eks.config import LoraSettings, TrainingConfig
    from raytrain_eks.train.lora import apply_lora, is_adapter
    from raytrain_eks.train.start import initial_adapters

    want = load_model(builtin_model, activation_checkpointing=False)
    # Files transformers converts while loading: three experts per layer (two ranks hold two and one), and a weight
    # stored under another name. Each rank still reads only its own shard.
    converted = {
        "qwen3-moe": _saved("qwen3-moe", tmp_path / "qwen3-moe", num_experts=3),
        "gpt-neox": _saved("gpt-neox", tmp_path / "gpt-neox"),
    }
    held = {}
    for arch, folder in converted.items():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            held[arch] = set(f.keys())  # a safetensors file is not iterable itself
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in held["qwen3-moe"]  # as the Hub's MoE files hold them
    assert "embed_out.weight" in held["gpt-neox"]
    # The same model as weights only a whole read can take (no safetensors), and as its config alone (no weights).
    as_bin = _as_bin(want, builtin_model, tmp_path / "bin-model")
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(Path(builtin_model) / "config.json", bare)
    checkpoint = tmp_path / "checkpoint_00000001"
    cases = [
        {"model": builtin_model, "out": str(tmp_path / "own"), "save": str(checkpoint)},
        {"model": builtin_model, "out": str(tmp_path / "lora"), "method": "lora"},
        {"model": str(as_bin), "out": str(tmp_path / "bin-lora"), "method": "lora"},  # rank 0's start
        {"model": str(bare), "out": str(tmp_path / "resume"), "resume": str(checkpoint)},
        *({"model": str(folder), "out": str(tmp_path / f"{arch}-out")} for arch, folder in converted.items()),
    ]
    _two_ranks(str(tmp_path / "store"), "prepare", json.dumps(cases))
    got = {c["out"]: [torch.load(f"{c['out']}.{r}") for r in range(2)] for c in cases}
    expected, buffers = want.state_dict(), dict(want.named_buffers())
    size = (Path(builtin_model) / "model.safetensors").stat().st_size

    own = got[str(tmp_path / "own")]
    for rank in range(2):
        _same(own[rank]["state"], expected, f"own shard, rank {rank}")
        _same(own[rank]["buffers"], buffers, f"own shard's buffers, rank {rank}")
    (note,) = [n for n in own[0]["notes"] if n.startswith("model start")]
    assert note.startswith("model start: each rank read its own shard of the weights (rank 0: ")
    read_mb = float(note.split("rank 0: ")[1].split(" MB")[0])
    assert 0.3 * size / 1e6 < read_mb < 0.7 * size / 1e6, (note, size)  # about half: its shard, not the whole

    base = load_model(builtin_model, activation_checkpointing=False)
    apply_lora(base, LoraSettings(), base=builtin_model)
    adapters = initial_adapters(base, TrainingConfig().seed)
    assert adapters and all(is_adapter(k) for k in adapters)
    for run, rank in [(run, rank) for run in ("lora", "bin-lora") for rank in range(2)]:
        state = got[str(tmp_path / run)][rank]["state"]
        _same({k: v for k, v in state.items() if is_adapter(k)}, adapters, f"{run}: adapters, rank {rank}")
        frozen = {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter(k)}
        _same(frozen, expected, f"{run}: LoRA's base, rank {rank}")
        _same(got[str(tmp_path / run)][rank]["buffers"], buffers, f"{run}: buffers, rank {rank}")

    for arch, folder in converted.items():
        reference = load_model(str(folder), activation_checkpointing=False)
        runs = got[str(tmp_path / f"{arch}-out")]
        for rank in range(2):
            _same(runs[rank]["state"], reference.state_dict(), f"{arch}, own shard, rank {rank}")
        (note,) = [n for n in runs[0]["notes"] if n.startswith("model start")]
        assert note.startswith("model start: each rank read its own shard of the weights"), (arch, note)
        read_mb = float(note.split("rank 0: ")[1].split(" MB")[0])
        size = (folder / "model.safetensors").stat().st_size
        assert 0.3 * size / 1e6 < read_mb < 0.75 * size / 1e6, (arch, note, size)  # its shard: 2 of 3 experts

    resumed = got[str(tmp_path / "resume")]
    for rank in range(2):  # from a folder with no weights at all: everything came from the checkpoint
        assert not [n for n in resumed[rank]["notes"] if n.startswith("model start")]
        _same(resumed[rank]["state"], expected, f"resume, rank {rank}")
        _same(resumed[rank]["buffers"], buffers, f"resume's buffers, rank {rank}")


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_shell_gets_the_buffers_from_pretrained_makes_and_reads_by_shard_every_architectures_files(
    tmp_path: Path, arch: str
):
    # Files that transformers converts on load included: Qwen3-MoE's experts are stacked (5.13 and 5.23 alike),
    # GPT-NeoX's embed_out is renamed lm_head (5.23; 5.13 keeps embed_out, read as stored).
    from raytrain_eks.train.model import load_model_shell
    from raytrain_eks.train.start import WeightFiles, computed_buffers, weights_source

    _saved(arch, tmp_path)
    want = load_model(str(tmp_path), activation_checkpointing=False)
    shell = load_model_shell(str(tmp_path), activation_checkpointing=False)
    source = weights_source(str(tmp_path), shell)
    buffers = computed_buffers(shell)
    persistent = set(want.state_dict())
    expected = {k: b for k, b in want.named_buffers() if k not in persistent}
    assert expected, "every architecture here has rotary frequencies outside its state dict"
    _same(buffers, expected, arch)
    assert isinstance(source, WeightFiles), source
    assert bool(source.stacked) == (arch == "qwen3-moe"), sorted(source.stacked)


if __name__ == "__main__":  # one rank: RANK WORLD STORE prepare PLAN
    _prepare_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[5])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the torchrun entry does: no interpreter shutdown racing gloo's threads (SIGABRT at exit)


def test_activation_checkpointing_is_switched_on_non_reentrant_in_every_decoder_layer(builtin_model: str):
    # Under whichever name the installed transformers has (5.23: activation_checkpointing_enable; the DLC's 5.13:
    # gradient_checkpointing_enable only): the suite runs the first, scripts/check_oldest.sh the second.
    model = load_model_shell(builtin_model, activation_checkpointing=True)
    layers = list(model.model.layers)
    assert len(layers) == model.config.num_hidden_layers
    for layer in layers:
        assert layer.gradient_checkpointing is True
        assert layer._gradient_checkpointing_func.keywords.get("use_reentrant") is False
    plain = load_model_shell(builtin_model, activation_checkpointing=False)
    assert not [m for m in plain.model.layers if getattr(m, "gradient_checkpointing", False)]
