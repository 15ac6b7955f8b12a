"""Data formats on small hand-made rows: tokenization, prompt masking, the BOS token a tokenizer adds on its own,
message contents of text parts; random data's global batch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from raytrain_eks.formats import MalformedRow
from raytrain_eks.train.data.encoding import IGNORE_INDEX, encode_row
from raytrain_eks.train.data.pipeline import random_batch

LLAMA31_TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja"
BOS = "<|begin_of_text|>"


@pytest.fixture(scope="module")
def bos_tokenizer(builtin_model):
    """The built-in tokenizer given a BOS token that it puts first on its own, as Llama 3's and Gemma's tokenizers
    do (the built-in one, like Qwen2's, has none); no chat template."""
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(Path(builtin_model) / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(BOS, special=True)])
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


def trained_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])


def masked_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX])


def test_text_format_trains_every_token_and_ends_with_eos(tokenizer):
    ids, labels = encode_row({"body": "the river runs"}, "text", tokenizer, text_field="body")
    assert labels == ids
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[:-1]) == "the river runs"


def test_text_rows_start_with_the_bos_token_a_tokenizer_adds_on_its_own(tokenizer, bos_tokenizer):
    from raytrain_eks.train.prompts import sample_prompts

    bos = bos_tokenizer.bos_token_id
    assert bos_tokenizer("x")["input_ids"][0] == bos, "the tokenizer of this test adds its BOS token itself"
    ids, labels = encode_row({"text": "the river runs"}, "text", bos_tokenizer)
    assert ids[0] == bos and ids[1:].count(bos) == 0 and ids[-1] == bos_tokenizer.eos_token_id
    assert bos_tokenizer.decode(ids[1:-1]) == "the river runs"
    assert labels == [IGNORE_INDEX, *ids[1:]], "the BOS token is never a label; the rest and the EOS are trained"
    # A text that begins with the BOS token's own text has it once.
    assert encode_row({"text": BOS + "the river runs"}, "text", bos_tokenizer) == (ids, labels)
    # The sample prompts of a run start as its rows do.
    assert sample_prompts(["the river"], None, "text", "text", bos_tokenizer) == (["the river"], [BOS + "the river"])
    # A tokenizer that adds no BOS token of its own (Qwen2's, the built-in model's) gets none.
    plain_ids, _ = encode_row({"text": "the river runs"}, "text", tokenizer)
    assert plain_ids == [*tokenizer("the river runs", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    assert sample_prompts(["the river"], None, "text", "text", tokenizer) == (["the river"], ["the river"])


def test_rows_in_the_plain_layout_start_with_bos_and_a_templates_rows_as_it_writes_them(bos_tokenizer):
    from raytrain_eks.train.prompts import render

    row = {"instruction": "Say hi.", "output": "hi"}
    ids, labels = encode_row(row, "instruction", bos_tokenizer)
    assert ids[0] == bos_tokenizer.bos_token_id and labels[0] == IGNORE_INDEX
    assert masked_text(bos_tokenizer, ids, labels) == BOS + "user: Say hi.\nassistant: "
    assert trained_text(bos_tokenizer, ids, labels) == "hi<|endoftext|>\n"
    # The sample prompts of a run start as its rows do.
    assert render([{"role": "user", "content": "Say hi."}], bos_tokenizer) == BOS + "user: Say hi.\nassistant: "
    # A chat template's rendering is kept as it is: Llama 3.1's writes the BOS token itself, once.
    templated = copy.deepcopy(bos_tokenizer)
    templated.chat_template = LLAMA31_TEMPLATE.read_text()
    ids, labels = encode_row(row, "instruction", templated)
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    assert templated.decode(ids) == templated.apply_chat_template(messages, tokenize=False)
    assert ids.count(templated.bos_token_id) == 1 and ids[0] == templated.bos_token_id
    assert labels[0] == IGNORE_INDEX


def test_instruction_format_masks_the_prompt(tokenizer):
    row = {"instruction": "What is 2 plus 3?", "input": "", "output": "2 plus 3 is 5."}
    ids, labels = encode_row(row, "instruction", tokenizer)
    assert tokenizer.decode(ids) == (
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n2 plus 3 is 5.<|im_end|>\n"
    )
    assert trained_text(tokenizer, ids, labels) == "2 plus 3 is 5.<|im_end|>\n"
    assert (
        masked_text(tokenizer, ids, labels) == "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    first_trained = next(i for i, lab in enumerate(labels) if lab != IGNORE_INDEX)
    assert all(lab == IGNORE_INDEX for lab in labels[:first_trained])
    assert labels[first_trained:] == ids[first_trained:]


def test_instruction_input_goes_into_the_prompt(tokenizer):
    row = {"instruction": "Reverse the order of these words.", "input": "red blue", "output": "blue red"}
    ids, labels = encode_row(row, "instruction", tokenizer)
    assert "Reverse the order of these words.\n\nred blue" in masked_text(tokenizer, ids, labels)
    assert trained_text(tokenizer, ids, labels) == "blue red<|im_end|>\n"


def test_chat_format_trains_only_assistant_turns(tokenizer):
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "What is EFA?"},
            {"role": "assistant", "content": "A fabric."},
        ]
    }
    ids, labels = encode_row(row, "chat", tokenizer)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert trained_text(tokenizer, ids, labels) == "Hello.<|im_end|>\nA fabric.<|im_end|>\n"
    assert "Be brief." in masked_text(tokenizer, ids, labels)
    assert "What is EFA?" in masked_text(tokenizer, ids, labels)


def test_without_a_chat_template_a_plain_layout_is_used(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    ids, labels = encode_row({"instruction": "Say hi.", "output": "hi"}, "instruction", plain)
    assert masked_text(plain, ids, labels) == "user: Say hi.\nassistant: "
    assert trained_text(plain, ids, labels) == "hi<|endoftext|>\n"


@pytest.mark.parametrize(
    ("row", "fmt", "reason"),
    [
        ({"instruction": "Q"}, "instruction", "missing field 'output'"),
        ({"output": "A"}, "instruction", "missing field 'instruction'"),
        ({"instruction": "Q", "output": 3}, "instruction", "field 'output' is not a string"),
        ({"messages": [{"role": "user", "content": "Q"}]}, "chat", "no assistant message"),
        ({"messages": [{"role": "robot", "content": "Q"}]}, "chat", "not {role: system|user|assistant"),
        ({"messages": "hello"}, "chat", "missing field 'messages'"),
        ({"title": "x"}, "text", "missing field 'text'"),
        (["not", "an", "object"], "text", "not a JSON object"),
    ],
)
def test_malformed_rows_say_why(tokenizer, row, fmt, reason):
    with pytest.raises(MalformedRow, match=reason.replace("|", r"\|").replace("{", r"\{")):
        encode_row(row, fmt, tokenizer)


def test_random_batch_gives_the_same_global_batch_for_any_world_size():
    common = {"seed": 3, "step": 5, "micro": 0, "seq_len": 16, "vocab_size": 100}
    whole = random_batch(rank=0, world_size=1, batch_size=8, **common)["input_ids"]
    halves = [random_batch(rank=r, world_size=2, batch_size=4, **common)["input_ids"] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), whole)
    other_step = random_batch(rank=0, world_size=1, batch_size=8, **{**common, "step": 6})["input_ids"]
    assert not torch.equal(other_step, whole)


# --- the format registry: ShareGPT, OpenAI-style rows with tools, and columns -------------------------------------


def test_every_registered_format_is_what_config_and_the_cli_accept():
    from typer.testing import CliRunner

    from raytrain_eks.cli import app
    from raytrain_eks.config import TrainingConfig
    from raytrain_eks.formats import FORMATS

    assert list(FORMATS) == ["text", "instruction", "chat", "sharegpt", "openai", "preference"]
    for name in FORMATS:
        assert TrainingConfig(data_format=name).data_format == name
    with pytest.raises(ValueError, match="sharegpt"):  # the message lists the registry's names
        TrainingConfig(data_format="alpaca-v9")
    help_text = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert "text, instruction, chat, sharegpt, openai, preference" in help_text


def test_sharegpt_rows_train_the_gpt_turns_only(tokenizer):
    # (ShareGPT's speaker, the chat role it is, what was said): both speaker spellings tools write.
    turns = [
        ("system", "system", "Be brief."),
        ("human", "user", "Hi"),
        ("gpt", "assistant", "Hello."),
        ("user", "user", "And EFA?"),
        ("assistant", "assistant", "A fabric."),
    ]
    row = {"conversations": [{"from": who, "value": text} for who, _, text in turns]}
    chat = {"messages": [{"role": role, "content": text} for _, role, text in turns]}
    assert encode_row(row, "sharegpt", tokenizer) == encode_row(chat, "chat", tokenizer)
    ids, labels = encode_row(row, "sharegpt", tokenizer)
    assert trained_text(tokenizer, ids, labels) == "Hello.<|im_end|>\nA fabric.<|im_end|>\n"


def test_openai_rows_with_tool_calls_train_the_assistants_calls_and_answers(tokenizer):
    row = {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "4 C, rain"},
            {"role": "assistant", "content": "4 degrees and rain."},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
    }
    from raytrain_eks.formats import openai_conversation

    conv = openai_conversation(row)
    assert conv.tools == row["tools"]
    assert conv.messages[1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    # Without a chat template: the call is written as JSON and trained; the tool's result is not.
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    ids, labels = encode_row(row, "openai", plain)
    trained = trained_text(plain, ids, labels)
    assert '"name": "weather"' in trained and '"city": "Oslo"' in trained and "4 degrees and rain." in trained
    assert "4 C, rain" in masked_text(plain, ids, labels) and "4 C, rain" not in trained
    # With the model's template, the answers are trained and the tool's turn is a prompt.
    ids, labels = encode_row(row, "openai", tokenizer)
    assert "4 degrees and rain." in trained_text(tokenizer, ids, labels)
    assert "4 C, rain" not in trained_text(tokenizer, ids, labels)


@pytest.mark.parametrize(
    ("row", "fmt", "reason"),
    [
        ({"conversations": [{"from": "bot", "value": "x"}]}, "sharegpt", "a turn is from 'bot'"),
        ({"conversations": [{"from": "human", "value": "Q"}]}, "sharegpt", "no assistant message"),
        ({"messages": [{"role": "wizard", "content": "Q"}]}, "openai", "role is 'wizard'"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
            "openai",
            "arguments of tool call 'f' are not JSON",
        ),
        (
            {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "tools": "x"},
            "openai",
            "'tools' is not a list",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
                    {"role": "assistant", "content": "A cat."},
                ]
            },
            "openai",
            "a user message's content holds a part of type 'image_url': only text is trained",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}, {"role": "assistant", "content": "A"}]},
            "chat",
            "a text part of a user message's content has no string 'text'",
        ),
        (
            {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": 3}]},
            "openai",
            "an assistant message's content is not a string or a list of text parts",
        ),
    ],
)
def test_malformed_rows_of_the_new_formats_say_why(tokenizer, row, fmt, reason):
    with pytest.raises(MalformedRow, match=reason):
        encode_row(row, fmt, tokenizer)


def test_a_content_of_text_parts_is_read_as_its_text(tokenizer):
    said = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Rain."}]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": ["Rain", "."]},
    ]
    for fmt in ("chat", "openai"):
        assert encode_row({"messages": parts}, fmt, tokenizer) == encode_row({"messages": said}, fmt, tokenizer)


def test_an_assistants_tool_calls_beside_text_parts_train_without_a_chat_template(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    row = {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "4 C, rain"},
            {"role": "assistant", "content": "4 degrees and rain."},
        ]
    }
    ids, labels = encode_row(row, "openai", plain)
    trained = trained_text(plain, ids, labels)
    assert trained.startswith('Let me look.\n[{"type": "function", "function": {"name": "weather"')
    assert "4 degrees and rain." in trained and "4 C, rain" not in trained


def test_columns_read_the_formats_fields_from_the_datas_own(tokenizer):
    from raytrain_eks.config import TrainingConfig

    mine = {"question": "What is 2 plus 3?", "answer": "5."}
    columns = {"instruction": "question", "output": "answer"}
    assert encode_row(mine, "instruction", tokenizer, columns=columns) == encode_row(
        {"instruction": "What is 2 plus 3?", "output": "5."}, "instruction", tokenizer
    )
    assert TrainingConfig(data_format="instruction", columns=columns).columns == columns
    with pytest.raises(
        ValueError,
        match="columns maps 'prompt', which the instruction format does not read: its "
        "fields are instruction, input, output",
    ):
        TrainingConfig(data_format="instruction", columns={"prompt": "question"})


@pytest.mark.parametrize(
    ("row", "fmt", "columns", "reason"),
    [
        (
            {"query": "What is 2 plus 3?", "answer": "5."},
            "instruction",
            {"instruction": "question", "output": "answer"},
            "missing field 'question' (training.columns: {instruction: question})",
        ),
        (
            {"question": "Q", "answer": 5},
            "instruction",
            {"instruction": "question", "output": "answer"},
            "field 'answer' (training.columns: {output: answer}) is not a string",
        ),
        (
            {"question": "Q"},  # a field the mapping leaves alone keeps the format's name
            "instruction",
            {"instruction": "question"},
            "missing field 'output'",
        ),
        (
            {"conversations": []},
            "sharegpt",
            {"conversations": "dialog"},
            "missing field 'dialog' (training.columns: {conversations: dialog}) (a list of {from, value})",
        ),
    ],
)
def test_a_mapped_column_that_is_missing_is_named_as_the_data_names_it(tokenizer, row, fmt, columns, reason):
    with pytest.raises(MalformedRow) as info:
        encode_row(row, fmt, tokenizer, columns=columns)
    assert str(info.value) == reason
