"""Tool calls end to end on the embedded server (demo model, whose chat template renders tools Hermes-style),
driven by the official `openai` SDK: tool_choice required and named (constrained, so the arguments always
validate), auto (the text read by the Hermes parser; its text forced here with a regex, since the demo
model's weights are random), streamed deltas the SDK assembles, a history with calls and tool answers, the
jobs API and a batch line."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from test_openai_chat_sdk import MESSAGES, Server, embedded  # noqa: F401 (the module-scoped fixture)

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.tools import template_messages
from tests.support.openai_batches import run_batch

ADD: dict[str, Any] = {"type": "function", "function": {
    "name": "add", "description": "Adds two numbers.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": -50, "maximum": 50}}}}}
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TOOLS = [ADD, WEATHER]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# What a model trained on the Hermes format would write; the regex makes the demo model write it.
HERMES_TEXT = 'Let me add them. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
HERMES_REGEX = r'Let me add them\. <tool_call>\{"name": "add", "arguments": \{"a": 2, "b": 3\}\}</tool_call>'


def _valid_calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, each checked against its function's schema."""
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_"), call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_required_tool_calls_validate_50_of_50(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=embedded.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120,
            temperature=1.0, seed=seed, parallel_tool_calls=False)

    with ThreadPoolExecutor(8) as pool:
        completions = list(pool.map(ask, range(50)))
    for completion in completions:
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        calls = _valid_calls(choice.message)
        assert len(calls) == 1, choice.message  # parallel_tool_calls=False: one call


def test_a_named_function_is_called_and_streams_as_deltas_the_sdk_assembles(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    asked: dict[str, Any] = dict(model=embedded.model, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                 max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**asked).choices[0]
    assert whole.finish_reason == "tool_calls"
    [(name, arguments)] = _valid_calls(whole.message)
    assert name == "get_weather"
    chunks = list(client.chat.completions.create(**asked, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) > 2  # the arguments arrived as they were generated, not at the end
    opening = deltas[0][0]
    assert opening.id.startswith("call_") and opening.function.name == "get_weather"
    streamed = "".join(d[0].function.arguments or "" for d in deltas)
    assert json.loads(streamed) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_reads_hermes_calls_plain_and_streamed(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    asked: dict[str, Any] = dict(model=embedded.model, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                 temperature=0, extra_body={"regex": HERMES_REGEX})
    choice = client.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add them."
    assert _valid_calls(choice.message) == [("add", {"a": 2, "b": 3})]
    chunks = list(client.chat.completions.create(**asked, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert content.strip() == "Let me add them." and "<tool_call>" not in content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    assert calls[0].id.startswith("call_")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    none = client.chat.completions.create(**{**asked, "tool_choice": "none"}).choices[0]
    assert none.finish_reason == "stop" and none.message.content == HERMES_TEXT
    assert not none.message.tool_calls


def test_a_history_with_calls_and_tool_answers_is_rendered_by_the_template(
    embedded: Server, prompt_tokenizer: PromptTokenizer  # noqa: F811
) -> None:
    history: list[dict[str, Any]] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    completion = embedded.client().chat.completions.create(
        model=embedded.model, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    options = ChatOptions(tools=TOOLS, tool_choice="auto")
    rendered = prompt_tokenizer.encode_messages(template_messages(history), template_kwargs={"tools": TOOLS})
    assert completion.usage is not None and completion.usage.prompt_tokens == len(rendered)
    text = prompt_tokenizer.decode(rendered)
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    assert "<tool_response>5</tool_response>" in text and '"get_weather"' in text
    assert prompt_tokenizer.count_messages(history, options) == len(rendered)


def test_continue_final_message_and_template_kwargs(embedded: Server, prompt_tokenizer: PromptTokenizer,  # noqa: F811
                                                    ) -> None:
    started = [*MESSAGES, {"role": "assistant", "content": "Queues wait"}]
    completion = embedded.client().chat.completions.create(
        model=embedded.model, messages=started, max_tokens=4, temperature=0,
        extra_body={"continue_final_message": True, "chat_template_kwargs": {"unused_variable": 1}})
    rendered = prompt_tokenizer.encode_messages(started, add_generation_prompt=False,
                                                continue_final_message=True)
    assert prompt_tokenizer.decode(rendered).endswith("<|assistant|>\nQueues wait")
    assert completion.usage is not None and completion.usage.prompt_tokens == len(rendered)


def test_jobs_api_tool_calls(embedded: Server) -> None:  # noqa: F811
    headers = {"Authorization": f"Bearer {embedded.key}"}
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 120, "temperature": 0}
    created = httpx.post(f"{embedded.url}/v1/jobs", json=body, headers=headers)
    assert created.status_code == 202, created.text
    job = httpx.get(f"{embedded.url}/v1/jobs/{created.json()['id']}", params={"wait": 60}, headers=headers,
                    timeout=90).json()
    assert job["status"] == "succeeded", job
    [call] = job["result"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert json.loads(job["result"]["text"])[0]["name"] == call["function"]["name"]
    refused = httpx.post(f"{embedded.url}/v1/jobs", headers=headers,
                         json={**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert refused.status_code == 422 and "tool_choice" in refused.text, refused.text


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_batch_line_with_tools_answers_like_the_route(embedded: Server, tool_choice: Any) -> None:  # noqa: F811
    client = embedded.client()
    body = {"model": embedded.model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
            "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0}
    bad = {**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    lines = [{"custom_id": "good", "method": "POST", "url": "/v1/chat/completions", "body": body},
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": bad}]
    answers = run_batch(client, lines, "/v1/chat/completions")
    choice = answers.outputs["good"]["choices"][0]
    routed = client.chat.completions.create(**body).choices[0]
    assert choice["finish_reason"] == routed.finish_reason == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == routed.message.tool_calls[0].function.model_dump()  # greedy: the same call
    assert "bad" in answers.errors and "tool_choice" in answers.errors
