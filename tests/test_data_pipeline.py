"""The data pipeline on hand-made files: reading JSONL/JSON/Parquet, counting malformed rows, packing, and the
errors a user gets for unusable data before any worker starts. Small local data is prepared in the driver, larger
data by Ray Data's tasks: the tests that read rows run both ways (``where``), and both give the same packed blocks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raytrain_eks.train.data.pipeline as data_module
from raytrain_eks.errors import DataError
from raytrain_eks.train.builtin import sample_data_path
from raytrain_eks.train.data.encoding import IGNORE_INDEX
from raytrain_eks.train.data.json_reader import TOO_DEEP
from raytrain_eks.train.data.packing import block_documents
from raytrain_eks.train.data.pipeline import DataSettings, prepare_dataset, prepared_in_driver

pytestmark = pytest.mark.usefixtures("starts_ray")


def prep(path, builtin_model, fmt="instruction", seq_len=32, min_blocks=1, where=None, **kw):
    return prepare_dataset(
        DataSettings(
            data_format=fmt,
            text_field=kw.get("text_field", "text"),
            tokenizer_path=builtin_model,
            seq_len=seq_len,
            seed=kw.get("seed", 0),
            columns=kw.get("columns"),
            chat_template=kw.get("chat_template"),
        ),
        data=str(path),
        min_blocks=min_blocks,
        eval_fraction=kw.get("eval_fraction", 0.0),
        in_driver=None if where is None else where == "driver",
        listed=kw.get("listed"),
    )


@pytest.fixture(params=["driver", "ray"])
def where(request):
    return request.param


FIXTURES = Path(__file__).parent / "fixtures"


def trained_and_whole(tokenizer, prepared) -> tuple[str, str]:
    """The text of every trained token of the packed blocks, in order, and the text of all their tokens."""
    rows = prepared.dataset.take_all()
    ids = np.concatenate([r["input_ids"] for r in rows])
    labels = np.concatenate([r["labels"] for r in rows])
    return tokenizer.decode(labels[labels != IGNORE_INDEX].tolist()), tokenizer.decode(ids.tolist())


def blocks(dataset) -> np.ndarray:
    """The packed blocks, in order: input ids, labels, positions and the count of filled positions side by side."""
    rows = dataset.take_all()
    assert all(set(r) == {"input_ids", "labels", "position_ids", "filled"} for r in rows)
    return np.array([np.concatenate([r["input_ids"], r["labels"], r["position_ids"], [r["filled"]]]) for r in rows])


def test_driver_and_ray_data_pack_the_same_blocks(tmp_path, ray_local, builtin_model, monkeypatch):
    # Three packing groups (a group is PACK_ROWS rows; smaller here so a small file has several), malformed rows,
    # rows held out for evaluation: both paths give the same training and held-out blocks in the same order.
    monkeypatch.setattr(data_module, "PACK_ROWS", 150)
    lines = sample_data_path().read_text().splitlines()
    lines[7] = "{broken"
    lines[20] = json.dumps({"instruction": "no answer"})
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert prepared_in_driver([str(path)]), "a small local file is prepared in the driver by default"
    driver = prep(path, builtin_model, seq_len=64, where="driver", eval_fraction=0.05, seed=3)
    ray_data = prep(path, builtin_model, seq_len=64, where="ray", eval_fraction=0.05, seed=3)
    assert driver.describe("d", 64) == ray_data.describe("d", 64)
    assert (driver.usable_rows, driver.eval_rows, len(driver.malformed)) == (len(lines) - 2, 19, 2)
    assert driver.dataset.num_blocks() == ray_data.dataset.num_blocks() == 3
    assert np.array_equal(blocks(driver.dataset), blocks(ray_data.dataset))
    assert np.array_equal(blocks(driver.eval_dataset), blocks(ray_data.eval_dataset))
    other_seed = prep(path, builtin_model, seq_len=64, where="driver", eval_fraction=0.05, seed=4)
    assert not np.array_equal(blocks(other_seed.dataset), blocks(driver.dataset))


def test_a_sort_cut_into_many_small_tasks_packs_the_same_blocks(tmp_path, ray_local, builtin_model, monkeypatch):
    # Blocks of 8 KiB and at most 16 KiB of input per sort task (the defaults are 16 and 64 MiB): the sample's rows
    # go through many small sort tasks, and the packed blocks are still those the driver makes.
    import ray.data

    monkeypatch.setattr(data_module, "PIPELINE_BLOCK_BYTES", 8 << 10)
    monkeypatch.setattr(data_module, "SORT_BATCH_BYTES", 16 << 10)
    before = ray.data.DataContext.get_current().shuffle_input_batch_bytes
    ray_data = prep(sample_data_path(), builtin_model, seq_len=64, where="ray")
    assert ray_data.dataset.context.shuffle_input_batch_bytes == 16 << 10
    assert ray.data.DataContext.get_current().shuffle_input_batch_bytes == before, "the caller's setting is back"
    driver = prep(sample_data_path(), builtin_model, seq_len=64, where="driver")
    assert ray_data.dataset.num_blocks() > 1
    assert np.array_equal(blocks(driver.dataset), blocks(ray_data.dataset))


def test_large_or_remote_data_goes_through_ray_data(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl"
    path.write_text("{}\n" * 10)
    assert prepared_in_driver([str(path)])
    monkeypatch.setattr(data_module, "DRIVER_PREP_BYTES", 29)
    assert not prepared_in_driver([str(path)]), "30 bytes is over a 29-byte limit"
    assert not prepared_in_driver(["s3://bucket/a.jsonl"])


def test_jsonl_with_malformed_rows_is_counted_and_packed(tmp_path, ray_local, builtin_model, tokenizer, where):
    good = [{"instruction": f"What is {i} plus 1?", "output": f"{i + 1}."} for i in range(5)]
    lines = [json.dumps(r) for r in good] + [
        json.dumps({"instruction": "no answer"}),
        json.dumps({"instruction": "Q", "output": 7}),
        "{not json",
        "[" * 100_000 + "]" * 100_000,  # one hostile row: too deep to decode, it costs only itself
        "",
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    prepared = prep(path, builtin_model, where=where)
    assert (prepared.rows, prepared.usable_rows) == (9, 5)
    assert prepared.malformed == {
        "missing field 'output'": 1,
        "field 'output' is not a string": 1,
        "the line is not valid JSON": 1,
        TOO_DEEP: 1,
    }
    assert "4 malformed rows" in prepared.describe(str(path), 32)
    rows = prepared.dataset.take_all()
    assert len(rows) == prepared.blocks
    assert all(len(r["input_ids"]) == 32 for r in rows)
    # Every trained label is one of the answers' tokens: prompts are masked through the whole pipeline.
    trained = [int(t) for r in rows for t in r["labels"] if t != IGNORE_INDEX]
    assert len(trained) == prepared.trained_tokens
    text = tokenizer.decode(trained)
    for i in range(5):
        assert f"{i + 1}." in text
    assert "plus" not in text


def test_json_array_folder_and_chat_format(tmp_path, ray_local, builtin_model, where):
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
    ]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.json").write_text(json.dumps(rows))
    (tmp_path / "data" / "b.jsonl").write_text(json.dumps(rows[0]) + "\n")
    prepared = prep(tmp_path / "data", builtin_model, fmt="chat", where=where)
    assert (prepared.rows, prepared.usable_rows) == (3, 2)
    assert prepared.malformed == {"no assistant message to learn from": 1}


def test_sharegpt_data_and_renamed_columns_are_packed(tmp_path, ray_local, builtin_model, tokenizer, where):
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there."}]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(json.dumps({"conversations": turns}) + "\n" + json.dumps({"conversations": turns[:1]}) + "\n")
    prepared = prep(path, builtin_model, fmt="sharegpt", where=where)
    assert (prepared.rows, prepared.usable_rows) == (2, 1)
    assert prepared.malformed == {"no assistant message to learn from": 1}
    trained = [int(t) for r in prepared.dataset.take_all() for t in r["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "Hello there.<|im_end|>\n"
    # The user's own column names, mapped onto the instruction format's fields.
    mine = tmp_path / "qa.jsonl"
    mine.write_text("\n".join(json.dumps({"question": f"Q{i}?", "answer": f"A{i}."}) for i in range(3)) + "\n")
    columns = {"instruction": "question", "output": "answer"}
    prepared = prep(mine, builtin_model, where=where, columns=columns)
    assert (prepared.rows, prepared.usable_rows) == (3, 3)
    trained = [int(t) for r in prepared.dataset.take_all() for t in r["labels"] if t != IGNORE_INDEX]
    assert all(f"A{i}." in tokenizer.decode(trained) for i in range(3))


def test_parquet_text_format(tmp_path, ray_local, builtin_model, where):
    table = pa.table({"body": ["the river runs to the sea"] * 6 + [None]})
    pq.write_table(table, tmp_path / "t.parquet")
    prepared = prep(tmp_path / "t.parquet", builtin_model, fmt="text", text_field="body", seq_len=16, where=where)
    assert (prepared.rows, prepared.usable_rows) == (7, 6)
    # Text trains on every token its row predicts: all but each row's first (packed apart, nothing predicts it).
    assert prepared.trained_tokens == prepared.tokens - prepared.usable_rows
    rows = prepared.dataset.take_all()
    assert sum(int((r["labels"] != IGNORE_INDEX).sum()) for r in rows) == prepared.trained_tokens
    # Each row lies whole in one block of 16, its positions counting from 0 where it starts.
    per_row = prepared.tokens // 6
    documents = [block_documents(r["position_ids"], int(r["filled"])) for r in rows]
    assert [n for block in documents for _, n in block] == [per_row] * 6
    assert all(
        r["position_ids"][s : s + n].tolist() == list(range(n))
        for r, b in zip(rows, documents, strict=True)
        for s, n in b
    )


def test_no_usable_row_is_a_clear_error(tmp_path, ray_local, builtin_model, where):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"instruction": "Q", "output": "A"}) + "\n")
    with pytest.raises(DataError) as info:
        prep(path, builtin_model, fmt="chat", where=where)
    assert "no usable row for format 'chat' (1 rows read: 1 x missing field 'messages'" in str(info.value)
    assert "--data-format" in info.value.hint


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing.jsonl", "no such file or folder"),
        (lambda p: (p / "x.txt").write_text("a,b\n") and p / "x.txt", "unsupported file type '.txt'"),
        (
            lambda p: (p / "empty").mkdir() or p / "empty",
            "has no .jsonl, .ndjson, .json, .parquet, .csv, .tsv or .arrow file",
        ),
    ],
)
def test_bad_paths(tmp_path, ray_local, builtin_model, make, message):
    with pytest.raises(DataError, match=message):
        prep(make(tmp_path), builtin_model)


def test_too_little_data_for_one_step(tmp_path, ray_local, builtin_model):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"instruction": "Q", "output": "A"}) + "\n")
    with pytest.raises(DataError, match=r"pack into 1 blocks of 32 tokens, but one step needs 16"):
        prep(path, builtin_model, min_blocks=16)


def _hub_dataset(cache, repo: str, splits: dict):
    """A dataset repository in the Hugging Face cache's own layout, as ``snapshot_download`` leaves it: the files
    under ``snapshots/<commit>/``, ``refs/main`` naming that commit. ``splits``: split -> rows (one Parquet file)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / f"datasets--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    (snapshot / "data").mkdir(parents=True)
    for split, rows in splits.items():
        pq.write_table(pa.Table.from_pylist(rows), snapshot / "data" / f"{split}-00000-of-00001.parquet")
    (snapshot / "README.md").write_text("---\nlicense: apache-2.0\n---\n# A test dataset\n")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hugging_face_dataset_is_read_offline_from_the_cache(tmp_path, ray_local, builtin_model, monkeypatch, where):
    import huggingface_hub.constants

    from raytrain_eks.train.data.sources import list_data_files

    train = [{"question": f"What is {i} plus 2?", "answer": f"{i + 2}."} for i in range(12)]
    test = [{"question": "What is 7 plus 2?", "answer": "9."}]
    snapshot = _hub_dataset(tmp_path / "hub", "acme/sums", {"train": train, "test": test})
    # No network here: HF_HUB_OFFLINE makes it the cache only (the cache folder, read when huggingface_hub is
    # imported, is set where it is read).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    files, kind = list_data_files("hf:acme/sums")
    assert kind == "parquet" and files == [str(snapshot / "data" / "train-00000-of-00001.parquet")]
    assert list_data_files("hf:acme/sums:test")[0] == [str(snapshot / "data" / "test-00000-of-00001.parquet")]
    columns = {"instruction": "question", "output": "answer"}
    prepared = prep("hf:acme/sums", builtin_model, where=where, columns=columns, listed=(files, kind))
    assert (prepared.rows, prepared.usable_rows) == (12, 12)
    # A folder in the Hub's layout, named directly.
    local = prep(f"hf:{snapshot}:test", builtin_model, where=where, columns=columns)
    assert (local.rows, local.usable_rows) == (1, 1)
    with pytest.raises(DataError, match=r"has no split 'validation' \(its splits: test, train\)"):
        list_data_files("hf:acme/sums:validation")
    with pytest.raises(DataError, match="'acme/missing' is neither reachable on the Hub nor in the Hugging Face"):
        list_data_files("hf:acme/missing")


EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))
# The rows of tatsu-lab/alpaca as its dataset card describes them (instruction, input, output, text): what a recipe
# naming it reads, where the Hub is out of reach and the dataset is not in the Hugging Face cache.
ALPACA_ROWS = [
    {
        "instruction": f"Give the sum of {i} and {i + 1}.",
        "input": "" if i % 2 else f"The numbers are {i} and {i + 1}.",
        "output": f"The sum of {i} and {i + 1} is {2 * i + 1}, since {i} + {i + 1} = {2 * i + 1}.",
        "text": f"Below is an instruction that describes a task. ... {2 * i + 1}",
    }
    for i in range(1200)  # enough for the blocks one of the recipe's steps takes
]
HUB_STAND_INS = {"hf:tatsu-lab/alpaca": ALPACA_ROWS}


def _reads_data(recipe: Path) -> bool:
    from raytrain_eks.config import load_config

    return not load_config(path=recipe, environ={}).training.uses_random_data


def test_the_recipes_that_read_no_data_say_so():
    # A recipe trains on random token ids only where its own file says `data: random` (the reference cluster's
    # network check); every other recipe's data is read by the test below.
    import yaml

    random_ones = [p.name for p in EXAMPLES if not _reads_data(p)]
    said = [p.name for p in EXAMPLES if (yaml.safe_load(p.read_text()).get("training") or {}).get("data") == "random"]
    assert random_ones == said == ["reference-cluster.yaml"]


@pytest.mark.parametrize("recipe", [p for p in EXAMPLES if _reads_data(p)], ids=lambda p: p.name)
def test_every_example_recipe_reads_its_data(recipe, ray_local, builtin_model, monkeypatch, tmp_path):
    # Each shipped recipe's data prepared as `train` prepares it (data, format, columns, template, the blocks one
    # step takes on this machine's CPU workers), from the repository's folder where its comments run it. The
    # tokenizer is the built-in model's: a Hub model may not be in the cache here, and the rows' use does not
    # depend on it.
    from raytrain_eks.config import BUILTIN_DATA, load_config
    from raytrain_eks.ray_session import LOCAL_CPU_WORKERS
    from raytrain_eks.train.data.encoding import chat_template_text
    from raytrain_eks.train.data.sources import list_data_files

    monkeypatch.chdir(recipe.parents[1])
    training = load_config(path=recipe, environ={}).training
    data = str(sample_data_path()) if training.data == BUILTIN_DATA else training.data
    if data.startswith("hf:"):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # tests reach no network: the Hugging Face cache only
        try:
            listed = list_data_files(data)
        except DataError:  # not in this machine's cache: a cache holding rows of the dataset's documented shape
            import huggingface_hub.constants

            assert data in HUB_STAND_INS, f"{data}: add its rows' shape to HUB_STAND_INS"
            _hub_dataset(tmp_path / "hub", data.removeprefix("hf:").split(":")[0], {"train": HUB_STAND_INS[data]})
            monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
            listed = list_data_files(data)
    else:
        listed = list_data_files(data)
    prepared = prepare_dataset(
        DataSettings(
            data_format=training.data_format,
            text_field=training.text_field,
            columns=training.columns or None,
            packing=training.packing,
            chat_template=chat_template_text(training.chat_template),
            tokenizer_path=builtin_model,
            seq_len=training.seq_len,
            seed=training.seed,
        ),
        data=data,
        listed=listed,
        min_blocks=(training.num_workers or LOCAL_CPU_WORKERS) * training.batch_size * training.grad_accum_steps,
        eval_fraction=training.effective_eval_fraction,
    )
    assert prepared.usable_rows == prepared.rows > 0, prepared.describe(data, training.seq_len)


def test_openai_rows_with_tool_calls_are_prepared(ray_local, builtin_model, tokenizer):
    # OpenAI's fine-tuning rows, rendered with Qwen2.5's template (it writes tool calls and tool definitions): the
    # tool call and the answers are trained; the tool's result, its definition and the prompts are context.
    template = (FIXTURES / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    path = FIXTURES / "data" / "openai.jsonl"
    prepared = prep(path, builtin_model, fmt="openai", seq_len=1024, where="driver", chat_template=template)
    assert (prepared.rows, prepared.usable_rows) == (3, 2)
    assert prepared.malformed == {"a message's role is 'function', not one of system, user, assistant, tool": 1}
    trained, whole = trained_and_whole(tokenizer, prepared)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in trained
    assert "It is 18 degrees and cloudy in Paris.<|im_end|>" in trained
    assert "100 degrees Celsius.<|im_end|>" in trained
    assert "18, " not in trained and "temperature_c" in whole  # the tool's result: read, not trained
    assert "Current weather in a city" in whole and "Current weather" not in trained
    assert "What is the weather in Paris?" in whole and "Paris?" not in trained
    labels = np.concatenate([r["labels"] for r in prepared.dataset.take_all()])
    assert int((labels != IGNORE_INDEX).sum()) == prepared.trained_tokens  # what the data's summary line says


def test_sharegpt_speakers_and_renamed_columns_from_files(ray_local, builtin_model, tokenizer):
    sharegpt = prep(FIXTURES / "data" / "sharegpt.jsonl", builtin_model, fmt="sharegpt", seq_len=256, where="driver")
    assert (sharegpt.rows, sharegpt.usable_rows) == (4, 3)
    assert sharegpt.malformed == {"a turn is from 'bing', not one of human, user, gpt, assistant, system": 1}
    trained, whole = trained_and_whole(tokenizer, sharegpt)
    for answer in ("Red.", "Cold.", "Eight.", "Six."):  # gpt, assistant and GPT all answer; each answer is trained
        assert f"{answer}<|im_end|>" in trained
    assert "<|im_start|>system\nAnswer in one word.<|im_end|>" in whole and "one word" not in trained
    assert "<|im_start|>user\nHow many legs has a spider?<|im_end|>" in whole and "spider" not in trained
    qa = prep(
        FIXTURES / "data" / "qa-columns.jsonl",
        builtin_model,
        seq_len=64,  # each row whole in a block
        where="driver",
        columns={"instruction": "question", "input": "context", "output": "answer"},
    )
    assert (qa.rows, qa.usable_rows) == (3, 2)
    assert qa.malformed == {"missing field 'answer' (training.columns: {output: answer})": 1}
    trained, whole = trained_and_whole(tokenizer, qa)
    assert "Jupiter.<|im_end|>" in trained and "danke<|im_end|>" in trained
    assert "<|im_start|>user\nTranslate to German:\n\nthank you<|im_end|>" in whole and "thank" not in trained
    assert "astronomy" not in whole  # a column no field reads is left out


def test_a_row_that_fails_to_encode_is_counted_and_the_rest_of_the_file_trains(
    tmp_path, ray_local, builtin_model, tokenizer, where
):
    # One row's text holds a lone surrogate (a character cut in half by whatever wrote the file): JSON reads it, and
    # the tokenizer refuses it with its own TypeError. Another asks to train on an image. Each is one counted row.
    def said(user: object, answer: str) -> dict[str, object]:
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}

    good = [said(f"What is {i} plus 1?", f"{i + 1}.") for i in range(6)]
    good.append(said([{"type": "text", "text": "What is 6 "}, {"type": "text", "text": "plus 1?"}], "7."))
    image = said([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "A cat.")
    lines = [json.dumps(r) for r in good[:3]]
    lines += [json.dumps(said("Cut \ud800 here", "x")), json.dumps(image)]  # json.dumps writes it as \ud800
    lines += [json.dumps(r) for r in good[3:]]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    prepared = prep(path, builtin_model, fmt="openai", seq_len=64, where=where)
    assert (prepared.rows, prepared.usable_rows) == (9, 7)
    failed = [why for why in prepared.malformed if why.startswith("could not be encoded (TypeError: ")]
    assert len(failed) == 1 and prepared.malformed[failed[0]] == 1
    summary = prepared.describe(str(path), 64)
    assert "skipped 2 malformed rows: " in summary and f"1 x {failed[0]}" in summary
    assert "1 x a user message's content holds a part of type 'image_url': only text is trained" in summary
    trained, _ = trained_and_whole(tokenizer, prepared)
    assert all(f"{i + 1}.<|im_end|>" in trained for i in range(7))


def test_the_data_command_shows_the_blocks_train_trains_on(ray_local, builtin_model, tmp_path):
    # `raytrain-eks data` prepares with no Ray; train hands its packed set to the workers through Ray. The blocks the
    # command shows are the first blocks the workers read, with the same counts.
    from raytrain_eks.presets import local_tiny
    from raytrain_eks.train.data.pipeline import PackedSet, prepare_for
    from raytrain_eks.train.data.preview import preview_data
    from raytrain_eks.train.launch import data_source

    cfg = local_tiny()
    shown = preview_data(cfg, show=4)
    training = cfg.training
    trained = prepare_for(
        training, builtin_model, data=data_source(cfg), min_blocks=1, eval_fraction=training.effective_eval_fraction
    )
    assert shown.counts == trained.counts()
    read = PackedSet.of(trained.dataset).take(np.arange(4))
    assert [b.input_ids for b in shown.blocks] == read["input_ids"].tolist()
    assert [b.labels for b in shown.blocks] == read["labels"].tolist()
    assert [b.filled for b in shown.blocks] == read["filled"].tolist()
    assert [b.documents for b in shown.blocks] == [
        block_documents(p, int(f)) for p, f in zip(read["position_ids"], read["filled"], strict=True)
    ]


def test_preference_pairs_pack_the_same_through_ray_data(ray_local, builtin_model, tmp_path, monkeypatch):
    # Method dpo: each row a pair joined at its split, carried through the keyed sort and the packing groups (several,
    # at 40 rows a group): both paths give the same blocks, and the ranks read pairs whole (an even number of
    # documents in every block).
    from raytrain_eks.config import load_config
    from raytrain_eks.train.data.pipeline import PackedSet, prepare_for

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(data_module, "PACK_ROWS", 40)
    training = load_config(environ={}, sets=["training.method=dpo", "training.seq_len=128"]).training
    given = {"data": training.data, "min_blocks": 1, "eval_fraction": 0.05}
    driver = prepare_for(training, builtin_model, in_driver=True, **given)
    ray_data = prepare_for(training, builtin_model, in_driver=False, **given)
    assert driver.counts() == ray_data.counts() and driver.counts()["usable_pairs"] == 100
    assert np.array_equal(blocks(driver.dataset), blocks(ray_data.dataset))
    assert np.array_equal(blocks(driver.eval_dataset), blocks(ray_data.eval_dataset))
    read = PackedSet.of(ray_data.dataset).take(np.arange(ray_data.blocks))
    assert ((read["position_ids"] == 0).sum(axis=1) % 2 == 0).all()
