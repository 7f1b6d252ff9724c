"""An agent loop on the real demo model, SmolLM2-135M-Instruct, whose own chat template renders role and
content alone: with `chat_template = "chatml-tools"` (the template Conveyor ships) the embedded server takes
a chat with a tool, answers it with a required call, and then answers the call's result sent back as a
`tool` message, with text. Without the setting the same history is refused (400: the template has no tool
role). The API (its /tokenize) and the worker (the job's usage) count the same prompt, the one transformers
renders with the shipped template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_openai_chat_sdk import Server

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.checkpoints.chat_template import resolve_chat_template
from conveyor.cli.api_server import load_tokenizers
from conveyor.core.settings import Settings
from conveyor.core.store.migrate import upgrade
from tests.support.live_server import new_api_key, serving
from tests.support.webhook_service import NullPublisher

# As tests/api/test_real_model_embedded.py serves it: fp32 on CPU over the file's int4 weights, 2 threads.
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=512, num_kv_blocks=64, block_size=16, max_model_len=1024,
              dtype="float32", device="cpu", attention_backend="torch", num_threads=2)
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
QUESTION: dict[str, Any] = {"role": "user", "content": "What's the weather like in Paris today?"}
RESULT = '{"city": "Paris", "sky": "sunny", "temperature_c": 24}'

pytestmark = pytest.mark.xdist_group("smollm2")  # the SmolLM2 tests share one worker (tests/conftest.py)


def _settings(tmp: Path, smollm2_dir: Path, **given: Any) -> Settings:
    url = f"sqlite:///{tmp / 'conveyor.db'}"
    upgrade(url)
    return Settings(data_dir=tmp, database_url=url, model=str(smollm2_dir), auth_enabled=True,
                    reconcile_interval_s=0.2, dispatch_grace_s=0.5, worker_heartbeat_s=0.2,
                    cancel_poll_s=0.1, **ENGINE, **given)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Server]:
    from conveyor.worker.embedded import EmbeddedRuntime

    settings = _settings(tmp_path_factory.mktemp("chatml-tools"), smollm2_dir, chat_template="chatml-tools")
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=load_tokenizers(settings),
                     runtime=runtime, token_stream=runtime.token_stream, finished_watch=runtime.finished,
                     finished_sink=runtime.finished)
    with serving(app) as base:
        yield Server(base, new_api_key(settings.database_url, "alice"), smollm2_dir.name,
                     settings.database_url, runtime, settings)


@pytest.fixture(scope="module")
def history(server: Server) -> list[Any]:
    """The question, the model's required call (an assistant message without content) and its result."""
    asked = server.client().chat.completions.create(model=server.model, messages=[QUESTION], tools=[WEATHER],
                                                    tool_choice="required", temperature=0, max_tokens=32)
    choice = asked.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert "paris" in json.loads(call.function.arguments)["city"].lower()  # type: ignore[union-attr]
    calls = [call.model_dump() for call in choice.message.tool_calls or []]
    return [QUESTION, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": call.id, "content": RESULT}]


def test_the_result_of_a_tool_call_sent_back_is_answered_with_text(server: Server, history: list[Any],
                                                                   smollm2_dir: Path) -> None:
    """The agent loop's next turn (the tools still offered, tool_choice auto: read by hermes, the parser the
    template's marker points to): the model reads the result and says it."""
    answer = server.client().chat.completions.create(model=server.model, messages=history, tools=[WEATHER],
                                                     temperature=0, max_tokens=24)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice
    assert "sunny" in (choice.message.content or "").lower(), choice  # the result, read

    # The worker rendered the history with the shipped template as transformers does with it, and the API
    # counts that same prompt.
    assert PromptTokenizer(smollm2_dir).chat_template != resolve_chat_template("chatml-tools")
    expected = _transformers_ids(smollm2_dir, history)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(expected)
    counted = httpx.post(server.url + "/tokenize", headers={"authorization": f"Bearer {server.key}"},
                         json={"model": server.model, "messages": history, "tools": [WEATHER]}, timeout=30)
    assert counted.status_code == 200, counted.text
    assert counted.json()["tokens"] == expected


def test_without_the_setting_the_models_own_template_refuses_the_tool_message(
        server: Server, history: list[Any], tmp_path: Path, smollm2_dir: Path) -> None:
    """The history the shipped template answers, sent to the model's own template: 400 naming the role."""
    settings = _settings(tmp_path, smollm2_dir)
    app = create_app(settings, publisher=NullPublisher(), tokenizer=load_tokenizers(settings))
    with serving(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=new_api_key(settings.database_url, "alice"),
                               max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no tool role") as refused:
            client.chat.completions.create(model=server.model, messages=history, tools=[WEATHER],
                                           max_tokens=16)
    assert refused.value.body["param"] == "messages[2].role"  # type: ignore[index]


def _transformers_ids(folder: Path, messages: list[dict[str, Any]]) -> list[int]:
    """transformers' own rendering with the shipped template (arguments as objects, as templates take
    them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    plain = [{**message, "tool_calls": [{**call, "function": {**call["function"], "arguments": json.loads(
        call["function"]["arguments"])}} for call in message["tool_calls"]]} if "tool_calls" in message
             else message for message in messages]
    text = tokenizer.apply_chat_template(plain, tools=[WEATHER], tokenize=False, add_generation_prompt=True,
                                         chat_template=resolve_chat_template("chatml-tools"))
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_an_openai_agents_agent_runs_to_completion_over_the_responses_api(server: Server) -> None:
    """The `openai-agents` package in its default mode (the Responses API): its first turn is a required
    call of its one function tool, which it runs; the next turn (tool_choice reset to auto, the call and its
    output sent back as items) answers with text, which ends the run."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # traces would go to OpenAI's platform
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return RESULT

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0)
    agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=server.model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48))
    result = Runner.run_sync(agent, QUESTION["content"], max_turns=3)
    assert [city.lower() for city in asked] == ["paris"]
    answer = result.final_output
    assert isinstance(answer, str) and "sunny" in answer.lower(), answer
    assert [item.type for item in result.new_items][:2] == ["tool_call_item", "tool_call_output_item"]
    assert all(raw.response_id.startswith("resp_") for raw in result.raw_responses)


def test_an_anthropic_tool_round_trip_is_answered_with_text(server: Server) -> None:
    """The same loop through Anthropic's Messages API and its SDK: a `tool_use` block forced by tool_choice
    `tool`, its `tool_result` sent back, then a text answer that reads the result."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key=server.key, max_retries=0)
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    question = {"role": "user", "content": QUESTION["content"]}
    asked = client.messages.create(model=server.model, max_tokens=32, messages=[question], tools=[tool],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body={"temperature": 0})
    [use] = asked.content
    assert asked.stop_reason == "tool_use" and use.type == "tool_use" and "paris" in use.input["city"].lower()
    answer = client.messages.create(model=server.model, max_tokens=24, tools=[tool],
                                    extra_body={"temperature": 0}, messages=[
        question, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}])
    assert answer.stop_reason == "end_turn" and "sunny" in answer.content[0].text.lower(), answer
