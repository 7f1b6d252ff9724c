"""Anthropic's Messages request translated into the OpenAI chat request every other door sends
(core/protocol/anthropic_request.py): each Anthropic shape -> the chat request it is, the job parameters that
follow from it (the same as the equivalent chat request's), and refusals naming the Anthropic field."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.core.protocol.anthropic_request import (
    MessageCountTokens,
    MessageCreate,
    parse_message_body,
)
from conveyor.core.protocol.chat_messages import ChatRoles
from conveyor.core.protocol.openai_request import ChatCompletionCreate, Served
from conveyor.core.protocol.refusal import Refusal

USER = {"role": "user", "content": "hi"}
SERVED = Served(models=("demo-model",), roles=ChatRoles(tool=True))
ADD = {"name": "add", "description": "Adds.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
ADD_FUNCTION = {"type": "function", "function": {"name": "add", "description": "Adds.",
                                                 "parameters": ADD["input_schema"]}}
CONVERSATION: list[dict[str, Any]] = [
    USER,
    {"role": "assistant", "content": [
        {"type": "text", "text": "Adding"}, {"type": "text", "text": " now."},
        {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2}},
        {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {"a": 3}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
         "content": [{"type": "text", "text": "too "}, {"type": "text", "text": "big"}]},
        {"type": "text", "text": "So?", "cache_control": {"type": "ephemeral"}}]},
]


def _message(**fields: Any) -> MessageCreate:
    return parse_message_body({"model": "demo-model", "max_tokens": 8, "messages": [USER], **fields})


def _chat(**fields: Any) -> ChatCompletionCreate:
    return _message(**fields).chat_request()


def _refusal(body: dict[str, Any], served: Served = SERVED) -> Refusal:
    with pytest.raises(Refusal) as caught:
        _message(**body).judged(served)
    return caught.value


def test_a_plain_message_is_the_chat_request_with_the_same_job_params() -> None:
    message = _message(system="Be brief.", temperature=0.5, top_p=0.9, top_k=40, stream=True, seed=3,
                       metadata={"user_id": "u-1"}, service_tier="standard_only", priority=-1,
                       deadline_s=30.0, on_deadline_miss="reject")
    system = {"role": "system", "content": "Be brief."}
    same = ChatCompletionCreate.model_validate({
        "model": "demo-model", "max_tokens": 8, "messages": [system, USER],
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stream": True, "seed": 3, "user": "u-1",
        "service_tier": "default", "priority": -1, "deadline_s": 30.0, "on_deadline_miss": "reject"})
    chat = message.chat_request()
    assert chat == same
    assert chat.job_params() == same.job_params()
    judged = message.judged(SERVED)
    assert judged.messages == [{"role": "system", "content": "Be brief."}, USER]


def test_system_blocks_are_the_system_messages_text_parts() -> None:
    chat = _chat(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.",
                                                            "cache_control": {"type": "ephemeral"}}])
    assert chat.chat_messages(SERVED.roles)[0] == {"role": "system", "content": "Be brief."}


def test_tool_use_and_tool_result_blocks_are_calls_and_tool_messages() -> None:
    judged = _message(messages=CONVERSATION, tools=[ADD]).judged(SERVED)
    assert judged.messages == [
        USER,
        {"role": "assistant", "content": "Adding now.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 3}'}}]},
        {"role": "tool", "content": "2", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "too big", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "So?"},
    ]
    assert judged.request.continue_final_message is None  # a user turn last: the answer is a new turn


def test_an_assistant_turn_of_calls_alone_has_no_content() -> None:
    turn = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "add", "input": {}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
    messages = _message(messages=[USER, turn, result]).judged(SERVED).messages
    assert messages[1]["content"] is None and messages[1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert messages[2] == {"role": "tool", "content": "", "tool_call_id": "t"}


def test_a_last_assistant_message_is_a_prefill() -> None:
    chat = _chat(messages=[USER, {"role": "assistant", "content": "Once upon"}])
    assert chat.continue_final_message is True and chat.add_generation_prompt is None
    assert chat.job_params()["continue_final_message"] is True


@pytest.mark.parametrize(("choice", "openai_choice", "parallel"), [
    ({"type": "auto"}, "auto", None),
    ({"type": "any"}, "required", None),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}, None),
    ({"type": "auto", "disable_parallel_tool_use": False}, "auto", None),
    ({"type": "none"}, "none", None),
])
def test_tools_and_tool_choice_are_openais(choice: dict[str, Any], openai_choice: Any,
                                           parallel: bool | None) -> None:
    tool = {**ADD, "type": "custom", "cache_control": {"type": "ephemeral"}}
    chat = _chat(tools=[tool], tool_choice=choice)
    assert [tool.model_dump(mode="json", exclude_none=True) for tool in chat.tools or []] == [ADD_FUNCTION]
    assert chat.model_dump(mode="json")["tool_choice"] == openai_choice
    assert chat.parallel_tool_calls is parallel


def test_stop_sequences_are_stops_kept_in_the_text() -> None:
    params = _chat(stop_sequences=["END", "\n\n"]).job_params()
    assert params["stop"] == ["END", "\n\n"] and params["include_stop_str_in_output"] is True
    assert "include_stop_str_in_output" not in _chat().job_params()
    assert "stop" not in _chat(stop_sequences=[]).job_params()


def test_thinking_disabled_and_service_tier_auto_change_nothing() -> None:
    assert _chat(thinking={"type": "disabled"}, service_tier="auto").job_params() == {"service_tier": "auto"}


def test_count_tokens_takes_the_conversation_alone() -> None:
    body = {"model": "demo-model", "messages": [USER], "system": "s", "tools": [ADD]}
    chat = MessageCountTokens.model_validate(body).chat_request()
    assert chat.max_tokens is None and len(chat.messages) == 2 and chat.tools is not None
    with pytest.raises(ValueError, match="max_tokens"):
        MessageCountTokens.model_validate({**body, "max_tokens": 4})


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


@pytest.mark.parametrize(("body", "param", "reason"), [
    ({"max_tokens": None}, "max_tokens", "valid integer"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0]",
     "image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0]", "document blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [IMAGE]}]}]},
     "messages[0].content[0].content[0]", "image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0]",
     "type must be one of text, tool_use, tool_result"),
    ({"system": [IMAGE]}, "system[0]", "image blocks are not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]}, "tools[0]",
     "web_search_20250305 is a server tool"),
    ({"tools": [{"name": "a b", "input_schema": {}}]}, "tools[0].name", "should match pattern"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name", "Field required"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice", "type must be one of auto, any, tool, none"),
    ({"stop_sequences": [""]}, "stop_sequences[0]", "at least 1 character"),
    ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team", "Extra inputs are not permitted"),
    ({"service_tier": "priority"}, "service_tier", "'auto' or 'standard_only'"),
    ({"n": 2}, "n", "Extra inputs are not permitted"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{}]}]}]},
     "messages[0].content[0].citations", "citations are not supported"),
    ({"system": [{"type": "text", "text": "x", "citations": [{}]}]}, "system[0].citations",
     "citations are not supported"),
])
def test_the_models_refuse_naming_the_anthropic_field(body: dict[str, Any], param: str, reason: str) -> None:
    refusal = _refusal(body)
    assert refusal.kind == "invalid" and refusal.param == param
    assert refusal.message.startswith(f"{param}: ") and reason in refusal.message, refusal.message


@pytest.mark.parametrize(("body", "param", "reason"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "extended thinking"),
    ({"mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}]}, "mcp_servers", "MCP"),
    ({"container": "container_1"}, "container", "containers"),
])
def test_what_conveyor_does_not_run_is_refused_by_name(body: dict[str, Any], param: str, reason: str) -> None:
    refusal = _refusal(body)
    assert (refusal.kind, refusal.param) == ("unsupported", param) and reason in refusal.message


@pytest.mark.parametrize(("body", "param", "reason"), [
    ({"model": "claude-sonnet-4-5"}, "model", "does not exist; this server serves `demo-model`"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "mul"}}, "tool_choice", "'mul'"),
    ({"tools": [ADD, ADD]}, "tools[1].name", "named twice"),
    ({"tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]}, "tools[0].input_schema",
     "not a valid JSON Schema"),
    ({"messages": [USER, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[1].content[0]", "tool_result blocks belong in user messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[1]", "tool_use blocks belong in assistant messages"),
])
def test_the_shared_rules_refuse_naming_the_anthropic_field(body: dict[str, Any], param: str,
                                                            reason: str) -> None:
    refusal = _refusal(body)
    assert refusal.param == param and refusal.message.startswith(f"{param}: ") and reason in refusal.message


def test_a_tool_result_is_refused_where_the_template_has_no_tool_role() -> None:
    refusal = _refusal({"messages": CONVERSATION}, Served(models=("demo-model",), roles=ChatRoles()))
    assert refusal.kind == "unsupported" and refusal.param == "messages[2].content[0]"
    assert "no tool role" in refusal.message


@pytest.mark.parametrize(("openai_field", "anthropic_field"), [
    ("messages[0].content", "system"),
    ("messages[1]", "messages[0]"),
    ("messages[2].tool_calls[1].function.arguments", "messages[1].content[3].input"),
    ("messages[2].content[1].text", "messages[1].content[1].text"),
    ("messages[3].role", "messages[2].content[0]"),
    ("messages[4].content", "messages[2].content[1].content"),
    ("messages[5].content[0]", "messages[2].content[2]"),
    ("messages", "messages"),
    ("tools[0].function.parameters", "tools[0].input_schema"),
    ("tools[0].function.name", "tools[0].name"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
    ("stop", "stop_sequences"),
    ("stop[2]", "stop_sequences[2]"),
    ("max_completion_tokens", "max_tokens"),
    ("user", "metadata.user_id"),
    ("temperature", "temperature"),
    (None, None),
])
def test_each_chat_field_names_its_anthropic_origin(openai_field: str | None, anthropic_field: str | None,
                                                   ) -> None:
    message = _message(system="s", messages=CONVERSATION)
    assert message.anthropic_field(openai_field) == anthropic_field


def test_parse_message_body_names_the_field_as_a_batch_line_error_would() -> None:
    with pytest.raises(Refusal) as caught:
        parse_message_body({"model": "m", "messages": [USER], "max_tokens": "8"})
    assert caught.value.param == "max_tokens" and caught.value.message == (
        "max_tokens: Input should be a valid integer")
