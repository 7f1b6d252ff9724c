"""OpenAI's embeddings response, built from a succeeded embedding job: what POST /v1/embeddings answers, what
the job's `result` shows (GET /v1/jobs/{id}, its webhook events), and what a batch line's answer holds.

`{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage":
{"prompt_tokens", "total_tokens"}}`; an embedding is a list of numbers (`encoding_format` float) or, with
base64, its little-endian float32 bytes base64-encoded, as the job stores it
(core/views/embedding_vectors.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from conveyor.core.views.embedding_vectors import decode_vector


class EmbeddingObject(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int = Field(description="the input's position in the request")
    embedding: list[float] | str = Field(
        description="the vector: numbers, or with encoding_format base64 its little-endian float32 bytes")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(description="the inputs' tokens (after truncation)")
    total_tokens: int


class EmbeddingList(BaseModel):
    """OpenAI's CreateEmbeddingResponse."""

    object: Literal["list"] = "list"
    data: list[EmbeddingObject]
    model: str
    usage: EmbeddingUsage


def embedding_list(vectors: list[str], encoding_format: str | None, model: str, prompt_tokens: int,
                   ) -> dict[str, Any]:
    """The response body of the stored vectors (base64 strings), in the format asked for (None: float)."""
    base64 = encoding_format == "base64"
    data = [{"object": "embedding", "index": index, "embedding": vector if base64 else decode_vector(vector)}
            for index, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
