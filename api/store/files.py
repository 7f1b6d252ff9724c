"""Uploaded and generated files: rows naming where the bytes live (see api/store/blobs.py)."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import BigInteger, Index, String, Text, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from api.store.models import Base, UTCDateTime
from api.store.paging import newest_first

BATCH, BATCH_OUTPUT = "batch", "batch_output"
FILE_PURPOSES = (BATCH, BATCH_OUTPUT)


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)
    url: Mapped[str] = mapped_column(Text)  # a local path (embedded) or an s3:// URL; never shown to clients
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


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
    before = None
    if after is not None:
        last = get(session, after, tenant_id)
        if last is None:
            return []
        before = (last.created_at, last.id)
    return list(session.execute(newest_first(query, File, limit=limit, before=before)).scalars())
