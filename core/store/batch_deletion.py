"""Deleting one ended batch on a client's request (DELETE /v1/batches/{id}, DELETE /v1/messages/batches/{id}):
its lines and jobs a chunk per transaction (core/store/batches.delete_step), then its output files' bytes.
Retention purges (core/store/retention.py) walk many batches with their own budget instead."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from conveyor.core.lifecycle import OPEN_BATCH_STATUSES
from conveyor.core.settings import Settings
from conveyor.core.store import batches, blobs


@dataclass(frozen=True)
class BatchDeletion:
    """What a delete found: no such batch of the tenant's (`found` False), a batch that has not ended
    (`open_status`: nothing was deleted), or a deleted batch."""

    found: bool
    open_status: str | None = None


def delete_ended_batch(session: Session, settings: Settings, batch_id: str, tenant_id: str) -> BatchDeletion:
    """Deletes the tenant's batch if it has ended: its lines, jobs, output and error files (their bytes
    after the rows are gone: a crash in between leaves an orphan blob, never a row naming missing bytes)."""
    urls: list[str] = []
    while True:  # a chunk of lines per transaction: a million-line batch never holds one huge transaction
        step = batches.delete_step(session, batch_id, tenant_id, settings.purge_chunk_rows)
        if step.status is None:
            return BatchDeletion(found=False)
        if step.status in OPEN_BATCH_STATUSES:
            return BatchDeletion(found=True, open_status=step.status)
        urls += step.blob_urls
        if step.done:
            break
    for url in urls:
        blobs.delete(settings, url)
    return BatchDeletion(found=True)
