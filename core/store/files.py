"""Uploaded and generated files: rows naming where the bytes live (see core/store/blobs.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import OPEN_BATCH_STATUSES
from conveyor.core.store.paging import page_after_id
from conveyor.core.store.tables import Batch, File

BATCH, BATCH_OUTPUT = "batch", "batch_output"
FILE_PURPOSES = (BATCH, BATCH_OUTPUT)


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def add(session: Session, file: File) -> File:
    """Inserts without committing: callers commit with whatever else the file belongs to."""
    assert file.purpose in FILE_PURPOSES, file.purpose
    session.add(file)
    return file


def get(session: Session, file_id: str, tenant_id: str | None = None) -> File | None:
    """The file, or None; with `tenant_id`, another tenant's file is None too."""
    query = select(File).where(File.id == file_id)
    if tenant_id is not None:
        query = query.where(File.tenant_id == tenant_id)
    return session.execute(query).scalar_one_or_none()


def page(session: Session, tenant_id: str, *, limit: int, after: str | None = None,
         purpose: str | None = None) -> list[File]:
    """Newest first; `after` is the last file id of the previous page (an unknown id gives an empty page)."""
    query = select(File).where(File.tenant_id == tenant_id)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    return page_after_id(session, query, File, tenant_id, limit=limit, after=after)


@dataclass(frozen=True)
class FileDeletion:
    """What DELETE found: no such file (`found` False), a file an open batch still reads (`open_batch_id`,
    not deleted), or a deleted file whose blob at `url` the caller removes after the commit."""

    found: bool
    url: str | None = None
    open_batch_id: str | None = None


def delete_file(session: Session, file_id: str, tenant_id: str) -> FileDeletion:
    """Deletes the tenant's file row, unless an open batch reads it as its input; commits. The blob goes
    after the commit (`blobs.delete`): a blob left by a crash in between is an orphan, never a row that
    names bytes that are gone."""
    row = session.execute(
        select(File.id, File.url).where(File.id == file_id, File.tenant_id == tenant_id).with_for_update()
    ).first()
    if row is None:
        session.rollback()
        return FileDeletion(found=False)
    reader = session.execute(
        select(Batch.id).where(Batch.input_file_id == file_id, Batch.status.in_(OPEN_BATCH_STATUSES)).limit(1)
    ).scalar_one_or_none()
    if reader is not None:
        session.rollback()
        return FileDeletion(found=True, open_batch_id=reader)
    session.execute(delete(File).where(File.id == file_id))
    session.commit()
    return FileDeletion(found=True, url=row.url)


def delete_rows(session: Session, file_ids: list[str]) -> list[str]:
    """Deletes these file rows; no commit. Returns their blob URLs, for the caller to remove after it
    commits."""
    if not file_ids:
        return []
    statement = delete(File).where(File.id.in_(file_ids)).returning(File.url)
    return list(session.execute(statement.execution_options(synchronize_session=False)).scalars())
