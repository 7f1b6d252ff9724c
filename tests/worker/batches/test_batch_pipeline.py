"""S3 batches end to end on Postgres and moto's S3 server: batch runners read the input, jobs run on the tiny
model in an embedded runtime, outputs land under the prefix. The runtime's own batch runner is replaced by
runners the tests drive round by round, so a test can stop one mid-batch and let another take over."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import OPEN_BATCH_STATUSES
from conveyor.core.s3 import make_s3_client
from conveyor.core.settings import Settings
from conveyor.core.store import batches
from conveyor.core.store.tables import Batch
from conveyor.worker.batches.runner import BatchRunner
from tests.support.live_server import wait_for

ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=512, num_kv_blocks=256, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
QUEUES = {"documents": {"max_running": 32}}
DRIVE_S = 120.0  # a hang guard, not a speed assertion
HOOK = "https://hooks.example.invalid/batches"  # never reached: the tests read the enqueued events


class _NoRunner:
    def start(self) -> None: ...
    def stop(self) -> None: ...


@pytest.fixture(autouse=True)
def _no_batches(pg_url: str) -> None:
    """The session's Postgres database outlives a test: runners here must see only this test's batches."""
    from sqlalchemy import text

    from conveyor.core.store.database import make_db_engine

    db_engine = make_db_engine(pg_url)
    with db_engine.begin() as conn:
        for table in ("batch_lines", "batches", "files"):
            conn.execute(text(f"DELETE FROM {table}"))
    db_engine.dispose()


@pytest.fixture
def batch_settings(make_settings: Callable[..., Settings], pg_url: str, demo_model_dir: Path,
                   moto_endpoint: str) -> Settings:
    return make_settings(database_url=pg_url, model=str(demo_model_dir), auth_enabled=False, queues=QUEUES,
                         s3_endpoint_url=moto_endpoint, s3_region="us-east-1", batch_window_jobs=64, **ENGINE)


@pytest.fixture
def runtime(batch_settings: Settings, sessions: sessionmaker[Session], s3: Any,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Engine, job feeders and reconciler; no batch runner of its own."""
    import conveyor.worker.services
    from conveyor.worker.embedded import EmbeddedRuntime

    monkeypatch.setattr(conveyor.worker.services, "make_batch_runner", lambda *args: _NoRunner())
    rt = EmbeddedRuntime(batch_settings, sessions=sessions)
    rt.start()
    yield rt
    rt.stop(grace_s=1.0)


def _runner(rt: Any, settings: Settings, sessions: sessionmaker[Session], owner: str,
            chunk_lines: int = 500) -> BatchRunner:
    s3 = make_s3_client(settings.s3_endpoint_url, settings.s3_region)
    return BatchRunner(sessions, settings, rt.publisher.publish, owner, tokenizer=rt.host.tokenizer, s3=s3,
                       chunk_lines=chunk_lines, interval_s=0.05)


def _line(custom_id: str, max_tokens: int = 1, **body: Any) -> bytes:
    body = {"messages": [{"role": "user", "content": f"hello {custom_id}"}], "max_tokens": max_tokens,
            "temperature": 0, **body}
    return json.dumps({"custom_id": custom_id, "body": body}).encode() + b"\n"


def _create(sessions: sessionmaker[Session], bucket: str, key: str, queue: str = "documents") -> str:
    with sessions() as session:
        batch = batches.create(session, tenant_id="default", input_url=f"s3://{bucket}/{key}",
                               output_url=f"s3://{bucket}/out/{key}/", queue=queue, now=utcnow(),
                               webhook={"url": HOOK})
    return batch.id


def _events(sessions: sessionmaker[Session], batch_id: str) -> list[dict[str, Any]]:
    """The batch.* events enqueued for the batch's own webhook."""
    from conveyor.core.store import webhooks

    with sessions() as session:
        deliveries = webhooks.for_subject(session, "default", "batch", batch_id)
    return [d.payload for d in deliveries if d.url == HOOK]


def _get(sessions: sessionmaker[Session], batch_id: str) -> Batch:
    with sessions() as session:
        batch = batches.get(session, batch_id)
    assert batch is not None
    return batch


def _drive(runner: BatchRunner, sessions: sessionmaker[Session], batch_id: str,
           until: Callable[[Batch], bool] | None = None) -> Batch:
    """Runs the runner's rounds until the batch is closed (or `until` holds)."""
    until = until or (lambda b: b.status not in OPEN_BATCH_STATUSES)

    def done() -> bool:
        runner.run_once()
        return until(_get(sessions, batch_id))

    wait_for(done, f"batch {batch_id}", timeout_s=DRIVE_S)
    return _get(sessions, batch_id)


def _read_jsonl(s3: Any, bucket: str, key: str) -> list[dict[str, Any]]:
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    return [json.loads(line) for line in body.splitlines()]


Jsonl = list[dict[str, Any]]


def _outputs(s3: Any, bucket: str, key: str) -> tuple[Jsonl, Jsonl, dict[str, Any]]:
    prefix = f"out/{key}/"
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=prefix + "manifest.json")["Body"].read())
    results = _read_jsonl(s3, bucket, prefix + "results.jsonl")
    return results, _read_jsonl(s3, bucket, prefix + "errors.jsonl"), manifest


def _assert_each_once(results: list[dict[str, Any]], custom_ids: list[str]) -> None:
    answered = [r["custom_id"] for r in results if r["response"] is not None]
    assert sorted(answered) == sorted(custom_ids)


def test_thousand_lines_with_bad_ones(runtime: Any, batch_settings: Settings, sessions: sessionmaker[Session],
                                      s3: Any, bucket: str) -> None:
    bad = {7: b"{not json\n", 100: b'{"body": {"prompt": "x"}}\n', 200: _line("c-0"),
           300: _line("c-300", max_tokens=0), 400: _line("c-400", max_tokens=10**6)}
    lines = [bad.get(i, _line(f"c-{i}")) for i in range(1000)]
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=b"".join(lines))
    batch_id = _create(sessions, bucket, "in.jsonl")

    batch = _drive(_runner(runtime, batch_settings, sessions, "runner-a"), sessions, batch_id)

    assert batch.status == "completed"
    assert (batch.total, batch.completed, batch.failed, batch.cancelled) == (1000, 995, 5, 0)
    results, errors, manifest = _outputs(s3, bucket, "in.jsonl")
    assert len(results) == 1000  # one line per input line, in input order
    _assert_each_once(results, [f"c-{i}" for i in range(1000) if i not in bad])
    ok = next(r for r in results if r["response"] is not None)
    assert ok["response"]["body"]["object"] == "chat.completion"
    assert ok["response"]["body"]["usage"]["completion_tokens"] == 1
    assert {e["line"]: e["error"]["code"] for e in errors} == {
        8: "invalid_json", 101: "missing_custom_id", 201: "duplicate_custom_id", 301: "invalid_parameter",
        401: "invalid_parameter"}
    assert manifest["status"] == "completed"
    assert manifest["request_counts"] == {"total": 1000, "completed": 995, "failed": 5, "cancelled": 0}
    assert manifest["tokens"]["completion"] == 995 == batch.completion_tokens
    assert manifest["tokens"]["prompt"] == batch.prompt_tokens > 0
    [event] = _events(sessions, batch_id)
    assert event["type"] == "batch.completed" and event["data"]["request_counts"]["completed"] == 995


def test_fifty_megabyte_input_is_read_in_bounded_memory(runtime: Any, batch_settings: Settings,
                                                        sessions: sessionmaker[Session], s3: Any,
                                                        bucket: str) -> None:
    """400 oversized lines of 128 KiB (cheap: rejected unparsed) and 100 valid lines: 50 MiB in all.
    tracemalloc traces Python allocations in every thread (boto's chunks, the reader, the parser, the store
    rows) while the runner reads and parses the whole input; the traced peak stays far below the input."""
    settings = batch_settings.model_copy(update={"batch_max_line_bytes": 4096, "batch_window_jobs": 200})
    filler = b'{"custom_id": "big", "body": {"prompt": "' + b"x" * (128 * 1024) + b'"}}\n'
    lines = [filler if i % 5 else _line(f"v-{i}") for i in range(500)]
    body = b"".join(lines)
    assert len(body) > 50 * 1024 * 1024
    s3.put_object(Bucket=bucket, Key="big.jsonl", Body=body)
    del body, lines
    batch_id = _create(sessions, bucket, "big.jsonl")
    runner = _runner(runtime, settings, sessions, "runner-big", chunk_lines=100)

    tracemalloc.start()
    try:
        _drive(runner, sessions, batch_id, until=lambda b: b.read_done)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, f"traced peak {peak} bytes while reading a 50 MiB input"

    batch = _drive(runner, sessions, batch_id)
    assert (batch.status, batch.total, batch.completed, batch.failed) == ("completed", 500, 100, 400)
    results, errors, _ = _outputs(s3, bucket, "big.jsonl")
    _assert_each_once(results, [f"v-{i}" for i in range(0, 500, 5)])
    assert {e["error"]["code"] for e in errors} == {"line_too_long"}


def test_cancel_mid_batch_writes_partial_outputs(runtime: Any, batch_settings: Settings,
                                                 sessions: sessionmaker[Session], s3: Any,
                                                 bucket: str) -> None:
    settings = batch_settings.model_copy(update={"batch_window_jobs": 8})
    body = b"".join(_line(f"k-{i}", max_tokens=4) for i in range(300))
    s3.put_object(Bucket=bucket, Key="c.jsonl", Body=body)
    batch_id = _create(sessions, bucket, "c.jsonl")
    runner = _runner(runtime, settings, sessions, "runner-c", chunk_lines=8)
    _drive(runner, sessions, batch_id, until=lambda b: b.completed >= 10)

    with sessions() as session:
        cancelling = batches.request_cancel(session, batch_id, "default", utcnow())
    assert cancelling is not None and cancelling.status == "cancelling"
    batch = _drive(runner, sessions, batch_id)

    assert batch.status == "cancelled"
    assert batch.total == 300 and batch.completed + batch.failed + batch.cancelled == 300
    assert 10 <= batch.completed < 300 and batch.cancelled > 0
    results, errors, manifest = _outputs(s3, bucket, "c.jsonl")
    assert [r["custom_id"] for r in results] == [f"k-{i}" for i in range(300)]
    assert sum(r["response"] is not None for r in results) == batch.completed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert manifest["status"] == "cancelled"
    assert manifest["request_counts"]["cancelled"] == batch.cancelled
    assert [e["type"] for e in _events(sessions, batch_id)] == ["batch.cancelled"]


def test_a_dead_runner_is_resumed_without_redoing_lines(runtime: Any, batch_settings: Settings,
                                                        sessions: sessionmaker[Session], s3: Any,
                                                        bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="r.jsonl", Body=b"".join(_line(f"r-{i}") for i in range(400)))
    batch_id = _create(sessions, bucket, "r.jsonl")
    first = _runner(runtime, batch_settings, sessions, "runner-dies", chunk_lines=50)
    _drive(first, sessions, batch_id, until=lambda b: b.read_line > 100)
    # `first` stops here without releasing its lease or closing its input: a SIGKILLed worker.
    second = _runner(runtime, batch_settings, sessions, "runner-takes-over", chunk_lines=50)

    batch = _drive(second, sessions, batch_id)

    assert batch.status == "completed" and (batch.total, batch.completed) == (400, 400)
    results, errors, _ = _outputs(s3, bucket, "r.jsonl")
    assert errors == []
    _assert_each_once(results, [f"r-{i}" for i in range(400)])
    with sessions() as session:
        from sqlalchemy import func, select

        from conveyor.core.store.tables import Job

        jobs_made = session.execute(select(func.count()).select_from(Job)
                                    .where(Job.meta["batch_id"].as_string() == batch_id)).scalar_one()
    assert jobs_made == 400  # no line got a second job


_DOOMED_RUNNER = """
import sys, time
from conveyor.core.settings import Settings
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.worker.batches.runner import BatchRunner
from conveyor.core.s3 import make_s3_client

database_url, endpoint, model = sys.argv[1:4]
settings = Settings(database_url=database_url, model=model, s3_endpoint_url=endpoint, s3_region="us-east-1",
                    worker_dead_after_s=2.0, batch_window_jobs=64)
sessions = make_session_factory(make_db_engine(database_url))

def publish(job_id: str, queue: str) -> None:  # no broker here: the test's reconciler publishes the jobs
    raise ConnectionError("no broker in this process")

runner = BatchRunner(sessions, settings, publish, "runner-sigkilled", tokenizer=None,
                     s3=make_s3_client(endpoint, "us-east-1"), chunk_lines=50)
while True:
    runner.run_once()
    time.sleep(0.02)
"""


def test_a_sigkilled_runner_process_is_resumed(runtime: Any, batch_settings: Settings,
                                               sessions: sessionmaker[Session], s3: Any, bucket: str,
                                               pg_url: str, moto_endpoint: str) -> None:
    """A runner in its own process is SIGKILLed mid-batch (lease held, input stream open); this process's
    runner takes the batch over once the lease expires."""
    import signal
    import subprocess
    import sys

    s3.put_object(Bucket=bucket, Key="k.jsonl", Body=b"".join(_line(f"x-{i}") for i in range(300)))
    batch_id = _create(sessions, bucket, "k.jsonl")
    child = subprocess.Popen([sys.executable, "-c", _DOOMED_RUNNER, pg_url, moto_endpoint,
                              batch_settings.model_source()])
    try:
        wait_for(lambda: _get(sessions, batch_id).read_line > 100, "the child to read 100 lines",
                 timeout_s=DRIVE_S)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    at_kill = _get(sessions, batch_id)
    assert at_kill.lease_owner == "runner-sigkilled" and not at_kill.read_done

    batch = _drive(_runner(runtime, batch_settings, sessions, "runner-survivor"), sessions, batch_id)

    assert batch.status == "completed" and (batch.total, batch.completed) == (300, 300)
    results, errors, _ = _outputs(s3, bucket, "k.jsonl")
    assert errors == []
    _assert_each_once(results, [f"x-{i}" for i in range(300)])


def test_an_unreadable_input_fails_the_batch(runtime: Any, batch_settings: Settings,
                                             sessions: sessionmaker[Session], s3: Any, bucket: str) -> None:
    batch_id = _create(sessions, bucket, "missing.jsonl")

    batch = _drive(_runner(runtime, batch_settings, sessions, "runner-f"), sessions, batch_id)

    assert batch.status == "failed" and batch.errors is not None
    assert batch.errors[0]["code"] == "input_unreadable"
    results, errors, manifest = _outputs(s3, bucket, "missing.jsonl")
    assert results == errors == [] and manifest["status"] == "failed"
    assert [e["type"] for e in _events(sessions, batch_id)] == ["batch.failed"]


def test_past_its_completion_window_a_batch_expires(runtime: Any, batch_settings: Settings,
                                                    sessions: sessionmaker[Session], s3: Any,
                                                    bucket: str) -> None:
    settings = batch_settings.model_copy(update={"batch_window_jobs": 2})
    body = b"".join(_line(f"e-{i}", max_tokens=16, ignore_eos=True) for i in range(200))  # > 1 s at 2 at once
    s3.put_object(Bucket=bucket, Key="e.jsonl", Body=body)
    with sessions() as session:
        batch_id = batches.create(session, tenant_id="default", input_url=f"s3://{bucket}/e.jsonl",
                                  output_url=f"s3://{bucket}/out/e.jsonl/", queue="documents", now=utcnow(),
                                  completion_window_s=1.0, webhook={"url": HOOK}).id
    runner = _runner(runtime, settings, sessions, "runner-e", chunk_lines=2)

    batch = _drive(runner, sessions, batch_id)

    assert batch.status == "expired" and batch.total == 200
    assert batch.completed + batch.failed + batch.cancelled == 200 and batch.cancelled > 0
    results, errors, manifest = _outputs(s3, bucket, "e.jsonl")
    assert [r["custom_id"] for r in results] == [f"e-{i}" for i in range(200)]
    assert {e["error"]["code"] for e in errors} <= {"batch_expired", "batch_cancelled"}
    assert manifest["status"] == "expired"
    assert [e["type"] for e in _events(sessions, batch_id)] == ["batch.expired"]
