"""The quoting profile's tasks: user messages whose right answer copies spans of the message itself, the
work n-gram and suffix speculation draft from. Three kinds, drawn in turn:

- invoice: a purchase order (bench/invoices.py); "list every part number with its unit price";
- rewrite: a paragraph (bench/sentences.py); "rewrite it with one named word replaced by another, keeping
  everything else the same";
- summary: a few paragraphs of notes; "summarise them, quoting sentences word for word".

Each task keeps the strings of its message that a right answer copies (`quoted`), so tests can check the
message holds them. The documents' token counts are drawn by the caller (`num_tokens`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from conveyor.bench.invoices import order
from conveyor.bench.sentences import PLACES, THINGS, CountFn, sentences

KINDS = ("invoice", "rewrite", "summary")
SUMMARY_PARAGRAPH = 4  # sentences per paragraph of the summary task's notes


@dataclass(frozen=True)
class CopyTask:
    kind: str  # one of KINDS
    message: str  # the user's turn: the instruction, a blank line, the document
    quoted: tuple[str, ...]  # spans of the message a right answer copies verbatim


def copy_task(kind: str, rng: random.Random, num_tokens: int, count: CountFn) -> CopyTask:
    """A task of `kind` whose document holds about `num_tokens` tokens (at least that many)."""
    if kind == "invoice":
        return invoice_task(rng, num_tokens, count)
    if kind == "rewrite":
        return rewrite_task(rng, num_tokens, count)
    if kind == "summary":
        return summary_task(rng, num_tokens, count)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def invoice_task(rng: random.Random, num_tokens: int, count: CountFn) -> CopyTask:
    doc = order(rng, num_tokens, count)
    instruction = (
        "List every part number in the purchase order below with its unit price, one per line, written "
        "as PART NUMBER: PRICE. Copy both exactly as they appear."
    )
    quoted = tuple(s for line in doc.lines for s in (line.part_number, line.unit_price))
    return CopyTask("invoice", f"{instruction}\n\n{doc.text}", quoted)


def rewrite_task(rng: random.Random, num_tokens: int, count: CountFn) -> CopyTask:
    paragraph = " ".join(sentences(rng, num_tokens, count))
    present = [t for t in THINGS if _has_word(paragraph, t)]
    old = rng.choice(present)  # every template names a thing: never empty
    new = rng.choice([t for t in THINGS if t not in present] or [f"red {old}"])
    instruction = (
        f'Rewrite the paragraph below, replacing every "{old}" with "{new}". Keep everything else exactly '
        "the same: the same words, in the same order, with the same punctuation."
    )
    return CopyTask("rewrite", f"{instruction}\n\n{paragraph}", (paragraph,))


def summary_task(rng: random.Random, num_tokens: int, count: CountFn) -> CopyTask:
    said = sentences(rng, num_tokens, count, least=SUMMARY_PARAGRAPH)
    paragraphs = [" ".join(said[i:i + SUMMARY_PARAGRAPH]) for i in range(0, len(said), SUMMARY_PARAGRAPH)]
    title = f"Notes from a meeting at {rng.choice(PLACES)}"
    instruction = (
        "Summarise the notes below in four or five sentences. Quote at least three of their sentences "
        "word for word, each in double quotation marks."
    )
    text = "\n\n".join([title, *paragraphs])
    return CopyTask("summary", f"{instruction}\n\n{text}", tuple(said))


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text) is not None
