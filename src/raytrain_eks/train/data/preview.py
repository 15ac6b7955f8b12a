"""What the model will be trained on, before any cluster or GPU: the data prepared exactly as ``train`` prepares it
(:func:`~raytrain_eks.train.data.pipeline.prepare_for`, the same settings and held-out rows), its counts, and the first
packed blocks with the tokens that train marked (``raytrain-eks data``). Example::

    shown = preview_data(cfg, show=2)
    shown.counts["packing_efficiency"], render_block(shown.blocks[0], tokenizer, marks="brackets")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from raytrain_eks.config import Config
from raytrain_eks.errors import UserError
from raytrain_eks.train.data.encoding import IGNORE_INDEX
from raytrain_eks.train.data.packing import block_documents


@dataclass(frozen=True)
class ShownBlock:
    """One packed block as the model gets it: ``labels`` is -100 where a token is not trained; ``documents`` are its
    rows as (start, length); the positions from ``filled`` on are padding. ``pairs``: the documents are preference
    pairs, each chosen answer's followed by its rejected one's (method dpo)."""

    index: int
    input_ids: list[int]
    labels: list[int]
    documents: list[tuple[int, int]]
    filled: int
    pairs: bool = False

    def to_json(self) -> dict[str, Any]:
        shown: dict[str, Any] = {
            "index": self.index,
            "input_ids": self.input_ids,
            "labels": self.labels,
            "documents": [{"start": s, "length": n} for s, n in self.documents],
            "filled": self.filled,
        }
        if self.pairs:  # documents 2k and 2k + 1: a pair's chosen and rejected encodings
            shown["pairs"] = [{"chosen": 2 * k, "rejected": 2 * k + 1} for k in range(len(self.documents) // 2)]
        return shown


@dataclass(frozen=True)
class DataPreview:
    """The counts of :meth:`~.pipeline.PreparedData.counts` and the first packed blocks (their stored
    order; each epoch walks the blocks in an order drawn from the seed)."""

    data: str
    counts: dict[str, Any]
    blocks: list[ShownBlock]
    line: str  # the run's own data line (PreparedData.describe)
    tokenizer_path: str
    chat_template: str | None

    def to_json(self) -> dict[str, Any]:
        return {"data": self.data, **self.counts, "shown_blocks": [b.to_json() for b in self.blocks]}


def preview_data(
    cfg: Config, *, show: int, verbose: bool = False, say: Callable[[str], None] | None = None
) -> DataPreview:
    """``cfg``'s training data prepared as ``train`` prepares it, and its first ``show`` packed blocks.

    Small local data is prepared in this process with no Ray at all; data on ``s3://`` or over
    :data:`~.pipeline.DRIVER_PREP_BYTES` goes through Ray Data's tasks on a Ray started here for the
    purpose (and stopped after), as a local ``train`` would. ``say`` hears what is being done.
    """
    from raytrain_eks.train.data.pipeline import first_blocks, prepare_for, prepared_in_driver
    from raytrain_eks.train.data.sources import list_data_files
    from raytrain_eks.train.launch import data_source, with_chat_template_text
    from raytrain_eks.train.model_source import resolve_model_path

    if show < 0:
        raise UserError(f"--show {show}: give a number of blocks, 0 or more")
    cfg = with_chat_template_text(cfg)
    training = cfg.training
    if training.uses_random_data:
        raise UserError(
            "training.data is 'random': synthetic token ids, no rows to show",
            hint="Give the data to look at: --data FILE|FOLDER|s3://...|hf:OWNER/NAME, or builtin:sample-instructions.",
        )
    source = data_source(cfg)
    listed = list_data_files(source)
    model_path = resolve_model_path(training.model_id)
    in_driver = prepared_in_driver(listed[0])
    given = {"data": source, "listed": listed, "min_blocks": 1, "eval_fraction": training.effective_eval_fraction}
    with _ray_if(not in_driver, verbose):
        prepared = prepare_for(training, model_path, in_driver=in_driver, ray_dataset=not in_driver, stage=say, **given)
        shown = first_blocks(prepared.dataset, show) if show else {}
    blocks = []
    for i in range(len(shown.get("input_ids", []))):
        filled = int(shown["filled"][i])
        positions = shown.get("position_ids")
        documents = block_documents(positions[i], filled) if positions is not None else [(0, filled)]
        blocks.append(
            ShownBlock(
                index=i,
                input_ids=[int(t) for t in shown["input_ids"][i]],
                labels=[int(t) for t in shown["labels"][i]],
                documents=documents,
                filled=filled,
                pairs=training.preference,
            )
        )
    return DataPreview(
        data=training.data,
        counts=prepared.counts(),
        blocks=blocks,
        line=prepared.describe(training.data),
        tokenizer_path=model_path,
        chat_template=training.chat_template,
    )


@contextlib.contextmanager
def _ray_if(needed: bool, verbose: bool) -> Iterator[None]:
    """A Ray of this process's own while inside, when ``needed`` and none runs yet; stopped after."""
    import ray

    if not needed or ray.is_initialized():
        yield
        return
    from raytrain_eks.ray_session import init_ray

    init_ray(None, 1, verbose)
    try:
        yield
    finally:
        ray.shutdown()


Marks = Literal["colour", "brackets"]
OPEN, CLOSE = "[[", "]]"  # around trained tokens when the output is not a terminal


def render_block(block: ShownBlock, tokenizer: Any, *, marks: Marks) -> Any:
    """``block`` as text a person reads: each row's tokens decoded, the trained ones marked (green in a terminal,
    between ``[[`` and ``]]`` otherwise), with a line naming each row and the padding. Returns a
    :class:`rich.text.Text` (styles are dropped where the output is no terminal)."""
    from rich.text import Text

    out = Text()
    trained_total = sum(1 for t in block.labels if t != IGNORE_INDEX)
    seq_len = len(block.input_ids)
    count, unit = (len(block.documents) // 2, "pair") if block.pairs else (len(block.documents), "row")
    out.append(
        f"block {block.index}: {count} {unit}{'s' if count != 1 else ''}, "
        f"{block.filled} of {seq_len} positions filled, {trained_total} tokens trained\n",
        style="bold",
    )
    if block.pairs:
        _render_pairs(block, tokenizer, marks, out)
    for n, (start, length) in enumerate([] if block.pairs else block.documents, 1):
        labels = np.asarray(block.labels[start : start + length])
        trained = int((labels != IGNORE_INDEX).sum())
        out.append(
            f"-- row {n}: positions {start}-{start + length - 1}, {length} tokens, {trained} trained\n", style="dim"
        )
        _append_marked(out, tokenizer, _spans(block.input_ids[start : start + length], labels), marks)
        out.append("\n")
    if block.filled < seq_len:
        out.append(f"-- padding: {seq_len - block.filled} positions (not trained)\n", style="dim")
    return out


def _render_pairs(block: ShownBlock, tokenizer: Any, marks: Marks, out: Any) -> None:
    """The preference pairs of ``block`` into ``out``: each pair's prompt once (both answers share it), then the
    chosen and the rejected answer, the tokens the loss scores marked."""
    for n, k in enumerate(range(0, len(block.documents) - 1, 2), 1):
        (c_start, c_length), (r_start, r_length) = block.documents[k], block.documents[k + 1]
        chosen = np.asarray(block.labels[c_start : c_start + c_length])
        prompt = int(np.argmax(chosen != IGNORE_INDEX)) if (chosen != IGNORE_INDEX).any() else c_length
        out.append(
            f"-- pair {n}: positions {c_start}-{r_start + r_length - 1}, prompt {prompt} tokens, chosen "
            f"{c_length - prompt}, rejected {r_length - prompt}\n",
            style="dim",
        )
        out.append("prompt: " + tokenizer.decode(block.input_ids[c_start : c_start + prompt]) + "\n")
        for name, start, length in (("chosen", c_start, c_length), ("rejected", r_start, r_length)):
            out.append(f"{name}: ", style="bold")
            answer = slice(start + prompt, start + length)
            _append_marked(out, tokenizer, _spans(block.input_ids[answer], np.asarray(block.labels[answer])), marks)
            out.append("\n")


def _append_marked(out: Any, tokenizer: Any, spans: Iterator[tuple[bool, list[int]]], marks: Marks) -> None:
    """Each span of tokens decoded into ``out``, the trained ones marked as :func:`render_block` says."""
    for is_trained, span in spans:
        text = tokenizer.decode(span)
        if not is_trained:
            out.append(text)
        elif marks == "colour":
            out.append(text, style="bold green")
        else:
            out.append(f"{OPEN}{text}{CLOSE}")


def _spans(ids: list[int], labels: np.ndarray) -> Iterator[tuple[bool, list[int]]]:
    """Runs of consecutive tokens that are all trained or all not, in order."""
    if not ids:
        return
    flags = labels != IGNORE_INDEX
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or flags[i] != flags[start]:
            yield bool(flags[start]), ids[start:i]
            start = i
