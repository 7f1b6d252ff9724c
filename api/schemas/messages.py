"""Anthropic's Messages API bodies. The requests (MessageCreate, MessageCountTokens: what the `anthropic` SDK
sends, plus Conveyor's extras it passes through `extra_body`) are defined once in
core/protocol/anthropic_request.py, since Message Batches requests are validated by the same rules; the token
count is the API's own."""

from __future__ import annotations

from pydantic import BaseModel, Field

from conveyor.core.protocol.anthropic_request import MessageCountTokens, MessageCreate

__all__ = ["MessageCountTokens", "MessageCreate", "MessageTokensCount"]


class MessageTokensCount(BaseModel):
    input_tokens: int = Field(description="the prompt's tokens: a message's usage.input_tokens and "
                              "cache_read_input_tokens add up to it")
