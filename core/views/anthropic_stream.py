"""A streamed Anthropic message: its events, in Anthropic's order:

    message_start, content_block_start, ping, content_block_delta..., content_block_stop, (more blocks),
    message_delta (stop_reason, usage), message_stop

built from the chat deltas a running job's answer makes (core/views/tool_stream.py, which decides what may be
sent while the job runs): content goes into a text block as text_delta; each tool call opens a tool_use block
whose input streams as input_json_delta. The events assemble, in Anthropic's SDK, into the message POST
/v1/messages answers without streaming (core/views/anthropic_objects.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.core.views.anthropic_objects import Ending, stop_reason, tool_use_id, usage
from conveyor.core.views.openai_objects import GenerationResult

PING: dict[str, Any] = {"type": "ping"}
MESSAGE_STOP: dict[str, Any] = {"type": "message_stop"}


def message_start(message_id: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    """The message as it opens: no content yet; its prompt's tokens as counted at submit (message_delta says
    how many the prefix cache served)."""
    message = {"id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": 0}}
    return {"type": "message_start", "message": message}


def message_delta(result: GenerationResult, ended: Ending, called_tools: bool) -> dict[str, Any]:
    """How the message ended, and its whole usage (the SDK takes each count from here, over
    message_start's)."""
    reason = stop_reason(result.finish_reason, ended.stop_sequence, called_tools)
    return {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": ended.stop_sequence},
            "usage": usage(result)}


def sendable(text: str, stop_sequences: Sequence[str]) -> str:
    """What of a running job's text may be sent now: all but the characters that may still be a stop
    sequence, the whole of the longest held back, since the job keeps a matched one at the end of its text
    (core/views/anthropic_objects.py `ending` cuts it off)."""
    hold = max((len(s) for s in stop_sequences), default=0)
    return text[: max(0, len(text) - hold)]


class BlockStream:
    """The content block events of chat deltas: {"content"} and {"tool_calls": [{index, (id, type,)
    function}]}, a call opening with its id."""

    def __init__(self) -> None:
        self.index = -1  # the open block's; -1: none opened yet
        self.kind: str | None = None  # the open block's type

    def open_text(self) -> list[dict[str, Any]]:
        """Opens the text block an answer without tool calls streams into, before its first token."""
        return self._open({"type": "text", "text": ""})

    def events(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("content"):
            if self.kind != "text":
                events += self.open_text()
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", []):
            function = call["function"]
            if "id" in call:
                events += self._open({"type": "tool_use", "id": tool_use_id(call["id"]),
                                      "name": function["name"], "input": {}})
            arguments = function.get("arguments")
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[dict[str, Any]]:
        """The last block's stop; an answer that opened none has an empty text block, as its message has."""
        opened = [] if self.kind is not None else self.open_text()
        return [*opened, self._stop()]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = [self._stop()] if self.kind is not None else []
        self.index, self.kind = self.index + 1, block["type"]
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _stop(self) -> dict[str, Any]:
        return {"type": "content_block_stop", "index": self.index}
