"""Uploaded and generated files: rows naming where the bytes live (see core/store/blobs.py)."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.store.paging import page_after_id
from core.store.tables import File

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
