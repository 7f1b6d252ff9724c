"""A chat job's prompt: its messages rendered by the model's chat template with the job's options (tools,
add_generation_prompt, continue_final_message, the template's own variables;
core/protocol/chat_options.py)."""

from __future__ import annotations

from typing import Any, Protocol

from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.tools import template_messages


class ChatTemplate(Protocol):
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> list[int]: ...


def chat_prompt_ids(tokenizer: ChatTemplate, messages: list[dict[str, Any]],
                    chat: dict[str, Any] | None) -> list[int]:
    """The prompt's token ids. ValueError naming `messages` when the template refuses them."""
    return tokenizer.apply_chat_template(template_messages(messages),
                                         **ChatOptions.from_json(chat).template_kwargs())
