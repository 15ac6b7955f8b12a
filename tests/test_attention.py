"""``training.attention``: which attention implementation the model is built with, decided on the host.

``auto`` is today's default (sdpa) on a CPU and flash-attention 2 on a bf16 CUDA run where flash-attn is installed;
an explicit ``flash_attention_2`` that cannot run is refused before any weight is read. The setting reaches the
model through the job's own load path (its config's ``_attn_implementation``), and eager and sdpa give the same loss
for a packed batch (``packing: documents``: per-row ``position_ids``). Flash-attention's own kernel needs a CUDA GPU
and the flash-attn package, neither of which is here: the one-row layout the job hands it for a packed batch is
checked against transformers' own reading of the positions, and run through sdpa.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_packing import save_tiny_llama
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from raytrain_eks.config import TrainingConfig, load_config
from raytrain_eks.errors import ConfigError, UserError
from raytrain_eks.train.context import ProcessContext
from raytrain_eks.train.data.cursor import DataCursor, take_from_parts
from raytrain_eks.train.data.encoding import IGNORE_INDEX
from raytrain_eks.train.data.packing import pack
from raytrain_eks.train.loop import agreed_attention, train
from raytrain_eks.train.model import (
    FLASH_ATTENTION,
    check_attention,
    choose_attention,
    chunked_cross_entropy,
    forward_inputs,
    load_model,
    load_model_shell,
    output_projection_deferred,
)

SEQ = 48
CPU = torch.device("cpu")


class _NoSdpa(LlamaForCausalLM):
    """A model class without an sdpa path (transformers then builds it with eager)."""

    _supports_sdpa = False
    _supports_flash_attn = False


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny Llama saved as from_pretrained reads it, with weights large enough that context changes a loss."""
    return save_tiny_llama(str(tmp_path_factory.mktemp("llama")))


def _packed(seed: int, lengths: tuple[int, ...] = (9, 14, 6, 11, 13, 7, 12)) -> dict[str, np.ndarray]:
    """Rows packed by documents into blocks of SEQ tokens (two blocks here: a batch of two rows of positions)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, 300, (n,), generator=gen).tolist()
        rows.append((ids, [IGNORE_INDEX] * 3 + ids[3:]))
    return pack(rows, seq_len=SEQ, pad_id=0, packing="documents")


def _loss(model, batch: dict[str, torch.Tensor], attention: str | None = None) -> float:
    """The job's loss of ``batch`` (its forward inputs, deferred projection and chunked loss), per trained token."""
    head = output_projection_deferred(model)
    labels = batch["labels"]
    with torch.no_grad():
        hidden = head.forward(model, **forward_inputs(batch, attention=attention)).logits.reshape(*labels.shape, -1)
        total = chunked_cross_entropy(hidden[:, :-1], head(), labels[:, 1:], transform=head.transform)
    return float(total) / int((labels[:, 1:] != IGNORE_INDEX).sum())


def test_auto_on_a_cpu_is_todays_default():
    for precision in ("fp32", "bf16"):
        attention, why = choose_attention("auto", LlamaForCausalLM, cuda=False, precision=precision)
        assert (attention, why) == ("sdpa", "auto: the run's device is not a CUDA GPU")
    # A model without sdpa gets eager, as transformers gives it when asked for nothing.
    assert choose_attention("auto", _NoSdpa, cuda=False, precision="fp32")[0] == "eager"
    assert choose_attention("eager", LlamaForCausalLM, cuda=False, precision="fp32") == ("eager", "as configured")
    assert choose_attention("sdpa", LlamaForCausalLM, cuda=True, precision="bf16") == ("sdpa", "as configured")
    with pytest.raises(UserError, match="training.attention sdpa: _NoSdpa has no sdpa path in transformers"):
        choose_attention("sdpa", _NoSdpa, cuda=False, precision="fp32")


def test_the_worker_decides_from_the_models_config_the_same_as_transformers_default(llama):
    # One process, no process group: the workers' decision as each rank makes it, then the model it builds.
    assert agreed_attention("auto", llama, "fp32", CPU) == ("sdpa", "auto: the run's device is not a CUDA GPU")
    default = AutoModelForCausalLM.from_pretrained(llama).config._attn_implementation
    built = load_model(llama, activation_checkpointing=False, attention="sdpa").config._attn_implementation
    assert default == built == "sdpa"


def test_auto_takes_flash_attention_on_cuda_where_flash_attn_is_installed(monkeypatch):
    # The only part that cannot run here: a CUDA device and an installed flash-attn. Both answers are the
    # decision's inputs: the device is given, and transformers' own is_flash_attn_2_available() is answered yes.
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert choose_attention("auto", LlamaForCausalLM, cuda=True, precision="bf16") == (
        FLASH_ATTENTION,
        "auto: flash-attn's variable-length kernel on a bf16 CUDA run",
    )
    assert choose_attention(FLASH_ATTENTION, LlamaForCausalLM, cuda=True, precision="bf16")[0] == FLASH_ATTENTION
    # Not where it cannot run: fp32 compute, a model without it, no flash-attn.
    assert choose_attention("auto", LlamaForCausalLM, cuda=True, precision="fp32")[0] == "sdpa"
    assert choose_attention("auto", _NoSdpa, cuda=True, precision="bf16")[0] == "eager"
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    attention, why = choose_attention("auto", LlamaForCausalLM, cuda=True, precision="bf16")
    assert attention == "sdpa" and "flash-attn 2 (2.3.3 or later) is not installed" in why


def test_the_flash_attn_minimum_is_the_one_transformers_checks():
    """The plan's reading of an image's flash-attn and the job's check use one minimum: transformers' own."""
    import inspect

    from transformers.utils import import_utils

    from raytrain_eks.config import FLASH_ATTN_MIN

    source = inspect.getsource(import_utils.is_flash_attn_2_available)
    assert f'version.parse("{FLASH_ATTN_MIN}")' in source


def test_flash_attention_that_cannot_run_is_refused_naming_what_is_missing(llama, monkeypatch):
    with pytest.raises(UserError) as info:
        choose_attention(FLASH_ATTENTION, LlamaForCausalLM, cuda=False, precision="fp32")
    assert info.value.message == (
        "training.attention flash_attention_2 cannot run here: the run's device is not a CUDA GPU; the run computes "
        "in fp32 (training.precision), and flash-attn only in bf16 or fp16"
    )
    assert "Use attention auto" in info.value.hint and "pip install flash-attn" in info.value.hint
    with pytest.raises(UserError, match="cannot run here: flash-attn 2 .2.3.3 or later. is not installed"):
        choose_attention(FLASH_ATTENTION, LlamaForCausalLM, cuda=True, precision="bf16", flash_installed=False)
    with pytest.raises(UserError, match="cannot run here: _NoSdpa has no flash-attention path in transformers"):
        choose_attention(FLASH_ATTENTION, _NoSdpa, cuda=True, precision="bf16", flash_installed=True)
    # The driver, before any worker starts: a local run on this machine (no CUDA here); on a cluster it knows only
    # the model and the configured precision.
    config = AutoModelForCausalLM.from_pretrained(llama).config
    with pytest.raises(UserError, match="the run's device is not a CUDA GPU"):
        check_attention(FLASH_ATTENTION, "auto", config, local=True)
    check_attention(FLASH_ATTENTION, "auto", config, local=False)
    with pytest.raises(UserError, match="cannot run here: the run computes in fp32"):
        check_attention(FLASH_ATTENTION, "fp32", config, local=False)
    check_attention("auto", "fp32", config, local=True)


def test_a_refused_flash_attention_stops_the_worker_before_any_weight_is_read(llama, tmp_path, monkeypatch):
    import raytrain_eks.train.loop as loop

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loop, "load_model", never)
    monkeypatch.setattr(loop, "load_model_shell", never)
    cfg = TrainingConfig(model_id=llama, steps=1, seq_len=SEQ, checkpoint_every=0, attention=FLASH_ATTENTION)
    with pytest.raises(UserError, match="training.attention flash_attention_2 cannot run here"):
        train(cfg, llama, ProcessContext(tmp_path))


def test_a_bogus_attention_is_refused_by_the_configuration(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(environ={}).training.attention == "auto"
    assert load_config(environ={}, sets=["training.attention=eager"]).training.attention == "eager"
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, sets=["training.attention=bogus"])
    assert info.value.problems == [
        "training.attention = 'bogus' (from --set training.attention): Input should be 'auto', 'sdpa', "
        "'flash_attention_2' or 'eager'"
    ]


def test_eager_and_sdpa_built_by_the_job_give_one_loss_for_a_packed_batch(llama):
    batch = {k: torch.from_numpy(v) for k, v in _packed(seed=2).items()}
    assert batch["input_ids"].shape == (2, SEQ) and "position_ids" in forward_inputs(batch)
    losses = {}
    for attention in ("eager", "sdpa"):
        shell = load_model_shell(llama, activation_checkpointing=False, attention=attention)  # the sharded start's
        model = load_model(llama, activation_checkpointing=False, attention=attention)
        assert shell.config._attn_implementation == model.config._attn_implementation == attention  # it is there
        losses[attention] = _loss(model, batch)
    assert losses["eager"] == pytest.approx(losses["sdpa"], rel=1e-5, abs=1e-5)
    # Without the positions, rows would attend across each other: a different loss, so the positions are used.
    plain = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    assert _loss(load_model(llama, activation_checkpointing=False, attention="eager"), plain) != pytest.approx(
        losses["eager"], rel=1e-3
    )


def test_flash_attentions_one_row_is_the_packed_batch_as_transformers_reads_it(llama):
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    batch = {k: torch.from_numpy(v) for k, v in _packed(seed=3).items()}
    one = forward_inputs(batch, attention=FLASH_ATTENTION)
    assert one["input_ids"].shape == one["position_ids"].shape == (1, 2 * SEQ)
    # The documents' bounds, computed on the host, are those transformers reads from the positions on the device.
    (cu_q, cu_k), (longest_q, longest_k) = prepare_fa_kwargs_from_position_ids(one["position_ids"])
    assert torch.equal(one["cu_seq_lens_q"], cu_q) and torch.equal(one["cu_seq_lens_k"], cu_k)
    assert one["max_length_q"] == one["max_length_k"] == int(longest_q) == int(longest_k)
    assert one["cu_seq_lens_q"].dtype == torch.int32 and SEQ in one["cu_seq_lens_q"].tolist()  # a block starts one
    # The same batch in one row (through sdpa, which ignores the bounds) has the loss of the batch of rows.
    model = load_model(llama, activation_checkpointing=False, attention="sdpa")
    assert _loss(model, batch, attention=FLASH_ATTENTION) == pytest.approx(_loss(model, batch), rel=1e-5, abs=1e-5)


class PackedInMemory(ProcessContext):
    """A lone process whose data is a packed set in memory, read as the Ray workers read theirs."""

    def __init__(self, out, blocks: dict[str, np.ndarray]) -> None:
        super().__init__(out)
        self._set = blocks

    def data_batches(self, batch_size, position, seed):
        n = len(self._set["input_ids"])
        parts = take_from_parts(lambda: [self._set], n)
        return DataCursor(parts, blocks=n, seed=seed, rank=0, world_size=1, batch_size=batch_size, position=position)


def test_the_run_says_and_records_its_attention(builtin_model, tmp_path, one_process_group, capsys):
    # The built-in model (Qwen2's architecture; a tokenizer for the checkpoint), trained one step by the job's loop.
    blocks = _packed(seed=4)
    losses = {}
    for attention in ("eager", "auto"):
        out = tmp_path / attention
        out.mkdir()
        cfg = TrainingConfig(
            model_id=builtin_model,
            data="builtin:sample-instructions",  # the set itself comes from the context
            steps=1,
            seq_len=SEQ,
            batch_size=2,
            log_every=1,
            checkpoint_every=0,
            precision="fp32",
            attention=attention,
            sample_tokens=0,
        )
        summary = train(cfg, builtin_model, PackedInMemory(out, blocks))
        assert json.loads((out / "summary.json").read_text())["attention"] == summary["attention"]
        losses[summary["attention"]] = summary["first_loss"]
    printed = capsys.readouterr().out
    assert "attention: eager (as configured)" in printed
    assert "attention: sdpa (auto: the run's device is not a CUDA GPU)" in printed
    assert losses["eager"] == pytest.approx(losses["sdpa"], rel=1e-5)
