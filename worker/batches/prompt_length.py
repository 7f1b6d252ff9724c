"""The prompt-length counter `LineLimits.count_tokens` expects, over any tokenizer with the engine
tokenizer's two methods (conveyor.engine.tokenizer.Tokenizer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from conveyor.core.protocol.model_task import ModelTask
from conveyor.worker.batches.lines import BatchRequest
from conveyor.worker.chat_prompt import chat_prompt_ids


class ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> list[int]: ...


def prompt_token_counter(tokenizer: ChatTokenizer) -> Callable[[BatchRequest], int]:
    """Counts what the engine will see: the chat template's tokens for messages, the encoded prompt, or the
    given token ids. A template that rejects the messages raises ValueError (reported as a bad line)."""

    def count(request: BatchRequest) -> int:
        if request.messages is not None:
            return len(chat_prompt_ids(tokenizer, request.messages, request.chat))
        if isinstance(request.prompt, list):
            return len(request.prompt)
        assert request.prompt is not None, "a parsed request has messages or a prompt"
        return len(tokenizer.encode(request.prompt))

    return count


def embedding_input_counter(tokenizer: ChatTokenizer, task: ModelTask) -> Callable[[str], int]:
    """Counts an embeddings line's text input as the model reads it: after its default prompt, lowercased
    when it says so, with the tokenizer's special tokens (as sentence-transformers tokenizes)."""
    return lambda text: len(tokenizer.encode(task.as_embedded(text)))
