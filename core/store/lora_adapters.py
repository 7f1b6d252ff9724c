"""LoRA adapters loaded at run time (table lora_adapters): added by POST /v1/load_lora_adapter, removed by
POST /v1/unload_lora_adapter, read by the API (which ids it serves) and by the workers of each adapter's base
model (what to load when a job names it, what to drop once it is gone)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, RUNNING, SCHEDULED
from conveyor.core.model_adapters import LORA_PARAM
from conveyor.core.store.tables import Job, LoraAdapter


class AdapterExists(ValueError):
    """An adapter of that name is already loaded."""


def add(session: Session, name: str, model_id: str, path: str, tenants: list[str] | None, now: datetime,
        ) -> LoraAdapter:
    row = LoraAdapter(name=name, model_id=model_id, path=path, tenants=tenants, created_at=now)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise AdapterExists(f"lora_name: the adapter {name!r} is already loaded") from None
    return row


def get(session: Session, name: str) -> LoraAdapter | None:
    return session.get(LoraAdapter, name)


def all_adapters(session: Session, model_id: str | None = None) -> list[LoraAdapter]:
    """Every adapter loaded at run time (of `model_id`'s, when given), oldest first."""
    statement = select(LoraAdapter).order_by(LoraAdapter.created_at, LoraAdapter.name)
    if model_id is not None:
        statement = statement.where(LoraAdapter.model_id == model_id)
    return list(session.scalars(statement))


def unfinished_jobs_naming(session: Session, name: str) -> int:
    """Scheduled, queued and running jobs that run with the adapter `name`."""
    named = Job.params[LORA_PARAM].as_string() == name
    unfinished = Job.status.in_((SCHEDULED, QUEUED, RUNNING))
    statement = select(func.count()).select_from(Job).where(unfinished, named)
    return int(session.scalar(statement) or 0)


def remove(session: Session, name: str) -> bool:
    row = session.get(LoraAdapter, name)
    if row is None:
        return False
    session.delete(row)
    session.commit()
    return True
