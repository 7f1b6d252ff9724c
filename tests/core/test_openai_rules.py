"""The one set of OpenAI request rules (core/protocol/openai_request.py) that the synchronous routes and batch
lines share: chat roles by template, model checks, refusals naming the field, and the job params they
produce."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.core.protocol.chat_messages import ChatRoles
from conveyor.core.protocol.openai_request import (
    CHAT,
    COMPLETIONS,
    ChatCompletionCreate,
    Served,
    check_request,
    parse_body,
)
from conveyor.core.protocol.refusal import Refusal

USER = {"role": "user", "content": "hi"}
SERVED = Served(models=("demo-model", "/models/demo-model"), roles=ChatRoles())


def _refusal(endpoint: str, body: dict[str, Any], served: Served = SERVED) -> Refusal:
    with pytest.raises(Refusal) as caught:
        request = parse_body(endpoint, body)
        check_request(request, served)
        if isinstance(request, ChatCompletionCreate):
            request.chat_messages(served.roles)
    return caught.value


@pytest.mark.parametrize(
    ("template", "roles"),
    [
        (None, ChatRoles()),
        ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}", ChatRoles()),
        ("{% if message['role'] == 'tool' %}<tool>{% endif %}", ChatRoles(tool=True)),
        ('{% if message.role == "developer" %}<dev>{% endif %}', ChatRoles(developer=True)),
        ({"default": "'tool'"}, ChatRoles()),  # several named templates: only the base roles
    ],
)
def test_roles_come_from_the_names_the_template_uses(template: object, roles: ChatRoles) -> None:
    assert ChatRoles.of_template(template) == roles


def test_developer_is_system_unless_the_template_has_it() -> None:
    body = parse_body(CHAT, {"messages": [{"role": "developer", "content": "be brief"}, USER]})
    assert isinstance(body, ChatCompletionCreate)
    assert body.chat_messages(ChatRoles())[0] == {"role": "system", "content": "be brief"}
    assert body.chat_messages(ChatRoles(developer=True))[0] == {"role": "developer", "content": "be brief"}


def test_tool_messages_need_a_template_with_a_tool_role() -> None:
    tool = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    refusal = _refusal(CHAT, {"messages": [USER, tool]})
    assert (refusal.kind, refusal.param) == ("unsupported", "messages[1].role")
    assert "tool role" in refusal.message
    body = parse_body(CHAT, {"messages": [USER, tool]})
    assert isinstance(body, ChatCompletionCreate)
    rendered = {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert body.chat_messages(ChatRoles(tool=True))[1] == rendered


@pytest.mark.parametrize(
    ("endpoint", "body", "kind", "param"),
    [
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "invalid", "messages[0].role"),
        (CHAT, {"model": "gpt-4o", "messages": [USER]}, "model_not_found", "model"),
        (CHAT, {"messages": [USER], "n": 0}, "invalid", "n"),
        (COMPLETIONS, {"prompt": "x", "n": 17}, "invalid", "n"),
        (CHAT, {"messages": [USER], "presence_penalty": 2.5}, "invalid", "presence_penalty"),
        (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, "invalid", "frequency_penalty"),
        (COMPLETIONS, {"prompt": [1, 2]}, "unsupported", "prompt"),
        (COMPLETIONS, {"prompt": []}, "invalid", "prompt"),  # once a 500 (schemathesis)
        (CHAT, {"messages": [USER], "logit_bias": {"5": 1}}, "unsupported", "logit_bias"),
        (CHAT, {"messages": [USER], "regex": "a", "choice": ["a"]}, "invalid", "choice"),
        (CHAT, {"messages": [USER], "response_format": {"type": "yaml"}}, "invalid", "response_format"),
        (
            CHAT,
            {"messages": [USER], "max_tokens": 3, "max_completion_tokens": 4},
            "invalid",
            "max_completion_tokens",
        ),
        (COMPLETIONS, {"prompt": "x", "top_logprobs": 2}, "invalid", "top_logprobs"),
        (CHAT, {"messages": [USER], "logprobs": 1}, "invalid", "logprobs"),  # chat's logprobs is a boolean
        (COMPLETIONS, {"prompt": "x", "bad\x00name": 1}, "invalid", "'bad\\x00name'"),
    ],
)
def test_refusals_name_the_field(endpoint: str, body: dict[str, Any], kind: str, param: str) -> None:
    refusal = _refusal(endpoint, body)
    assert (refusal.kind, refusal.param) == (kind, param)
    assert refusal.message.startswith(f"{param}: ")


def test_any_served_name_is_accepted_and_no_names_means_any() -> None:
    for model in SERVED.models:
        check_request(parse_body(COMPLETIONS, {"prompt": "x", "model": model}), SERVED)
    check_request(parse_body(COMPLETIONS, {"prompt": "x", "model": "anything"}), Served())


def test_job_params_carry_the_penalties_and_only_what_was_sent() -> None:
    chat = parse_body(
        CHAT,
        {
            "messages": [USER],
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "logprobs": True,
            "top_logprobs": 2,
            "stop_token_ids": [2],
            "n": 1,
        },
    )
    assert chat.job_params() == {
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
        "logprobs": 2,
        "stop_token_ids": [2],
    }
    text = parse_body(COMPLETIONS, {"prompt": ["once"], "logprobs": 0, "max_tokens": 3})
    assert text.job_params() == {"logprobs": 0} and text.requested_max_tokens() == 3
