"""Hostile batch lines, generated: random JSON values, nesting far past any recursion limit, integers of
thousands of digits, wrong types under the known field names, bytes that are not JSON. Each line, parsed as
the batch runner parses it (the real tokenizer counting prompts, the queue's limits, the served model), must
come out as a BatchRequest whose job the store can hold, or a LineError the rules chose: never an exception,
and never the catch-all's `invalid_line` ("could not be judged"), which would mean an unforeseen error."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.protocol.chat_messages import ChatRoles
from conveyor.core.protocol.openai_request import ChatCompletionCreate, CompletionCreate, Served
from conveyor.core.protocol.request_rules import json_problem, text_problem
from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.batches.lines import BatchRequest, CustomIdSet, LineError, LineLimits, parse_line
from conveyor.worker.batches.prompt_length import prompt_token_counter
from conveyor.worker.batches.reader import LineStream, ReadPosition

FIELDS = sorted({*ChatCompletionCreate.model_fields, *CompletionCreate.model_fields})
# Placeholders replaced in the line's text after json.dumps, which can neither write an integer over 4,300
# digits nor nest past its recursion limit: "@@int:N@@" -> N nines ("@@neg:N@@" negative), "@@arrays:N@@" and
# "@@objects:N@@" -> N nested arrays or objects.
_PLACEHOLDER = re.compile(r'"@@(int|neg|arrays|objects):(\d+)@@"')


@pytest.fixture(scope="module")
def limits(tmp_path_factory: pytest.TempPathFactory) -> LineLimits:
    from conveyor.engine.demo import build_tiny_model

    tokenizer = Tokenizer(build_tiny_model(tmp_path_factory.mktemp("fuzz-tokenizer")))
    served = Served(models=("demo-model",), roles=ChatRoles.of_template(tokenizer.chat_template))
    return LineLimits(max_prompt_tokens=512, count_tokens=prompt_token_counter(tokenizer),
                      max_output_tokens=256, served=served, max_model_len=1024)


def _placeholder(kind: str, size: int) -> str:
    return f"@@{kind}:{size}@@"


def mostly(usual: st.SearchStrategy[Any], *others: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`usual` four times in five, else one of `others`."""
    return st.integers(0, 4).flatmap(lambda i: usual if i else st.one_of(*others))


ODD_TEXT = st.sampled_from(["", "\x00", "a\x00b", "\udfff", "x\ud800y", "\U0001f680", " ", "\n", "NaN", "5",
                            "true", "demo-model", "/v1/chat/completions", "/v1/completions", "POST", "user",
                            "system", "tool", "developer", "json_schema", "json_object", "text", "$ref", "#"])
TEXT = st.one_of(ODD_TEXT, st.text(max_size=20))
HOSTILE_SCALARS = st.one_of(
    st.builds(_placeholder, st.sampled_from(["int", "neg"]),
              st.sampled_from([19, 20, 100, 101, 4300, 4301, 5000])),
    st.builds(_placeholder, st.sampled_from(["arrays", "objects"]),
              st.sampled_from([1, 31, 32, 33, 1000, 3000])),
    st.integers(-(2**80), 2**80),
    st.sampled_from([0, 1, -1, 5, 2**31 - 1, 2**31, 2**63, -(2**63) - 1, 5.0, 0.5, 1e-9, 1e308]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    TEXT,
)
KEYS = st.one_of(TEXT, st.sampled_from(FIELDS))
JSON = st.recursive(HOSTILE_SCALARS, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(KEYS, children, max_size=4)), max_leaves=12)


def _nested_schema(levels: int, keyword: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema} if keyword == "items" else {
            "type": "object", "properties": {"a": schema}}
    return schema


SCHEMAS = st.one_of(
    st.builds(_nested_schema, st.integers(0, 200), st.sampled_from(["items", "properties"])),
    st.dictionaries(st.sampled_from(["type", "properties", "items", "$schema", "$ref", "pattern", "enum",
                                     "anyOf", "required", "maximum", "$defs"]), JSON, max_size=4),
    JSON,
)
FORMAT_TYPES = st.one_of(st.sampled_from(["json_object", "text", "json_schema", "xml"]), JSON)
RESPONSE_FORMATS = st.one_of(
    SCHEMAS.map(lambda schema: {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}),
    st.fixed_dictionaries({"type": FORMAT_TYPES}),
    JSON,
)
PLAIN = st.text(alphabet="abcdefghij -", min_size=1, max_size=12)
ROLES = st.sampled_from(["user", "system", "assistant"])
ODD_ROLES = st.one_of(st.sampled_from(["user", "tool", "developer"]), JSON)
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({"role": ROLES, "content": PLAIN}), min_size=1, max_size=2),
    st.lists(st.fixed_dictionaries({"role": ODD_ROLES, "content": st.one_of(TEXT, JSON)},
                                   optional={"name": JSON, "extra": JSON}), max_size=3),
    JSON,
)
PROMPTS = st.one_of(PLAIN, PLAIN, TEXT, st.lists(st.one_of(PLAIN, st.integers(-5, 600)), max_size=2), JSON)
# Mostly well-formed lines with a few hostile fields, so that most lines reach the field rules, the
# structured-output check, the engine's rules and the tokenizer; some wholly random ones too.
FIELD_VALUES = st.one_of(st.integers(-2, 300), st.floats(0, 2), HOSTILE_SCALARS, JSON)
HOSTILE_FIELDS = st.dictionaries(mostly(st.sampled_from(FIELDS), TEXT), FIELD_VALUES, max_size=3)
INPUTS = st.one_of(st.fixed_dictionaries({"messages": MESSAGES}), st.fixed_dictionaries({"prompt": PROMPTS}))
FORMATS = st.one_of(st.just({}), st.fixed_dictionaries({"response_format": RESPONSE_FORMATS}))
BODIES = mostly(
    st.builds(lambda base, extra, fmt: {**extra, **base, **fmt}, INPUTS, HOSTILE_FIELDS, FORMATS),
    JSON,
)
CUSTOM_IDS = mostly(st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=8), TEXT, JSON)
URLS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/x"])
LINES = mostly(
    st.fixed_dictionaries({"custom_id": CUSTOM_IDS, "body": BODIES},
                          optional={"method": mostly(st.just("POST"), JSON), "url": URLS}),
    st.fixed_dictionaries({"custom_id": CUSTOM_IDS, "body": BODIES}, optional={"extra": JSON}),
    JSON,
)


def _expand(match: re.Match[str]) -> str:
    kind, size = match.group(1), int(match.group(2))
    if kind in ("int", "neg"):
        return ("-" if kind == "neg" else "") + "9" * size
    if kind == "arrays":
        return "[" * size + "]" * size
    return '{"a":' * size + "1" + "}" * size


def _jsonl(line: object) -> bytes:
    text = json.dumps(line, ensure_ascii=True)  # surrogates stay \\udfff escapes, as a client may send them
    return _PLACEHOLDER.sub(_expand, text).encode()


def _assert_storable(request: BatchRequest) -> None:
    """What the runner stores for the line's job: text without NUL or lone surrogates, finite JSON."""
    assert text_problem(request.custom_id) is None
    assert isinstance(request.prompt, str) or request.messages is not None or request.inputs is not None
    if isinstance(request.prompt, str):
        assert text_problem(request.prompt) is None
    for item in request.inputs or []:  # a completions line's token-id or several prompts
        assert text_problem(item) is None if isinstance(item, str) else all(0 <= t < 2**31 for t in item)
    for message in request.messages or []:
        assert text_problem(message["role"]) is None and text_problem(message["content"]) is None
    assert json_problem(request.params) is None
    json.dumps(request.params, allow_nan=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(st.one_of(LINES.map(_jsonl), st.binary(max_size=40)), min_size=1, max_size=5))
def test_every_hostile_line_is_a_request_or_a_line_error(limits: LineLimits, lines: list[bytes]) -> None:
    content = b"".join(raw.replace(b"\n", b" ") + b"\n" for raw in lines)
    seen = CustomIdSet()
    with LineStream(iter([content]), ReadPosition(), max_line_bytes=1 << 20) as stream:
        for number, raw in stream:
            parsed = parse_line(number, raw, seen, limits)
            assert isinstance(parsed, BatchRequest | LineError), parsed
            if isinstance(parsed, LineError):
                assert not parsed.message.startswith("the line could not be judged"), (raw[:300], parsed)
                assert parsed.custom_id is None or text_problem(parsed.custom_id) is None
                assert text_problem(parsed.message) is None, parsed
            else:
                _assert_storable(parsed)
