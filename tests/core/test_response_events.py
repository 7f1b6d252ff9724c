"""A response's stream events (core/views/response_events.py): OpenAI's order, and numbers that a replay of
the ended response gives again, so that a stream resumed with starting_after continues where it stopped,
inside a delta too."""

from __future__ import annotations

from typing import Any

from conveyor.core.views.response_events import ResponseEvents, after, replayed
from conveyor.core.views.response_objects import item_id

JOB = "job_1"
MESSAGE = item_id(JOB, "msg", 0)
CALL = item_id(JOB, "fc", 0)


def response(status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": "resp_" + JOB, "object": "response", "status": status, "output": output}


def message(text: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": MESSAGE, "type": "message", "status": "completed", "role": "assistant", "content": [part]}


def call(arguments: str) -> dict[str, Any]:
    return {"id": CALL, "type": "function_call", "status": "completed", "call_id": "call_1", "name": "f",
            "arguments": arguments}


def live(deltas: list[dict[str, Any]], final: dict[str, Any]) -> list[dict[str, Any]]:
    events = ResponseEvents(JOB)
    streamed = events.opening(response("queued", []))
    return [*streamed, *events.deltas(deltas), *events.closing(final)]


def test_a_text_answer_streams_in_openais_order() -> None:
    final = response("completed", [message("Hello world")])
    events = live([{"content": "Hel"}, {"content": "lo"}, {"content": " world"}], final)
    assert [e["type"] for e in events] == [
        "response.created", "response.queued", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[5]["sequence_number"] == 7 and events[7]["sequence_number"] == 15  # by characters
    assert events[-1]["response"] == final and events[-4]["text"] == "Hello world"


def test_a_replay_numbers_its_events_as_the_live_stream_did() -> None:
    final = response("completed", [message("Hello world"), call('{"a": 1}')])
    streamed = live([{"content": "Hello"}, {"content": " world"}], final)  # the call read at the end
    again = replayed(JOB, response("queued", []), final)
    assert [(e["type"], e["sequence_number"]) for e in again if "delta" not in e["type"]] == \
        [(e["type"], e["sequence_number"]) for e in streamed if "delta" not in e["type"]]
    calls = [e for e in again if e["type"] == "response.function_call_arguments.done"]
    assert calls[0]["arguments"] == '{"a": 1}' and calls[0]["item_id"] == CALL


def test_named_function_arguments_stream_as_they_come() -> None:
    final = response("completed", [call('{"a": 12}')])
    opening = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    rest = {"index": 0, "function": {"arguments": ': 12}'}}
    events = live([{"tool_calls": [opening]}, {"tool_calls": [rest]}], final)
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"a"', ": 12}"]
    again = replayed(JOB, response("queued", []), final)
    assert [(e["type"], e["sequence_number"]) for e in again if "delta" not in e["type"]] == \
        [(e["type"], e["sequence_number"]) for e in events if "delta" not in e["type"]]
    assert events[-2]["item"] == call('{"a": 12}')


def test_starting_after_keeps_the_rest_of_a_delta() -> None:
    events = replayed(JOB, response("queued", []), response("completed", [message("abcdef")]))
    delta = next(e for e in events if e["type"] == "response.output_text.delta")
    first = delta["sequence_number"] - 5  # the number of "a"
    rest = after(events, first + 1)  # the client has "ab"
    assert rest[0]["type"] == "response.output_text.delta" and rest[0]["delta"] == "cdef"
    assert after(events, delta["sequence_number"])[0]["type"] == "response.output_text.done"
    assert after(events, None) == events


def test_a_failed_or_cancelled_response_ends_with_failed() -> None:
    events = live([{"content": "Hel"}], response("cancelled", []))
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "cancelled"
    assert [e["text"] for e in events if e["type"] == "response.output_text.done"] == ["Hel"]
