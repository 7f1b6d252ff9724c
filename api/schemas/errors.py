"""The error body every 4xx/5xx uses (documented in OpenAPI)."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail
