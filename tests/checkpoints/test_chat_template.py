"""The chat_template setting's values resolved to a template (inline text, a shipped name, a file) or refused
saying why; and the shipped `chatml-tools`: what it renders (tools, a call without content, its result), that
transformers' apply_chat_template takes it, that the hermes parser reads its calls back, and that both
tokenizers (the API's and the engine's) render with it when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.checkpoints.chat_template import SHIPPED_DIR, resolve_chat_template, shipped_templates
from conveyor.core.protocol.chat_messages import ChatRoles
from conveyor.core.protocol.chat_options import ChatOptions, tool_parser_for
from conveyor.core.protocol.tools import template_messages
from conveyor.core.views.tool_calls import read_output
from conveyor.engine.tokenizer import Tokenizer

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, à la minute.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL: dict[str, Any] = {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# OpenAI's history (arguments as JSON text), as the API and the worker hand it to template_messages.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
]
RENDERED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    "These functions are available to you, each described as a JSON object:\n<tools>\n"
    + json.dumps(WEATHER["function"], ensure_ascii=False) + "\n</tools>\n\n"
    "To call functions, answer with one <tool_call></tool_call> block per call, each holding a JSON object "
    "with the function's name and its arguments:\n"
    '<tool_call>{"name": "the function", "arguments": {"argument": "value"}}</tool_call>\n'
    "Their results come back inside <tool_response></tool_response>.<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    "<|im_end|>\n"
    "<|im_start|>tool\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def chatml_tools() -> str:
    return resolve_chat_template("chatml-tools")


def _render(tokenizer: Any, messages: list[dict[str, Any]], template: str, **kwargs: Any) -> str:
    """transformers' own apply_chat_template, given the template."""
    return str(tokenizer.apply_chat_template(template_messages(messages), chat_template=template,
                                             tokenize=False, **kwargs))


# --- resolving the setting ---------------------------------------------------------------------------


def test_a_value_holding_jinja_is_the_template_itself() -> None:
    assert resolve_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    loop = "{% for m in messages %}x{% endfor %}"
    assert resolve_chat_template(loop) == loop


def test_a_shipped_name_is_the_packaged_file() -> None:
    assert shipped_templates() == ["chatml-tools"]
    assert resolve_chat_template("chatml-tools") == (SHIPPED_DIR / "chatml-tools.jinja").read_text()


def test_a_path_is_the_files_template(tmp_path: Path) -> None:
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert resolve_chat_template(str(path)) == path.read_text()


@pytest.mark.parametrize(("value", "refusal"), [
    ("/no/such/template.jinja", r"no file '/no/such/template.jinja'.*Conveyor ships \(chatml-tools\)"),
    ("chatml-tool", r"no file 'chatml-tool'.*\(chatml-tools\)"),  # a misspelt name
    ("{% for m in messages %}", r"the template given does not compile as a Jinja template \(line 1\)"),
    ("{{ messages | no_such_filter }}", "does not compile.*no_such_filter"),
])
def test_a_bad_value_is_refused_saying_why(value: str, refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        resolve_chat_template(value)


def test_a_file_that_does_not_compile_or_read_is_refused_naming_it(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if messages %}\n{{ messages[0] }}\n")  # no endif
    with pytest.raises(ValueError, match=rf"'{broken}' does not compile as a Jinja template \(line 2\)"):
        resolve_chat_template(str(broken))
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=rf"cannot read '{binary}'"):
        resolve_chat_template(str(binary))


def test_transformers_generation_tag_compiles() -> None:
    template = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert resolve_chat_template(template) == template


# --- the shipped chatml-tools ------------------------------------------------------------------------


def test_chatml_tools_renders_tools_a_call_without_content_and_its_result(
        chatml_tools: str, prompt_tokenizer: PromptTokenizer) -> None:
    hf = prompt_tokenizer._tok  # transformers' own tokenizer
    rendered = _render(hf, CONVERSATION, chatml_tools, tools=[WEATHER], add_generation_prompt=True)
    assert rendered == RENDERED


def test_chatml_tools_without_tools_adds_no_system_message(chatml_tools: str,
                                                           prompt_tokenizer: PromptTokenizer) -> None:
    hf = prompt_tokenizer._tok
    user = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert _render(hf, [user], chatml_tools) == "<|im_start|>user\nab<|im_end|>\n"
    answered = [*CONVERSATION[1:], {"role": "assistant", "content": "Sunny."}]
    assert _render(hf, answered, chatml_tools, add_generation_prompt=False) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nSunny.<|im_end|>\n")


def test_chatml_tools_renders_content_before_several_calls(chatml_tools: str,
                                                           prompt_tokenizer: PromptTokenizer) -> None:
    second = {**CALL, "id": "call_2", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
    message = {"role": "assistant", "content": "Checking both.", "tool_calls": [CALL, second]}
    assert _render(prompt_tokenizer._tok, [message], chatml_tools) == (
        "<|im_start|>assistant\nChecking both.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Lyon"}}</tool_call><|im_end|>\n')


def test_its_calls_read_back_with_the_parser_its_markers_point_to(chatml_tools: str,
                                                                 prompt_tokenizer: PromptTokenizer) -> None:
    """The roles and the tool parser the API judges by: a tool role, no developer role, hermes; and what it
    renders of a call is what hermes reads as that call."""
    assert ChatRoles.of_template(chatml_tools) == ChatRoles(developer=False, tool=True)
    assert tool_parser_for("auto", chatml_tools) == "hermes"
    rendered = _render(prompt_tokenizer._tok, [CONVERSATION[2]], chatml_tools)
    answer = rendered.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    read = read_output(answer, ChatOptions(tools=[WEATHER], tool_choice="auto", tool_parser="hermes"), "job")
    assert [(call.name, json.loads(call.arguments)) for call in read.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert read.content is None


def test_both_tokenizers_render_with_the_template_given(demo_model_dir: Path, chatml_tools: str) -> None:
    """The API's PromptTokenizer and the engine's Tokenizer, given the template, count and render alike; a
    tokenizer without it keeps the model's own."""
    api, engine = PromptTokenizer(demo_model_dir, chatml_tools), Tokenizer(demo_model_dir, chatml_tools)
    assert api.chat_template == engine.chat_template == chatml_tools
    options = ChatOptions(tools=[WEATHER], tool_choice="auto")
    ids = api.encode_chat(CONVERSATION, options)
    assert ids == engine.apply_chat_template(template_messages(CONVERSATION), **options.template_kwargs())
    assert ids == engine.encode(RENDERED, add_special_tokens=False)
    assert PromptTokenizer(demo_model_dir).chat_template != chatml_tools
    assert Tokenizer(demo_model_dir).chat_template != chatml_tools
