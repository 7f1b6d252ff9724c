"""A thin wrapper over transformers' AutoTokenizer: encode, decode, chat template, EOS ids, streaming text."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer


class Tokenizer:
    """Thread-safe: the service encodes in caller threads while the engine thread decodes."""

    def __init__(self, model_path: str | Path, chat_template: str | None = None) -> None:
        """`chat_template`: a template's text rendering chats in place of the folder's own (None: its own)."""
        path = Path(model_path)
        self._tok = AutoTokenizer.from_pretrained(str(path))
        if chat_template is not None:
            self._tok.chat_template = chat_template
        self._lock = threading.Lock()
        self.eos_token_ids: frozenset[int] = frozenset(_eos_ids(self._tok.eos_token_id, path))

    @property
    def hf_tokenizer(self) -> object:
        return self._tok

    @property
    def chat_template(self) -> object:
        """The chat template's source (None without one), read for the roles it names."""
        return self._tok.chat_template

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Renders with the chat template (the model's own, or the one given); it already holds any BOS.
        `template_kwargs` go to the template as well (tools, continue_final_message, its own variables).

        Template failures (bad roles, a template's raise_exception) become ValueError naming `messages`.
        """
        with self._lock:
            if not self._tok.chat_template:
                raise ValueError("messages: the model folder has no chat template")
            try:
                text = self._tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
                )
            except Exception as exc:
                raise ValueError(f"messages: the chat template rejected them: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError("messages: expected one conversation (a list of {role, content} dicts)")
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas.

    NOTE: decoding a short window (prefix_offset..end) and subtracting the text of the already-emitted part
    keeps multi-token characters and SentencePiece spaces right without decoding the whole output each step.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def step(self, output_ids: list[int]) -> str:
        """Appends and returns the text newly readable from output_ids: "" while the newest ids end inside a
        character (its bytes split across tokens), which is held back until it is whole."""
        return self._advance(output_ids, whole=False)

    def flush(self, output_ids: list[int]) -> str:
        """At the end of the output: appends and returns what `step` held back, as a full decode writes it
        (an incomplete character becomes U+FFFD), so that the text equals the decode of every id."""
        return self._advance(output_ids, whole=True)

    def _advance(self, output_ids: list[int], *, whole: bool) -> str:
        skip = self._skip_special_tokens
        prefix_text = self._tokenizer.decode(output_ids[self._prefix_offset : self._read_offset], skip)
        full_text = self._tokenizer.decode(output_ids[self._prefix_offset :], skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not whole):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(output_ids)
        self.text += delta
        return delta


def _eos_ids(tokenizer_eos: int | None, model_path: Path) -> set[int]:
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    gen_config = model_path / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
