"""Grammar-constrained decoding with the random-weight demo model: the output always parses and validates."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutput
from tests.support.engine import drain

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2},
    },
    "required": ["color", "count", "ok", "name", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["The queue holds", "A block table", "Every pause is", "The model reads"]


def _engine(path: Path, num_kv_blocks: int = 128, max_model_len: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), num_kv_blocks=num_kv_blocks, max_model_len=max_model_len))


def _run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, Any]:
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], p)
    return {k: v for k, v in drain(engine).items()}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_outputs_parse_and_validate(demo_model_dir: Path, temperature: float) -> None:
    engine = _engine(demo_model_dir)
    structured = StructuredOutput(json_schema=SCHEMA)
    params = [SamplingParams(max_tokens=120, temperature=temperature, seed=i, structured=structured)
              for i in range(20)]
    done = _run(engine, params)
    for out in done.values():
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert engine._grammars is not None and engine._grammars.num_compiles == 1  # one schema, compiled once


def test_choice_and_regex(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir)
    choices = ["yes", "no", "maybe later"]
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                             structured=StructuredOutput(choice=choices)) for i in range(4)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=i,
                              structured=StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}")) for i in range(4)]
    done = _run(engine, params)
    for i in range(4):
        assert done[f"r{i}"].text in choices
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", done[f"r{i + 4}"].text), done[f"r{i + 4}"].text


def test_json_object_is_an_object(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir)
    done = _run(engine, [SamplingParams(max_tokens=200, temperature=0.0,
                                        structured=StructuredOutput(json_object=True))])
    out = done["r0"]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # a random model may ramble inside an object; it must still have started one
        assert out.finish_reason == "length" and out.text.startswith("{")


def test_unconstrained_rows_unchanged_by_constrained_neighbours(demo_model_dir: Path) -> None:
    plain = [SamplingParams(max_tokens=12, temperature=0.0),
             SamplingParams(max_tokens=12, temperature=1.0, seed=7)]
    alone = _run(_engine(demo_model_dir), plain)
    structured = StructuredOutput(json_schema=SCHEMA)
    constrained = SamplingParams(max_tokens=60, structured=structured, seed=3)
    mixed = _run(_engine(demo_model_dir), [*plain, constrained])
    for key in ("r0", "r1"):
        assert mixed[key].token_ids == alone[key].token_ids


def test_preempted_constrained_request_still_valid(demo_model_dir: Path) -> None:
    engine = _engine(demo_model_dir, num_kv_blocks=10, max_model_len=128)  # 4 x ~60 tokens cannot all fit
    structured = StructuredOutput(json_schema=SCHEMA)
    params = [SamplingParams(max_tokens=110, temperature=1.0, seed=i, structured=structured)
              for i in range(4)]
    done = _run(engine, params)
    assert engine.scheduler.num_preemptions > 0
    for out in done.values():
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_max_tokens_before_grammar_completes_is_length(demo_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=3, structured=StructuredOutput(json_schema=SCHEMA))
    done = _run(_engine(demo_model_dir), [params])
    assert done["r0"].finish_reason == "length"
    assert done["r0"].text.startswith("{")


def test_mask_keeps_only_allowed_tokens(demo_model_dir: Path) -> None:
    """The sampler's masked logits: -inf outside the grammar's next tokens, untouched rows unchanged."""
    engine = _engine(demo_model_dir)
    seq = engine.make_sequence("c", "x", SamplingParams(structured=StructuredOutput(choice=["yes"])))
    free = engine.make_sequence("f", "x", SamplingParams())
    from conveyor.engine.structured_output.mask import apply_grammar_masks

    logits = torch.zeros(2, engine.vocab_size)
    masked = apply_grammar_masks(logits, [seq, free])
    assert torch.equal(masked[1], logits[1])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert allowed and all(engine.tokenizer.decode([t]) and "yes".startswith(engine.tokenizer.decode([t]))
                           for t in allowed)


@pytest.mark.parametrize("bad", [
    {"regex": "(("}, {"json_schema": {"type": "nonsense"}}, {"json_schema": "{not json"}, {"choice": []},
])
def test_bad_constraint_is_a_value_error_naming_the_field(demo_model_dir: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"structured\."):
        _engine(demo_model_dir).add_request("r", "x", SamplingParams(structured=StructuredOutput(**bad)))


def test_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ValueError, match="at most"):
        StructuredOutput(choice=["x" * 70_000])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredOutput(choice=["a"]))


def test_bounded_strings_refuse_raw_control_characters() -> None:
    """xgrammar 0.2.9 lets U+0000-U+001F into maxLength strings; conveyor.engine.structured_output.grammar
    narrows that class. If a new xgrammar writes the class differently, this fails instead of the fix silently
    doing nothing."""
    from conveyor.engine.structured_output.grammar import (
        _LOOSE_STRING_CHAR,
        _STRICT_STRING_CHAR,
        _json_schema_ebnf,
    )

    ebnf = _json_schema_ebnf({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}})
    assert _STRICT_STRING_CHAR in ebnf and _LOOSE_STRING_CHAR not in ebnf


@pytest.mark.parametrize("max_length", [None, 4])
def test_strings_refuse_encoded_surrogates(demo_model_dir: Path, max_length: int | None) -> None:
    """Bytes ED A7 B9 (U+D9F9, a surrogate: not valid UTF-8) decode to three U+FFFD, so a string xgrammar
    counted as 4 characters came back longer than its maxLength from the demo model. A valid two-byte
    character still passes."""
    from conveyor.engine.structured_output.grammar import GrammarCompiler

    engine = _engine(demo_model_dir)
    tokenizer = engine.tokenizer.hf_tokenizer
    byte_token = {b: tokenizer.convert_tokens_to_ids(c) for b, c in _byte_level_alphabet().items()}
    string = {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}
    schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
    compiler = GrammarCompiler(tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    for character, valid in ((b"\xed\xa7\xb9", False), (b"\xc3\xa9", True)):
        matcher = compiler.matcher(StructuredOutput(json_schema=schema))
        assert all(matcher.accept_token(byte_token[b]) for b in b'{"s": "')
        assert all(matcher.accept_token(byte_token[b]) for b in character) is valid, character


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: the printable character each byte is written as."""
    spans = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))
    printable = [b for lo, hi in spans for b in range(ord(lo), ord(hi) + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}
