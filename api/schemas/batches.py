"""Batch schemas: BatchCreate (OpenAI's form or Conveyor's S3 form), BatchPublic, BatchList."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from conveyor.api.schemas.fields import STORABLE, StoredJsonObject
from conveyor.api.schemas.jobs import WebhookTarget, exactly_one_of
from conveyor.api.schemas.scheduling import ScheduleFields

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
# The same patterns in the JSON schema and here, applied as JSON schema validators written in Python apply
# them (re.search; Python's re reads \u escapes such as \u0000 too), so the schema and the API agree on
# every string.
_BUCKET = "s3://[a-z0-9][a-z0-9.\\-]{1,61}[a-z0-9]"
S3_OBJECT_PATTERN = f"^{_BUCKET}/[^\\u0000]*[^\\u0000/]$"  # a key, not ending in "/"
S3_PREFIX_PATTERN = f"^{_BUCKET}(/[^\\u0000]*)?$"
_S3_OBJECT = re.compile(S3_OBJECT_PATTERN)
_S3_PREFIX = re.compile(S3_PREFIX_PATTERN)
FileId = Annotated[str, Field(max_length=40), STORABLE]


class BatchCreate(ScheduleFields):
    """OpenAI's form: `input_file_id`, `endpoint`, `completion_window`, `metadata`. Conveyor's form: `input`
    (s3://bucket/key.jsonl), `output` (s3://bucket/prefix/), `queue`, `webhook`, and `run_at` or `delay_s`
    (the batch stays `validating` until then, its completion window counting from then). Without `output`
    the outputs become files (`output_file_id`, `error_file_id`)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=exactly_one_of("input_file_id", "input"))

    input_file_id: FileId | None = Field(None, description="an uploaded file (purpose batch)")
    input: Annotated[str, STORABLE] | None = Field(
        None, description="s3://bucket/key.jsonl", json_schema_extra={"pattern": S3_OBJECT_PATTERN}
    )
    output: Annotated[str, STORABLE] | None = Field(
        None, description="s3://bucket/prefix/; omitted: outputs become files",
        json_schema_extra={"pattern": S3_PREFIX_PATTERN},
    )
    endpoint: Endpoint | None = Field(None, description="every line's endpoint; omitted: each line says")
    completion_window: str = Field("24h", pattern=r"^[1-9][0-9]{0,2}h$", description="e.g. 24h")
    queue: str = Field("documents", description="the queue the lines run in")
    webhook: WebhookTarget | None = Field(None, description="URL or object with `url`; stored")
    metadata: StoredJsonObject | None = None

    @field_validator("input")
    @classmethod
    def _input_is_an_object(cls, url: str | None) -> str | None:
        if url is not None and not _S3_OBJECT.search(url):
            raise ValueError("must be s3://bucket/key naming an object")
        return url

    @field_validator("output")
    @classmethod
    def _output_is_a_prefix(cls, url: str | None) -> str | None:
        if url is None:
            return None
        if not _S3_PREFIX.search(url):
            raise ValueError("must be s3://bucket/prefix/")
        return url if url.endswith("/") else url + "/"

    @model_validator(mode="after")
    def _one_input(self) -> BatchCreate:
        if (self.input is None) == (self.input_file_id is None):
            sent = "both were sent" if self.input is not None else "neither was sent"
            raise PydanticCustomError("one_input", f"input_file_id, input: send exactly one of them; {sent}")
        return self

    @property
    def completion_window_s(self) -> float:
        return float(self.completion_window[:-1]) * 3600.0


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int
    cancelled: int


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    line: int | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchPublic(BaseModel):
    """OpenAI's `batch` object, plus Conveyor's `input`, `output`, `outputs` (S3 URLs), `queue`, `webhook`."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str | None
    errors: BatchErrors | None
    input_file_id: str | None
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, Any] | None
    usage: dict[str, Any]
    input: str | None
    output: str | None
    outputs: dict[str, str] | None
    queue: str
    webhook: dict[str, str] | None
    run_at: int | None = Field(None, description="when a scheduled batch starts (unix time); null: at once")


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchPublic]
    first_id: str | None
    last_id: str | None
    has_more: bool
