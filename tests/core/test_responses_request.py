"""A Responses API body as the chat request it is (core/protocol/responses_request.py): each input item's
message, function tools and formats in chat's form, the earlier turns first, Conveyor's extras split between
the chat and jobs rules, and every refusal naming the Responses field the client sent."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.core.protocol.chat_messages import ChatRoles
from conveyor.core.protocol.openai_request import Served
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.responses_request import ResponseCreate

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": SCHEMA}


def chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> Any:
    """The chat request, judged as the route judges it (a template with a tool role)."""
    translated = ResponseCreate.model_validate(body).chat_request(history or [])
    translated.messages(Served(roles=ChatRoles(developer=True, tool=True)))
    return translated.chat


def test_items_become_chat_messages_in_order() -> None:
    request = chat({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer "},
                                          {"type": "input_text", "text": "in French."}]}]},
        history=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    plain = [m.model_dump(exclude_none=True) for m in request.messages]
    assert plain == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"},
        {"role": "developer", "content": "Answer in French."}]


def test_fields_take_their_chat_names() -> None:
    request = chat({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
                    "parallel_tool_calls": False, "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                    "include": ["message.output_text.logprobs"], "top_logprobs": 3,
                    "seed": 11, "priority": 2, "stop": ["\n"]})
    params = request.job_params()
    assert request.requested_max_tokens() == 7 and params["logprobs"] == 3 and params["seed"] == 11
    assert params["tools"][0].function.name == "get_weather"
    assert params["tool_choice"].function.name == "get_weather"
    assert params["parallel_tool_calls"] is False and params["priority"] == 2 and params["stop"] == ["\n"]
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    formatted = chat({"input": "x", "text": {"format": fmt}})
    assert formatted.job_params()["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


def test_placement_extras_are_left_to_the_jobs_rules() -> None:
    body = ResponseCreate.model_validate({"input": "x", "queue": "documents", "delay_s": 5, "seed": 1})
    assert body.placement() == {"queue": "documents", "delay_s": 5}
    assert "queue" not in body.chat_request([]).chat.job_params()


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0]"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"input": "x", "tools": [{**TOOL, "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "tools": [TOOL, TOOL]}, "tools[1].name"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "messages": []}, "messages"),
    ({"input": "x", "min_p": 7}, "min_p"),
])
def test_refusals_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(Refusal) as refused:
        chat(body)
    assert refused.value.param == param and refused.value.message.startswith(param + ": "), refused.value


def test_stored_form_lists_the_input_items_with_text_parts() -> None:
    body = ResponseCreate.model_validate({"input": "Hello", "instructions": "Be kind.", "background": True,
                                         "tools": [TOOL], "tool_choice": "required"})
    stored = body.stored()
    assert stored["input"] == [{"type": "message", "role": "user",
                                "content": [{"type": "input_text", "text": "Hello"}]}]
    assert stored["instructions"] == "Be kind." and stored["background"] and stored["tools"] == [TOOL]
