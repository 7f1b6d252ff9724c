"""One Alembic history for both backends: upgrading a fresh database gives exactly the models' schema."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text, update

from conveyor.core.store import job_tallies
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.migrate import alembic_config, upgrade
from conveyor.core.store.tables import Base, Job


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request: pytest.FixtureRequest) -> str:
    name = "sqlite_url" if request.param == "sqlite" else "fresh_postgres_url"
    return str(request.getfixturevalue(name))


def test_upgrade_head_matches_the_models(fresh_url: str) -> None:
    upgrade(fresh_url)
    upgrade(fresh_url)  # a second run is a no-op
    db_engine = make_db_engine(fresh_url)
    head = ScriptDirectory.from_config(alembic_config(fresh_url)).get_current_head()  # one linear history
    with db_engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
        assert current == head == "0027_jobs_created_index"
        assert {"tenants", "api_keys", "jobs", "workers"} <= set(inspect(conn).get_table_names())
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        assert conn.execute(text("SELECT id FROM tenants")).scalars().all() == ["default"]
    db_engine.dispose()


def test_existing_tenants_keep_their_own_cache_partition_and_the_namespace_downgrades(fresh_url: str) -> None:
    upgrade(fresh_url, "0008_metric_counts")
    db_engine = make_db_engine(fresh_url)
    with db_engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, created_at) VALUES ('alice', CURRENT_TIMESTAMP)"))
    upgrade(fresh_url)
    with db_engine.connect() as conn:
        rows = conn.execute(text("SELECT id, cache_namespace FROM tenants ORDER BY id")).all()
        assert [tuple(row) for row in rows] == [("alice", None), ("default", None)]
    command.downgrade(alembic_config(fresh_url), "0008_metric_counts")
    with db_engine.connect() as conn:
        assert "cache_namespace" not in {c["name"] for c in inspect(conn).get_columns("tenants")}
    db_engine.dispose()


def test_jobs_finished_before_get_no_draft_figures_and_the_columns_downgrade(fresh_url: str) -> None:
    """Speculative decoding's usage columns: NULL for the jobs stored before (no figure, as cached_tokens had
    none before 0006), gone again after a downgrade, the jobs kept."""
    upgrade(fresh_url, "0022_console_sessions")
    db_engine = make_db_engine(fresh_url)
    with db_engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (id, tenant_id, queue, status, params, request_hash, created_at, updated_at,"
            " attempts, preemptions, completion_tokens, cached_tokens) VALUES ('job_old', 'default',"
            " 'demo:interactive', 'succeeded', '{}', 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 1, 0, 8, 0)"))
    upgrade(fresh_url)
    with db_engine.begin() as conn:
        row = conn.execute(text("SELECT draft_tokens, accepted_draft_tokens FROM jobs")).one()
        assert tuple(row) == (None, None)
        conn.execute(text("UPDATE jobs SET draft_tokens = 12, accepted_draft_tokens = 9"))
    command.downgrade(alembic_config(fresh_url), "0022_console_sessions")
    with db_engine.connect() as conn:
        columns = {c["name"] for c in inspect(conn).get_columns("jobs")}
        assert not {"draft_tokens", "accepted_draft_tokens"} & columns and "cached_tokens" in columns
        assert conn.execute(text("SELECT completion_tokens FROM jobs")).scalar_one() == 8
    db_engine.dispose()


def test_jobs_stored_before_are_no_responses_and_the_column_downgrades(fresh_url: str) -> None:
    """jobs.responses_request (0025): SQL NULL for the jobs stored before (none was a response), gone again
    after a downgrade, the jobs kept."""
    upgrade(fresh_url, "0024_batch_request_count")
    db_engine = make_db_engine(fresh_url)
    with db_engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (id, tenant_id, queue, status, params, request_hash, created_at, updated_at,"
            " attempts, preemptions) VALUES ('job_old', 'default', 'demo:interactive', 'succeeded', '{}',"
            " 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 1, 0)"))
    upgrade(fresh_url)
    with db_engine.begin() as conn:
        unanswered = text("SELECT count(*) FROM jobs WHERE responses_request IS NULL")
        assert conn.execute(unanswered).scalar_one() == 1
    command.downgrade(alembic_config(fresh_url), "0024_batch_request_count")
    with db_engine.connect() as conn:
        assert "responses_request" not in {c["name"] for c in inspect(conn).get_columns("jobs")}
        assert conn.execute(text("SELECT id FROM jobs")).scalar_one() == "job_old"
    db_engine.dispose()


def test_batches_stored_before_know_no_request_count_and_the_column_downgrades(fresh_url: str) -> None:
    """batches.request_count (0024): NULL for the batches stored before (they count their lines as they read
    them), gone again after a downgrade, the batches kept."""
    upgrade(fresh_url, "0023_job_draft_tokens")
    db_engine = make_db_engine(fresh_url)
    with db_engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO batches (id, tenant_id, input_url, queue, completion_window, status, total,"
            " completed, failed, cancelled, prompt_tokens, completion_tokens, read_line, read_offset,"
            " read_done, created_at, updated_at) VALUES ('batch_1', 'default', 's3://b/in.jsonl',"
            " 'documents', '24h', 'in_progress', 3, 1, 0, 0, 0, 0, 4, 30, false, CURRENT_TIMESTAMP,"
            " CURRENT_TIMESTAMP)"))
    upgrade(fresh_url)
    with db_engine.begin() as conn:
        assert tuple(conn.execute(text("SELECT total, request_count FROM batches")).one()) == (3, None)
        conn.execute(text("UPDATE batches SET request_count = 3"))
    command.downgrade(alembic_config(fresh_url), "0023_job_draft_tokens")
    with db_engine.connect() as conn:
        assert "request_count" not in {c["name"] for c in inspect(conn).get_columns("batches")}
        assert conn.execute(text("SELECT total FROM batches")).scalar_one() == 3
    db_engine.dispose()


def test_batch_jobs_get_their_batch_from_their_line_and_the_column_downgrades(fresh_url: str) -> None:
    """Backfilled from batch_lines (the store's record), never from a client's metadata."""
    upgrade(fresh_url, "0009_tenant_cache_namespace")
    db_engine = make_db_engine(fresh_url)
    with db_engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO batches (id, tenant_id, input_url, queue, completion_window, status, total,"
            " completed, failed, cancelled, prompt_tokens, completion_tokens, read_line, read_offset,"
            " read_done, failure_count, created_at, updated_at) VALUES ('batch_1', 'default', 's3://b/in.jsonl',"
            " 'documents', '24h', 'in_progress', 1, 0, 0, 0, 0, 0, 2, 10, false, 0, CURRENT_TIMESTAMP,"
            " CURRENT_TIMESTAMP)"))
        for job_id, meta in (("job_line", '{"batch_id": "batch_1"}'), ("job_own", '{"batch_id": "batch_1"}'),
                             ("job_plain", None)):
            conn.execute(text(
                "INSERT INTO jobs (id, tenant_id, queue, status, params, metadata, request_hash, created_at,"
                " updated_at, attempts, preemptions) VALUES (:id, 'default', 'documents', 'queued', '{}',"
                " :meta, 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 0, 0)"), {"id": job_id, "meta": meta})
        conn.execute(text("INSERT INTO batch_lines (batch_id, line, custom_id, status, job_id) VALUES"
                          " ('batch_1', 1, 'c1', 'queued', 'job_line')"))
    upgrade(fresh_url)
    with db_engine.connect() as conn:
        rows = conn.execute(text("SELECT id, batch_id FROM jobs ORDER BY id")).all()
        expected = [("job_line", "batch_1"), ("job_own", None), ("job_plain", None)]
        assert [tuple(row) for row in rows] == expected
    command.downgrade(alembic_config(fresh_url), "0009_tenant_cache_namespace")
    with db_engine.connect() as conn:
        assert "batch_id" not in {c["name"] for c in inspect(conn).get_columns("jobs")}
        assert conn.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 3
    db_engine.dispose()


def test_the_migration_starts_the_tallies_from_the_jobs_queued_and_running(fresh_url: str) -> None:
    upgrade(fresh_url, "0015_claim_urgency_indexes")
    db_engine = make_db_engine(fresh_url)
    with db_engine.begin() as conn:
        for job_id, status, params in (("j1", "queued", '{"max_tokens": 10, "n": 2}'), ("j2", "queued", "{}"),
                                       ("j3", "running", '{"max_tokens": 5}'), ("j4", "succeeded", "{}")):
            conn.execute(text(
                "INSERT INTO jobs (id, tenant_id, queue, status, params, request_hash, created_at,"
                " updated_at, attempts, preemptions, priority) VALUES (:id, 'default', 'documents', :status,"
                " :params, 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 0, 0, 0)"),
                {"id": job_id, "status": status, "params": params})
    upgrade(fresh_url, "0016_job_tallies")
    sessions = make_session_factory(db_engine)
    with sessions() as session:
        assert job_tallies.tallies(session) == {"documents": job_tallies.QueueTally(2, 1, 20 + 16 + 5)}
        session.execute(update(Job).where(Job.id == "j3").values(status="succeeded"))  # the triggers run
        session.commit()
        assert job_tallies.tallies(session) == {"documents": job_tallies.QueueTally(2, 0, 36)}
    command.downgrade(alembic_config(fresh_url), "0015_claim_urgency_indexes")
    with sessions() as session:
        session.execute(update(Job).where(Job.id == "j1").values(status="running"))  # no trigger left
        session.commit()
    db_engine.dispose()


def test_stored_jobs_tallies_and_counts_move_to_the_default_model_lanes_and_back(fresh_url: str) -> None:
    """Migration 0017: every queue column names the default model's lane; queued jobs are published again
    (to the lane's broker queue); a downgrade strips the model while only one has jobs."""
    upgrade(fresh_url, "0016_job_tallies")
    db_engine = make_db_engine(fresh_url)
    with db_engine.begin() as conn:
        for job_id, status in (("j1", "queued"), ("j2", "running"), ("j3", "succeeded")):
            conn.execute(text(
                "INSERT INTO jobs (id, tenant_id, queue, status, params, request_hash, created_at,"
                " updated_at, dispatched_at, attempts, preemptions, priority) VALUES (:id, 'default',"
                " 'documents', :status, '{}', 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP,"
                " 0, 0, 0)"),
                {"id": job_id, "status": status})
        conn.execute(text("INSERT INTO metric_counts (metric, queue, status, label, count, total) VALUES"
                          " ('e2e', 'documents', 'succeeded', '1.0', 1, 0.5),"
                          " ('webhook_deliveries', '', '', 'ok', 1, 0)"))
    upgrade(fresh_url, default_model="small")
    sessions = make_session_factory(db_engine)
    with sessions() as session:
        assert job_tallies.tallies(session) == {"small:documents": job_tallies.QueueTally(1, 1, 32)}
        rows = session.execute(text("SELECT id, queue, dispatched_at IS NULL FROM jobs ORDER BY id")).all()
        assert [tuple(row) for row in rows] == [("j1", "small:documents", 1), ("j2", "small:documents", 0),
                                                ("j3", "small:documents", 0)]
        counted = session.execute(text("SELECT queue FROM metric_counts ORDER BY metric")).scalars().all()
        assert counted == ["small:documents", ""]
    command.downgrade(alembic_config(fresh_url), "0016_job_tallies")
    with sessions() as session:
        assert session.execute(text("SELECT DISTINCT queue FROM jobs")).scalars().all() == ["documents"]
        assert job_tallies.tallies(session) == {"documents": job_tallies.QueueTally(1, 1, 32)}
    db_engine.dispose()


def test_stored_jobs_are_generation_jobs_and_a_downgrade_drops_the_embedding_ones(fresh_url: str) -> None:
    """Migration 0018: every job stored so far is of kind generation; a downgrade deletes the embedding jobs
    (an older release would read them as prompts), with their webhook deliveries, before the columns go."""
    upgrade(fresh_url, "0017_model_lanes", default_model="small")
    db_engine = make_db_engine(fresh_url)
    job = ("INSERT INTO jobs (id, tenant_id, queue, status, params, request_hash, created_at, updated_at,"
           " attempts, preemptions, priority{columns}) VALUES (:id, 'default', 'small:interactive',"
           " 'succeeded', '{{}}', 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 1, 0, 0{values})")
    with db_engine.begin() as conn:
        conn.execute(text(job.format(columns="", values="")), {"id": "j_text"})
    upgrade(fresh_url)
    with db_engine.begin() as conn:
        assert conn.execute(text("SELECT kind FROM jobs")).scalars().all() == ["generation"]
        conn.execute(text(job.format(columns=", kind, inputs, embeddings", values=", 'embedding', :inputs,"
                                     " :embeddings")),
                     {"id": "j_vec", "inputs": '["a", [1, 2]]', "embeddings": '["AACAPw==", "AAAAQA=="]'})
        conn.execute(text(
            "INSERT INTO webhook_deliveries (id, tenant_id, url, event_type, subject_type, subject_id,"
            " payload, status, attempts, schedule_start, created_at, updated_at) VALUES ('d1', 'default',"
            " 'https://example.com/hook', 'job.succeeded', 'job', 'j_vec', '{}', 'delivered', 1, 0,"
            " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO webhook_attempts (delivery_id, number, attempted_at, outcome,"
                          " duration_s) VALUES ('d1', 1, CURRENT_TIMESTAMP, 'delivered', 0.1)"))
    sessions = make_session_factory(db_engine)
    with sessions() as session:
        stored = session.get(Job, "j_vec")
        assert stored is not None and (stored.kind, stored.inputs) == ("embedding", ["a", [1, 2]])
        assert stored.embeddings == ["AACAPw==", "AAAAQA=="]
    command.downgrade(alembic_config(fresh_url), "0017_model_lanes")
    with db_engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM jobs")).scalars().all() == ["j_text"]
        assert conn.execute(text("SELECT count(*) FROM webhook_deliveries")).scalar_one() == 0
        assert not {"kind", "inputs", "embeddings"} & {c["name"] for c in inspect(conn).get_columns("jobs")}
    db_engine.dispose()


def test_the_tallies_count_scheduled_jobs_from_0026_and_no_more_after_its_downgrade(fresh_url: str) -> None:
    """Migration 0026: the tally triggers count `scheduled` too, from the jobs scheduled at the upgrade on;
    the walk's row table comes and goes; a downgrade drops the scheduled tallies and counts as 0016 did."""
    upgrade(fresh_url, "0025_job_responses_request")
    db_engine = make_db_engine(fresh_url)
    job = ("INSERT INTO jobs (id, tenant_id, queue, status, params, request_hash, created_at, updated_at,"
           " attempts, preemptions, priority) VALUES (:id, 'default', 'm:documents', :status, :params, 'h',"
           " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 0, 0, 0)")
    with db_engine.begin() as conn:
        for job_id, status, params in (("j1", "scheduled", '{"max_tokens": 10}'), ("j2", "scheduled", "{}"),
                                       ("j3", "queued", "{}"), ("j4", "succeeded", "{}")):
            conn.execute(text(job), {"id": job_id, "status": status, "params": params})
    upgrade(fresh_url)
    sessions = make_session_factory(db_engine)
    with sessions() as session:
        assert job_tallies.tallies(session) == {"m:documents": job_tallies.QueueTally(1, 0, 16, scheduled=2)}
        session.execute(update(Job).where(Job.id == "j1").values(status="queued"))  # the triggers run
        session.execute(text(job), {"id": "j5", "status": "scheduled", "params": "{}"})
        session.commit()
        assert job_tallies.tallies(session) == {"m:documents": job_tallies.QueueTally(2, 0, 26, scheduled=2)}
    with db_engine.connect() as conn:
        assert "broker_republish" in inspect(conn).get_table_names()
    command.downgrade(alembic_config(fresh_url), "0025_job_responses_request")
    with sessions() as session:
        assert job_tallies.tallies(session) == {"m:documents": job_tallies.QueueTally(2, 0, 26)}
        session.execute(update(Job).where(Job.id == "j2").values(status="queued"))  # counted: now queued
        session.execute(text(job), {"id": "j6", "status": "scheduled", "params": "{}"})  # not counted
        session.commit()
        assert job_tallies.tallies(session) == {"m:documents": job_tallies.QueueTally(3, 0, 42)}
    with db_engine.connect() as conn:
        assert "broker_republish" not in inspect(conn).get_table_names()
    db_engine.dispose()
