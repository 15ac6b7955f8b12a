"""The per-GPU memory estimate against torch's own accounting: torch's FSDP2 memory tracker follows every tensor
of a real training step of the job's sharded model (its ``apply_fsdp``, its chunked loss, fused AdamW) under fake
tensors and a fake process group, so Qwen2-shaped models at seq 2048 on 8 ranks are measured on CPU in seconds, with
no GPU and no memory. The estimate is within 15% of the tracker's peak for every size and setting. Then the check
against a GPU, judged on what it must hold (the peak with the allocator's margin, the CUDA context, NCCL's buffers and
cuBLAS's workspace): over the GPU switches activation checkpointing on, or refuses with the numbers and the terms."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raytrain_eks.train.memory import GIB, DoesNotFit, check_fit, estimate, refuse_unless_fits, shape_from_config


def _qwen2(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, layers: int) -> dict[str, int]:
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        num_hidden_layers=layers,
    )


# Qwen2.5-1.5B itself (its public config.json, KNOWN_CONFIGS: 28 layers, about 10 s a setting under the tracker),
# Qwen2.5-0.5B's widths with fewer layers, and a mid size.
SHAPES = {
    "qwen2.5-1.5b": _qwen2(1536, 8960, 12, 2, 151936, 28),
    "qwen2.5-0.5b-widths-6-layers": _qwen2(896, 4864, 14, 2, 151936, 6),
    "qwen2-mid-8-layers": _qwen2(1024, 2816, 16, 4, 32000, 8),
}
# The LoRA check's sizes: its accounting per layer, at a few layers (the frozen base adds nothing per layer to learn).
LORA_SHAPES = {
    "qwen2.5-1.5b-widths-4-layers": _qwen2(1536, 8960, 12, 2, 151936, 4),
    "qwen2.5-0.5b-widths-6-layers": SHAPES["qwen2.5-0.5b-widths-6-layers"],
}


@pytest.fixture(scope="module")
def fake_group():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (8,))
    finally:
        dist.destroy_process_group()


def _tracked_peak(config, mesh, *, seq_len: int, checkpointing: bool, lora=None, attention: str = "sdpa") -> int:
    """The FSDP2 memory tracker's peak over the forward, loss and backward of a second training step (the first,
    untracked, creates AdamW's moments, which the tracker then counts). The optimizer's step is left out: under fake
    tensors the fused kernel's decomposition allocates what the CUDA kernel does not. With ``lora`` the job's own
    adapters go in first (on the meta device: peft cannot move fake tensors), and the model gets fake storage.
    ``attention`` is the attention implementation transformers builds the model with."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import AutoModelForCausalLM

    from raytrain_eks.train.lora import apply_lora
    from raytrain_eks.train.model import checkpoint_activations, chunked_cross_entropy, output_projection_deferred
    from raytrain_eks.train.sharding import apply_fsdp

    adapted = None
    if lora is not None:
        with torch.device("meta"):
            adapted = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        apply_lora(adapted, lora)
    with FakeTensorMode(allow_non_fake_inputs=lora is not None):
        if adapted is None:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        else:
            model = adapted
            model.to_empty(device="cpu")
            model.tie_weights()  # storage swapped in one parameter at a time unties them
            assert model.lm_head.weight is model.model.embed_tokens.weight
        model.config.use_cache = False
        if checkpointing:
            checkpoint_activations(model)
        model.train()
        apply_fsdp(model, precision="bf16", mesh=mesh)
        weight = output_projection_deferred(model)
        trainable = [p for p in model.parameters() if p.requires_grad]  # as the job's optimizer takes them
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)  # fused, as on a GPU
        ids = torch.randint(0, config.vocab_size, (1, seq_len))

        def forward_and_backward():
            chunked_cross_entropy(model(input_ids=ids).logits[:, :-1], weight(), ids[:, 1:]).backward()

        forward_and_backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((ids,))
        with tracker:
            forward_and_backward()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        return peak["Total"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_estimate_is_within_15_percent_of_torchs_fsdp2_memory_tracker(fake_group, name, checkpointing):
    from transformers import Qwen2Config

    config = Qwen2Config(tie_word_embeddings=True, **SHAPES[name])
    tracked = _tracked_peak(config, fake_group, seq_len=2048, checkpointing=checkpointing)
    est = estimate(
        shape_from_config(name, config),
        shard_ranks=8,
        precision="bf16",
        micro_batch=1,
        seq_len=2048,
        activation_checkpointing=checkpointing,
    )
    assert est.peak_bytes == pytest.approx(tracked, rel=0.15), (est.parts, tracked / GIB)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
@pytest.mark.parametrize("name", ["qwen2.5-0.5b-widths-6-layers", "qwen2-mid-8-layers"])
def test_eager_attentions_matrices_are_in_the_estimate(fake_group, name, checkpointing):
    # training.attention: eager keeps every layer's seq x seq attention matrices for backward (SDPA keeps none):
    # at seq 2048 that is gigabytes the SDPA estimate would miss.
    from transformers import Qwen2Config

    config = Qwen2Config(tie_word_embeddings=True, **SHAPES[name])
    tracked = _tracked_peak(config, fake_group, seq_len=2048, checkpointing=checkpointing, attention="eager")
    common = dict(shard_ranks=8, precision="bf16", micro_batch=1, seq_len=2048, activation_checkpointing=checkpointing)
    shape = shape_from_config(name, config)
    est = estimate(shape, attention="eager", **common)
    assert est.peak_bytes == pytest.approx(tracked, rel=0.15), (est.parts, tracked / GIB)
    assert est.settings["attention"] == "eager"
    if not checkpointing:  # each layer keeps 1 x 2048 x 2048 x heads in fp32 and bf16
        assert est.parts["eager attention's matrices"] == shape.layers * shape.heads * 2048 * 2048 * 6
        assert est.peak_bytes > estimate(shape, **common).peak_bytes + GIB


# Every LoRA shape without activation checkpointing; with it, one (the widths of the model the tool is planned for).
LORA_CASES = [(name, False) for name in LORA_SHAPES] + [("qwen2.5-1.5b-widths-4-layers", True)]


@pytest.mark.parametrize(("name", "checkpointing"), LORA_CASES, ids=[f"{n}-ac-{c}" for n, c in LORA_CASES])
def test_the_lora_estimate_is_within_15_percent_of_torchs_fsdp2_memory_tracker(fake_group, name, checkpointing):
    # LoRA on every linear layer of the blocks, rank 16, dropout on: the frozen base keeps its weights (sharded) but
    # has no gradients and no moments; the adapters keep their dropped-out inputs. With activation checkpointing the
    # activations are small and the loss's forward chunk (no projection gradient to outweigh it) decides the peak.
    from transformers import Qwen2Config

    from raytrain_eks.config import LoraSettings
    from raytrain_eks.train.memory import LOSS_CHUNK_LOGITS, lora_params, loss_bytes

    config = Qwen2Config(tie_word_embeddings=True, **LORA_SHAPES[name])
    lora = LoraSettings()
    tracked = _tracked_peak(config, fake_group, seq_len=2048, checkpointing=checkpointing, lora=lora)
    common = dict(shard_ranks=8, precision="bf16", micro_batch=1, seq_len=2048, activation_checkpointing=checkpointing)
    base = shape_from_config(name, config)
    est = estimate(base, lora=lora, **common)
    assert est.peak_bytes == pytest.approx(tracked, rel=0.15), (est.parts, tracked / GIB)
    full = estimate(base, **common)
    moments = "AdamW moments (fp32, sharded)"
    assert est.parts[moments] == 8 * lora_params(base, lora) // 8 < full.parts[moments] / 10
    # The forward's chunk: bf16 logits, their fp32 copy and fp32 log-probabilities (10 bytes a logit), 4 bytes a
    # logit more than the backward's chunk that was counted before; no projection gradient.
    chunk = LOSS_CHUNK_LOGITS // base.vocab * base.vocab
    lora_loss = loss_bytes(base, tokens=2048, compute_bytes=2, projection_grad=False)
    assert lora_loss == 10 * chunk < loss_bytes(base, tokens=2048, compute_bytes=2)
    assert est.parts.get("loss", lora_loss) == lora_loss
    assert est.peak_bytes < full.peak_bytes


def test_the_reference_model_at_seq_2048_is_checked_against_an_l4(fake_group):
    from transformers import Qwen2Config

    from raytrain_eks.train.memory import KNOWN_CONFIGS

    known = dict(KNOWN_CONFIGS["Qwen/Qwen2.5-1.5B"])
    config = Qwen2Config(**{k: v for k, v in known.items() if k != "model_type"})
    shape = shape_from_config("Qwen/Qwen2.5-1.5B", config)
    assert 1.5e9 < shape.params < 1.6e9  # 1.54 B with the tied embedding
    l4 = 22888 * 2**20
    common = dict(gpu_bytes=l4, gpu_name="L4", shard_ranks=8, precision="bf16", seq_len=2048)
    fits = check_fit(shape, micro_batch=1, activation_checkpointing=False, **common)
    assert fits.fits and not fits.switched_on, fits.line
    # Four packed sequences of 2048 per micro-batch: too many activations for an L4 without checkpointing.
    switched = check_fit(shape, micro_batch=4, activation_checkpointing=False, **common)
    assert switched.fits and switched.switched_on and switched.checkpointing
    assert "activation checkpointing switched on" in switched.line
    # On one GPU with no sharding the weights and AdamW alone are 17 GiB: refused, with the numbers.
    alone = check_fit(shape, micro_batch=1, activation_checkpointing=False, **{**common, "shard_ranks": 1})
    assert not alone.fits
    with pytest.raises(DoesNotFit) as info:
        refuse_unless_fits(alone)
    assert info.value.exit_code == 2
    assert "Qwen/Qwen2.5-1.5B does not fit" in info.value.message and "over the 22.4 GiB L4" in info.value.message
    assert "training.batch_size" in (info.value.hint or "")


def test_the_known_shapes_are_the_counts_of_their_public_configs():
    from transformers import AutoConfig

    from raytrain_eks.train.memory import KNOWN_CONFIGS, KNOWN_SHAPES

    assert set(KNOWN_SHAPES) == set(KNOWN_CONFIGS)
    for name, known in KNOWN_CONFIGS.items():
        fields = dict(known)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        assert shape_from_config(name, config) == KNOWN_SHAPES[name]


def _plan_memory(cfg_for, **environ):
    from raytrain_eks.deploy.plan import JOB_CONFIG_FILE
    from raytrain_eks.eks.plan import build_plan

    plan = build_plan(cfg_for(MODEL_ID="Qwen/Qwen2.5-1.5B", GPU_NODE_COUNT="2", **environ))
    job = plan.files[JOB_CONFIG_FILE][0]["data"]
    return plan.summary["memory_per_gpu"], yaml_load(next(iter(job.values())))["training"]


def yaml_load(text):
    import yaml

    return yaml.safe_load(text)


def test_plan_shows_the_estimate_switches_checkpointing_on_where_it_must_and_refuses_what_cannot_fit(cfg_for, tmp_path):
    from raytrain_eks.eks.plan import write_plan

    # The reference on 2 x g6.12xlarge (8 L4s, HSDP: 4 ranks shard each parameter), seq 1024 x 2: fits as it is.
    memory, training = _plan_memory(cfg_for)
    assert memory["gpu_gib"] == 22.4 and 8 < memory["peak_gib"] < 0.85 * 22.4
    assert memory["settings"]["shard_ranks"] == 4 and memory["settings"]["precision"] == "bf16"
    assert not memory["activation_checkpointing_switched_on"] and training["activation_checkpointing"] is False
    assert memory["line"].startswith("memory: about ") and memory["line"].endswith("of 22.4 GiB L4")
    # Eight sequences of 2048: the activations alone are over 85% of an L4, so the job gets checkpointing.
    memory, training = _plan_memory(cfg_for, SEQ_LEN="2048", BATCH_SIZE="8")
    assert memory["activation_checkpointing_switched_on"] and training["activation_checkpointing"] is True
    assert "activation checkpointing switched on (without it " in memory["line"] and "over the GPU)" in memory["line"]
    # 32 sequences of 32768 tokens do not fit even so: refused with the numbers, and nothing is written.
    cfg = cfg_for(MODEL_ID="Qwen/Qwen2.5-1.5B", SEQ_LEN="32768", BATCH_SIZE="32")
    with pytest.raises(DoesNotFit) as info:
        write_plan(cfg, tmp_path / "out")
    assert "Qwen/Qwen2.5-1.5B does not fit" in info.value.message and "even with activation checkpointing" in (
        info.value.message
    )
    assert not (tmp_path / "out").exists()


def test_plan_counts_flash_attention_under_auto_where_the_image_ships_it(cfg_for, tmp_path):
    # Gemma 2 has no sdpa path: under auto the job runs it eager unless it chooses flash-attention, which it does on a
    # bf16 CUDA run where flash-attn is installed. The default image ships flash-attn 2.8.3 (its build lock), so the
    # plan counts no attention matrices there; for an image this tool does not know it counts eager's, and a long
    # sequence that fits with flash-attention is refused, naming the matrices and how to avoid them.
    from transformers import Gemma2Config

    from raytrain_eks.config import load_config
    from raytrain_eks.eks.plan import build_plan

    model = tmp_path / "gemma2"
    Gemma2Config(
        num_hidden_layers=4, hidden_size=2048, intermediate_size=4096, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=32000,
    ).save_pretrained(model)  # fmt: skip
    settings = dict(MODEL_ID=str(model), SEQ_LEN="8192", BATCH_SIZE="1", GPU_NODE_COUNT="2")
    memory = build_plan(cfg_for(**settings)).summary["memory_per_gpu"]
    assert memory["settings"]["attention"] == "flash_attention_2"
    assert "eager attention's matrices" not in memory["parts_gib"] and memory["peak_gib"] < 0.85 * 22.4
    with pytest.raises(DoesNotFit) as info:
        build_plan(cfg_for(**settings, DLC_IMAGE="registry.example.com/ray:custom"))
    assert "eager attention's matrices 24.0" in info.value.message  # 4 layers x 32 heads x 8192^2 x 6 bytes
    assert "flash-attention keeps none: training.attention flash_attention_2 (or auto)" in info.value.hint
    # fp32 rules flash-attention out: the default image's plan counts the matrices too (4 bytes an entry), and the
    # refusal says why flash-attention does not apply.
    with pytest.raises(DoesNotFit) as info:
        build_plan(load_config(environ=settings, sets=["training.precision=fp32"]))
    assert "eager attention's matrices 16.0" in info.value.message
    assert info.value.hint.endswith("This run computes in fp32 (training.precision).")


def test_a_model_whose_shape_is_unknown_here_is_planned_with_a_note(cfg_for):
    from raytrain_eks.eks.plan import build_plan

    plan = build_plan(cfg_for(MODEL_ID="example-org/not-on-this-machine"))
    assert plan.summary["memory_per_gpu"] is None
    assert any(
        a.startswith("No memory estimate: the shape of example-org/not-on-this-machine") for a in plan.assumptions
    )


def test_a_run_on_a_gpu_checks_its_own_devices_memory_from_the_models_config(builtin_model):
    from raytrain_eks.config import BUILTIN_MODEL, TrainingConfig
    from raytrain_eks.train.memory import check_run
    from raytrain_eks.train.sharding import choose_sharding

    layout = choose_sharding("auto", ["node-a"] * 2 + ["node-b"] * 2, "bf16")  # HSDP: 2 ranks shard each parameter
    training = TrainingConfig(model_id=BUILTIN_MODEL, seq_len=256, batch_size=4)
    roomy = check_run(builtin_model, training, layout=layout, precision="bf16", gpu_bytes=24 * GIB, gpu_name="L4")
    assert roomy.fits and not roomy.switched_on and roomy.estimate.settings["shard_ranks"] == 2
    assert roomy.line.startswith("memory: about ") and " MiB per GPU" in roomy.line
    # The same run on a device with a fifth of its no-checkpointing peak: even checkpointing cannot make it fit.
    tight = check_run(
        builtin_model, training, layout=layout, precision="bf16", gpu_bytes=roomy.estimate.peak_bytes // 5, gpu_name="x"
    )
    assert not tight.fits
    with pytest.raises(DoesNotFit, match=f"{BUILTIN_MODEL} does not fit"):
        refuse_unless_fits(tight)


def test_config_show_prints_the_estimate_for_the_configured_gpus(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from raytrain_eks.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODEL_ID", "Qwen/Qwen2.5-1.5B")
    result = CliRunner().invoke(app, ["config", "show"])
    assert result.exit_code == 0, result.output
    assert "# memory: about " in result.output and "of 22.4 GiB L4" in result.output


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_gradient_accumulation_keeps_the_gradients_sharded(fake_group, mode):
    """Between micro-batches each rank holds its shard of the running gradient sum, never the whole gradient: the
    tracker sees no unsharded gradient after the first micro-batch's backward, and the sharded gradients are 4
    bytes per parameter over the ranks that shard it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, Qwen2Config

    from raytrain_eks.train.model import chunked_cross_entropy, output_projection_deferred
    from raytrain_eks.train.sharding import MESH_DIMS, apply_fsdp, set_gradient_sync

    mesh = fake_group if mode == "fsdp" else init_device_mesh("cpu", (2, 4), mesh_dim_names=MESH_DIMS)
    config = Qwen2Config(tie_word_embeddings=True, **{**SHAPES["qwen2-mid-8-layers"], "num_hidden_layers": 4})
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config)
        model.config.use_cache = False
        apply_fsdp(model, precision="bf16", mesh=mesh)
        weight = output_projection_deferred(model)
        params = sum(p.numel() for p in model.parameters())
        tracker = FSDPMemTracker(model, None)
        ids = torch.randint(0, config.vocab_size, (1, 512))
        with tracker:
            set_gradient_sync(model, mode, last=False)  # the first of two micro-batches
            chunked_cross_entropy(weight.forward(model, input_ids=ids).logits[:, :-1], weight(), ids[:, 1:]).backward()
            held = tracker.get_tracker_snapshot("current")
    (now,) = held.values()
    shard = 8 if mode == "fsdp" else 4
    by_name = {str(k).split(".")[-1]: v for k, v in now.items()}
    assert by_name["UNSHARDED_GRAD"] == 0
    # FSDP's sharded gradients; HSDP's reduce-scattered sum waits in FSDP's partial-reduction buffer (a temporary
    # to the tracker) until the last micro-batch's all-reduce across nodes.
    held_grads = by_name["SHARDED_GRAD"] + by_name["TEMP"]
    assert held_grads == pytest.approx(4 * params / shard, rel=0.01)


def test_auto_counts_the_models_own_attention_and_a_gpu_run_what_its_ranks_chose():
    # Gemma 2 has no sdpa path in transformers: left to itself (training.attention auto without flash-attention) it
    # runs eager and keeps each layer's attention matrices; Qwen2 runs sdpa and keeps none. A run on a GPU knows
    # what its ranks chose (flash-attention where it is installed) and counts that.
    from transformers import Gemma2Config, Qwen2Config

    from raytrain_eks.config import TrainingConfig
    from raytrain_eks.train.memory import check_training

    small = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    gemma = shape_from_config("gemma2", Gemma2Config(num_hidden_layers=2, head_dim=64, **small))
    qwen = shape_from_config("qwen2", Qwen2Config(num_hidden_layers=2, **small))
    assert (gemma.default_attention, qwen.default_attention) == ("eager", "sdpa")
    training = TrainingConfig(seq_len=2048, batch_size=1)  # attention: auto
    common = dict(shard_ranks=8, precision="bf16", gpu_bytes=80 * GIB, gpu_name="H100")
    matrices = "eager attention's matrices"
    auto = check_training(gemma, training, **common).estimate
    assert auto.settings["attention"] == "eager" and auto.parts[matrices] == 2 * 4 * 2048 * 2048 * 6
    assert matrices not in check_training(qwen, training, **common).estimate.parts
    flash = check_training(gemma, training, attention="flash_attention_2", **common).estimate
    assert matrices not in flash.parts and flash.peak_bytes < auto.peak_bytes
    eager = TrainingConfig(seq_len=2048, batch_size=1, attention="eager")
    assert matrices in check_training(qwen, eager, **common).estimate.parts
    # Refused with the matrices counted: the hint names the attention that keeps none.
    tight = check_training(gemma, training, **{**common, "gpu_bytes": auto.peak_bytes // 4})
    with pytest.raises(DoesNotFit) as info:
        refuse_unless_fits(tight)
    assert "GiB of attention matrices here; flash-attention keeps none: training.attention flash_attention_2" in (
        info.value.hint
    )
    assert "fp32" not in info.value.hint
