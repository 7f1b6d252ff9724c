"""The shared Postgres fixture outlives one test: it must leave every store table empty for the next one."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from conveyor.core.clock import utcnow
from conveyor.core.store import (
    batches,
    console_sessions,
    job_tallies,
    jobs,
    keys,
    lora_adapters,
    outcome_counts,
    republish_walk,
    webhooks,
    workers,
)
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.files import new_file_id
from conveyor.core.store.tables import Attempt, Base, BatchLine, File


def _fill_every_table(url: str) -> None:
    """One row or more in each store table, as the service tests leave them."""
    db_engine = make_db_engine(url)
    now = utcnow()
    with make_session_factory(db_engine)() as session:
        keys.create_key(session, "left-over", now)  # tenants, api_keys
        workers.register(session, "w-left-over", hostname="h", pid=1, queues=["documents"], now=now)
        left_over = jobs.NewJob(
            tenant_id="left-over", queue="documents", prompt="x", messages=None, params={}, meta=None,
            webhook=None, idempotency_key=None, request_hash="x", prompt_tokens=1, ttl_s=None, timeout_s=None,
        )
        jobs.add(session, left_over, now)
        job_tallies.fold(session)  # job_tallies
        jobs.add(session, left_over, now)  # job_tally_deltas
        batch = batches.create(session, tenant_id="left-over", input_url="s3://b/in.jsonl", output_url=None,
                               queue="documents", now=now)
        session.add(BatchLine(batch_id=batch.id, line=1, custom_id="a", status="succeeded"))
        session.add(File(id=new_file_id(), tenant_id="left-over", purpose="batch", filename="in.jsonl",
                         bytes=1, url="/nowhere", created_at=now))
        subscription, _ = webhooks.create_subscription(session, "left-over", "https://example.com/hook",
                                                       ["job.succeeded"], None, now)
        delivery = webhooks.add_delivery(
            session, tenant_id="left-over", subscription_id=subscription.id, url="https://example.com/hook",
            event={"type": "job.succeeded"}, subject_type="job", subject_id="job_x", now=now,
        )
        session.flush()
        session.add(Attempt(delivery_id=delivery.id, number=1, attempted_at=now, outcome="retry",
                            duration_s=0.1))
        outcome_counts.record_webhook_attempt(session, "retry")  # metric_counts
        session.commit()
        lora_adapters.add(session, "left-over", "demo-model", "/nowhere", None, now)
        console_sessions.open_session(session, None, now)
        republish_walk.begin(session, now, ["documents"])  # broker_republish
    db_engine.dispose()


def _row_counts(url: str) -> dict[str, int]:
    db_engine = make_db_engine(url)
    with db_engine.connect() as conn:
        counts = {t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
                  for t in Base.metadata.sorted_tables}
    db_engine.dispose()
    return counts


def test_emptied_postgres_clears_every_table_but_the_default_tenant(
    _migrated_postgres: str, request: pytest.FixtureRequest,
) -> None:
    _fill_every_table(_migrated_postgres)
    filled = _row_counts(_migrated_postgres)
    assert all(filled.values()), f"the test left some table empty: {filled}"

    url = request.getfixturevalue("emptied_postgres")
    counts = _row_counts(url)
    assert counts.pop("tenants") == 1  # `default`, created by the migrations
    assert counts == dict.fromkeys(counts, 0)
