"""Configuration: presets, the YAML file, env.sh variables and flags in order; every problem reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from raytrain_eks import presets
from raytrain_eks.cli import main
from raytrain_eks.config import Config, load_config
from raytrain_eks.config_layers import COMMAND_ENV_VARS, ENV_VARS
from raytrain_eks.errors import ConfigError


def test_reference_defaults_match_the_reference_deployment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ={})
    assert cfg.cluster.gpu_node_type == "g6.12xlarge"
    assert cfg.cluster.gpu_node_count == 2 and cfg.cluster.gpus_per_node == 4
    assert cfg.cluster.system_node_type == "m7i.xlarge"
    assert cfg.ray.image == "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
    assert cfg.network.env == {
        "FI_PROVIDER": "efa",
        "NCCL_NET_PLUGIN": "ofi",
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_DEBUG": "INFO",
    }
    assert cfg.training.model_id == "Qwen/Qwen2.5-1.5B"
    assert cfg.training.precision == "auto"  # bf16 on the reference's L4s, resolved by the workers
    assert (cfg.cluster.k8s_version, cfg.cluster.ami_family) == ("1.36", "AmazonLinux2023")  # the reference's
    d = cfg.derived
    assert (d.cluster_gpus, d.world_size, d.workers_per_node, d.ray_gpus_per_worker_pod) == (8, 8, 4, 4)


def test_derived_values_follow_one_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ={"GPUS_PER_NODE": "8", "GPU_NODE_COUNT": "3"})
    assert cfg.derived.ray_gpus_per_worker_pod == 8
    assert cfg.derived.world_size == 24
    cfg = load_config(environ={"NUM_WORKERS": "6"})
    assert cfg.derived.world_size == 6 and cfg.derived.workers_per_node == 3


def test_layers_apply_in_order_file_then_env_then_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raytrain-eks.yaml").write_text(
        yaml.safe_dump({"training": {"steps": 11, "seq_len": 64, "batch_size": 3}, "cluster": {"region": "us-west-2"}})
    )
    cfg = load_config(
        preset=presets.local_tiny(),
        environ={"SEQ_LEN": "96", "BATCH_SIZE": "5"},
        overrides={"training": {"batch_size": 7, "steps": None}},
    )
    assert cfg.training.steps == 11  # file (flag was None: not given)
    assert cfg.training.seq_len == 96  # env over file
    assert cfg.training.batch_size == 7  # flag over env
    assert cfg.cluster.region == "us-west-2"
    assert cfg.training.model_id == "builtin:tiny-qwen2"  # preset, untouched by the file


# Every variable the reference's scripts/env.sh sets, in its order (AWS_REGION and AWS_DEFAULT_REGION are copies of
# REGION that it exports for the AWS CLI; boto3 reads them itself).
REFERENCE_ENV_SH = [
    "CLUSTER_NAME", "REGION", "K8S_VERSION", "NODE_AMI_FAMILY", "AWS_REGION", "AWS_DEFAULT_REGION", "NAMESPACE",
    "ASSUME_YES", "SYSTEM_NODE_TYPE", "SYSTEM_NODE_COUNT", "GPU_NODE_TYPE", "GPU_NODE_COUNT", "GPUS_PER_NODE",
    "GPU_NODEGROUP_NAME", "GPU_AZ", "CAPACITY_RESERVATION_ID", "DLC_IMAGE", "KUBERAY_VERSION", "RAY_VERSION",
    "RAY_CLUSTER_NAME", "NVIDIA_DEVICE_PLUGIN_VERSION", "EFA_DEVICE_PLUGIN_VERSION", "MODEL_ID", "STEPS", "SEQ_LEN",
    "BATCH_SIZE", "LEARNING_RATE", "NUM_WORKERS", "BENCH_STEPS", "BENCH_WARMUP_STEPS",
]  # fmt: skip


def test_no_variable_of_the_reference_env_sh_is_ignored():
    aliases = {"AWS_REGION", "AWS_DEFAULT_REGION"}
    ignored = [n for n in REFERENCE_ENV_SH if n not in ENV_VARS and n not in COMMAND_ENV_VARS and n not in aliases]
    assert ignored == []


def test_every_env_var_of_the_reference_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    values = {
        "CLUSTER_NAME": "c1",
        "REGION": "eu-west-1",
        "K8S_VERSION": "1.32",
        "NODE_AMI_FAMILY": "Bottlerocket",
        "CAPACITY_RESERVATION_ID": "cr-0123456789abcdef0",
        "SYSTEM_NODE_TYPE": "m7i.2xlarge",
        "SYSTEM_NODE_COUNT": "2",
        "GPU_NODE_TYPE": "p5.48xlarge",
        "GPU_NODE_COUNT": "4",
        "GPUS_PER_NODE": "8",
        "GPU_NODEGROUP_NAME": "gpus",
        "GPU_AZ": "eu-west-1b",
        "DLC_IMAGE": "example.com/ray/train:v2",
        "KUBERAY_VERSION": "1.6.0",
        "RAY_VERSION": "2.59.0",
        "NVIDIA_DEVICE_PLUGIN_VERSION": "0.19.0",
        "EFA_DEVICE_PLUGIN_VERSION": "v0.5.20",
        "NAMESPACE": "train",
        "RAY_CLUSTER_NAME": "rc",
        "MODEL_ID": "Qwen/Qwen2.5-0.5B",
        "STEPS": "9",
        "SEQ_LEN": "512",
        "BATCH_SIZE": "4",
        "LEARNING_RATE": "0.0001",
        "NUM_WORKERS": "16",
        "CHECKPOINT_EVERY": "25",
        "KEEP_CHECKPOINTS": "3",
        "STORAGE_PATH": "s3://bucket/runs",
        "CHECKPOINT_BUCKET": "team-checkpoints",
        "STORAGE_SHARED": "True",
        "BENCH_STEPS": "40",
        "BENCH_WARMUP_STEPS": "5",
    }
    assert set(values) == set(ENV_VARS)
    cfg = load_config(environ=values)
    for name, (section, field) in ENV_VARS.items():
        got = getattr(getattr(cfg, section), field)
        assert str(got) == values[name] or got == type(got)(values[name]), name


def test_all_problems_reported_at_once_with_field_value_and_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raytrain-eks.yaml").write_text("training:\n  batch_size: 0\n  optimiser: adam\n")
    with pytest.raises(ConfigError) as info:
        load_config(environ={"STEPS": "-3", "SEQ_LEN": "abc", "REGION": "mars-1", "DLC_IMAGE": "not an image"})
    problems = info.value.problems
    text = "\n".join(problems)
    assert len(problems) == 6, text
    assert "training.steps = '-3' (from environment variable STEPS)" in text
    assert "training.seq_len = 'abc' (from environment variable SEQ_LEN)" in text
    assert "cluster.region = 'mars-1' (from environment variable REGION): allowed: an AWS region" in text
    assert "ray.image = 'not an image'" in text
    assert "training.batch_size = 0 (from raytrain-eks.yaml)" in text
    assert "training.optimiser" in text and "unknown setting; allowed here: model_id" in text


def test_ami_family_is_one_eksctl_knows_and_has_an_image_for_the_version(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(environ={"NODE_AMI_FAMILY": "Bottlerocket"}).cluster.ami_family == "Bottlerocket"
    with pytest.raises(ConfigError) as info:
        load_config(environ={"NODE_AMI_FAMILY": "WindowsServer2022CoreContainer"})
    assert "cluster.ami_family = 'WindowsServer2022CoreContainer' (from environment variable NODE_AMI_FAMILY)" in str(
        info.value
    )
    with pytest.raises(ConfigError, match="ami_family 'AmazonLinux2' has no EKS AMI for k8s_version 1.36"):
        load_config(environ={"NODE_AMI_FAMILY": "AmazonLinux2"})
    assert load_config(environ={"NODE_AMI_FAMILY": "AmazonLinux2", "K8S_VERSION": "1.32"}).cluster.ami_family


def test_cross_field_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(environ={"GPU_AZ": "us-west-2a", "STEPS": "5"}, overrides={"training": {"warmup_steps": 9}})
    text = str(info.value)
    assert "gpu_az 'us-west-2a' is not in region 'us-east-1'" in text
    assert "(from environment variable GPU_AZ)" in text
    assert "warmup_steps (9) must not exceed steps (5)" in text


def test_optional_zone_and_reservation_empty_means_unset_and_a_bad_value_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(environ={"GPU_AZ": ""}, overrides={"cluster": {"capacity_reservation_id": ""}})
    assert (cfg.cluster.gpu_az, cfg.cluster.capacity_reservation_id) == (None, None)
    # As env.sh exports them when not set: empty is not set, where not set is allowed.
    empty = load_config(environ={"CAPACITY_RESERVATION_ID": "", "STORAGE_PATH": "", "BENCH_STEPS": ""})
    assert (empty.cluster.capacity_reservation_id, empty.training.storage_path) == (None, None)
    assert empty.fabric.compare_steps is None
    with pytest.raises(ConfigError) as info:
        load_config(
            environ={"GPU_AZ": "us-east-1"},
            overrides={"cluster": {"capacity_reservation_id": "cr-XYZ", "availability_zones": ["us-east-1a", "1b"]}},
        )
    text = "\n".join(info.value.problems)
    assert len(info.value.problems) == 3, text
    assert "cluster.gpu_az = 'us-east-1' (from environment variable GPU_AZ): allowed: an availability zone" in text
    assert "capacity_reservation_id = 'cr-XYZ' (from flag --capacity-reservation-id): allowed: a capacity" in text
    assert "allowed: availability zones such as us-east-1a" in text


def test_missing_explicit_file_and_bad_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="does not exist; create one with `raytrain-eks init"):
        load_config(path=tmp_path / "nope.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  steps: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(path=bad, environ={})
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path=bad, environ={})


def test_cli_bad_config_exits_2_with_message_and_no_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STEPS", "zero")
    monkeypatch.setenv("NUM_WORKERS", "-1")
    with pytest.raises(SystemExit) as info:
        main(["train"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert "Invalid configuration: 2 problems" in captured.err
    assert "training.steps = 'zero' (from environment variable STEPS)" in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "runs").exists(), "nothing may be created for a bad configuration"


def test_cli_bad_flag_value_names_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", "--data-format", "xml", "--steps", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "training.data_format = 'xml' (from flag --data-format)" in err
    assert "training.steps = 0 (from flag --steps)" in err


def test_init_writes_a_commented_file_that_loads_back(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["init"])
    text = (tmp_path / "raytrain-eks.yaml").read_text()
    assert "# env GPU_NODE_TYPE" in text and "# env STEPS" in text
    assert load_config(environ={}) == Config()
    with pytest.raises(SystemExit) as info:
        main(["init"])
    assert info.value.code == 1
    assert "already exists" in capsys.readouterr().err


def test_config_show_prints_resolved_yaml_and_env(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPU_NODE_COUNT", "3")
    main(["config", "show", "--preset", "reference"])
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["cluster"]["gpu_node_count"] == 3
    assert "world_size=12" in out
    main(["config", "show", "--env"])
    assert "export GPU_NODE_COUNT=3" in capsys.readouterr().out


def test_lora_trains_at_loras_learning_rate_unless_one_is_set(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lora = load_config(environ={}, sets=["training.method=lora"]).training
    assert lora.learning_rate == 2e-4 and lora.learning_rate_reason == "LoRA's default; full fine-tuning's is 2e-05"
    full = load_config(environ={}).training
    assert full.learning_rate == 2e-5 and full.learning_rate_reason == "full fine-tuning's default; LoRA's is 0.0002"
    # A preset's own rate is a set one (local-tiny's, tuned for its tiny model).
    tiny = load_config(preset=presets.local_tiny(), environ={}, sets=["training.method=lora"]).training
    assert tiny.learning_rate == 3e-3
    # A rate given in any layer is the one used, whatever the method; given empty, it is the method's again.
    (tmp_path / "raytrain-eks.yaml").write_text(yaml.safe_dump({"training": {"method": "lora", "learning_rate": 1e-3}}))
    assert load_config(environ={}).training.learning_rate == 1e-3
    assert load_config(environ={"LEARNING_RATE": "5e-4"}).training.learning_rate == 5e-4
    assert load_config(environ={"LEARNING_RATE": ""}).training.learning_rate == 2e-4
    kept = load_config(environ={}, sets=["training.learning_rate=2e-5"]).training
    assert kept.learning_rate == 2e-5 and kept.learning_rate_reason == "as set; LoRA's default is 0.0002"
    # A method that is refused is the one problem reported, not a learning rate that could not follow it.
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, sets=["training.method=qlora"])
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith("training.method = 'qlora'")


def test_init_leaves_the_learning_rate_to_the_method_and_config_show_says_which(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["init"])
    path = tmp_path / "raytrain-eks.yaml"
    written = yaml.safe_load(path.read_text())
    assert written["training"]["learning_rate"] is None
    written["training"]["method"] = "lora"  # the user's one edit
    path.write_text(yaml.safe_dump(written))
    capsys.readouterr()
    main(["config", "show"])
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["training"]["learning_rate"] == 2e-4
    assert "  learning_rate: 0.0002  # LoRA's default; full fine-tuning's is 2e-05\n" in out


def test_config_objects_are_immutable():
    cfg = Config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.training.steps = 5  # type: ignore[misc]
    assert cfg.training.steps == 100


def test_usage_errors_exit_2_without_traceback(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--no-such-flag"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "No such option: --no-such-flag" in err and "Traceback" not in err


def test_command_exit_codes_reach_the_shell(capsys):
    fixtures = Path(__file__).parent / "fixtures" / "nccl"
    with pytest.raises(SystemExit) as info:
        main(["verify-transport", str(fixtures / "socket_fallback_nccl2.27_kubectl.log")])
    assert info.value.code == 1
    main(["verify-transport", "--require", "efa", str(fixtures / "efa_2node_nccl2.29_ray.log")])
    assert "EFA" in capsys.readouterr().out


def test_the_config_file_comments_come_from_the_fields_own_descriptions():
    from raytrain_eks.config import Config
    from raytrain_eks.config_file import commented_yaml

    lines = commented_yaml(load_config(environ={}, path=None)).splitlines()
    described = [
        (section, name, info.description)
        for section, sinfo in Config.model_fields.items()
        for name, info in sinfo.annotation.model_fields.items()
        if info.description
    ]
    assert len(described) >= 25, "the settings carry their help"
    for section, name, description in described:
        start = lines.index(f"{section}:")
        at = lines.index(f"  {name}:", start) if f"  {name}:" in lines[start:] else None
        if at is None:  # a value on the same line
            at = next(i for i in range(start, len(lines)) if lines[i].startswith(f"  {name}: "))
        assert lines[at - 1].startswith("  # ") and lines[at - 1].endswith(description), (section, name)


def test_storage_for_several_nodes_must_reach_every_node(tmp_path, monkeypatch):
    from raytrain_eks.config import check_storage_for_nodes

    monkeypatch.chdir(tmp_path)

    def training(**over):
        return load_config(preset=presets.local_tiny(), environ={}, overrides={"training": over}).training

    # One node: any storage (the run folder included) is fine.
    check_storage_for_nodes(training(), 1, counted="test")
    # Several nodes: a remote URI, or a local path declared shared.
    check_storage_for_nodes(training(storage_path="s3://bucket/runs"), 2, counted="test")
    check_storage_for_nodes(training(storage_path="/mnt/efs/runs", storage_shared=True), 2, counted="test")
    for refused in (training(), training(storage_path="/data/runs"), training(storage_path="file:///data/runs")):
        with pytest.raises(ConfigError) as info:
            check_storage_for_nodes(refused, 3, counted="alive Ray nodes")
        assert info.value.exit_code == 2 and len(info.value.problems) == 1
        message = info.value.problems[0]
        assert f"training.storage_path = {refused.storage_path!r}" in message and "span 3 nodes" in message
        assert "s3://BUCKET/PREFIX" in message and "training.storage_shared: true" in message
    # The setting comes from the environment too; declaring "shared" without a path is refused.
    env = load_config(preset=presets.local_tiny(), environ={"STORAGE_PATH": "/mnt/x", "STORAGE_SHARED": "true"})
    assert env.training.storage_shared and env.training.storage_reaches_every_node
    with pytest.raises(ConfigError, match="storage_shared is true but storage_path is empty"):
        load_config(preset=presets.local_tiny(), environ={"STORAGE_SHARED": "true"})


def test_the_reference_cluster_counts_its_worker_nodes_for_storage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reference = load_config(preset=presets.reference(), environ={})
    assert reference.derived.worker_nodes == 2  # 2 x g6.12xlarge, one rank per GPU
    with pytest.raises(ConfigError, match="span 2 nodes"):
        reference.check_cluster_storage()
    load_config(preset=presets.reference(), environ={"STORAGE_PATH": "s3://b/p"}).check_cluster_storage()
    one = load_config(preset=presets.reference(), environ={"NUM_WORKERS": "1"})
    assert one.derived.worker_nodes == 1
    one.check_cluster_storage()


def test_set_reaches_any_setting_last_of_all_layers_and_names_itself_in_errors(tmp_path, monkeypatch):
    from raytrain_eks.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "raytrain-eks.yaml").write_text("training:\n  steps: 30\n  seq_len: 64\n")
    cfg = load_config(
        environ={"STEPS": "40"},
        overrides={"training": {"steps": 50}},
        sets=[
            "training.steps=60",
            "training.columns={instruction: question}",
            "cluster.gpu_node_count=4",
            "training.sample_prompts=[Hi, Bye]",
        ],
    )
    assert cfg.training.steps == 60 and cfg.training.seq_len == 64  # --set over flag, env and file; file kept
    assert cfg.training.columns == {"instruction": "question"} and cfg.cluster.gpu_node_count == 4
    assert cfg.training.sample_prompts == ["Hi", "Bye"]
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, sets=["training.stepz=7", "cluster.gpu_node_count=many"])
    text = str(info.value)
    assert "training.stepz (from --set training.stepz): unknown setting; allowed here: model_id" in text
    assert "cluster.gpu_node_count = 'many' (from --set cluster.gpu_node_count)" in text
    with pytest.raises(ConfigError, match=r"--set 'steps': write SECTION.FIELD=VALUE"):
        load_config(environ={}, sets=["steps"])
    with pytest.raises(ConfigError, match=r"training.steps is a value, not a section"):
        load_config(environ={}, sets=["training.steps.x=1"])


def test_csv_delimiter_is_one_character_the_csv_reader_splits_on(tmp_path, monkeypatch):
    # Semicolon- or pipe-separated exports set it; a value the CSV reader cannot split on is refused with the others,
    # naming the setting and how to write one, not when the data is read after Ray has started.
    monkeypatch.chdir(tmp_path)
    assert load_config(environ={}).training.csv_delimiter == ","
    assert load_config(environ={}, sets=["training.csv_delimiter=;"]).training.csv_delimiter == ";"
    (tmp_path / "raytrain-eks.yaml").write_text('training:\n  csv_delimiter: "\\t"\n')
    assert load_config(environ={}).training.csv_delimiter == "\t"
    allowed = """allowed: one ASCII character, not '"' or a line break; quote it in YAML: ';', '|', "\\t" (a tab)"""
    # A bare | starts a YAML block (an empty text here); \t outside double quotes is two characters.
    for written, value in (("';;'", ";;"), ("|", ""), ("\\t", "\\t"), ("'\"'", '"'), ('"\\n"', "\n"), ("§", "§")):
        (tmp_path / "raytrain-eks.yaml").write_text(f"training:\n  csv_delimiter: {written}\n")
        with pytest.raises(ConfigError) as info:
            load_config(environ={})
        assert info.value.problems == [f"training.csv_delimiter = {value!r} (from raytrain-eks.yaml): {allowed}"]


def test_plan_and_train_take_set(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from raytrain_eks.cli import app

    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(app, ["config", "show", "--set", "training.seq_len=96"])
    assert shown.exit_code == 0 and "seq_len: 96" in shown.output
    planned = CliRunner().invoke(app, ["plan", "--set", "cluster.gpu_node_count=3"], env={"COLUMNS": "200"})
    assert planned.exit_code == 0, planned.output
    assert "3 x g6.12xlarge" in planned.output
    bad = CliRunner().invoke(app, ["train", "--set", "training.steps=0"])
    # The app raises it; the installed command (raytrain_eks.cli.main) prints it and exits 2, before anything runs.
    assert getattr(bad.exception, "exit_code", None) == 2
    assert "training.steps = 0 (from --set training.steps)" in str(bad.exception)


@pytest.mark.parametrize(
    "name",
    [
        "chat-data-local.yaml",
        "sharegpt-local.yaml",
        "reference-cluster.yaml",
        "lora-local.yaml",
        "full-finetune-local.yaml",
    ],
)
def test_the_example_recipes_load_as_they_are(name, tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    path = Path(__file__).resolve().parents[1] / "examples" / name
    cfg = load_config(path=path, environ={})
    assert cfg.training.steps > 0
    if name == "reference-cluster.yaml":
        assert cfg.cluster.gpu_node_count == 2 and cfg.fabric.require == "efa" and cfg.training.sharding == "auto"
    if name == "lora-local.yaml":
        assert cfg.training.method == "lora" and cfg.training.lora.rank == 16
    if name == "full-finetune-local.yaml":
        assert cfg.training.method == "full" and cfg.training.data.startswith("hf:")


def test_one_lora_module_named_alone_is_the_list_of_that_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raytrain-eks.yaml").write_text("training:\n  lora:\n    target_modules: q_proj\n")
    assert load_config(environ={}).training.lora.target_modules == ["q_proj"]
    cfg = load_config(environ={}, sets=["training.lora.target_modules=v_proj"])
    assert cfg.training.lora.target_modules == ["v_proj"]
    assert load_config(environ={}, sets=["training.lora.target_modules=all-linear"]).training.lora.target_modules == (
        "all-linear"
    )
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, sets=["training.lora.target_modules=[q_proj, 3]"])
    assert info.value.problems == [
        "training.lora.target_modules = ['q_proj', 3] (from --set training.lora.target_modules): 3: a layer's name, "
        "such as q_proj"
    ]


def test_errors_show_the_given_value_and_its_source_at_any_depth(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raytrain-eks.yaml").write_text(
        "training:\n  lora:\n    rank: 0\n    target_modules: 7\n  sample_prompts: [Hi, 5]\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(environ={})
    text = "\n".join(info.value.problems)
    assert len(info.value.problems) == 3, text
    assert "training.lora.rank = 0 (from raytrain-eks.yaml): Input should be greater than or equal to 1" in text
    assert "training.lora.target_modules = 7 (from raytrain-eks.yaml): give a layer's name (q_proj)" in text
    assert "training.sample_prompts.1 = 5 (from raytrain-eks.yaml): Input should be a valid string" in text
    # A later layer that replaces a whole section takes the source of everything under it.
    (tmp_path / "raytrain-eks.yaml").write_text("training:\n  lora:\n    rank: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, sets=["training.lora={rank: -1}"])
    assert info.value.problems == [
        "training.lora.rank = -1 (from --set training.lora): Input should be greater than or equal to 1"
    ]
    # A mapping's key that is refused is the value shown.
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, sets=["network.env={1: x}"])
    assert info.value.problems == ["network.env.1 = 1 (from --set network.env): Input should be a valid string"]


def test_a_union_members_refusals_are_one_line_with_the_value_given():
    from typing import Literal

    from pydantic import BaseModel

    from raytrain_eks.config_layers import format_errors

    class Section(BaseModel):
        modules: list[str] | Literal["all-linear"]

    tree = {"training": {"modules": "q_proj"}}
    with pytest.raises(ValidationError) as info:
        Section.model_validate(tree["training"])
    errors = [{**e, "loc": ("training", *e["loc"])} for e in info.value.errors()]
    assert len(errors) == 2 and any("list[str]" in map(str, e["loc"]) for e in errors)  # pydantic names the members
    assert format_errors(errors, {("training",): "x.yaml"}, tree, Config) == [
        "training.modules = 'q_proj' (from x.yaml): Input should be a valid list; or Input should be 'all-linear'"
    ]


def test_gpu_tolerations_are_kubernetes_tolerations_passed_on_as_written(tmp_path, monkeypatch):
    from raytrain_eks.k8s import manifests

    monkeypatch.chdir(tmp_path)
    # A toleration as kubectl and the core/v1 schema take it: tolerationSeconds is an integer.
    (tmp_path / "raytrain-eks.yaml").write_text(
        "cluster:\n  gpu_tolerations:\n"
        "  - {key: nvidia.com/gpu, operator: Exists, effect: NoExecute, tolerationSeconds: 300}\n"
        "  - {key: team, value: ml, effect: NoSchedule}\n"
    )
    cfg = load_config(environ={})
    given = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        {"key": "team", "value": "ml", "effect": "NoSchedule"},
    ]
    assert manifests.gpu_tolerations(cfg) == given
    assert [list(t) for t in manifests.gpu_tolerations(cfg)] == [list(t) for t in given]  # the order written
    (tmp_path / "raytrain-eks.yaml").write_text(
        "cluster:\n  gpu_tolerations:\n"
        "  - {key: nvidia.com/gpu, operater: Exists, effect: NoSchedule}\n"
        "  - {key: a, operator: exists}\n"
        "  - {key: b, operator: Exists, effect: NoSchedule, tolerationSeconds: 60}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(environ={})
    (problem,) = info.value.problems
    assert problem.startswith("cluster.gpu_tolerations = [{'key': 'nvidia.com/gpu', 'operater': 'Exists'")
    assert "(from raytrain-eks.yaml): toleration 1: 'operater' is not a field of a toleration (its fields: key, " in (
        problem
    )
    assert "toleration 2: operator = 'exists': Input should be 'Exists' or 'Equal'" in problem
    assert "toleration 3: tolerationSeconds applies to effect NoExecute only" in problem
    with pytest.raises(ConfigError, match="toleration 1: an empty key .every taint. needs operator Exists"):
        load_config(environ={}, sets=["cluster.gpu_tolerations=[{value: x}]"])


def test_a_setting_the_target_would_ignore_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raytrain-eks.yaml").write_text("cluster:\n  target: kubernetes\n  existing: true\n")
    with pytest.raises(ConfigError) as info:
        load_config(environ={})
    assert info.value.problems == [
        "cluster (from raytrain-eks.yaml): cluster.existing applies to target eks (an EKS cluster up did not "
        "create); with target kubernetes the cluster is always yours and is never created or deleted: leave "
        "existing out (or false)"
    ]
    assert load_config(environ={}, sets=["cluster.target=eks"]).cluster.existing
    (tmp_path / "raytrain-eks.yaml").write_text("cluster:\n  kubeconfig: ~/.kube/other\n")
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, sets=["cluster.context=gpu"])
    (problem,) = info.value.problems
    assert problem.startswith("cluster (from --set cluster.context, raytrain-eks.yaml): cluster.kubeconfig and ")
    assert "cluster.context apply to target kubernetes; with target eks every step reaches the EKS cluster" in problem
    assert "set cluster.target to kubernetes" in problem
    cfg = load_config(environ={}, sets=["cluster.target=kubernetes"])
    assert (cfg.cluster.target, cfg.cluster.kubeconfig) == ("kubernetes", "~/.kube/other")
    # The command line's --kubeconfig is the same setting: refused on target eks before anything is made.
    (tmp_path / "raytrain-eks.yaml").unlink()
    with pytest.raises(SystemExit) as done:
        main(["status", "--kubeconfig", str(tmp_path / "kubeconfig")])
    assert done.value.code == 2
    assert "cluster.kubeconfig applies to target kubernetes" in capsys.readouterr().err
    assert not (tmp_path / ".raytrain-eks").exists()
