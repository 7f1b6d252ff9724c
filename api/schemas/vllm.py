"""Request and response bodies of vLLM's server routes (/tokenize, /detokenize, /version), in vLLM's shapes,
so clients written for vLLM's OpenAI-compatible server read them unchanged."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from conveyor.core.protocol.chat_messages import ChatMessageIn
from conveyor.core.protocol.request_fields import NonEmptyText, StoredText
from conveyor.core.protocol.tools import Tools

MAX_TOKENIZE_IDS = 1_000_000  # a detokenize body is bounded by max_body_bytes too; this names the limit


class TokenizeCompletion(BaseModel):
    """A plain prompt, tokenized as /v1/completions would."""

    model_config = ConfigDict(extra="forbid")

    model: NonEmptyText | None = Field(None, description="the served model (GET /v1/models); optional")
    prompt: StoredText
    add_special_tokens: StrictBool = Field(True, description="add the tokenizer's special tokens (BOS)")
    return_token_strs: StrictBool = Field(False, description="also return each token as its string")


class TokenizeChat(BaseModel):
    """Chat messages rendered with the model's chat template, as /v1/chat/completions does, then tokenized."""

    model_config = ConfigDict(extra="forbid")

    model: NonEmptyText | None = Field(None, description="the served model (GET /v1/models); optional")
    messages: list[ChatMessageIn] = Field(min_length=1)
    tools: Tools | None = Field(None, description="functions offered, rendered by the chat template")
    add_generation_prompt: StrictBool | None = Field(
        None, description="end with the assistant turn's opening (default true, or false with "
        "continue_final_message)")
    continue_final_message: StrictBool | None = Field(
        None, description="leave the last message open, to be continued (not with add_generation_prompt)")
    add_special_tokens: StrictBool = Field(
        False, description="add special tokens on top of the template's (which already holds any BOS)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (e.g. enable_thinking)")
    return_token_strs: StrictBool = Field(False, description="also return each token as its string")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None = Field(description="the longest prompt + output the workers serve")
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: NonEmptyText | None = Field(None, description="the served model (GET /v1/models); optional")
    tokens: list[StrictInt] = Field(max_length=MAX_TOKENIZE_IDS)


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str
