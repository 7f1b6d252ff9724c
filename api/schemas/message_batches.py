"""Message Batch schemas, in Anthropic's shape: MessageBatchCreate (its requests), MessageBatchPublic,
MessageBatchList, DeletedMessageBatch.

The limits are Anthropic's: at most 100,000 requests and 256 MB of body per batch; a custom_id is 1 to 64 of
[a-zA-Z0-9_-], unique within its batch (a duplicate refuses the whole create, as Anthropic does). Each
request's `params` is a Messages body, judged when the runner reads its line (worker/batches/lines.py), so
an invalid one is that request's `errored` result while the others run.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_REQUESTS = 100_000
MAX_BODY_BYTES = 256 * 1000 * 1000
CUSTOM_ID_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"
Rfc3339 = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


class MessageBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(pattern=CUSTOM_ID_PATTERN, description="matches the request to its result")
    params: dict[str, Any] = Field(description="a Messages body, as POST /v1/messages takes it; an invalid "
                                   "one is this request's `errored` result")


class MessageBatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: list[MessageBatchRequest] = Field(min_length=1, max_length=MAX_REQUESTS)

    @model_validator(mode="after")
    def _custom_ids_are_unique(self) -> MessageBatchCreate:
        first: dict[str, int] = {}
        for index, request in enumerate(self.requests):
            earlier = first.setdefault(request.custom_id, index)
            if earlier != index:
                message = (f"requests[{index}].custom_id: {request.custom_id!r} is already the custom_id of "
                           f"requests[{earlier}]; each must be unique within the batch")
                raise PydanticCustomError("duplicate_custom_id", message)
        return self


class MessageBatchRequestCounts(BaseModel):
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatchPublic(BaseModel):
    """Anthropic's `message_batch` object (core/views/message_batch_objects.py)."""

    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchRequestCounts
    ended_at: Rfc3339 | None
    created_at: Rfc3339
    expires_at: Rfc3339
    cancel_initiated_at: Rfc3339 | None
    archived_at: Rfc3339 | None = Field(description="always null: results stay until the batch is deleted")
    results_url: str | None = Field(description="where the results are read, once the batch has ended")


class MessageBatchList(BaseModel):
    data: list[MessageBatchPublic]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedMessageBatch(BaseModel):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"
