"""Prompts sent over HTTP are text the jobs API accepts: synthesised token ids of the tiny preset's byte-level
tokenizer decode to NUL and other control characters, which the API refuses."""

from __future__ import annotations

import random
import unicodedata

import pytest
from transformers import AutoTokenizer

from conveyor.bench.cli import resolve_model
from conveyor.bench.experiment import vocab_ids
from conveyor.bench.prompt_text import FALLBACK, WORDS, safe_text, token_decoder, word_prompt
from conveyor.bench.workload import Range, WorkloadSpec, generate

SEEDS = range(200)


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory: pytest.TempPathFactory) -> str:
    model = resolve_model("preset:tiny", tmp_path_factory.mktemp("bench-models"))
    assert model is not None
    return model


def _control_or_surrogate(text: str) -> list[str]:
    return [c for c in text if unicodedata.category(c) in ("Cc", "Cs")]


def test_synthesised_prompts_never_hold_control_characters(tiny_preset: str) -> None:
    vocab, decode = vocab_ids(tiny_preset), token_decoder(tiny_preset)
    tok = AutoTokenizer.from_pretrained(tiny_preset)
    raw_with_nul, asked, got = 0, 0, 0
    for seed in SEEDS:
        spec = WorkloadSpec(profile="short", num_requests=4, seed=seed, short_prompt=Range(16, 96))
        for req in generate(spec, vocab, 2048):
            ids = list(req.prompt_token_ids or [])
            raw_with_nul += "\x00" in tok.decode(ids, skip_special_tokens=True)
            text = decode(ids)
            assert text.strip() and not _control_or_surrogate(text), (seed, req.request_id, text)
            text.encode("utf-8")  # no lone surrogates: valid Unicode
            asked += len(ids)
            got += len(tok(text, add_special_tokens=False)["input_ids"])
    assert raw_with_nul > 20  # the test means something: the bare decode had NULs
    assert 0.8 <= got / asked <= 1.2  # about the requested length once re-tokenized by the service


def test_safe_text_replaces_every_unsafe_character() -> None:
    assert safe_text("a\x00b\x1fc\x7fd\x85e\udfff\ufffdf\tg\nh") == "a b c d e  f g h"
    assert safe_text("caf\u00e9 \u4e2d\u6587 \U0001f600") == "caf\u00e9 \u4e2d\u6587 \U0001f600"
    assert safe_text("\x00\x01") == FALLBACK and safe_text("") == FALLBACK


def test_word_prompts_are_seeded_plain_words() -> None:
    text = word_prompt(random.Random(3), 9)
    assert text == word_prompt(random.Random(3), 9)
    assert len(text.split()) == 9 and all(w in WORDS for w in text.split())
    assert safe_text(text) == text
