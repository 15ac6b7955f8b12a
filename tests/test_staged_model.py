"""Models staged where every node reads them (``raytrain-eks stage-model``), in moto's S3: what is copied, the
manifest written last, and each node's copy made once per staging. The training run that reads a staged model
end to end is in test_s3_storage.py."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from raytrain_eks.cli import main
from raytrain_eks.errors import UserError
from raytrain_eks.train import staged
from raytrain_eks.train.model_source import check_model, resolve_model_path

BUCKET = "staged-models"


@pytest.fixture
def bucket(aws_env: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> object:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv(staged.CACHE_ENV, str(tmp_path / "cache"))
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    return s3


def _model_folder(tmp_path: Path) -> Path:
    source = Path(resolve_model_path("builtin:tiny-qwen2"))
    folder = tmp_path / "my-model"
    folder.mkdir()
    for f in source.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "README.md").write_text("not needed to load the model\n")
    (folder / "pytorch_model.bin").write_bytes(b"an older copy of the same weights")
    return folder


def test_a_staged_folder_holds_the_model_files_and_its_manifest_and_loads(bucket, tmp_path, capsys):
    folder = _model_folder(tmp_path)
    main(["stage-model", str(folder), "--to", f"s3://{BUCKET}/models"])
    uri = f"s3://{BUCKET}/models/my-model"
    assert f"model: {uri}" in capsys.readouterr().out
    keys = {o["Key"].removeprefix("models/my-model/") for o in bucket.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert {"config.json", "model.safetensors", staged.MANIFEST} <= keys
    assert "README.md" not in keys and "pytorch_model.bin" not in keys
    manifest = json.loads(bucket.get_object(Bucket=BUCKET, Key=f"models/my-model/{staged.MANIFEST}")["Body"].read())
    assert sorted(e["path"] for e in manifest["files"]) == sorted(keys - {staged.MANIFEST})
    local = resolve_model_path(uri)
    assert Path(local).parent == tmp_path / "cache"
    assert check_model(local).model_type == "qwen2"
    # Again: the node's copy is used as it is (nothing read but the manifest).
    (Path(local) / "marker").write_text("kept")
    assert resolve_model_path(uri) == local and (Path(local) / "marker").exists()
    # Staged again (another staging, another manifest): a new copy.
    main(["stage-model", str(folder), "--to", f"s3://{BUCKET}/models"])
    assert resolve_model_path(uri) != local


def test_a_location_without_a_staged_model_is_one_message(bucket, tmp_path):
    bucket.put_object(Bucket=BUCKET, Key="models/half/config.json", Body=b"{}")  # a copy that broke off
    with pytest.raises(UserError, match="not a staged model") as err:
        resolve_model_path(f"s3://{BUCKET}/models/half")
    assert "raytrain-eks stage-model" in (err.value.hint or "")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="not a Hugging Face model folder"):
        staged.stage_model(str(empty), f"s3://{BUCKET}/models")
    assert "models/empty/" not in json.dumps(bucket.list_objects_v2(Bucket=BUCKET).get("Contents", []), default=str)


def test_a_destination_that_cannot_be_written_is_one_message(bucket, tmp_path):
    with pytest.raises(UserError, match="cannot write the model to s3://no-such-bucket/models/tiny-qwen2"):
        staged.stage_model("builtin:tiny-qwen2", "s3://no-such-bucket/models")
