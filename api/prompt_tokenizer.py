"""Counting prompt tokens at submit time with the model's own tokenizer (the API never loads the engine)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.model_limits import model_context_length
from conveyor.core.protocol.tools import template_messages


class PromptTokenizer:
    """Renders chat messages with the model's chat template and counts tokens the way the engine will.

    Thread-safe: routes run in a thread pool and fast tokenizers must not be used concurrently.
    """

    def __init__(self, model_path: str | Path, chat_template: str | None = None) -> None:
        """`chat_template`: a template's text rendering chats in place of the model's own (its settings'
        chat_template_text(): the one the workers render with); None: the model's own."""
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(model_path))
        if chat_template is not None:
            self._tok.chat_template = chat_template
        # The model's own context length (config.json): what submit judges prompt + max_tokens against.
        self.context_length: int | None = model_context_length(Path(model_path))
        self._lock = threading.Lock()

    @property
    def chat_template(self) -> object:
        """The chat template's source (the model's own or the chat_template setting's; None without one): read
        for the roles it names and the tool parser its markers point to."""
        return self._tok.chat_template

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def count_prompt(self, prompt: str) -> int:
        return len(self.encode_prompt(prompt))

    def count_messages(self, messages: list[dict[str, Any]], options: ChatOptions | None = None) -> int:
        """The tokens the worker's rendering will be (core/protocol/chat_options.py: tools and template
        options). Raises ValueError when the model has no chat template, or when the template refuses them."""
        return len(self.encode_chat(messages, options or ChatOptions()))

    def encode_chat(self, messages: list[dict[str, Any]], options: ChatOptions,
                    add_special_tokens: bool = False) -> list[int]:
        """The messages rendered as a job's are (its tools and template options), tokenized."""
        kwargs = options.template_kwargs()
        return self.encode_messages(
            template_messages(messages), add_generation_prompt=kwargs.pop("add_generation_prompt"),
            continue_final_message=kwargs.pop("continue_final_message"),
            add_special_tokens=add_special_tokens, template_kwargs=kwargs)

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self._tok.encode(prompt, add_special_tokens=add_special_tokens))

    def encode_messages(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, add_special_tokens: bool = False,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The chat template's rendering, tokenized. The template already holds any BOS, so by default no
        special tokens are added again. Raises ValueError when the model has no chat template, or when the
        template refuses the messages."""
        with self._lock:
            if not self._tok.chat_template:
                raise ValueError("messages: the model has no chat template; send `prompt` instead")
            try:
                text = self._tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, **(template_kwargs or {}))
            except Exception as exc:  # jinja2's TemplateError and the template's own raise_exception
                raise ValueError(f"messages: the chat template refused them: {exc}") from exc
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def token_strings(self, token_ids: list[int]) -> list[str]:
        with self._lock:
            return list(self._tok.convert_ids_to_tokens(token_ids))

    def decode(self, token_ids: list[int]) -> str:
        with self._lock:
            return str(self._tok.decode(token_ids))
