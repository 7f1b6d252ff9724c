"""OpenAI-compatible request and response bodies. The requests (ChatCompletionCreate, CompletionCreate: what
the `openai` SDK sends, plus the engine extras it passes through `extra_body`) are defined once in
core/protocol/openai_request.py, since batch lines are validated by the same rules; the model list is the
API's own."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from conveyor.core.protocol.openai_request import ChatCompletionCreate, CompletionCreate, OpenAIRequest

__all__ = ["ChatCompletionCreate", "CompletionCreate", "ModelCard", "ModelList", "OpenAIRequest"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conveyor"
    max_model_len: int | None = Field(None, description="the longest prompt + output its workers serve "
                                      "(vLLM's field); null: not known yet (a demo model not built)")
    workers: int = Field(0, description="live workers serving it now; 0: its jobs wait until one starts "
                         "(scale from zero)")
    task: Literal["generate", "embed"] = Field(
        "generate", description="generate: chat and completions; embed: POST /v1/embeddings (max_model_len "
        "is then its longest input)")
    embedding_size: int | None = Field(None, description="an embedding model's vector size; null otherwise")
    parent: str | None = Field(None, description="a LoRA adapter's base model (vLLM's field); null for a "
                               "base model")
    quantization: Literal["none", "int8", "int4"] = Field(
        "none", description="how its workers hold the weights: int8 or int4 (weight-only, groups of 32), or "
        "none (the model's dtype); an adapter's is its base model's")
    speculative: str | None = Field(
        None, description="the speculative decoding method its workers run (ngram or suffix: the "
        "`speculative` setting); null: off. An adapter's is its base model's")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
