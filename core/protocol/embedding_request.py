"""One set of rules for embeddings request bodies: what POST /v1/embeddings accepts (OpenAI's shape, as the
`openai` SDK's `client.embeddings.create` sends it, plus `truncate`), what a job of kind embedding carries,
and what a batch line's body with `url: "/v1/embeddings"` may hold, so the same body is accepted or refused,
naming the same item, on every path.

1. the pydantic models: types and bounds, `input` judged item by item (core/protocol/embedding_input.py),
   unknown fields refused (`parse_embedding_body`: a Refusal naming the field, for batch lines);
2. the limits that need the model and the settings (core/protocol/embedding_rules.py);
3. `job_params`: what the job stores of the request beside its inputs.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from conveyor.core.protocol.embedding_input import as_inputs, input_problem
from conveyor.core.protocol.field_errors import validation_message
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.request_fields import (
    MAX_INT32,
    DeadlineSeconds,
    EncodingFormat,
    NonEmptyText,
    OnDeadlineMiss,
    Priority,
    StoredText,
    StrictFlag,
)
from conveyor.core.protocol.service_tiers import ServiceTier

EMBEDDINGS = "/v1/embeddings"
# The job's params of an embedding job. It writes no output: max_tokens 0 makes the queue tallies, the
# tokens-per-minute quota and the deadline forecasts, which read max_tokens from params, count its prompt
# tokens only.
NO_OUTPUT = {"max_tokens": 0}
DIMENSIONS = Field(
    None, strict=True, ge=1, le=MAX_INT32,
    description="keep the first this many components of each vector (renormalised when the model "
    "normalises); at most the model's embedding size")


class EmbeddingFields(BaseModel):
    """What to embed and how the vectors come back: the fields every door's embeddings body shares."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids or a list of token-id lists; each "
        "embedded on its own")
    encoding_format: EncodingFormat | None = Field(
        None, description="float (the default): lists of numbers; base64: each vector's little-endian "
        "float32 bytes, base64-encoded (what the openai SDK asks for and decodes)")
    dimensions: int | None = DIMENSIONS
    truncate: StrictFlag | None = Field(
        None, description="Conveyor's: cut an input longer than the model's maximum input length to it "
        "(keeping its start, as sentence-transformers does) rather than refuse it")

    @field_validator("input", mode="before")
    @classmethod
    def _input_items(cls, value: object) -> object:
        problem = input_problem(value)
        if problem is not None:  # "input[2]: ..." names the item; the message keeps it (field_errors)
            raise PydanticCustomError("invalid_input", problem)
        return value

    def inputs(self) -> list[str | list[int]]:
        return as_inputs(self.input)

    def truncates(self) -> bool:
        return bool(self.truncate)

    def job_params(self) -> dict[str, Any]:
        """The job's params: no output, and the fields sent that change the vectors or their format."""
        sent = {name: getattr(self, name) for name in ("dimensions", "encoding_format")
                if getattr(self, name) is not None}
        return JobParams.written({**NO_OUTPUT, **sent, **({"truncate": True} if self.truncate else {})})


class EmbeddingCreate(EmbeddingFields):
    """POST /v1/embeddings (and a batch line's body for it)."""

    model: NonEmptyText | None = Field(None, description="the served embedding model (GET /v1/models)")
    user: StoredText | None = Field(None, description="accepted and ignored")
    priority: Priority | None = Field(None, description="vLLM's: lower is served first (default 0)")
    deadline_s: DeadlineSeconds | None = None
    on_deadline_miss: OnDeadlineMiss | None = None
    service_tier: ServiceTier | None = Field(None, description="as on the chat and completion routes")

    def queue_params(self) -> dict[str, Any]:
        """The sent fields that place the job in its queue, under the job's names."""
        names = ("priority", "deadline_s", "on_deadline_miss", "service_tier")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def parse_embedding_body(body: dict[str, Any]) -> EmbeddingCreate:
    """A batch line's body validated as POST /v1/embeddings validates its request; Refusal naming the field
    (or the item: `input[2]`) otherwise."""
    try:
        return EmbeddingCreate.model_validate(body)
    except ValidationError as exc:
        param, message = validation_message(exc.errors())
        raise Refusal("invalid", param, message.removeprefix(f"{param}: ") if param else message) from None
