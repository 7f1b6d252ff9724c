"""A chat job's recorded messages as prompt text, for replaying an exported trace with text.

The messages are rendered as bench/chat_format.py renders the text profiles' one message: the model's chat
template with the assistant's generation prompt, and the template's own BOS dropped when encoding adds one
(so the engine sees one BOS). A model whose tokenizer has no chat template cannot replay a chat job.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from conveyor.bench.chat_format import ChatFormat

PROBE = [{"role": "user", "content": "x"}]  # a conversation to learn what ChatFormat.render drops in front


class MessageRenderer:
    """`renderer(messages) -> str` with `model`'s chat template; the tokenizer is loaded on the first chat
    line, so a trace without one needs none (a bench.trace_replay.ChatRenderer)."""

    def __init__(self, model: str | None) -> None:
        self.model = model
        self._fmt: ChatFormat | None = None
        self._dropped = 0  # characters ChatFormat.render drops in front: the template's BOS, or none

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        fmt = self._format()
        try:
            return _template(fmt, messages)[self._dropped:]
        except TemplateError as exc:
            raise ValueError(f"messages: the chat template cannot render them: {exc}") from exc

    def _format(self) -> ChatFormat:
        if self._fmt is None:
            if self.model is None:
                raise ValueError("messages: a chat job is rendered with the chat template of --model")
            fmt = ChatFormat.from_model(self.model)
            if not fmt.has_template:
                raise ValueError(f"messages: the tokenizer of {self.model} has no chat template to render a "
                                 "chat job with")
            self._dropped = len(_template(fmt, PROBE)) - len(fmt.render(PROBE[0]["content"]))
            self._fmt = fmt
        return self._fmt


def _template(fmt: ChatFormat, messages: list[dict[str, Any]]) -> str:
    text = fmt.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str), "one conversation renders to one string"
    return text
