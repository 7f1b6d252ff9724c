"""A Message Batch's lines (url /v1/messages, written by POST /v1/messages/batches): the Messages body read by
Anthropic's rules into its chat request, then judged exactly as a chat line, each refusal naming the field as
the Messages body wrote it; such a line is read in a message batch only."""

from __future__ import annotations

import json
from typing import Any

from conveyor.core.protocol.openai_request import Served
from conveyor.worker.batches.lines import (
    MESSAGES,
    BatchRequest,
    CustomIdSet,
    LineError,
    LineLimits,
    parse_line,
)

LIMITS = LineLimits(endpoint=MESSAGES, served=Served(models=("m",)))
BODY: dict[str, Any] = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
ADD = {"name": "add", "input_schema": {"type": "object"}}


def _parse(body: dict[str, Any], limits: LineLimits = LIMITS) -> BatchRequest | LineError:
    raw = json.dumps({"custom_id": "a", "method": "POST", "url": MESSAGES, "body": body}).encode()
    return parse_line(3, raw, CustomIdSet(), limits)


def _error(body: dict[str, Any], limits: LineLimits = LIMITS) -> tuple[str, str]:
    parsed = _parse(body, limits)
    assert isinstance(parsed, LineError), parsed
    assert (parsed.line, parsed.custom_id) == (3, "a")
    return parsed.code, parsed.message


def test_a_messages_line_becomes_the_chat_request_it_asks_for() -> None:
    request = _parse({**BODY, "system": "be brief", "temperature": 0.5, "stop_sequences": ["x"], "top_k": 3})
    assert isinstance(request, BatchRequest), request
    assert (request.endpoint, request.model, request.custom_id) == (MESSAGES, "m", "a")
    assert request.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    # The stop sequence stays in the text, for the result's message to name it (and cut it off).
    assert request.params == {"max_tokens": 5, "temperature": 0.5, "top_k": 3, "stop": ["x"],
                              "include_stop_str_in_output": True}


def test_invalid_params_are_a_line_error_naming_the_messages_field() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    code, message = _error({**BODY, "messages": [{"role": "user", "content": [image]}]})
    assert code == "invalid_body" and message.startswith("messages[0].content[0]: image blocks are not")
    assert _error({**BODY, "temperature": 3.5})[1].startswith("temperature: ")
    no_max_tokens = {key: value for key, value in BODY.items() if key != "max_tokens"}
    assert _error(no_max_tokens)[1].startswith("max_tokens: ")
    assert _error({**BODY, "stream": True}) == ("invalid_parameter", "stream: must be false in a batch")
    assert _error({**BODY, "model": "other"})[0] == "model_not_found"


def test_the_chat_rules_refusals_name_the_messages_body_fields() -> None:
    """The system prompt is the chat request's first message: a refusal of its fourth (a tool answer) names
    the Messages body's third message, where the tool_result block was."""
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "5"}]},
    ]
    code, message = _error({**BODY, "system": "add", "messages": conversation, "tools": [ADD]})
    assert code == "invalid_body" and message.startswith("messages[2].content[0]: "), message
    choice = {"type": "tool", "name": "nope"}
    assert _error({**BODY, "tools": [ADD], "tool_choice": choice})[1].startswith("tool_choice: ")


def test_a_messages_line_is_read_in_a_message_batch_only() -> None:
    for limits in (LineLimits(), LineLimits(endpoint="/v1/chat/completions")):
        assert _error(BODY, limits)[0] == "invalid_url"
