"""api/job_reads.py: reads asked for in one turn of the event loop share one query, each still sees only
its own tenant's job, and a failed query fails each of its reads."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api import job_reads
from conveyor.api.job_reads import JobReads
from conveyor.core.clock import utcnow
from conveyor.core.store import keys
from tests.support.worker import add_job


class CountingReads(JobReads):
    """JobReads that records the ids of each query it makes."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        super().__init__(session_factory)
        self.queries: list[list[str]] = []

    def _read_many(self, job_ids: list[str]) -> dict[str, Any]:
        self.queries.append(sorted(job_ids))
        return super()._read_many(job_ids)


def test_reads_asked_together_share_one_query_and_each_tenant_sees_only_its_own(
    session_factory: sessionmaker[Session],
) -> None:
    with session_factory() as session:
        for tenant in ("alice", "bob"):
            keys.ensure_tenant(session, tenant, utcnow())
        session.commit()
    mine = [add_job(session_factory, f"job {i}", tenant_id="alice") for i in range(5)]
    theirs = add_job(session_factory, "not alice's", tenant_id="bob")
    reads = CountingReads(session_factory)

    async def read_all() -> list[Any]:
        asked = [*mine, mine[0], theirs, "job_" + "0" * 32]  # one job twice, another tenant's, an unknown one
        return await asyncio.gather(*(reads.read(job_id, "alice") for job_id in asked))

    found = asyncio.run(read_all())
    assert [job.id for job in found[:6]] == [*mine, mine[0]]
    assert found[6:] == [None, None], "bob's job and an unknown id read as no job for alice"
    assert reads.queries == [sorted({*mine, theirs, "job_" + "0" * 32})], "one query for every read"
    assert asyncio.run(reads.read(theirs, "bob")).id == theirs


def test_reads_asked_while_queries_run_go_together_in_the_next(
    session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [add_job(session_factory, f"job {i}") for i in range(12)]
    reads = CountingReads(session_factory)
    monkeypatch.setattr(job_reads, "MAX_IN_FLIGHT", 1)

    async def staggered() -> list[Any]:
        first = asyncio.ensure_future(reads.read(ids[0], "default"))
        await asyncio.sleep(0)  # the first query starts; the rest are asked for while it runs
        rest = [asyncio.ensure_future(reads.read(job_id, "default")) for job_id in ids[1:]]
        return await asyncio.gather(first, *rest)

    found = asyncio.run(staggered())
    assert [job.id for job in found] == ids
    assert reads.queries == [[ids[0]], sorted(ids[1:])]


def test_a_failed_query_fails_each_of_its_reads_and_a_cancelled_read_leaves_the_others(
    session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [add_job(session_factory, f"job {i}") for i in range(3)]
    reads = JobReads(session_factory)

    def unreachable(*_args: object) -> list[Any]:
        raise OperationalError("SELECT", {}, Exception("database is down"))

    async def while_down() -> list[Any]:
        asked = (reads.read(job_id, "default") for job_id in ids)
        return await asyncio.gather(*asked, return_exceptions=True)

    with monkeypatch.context() as patch:
        patch.setattr(job_reads, "records", unreachable)
        assert all(isinstance(outcome, OperationalError) for outcome in asyncio.run(while_down()))

    async def one_cancelled() -> list[Any]:
        cancelled = asyncio.ensure_future(reads.read(ids[0], "default"))
        others = [asyncio.ensure_future(reads.read(job_id, "default")) for job_id in ids[1:]]
        await asyncio.sleep(0)
        cancelled.cancel()
        return await asyncio.gather(*others)

    assert [job.id for job in asyncio.run(one_cancelled())] == ids[1:]


def test_more_reads_than_a_query_takes_go_in_several_and_all_are_answered(
    session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = [add_job(session_factory, f"job {i}") for i in range(7)]
    reads = CountingReads(session_factory)
    monkeypatch.setattr(job_reads, "MAX_GROUP", 3)

    async def read_all() -> list[Any]:
        return await asyncio.gather(*(reads.read(job_id, "default") for job_id in ids))

    assert [job.id for job in asyncio.run(read_all())] == ids
    assert sorted(len(query) for query in reads.queries) == [1, 3, 3]
