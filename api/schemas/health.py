"""Liveness and readiness bodies."""

from __future__ import annotations

from pydantic import BaseModel


class Health(BaseModel):
    status: str = "ok"


class Check(BaseModel):
    ok: bool
    detail: str


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, Check]
