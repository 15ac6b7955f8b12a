"""The data formats a training row may have, registered once: each is one function from a row to a conversation
(or, for ``text``, none: the row's text is trained whole). Encoding, the sample prompts, the configuration's
validation, the CLI's help and the error hints all read :data:`FORMATS`. Example::

    conv = data_format("sharegpt").conversation({"conversations": [{"from": "human", "value": "Hi"},
                                                                   {"from": "gpt", "value": "Hello"}]})
    conv.messages   # [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]

``training.columns`` renames a data set's fields to the format's (:func:`renamed`), so a file with ``question`` and
``answer`` trains as ``instruction`` data without being rewritten.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


class MalformedRow(ValueError):
    """A row that cannot be used; the message says why (it is counted, not raised to the user)."""

    @classmethod
    def of(cls, exc: Exception) -> MalformedRow:
        """The row whose encoding raised ``exc``, named by its type and first line: one row a tokenizer refuses
        (``could not be encoded (TypeError: ...)``) is counted, and the rest of its file trains."""
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return cls(f"could not be encoded ({type(exc).__name__}{': ' + first if first else ''})")


@dataclass(frozen=True)
class Conversation:
    """Messages (``role``, ``content``; an assistant's ``tool_calls``, a tool's ``tool_call_id``) and the tools
    the conversation may call, handed to the chat template."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class DataFormat:
    """``name``; ``fields``, the row fields it reads (``training.columns`` may map them); ``conversation``, the row as
    a :class:`Conversation` (``None`` for plain text); ``summary``, one line for help and hints."""

    name: str
    fields: tuple[str, ...]
    summary: str
    conversation: Callable[[Mapping[str, Any]], Conversation] | None = field(default=None, compare=False)
    # For preference data: the row's (chosen, rejected) conversations, sharing their prompt.
    pair: Callable[[Mapping[str, Any]], tuple[Conversation, Conversation]] | None = field(default=None, compare=False)


FORMATS: dict[str, DataFormat] = {}


def register(fmt: DataFormat) -> DataFormat:
    FORMATS[fmt.name] = fmt
    return fmt


def data_format(name: str) -> DataFormat:
    """The registered format ``name``; a ``ValueError`` naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown data format {name!r}: use one of {', '.join(FORMATS)}") from None


def formats_help() -> str:
    """``text (text), instruction (instruction, input, output), ...``: every format and the fields it reads."""
    return "; ".join(f"{f.name} ({f.summary})" for f in FORMATS.values())


def renamed(row: Mapping[str, Any], columns: Mapping[str, str] | None) -> Mapping[str, Any]:
    """``row`` with each format field of ``columns`` (format field -> the data's column) read from its column."""
    if not columns or not isinstance(row, Mapping):
        return row
    out = dict(row)
    for fmt_field, column in columns.items():
        if column in row:
            out[fmt_field] = row[column]
    return out


def column_reason(reason: str, columns: Mapping[str, str] | None) -> str:
    """A :class:`MalformedRow` reason with each format field that ``columns`` maps named as the data's column, and
    the mapping: ``missing field 'instruction'`` -> ``missing field 'question' (training.columns: {instruction:
    question})``."""
    if not columns:
        return reason

    def named(match: re.Match[str]) -> str:
        fmt_field = match.group(1)
        column = columns.get(fmt_field)
        if column is None or column == fmt_field:
            return match.group(0)
        return f"field '{column}' (training.columns: {{{fmt_field}: {column}}})"

    return re.sub(r"field '([^']*)'", named, reason)


def field_text(row: Mapping[str, Any], key: str, *, required: bool) -> str:
    """The string in ``row[key]`` ("" when absent and not ``required``); :class:`MalformedRow` otherwise."""
    value = row.get(key)
    if value is None or value == "":
        if required:
            raise MalformedRow(f"missing field '{key}'")
        return ""
    if not isinstance(value, str):
        raise MalformedRow(f"field '{key}' is not a string")
    return value


def content_text(content: Any, role: str) -> str:
    """A message's ``content`` as text: a string as it is, a list of parts (OpenAI's ``{"type": "text", "text": ...}``
    or plain strings) as their texts joined, as chat templates that take parts write them. A part that is not text
    (an image, audio) makes the row malformed: only text is trained."""
    if isinstance(content, str):
        return content
    speaker = f"{'an' if role == 'assistant' else 'a'} {role} message"
    if not isinstance(content, list):
        raise MalformedRow(f"{speaker}'s content is not a string or a list of text parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise MalformedRow(
                f"{speaker}'s content holds a part of type {kind!r}: only text is trained (give the row's "
                "text parts only, or leave the row out)"
            )
        if not isinstance(part.get("text"), str):
            raise MalformedRow(f"a text part of {speaker}'s content has no string 'text'")
        texts.append(part["text"])
    return "".join(texts)


def _needs_an_answer(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not any(m["role"] == "assistant" for m in messages):
        raise MalformedRow("no assistant message to learn from")
    return messages


def instruction_conversation(row: Mapping[str, Any]) -> Conversation:
    """An alpaca-style row (instruction, optional input, output) as a user/assistant conversation."""
    instruction = field_text(row, "instruction", required=True)
    extra = field_text(row, "input", required=False)
    output = field_text(row, "output", required=True)
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return Conversation([{"role": "user", "content": prompt}, {"role": "assistant", "content": output}])


def chat_conversation(row: Mapping[str, Any]) -> Conversation:
    """The ``messages`` of a chat row, checked: roles system/user/assistant, text contents (a string, or text parts:
    :func:`content_text`), an assistant turn."""
    messages = row.get("messages")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MalformedRow("missing field 'messages' (a list of {role, content})")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str | list):
            raise MalformedRow("a message is not {role: system|user|assistant, content: string or text parts}")
        out.append({"role": m["role"], "content": content_text(m["content"], m["role"])})
    return Conversation(_needs_an_answer(out))


# The speaker names ShareGPT files use (FastChat's, and the user/assistant variants other tools write).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def sharegpt_conversation(row: Mapping[str, Any]) -> Conversation:
    """``conversations`` of ``{from, value}``: ``human``/``user``, ``gpt``/``assistant`` and ``system``."""
    turns = row.get("conversations")
    if not isinstance(turns, (list, tuple)) or not turns:
        raise MalformedRow("missing field 'conversations' (a list of {from, value})")
    out = []
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get("value"), str):
            raise MalformedRow("a turn is not {from, value: string}")
        role = SHAREGPT_ROLES.get(str(t.get("from", "")).lower())
        if role is None:
            raise MalformedRow(f"a turn is from {t.get('from')!r}, not one of {', '.join(SHAREGPT_ROLES)}")
        out.append({"role": role, "content": t["value"]})
    return Conversation(_needs_an_answer(out))


def openai_conversation(row: Mapping[str, Any]) -> Conversation:
    """OpenAI's chat fine-tuning rows: ``messages`` of system, user, assistant (``content``, or ``tool_calls``
    with ``content`` null) and ``tool`` (``tool_call_id``, ``content``) turns, and an optional ``tools`` list. A
    ``content`` of text parts is read as its text (:func:`content_text`)."""
    messages = row.get("messages")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MalformedRow("missing field 'messages' (a list of {role, content})")
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else None
        if role not in (*ROLES, "tool"):
            raise MalformedRow(f"a message's role is {role!r}, not one of system, user, assistant, tool")
        content = m.get("content")
        calls = m.get("tool_calls") if role == "assistant" else None
        msg: dict[str, Any] = {
            "role": role,
            "content": "" if content is None and calls else content_text(content, role),
        }
        if calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and "function" in c for c in calls):
                raise MalformedRow("an assistant's tool_calls are not a list of {function: {name, arguments}}")
            msg["tool_calls"] = [_tool_call(c) for c in calls]
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise MalformedRow("'tools' is not a list of tool definitions")
    return Conversation(_needs_an_answer(out), tools or None)


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call with its arguments as an object (OpenAI's rows hold them as a JSON string; chat templates
    such as Qwen2.5's write them out as JSON themselves)."""
    fn = call["function"]
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise MalformedRow("a tool call's function has no name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            raise MalformedRow(f"the arguments of tool call {fn['name']!r} are not JSON") from None
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if "id" in call:
        out["id"] = str(call["id"])
    return out


def _preference_messages(value: Any, key: str) -> list[dict[str, Any]]:
    """``row[key]`` as checked messages: a string is one message (the prompt's user turn, or an answer); a list is
    read as chat messages of roles system/user/assistant with text contents."""
    role = "user" if key == "prompt" else "assistant"
    if isinstance(value, str) and value:
        return [{"role": role, "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise MalformedRow(f"missing field '{key}' (a string, or a list of {{role, content}})")
    out = []
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str | list):
            raise MalformedRow(f"a message of '{key}' is not {{role: system|user|assistant, content}}")
        out.append({"role": m["role"], "content": content_text(m["content"], m["role"])})
    return out


def _prompt_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages before the last run of assistant messages: the prompt they answer."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]


def preference_pair(row: Mapping[str, Any]) -> tuple[Conversation, Conversation]:
    """A preference row as its (chosen, rejected) conversations, as TRL's preference format lays it out: ``prompt``
    (a string, or messages) with ``chosen`` and ``rejected`` answers (strings, or assistant messages); or, as
    UltraFeedback binarized does, ``chosen`` and ``rejected`` whole conversations that share their prompt (a string
    ``prompt`` beside them is then only a copy of it). A text prompt and answers train as a user/assistant exchange
    through the chat template, as ``instruction`` rows do."""
    chosen = _needs_an_answer(_preference_messages(row.get("chosen"), "chosen"))
    rejected = _needs_an_answer(_preference_messages(row.get("rejected"), "rejected"))
    implicit = [_prompt_of(chosen), _prompt_of(rejected)]
    if implicit[0] or implicit[1]:
        if implicit[0] != implicit[1]:
            raise MalformedRow("'chosen' and 'rejected' do not share their prompt (the messages before the answer)")
        prompt: list[dict[str, Any]] = []
    else:
        prompt = _preference_messages(row.get("prompt"), "prompt")
    return Conversation([*prompt, *chosen]), Conversation([*prompt, *rejected])


register(DataFormat("text", ("text",), "a text field, trained whole; training.text_field names it"))
register(
    DataFormat(
        "instruction",
        ("instruction", "input", "output"),
        "instruction, optional input, output",
        instruction_conversation,
    )
)
register(DataFormat("chat", ("messages",), "messages of {role: system|user|assistant, content}", chat_conversation))
register(
    DataFormat(
        "sharegpt",
        ("conversations",),
        "conversations of {from: human|gpt|system (or user|assistant), value}",
        sharegpt_conversation,
    )
)
register(
    DataFormat(
        "openai",
        ("messages", "tools"),
        "messages of system/user/assistant/tool turns with tool_calls, and an optional tools list",
        openai_conversation,
    )
)
register(
    DataFormat(
        "preference",
        ("prompt", "chosen", "rejected"),
        "prompt with chosen and rejected answers (text or messages), or chosen/rejected conversations sharing a "
        "prompt (UltraFeedback binarized); for training.method dpo, or the chosen answer for sft",
        lambda row: preference_pair(row)[0],
        preference_pair,
    )
)
FORMAT_NAMES = tuple(FORMATS)
