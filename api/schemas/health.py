"""Liveness and readiness bodies."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Health(BaseModel):
    status: str = "ok"


class Check(BaseModel):
    ok: bool
    detail: str


class Readiness(BaseModel):
    ready: bool = Field(description="the API can take jobs: its database and broker answer (workers may be "
                                    "none: jobs wait queued until one starts)")
    checks: dict[str, Check]
