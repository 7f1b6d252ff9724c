"""OpenAI's Responses API on the embedded server (tiny demo model, SQLite, auth on), driven by the official
`openai` SDK over real HTTP: a response is the chat job of its input (the same tokens as the chat route),
background responses are queued jobs to poll, stream again or cancel, previous_response_id carries the
conversation, a required function tool returns a call whose arguments validate, `store: false` keeps
nothing, another tenant's response is a 404, and what is not supported is a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from test_openai_chat_sdk import Server, embedded  # noqa: F401 (the module-scoped fixture)

from conveyor.core.clock import utcnow
from conveyor.core.store import webhooks
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.tables import Delivery
from tests.support.live_server import new_api_key, wait_for

GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12, "extra_body": {"ignore_eos": True}}
LONG: dict[str, Any] = {"max_output_tokens": 800, "extra_body": {"ignore_eos": True}}  # runs for seconds
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}


def _final(client: openai.OpenAI, response_id: str) -> Any:
    seen: list[Any] = []

    def ended() -> bool:
        seen.append(client.responses.retrieve(response_id))
        return seen[-1].status not in ("queued", "in_progress")

    wait_for(ended, f"response {response_id} to end")
    return seen[-1]


def test_a_response_is_the_chat_job_of_its_input(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    response = client.responses.create(model=embedded.model, instructions="Be brief.", input="Name a queue.",
                                       **GREEDY)
    chat = client.chat.completions.create(
        model=embedded.model, messages=[{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Name a queue."}],
        temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 12 == chat.usage.completion_tokens
    job = embedded.job(response.id.removeprefix("resp_"))  # a job like any other, under /v1/jobs too
    assert job.queue.endswith("interactive") and job.messages[0] == {"role": "system", "content": "Be brief."}


def test_background_responses_are_queued_then_polled(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    created = client.responses.create(model=embedded.model, input="Hello", background=True, **GREEDY)
    assert created.status == "queued" and created.background and created.output == []
    done = _final(client, created.id)
    assert done.status == "incomplete" and len(done.output_text) > 0
    jobs = httpx.get(f"{embedded.url}/v1/jobs/{created.id.removeprefix('resp_')}",
                     headers={"Authorization": f"Bearer {embedded.key}"})
    assert jobs.json()["status"] == "succeeded"


def test_an_idempotency_key_creates_one_response(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    key = {"Idempotency-Key": "resp-once-1"}
    first = client.responses.create(model=embedded.model, input="Once", background=True, extra_headers=key,
                                    **GREEDY)
    again = client.responses.create(model=embedded.model, input="Once", background=True, extra_headers=key,
                                    **GREEDY)
    assert again.id == first.id
    with pytest.raises(openai.ConflictError, match="Idempotency-Key"):
        client.responses.create(model=embedded.model, input="Twice", background=True, extra_headers=key,
                                **GREEDY)
    answered = client.responses.create(model=embedded.model, input="Once", extra_headers=key, **GREEDY)
    assert answered.id == first.id and answered.status == "incomplete"  # the same job, followed to its end


def test_streamed_events_come_in_order_and_resume(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    events = list(client.responses.create(model=embedded.model, input="Hi", stream=True, background=True,
                                          **GREEDY))
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert types[3:5] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(types[5:-4]) == {"response.output_text.delta"}
    numbers = [event.sequence_number for event in events]
    assert numbers == sorted(set(numbers))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text
    # Resumed once ended: the same numbering; inside a delta, the rest of its text.
    again = list(client.responses.retrieve(final.id, stream=True))
    assert [e.sequence_number for e in again if e.type == "response.incomplete"] == [numbers[-1]]
    middle = numbers[types.index("response.output_text.delta")] - 1 + len(text) // 2
    rest = list(client.responses.retrieve(final.id, stream=True, starting_after=middle))
    deltas = "".join(event.delta for event in rest if event.type == "response.output_text.delta")
    first = numbers[types.index("response.output_text.delta")] - len(events[5].delta) + 1
    assert deltas == text[middle - first + 1:] and rest[-1].type == "response.incomplete"


def test_a_stream_resumed_before_the_job_starts_is_live(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    waiting = client.responses.create(model=embedded.model, input="Soon", background=True,
                                      **{**GREEDY, "extra_body": {"ignore_eos": True, "delay_s": 1.0}})
    events = list(client.responses.retrieve(waiting.id, stream=True))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(deltas) == events[-1].response.output_text and len(deltas) > 1  # as generated


def test_previous_response_id_carries_the_conversation(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    first = client.responses.create(model=embedded.model, instructions="Only the first turn's.",
                                    input="My name is Ada.", **GREEDY)
    second = client.responses.create(model=embedded.model, input="What is my name?",
                                     previous_response_id=first.id, **GREEDY)
    messages = embedded.job(second.id.removeprefix("resp_")).messages
    assert messages == [{"role": "user", "content": "My name is Ada."},
                        {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "What is my name?"}]
    assert second.previous_response_id == first.id
    items = client.responses.input_items.list(second.id).data
    assert [item.content[0].text for item in items] == ["What is my name?"]


def test_cancel_ends_a_queued_or_running_response(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    waiting = client.responses.create(model=embedded.model, input="Later", background=True,
                                      **{**GREEDY, "extra_body": {"delay_s": 600}})
    assert waiting.status == "queued"
    assert client.responses.cancel(waiting.id).status == "cancelled"
    running = client.responses.create(model=embedded.model, input="Go on", background=True, **LONG)
    wait_for(lambda: client.responses.retrieve(running.id).status == "in_progress", "the response to run")
    assert client.responses.cancel(running.id).status == "cancelled"
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"  # again: as it is
    ended = client.responses.create(model=embedded.model, input="Done", background=True, **GREEDY)
    _final(client, ended.id)
    with pytest.raises(openai.ConflictError):
        client.responses.cancel(ended.id)
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        client.responses.cancel(client.responses.create(model=embedded.model, input="x", **GREEDY).id)


def test_a_required_function_tool_returns_a_call_that_validates(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    response = client.responses.create(model=embedded.model, input="Weather in Oslo?", tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                       max_output_tokens=120)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    answered = client.responses.create(  # the call's output after the earlier turn
        model=embedded.model, previous_response_id=response.id, tools=[WEATHER], **GREEDY, input=[output])
    messages = embedded.job(answered.id.removeprefix("resp_")).messages
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}
    resent = client.responses.create(  # the same history sent whole: the SDK's output items as they came
        model=embedded.model, tools=[WEATHER], **GREEDY, input=[
            {"role": "user", "content": "Weather in Oslo?"}, *response.output,
            output])
    assert embedded.job(resent.id.removeprefix("resp_")).messages == messages


def test_a_named_function_streams_its_arguments(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    events = list(client.responses.create(
        model=embedded.model, input="Weather?", tools=[WEATHER], stream=True, max_output_tokens=120,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0))
    types = [event.type for event in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = events[-1].response.output
    assert call.type == "function_call" and streamed == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_text_format_and_logprobs(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    schema = {"type": "object", "additionalProperties": False, "required": ["unit"],
              "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}
    fmt = {"type": "json_schema", "name": "unit", "schema": schema}
    shaped = client.responses.create(model=embedded.model, input="Unit?", max_output_tokens=60,
                                     text={"format": fmt})
    jsonschema.validate(json.loads(shaped.output_text), schema)
    scored = client.responses.create(model=embedded.model, input="Hi", top_logprobs=2, **GREEDY,
                                     include=["message.output_text.logprobs"])
    tokens = scored.output[0].content[0].logprobs
    assert len(tokens) == 12 and all(len(token.top_logprobs) == 2 for token in tokens)
    assert "".join(token.token for token in tokens) == scored.output_text


def test_store_false_keeps_nothing(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    response = client.responses.create(model=embedded.model, input="Forget me", store=False, **GREEDY)
    assert response.store is False and response.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_another_tenants_response_is_a_404(embedded: Server) -> None:  # noqa: F811
    mine = embedded.client().responses.create(model=embedded.model, input="Mine", background=True, **GREEDY)
    other = embedded.client(new_api_key(embedded.database_url, "mallory"))
    for call in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.cancel(mine.id),
                 lambda: other.responses.delete(mine.id), lambda: other.responses.input_items.list(mine.id),
                 lambda: other.responses.create(model=embedded.model, input="x",
                                                previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    _final(embedded.client(), mine.id)
    embedded.client().responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        embedded.client().responses.retrieve(mine.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "colour": "blue"}, "colour"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}, "input[1].role"),
])
def test_what_cannot_run_is_a_400_naming_the_field(embedded: Server, body: dict[str, Any],  # noqa: F811
                                                   param: str) -> None:
    answer = httpx.post(f"{embedded.url}/v1/responses", json={"model": embedded.model, **body},
                        headers={"Authorization": f"Bearer {embedded.key}"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_webhooks_send_the_responses_events(embedded: Server) -> None:  # noqa: F811
    with _store(embedded.database_url) as session:
        webhooks.create_subscription(session, "hooked", "http://127.0.0.1:9/hook", ["response.*"], "test",
                                     utcnow())
    client = embedded.client(new_api_key(embedded.database_url, "hooked"))
    ended = client.responses.create(model=embedded.model, input="Hook", **GREEDY)
    cancelled = client.responses.create(model=embedded.model, input="Hook", background=True,
                                        **{**GREEDY, "extra_body": {"delay_s": 600}})
    client.responses.cancel(cancelled.id)
    with _store(embedded.database_url) as session:
        sent = {row.subject_id: row for row in session.execute(select(Delivery)).scalars()
                if row.tenant_id == "hooked"}
    assert sent[ended.id.removeprefix("resp_")].event_type == "response.incomplete"
    assert sent[ended.id.removeprefix("resp_")].payload["data"]["output"][0]["type"] == "message"
    assert sent[cancelled.id.removeprefix("resp_")].event_type == "response.cancelled"
    assert sent[cancelled.id.removeprefix("resp_")].payload["data"]["id"] == cancelled.id


@contextmanager
def _store(url: str) -> Iterator[Session]:
    db_engine = make_db_engine(url)
    try:
        with make_session_factory(db_engine)() as session:
            yield session
    finally:
        db_engine.dispose()
