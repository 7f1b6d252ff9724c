"""File schemas: FilePublic, OpenAI's `file` object."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from core.store.tables import File


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
