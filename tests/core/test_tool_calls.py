"""Reading tool calls out of a job's text (core/views/tool_calls.py), streaming them
(core/views/tool_stream.py), and the options and constraint a request's tool fields make
(core/protocol/chat_options.py, core/protocol/tools.py)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from conveyor.core.protocol.chat_options import ChatOptions, chat_options, tool_parser_for
from conveyor.core.protocol.tools import NamedToolChoice, Tool, constrained_schema, history_problem
from conveyor.core.views.tool_calls import call_id, read_output
from conveyor.core.views.tool_stream import StreamDivergedError, ToolCallStream, answer_stream

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
NOTE = {"type": "function", "function": {"name": "note"}}
TOOLS = [ADD, NOTE]
NAMED = {"type": "function", "function": {"name": "add"}}


def options(parser: str = "hermes", choice: Any = "auto", **more: Any) -> ChatOptions:
    return ChatOptions(tools=TOOLS, tool_choice=choice, tool_parser=parser, **more)  # type: ignore[arg-type]


def calls(text: str, opts: ChatOptions) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in read_output(text, opts, "job_1").tool_calls]


@pytest.mark.parametrize(
    ("parser", "text", "content", "expected"),
    [
        ("hermes", 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "Sure.",
         [("add", {"a": 1})]),
        ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
                   '<tool_call>{"name": "note", "arguments": "{}"}</tool_call>', None,
         [("add", {"a": 1}), ("note", {})]),
        # unclosed: the text ended at a stop
        ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}', None, [("add", {"a": 1})]),
        ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "note", '
                        '"parameters": {}}', None, [("add", {"a": 1}), ("note", {})]),
        ("llama3_json", ' {"name": "add", "arguments": {"a": 7}}', None, [("add", {"a": 7})]),
        ("mistral", 'Ok [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]', "Ok", [("add", {"a": 1})]),
        ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 2}[TOOL_CALLS]note[ARGS]{}', None,
         [("add", {"a": 2}), ("note", {})]),
    ],
)
def test_each_parser_reads_its_format(parser: str, text: str, content: str | None,
                                      expected: list[tuple[str, Any]]) -> None:
    read = read_output(text, options(parser), "job_1")
    assert read.content == content
    assert [(c.name, json.loads(c.arguments)) for c in read.tool_calls] == expected
    assert [c.id for c in read.tool_calls] == [call_id("job_1", i) for i in range(len(expected))]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", "No call here."),
        ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'),  # cut JSON
        ("hermes", '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>'),  # not offered
        ("hermes", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'),  # arguments not an object
        ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and then some words'),
        ("mistral", "[TOOL_CALLS] not json"),
        ("hermes", "<tool_call>" + "[" * 100_000),  # deeper than Python's JSON parser goes
        ("llama3_json", "[" * 100_000),
    ],
)
def test_text_that_holds_no_well_formed_call_is_all_content(parser: str, text: str) -> None:
    read = read_output(text, options(parser), "job_1")
    assert (read.content, read.tool_calls) == (text, [])


def test_constrained_choices_read_the_whole_text_as_the_call() -> None:
    assert calls('[{"name": "note", "arguments": {}}, {"name": "add", "arguments": {"a": 3}}]',
                 options(choice="required")) == [("note", {}), ("add", {"a": 3})]
    named = read_output('{"a": 4}', options(choice=NAMED), "job_1")
    assert named.content is None
    assert [(c.name, c.arguments) for c in named.tool_calls] == [("add", '{"a": 4}')]
    assert read_output('{"a": ', options(choice=NAMED), "job_1").tool_calls == []  # cut by max_tokens
    unread = read_output("<tool_call>", ChatOptions(tools=TOOLS, tool_choice="none"), "j")
    assert unread.content == "<tool_call>"


def test_the_constraint_schema_accepts_exactly_the_calls() -> None:
    schema = constrained_schema(TOOLS, "required", parallel=False)
    assert schema is not None
    jsonschema.validate([{"name": "add", "arguments": {"a": 1}}], schema)
    for wrong in ([], [{"name": "add", "arguments": {}}], [{"name": "other", "arguments": {}}],
                  [{"name": "note", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    parallel = constrained_schema(TOOLS, "required", parallel=True)
    assert parallel is not None and "maxItems" not in parallel
    assert constrained_schema(TOOLS, NAMED, parallel=True) == ADD["function"]["parameters"]  # type: ignore[index]
    assert constrained_schema(TOOLS, "auto", parallel=True) is None


def test_request_fields_make_options_or_a_refusal_naming_the_field() -> None:
    tools = [Tool.model_validate(t) for t in TOOLS]
    made = chat_options(tools=tools, tool_choice=None, parallel_tool_calls=None, add_generation_prompt=None,
                        continue_final_message=True, chat_template_kwargs=None, parser="mistral")
    assert made.tool_choice == "auto" and not made.add_generation_prompt and made.keeps_special_tokens()
    assert ChatOptions.from_json(made.to_json()) == made
    assert ChatOptions().to_json() is None
    bad = [({"tool_choice": NamedToolChoice.model_validate({"type": "function", "function": {"name": "x"}})},
            "tool_choice"), ({"tools": None, "tool_choice": "required"}, "tool_choice"),
           ({"tools": tools + tools[:1]}, "tools[2].function.name"),
           ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
           ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message")]
    for fields, param in bad:
        given = dict(tools=tools, tool_choice=None, parallel_tool_calls=None, add_generation_prompt=None,
                     continue_final_message=None, chat_template_kwargs=None, parser="hermes")
        with pytest.raises(ValueError, match=f"^{param.replace('[', '.').replace(']', '.')}: "):
            chat_options(**{**given, **fields})  # type: ignore[arg-type]


def test_the_parser_follows_the_setting_or_the_templates_markers() -> None:
    assert tool_parser_for("auto", "{{ '[TOOL_CALLS]' }}") == "mistral"
    assert tool_parser_for("auto", "<|python_tag|>{{ x }}") == "llama3_json"
    assert tool_parser_for("auto", "<tool_call>") == tool_parser_for("auto", None) == "hermes"
    assert tool_parser_for("mistral", "<tool_call>") == "mistral"


def _stream(opts: ChatOptions, text: str, step: int = 3) -> tuple[list[dict[str, Any]], bool]:
    stream = answer_stream(opts, "job_1")
    deltas = [d for end in range(step, len(text), step) for d in stream.update(text[:end])]
    rest, called = stream.close(text)
    return deltas + rest, called


def _assembled(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """What the SDK builds from the deltas: content, and calls merged by index."""
    content, merged = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            into = merged.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            into["id"] = call.get("id") or into["id"]
            into["name"] += call.get("function", {}).get("name") or ""
            into["arguments"] += call.get("function", {}).get("arguments") or ""
    return content, [merged[i] for i in sorted(merged)]


@pytest.mark.parametrize(
    ("opts", "text"),
    [
        (options("hermes"), 'Let me see. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'),
        (options("mistral"), 'Hm [TOOL_CALLS] [{"name": "note", "arguments": {}}]'),
        (options("llama3_json"), '{"name": "add", "parameters": {"a": 5}}'),
        (options(choice="required"), '[{"name": "add", "arguments": {"a": 1}}]'),
        (options(choice=NAMED), '{"a": 12345}'),
    ],
)
def test_streamed_deltas_assemble_to_the_whole_answer(opts: ChatOptions, text: str) -> None:
    deltas, called = _stream(opts, text)
    content, streamed_calls = _assembled(deltas)
    whole = read_output(text, opts, "job_1")
    assert called and content.strip() == (whole.content or "")
    assert "<tool_call>" not in content and "[TOOL_CALLS]" not in content
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in streamed_calls] == [
        (c.id, c.name, json.loads(c.arguments)) for c in whole.tool_calls]


def test_content_streams_before_the_call_and_a_marker_prefix_is_held() -> None:
    stream = ToolCallStream(options("hermes"), "job_1")
    assert stream.update("Hello <tool_") == [{"content": "Hello "}]  # "<tool_" may begin the marker
    assert stream.update("Hello <tool_call>{") == []
    named = ToolCallStream(options(choice=NAMED), "job_1")
    first = named.update('{"a"')
    assert first[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a"'}
    assert named.update('{"a": 1') == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 1"}}]}]


def test_a_text_without_calls_streams_as_content_and_a_diverged_one_is_told() -> None:
    deltas, called = _stream(options("hermes"), "Just words, and a < sign.")
    assert not called and _assembled(deltas)[0] == "Just words, and a < sign."
    stream = ToolCallStream(options("hermes"), "job_1")
    stream.update("abc")
    with pytest.raises(StreamDivergedError):
        stream.close("xyz")


def test_a_history_call_whose_arguments_are_no_object_is_refused_naming_it() -> None:
    for arguments in ("[1]", "{", "[" * 100_000):
        call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": arguments}}
        problem = history_problem([{"role": "assistant", "content": None, "tool_calls": [call]}])
        assert problem == ("messages[0].tool_calls[0].function.arguments", "must be a JSON object's text")
