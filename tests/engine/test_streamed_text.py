"""A request's text as it grows step by step: every step's text continues the last (a character whose bytes
arrive in several tokens is held back until whole), and the final text is the decode of every generated id,
a character cut off by the end included (as U+FFFD, as the decoder writes it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.engine.tokenizer import IncrementalDetokenizer, Tokenizer

SPLIT = "queues ☕"  # the cup's three UTF-8 bytes are three byte-fallback tokens of the tiny tokenizer


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def test_a_character_cut_off_by_the_end_is_flushed_as_the_decoder_writes_it(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(SPLIT, add_special_tokens=False)
    assert len(tokenizer.decode(ids[-1:])) == 1, "the cup should end in a byte token of its own"
    cut = ids[:-1]  # the cup's last byte never comes
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.step(cut[: i + 1]) for i in range(len(cut))]
    assert "\ufffd" not in "".join(deltas)  # held back while incomplete
    assert "".join(deltas) + detok.flush(cut) == detok.text == tokenizer.decode(cut)
    assert detok.text.endswith("\ufffd") and detok.flush(cut) == ""


def test_every_step_continues_the_text_and_the_end_is_the_full_decode(llama_dir: Path,
                                                                      tokenizer: Tokenizer) -> None:
    """A random-weight model writes bytes in any order: some requests end inside a character."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=256))
    for i in range(24):
        engine.add_request(f"r{i}", f"Hello {i}", SamplingParams(max_tokens=40, temperature=1.0, seed=i))
    texts: dict[str, str] = {}
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.text.startswith(texts.get(out.request_id, "")), out.request_id
            texts[out.request_id] = out.text
            if out.finished:
                finished[out.request_id] = out
    assert len(finished) == 24
    for out in finished.values():
        assert out.text == tokenizer.decode(out.token_ids), out.request_id
    assert any(out.text.endswith("\ufffd") for out in finished.values()), "no request ended mid-character"
