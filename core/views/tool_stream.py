"""Streaming a chat job that reads tool calls (core/views/tool_calls.py) as deltas the OpenAI SDK assembles.

- A named function: the call opens with the first text (id, name, empty arguments) and its arguments then
  stream as they are generated: the text is the arguments.
- `auto` with a parser whose calls follow content (hermes, mistral): content streams until the call's marker
  appears (text that could be the marker's start is held back); the calls are sent whole at the end.
- `required` and llama3_json (the whole answer is the call): nothing streams until the end.
"""

from __future__ import annotations

from typing import Any

from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.views.tool_calls import HERMES_OPEN, MISTRAL_MARK, call_id, read_output


class StreamDivergedError(ValueError):
    """The final text does not continue what was streamed (the job was restarted and wrote otherwise)."""


class ContentStream:
    """The plain case: every new piece of text is content."""

    def __init__(self) -> None:
        self.streamed = ""

    def update(self, text: str) -> list[dict[str, Any]]:
        if len(text) <= len(self.streamed) or not text.startswith(self.streamed):
            return []
        piece, self.streamed = text[len(self.streamed):], text
        return [{"content": piece}]

    def close(self, text: str) -> tuple[list[dict[str, Any]], bool]:
        if not text.startswith(self.streamed):
            raise StreamDivergedError("the job was restarted and generated a different text")
        rest = text[len(self.streamed):]
        return ([{"content": rest}] if rest else []), False


def answer_stream(options: ChatOptions, seed: str) -> ContentStream | ToolCallStream:
    """The stream for a job's answer: tool calls read when it asked for them, else plain content."""
    return ToolCallStream(options, seed) if options.reads_tool_calls else ContentStream()


class ToolCallStream:
    def __init__(self, options: ChatOptions, seed: str) -> None:
        assert options.reads_tool_calls, "plain content streams without a tool-call stream"
        self._options, self._seed = options, seed
        choice = options.tool_choice
        self._named: str | None = choice["function"]["name"] if isinstance(choice, dict) else None
        self.streamed = ""  # the text already turned into deltas

    def update(self, text: str) -> list[dict[str, Any]]:
        """Deltas for what `text` (the text so far) adds that is safe to send now."""
        end = self._safe_end(text)
        if end <= len(self.streamed) or not text.startswith(self.streamed):
            return []
        piece, self.streamed = text[len(self.streamed): end], text[:end]
        return [self._delta(piece, opening=len(self.streamed) == len(piece))]

    def close(self, text: str) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas for the final text, and whether it made tool calls. StreamDivergedError when the
        text does not continue what was streamed."""
        if not text.startswith(self.streamed):
            raise StreamDivergedError("the job was restarted and generated a different text")
        read = read_output(text, self._options, self._seed)
        if self._named is not None:
            rest = text[len(self.streamed):]
            deltas = [self._delta(rest, opening=not self.streamed)] if rest or not self.streamed else []
            return deltas, bool(read.tool_calls)
        if not read.tool_calls:
            rest = text[len(self.streamed):]
            return ([{"content": rest}] if rest else []), False
        content = text[: max(text.find(self._mark()), 0)].rstrip()[len(self.streamed):]
        deltas = [{"content": content}] if read.content and content else []
        for index, call in enumerate(read.tool_calls):
            deltas.append({"tool_calls": [{"index": index, **call.as_openai()}]})
        return deltas, True

    def _safe_end(self, text: str) -> int:
        """How much of `text` can be sent now."""
        if self._named is not None:
            return len(text)
        if self._options.tool_choice == "required" or self._options.tool_parser == "llama3_json":
            return 0
        mark = self._mark()
        at = text.find(mark)
        if at >= 0:
            return at
        for size in range(min(len(mark) - 1, len(text)), 0, -1):  # a suffix that may begin the mark
            if mark.startswith(text[-size:]):
                return len(text) - size
        return len(text)

    def _mark(self) -> str:
        return HERMES_OPEN if self._options.tool_parser == "hermes" else MISTRAL_MARK

    def _delta(self, piece: str, *, opening: bool) -> dict[str, Any]:
        if self._named is None:
            return {"content": piece}
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        if opening:
            call = {"index": 0, "id": call_id(self._seed, 0), "type": "function",
                    "function": {"name": self._named, "arguments": piece}}
        return {"tool_calls": [call]}
