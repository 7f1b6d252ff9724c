"""What a served model does, read from its folder without torch: generate text, or embed its inputs.

The API refuses an embeddings request to a generation model (and a generation request to an embedding model)
before any job is queued, and judges each embedding input against the longest one the model embeds; the
worker passes the same `task` setting to its engine (EngineConfig.task), which resolves "auto" by the same
rule: embed when the folder is a sentence-transformers model (its `modules.json`) or the model cannot generate
(an encoder, or a decoder saved without its LM head: `Qwen2Model`, not `Qwen2ForCausalLM`), else generate.

The longest input of an embedding model is the smaller of the sentence-transformers `max_seq_length`
(`sentence_bert_config.json`, or the tokenizer's `model_max_length` where sentence-transformers 6 keeps it:
what it truncates to) and the positions the model can use:
BERT's `max_position_embeddings`; XLM-RoBERTa's and RoBERTa's less `pad_token_id + 1`, since their position
ids start after the padding index; a decoder's context length (core/protocol/model_limits.py). A text is
tokenized as sentence-transformers reads it: after its default prompt, lowercased when its config says so. The
engine reads the same files (engine/pooling.py); tests/core/test_model_task.py checks that both agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from conveyor.core.protocol.model_limits import model_context_length

Task = Literal["generate", "embed"]
TaskSetting = Literal["auto", "generate", "embed"]
# model_type of the encoders whose architectures the engine embeds with (config.json).
ENCODER_TYPES = frozenset({"bert", "xlm-roberta", "roberta"})
# Encoders whose position ids start after the padding index: pad_token_id + 1 positions are never used.
OFFSET_POSITION_TYPES = frozenset({"xlm-roberta", "roberta"})
ST_MODULES = "modules.json"
ST_CONFIG = "sentence_bert_config.json"
NO_LENGTH_LIMIT = 10**9  # transformers writes model_max_length ~1e30 for a tokenizer without a limit


@dataclass(frozen=True)
class ModelTask:
    """What the model serves: `task`, and for an embedding model the size of its vectors, its longest input
    in tokens and its vocabulary (None: not known, e.g. a folder without config.json)."""

    task: Task
    embedding_size: int | None = None
    max_input_tokens: int | None = None
    vocab_size: int | None = None  # the token ids its embedding table holds (config.json)
    # How sentence-transformers (and so the engine) reads a text before tokenizing it: its default prompt
    # first (config_sentence_transformers.json), lowercased when its config says do_lower_case.
    text_prefix: str = ""
    lowercase: bool = False

    def as_embedded(self, text: str) -> str:
        """The text as the model tokenizes it."""
        return self.text_prefix + (text.lower() if self.lowercase else text)

    @property
    def embeds(self) -> bool:
        return self.task == "embed"

    def serves(self) -> str:
        """What it serves, for a refusal naming it: "serves embeddings (POST /v1/embeddings)"."""
        if self.embeds:
            return "serves embeddings (POST /v1/embeddings, or a job of kind embedding) and generates no text"
        return ("generates text (POST /v1/chat/completions, /v1/completions, or a job of kind generation) "
                "and serves no embeddings")


def model_task(folder: Path, setting: TaskSetting = "auto") -> ModelTask:
    """The model's task (the setting, or "auto" resolved from the folder), with its embedding size and
    longest input when it embeds."""
    config = _read_json(folder / "config.json") or {}
    task: Task = resolve_task(folder, config) if setting == "auto" else setting
    if task == "generate":
        return ModelTask("generate")
    size, vocab = config.get("hidden_size"), config.get("vocab_size")
    st_config = _read_json(folder / ST_CONFIG) or {}
    return ModelTask("embed", size if isinstance(size, int) else None, max_input_tokens(folder, config),
                     vocab if isinstance(vocab, int) else None, _default_prompt(folder),
                     st_config.get("do_lower_case") is True)


def resolve_task(folder: Path, config: dict[str, Any]) -> Task:
    """"auto": embed for a sentence-transformers folder or a model that cannot generate (an encoder, a
    decoder saved without its LM head), else generate."""
    embeds = (folder / ST_MODULES).is_file() or is_encoder(config) or is_headless_decoder(config)
    return "embed" if embeds else "generate"


def is_encoder(config: dict[str, Any]) -> bool:
    return config.get("model_type") in ENCODER_TYPES


def is_headless_decoder(config: dict[str, Any]) -> bool:
    """A decoder saved as its base model (`Qwen2Model`, as sentence-transformers saves one): no LM head."""
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        return False
    return not any(str(name).endswith("ForCausalLM") for name in architectures)


def max_input_tokens(folder: Path, config: dict[str, Any]) -> int | None:
    """The longest input the model embeds: sentence-transformers' max_seq_length within the positions the
    model can use; None when neither is known."""
    limits = [n for n in (_st_max_seq_length(folder), _usable_positions(folder, config)) if n is not None]
    return min(limits) if limits else None


def _usable_positions(folder: Path, config: dict[str, Any]) -> int | None:
    if not is_encoder(config):
        return model_context_length(folder)
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    if config.get("model_type") in OFFSET_POSITION_TYPES:
        padding = config.get("pad_token_id")
        return positions - (padding if isinstance(padding, int) else 1) - 1
    return positions


def _st_max_seq_length(folder: Path) -> int | None:
    """A sentence-transformers folder's max_seq_length (sentence_bert_config.json), or where
    sentence-transformers 6 keeps it: the tokenizer's model_max_length (not transformers' "no limit")."""
    if not (folder / ST_MODULES).is_file():
        return None
    length = (_read_json(folder / ST_CONFIG) or {}).get("max_seq_length")
    if length is None:
        length = (_read_json(folder / "tokenizer_config.json") or {}).get("model_max_length")
    valid = isinstance(length, int) and not isinstance(length, bool) and 0 < length < NO_LENGTH_LIMIT
    return length if valid else None  # type: ignore[return-value]


def _default_prompt(folder: Path) -> str:
    """The prompt sentence-transformers puts before every text (its default_prompt_name's), or ""."""
    config = _read_json(folder / "config_sentence_transformers.json") or {}
    prompts, name = config.get("prompts"), config.get("default_prompt_name")
    prompt = prompts.get(name) if isinstance(prompts, dict) and name is not None else None
    return prompt if isinstance(prompt, str) else ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
