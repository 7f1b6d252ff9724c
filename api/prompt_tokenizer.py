"""Counting prompt tokens at submit time with the model's own tokenizer (the API never loads the engine)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from core.model_limits import model_context_length


class PromptTokenizer:
    """Renders chat messages with the model's chat template and counts tokens the way the engine will.

    Thread-safe: routes run in a thread pool and fast tokenizers must not be used concurrently.
    """

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(model_path))
        # The model's own context length (config.json): what submit judges prompt + max_tokens against.
        self.context_length: int | None = model_context_length(Path(model_path))
        self._lock = threading.Lock()

    @property
    def chat_template(self) -> object:
        """The model's chat template source (None without one); read for the roles it names."""
        return self._tok.chat_template

    def count_prompt(self, prompt: str) -> int:
        with self._lock:
            return len(self._tok.encode(prompt, add_special_tokens=True))

    def count_messages(self, messages: list[dict[str, str]]) -> int:
        """Raises ValueError when the model has no chat template."""
        with self._lock:
            if not self._tok.chat_template:
                raise ValueError("messages: the model has no chat template; send `prompt` instead")
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template already holds any BOS, so no special tokens are added again.
            return len(self._tok.encode(text, add_special_tokens=False))
