from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conveyor.core.s3 import S3Location
from conveyor.worker.batches.lines import (
    CHAT,
    COMPLETIONS,
    BatchRequest,
    CustomIdSet,
    LineError,
    LineLimits,
    parse_line,
)
from conveyor.worker.batches.reader import OversizeLine, open_s3_lines


def _words(request: BatchRequest) -> int:
    """A stand-in token counter: one token per whitespace-separated word."""
    if request.messages is not None:
        return sum(len(m["content"].split()) for m in request.messages)
    return len(request.prompt) if isinstance(request.prompt, list) else len(str(request.prompt).split())


LIMITS = LineLimits(max_prompt_tokens=50, count_tokens=_words, max_output_tokens=256)


def _parse(line: dict[str, Any] | bytes, limits: LineLimits = LIMITS) -> BatchRequest | LineError:
    raw = line if isinstance(line, bytes) else json.dumps(line).encode()
    return parse_line(7, raw, CustomIdSet(), limits)


def test_openai_chat_line_maps_parameters() -> None:
    request = _parse({"custom_id": "a", "method": "POST", "url": CHAT, "body": {
        "model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 12, "temperature": 0, "top_p": 0.9, "stop": "\n", "seed": 3, "n": 1,
        "logprobs": True, "top_logprobs": 2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
        "min_tokens": 1, "ignore_eos": False, "stop_token_ids": [2]}})
    assert isinstance(request, BatchRequest)
    assert request.endpoint == CHAT and request.model == "m" and request.line == 7
    assert request.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert request.params == {"max_tokens": 12, "temperature": 0, "top_p": 0.9, "stop": "\n", "seed": 3,
                              "logprobs": 2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                              "min_tokens": 1, "ignore_eos": False, "stop_token_ids": [2]}


def test_conveyor_prompt_line_and_openai_completions_prompt_list() -> None:
    plain = _parse({"custom_id": "a", "body": {"prompt": "once upon", "max_tokens": 4, "logprobs": 1}})
    assert isinstance(plain, BatchRequest)
    assert (plain.endpoint, plain.prompt, plain.params) == (COMPLETIONS, "once upon", {"max_tokens": 4,
                                                                                       "logprobs": 1})
    listed = _parse({"custom_id": "b", "url": COMPLETIONS, "body": {"prompt": ["hello"]}})
    assert isinstance(listed, BatchRequest) and listed.prompt == "hello"
    tokens = _parse({"custom_id": "c", "body": {"prompt": [1, 2, 3]}})  # its job's inputs, as on the route
    assert isinstance(tokens, BatchRequest) and (tokens.prompt, tokens.inputs) == (None, [[1, 2, 3]])


@pytest.mark.parametrize(("line", "code", "fragment"), [
    (b"{not json", "invalid_json", "not valid JSON"),
    (b"[1, 2]", "invalid_json", "JSON object"),
    ({"body": {"prompt": "x"}}, "missing_custom_id", "custom_id is required"),
    ({"custom_id": 5, "body": {"prompt": "x"}}, "invalid_custom_id", "non-empty string"),
    ({"custom_id": "a", "body": {"prompt": "x"}, "extra": 1}, "invalid_line", "extra"),
    ({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}, "invalid_method", "POST"),
    ({"custom_id": "a", "url": "/v1/moderations", "body": {"input": "x"}}, "invalid_url", "url must be"),
    ({"custom_id": "a", "url": CHAT, "body": {"prompt": "x"}}, "invalid_body", "needs messages"),
    ({"custom_id": "a", "body": {"prompt": "x", "messages": []}}, "invalid_body", "exactly one"),
    ({"custom_id": "a", "body": "x"}, "invalid_body", "JSON object"),
    ({"custom_id": "a", "body": {"messages": [{"role": "robot", "content": "x"}]}}, "invalid_body", "role"),
    ({"custom_id": "a", "body": {"prompt": "x", "frequency_penalty": 3}}, "invalid_parameter",
     "frequency_penalty"),
    ({"custom_id": "a", "body": {"prompt": "x", "n": 17}}, "invalid_parameter",
     "n: Input should be less than or equal to 16"),
    ({"custom_id": "a", "body": {"prompt": "x", "temperature": -1}}, "invalid_parameter", "temperature"),
    ({"custom_id": "a", "body": {"prompt": "x", "top_p": "high"}}, "invalid_parameter", "top_p"),
    ({"custom_id": "a", "body": {"prompt": "x", "max_tokens": 1.5}}, "invalid_parameter", "max_tokens"),
    ({"custom_id": "a", "body": {"prompt": "x", "max_tokens": 1000}}, "invalid_parameter", "<= 256"),
    ({"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                 "max_completion_tokens": 4}}, "invalid_parameter", "disagree"),
    ({"custom_id": "a", "body": {"prompt": "x", "top_logprobs": 2}}, "invalid_parameter", "top_logprobs"),
    ({"custom_id": "a", "body": {"prompt": "x", "stream": True}}, "invalid_parameter", "stream"),
    ({"custom_id": "a", "body": {"prompt": "word " * 51}}, "prompt_too_long", "51 tokens"),
])
def test_bad_lines(line: dict[str, Any] | bytes, code: str, fragment: str) -> None:
    error = _parse(line)
    assert isinstance(error, LineError)
    assert (error.line, error.code) == (7, code)
    assert fragment in error.message


def test_oversize_line_and_batch_endpoint_mismatch() -> None:
    error = parse_line(3, OversizeLine(100), CustomIdSet())
    assert isinstance(error, LineError) and error.code == "line_too_long" and error.custom_id is None
    line = json.dumps({"custom_id": "a", "url": COMPLETIONS, "body": {"prompt": "x"}}).encode()
    mismatch = parse_line(4, line, CustomIdSet(), LineLimits(endpoint=CHAT))
    assert isinstance(mismatch, LineError) and mismatch.code == "invalid_url"


def test_custom_id_set_rejects_repeats() -> None:
    seen = CustomIdSet({"a"})
    assert not seen.add("a") and seen.add("b") and "b" in seen and len(seen) == 2


def _thousand_lines() -> tuple[bytes, dict[int, str]]:
    """1,000 lines, some bad; returns the file and the expected error code per line number."""
    lines, bad = [], {}
    for n in range(1, 1001):
        line: Any = {"custom_id": f"req-{n}", "body": {"messages": [{"role": "user", "content": f"q {n}"}],
                                                       "max_tokens": 8}}
        if n % 97 == 0:
            line, bad[n] = '{"custom_id": "broken", ', "invalid_json"
        elif n % 89 == 0:
            del line["custom_id"]
            bad[n] = "missing_custom_id"
        elif n % 83 == 0:
            line["custom_id"] = "req-1"
            bad[n] = "duplicate_custom_id"
        elif n % 79 == 0:
            line["body"]["top_p"] = 0
            bad[n] = "invalid_parameter"
        elif n % 73 == 0:
            line["body"]["messages"][0]["content"] = "long " * 60
            bad[n] = "prompt_too_long"
        lines.append(line if isinstance(line, str) else json.dumps(line))
    return ("\n".join(lines) + "\n").encode(), bad


def test_thousand_line_batch_from_s3(s3: Any, bucket: str) -> None:
    data, bad = _thousand_lines()
    assert set(bad.values()) == {"invalid_json", "missing_custom_id", "duplicate_custom_id",
                                 "invalid_parameter", "prompt_too_long"}
    s3.put_object(Bucket=bucket, Key="in/batch.jsonl", Body=data)
    seen = CustomIdSet()
    with open_s3_lines(s3, S3Location(bucket, "in/batch.jsonl"), chunk_bytes=1000) as lines:
        parsed = [parse_line(number, raw, seen, LIMITS) for number, raw in lines]
    errors = {p.line: p.code for p in parsed if isinstance(p, LineError)}
    requests = [p for p in parsed if isinstance(p, BatchRequest)]
    assert errors == bad
    assert len(requests) == 1000 - len(bad)
    assert [r.custom_id for r in requests] == [f"req-{n}" for n in range(1, 1001) if n not in bad]
    assert all(r.messages == [{"role": "user", "content": f"q {r.line}"}] for r in requests)
    duplicate = next(p for p in parsed if isinstance(p, LineError) and p.code == "duplicate_custom_id")
    assert duplicate.custom_id == "req-1"


def test_each_line_is_judged_and_queued_by_the_model_it_names(
    migrated_sqlite_url: str, demo_model_dir: Path, tmp_path: Path,
) -> None:
    """A worker of model `a` reading a batch: a line naming `a` (or none) goes to a's lane, one naming `b`
    whose tokenizer this worker cannot read fails alone, an unknown model is model_not_found."""
    from conveyor.core.protocol.service_tiers import PriorityRange
    from conveyor.core.settings import Settings
    from conveyor.core.store.tables import Batch
    from conveyor.engine.tokenizer import Tokenizer
    from conveyor.worker.batches.model_limits import ModelLimits

    settings = Settings(database_url=migrated_sqlite_url, models={
        "a": {"path": str(demo_model_dir)}, "b": {"path": str(tmp_path / "not-mounted-here")}})
    batch = Batch(id="batch_1", tenant_id="default", endpoint=None, queue="documents")
    of_a = ModelLimits(settings.for_model("a"), Tokenizer(demo_model_dir))
    limits = of_a.of_chunk(batch, PriorityRange(), {})
    seen = CustomIdSet()

    def parsed(custom_id: str, model: str | None) -> BatchRequest | LineError:
        body = {"prompt": "hello there", "max_tokens": 4, **({"model": model} if model else {})}
        return parse_line(1, json.dumps({"custom_id": custom_id, "body": body}).encode(), seen, limits)

    named, unnamed = parsed("named", "a"), parsed("unnamed", None)
    assert isinstance(named, BatchRequest) and isinstance(unnamed, BatchRequest)
    assert named.lane == unnamed.lane == "a:documents" and named.prompt_tokens > 0
    unreadable, unknown = parsed("b", "b"), parsed("c", "c")
    assert isinstance(unreadable, LineError) and unreadable.code == "model_unavailable"
    assert "not-mounted-here" in unreadable.message
    assert isinstance(unknown, LineError) and unknown.code == "model_not_found"
    assert "`c`" in unknown.message and "`a`, `b`" in unknown.message
