"""A batch line is judged by its model's chat_template as the API judges a request: a worker reading a line
for another served model loads that model's tokenizer with the model's template, so a tool message is
refused under a template without a tool role, and taken (counted as the engine will render it) under
`chatml-tools`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.checkpoints.chat_template import resolve_chat_template
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.service_tiers import PriorityRange
from conveyor.core.settings import Settings
from conveyor.core.store.tables import Batch
from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.batches.lines import BatchRequest, CustomIdSet, LineError, parse_line
from conveyor.worker.batches.model_limits import ModelLimits

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# ChatML of role and content alone, as SmolLM2's own: no tool role.
BARE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_a_line_for_a_model_with_chatml_tools_is_judged_and_counted_with_it(
        migrated_sqlite_url: str, demo_model_dir: Path) -> None:
    settings = Settings(database_url=migrated_sqlite_url, models={
        "own": {"path": str(demo_model_dir)}, "bare": {"path": str(demo_model_dir), "chat_template": BARE},
        "tools": {"path": str(demo_model_dir), "chat_template": "chatml-tools"}})
    of_own = ModelLimits(settings.for_model("own"), Tokenizer(demo_model_dir))
    batch = Batch(id="batch_1", tenant_id="default", endpoint=None, queue="documents")
    limits = of_own.of_chunk(batch, PriorityRange(), {})
    seen = CustomIdSet()

    def parsed(custom_id: str, model: str) -> BatchRequest | LineError:
        body = {"model": model, "messages": HISTORY, "tools": [WEATHER], "max_tokens": 4}
        return parse_line(1, json.dumps({"custom_id": custom_id, "body": body}).encode(), seen, limits)

    taken, refused = parsed("tools", "tools"), parsed("bare", "bare")
    assert isinstance(refused, LineError) and "no tool role" in refused.message, refused
    assert isinstance(taken, BatchRequest), taken
    api = PromptTokenizer(demo_model_dir, resolve_chat_template("chatml-tools"))
    options = ChatOptions(tools=[WEATHER], tool_choice="auto")
    assert taken.prompt_tokens == api.count_messages(HISTORY, options)
