"""Anthropic's Messages API on Conveyor, driven by the official `anthropic` SDK over real HTTP: the embedded
server of test_openai_chat_sdk.py (demo model, SQLite, auth on) for messages, streams, tools and token
counts; the worker-less server for the errors, each in Anthropic's shape. The demo model's weights are random,
so where a test needs a value it constrains the output with a tool (tool_choice tool or any) or looks for the
seed that ends it."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
import test_openai_chat_sdk as chat_sdk
from test_openai_chat_sdk import Server

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.clock import utcnow
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.tools import template_messages
from conveyor.core.store import jobs
from conveyor.core.store.database import make_db_engine, make_session_factory
from tests.support.live_server import WAIT_S, new_api_key, wait_for

embedded, workerless = chat_sdk.embedded, chat_sdk.workerless  # its servers, as fixtures of this module
MESSAGES: list[Any] = [{"role": "user", "content": "Write a haiku about queues."}]
GREEDY: dict[str, Any] = {"max_tokens": 12, "extra_body": {"temperature": 0}}
ADD: dict[str, Any] = {
    "name": "add", "description": "Adds two numbers.",
    "input_schema": {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": -50, "maximum": 50}}}}
WEATHER: dict[str, Any] = {
    "name": "get_weather", "description": "The weather in a city.",
    "input_schema": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                     "properties": {"city": {"type": "string", "maxLength": 12},
                                    "unit": {"enum": ["celsius", "fahrenheit"]}}}}
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in (ADD, WEATHER)}


def client_of(server: Server, key: str | None = None, timeout: float = WAIT_S) -> anthropic.Anthropic:
    """Anthropic's client pointed at Conveyor: its base URL (the SDK adds /v1/messages) and an API key."""
    return anthropic.Anthropic(base_url=server.url, api_key=key or server.key, max_retries=0, timeout=timeout)


def job_id_of(message_id: str) -> str:
    return message_id.removeprefix("msg_")


def _valid_tool_uses(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, input) of each tool_use block, each checked against its tool's input_schema."""
    uses = []
    for block in message.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_"), block
            jsonschema.validate(block.input, SCHEMAS[block.name])
            uses.append((block.name, block.input))
    return uses


def test_a_message_with_its_usage_and_job(embedded: Server) -> None:
    message = client_of(embedded).messages.create(model=embedded.model, messages=MESSAGES, **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == embedded.model
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == 12 and usage.cache_creation_input_tokens == 0
    job = embedded.job(job_id_of(message.id))
    assert job.status == "succeeded" and job.queue.endswith(":interactive") and job.result_text == block.text
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == job.prompt_tokens
    assert usage.cache_read_input_tokens == job.cached_tokens
    assert job.params["temperature"] == 0 and job.params["max_tokens"] == 12


def test_a_message_that_ends_on_its_own_is_an_end_turn(embedded: Server) -> None:
    """Sampling from the random weights ends at EOS now and then: the first seed whose answer does."""
    client = client_of(embedded)
    for seed in range(200):
        message = client.messages.create(model=embedded.model, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=64, extra_body={"seed": seed})
        if message.stop_reason != "max_tokens":
            break
    assert message.stop_reason == "end_turn" and message.stop_sequence is None, message
    assert message.usage.output_tokens < 64
    assert embedded.job(job_id_of(message.id)).finish_reason == "stop"


def test_a_stop_sequence_ends_the_message_and_is_named(embedded: Server) -> None:
    client = client_of(embedded)
    free = client.messages.create(model=embedded.model, messages=MESSAGES, **GREEDY)
    text = free.content[0].text  # type: ignore[union-attr]
    stop = text[6:9]  # somewhere inside the greedy text: both answers must end just before it
    assert len(stop) == 3, text
    stopped = client.messages.create(model=embedded.model, messages=MESSAGES, stop_sequences=["\x07", stop],
                                     **GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    with client.messages.stream(model=embedded.model, messages=MESSAGES, stop_sequences=[stop],
                                **GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == stopped.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_a_streamed_message_assembles_into_the_one_not_streamed(embedded: Server) -> None:
    client = client_of(embedded)
    whole = client.messages.create(model=embedded.model, messages=MESSAGES, **GREEDY)
    with client.messages.stream(model=embedded.model, messages=MESSAGES, **GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) >= 2, "text must arrive in several deltas while the job runs"
    assert final.id != whole.id and final.id.startswith("msg_job_")
    assert [(b.type, b.text) for b in final.content] == [  # type: ignore[union-attr]
        (b.type, b.text) for b in whole.content]  # type: ignore[union-attr]
    ended = (final.stop_reason, final.stop_sequence)
    assert ended == (whole.stop_reason, whole.stop_sequence) == ("max_tokens", None)
    assert (final.model, final.role) == (whole.model, whole.role)
    # The same prompt again: it may find more of its prompt in the prefix cache, never a different total.
    for usage in (final.usage, whole.usage):
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == embedded.job(
            job_id_of(whole.id)).prompt_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens == 12


def test_the_streamed_events_come_in_anthropics_order(embedded: Server) -> None:
    body = {"model": embedded.model, "messages": MESSAGES, "max_tokens": 6, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{embedded.url}/v1/messages", json=body, timeout=WAIT_S,
                      headers={"x-api-key": embedded.key, "anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        job_id = response.headers["x-conveyor-job-id"]
        raw = response.read().decode()
    events = [_parsed(part) for part in raw.strip().split("\n\n")]
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"} and len(names) > 6
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["id"] == f"msg_{job_id}" and start["content"] == [] and start["stop_reason"] is None
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text",
                                                                                         "text": ""}}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == embedded.job(job_id).result_text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6


def _parsed(event: str) -> tuple[str, dict[str, Any]]:
    lines = dict(line.split(": ", 1) for line in event.splitlines())
    return lines["event"], json.loads(lines["data"])


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_tool_choice_gives_tool_use_blocks_that_validate(embedded: Server, tool_choice: Any) -> None:
    client = client_of(embedded)
    asked: dict[str, Any] = {"model": embedded.model, "messages": MESSAGES, "tools": [ADD, WEATHER],
                             "tool_choice": {**tool_choice, "disable_parallel_tool_use": True},
                             "max_tokens": 120}
    message = client.messages.create(**asked)
    assert message.stop_reason == "tool_use", message
    [(name, _)] = _valid_tool_uses(message)
    assert tool_choice["type"] == "any" or name == "get_weather"
    job = embedded.job(job_id_of(message.id))
    assert job.chat["parallel_tool_calls"] is False and job.params["structured"]["json_schema"]
    with client.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and len(_valid_tool_uses(final)) == 1


def test_a_conversation_with_tool_use_and_tool_result_blocks(embedded: Server,
                                                            prompt_tokenizer: PromptTokenizer) -> None:
    conversation: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": [{"type": "text", "text": "Adding."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "add",
                                           "input": {"a": 2, "b": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                                     {"type": "text", "text": "Thanks. And the weather?"}]},
    ]
    message = client_of(embedded).messages.create(
        model=embedded.model, system="You add numbers.", messages=conversation, tools=[ADD, WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=120)
    assert _valid_tool_uses(message)[0][0] == "get_weather"
    # The chat the template rendered: the system prompt, the call in the assistant turn, the tool's answer.
    chat = [{"role": "system", "content": "You add numbers."}, *MESSAGES,
            {"role": "assistant", "content": "Adding.", "tool_calls": [{"id": "toolu_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
            {"role": "user", "content": "Thanks. And the weather?"}]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in (ADD, WEATHER)]
    rendered = prompt_tokenizer.encode_messages(template_messages(chat), template_kwargs={"tools": tools})
    text = prompt_tokenizer.decode(rendered)
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    assert "<tool_response>5</tool_response>" in text and "You add numbers." in text
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(rendered)
    options = ChatOptions(tools=tools, tool_choice="auto")
    assert prompt_tokenizer.count_messages(chat, options) == len(rendered)


def test_count_tokens_is_what_the_message_reports(embedded: Server) -> None:
    client = client_of(embedded)
    asked: dict[str, Any] = {"model": embedded.model, "system": "Be brief.", "messages": MESSAGES,
                             "tools": [ADD]}
    counted = client.messages.count_tokens(**asked)
    message = client.messages.create(**asked, max_tokens=2)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0
    assert counted.input_tokens == embedded.job(job_id_of(message.id)).prompt_tokens
    bare = client.messages.count_tokens(model=embedded.model, messages=MESSAGES)
    assert bare.input_tokens < counted.input_tokens  # the tools and the system prompt are counted


def test_a_prefill_is_continued(embedded: Server, prompt_tokenizer: PromptTokenizer) -> None:
    started = [*MESSAGES, {"role": "assistant", "content": "Queues wait"}]
    message = client_of(embedded).messages.create(model=embedded.model, messages=started, **GREEDY)
    rendered = prompt_tokenizer.encode_messages(started, add_generation_prompt=False,
                                                continue_final_message=True)
    assert prompt_tokenizer.decode(rendered).endswith("<|assistant|>\nQueues wait")
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(rendered)


def test_x_api_key_or_bearer_and_nothing_else(embedded: Server) -> None:
    url, body = f"{embedded.url}/v1/messages/count_tokens", {"model": embedded.model, "messages": MESSAGES}
    for headers in ({"x-api-key": embedded.key}, {"Authorization": f"Bearer {embedded.key}"}):
        assert httpx.post(url, json=body, headers=headers).status_code == 200
    bearer = {"Authorization": f"Bearer {embedded.key}"}
    # x-api-key, when sent, is the key: beside a valid bearer, an empty or wrong one is refused.
    for headers in ({}, {"x-api-key": "cvk_wrong"}, {"Authorization": "Bearer cvk_wrong"},
                    {"x-api-key": "", **bearer}, {"x-api-key": "cvk_wrong", **bearer}):
        refused = httpx.post(url, json=body, headers=headers)
        assert refused.status_code == 401, refused.text
        assert refused.json()["type"] == "error"
        assert refused.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        client_of(embedded, "cvk_not-a-key").messages.create(model=embedded.model, messages=MESSAGES,
                                                              max_tokens=2)
    assert wrong.value.status_code == 401 and wrong.value.body["error"]["type"] == "authentication_error"


def test_a_message_is_its_tenants_job_only(embedded: Server) -> None:
    message = client_of(embedded).messages.create(model=embedded.model, messages=MESSAGES, max_tokens=2)
    job_id = job_id_of(message.id)
    mine = httpx.get(f"{embedded.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {embedded.key}"})
    assert mine.status_code == 200 and mine.json()["id"] == job_id
    other = new_api_key(embedded.database_url, "mallory")
    theirs = httpx.get(f"{embedded.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {other}"})
    assert theirs.status_code == 404
    listed = httpx.get(f"{embedded.url}/v1/jobs", headers={"Authorization": f"Bearer {other}"}).json()
    assert job_id not in [job["id"] for job in listed["data"]]
    assert embedded.job(job_id).tenant_id == "alice"


def test_a_job_cancelled_mid_stream_ends_it_with_an_error_event(embedded: Server) -> None:
    with client_of(embedded).messages.stream(model=embedded.model, messages=MESSAGES, max_tokens=900,
                                             extra_body={"temperature": 0}) as stream:
        events = iter(stream)
        opened = next(events)
        assert opened.type == "message_start"
        job_id = job_id_of(opened.message.id)
        wait_for(lambda: embedded.job(job_id).status == "running", "the job to start")
        cancelled = httpx.post(f"{embedded.url}/v1/jobs/{job_id}/cancel",
                               headers={"Authorization": f"Bearer {embedded.key}"})
        assert cancelled.status_code == 200, cancelled.text
        with pytest.raises(anthropic.APIStatusError) as ended:
            list(events)
    assert "cancelled" in str(ended.value)


def test_errors_in_anthropics_shape(workerless: Server) -> None:
    client = client_of(workerless)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "user", "content": [image]}], "max_tokens": 4},
         "messages[0].content[0]: image"),
        ({"messages": MESSAGES}, "max_tokens: Field required"),
        ({"messages": MESSAGES, "max_tokens": 4,
          "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "tools[0]: web_search_20250305 is a server tool"),
        ({"messages": MESSAGES, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024}},
         "thinking: extended thinking is not supported"),
        ({"messages": MESSAGES, "max_tokens": 4, "top_n": 3}, "top_n: Extra inputs are not permitted"),
        ({"messages": MESSAGES, "max_tokens": 65}, "max_tokens: 65 exceeds the interactive queue's"),
        ({"messages": MESSAGES, "max_tokens": 4, "tool_choice": {"type": "any"}}, "tool_choice: needs tools"),
        ({"messages": MESSAGES, "max_tokens": 4, "stop_sequences": ["x"] * 17},
         "stop_sequences: List should"),
    ]
    for asked, message in refusals:
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.post("/v1/messages", body={"model": workerless.model, **asked}, cast_to=httpx.Response)
        assert refused.value.status_code == 400
        assert refused.value.body["type"] == "error", refused.value.body
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        assert refused.value.body["error"]["message"].startswith(message), refused.value.body
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-sonnet-4-5", messages=MESSAGES, max_tokens=4)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in unknown.value.body["error"]["message"]


def test_a_full_queue_is_a_rate_limit_error(workerless: Server) -> None:
    db_engine = make_db_engine(workerless.database_url)
    with make_session_factory(db_engine)() as session:  # the one job the interactive queue may hold
        jobs.add(session, jobs.NewJob(
            tenant_id="bob", queue="demo-model:interactive", prompt="Hi", messages=None, params={}, meta=None,
            webhook=None, idempotency_key=None, request_hash="x", prompt_tokens=1, ttl_s=None, timeout_s=None,
        ), utcnow())
    db_engine.dispose()
    with pytest.raises(anthropic.RateLimitError) as full:
        client_of(workerless).messages.create(model=workerless.model, messages=MESSAGES, max_tokens=4)
    assert full.value.body["error"]["type"] == "rate_limit_error"
    assert full.value.response.headers["retry-after"] == "2"
