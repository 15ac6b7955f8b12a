"""Export to Hugging Face format, streamed a bounded group of tensors at a time, from local disk and from S3.

Each exported folder is compared with what the whole model written by ``save_pretrained`` gives: the same
tensors (tied weights once), the same logits from ``from_pretrained``, config and tokenizer beside them.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from raytrain_eks.cli import main
from raytrain_eks.train import export as export_mod
from raytrain_eks.train.checkpoint import EXPORT_MARKER, HF_DIR, checkpoint_name, mark_complete
from raytrain_eks.train.export import export_hf

BUCKET = "raytrain-eks-export"


def _model(builtin_model: str, *, tied: bool = True):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(builtin_model)
    config.tie_word_embeddings = tied
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # weights unlike any initialisation, norms included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _checkpoint(root: Path, model, builtin_model: str) -> Path:
    """A checkpoint as training writes it: DCP model + AdamW state, ``hf/`` config and tokenizer, marker."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    folder = root / "ray" / checkpoint_name(3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(
            {"model": dict(model.state_dict()), "optim": optimizer.state_dict()},
            checkpoint_id=str(folder),
            no_dist=True,
        )
    model.config.save_pretrained(folder / HF_DIR)
    AutoTokenizer.from_pretrained(builtin_model).save_pretrained(folder / HF_DIR)
    mark_complete(folder, step=3, world_size=1)
    return folder


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        part = load_file(folder / name)
        assert not out.keys() & part.keys()
        out.update(part)
    return out


def _logits(folder: Path, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([[5, 17, 99, 3, 250, 8]])).logits


def test_streamed_export_in_several_files_equals_the_whole_model(tmp_path, builtin_model, monkeypatch):
    model = _model(builtin_model)
    folder = _checkpoint(tmp_path, model, builtin_model)
    reference = tmp_path / "reference"
    model.save_pretrained(reference)

    groups: list[int] = []
    load_group = export_mod._load_group

    def recording(checkpoint, entries, dtype):
        groups.append(sum(e.nbytes for e in entries))
        return load_group(checkpoint, entries, dtype)

    monkeypatch.setattr(export_mod, "_load_group", recording)
    sizes = {n: t.numel() * 4 for n, t in model.state_dict().items()}
    group, shard = 200_000, 2_000_000  # far below the model's size: many groups, several files
    out = export_hf(tmp_path, tmp_path / "out", max_shard_bytes=shard, group_bytes=group)

    largest = max(sizes.values())
    assert len(groups) > 5 and max(groups) <= max(group, largest), groups
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert all((out / f).stat().st_size <= shard + largest + 64 * 1024 for f in files)

    ours, theirs = _weights(out), _weights(reference)
    assert ours.keys() == theirs.keys() and "lm_head.weight" not in ours  # tied: written once, as save_pretrained
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in theirs.values())
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), name
    assert torch.equal(_logits(out, torch.float32), _logits(reference, torch.float32))

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    assert (out / "generation_config.json").is_file() and (out / "tokenizer_config.json").is_file()
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert marker["checkpoint"] == str(folder) and marker["dtype"] == "float32"


def test_bfloat16_and_untied_exports_match_save_pretrained(tmp_path, builtin_model):
    model = _model(builtin_model, tied=False)
    _checkpoint(tmp_path, model, builtin_model)
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    out = export_hf(tmp_path, tmp_path / "fp32")
    assert not (out / "model.safetensors.index.json").exists()
    ours, theirs = _weights(out), _weights(reference)
    assert ours.keys() == theirs.keys() and "lm_head.weight" in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert not torch.equal(ours["lm_head.weight"], ours["model.embed_tokens.weight"])
    assert torch.equal(_logits(out, torch.float32), _logits(reference, torch.float32))

    half = export_hf(tmp_path, tmp_path / "bf16", dtype="bfloat16", group_bytes=100_000)
    reference_half = tmp_path / "reference-bf16"
    model.to(torch.bfloat16).save_pretrained(reference_half)
    ours, theirs = _weights(half), _weights(reference_half)
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], theirs[k]) for k in theirs)
    assert torch.equal(_logits(half, torch.bfloat16), _logits(reference_half, torch.bfloat16))
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(Exception, match="float16"):
        export_hf(tmp_path, tmp_path / "f16", dtype="float16")
    assert not (tmp_path / "f16").exists()


def test_export_from_s3_reads_only_the_model_tensors(tmp_path, builtin_model, aws_env, monkeypatch, capsys):
    import boto3
    from pyarrow import fs as pafs

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    model = _model(builtin_model)
    folder = _checkpoint(tmp_path / "local", model, builtin_model)
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    uri = f"s3://{BUCKET}/runs/a/ray/{folder.name}"
    remote, base = pafs.FileSystem.from_uri(uri)
    pafs.copy_files(str(folder), base, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=remote)

    seen: dict[str, int] = {}
    export_local = export_mod._export_local

    def looking(checkpoint, *args, **kwargs):  # the local copy DCP reads, before it is deleted
        shards = list(checkpoint.glob("*.distcp"))
        seen["size"] = sum(p.stat().st_size for p in shards)
        seen["stored"] = sum(p.stat().st_blocks * 512 for p in shards)
        seen["optimizer_files"] = len(list(checkpoint.glob("trainer_rank*")))
        return export_local(checkpoint, *args, **kwargs)

    monkeypatch.setattr(export_mod, "_export_local", looking)
    main(["export", f"s3://{BUCKET}/runs/a", str(tmp_path / "from-s3")])  # a storage folder: its newest checkpoint
    assert "model:" in capsys.readouterr().out

    model_bytes = sum(t.numel() * 4 for t in model.state_dict().values())
    shards = sum(p.stat().st_size for p in folder.glob("*.distcp"))
    assert shards > 2.5 * model_bytes and seen["size"] == shards  # the optimizer's moments are there too
    assert seen["stored"] < 1.5 * model_bytes and seen["optimizer_files"] == 0  # but only the model was copied

    local = export_hf(folder, tmp_path / "from-disk")
    ours, theirs = _weights(tmp_path / "from-s3"), _weights(local)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    marker = json.loads((tmp_path / "from-s3" / EXPORT_MARKER).read_text())
    assert marker["checkpoint"] == uri
