"""A batch line whose prompt + max_tokens exceed the model's context is a line error (`context_too_long`,
naming max_tokens), as the same request is a 422/400 at the synchronous routes; one that fits is a request."""

from __future__ import annotations

import json

from conveyor.worker.batches.lines import CHAT, BatchRequest, CustomIdSet, LineError, LineLimits, parse_line

LIMITS = LineLimits(
    max_prompt_tokens=50, count_tokens=lambda request: 10, max_output_tokens=256, max_model_len=64
)


def _line(max_tokens: int) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": body}).encode()


def test_a_line_beyond_the_context_is_a_line_error() -> None:
    error = parse_line(3, _line(55), CustomIdSet(), LIMITS)
    assert isinstance(error, LineError) and error.code == "context_too_long", error
    assert error.message.startswith("max_tokens:") and "max_model_len (64)" in error.message


def test_a_line_that_fits_is_a_request() -> None:
    assert isinstance(parse_line(3, _line(54), CustomIdSet(), LIMITS), BatchRequest)
