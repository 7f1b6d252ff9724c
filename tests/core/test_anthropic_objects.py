"""Anthropic's message and its stream built from a job's result (core/views/anthropic_objects.py,
core/views/anthropic_stream.py): content blocks read as the chat route reads tool calls, stop reasons, the
stop sequence cut off and named, usage with the prefix cache's tokens apart, the error shape, and the events a
stream sends, which assemble into the same message."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.views.anthropic_objects import (
    ending,
    error_body,
    error_type,
    message_object,
    stop_reason,
    tool_use_id,
)
from conveyor.core.views.anthropic_stream import BlockStream, message_delta, message_start, sendable
from conveyor.core.views.openai_objects import GenerationResult
from conveyor.core.views.tool_calls import call_id
from conveyor.core.views.tool_stream import answer_stream

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
AUTO = ChatOptions(tools=[ADD], tool_choice="auto")
NAMED = ChatOptions(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}})
REQUIRED = ChatOptions(tools=[ADD], tool_choice="required")
HERMES = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def result(text: str, finish: str = "stop", chat: ChatOptions | None = None, cached: int = 0,
           ) -> GenerationResult:
    return GenerationResult(text=text, finish_reason=finish, prompt_tokens=20, completion_tokens=7,
                            model="demo-model", created=0, cached_tokens=cached, chat=chat or ChatOptions(),
                            job_id="job_1")


def test_a_text_answer() -> None:
    message = message_object(result("Hello.", cached=16), "msg_job_1")
    assert message == {
        "id": "msg_job_1", "type": "message", "role": "assistant", "model": "demo-model",
        "content": [{"type": "text", "text": "Hello."}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 7, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 16}}


def test_an_empty_answer_still_has_its_text_block() -> None:
    assert message_object(result(""), "msg_job_1")["content"] == [{"type": "text", "text": ""}]


@pytest.mark.parametrize(("text", "finish", "stops", "shown", "reason", "sequence"), [
    ("Hello", "length", ["lo"], "Hello", "max_tokens", None),  # cut by max_tokens: nothing matched
    ("Hello END", "stop", ["END"], "Hello ", "stop_sequence", "END"),
    ("Hello", "stop", ["END"], "Hello", "end_turn", None),  # EOS
    ("a stop", "stop", ["stop", "p", "a stop!"], "a ", "stop_sequence", "stop"),  # the longest that ends it
])
def test_stop_reasons_and_the_stop_sequence(text: str, finish: str, stops: list[str], shown: str, reason: str,
                                            sequence: str | None) -> None:
    message = message_object(result(text, finish), "msg_job_1", stops)
    assert message["content"] == [{"type": "text", "text": shown}]
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)


def test_tool_calls_are_tool_use_blocks_after_the_text() -> None:
    message = message_object(result(HERMES, chat=AUTO), "msg_job_1")
    assert message["content"] == [
        {"type": "text", "text": "Let me add."},
        {"type": "tool_use", "id": tool_use_id(call_id("job_1", 0)), "name": "add", "input": {"a": 1}}]
    assert message["stop_reason"] == "tool_use" and message["content"][1]["id"].startswith("toolu_")
    named = message_object(result('{"a": 2}', chat=NAMED), "msg_job_1")
    assert [block["type"] for block in named["content"]] == ["tool_use"]
    assert named["content"][0]["input"] == {"a": 2}
    cut = message_object(result('{"a": ', "length", chat=NAMED), "msg_job_1")  # no call: the text as it is
    assert cut["content"] == [{"type": "text", "text": '{"a": '}] and cut["stop_reason"] == "max_tokens"


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (409, "invalid_request_error"), (413, "request_too_large"),
    (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error"), (504, "api_error"),
    (529, "overloaded_error"),
])
def test_error_types_follow_the_status(status: int, kind: str) -> None:
    assert error_type(status) == kind
    assert error_body(kind, "x: y") == {"type": "error", "error": {"type": kind, "message": "x: y"}}


def test_stop_reason_prefers_the_stop_sequence_to_a_call() -> None:
    assert stop_reason("stop", "END", called_tools=True) == "stop_sequence"
    assert stop_reason("length", None, called_tools=True) == "max_tokens"


def assembled(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What Anthropic's SDK makes of the events: the message_start's message, blocks filled by deltas,
    message_delta's ending and usage."""
    message: dict[str, Any] = {}
    inputs: dict[int, str] = {}
    for event in events:
        kind = event["type"]
        if kind == "message_start":
            message = json.loads(json.dumps(event["message"]))
        elif kind == "content_block_start":
            assert event["index"] == len(message["content"])
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            delta, block = event["delta"], message["content"][event["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                inputs[event["index"]] = inputs.get(event["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and event["index"] in inputs:
            message["content"][event["index"]]["input"] = json.loads(inputs[event["index"]])
        elif kind == "message_delta":
            message.update(event["delta"])
            message["usage"].update(event["usage"])
    return message


def streamed(final: GenerationResult, pieces: list[str], stops: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The events of a job whose text grew through `pieces` and ended as `final`, as the route sends them."""
    stream, blocks = answer_stream(final.chat, "job_1"), BlockStream()
    events = [message_start("msg_job_1", final.model, final.prompt_tokens)]
    if not final.chat.reads_tool_calls:
        events += blocks.open_text()
    for text in pieces:
        events += [e for delta in stream.update(sendable(text, stops)) for e in blocks.events(delta)]
    ended = ending(final.text, final.finish_reason, stops)
    deltas, called = stream.close(ended.text)
    events += [e for delta in deltas for e in blocks.events(delta)]
    return [*events, *blocks.close(), message_delta(final, ended, called)]


@pytest.mark.parametrize(("final", "pieces", "stops"), [
    (result("Hello there", "length", cached=16), ["He", "Hello", "Hello th"], []),
    (result("Hello END"), ["Hello", "Hello E", "Hello EN"], ["END"]),
    (result("END", cached=4), ["E", "EN"], ["END", "X"]),  # nothing of a text shorter than a stop is sent
    (result('{"a": 12}', chat=NAMED), ['{"a', '{"a": 1'], []),
    (result('[{"name": "add", "arguments": {"a": 12}}]', chat=REQUIRED), ['[{"na'], []),
    (result(""), [], []),
])
def test_the_stream_assembles_into_the_message(final: GenerationResult, pieces: list[str],
                                               stops: list[str]) -> None:
    assert assembled(streamed(final, pieces, stops)) == message_object(final, "msg_job_1", stops)


def test_what_may_still_be_a_stop_sequence_is_held_back() -> None:
    assert sendable("Hello EN", ["END"]) == "Hello" and sendable("Hello EN", []) == "Hello EN"
    assert sendable("EN", ["END", "X"]) == ""


def test_a_named_call_streams_its_input_as_json_deltas() -> None:
    events = streamed(result('{"a": 12}', chat=NAMED), ['{"a', '{"a": 1'])
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert starts == [{"type": "content_block_start", "index": 0, "content_block": {
        "type": "tool_use", "id": tool_use_id(call_id("job_1", 0)), "name": "add", "input": {}}}]
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert pieces == ['{"a', '": 1', "2}"]
    assert [e["type"] for e in events][-2:] == ["content_block_stop", "message_delta"]


def test_text_then_calls_are_blocks_in_order() -> None:
    final = result(HERMES, chat=AUTO)
    events = streamed(final, ["Let", "Let me add. <tool", HERMES[:-5]])
    kinds = [(e["type"], e.get("index")) for e in events if e["type"].startswith("content_block_")]
    assert kinds == [("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
                     ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
                     ("content_block_stop", 1)]
    # NOTE: the space before the call streams before the call is known (core/views/tool_stream.py, as on the
    # chat route); the whole message strips it.
    whole, message = assembled(events), message_object(final, "msg_job_1")
    assert whole["content"][0]["text"].rstrip() == message["content"][0]["text"]
    assert whole["content"][1:] == message["content"][1:] and whole["stop_reason"] == "tool_use"
