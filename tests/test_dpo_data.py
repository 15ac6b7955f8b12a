"""Preference data (the ``preference`` format): each row becomes a chosen and a rejected encoding sharing one masked
prompt, in TRL's preference layouts (text, or messages with an explicit prompt) and UltraFeedback binarized's (whole
conversations sharing a prompt); rows that do not fit are refused with their reason."""

from __future__ import annotations

import pytest

from raytrain_eks.formats import MalformedRow
from raytrain_eks.train.data.encoding import IGNORE_INDEX, encode_pair, encode_row


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
    with pytest.raises(MalformedRow, match="use --format preference"):
        encode_pair({"instruction": "a", "output": "b"}, "instruction", tokenizer)


# --- packing: each pair whole in one block, chosen and rejected two documents ---------------------------------------


def test_packed_pairs_score_as_the_same_pairs_run_one_by_one(tokenizer):
    """Pairs packed into blocks (several pairs a block, pairs of different lengths) give each response the summed
    log-probability it has when run alone: the documents do not see each other, and chosen pairs with rejected."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from raytrain_eks.train.data.packing import pack_pairs
    from raytrain_eks.train.dpo import packed_pair_logps, response_logps

    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1) * (a % 3 + 1)}
        for a, b in [(1, 2), (13, 4), (7, 70), (2, 2), (40, 5)]
    ]
    pairs = [encode_pair(row, "preference", tokenizer) for row in rows]
    packed = pack_pairs([((c.ids, c.labels), (r.ids, r.labels)) for c, r in pairs], seq_len=64, pad_id=0)
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


def test_a_pair_longer_than_a_block_is_left_out_whole():
    from raytrain_eks.train.data.packing import pack_pairs

    short = (([1, 2], [IGNORE_INDEX, 2]), ([1, 3], [IGNORE_INDEX, 3]))
    long = (([1, 2, 3, 4], [IGNORE_INDEX, 2, 3, 4]), ([1, 5, 6], [IGNORE_INDEX, 5, 6]))
    packed = pack_pairs([short, long], seq_len=6, pad_id=0)
    assert packed["input_ids"].tolist() == [[1, 2, 1, 3, 0, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3]]


def test_the_built_in_preference_set_is_pairs_with_one_wrong_answer_each(tokenizer):
    """The shipped arithmetic pairs: every row a pair sharing its prompt, chosen and rejected differing only in the
    result, and all of them packed whole."""
    import json
    import operator
    from importlib.resources import files

    from raytrain_eks.train.data.packing import pack_pairs

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
    packed = pack_pairs([((c.ids, c.labels), (r.ids, r.labels)) for c, r in pairs], seq_len=128, pad_id=0)
    assert int((packed["position_ids"] == 0).sum()) == 200  # every pair whole: 100 chosen, 100 rejected
