"""Preference data (the ``preference`` format): each row becomes a chosen and a rejected encoding sharing one masked
prompt, in TRL's preference layouts (text, or messages with an explicit prompt) and UltraFeedback binarized's (whole
conversations sharing a prompt); rows that do not fit are refused with their reason. The configuration of method dpo:
its data, format and learning rate when none is set, and what it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from raytrain_eks import presets
from raytrain_eks.config import TrainingConfig, load_config
from raytrain_eks.errors import ConfigError
from raytrain_eks.formats import MalformedRow
from raytrain_eks.train.data.encoding import IGNORE_INDEX, encode_pair, encode_row

# --- configuration: method dpo's defaults and refusals -----------------------------------------------------------


def test_dpo_reads_the_built_in_pairs_at_its_own_learning_rate_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lora = load_config(environ={}, sets=["training.method=dpo"]).training
    assert (lora.data, lora.data_format) == ("builtin:sample-preferences", "preference")
    assert lora.learning_rate == 5e-5 and lora.learning_rate_reason == "DPO with LoRA's default; full DPO's is 5e-06"
    assert lora.adapters == lora.lora and lora.preference and (lora.dpo.beta, lora.dpo.loss_type) == (0.1, "sigmoid")
    full = load_config(environ={}, sets=["training.method=dpo", "training.dpo.adapters=none"]).training
    assert full.learning_rate == 5e-6 and full.adapters is None
    # The local preset's instruction data is supervised data: dpo reads its pairs instead; what is given is kept.
    tiny = load_config(preset=presets.local_tiny(), environ={}, overrides={"training": {"method": "dpo"}}).training
    assert (tiny.data, tiny.data_format) == ("builtin:sample-preferences", "preference")
    mine = load_config(environ={}, sets=["training.method=dpo", "training.data=prefs.jsonl", "training.dpo.beta=0.2"])
    assert (mine.training.data, mine.training.dpo.beta) == ("prefs.jsonl", 0.2)
    assert TrainingConfig(method="dpo").data_format == "preference"
    # Other methods keep their data, have no pairs, and only lora has adapters.
    sft = load_config(environ={}, sets=["training.dpo.beta=0.5"]).training
    assert (sft.data, sft.data_format, sft.adapters, sft.preference) == ("random", "instruction", None, False)
    assert load_config(environ={}, sets=["training.method=lora"]).training.adapters is not None


def test_dpo_refuses_data_without_pairs_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raytrain-eks.yaml").write_text(yaml.safe_dump({"training": {"data_format": "chat"}}))
    with pytest.raises(ConfigError, match=r"data_format is 'chat': set data_format to preference \(--data-format"):
        load_config(environ={}, sets=["training.method=dpo"])
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, sets=["training.method=dpo", "training.dpo.beta=0", "training.dpo.loss_type=kto"])
    problems = "\n".join(info.value.problems)
    assert "training.dpo.beta = 0" in problems and "training.dpo.loss_type = 'kto'" in problems
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, sets=["training.method=dpo", "training.data=random", "training.packing=concat"])
    (problem,) = info.value.problems  # every problem of dpo's data in one message, a fix for each
    assert "data is random token ids, which hold no pairs: set data to builtin:sample-preferences" in problem
    assert "packing is 'concat'" in problem and "set data_format to preference" in problem


def _trained(tokenizer, labels: list[int]) -> str:
    return tokenizer.decode([t for t in labels if t != IGNORE_INDEX])


def _prompt(ids: list[int], labels: list[int]) -> list[int]:
    first = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
    return ids[:first]


def test_a_text_row_gives_two_answers_after_the_same_masked_prompt(tokenizer):
    chosen, rejected = encode_pair({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "preference", tokenizer)
    assert _prompt(chosen.ids, chosen.labels) == _prompt(rejected.ids, rejected.labels)
    assert "2+2=" in tokenizer.decode(_prompt(chosen.ids, chosen.labels))
    assert _trained(tokenizer, chosen.labels).startswith("4") and "2+2" not in _trained(tokenizer, chosen.labels)
    assert _trained(tokenizer, rejected.labels).startswith("5")


def test_ultrafeedback_conversations_encode_as_the_explicit_prompt_layout(tokenizer):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3*3?"}]
    ultrafeedback = {
        "prompt": "What is 3*3?",
        "chosen": [*prompt, {"role": "assistant", "content": "9"}],
        "rejected": [*prompt, {"role": "assistant", "content": "6"}],
        "score_chosen": 9.0,
    }
    explicit = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "9"}],
        "rejected": [{"role": "assistant", "content": "6"}],
    }
    assert encode_pair(ultrafeedback, "preference", tokenizer) == encode_pair(explicit, "preference", tokenizer)
    chosen, _ = encode_pair(ultrafeedback, "preference", tokenizer)
    assert "Be brief." in tokenizer.decode(chosen.ids) and _trained(tokenizer, chosen.labels).startswith("9")


def test_supervised_training_on_preference_rows_trains_the_chosen_answer(tokenizer):
    row = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    chosen, _ = encode_pair(row, "preference", tokenizer)
    assert encode_row(row, "preference", tokenizer) == (chosen.ids, chosen.labels)


def test_columns_map_a_data_sets_own_names(tokenizer):
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    row = {"question": "2+2=", "good": "4", "bad": "5"}
    plain = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    assert encode_pair(row, "preference", tokenizer, columns) == encode_pair(plain, "preference", tokenizer)
    with pytest.raises(MalformedRow, match=r"missing field 'bad' \(training.columns: \{rejected: bad\}\)"):
        encode_pair({"question": "2+2=", "good": "4"}, "preference", tokenizer, columns)


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"prompt": "2+2=", "chosen": "4"}, "missing field 'rejected'"),
        ({"chosen": "4", "rejected": "5"}, "missing field 'prompt'"),
        (
            {
                "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "1"}],
                "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "2"}],
            },
            "do not share their prompt",
        ),
        ({"prompt": "q", "chosen": [{"role": "robot", "content": "1"}], "rejected": "2"}, "a message of 'chosen'"),
    ],
)
def test_a_row_that_is_not_a_pair_is_refused_with_its_reason(row, reason, tokenizer):
    with pytest.raises(MalformedRow, match=reason):
        encode_pair(row, "preference", tokenizer)


def test_a_format_without_pairs_is_refused(tokenizer):
    with pytest.raises(MalformedRow, match="use --data-format preference"):
        encode_pair({"instruction": "a", "output": "b"}, "instruction", tokenizer)


# --- packing: each pair whole in one block, chosen and rejected two documents ---------------------------------------


def test_packed_pairs_score_as_the_same_pairs_run_one_by_one(tokenizer):
    """Pairs packed into blocks (several pairs a block, pairs of different lengths) give each response the summed
    log-probability it has when run alone: the documents do not see each other, and chosen pairs with rejected."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain_eks.train.dpo import packed_pair_logps, response_logps

    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1) * (a % 3 + 1)}
        for a, b in [(1, 2), (13, 4), (7, 70), (2, 2), (40, 5)]
    ]
    pairs = [encode_pair(row, "preference", tokenizer) for row in rows]
    packed = packed_pairs([((c.ids, c.labels), (r.ids, r.labels)) for c, r in pairs], seq_len=64, pad_id=0)
    assert len(packed["input_ids"]) < len(pairs)  # several pairs share a block
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    blocks = {k: torch.as_tensor(v) for k, v in packed.items()}
    with torch.no_grad():
        # No cache: transformers tells the documents apart by their positions only without one.
        ids, positions = blocks["input_ids"], blocks["position_ids"].long()
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        got = packed_pair_logps(logits, blocks["labels"], blocks["position_ids"])
        alone = []
        for encoded in [e for pair in pairs for e in pair]:
            ids, labels = torch.tensor([encoded.ids]), torch.tensor([encoded.labels])
            alone.append(response_logps(model(input_ids=ids).logits, labels))
    # Blocks are filled longest pair first: match the pairs by their chosen responses' scores.
    want_chosen = sorted(alone[i][0].item() for i in range(0, len(alone), 2))
    want_rejected = {round(alone[i][0].item(), 4): alone[i + 1][0].item() for i in range(0, len(alone), 2)}
    assert sorted(got.chosen.tolist()) == pytest.approx(want_chosen, abs=1e-4)
    for chosen, rejected in zip(got.chosen.tolist(), got.rejected.tolist(), strict=True):
        assert rejected == pytest.approx(want_rejected[round(chosen, 4)], abs=1e-4)
    assert got.chosen_tokens.sum() + got.rejected_tokens.sum() == int((blocks["labels"] != IGNORE_INDEX).sum())


def packed_pairs(pairs, seq_len: int, pad_id: int) -> dict:
    """Pairs ``((chosen ids, labels), (rejected ids, labels))`` packed as the pipeline packs them: each pair one
    joined row with its split (encode_joined_pair's layout), the rows packed by pack_table."""
    import pyarrow as pa

    from raytrain_eks.train.data.packing import pack_table

    table = pa.table(
        {
            "input_ids": [[*c[0], *r[0]] for c, r in pairs],
            "labels": [[*c[1], *r[1]] for c, r in pairs],
            "split": [len(c[0]) for c, _ in pairs],
        }
    )
    return pack_table(table, seq_len, pad_id, packing="documents", overlong="drop")


def test_a_pair_longer_than_a_block_is_left_out_whole():
    short = (([1, 2], [IGNORE_INDEX, 2]), ([1, 3], [IGNORE_INDEX, 3]))
    long = (([1, 2, 3, 4], [IGNORE_INDEX, 2, 3, 4]), ([1, 5, 6], [IGNORE_INDEX, 5, 6]))
    packed = packed_pairs([short, long], seq_len=6, pad_id=0)
    assert packed["input_ids"].tolist() == [[1, 2, 1, 3, 0, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3]]


def test_the_built_in_preference_set_is_pairs_with_one_wrong_answer_each(tokenizer):
    """The shipped arithmetic pairs: every row a pair sharing its prompt, chosen and rejected differing only in the
    result, and all of them packed whole."""
    import json
    import operator
    from importlib.resources import files

    text = files("raytrain_eks.resources").joinpath("sample_preferences.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines()]
    assert len(rows) == 100 and len({row["prompt"] for row in rows}) == 100
    pairs = [encode_pair(row, "preference", tokenizer) for row in rows]
    for row, (chosen, rejected) in zip(rows, pairs, strict=True):
        assert _prompt(chosen.ids, chosen.labels) == _prompt(rejected.ids, rejected.labels)
        a, op, b = row["prompt"].removeprefix("What is ").removesuffix("?").split()
        right = {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](int(a), int(b))
        assert row["chosen"] == f"{a} {op} {b} = {right}." and row["rejected"] != row["chosen"]
        assert row["rejected"].startswith(f"{a} {op} {b} = ")
    packed = packed_pairs([((c.ids, c.labels), (r.ids, r.labels)) for c, r in pairs], seq_len=128, pad_id=0)
    assert int((packed["position_ids"] == 0).sum()) == 200  # every pair whole: 100 chosen, 100 rejected


# --- the data path of method dpo: files prepared as `train` prepares them, the `data` command -----------------------

WORDS = "the policy learns which answer people preferred and keeps near its reference while it learns".split()  # noqa: SIM905


def _preference_rows(layout: str, count: int = 24) -> list[dict]:
    """Pairs of mixed lengths in one of the layouts the preference format reads: TRL's plain text (``trl-text``),
    TRL's conversational with an explicit prompt (``trl-messages``) or UltraFeedback binarized's whole
    conversations (``ultrafeedback``). Pair 5's rejected answer is long enough that the pair passes a block of 192."""
    rows = []
    for i in range(count):
        prompt = f"Question {i}: " + " ".join(WORDS[: 2 + i % 5])
        chosen = f"Good answer {i}: " + " ".join(WORDS[: 1 + (3 * i) % 11])
        rejected = f"Bad answer {i}: " + " ".join(WORDS * (6 if i == 5 else 0) or WORDS[: 1 + (5 * i) % 13])
        if layout == "trl-text":
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        elif layout == "trl-messages":
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
        else:
            user = {"role": "user", "content": prompt}
            rows.append(
                {
                    "prompt": prompt,
                    "prompt_id": f"{i:064x}",
                    "chosen": [user, {"role": "assistant", "content": chosen}],
                    "rejected": [user, {"role": "assistant", "content": rejected}],
                    "messages": [user, {"role": "assistant", "content": chosen}],
                    "score_chosen": 8.0,
                    "score_rejected": 3.0,
                }
            )
    return rows


def _dpo_training(path, *sets: str):
    return load_config(
        environ={}, sets=["training.method=dpo", f"training.data={path}", "training.seq_len=192", *sets]
    ).training


def _pairs_of(packed: dict, tokenizer) -> list[tuple[str, str, str]]:
    """Each packed pair as (prompt, chosen's scored text, rejected's scored text), read from the blocks alone; the
    chosen and rejected documents of a pair must start with the same prompt, and nothing before it is scored."""
    from raytrain_eks.train.data.packing import block_documents

    found = []
    columns = (packed[k] for k in ("input_ids", "labels", "position_ids", "filled"))
    for ids, labels, positions, filled in zip(*columns, strict=True):
        documents = block_documents(positions, int(filled))
        assert len(documents) % 2 == 0
        for (c_start, c_len), (r_start, r_len) in zip(documents[0::2], documents[1::2], strict=True):
            chosen, rejected = labels[c_start : c_start + c_len], labels[r_start : r_start + r_len]
            prompt = int(np.argmax(chosen != IGNORE_INDEX))
            assert (chosen[:prompt] == IGNORE_INDEX).all() and (rejected[:prompt] == IGNORE_INDEX).all()
            assert ids[c_start : c_start + prompt].tolist() == ids[r_start : r_start + prompt].tolist()
            assert (chosen[prompt:] != IGNORE_INDEX).all() and (rejected[prompt:] != IGNORE_INDEX).all()
            found.append(
                (
                    tokenizer.decode(ids[c_start : c_start + prompt]),
                    tokenizer.decode(chosen[prompt:]),
                    tokenizer.decode(rejected[prompt:]),
                )
            )
    return found


@pytest.mark.parametrize("layout", ["trl-text", "trl-messages", "ultrafeedback"])
def test_preference_files_pack_into_blocks_whose_documents_pair_up(layout, builtin_model, tokenizer, tmp_path):
    """A preference file prepared as `train` prepares it (no Ray): every usable pair lands whole in one block, chosen
    then rejected after the same prompt, only the answers scored; the loss's pairing finds one entry per pair; the
    pair too long for a block and the row that is no pair are left out and counted as pairs."""
    import torch

    from raytrain_eks.train.data.pipeline import first_blocks, prepare_for
    from raytrain_eks.train.dpo import packed_pair_logps

    rows = _preference_rows(layout)
    path = tmp_path / "prefs.jsonl"
    lines = [json.dumps(row) for row in rows] + [json.dumps({"prompt": "Question: alone", "chosen": "no pair"})]
    path.write_text("\n".join(lines) + "\n")
    training = _dpo_training(path, "training.eval_fraction=0.1")
    given = {"data": str(path), "min_blocks": 1, "eval_fraction": training.effective_eval_fraction}
    prepared = prepare_for(training, builtin_model, in_driver=True, ray_dataset=False, **given)

    long_pair = encode_pair(rows[5], "preference", tokenizer)
    assert len(long_pair[0].ids) <= 192 < len(long_pair[0].ids) + len(long_pair[1].ids)
    counts = prepared.counts()
    assert (counts["pairs"], counts["malformed_pairs"], counts["dropped_pairs"]) == (25, 1, 1)
    assert (counts["usable_pairs"], counts["eval_pairs"]) == (23, 2)
    assert counts["dropped_tokens"] == len(long_pair[0].ids) + len(long_pair[1].ids)
    assert "truncated_rows" not in counts and "rows" not in counts
    line = prepared.describe(str(path))
    assert "23/25 pairs usable" in line and "dropped 1 pairs longer than 192 tokens" in line

    trained = first_blocks(prepared.dataset, prepared.blocks)
    held_out = first_blocks(prepared.eval_dataset, prepared.eval_blocks)
    pairs = _pairs_of(trained, tokenizer) + _pairs_of(held_out, tokenizer)
    assert len(_pairs_of(held_out, tokenizer)) == 2
    assert len(pairs) == 23 > prepared.blocks + prepared.eval_blocks  # some blocks hold several pairs
    want = []
    for i, row in enumerate(rows):
        if i != 5:
            chosen, rejected = encode_pair(row, "preference", tokenizer)
            prompt = next(k for k, t in enumerate(chosen.labels) if t != IGNORE_INDEX)
            texts = (chosen.ids[:prompt], chosen.ids[prompt:], rejected.ids[prompt:])
            want.append(tuple(tokenizer.decode(t) for t in texts))
    assert sorted(pairs) == sorted(want)
    assert all(p[1].startswith("Good answer") and p[2].startswith("Bad answer") for p in pairs)

    blocks = {k: torch.as_tensor(v, dtype=torch.long) for k, v in trained.items()}
    logits = torch.randn(*blocks["input_ids"].shape, len(tokenizer), generator=torch.Generator().manual_seed(0))
    got = packed_pair_logps(logits, blocks["labels"], blocks["position_ids"])
    assert len(got.chosen) == len(got.rejected) == 21  # one entry per training pair
    assert bool((got.chosen_tokens > 0).all() and (got.rejected_tokens > 0).all())
    assert int(got.chosen_tokens.sum() + got.rejected_tokens.sum()) == int((blocks["labels"] != IGNORE_INDEX).sum())


def test_the_data_command_shows_each_pair_with_its_scored_answers(builtin_model, tmp_path, monkeypatch, capsys):
    from test_json_output import run_cli

    monkeypatch.chdir(tmp_path)
    args = ["data", "--set", "training.method=dpo", "--seq-len", "128", "--show", "1"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "data: builtin:sample-preferences: 100/100 pairs usable" in out and "5 pairs held out" in out
    block = out[out.index("block 0:") :]
    assert block.startswith("block 0: 2 pairs,") and "-- pair 1: positions 0-" in block
    prompt = block.split("prompt: ", 1)[1].split("chosen: ", 1)[0]
    chosen = block.split("chosen: [[", 1)[1].split("]]", 1)[0]
    rejected = block.split("rejected: [[", 1)[1].split("]]", 1)[0]
    question = prompt.split("What is ", 1)[1].split("?", 1)[0]
    assert chosen.startswith(f"{question} = ") and rejected.startswith(f"{question} = ") and chosen != rejected
    assert "[[" not in prompt, "the prompt is not scored"
    code, out, err = run_cli([*args, "--json"], capsys)
    got = json.loads(out)
    assert (got["pairs"], got["usable_pairs"], got["dropped_pairs"]) == (100, 100, 0)
    assert got["shown_blocks"][0]["pairs"] == [{"chosen": 0, "rejected": 1}, {"chosen": 2, "rejected": 3}]


def test_a_built_in_data_set_is_found_by_name_and_an_unknown_one_is_named():
    from raytrain_eks.errors import DataError
    from raytrain_eks.train.data.sources import list_data_files

    files, kind = list_data_files("builtin:sample-preferences")
    assert kind == "json" and files[0].endswith("sample_preferences.jsonl")
    with pytest.raises(DataError, match="no such built-in data set; there are builtin:sample-instructions, builtin:"):
        list_data_files("builtin:sample-prefs")
