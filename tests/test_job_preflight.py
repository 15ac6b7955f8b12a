"""``submit``'s checks of the job's own configuration, before anything is applied, and what its ConfigMap ships: a
``training.chat_template`` file travels as its text (the head pod has no copy of the file, and the job reads the
text with no file there); LoRA ``target_modules`` the model does not have, and under ``--offline`` a Hub model id or
``hf:`` data, are one message each with nothing applied.

Against the fakes of test_deploy.py (``World``: FakeKube, FakeTools, FakeRay), with S3 on moto's server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from test_deploy import TOKEN, World

from raytrain_eks.config import Config, load_config
from raytrain_eks.deploy import submit as sub
from raytrain_eks.errors import DataError, UserError
from raytrain_eks.k8s import manifests as m
from raytrain_eks.k8s.state import apply_state
from raytrain_eks.train.launch import with_chat_template_text

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aws_env: str) -> World:
    monkeypatch.chdir(tmp_path)  # no raytrain-eks.yaml of the repository is read
    return World(tmp_path, load_config(environ={}, path=None))


@pytest.fixture
def ready(world: World) -> World:
    world.up()
    world.lines.clear()
    return world


def _with(w: World, *sets: str) -> Config:
    """The deployment's configuration with ``sets`` (``--set`` items), as the commands give it to submit."""
    return apply_state(load_config(environ={}, path=None, sets=list(sets)), w.store)


def _nothing_applied(w: World, cfg: Config, raised: type[Exception], match: str) -> pytest.ExceptionInfo:
    before = (len(w.kube.applied), len(w.kube.exec_calls), len(w.store.created))
    with pytest.raises(raised, match=match) as err:
        sub.submit(dataclasses.replace(w.d, cfg=cfg), hf_token=TOKEN)
    assert (len(w.kube.applied), len(w.kube.exec_calls), len(w.store.created)) == before
    assert w.ray.submitted == []
    return err


def test_a_chat_template_file_travels_as_its_text_and_the_job_reads_it_with_no_file(ready: World, tmp_path: Path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    result = sub.submit(dataclasses.replace(ready.d, cfg=_with(ready, f"training.chat_template={template}")))
    assert result.exit_code == 0
    cfg = ready.d.cfg
    shipped = ready.kube.get("v1", "ConfigMap", m.config_map_name(cfg), cfg.ray.namespace)["data"][m.CONFIG_FILE]
    assert yaml.safe_load(shipped)["training"]["chat_template"] == TEMPLATE
    # In the head pod: the mounted file is the job's config (train --config), and the template file is not there.
    template.unlink()
    mounted = tmp_path / "pod" / m.CONFIG_FILE
    mounted.parent.mkdir()
    mounted.write_text(shipped)
    job = with_chat_template_text(load_config(environ={}, path=mounted))
    assert job.training.chat_template == TEMPLATE


def test_what_the_job_would_meet_in_the_head_pod_stops_submit_before_anything(ready: World, tmp_path: Path):
    # A chat template file that cannot be read.
    missing = tmp_path / "nowhere.jinja"
    err = _nothing_applied(
        ready, _with(ready, f"training.chat_template={missing}"), DataError, "cannot read the template file"
    )
    assert str(missing) in err.value.message
    # LoRA layers the model does not have, named with the linear layers it has.
    cfg = _with(ready, "training.method=lora", "training.lora.target_modules=[q_proj, qkv, c_attn]")
    err = _nothing_applied(ready, cfg, UserError, r"'qkv', 'c_attn' match no linear layer of Qwen/Qwen2.5-1.5B")
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in err.value.message
    # --offline with the default model (a Hub id) and a Hub dataset: both in one message, pointing at stage-model.
    cfg = _with(ready, "ray.offline=true", "training.data=hf:tatsu-lab/alpaca")
    err = _nothing_applied(ready, cfg, UserError, "--offline")
    said = err.value.message
    assert "training.model_id 'Qwen/Qwen2.5-1.5B' is a Hub model" in said
    assert "training.data 'hf:tatsu-lab/alpaca' is a Hub dataset" in said
    assert "raytrain-eks stage-model" in (err.value.hint or "")


@pytest.mark.parametrize(
    "sets",
    [
        ["training.model_id=s3://team-models/Qwen2.5-1.5B"],  # staged by stage-model
        ["training.model_id=/mnt/shared/models/Qwen2.5-1.5B", "training.data=hf:/mnt/shared/alpaca"],  # the volume
        ["training.model_id=builtin:tiny-qwen2"],
    ],
)
def test_offline_takes_models_and_data_no_node_downloads_from_the_hub(sets: list[str]):
    cfg = load_config(environ={}, path=None, sets=["ray.offline=true", *sets])
    assert sub.job_config(cfg) == cfg
    # The same model from the Hub is refused: the check is about where the files come from.
    hub = load_config(environ={}, path=None, sets=["ray.offline=true", *sets[1:]])
    with pytest.raises(UserError, match="is a Hub model"):
        sub.job_config(hub)
