"""File schemas: the upload form (POST /v1/files), FilePublic (OpenAI's `file` object), FileList."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from conveyor.core.store.tables import File

# The OpenAPI request body of POST /v1/files, whose route reads the form itself (streamed to the file store).
UPLOAD_BODY: dict[str, Any] = {
    "required": True,
    "content": {"multipart/form-data": {"schema": {
        "type": "object",
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "the JSONL input of a batch"},
            "purpose": {"type": "string", "enum": ["batch"]},
        },
        "required": ["file", "purpose"],
    }}},
}


class FilePublic(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int  # unix seconds
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def from_row(cls, row: File) -> FilePublic:
        return cls(id=row.id, bytes=row.bytes, created_at=int(row.created_at.timestamp()),
                   filename=row.filename, purpose=row.purpose)  # type: ignore[arg-type]


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FilePublic]
    first_id: str | None
    last_id: str | None
    has_more: bool
