"""Conversations rendered by the chat templates of real models (their public tokenizer_config.json, in
``fixtures/chat_templates/`` with their sources): what is trained and what is context.

The tokenizer is the built-in model's (its byte-level BPE spells any template's special tokens as ordinary text),
with each model's template in place of its own, so what the template renders is exactly what the ids decode to.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from raytrain_eks.errors import DataError
from raytrain_eks.formats import MalformedRow
from raytrain_eks.train.data.encoding import IGNORE_INDEX, chat_template_text, encode_row, encoding_tokenizer
from raytrain_eks.train.data.pipeline import DataSettings, prepare_dataset

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN25 = "Qwen-Qwen2.5-7B-Instruct"
QWEN3 = "Qwen-Qwen3-0.6B"
LLAMA31 = "meta-llama-Llama-3.1-8B-Instruct"
MISTRAL = "mistralai-Mistral-Nemo-Instruct-2407"
GEMMA2 = "google-gemma-2-2b-it"

ONE = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5."}]
SYSTEM_TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "5."},
]
REASONING = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nHello."},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n5."},
]
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}
TOOL_ROW = {
    "messages": [
        {"role": "user", "content": "Add 2 and 3."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call00001", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call00001", "content": "5"},
        {"role": "assistant", "content": "5."},
    ],
    "tools": [ADD_TOOL],
}


@pytest.fixture(scope="module")
def with_template(builtin_model):
    def make(name: str):
        tokenizer = copy.deepcopy(encoding_tokenizer(builtin_model))
        tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
        return tokenizer

    return make


def trained_and_context(tokenizer, row, fmt="chat"):
    ids, labels = encode_row(row, fmt, tokenizer)
    trained = tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    return trained, tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("name", "answer"),
    [
        (QWEN25, "5.<|im_end|>\n"),
        (QWEN3, "<think>\n\n</think>\n\n5.<|im_end|>\n"),  # Qwen3 writes an empty reasoning block before it
        (LLAMA31, "5.<|eot_id|>"),
        (MISTRAL, "5.<|endoftext|>"),  # the answer and the tokenizer's EOS, as the template ends a turn
        (GEMMA2, "5.<end_of_turn>\n"),
    ],
)
def test_one_answer_is_trained_as_each_template_writes_it(with_template, name, answer):
    tokenizer = with_template(name)
    trained, whole = trained_and_context(tokenizer, {"messages": ONE})
    assert trained == answer
    assert whole == tokenizer.apply_chat_template(ONE, tokenize=False)
    # Everything before the answer is the prompt the template gives a model to answer.
    prompt = tokenizer.apply_chat_template(ONE[:1], tokenize=False, add_generation_prompt=True)
    assert whole.startswith(prompt) and whole[len(prompt) :] == answer


@pytest.mark.parametrize(
    ("name", "answers"),
    [
        (QWEN25, "Hello.<|im_end|>\n5.<|im_end|>\n"),  # renders turn by turn: every answer trained
        (LLAMA31, "Hello.<|eot_id|>5.<|eot_id|>"),
        # Qwen3 renders an answer before the last user message without its reasoning block, and Mistral Nemo writes
        # the system prompt only into a conversation that ends with the user: both rewrite earlier turns, so the
        # last answer is trained and the earlier ones are its context.
        (QWEN3, "<think>\n\n</think>\n\n5.<|im_end|>\n"),
        (MISTRAL, "5.<|endoftext|>"),
    ],
)
def test_multi_turn_rows_with_a_system_prompt(with_template, name, answers):
    tokenizer = with_template(name)
    trained, whole = trained_and_context(tokenizer, {"messages": SYSTEM_TWO_TURNS})
    assert trained == answers
    assert whole == tokenizer.apply_chat_template(SYSTEM_TWO_TURNS, tokenize=False)
    assert "Hello." in whole


def test_a_template_that_refuses_a_row_makes_it_malformed_with_the_templates_reason(with_template):
    with pytest.raises(MalformedRow, match="the chat template refuses the row: System role not supported"):
        encode_row({"messages": SYSTEM_TWO_TURNS}, "chat", with_template(GEMMA2))


def test_qwen3_keeps_the_reasoning_of_the_last_answer_only(with_template):
    tokenizer = with_template(QWEN3)
    trained, whole = trained_and_context(tokenizer, {"messages": REASONING})
    assert trained == "<think>\nadd them\n</think>\n\n5.<|im_end|>\n"
    assert "say hello" not in whole and "Hello." in whole  # the earlier answer, as Qwen3 shows history


@pytest.mark.parametrize(
    ("name", "answers"),
    [
        (QWEN25, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n5.<|im_end|>\n'),
        (LLAMA31, '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>5.<|eot_id|>'),
        (
            MISTRAL,
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "call00001"}]<|endoftext|>'
            "5.<|endoftext|>",
        ),
    ],
)
def test_tool_calls_are_trained_and_tool_results_are_context(with_template, name, answers):
    tokenizer = with_template(name)
    trained, whole = trained_and_context(tokenizer, TOOL_ROW, fmt="openai")
    assert trained == answers
    assert whole == tokenizer.apply_chat_template(TOOL_ROW["messages"], tools=TOOL_ROW["tools"], tokenize=False)
    assert "Add two numbers" in whole and "Add two numbers" not in trained  # the tool's definition is context


def test_a_template_with_generation_blocks_gives_the_mask_itself(with_template):
    # TRL's Qwen2.5 training template: Qwen2.5's rendering with the assistant's output in {% generation %} blocks.
    tokenizer = with_template("trl-qwen2_5_training")
    ids, labels = encode_row({"messages": SYSTEM_TWO_TURNS}, "chat", tokenizer)
    own = tokenizer.apply_chat_template(
        SYSTEM_TWO_TURNS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == list(own["input_ids"])
    assert [lab != IGNORE_INDEX for lab in labels] == [bool(m) for m in own["assistant_masks"]]
    trained = tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    assert "Hello." in trained and "5." in trained and "Add 2 and 3." not in trained and "Be brief." not in trained
    # The same text as the plain Qwen2.5 template renders.
    assert tokenizer.decode(ids) == with_template(QWEN25).apply_chat_template(SYSTEM_TWO_TURNS, tokenize=False)


def _prepare(path, tokenizer_path, template):
    """The chat rows of ``path`` prepared in the driver with ``template``, in 256-token blocks (each row whole: Llama
    3.1's system header alone is longer than 64 tokens)."""
    return prepare_dataset(
        DataSettings(
            data_format="chat",
            text_field="text",
            tokenizer_path=tokenizer_path,
            seq_len=256,
            seed=0,
            chat_template=template,
        ),
        data=str(path),
        min_blocks=1,
        in_driver=True,
    )


def test_training_chat_template_replaces_the_tokenizers_own(tmp_path, ray_local, builtin_model):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"messages": ONE}) + "\n" for _ in range(4)))
    template = chat_template_text(str(TEMPLATES / f"{LLAMA31}.jinja"))
    assert template == (TEMPLATES / f"{LLAMA31}.jinja").read_text()
    assert chat_template_text(template) == template  # the template itself, given inline
    prepared = _prepare(path, builtin_model, template)
    tokenizer = encoding_tokenizer(builtin_model)
    text = tokenizer.decode(prepared.dataset.take_all()[0]["input_ids"])
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date")  # Llama 3.1's
    assert tokenizer.chat_template != template, "the shared tokenizer keeps its own template"
    with pytest.raises(DataError, match="cannot read the template file"):
        chat_template_text(str(tmp_path / "missing.jinja"))


def test_a_row_the_template_refuses_among_the_first_gives_no_prompt_and_is_counted(
    tmp_path, ray_local, builtin_model, with_template
):
    # Gemma 2 has no system role: the first row is refused, by training and by the sample prompts alike; the run's
    # prompts come from the rows after it, and the data's summary counts it with the template's reason.
    from raytrain_eks.train.prompts import sample_prompts

    path = tmp_path / "train.jsonl"
    rows = [{"messages": SYSTEM_TWO_TURNS}, {"messages": ONE}, {"messages": ONE}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = with_template(GEMMA2)
    shown, rendered = sample_prompts(None, ([str(path)], "json"), "chat", "text", tokenizer, count=1)
    assert shown == ["Add 2 and 3."]
    assert rendered == [tokenizer.apply_chat_template(ONE[:1], tokenize=False, add_generation_prompt=True)]
    prepared = _prepare(path, builtin_model, tokenizer.chat_template)
    assert prepared.malformed == {"the chat template refuses the row: System role not supported": 1}
    assert "skipped 1 malformed rows: 1 x the chat template refuses the row" in prepared.describe(str(path), 64)


def test_rows_whose_earlier_answers_a_template_rewrites_are_counted(tmp_path, ray_local, builtin_model):
    # Qwen3 rewrites earlier turns: of the two multi-turn rows, only the last answer is trained, and the data's
    # summary says how many rows that is; a row of one answer loses nothing and is not counted.
    path = tmp_path / "train.jsonl"
    rows = [{"messages": SYSTEM_TWO_TURNS}, {"messages": REASONING}, {"messages": ONE}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    qwen3 = _prepare(path, builtin_model, (TEMPLATES / f"{QWEN3}.jinja").read_text())
    assert (qwen3.usable_rows, qwen3.last_answer_only) == (3, 2)
    assert "\n  trained on the last answer only: 2 rows (the chat template rewrites earlier turns" in qwen3.describe(
        str(path), 64
    )
    qwen25 = _prepare(path, builtin_model, (TEMPLATES / f"{QWEN25}.jinja").read_text())
    assert qwen25.last_answer_only == 0 and "last answer only" not in qwen25.describe(str(path), 64)


def test_a_given_sample_prompt_the_template_refuses_is_one_message(builtin_model):
    from raytrain_eks.train.prompts import sample_prompts

    tokenizer = copy.deepcopy(encoding_tokenizer(builtin_model))
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system prompt comes first') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(DataError, match="sample_prompts: the chat template refuses a prompt given alone") as err:
        sample_prompts(["Say hi."], None, "chat", "text", tokenizer)
    assert "a system prompt comes first" in err.value.message and "leave training.sample_prompts empty" in (
        err.value.hint or ""
    )
