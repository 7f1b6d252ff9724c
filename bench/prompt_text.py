"""Prompt text the jobs API accepts: synthesised token ids decoded to safe text, and prompts of plain words.

The API refuses a prompt with NUL (U+0000) or lone surrogates (core/protocol/request_rules.py `text_problem`:
the store could not serve them back). Random token ids of a byte-level tokenizer decode to any byte, NUL and
other control characters included, so decoded prompts are made safe here rather than checked: every C0/C1
control character and lone surrogate becomes a space. So does U+FFFD, what a byte that is not UTF-8 on its
own decodes to: sent as is, it comes back as three bytes (three tokens for a byte-level tokenizer), and
prompts grew by half. A space is about one token, as the byte was, so the prompt keeps about the requested
length (tests/bench/test_prompt_text.py measures both).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

# C0 controls, DEL, C1 controls, the surrogate range (only lone ones can occur in a Python str), U+FFFD.
_REPLACED = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufffd]")
FALLBACK = "hello"  # for a prompt that is nothing but unsafe characters: the API refuses an empty one

# Common short English words: each is about one token for any English tokenizer, and needs no tokenizer.
WORDS = (
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with",
    "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "hot", "word", "but",
    "what", "some", "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how",
    "said", "an", "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many",
    "then", "them", "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him",
    "two", "has", "look", "more", "day", "could", "go", "come", "did", "number", "sound", "no", "most",
    "people", "my", "over", "know", "water", "than", "call", "first", "who", "may", "down", "side", "been",
    "now", "find",
)


def safe_text(text: str) -> str:
    """`text` with control characters, lone surrogates and U+FFFD replaced by spaces; never blank."""
    cleaned = _REPLACED.sub(" ", text)
    return cleaned if cleaned.strip() else FALLBACK


def word_prompt(rng: random.Random, num_words: int) -> str:
    """A prompt of `num_words` ordinary words, drawn from `rng` (seeded by the caller)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def token_decoder(model: str) -> Callable[[list[int]], str]:
    """Turns synthesised prompt token ids into safe text with `model`'s tokenizer."""
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(model)
    return lambda ids: safe_text(tok.decode(ids, skip_special_tokens=True))
