"""The one set of OpenAI request rules (core/protocol/openai_request.py) that the synchronous routes and batch
lines share: chat roles by template, model checks, refusals naming the field, and the job params they
produce."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.core.protocol.chat_messages import ChatRoles
from conveyor.core.protocol.completion_prompts import Prompts
from conveyor.core.protocol.openai_request import (
    CHAT,
    COMPLETIONS,
    ChatCompletionCreate,
    CompletionCreate,
    Served,
    check_request,
    parse_body,
)
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.request_limits import RequestLimits, prompt_sizes, size_problem, tokens_problem

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
        (COMPLETIONS, {"prompt": [[1, 2], "x"]}, "invalid", "prompt[1]"),  # token ids, or text: not both
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


@pytest.mark.parametrize(("prompt", "items", "listed", "stored"), [
    ("once", ["once"], False, ("once", None)),  # as every release stores a prompt
    (["once"], ["once"], True, ("once", None)),
    (["once", "twice"], ["once", "twice"], True, (None, ["once", "twice"])),
    ([1, 2, 3], [[1, 2, 3]], False, (None, [[1, 2, 3]])),
    ([[1, 2], [3]], [[1, 2], [3]], True, (None, [[1, 2], [3]])),
])
def test_a_completion_takes_every_prompt_shape(prompt: Any, items: list[Any], listed: bool,
                                              stored: tuple[Any, Any]) -> None:
    body = parse_body(COMPLETIONS, {"prompt": prompt, "n": 2})
    check_request(body, SERVED)
    assert isinstance(body, CompletionCreate)
    prompts = body.prompts()
    assert (prompts.items, prompts.listed) == (items, listed)
    assert (prompts.stored_prompt(), prompts.stored_inputs()) == stored
    assert body.job_params() == {"n": 2}  # n choices of each prompt


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": []}, "prompt", "prompt: must not be empty"),  # said once, not "prompt: prompt: ..."
    ({"prompt": [[1], []]}, "prompt[1]", "prompt[1]: must not be an empty list of token ids"),
    ({"prompt": [3, -1]}, "prompt[1]", "prompt[1]: token id -1 is out of range (0 to 2147483647)"),
    ({"prompt": [[3], [2**31]]}, "prompt[1][0]", "prompt[1][0]: token id 2147483648 is out of range"),
    ({"prompt": [[3], 4]}, "prompt[1]", "prompt[1]: must be a list of token ids, as prompt[0] is"),
    ({"prompt": [1.5]}, "prompt[0]", "prompt[0]: must be a string, a token id (an integer) or a list"),
    ({"prompt": ["a"] * 2049}, "prompt", "prompt: 2049 prompts exceed the limit of 2048 per request"),
    ({"prompt": ["a"] * 129, "n": 16}, "n", "n: 16 choices for each of 129 prompts exceed the limit of 2048"),
])
def test_a_bad_prompt_is_refused_naming_the_item(body: dict[str, Any], param: str, message: str) -> None:
    refusal = _refusal(COMPLETIONS, body)
    assert (refusal.kind, refusal.param) == ("invalid", param)
    assert refusal.message.startswith(message)


def test_each_prompt_is_held_to_the_vocabulary_and_the_limits_on_its_own() -> None:
    limits = RequestLimits("interactive", max_prompt_tokens=6, max_model_len=9, vocab_size=100)
    several = prompt_sizes(Prompts([[1, 2], [3, 100], "text"], listed=True), max_tokens=4)
    assert [size.named for size in several] == ["prompt[0]", "prompt[1]", "prompt[2]"]
    assert size_problem(several[0], limits) is None
    unknown = size_problem(several[1], limits)
    assert unknown is not None and unknown.field == "prompt[1][1]"
    assert unknown.message == "prompt[1][1]: token id 100 is not in the model's vocabulary (0 to 99)"
    [alone] = prompt_sizes(Prompts([[7, 100]]), max_tokens=4)  # one list of ids: its tokens are prompt[j]
    assert (problem := size_problem(alone, limits)) is not None and problem.field == "prompt[1]"
    long = tokens_problem(several[2], 7, limits)
    assert long is not None and long.message.startswith("prompt[2]: 7 tokens exceeds the interactive queue's")
    context = tokens_problem(several[2], 6, limits)
    assert context is not None and context.field == "max_tokens"
    assert context.message == ("max_tokens: 6 prompt tokens (prompt[2]) + max_tokens 4 exceeds max_model_len "
                               "(9)")
