"""A user message as the prompt text a chat model expects: its chat template, with the generation prompt.

The bench sends these prompts as text, and the engine (like the service) encodes a text prompt with the
tokenizer's special tokens. A template that writes the BOS token itself would then start with two of them,
so when the tokenizer adds BOS on encode, the rendered text drops its own leading one: the engine's tokens
are then the template's tokens, once. A tokenizer without a chat template gets the message as plain text.
"""

from __future__ import annotations

from typing import Any


class ChatFormat:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(tokenizer.chat_template)
        self._bos = _added_bos(tokenizer)

    @classmethod
    def from_model(cls, model: str) -> ChatFormat:
        """The tokenizer of the model folder the engine loads (the bench's resolved `model`)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model))

    def render(self, message: str) -> str:
        """`message` as the user's turn, then the assistant's generation prompt (plain text without a
        template)."""
        if not self.has_template:
            return message
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
        )
        assert isinstance(text, str), "one conversation renders to one string"
        return text.removeprefix(self._bos) if self._bos else text

    def count(self, text: str) -> int:
        """Tokens of a piece of text, special tokens left out (for sizing documents)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_tokens(self, prompt: str) -> int:
        """Tokens of a whole prompt as the engine encodes it (with the tokenizer's special tokens)."""
        return len(self.tokenizer.encode(prompt))


def _added_bos(tokenizer: Any) -> str:
    """The BOS token's text when encoding adds it at the start, else ""."""
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    if not bos or bos_id is None:
        return ""
    with_special = tokenizer.encode("a")
    plain = tokenizer.encode("a", add_special_tokens=False)
    return bos if with_special[:1] == [bos_id] and plain[:1] != [bos_id] else ""
