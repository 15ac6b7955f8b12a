"""Encoding a row: a format's text or conversation into token ids and labels, prompt tokens masked.

:func:`encode_row` turns one row of a registered format (:mod:`raytrain_eks.formats`) into ``input_ids`` and
``labels``, where the tokens no loss is taken on carry :data:`IGNORE_INDEX`. Conversations go through the
tokenizer's chat template (or ``training.chat_template``, :func:`encoding_tokenizer`): a template with
``{% generation %}`` blocks marks the assistant's tokens itself; otherwise the conversation is rendered prefix by
prefix (:func:`_segments`), and a template that rewrites earlier turns has its last answer trained
(:func:`_last_answer`). Text rows, and conversations in the plain layout used without a template, start with the
tokenizer's BOS token where it adds one on its own (:func:`leading_bos`); a template writes its own. A row that does
not fit raises :class:`MalformedRow` with the reason.

Example::

    ids, labels = encode_row({"instruction": "Add 1 and 2.", "output": "3"}, "instruction", load_tokenizer(path))
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_eks.errors import DataError
from raytrain_eks.formats import Conversation, MalformedRow, column_reason, field_text, renamed
from raytrain_eks.formats import data_format as registered_format

IGNORE_INDEX = -100


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    """The tokenizer of a model (hub id or folder), loaded once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@functools.lru_cache(maxsize=4)
def encoding_tokenizer(path: str, chat_template: str | None = None) -> Any:
    """:func:`load_tokenizer`'s tokenizer with ``chat_template`` (Jinja text) in place of its own, when given (a copy:
    the cached tokenizer is shared)."""
    import copy

    tokenizer = load_tokenizer(path)
    if chat_template is None:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = chat_template
    return tokenizer


def chat_template_text(value: str | None, option: str = "training.chat_template") -> str | None:
    """The Jinja text of ``training.chat_template``: the value itself when it is a template (it holds ``{%`` or
    ``{{``), else the file it names; :class:`DataError` for a file that cannot be read."""
    if not value or "{%" in value or "{{" in value:
        return value or None
    path = Path(value).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DataError(
            f"{option} {value!r}: cannot read the template file ({exc.strerror or exc})",
            hint="Name a .jinja file, or give the template itself (YAML block text holding {% ... %}).",
        ) from None
    if "{%" not in text and "{{" not in text:
        raise DataError(f"{option} {value!r}: the file holds no Jinja template (no {{% or {{{{)")
    return text


def leading_bos(tokenizer: Any) -> list[int]:
    """``[bos_token_id]`` when the tokenizer starts what it encodes with its BOS token on its own (Llama 3's and
    Gemma's do), else ``[]`` (Qwen2's has none). A model of such a tokenizer saw every text begin with it."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    return [bos] if tokenizer("x")["input_ids"][:1] == [bos] else []


def text_start(tokenizer: Any) -> str:
    """The text a row or prompt without a chat template starts with: the BOS token's, where :func:`leading_bos`
    finds one, else ``""``."""
    return str(tokenizer.bos_token) if leading_bos(tokenizer) else ""


# A chat template that marks what the assistant writes: transformers then gives each token's mask itself.
_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


def _render(tokenizer: Any, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool = False) -> str:
    """The chat template's rendering of ``msgs``; a template that refuses them (its own ``raise_exception``, or a
    failure inside it) makes the row malformed, with the template's reason."""
    if not msgs:
        return ""
    extra = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **extra)
    except Exception as exc:  # jinja2's TemplateError, or a TypeError on a field the template cannot take
        raise MalformedRow(f"the chat template refuses the row: {str(exc).strip() or type(exc).__name__}") from None


def _masked_by_template(
    messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None
) -> tuple[list[int], list[int]]:
    """Token ids and labels from a template with ``{% generation %}`` blocks: the tokens it marks as the
    assistant's (``return_assistant_tokens_mask``) are trained, all others masked."""
    extra = {"tools": tools} if tools else {}
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **extra
        )
    except Exception as exc:
        raise MalformedRow(f"the chat template refuses the row: {str(exc).strip() or type(exc).__name__}") from None
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if not any(mask):
        raise MalformedRow("the chat template marks no assistant tokens in the row")
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]


def _segments(
    messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None = None
) -> list[tuple[str, bool]]:
    """Split a conversation into (text, trained) pieces; only assistant answers are trained (:func:`_split`)."""
    return _split(messages, tokenizer, tools)[0]


def _split(
    messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None = None
) -> tuple[list[tuple[str, bool]], bool]:
    """A conversation as (text, trained) pieces, only assistant answers trained, and whether the template rewrote
    earlier turns, so that only the last answer is trained.

    With a chat template, each piece is the difference between renderings of growing prefixes of the
    conversation, so the pieces add up to exactly the template's rendering. A template that rewrites earlier
    turns once later ones follow (Qwen3 drops the reasoning of earlier answers, Mistral Nemo moves the system prompt
    into the last user message) renders no such prefixes: then the last answer is trained, found between its
    prompt and its end in the whole rendering, and the earlier turns are its context (:func:`_last_answer`).
    Without a template, a plain ``role: content`` layout is used (an assistant's tool calls written as JSON), after
    the BOS token where the tokenizer adds one on its own (:func:`text_start`), and the answer ends with the EOS
    token. ``tools`` (OpenAI-style tool definitions) go to the chat template.
    """
    if getattr(tokenizer, "chat_template", None):
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, msg in enumerate(messages):
            if msg["role"] == "assistant":
                prompt = _render(tokenizer, messages[:i], tools, gen=True)
                full = _render(tokenizer, messages[: i + 1], tools)
                if not prompt.startswith(done) or not full.startswith(prompt):
                    return _last_answer(messages, tokenizer, tools), True
                pieces += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
            else:
                full = _render(tokenizer, messages[: i + 1], tools)
                if not full.startswith(done):
                    return _last_answer(messages, tokenizer, tools), True
                pieces.append((full[len(done) :], False))
            done = full
        return pieces, False
    eos = tokenizer.eos_token or ""
    start = text_start(tokenizer)
    pieces = [(start, False)] if start else []
    for msg in messages:
        content = msg["content"]
        if msg.get("tool_calls"):
            content = (content + "\n" if content else "") + json.dumps(msg["tool_calls"], ensure_ascii=False)
        if msg["role"] == "assistant":
            pieces += [("assistant: ", False), (content + eos + "\n", True)]
        else:
            pieces.append((f"{msg['role']}: {content}\n", False))
    return pieces, False


_ANSWER_MARK = "\u27e6raytrain-eks answer\u27e7"  # stands in for the last answer's text (see _last_answer)


def _last_answer(
    messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None
) -> list[tuple[str, bool]]:
    """The pieces of a conversation whose template rewrites earlier turns: the whole rendering, with only the
    last assistant answer trained (its text and the end of its turn). The answer is found between the rendering
    of what precedes it (with the generation prompt) and the rendering that ends with it; where the template renders
    those otherwise than within the whole (Mistral Nemo writes the system prompt only into a conversation that ends
    with the user), by rendering the whole with a mark in place of the answer's text. A row where neither finds
    it is malformed."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise MalformedRow("the row has no assistant turn")
    whole = _render(tokenizer, messages, tools)
    prompt = _render(tokenizer, messages[:last], tools, gen=True)
    answered = _render(tokenizer, messages[: last + 1], tools)
    if answered.startswith(prompt) and whole.startswith(answered):
        return [(prompt, False), (answered[len(prompt) :], True), (whole[len(answered) :], False)]
    marked = [*messages[:last], {**messages[last], "content": _ANSWER_MARK}, *messages[last + 1 :]]
    shown = _render(tokenizer, marked, tools)
    ended = _render(tokenizer, marked[: last + 1], tools)
    if shown.count(_ANSWER_MARK) == 1 and ended.count(_ANSWER_MARK) == 1:
        before, after = shown.split(_ANSWER_MARK)
        turn_end = ended.split(_ANSWER_MARK)[1]
        turn_end = turn_end if after.startswith(turn_end) else ""
        if whole.startswith(before) and whole.endswith(after) and len(whole) >= len(before) + len(after):
            text = whole[len(before) : len(whole) - len(after)]
            return [(before, False), (text + turn_end, True), (after[len(turn_end) :], False)]
    raise MalformedRow("the tokenizer's chat template does not render the last answer where it can be found")


@dataclass(frozen=True)
class Encoded:
    """One encoded row: token ids, labels (:data:`IGNORE_INDEX` where no loss is taken), and whether the chat
    template rewrote earlier turns, so that of several answers only the last is trained (:func:`_last_answer`)."""

    ids: list[int]
    labels: list[int]
    last_answer_only: bool = False
    split: int = 0  # a preference pair joined (:func:`encode_joined_pair`): where the rejected encoding starts


def encode_row(
    row: dict[str, Any],
    data_format: str,
    tokenizer: Any,
    text_field: str = "text",
    columns: dict[str, str] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and labels of one row; labels are :data:`IGNORE_INDEX` on prompt tokens.

    >>> ids, labels = encode_row({"instruction": "Add 1 and 2.", "output": "3"}, "instruction", tok)
    The format comes from :mod:`raytrain_eks.formats`; ``columns`` maps its fields to the row's. Raises
    :class:`MalformedRow` when the row does not fit the format.
    """
    encoded = encode(row, data_format, tokenizer, text_field, columns)
    return encoded.ids, encoded.labels


def encode(
    row: dict[str, Any],
    data_format: str,
    tokenizer: Any,
    text_field: str = "text",
    columns: dict[str, str] | None = None,
) -> Encoded:
    """:func:`encode_row`'s ids and labels, and whether earlier answers were left untrained (:class:`Encoded`)."""
    if not isinstance(row, dict):
        raise MalformedRow("the row is not a JSON object")
    fmt = registered_format(data_format)
    fields = renamed(row, columns)
    try:  # a field read from a column of training.columns is named as the data names it
        conversation = None if fmt.conversation is None else fmt.conversation(fields)
        text = field_text(fields, text_field, required=True) if conversation is None else ""
    except MalformedRow as exc:
        raise MalformedRow(column_reason(str(exc), columns)) from None
    if conversation is None:
        # The text as the model read text in pre-training: after the BOS token its tokenizer puts first (never a
        # label: nothing in the row predicts it), and trained up to its EOS token.
        start = leading_bos(tokenizer)
        body: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        if start and body[:1] == start:  # the text begins with the BOS token's own text
            body = body[1:]
        end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return Encoded(start + body + end, [IGNORE_INDEX] * len(start) + body + end)
    return _encoded_conversation(conversation, tokenizer)


def _encoded_conversation(conversation: Conversation, tokenizer: Any) -> Encoded:
    """A conversation's ids and labels through the chat template, only the assistant's tokens trained."""
    if _GENERATION_BLOCK.search(getattr(tokenizer, "chat_template", None) or ""):
        return Encoded(*_masked_by_template(conversation.messages, tokenizer, conversation.tools))
    ids: list[int] = []
    labels: list[int] = []
    pieces, rewritten = _split(conversation.messages, tokenizer, conversation.tools)
    for piece_text, trained in pieces:
        piece = tokenizer(piece_text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    if not ids:
        raise MalformedRow("the row has no tokens")
    answers = sum(m["role"] == "assistant" for m in conversation.messages)
    return Encoded(ids, labels, last_answer_only=rewritten and answers > 1)


def encode_pair(
    row: dict[str, Any], data_format: str, tokenizer: Any, columns: dict[str, str] | None = None
) -> tuple[Encoded, Encoded]:
    """A preference row's chosen and rejected encodings: the same prompt tokens, masked, then each answer, trained.

    >>> chosen, rejected = encode_pair({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "preference", tok)
    :class:`MalformedRow` for a row that does not fit, or a format that holds no pairs."""
    if not isinstance(row, dict):
        raise MalformedRow("the row is not a JSON object")
    fmt = registered_format(data_format)
    if fmt.pair is None:
        raise MalformedRow(f"the {data_format} format holds no chosen/rejected pairs (use --data-format preference)")
    try:
        chosen, rejected = fmt.pair(renamed(row, columns))
    except MalformedRow as exc:
        raise MalformedRow(column_reason(str(exc), columns)) from None
    return _encoded_conversation(chosen, tokenizer), _encoded_conversation(rejected, tokenizer)


def encode_joined_pair(
    row: dict[str, Any], data_format: str, tokenizer: Any, columns: dict[str, str] | None = None
) -> Encoded:
    """:func:`encode_pair`'s two encodings as one row, chosen then rejected, with ``split`` where the rejected one
    starts: the pipeline shuffles and counts a pair as one row, and :func:`~.packing.pack_table`'s layout puts its
    two documents side by side in one block.

    >>> joined = encode_joined_pair({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "preference", tok)
    >>> joined.ids[joined.split :] == encode_pair(...)[1].ids
    """
    chosen, rejected = encode_pair(row, data_format, tokenizer, columns)
    return Encoded(
        chosen.ids + rejected.ids,
        chosen.labels + rejected.labels,
        last_answer_only=chosen.last_answer_only or rejected.last_answer_only,
        split=len(chosen.ids),
    )
