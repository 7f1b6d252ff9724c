"""Fair share and quotas on the real stack: `conveyor api` (auth on) and `conveyor worker` processes on the
suite's own PostgreSQL and Redis (tests.support.fault_stack), two tenants,
documents.max_running = 2 on one worker.

- A submits 60 documents, then B submits 4: every one of B's jobs finishes before A's 20th, read from the
  finished timestamps in the store; meanwhile A, at its max_queued, gets 429 with Retry-After while B's
  submit at the same moment gets 202.
- The same with A's work being a 200-line batch (its window of queued lines in the queue when B submits).
The worker that runs the documents starts once both tenants' work is queued, so the order is decided by the
claims alone, not by how fast the submits came.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from conveyor.core.clock import utcnow
from conveyor.core.store import tenants
from conveyor.core.store.tables import Job
from tests.support.fault_stack import ApiServer, Proc, Servers, Stack, spawn
from tests.support.fault_store import SETTLE_S, wait_until
from tests.support.live_server import new_api_key

pytestmark = pytest.mark.faults

ONE_WORKER_TWO_SLOTS = {"QUEUES__DOCUMENTS__MAX_RUNNING": "2"}
BATCH_LINES = 200
WINDOW = 64  # batch_window_jobs: the batch's lines queued at once


class AuthApi(ApiServer):
    """`conveyor api` with auth on, its data folder (uploaded files) shared with the test's workers."""

    def __init__(self, servers: Servers, log_dir: Path, data_dir: Path) -> None:
        super().__init__(servers, log_dir)
        self.data_dir = data_dir

    def start(self, wait: bool = True) -> Proc:
        env = self.servers.env(self.data_dir, PORT=str(self.port), AUTH_ENABLED="true")
        proc = spawn(f"auth-api-{len(self.procs)}", ["api"], env, self.log_dir)
        self.procs.append(proc)
        if wait:
            self.wait(proc)
        return proc


@pytest.fixture(scope="module")
def auth_api(fault_servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthApi]:
    api = AuthApi(fault_servers, tmp_path_factory.mktemp("auth-api"), tmp_path_factory.mktemp("shared-data"))
    yield api
    api.stop()


@pytest.fixture
def clients(stack: Stack, auth_api: AuthApi) -> Iterator[dict[str, httpx.Client]]:
    """Clients of tenants a and b on the auth API (the store was emptied for this test, keys included)."""
    auth_api.ensure_running()
    made = {tenant: httpx.Client(base_url=auth_api.url, timeout=30, headers={
        "Authorization": f"Bearer {new_api_key(stack.servers.database_url, tenant)}"}) for tenant in "ab"}
    yield made
    for client in made.values():
        client.close()


def _document(client: httpx.Client, i: int) -> httpx.Response:
    return client.post("/v1/jobs", json={"prompt": f"Document {i}: the river", "max_tokens": 2,
                                         "temperature": 0, "queue": "documents"})


def _finished_in_order(stack: Stack, ids: set[str]) -> list[Job]:
    with Session(stack.store.db) as session:
        rows = list(session.execute(select(Job).where(Job.id.in_(ids))).scalars())
    assert all(job.status == "succeeded" for job in rows), [(j.status, j.error_code) for j in rows]
    return sorted(rows, key=lambda job: job.finished_at)  # type: ignore[arg-type, return-value]


def _wait_done(stack: Stack, ids: set[str]) -> list[Job]:
    def done() -> bool:
        return all(job.status not in ("queued", "running") for job in stack.store.jobs(ids).values())

    def workers_alive() -> None:
        for proc in stack.procs:
            proc.check_alive()

    wait_until(done, f"{len(ids)} jobs to finish", SETTLE_S, also=workers_alive)
    return _finished_in_order(stack, ids)


def _last(rows: list[Job], ids: set[str]) -> Job:
    return [job for job in rows if job.id in ids][-1]  # rows are in finishing order


def _a_jobs_done_before(rows: list[Job], last_b: Job) -> int:
    assert last_b.finished_at is not None
    return sum(1 for job in rows if job.tenant_id == "a" and job.finished_at is not None
               and job.finished_at < last_b.finished_at)


def test_b_submitting_after_as_60_documents_finishes_before_as_20th(
    stack: Stack, auth_api: AuthApi, clients: dict[str, httpx.Client],
) -> None:
    with Session(stack.store.db) as session:
        tenants.set_overrides(session, "a", {"max_queued": 60}, utcnow())
    a_ids = set()
    for i in range(60):
        response = _document(clients["a"], i)
        assert response.status_code == 202, response.text
        a_ids.add(response.json()["id"])

    refused, accepted = _document(clients["a"], 60), _document(clients["b"], 0)  # the same moment

    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1, refused.text
    assert refused.json()["error"]["code"] == "tenant_queue_full"
    assert accepted.status_code == 202, accepted.text
    b_ids = {accepted.json()["id"]} | {_document(clients["b"], i).json()["id"] for i in (1, 2, 3)}
    stack.start_worker(DATA_DIR=str(auth_api.data_dir), **ONE_WORKER_TWO_SLOTS)

    rows = _wait_done(stack, a_ids | b_ids)

    last_b = _last(rows, b_ids)
    assert _a_jobs_done_before(rows, last_b) < 19, [job.tenant_id for job in rows]
    assert all(job.attempts == 1 for job in rows)  # each claimed once


def test_b_finishes_before_the_20th_line_of_as_200_line_batch(
    stack: Stack, auth_api: AuthApi, clients: dict[str, httpx.Client],
) -> None:
    lines = "".join(f'{{"custom_id": "l{i}", "body": {{"prompt": "Line {i}", "max_tokens": 2}}}}\n'
                    for i in range(BATCH_LINES))
    uploaded = clients["a"].post("/v1/files", files={"file": ("in.jsonl", lines.encode())},
                                 data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    batch = clients["a"].post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                   "endpoint": "/v1/completions"})
    assert batch.status_code == 200, batch.text
    # A worker that runs no documents reads the batch's first window into the queue.
    stack.start_worker(DATA_DIR=str(auth_api.data_dir), WORKER_QUEUES="interactive")

    def window_queued() -> bool:
        return sum(1 for job in stack.store.jobs().values() if job.tenant_id == "a") >= WINDOW

    wait_until(window_queued, "the batch's first window of jobs", SETTLE_S)
    b_ids = {_document(clients["b"], i).json()["id"] for i in range(4)}
    stack.start_worker(DATA_DIR=str(auth_api.data_dir), WORKER_QUEUES="documents", **ONE_WORKER_TWO_SLOTS)

    _wait_done(stack, b_ids)
    rows = _finished_in_order(stack, {job.id for job in stack.store.jobs().values()
                                      if job.status == "succeeded"})
    last_b = _last(rows, b_ids)
    assert _a_jobs_done_before(rows, last_b) < 19, [job.tenant_id for job in rows]
    assert clients["a"].post(f"/v1/batches/{batch.json()['id']}/cancel").status_code == 200
