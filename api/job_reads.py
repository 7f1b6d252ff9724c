"""Job reads that arrive together, made as one query: the reads of `GET /v1/jobs/{id}`, its long poll and
its event stream.

Long polls wake in groups (one finished-jobs notification names every job of an engine step), and each woken
waiter reads its job again. Read one by one, that was a thread-pool hand-off, a session and a query per job;
here the reads asked for in one turn of the event loop share them. At most MAX_IN_FLIGHT queries run at once;
reads asked for meanwhile wait and go together in the next one, so the busier the API, the larger the group.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from conveyor.core.store.jobs.records import records
from conveyor.core.views.public import JobPublic

MAX_IN_FLIGHT = 2
MAX_GROUP = 500  # job ids per query (a burst of thousands of long polls waking at once: several queries)
Owned = tuple[str, JobPublic]  # (the job's tenant, the job)
Waiting = dict[str, list[asyncio.Future[Owned | None]]]  # job id -> the reads that want it


@dataclass
class _LoopReads:
    """One event loop's reads: those waiting for the next query, and how many queries run."""

    waiting: Waiting = field(default_factory=dict)
    in_flight: int = 0


class JobReads:
    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._sessions = session_factory
        self._loops: dict[asyncio.AbstractEventLoop, _LoopReads] = {}

    async def read(self, job_id: str, tenant: str) -> JobPublic | None:
        """The job as the store has it now, or None if the tenant has no such job."""
        loop = asyncio.get_running_loop()
        reads = self._loops.setdefault(loop, _LoopReads())
        future: asyncio.Future[Owned | None] = loop.create_future()
        reads.waiting.setdefault(job_id, []).append(future)
        if len(reads.waiting) == 1 and reads.in_flight < MAX_IN_FLIGHT:
            loop.call_soon(self._start_query, loop)  # after the others asked for in this turn
        found = await future
        return found[1] if found is not None and found[0] == tenant else None

    def _start_query(self, loop: asyncio.AbstractEventLoop) -> None:
        """Queries for the reads waiting, MAX_GROUP ids each, while fewer than MAX_IN_FLIGHT run."""
        reads = self._loops.get(loop)
        while reads is not None and reads.waiting and reads.in_flight < MAX_IN_FLIGHT:
            job_ids = list(reads.waiting)[:MAX_GROUP]
            group = {job_id: reads.waiting.pop(job_id) for job_id in job_ids}
            reads.in_flight += 1
            loop.create_task(self._query(loop, group))

    async def _query(self, loop: asyncio.AbstractEventLoop, group: Waiting) -> None:
        reads = self._loops[loop]
        try:
            found = await run_in_threadpool(self._read_many, list(group))
        except Exception as exc:  # every read of the group fails alike (e.g. the database is down: 503)
            for future in _pending(group):
                future.set_exception(exc)
        else:
            for job_id, futures in group.items():
                for future in futures:
                    if not future.done():  # its request is gone (the client disconnected)
                        future.set_result(found.get(job_id))
        finally:
            for future in _pending(group):  # the query itself was cancelled (shutdown)
                future.cancel()
            reads.in_flight -= 1
            if reads.waiting:
                self._start_query(loop)
            elif reads.in_flight == 0:
                del self._loops[loop]

    def _read_many(self, job_ids: list[str]) -> dict[str, Owned]:
        with self._sessions() as session:
            rows = records(session, job_ids)
            return {job.id: (job.tenant_id, JobPublic.from_row(job)) for job in rows}


def _pending(group: Waiting) -> list[asyncio.Future[Owned | None]]:
    """The group's reads still awaited (a read whose request is gone was cancelled)."""
    return [future for futures in group.values() for future in futures if not future.done()]
