from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def test_encode_decode_round_trip_and_eos(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Good morning! How are you today?")
    assert ids[0] == 1  # BOS from the tokenizer's own settings
    assert tokenizer.decode(ids) == "Good morning! How are you today?"
    assert 2 in tokenizer.eos_token_ids


def test_incremental_detokenizer_matches_a_full_decode(tokenizer: Tokenizer) -> None:
    text = "Dates: 2024-05-01, café ☕ and queues."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_text_keeps_special_tokens_only_when_asked(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("queues", add_special_tokens=False), 2]  # 2: EOS, a special token
    skipped, shown = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer, False)
    for i in range(len(ids)):
        skipped.step(ids[: i + 1])
        shown.step(ids[: i + 1])
    assert skipped.text == "queues"
    assert shown.text == tokenizer.decode(ids, skip_special_tokens=False) != skipped.text


def test_chat_template_comes_from_the_model_folder(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(1) == 1  # the template's BOS, not a second one from encode
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|assistant|>\n")
    with pytest.raises(ValueError, match="messages"):
        tokenizer.apply_chat_template([42])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="messages"):
        tokenizer.apply_chat_template([[{"role": "user", "content": "a"}]])  # type: ignore[list-item]
