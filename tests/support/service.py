"""Helpers shared by the service tests (`tests.support.service`; the root conftest holds the
fixtures)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import jobs, keys
from conveyor.core.store.tables import Job
from tests.support.live_server import wait_for

# The base URL of in-process test clients: a loopback name, since the app answers only the names in
# allowed_hosts (the loopback names by default), and TestClient's own `testserver` is none of them.
LOCAL_URL = "http://localhost"


class RecordingPublisher:
    """A JobPublisher (and the reconciler's broker) that keeps what it published; `reachable=False` plays a
    broker that is down."""

    def __init__(self, reachable: bool = True) -> None:
        self.published: list[tuple[str, str]] = []
        self.reachable = reachable
        self.waiting = 0  # what depth() reports for every queue
        self.restarted = False  # lost_messages() says so once, as a broker restarted empty does

    def publish(self, job_id: str, queue: str) -> None:
        if not self.reachable:
            raise ConnectionError("broker: unreachable")
        self.published.append((job_id, queue))

    def depth(self, queue: str) -> int:
        return self.waiting

    def ping(self) -> bool:
        return self.reachable

    def lost_messages(self) -> bool:
        restarted, self.restarted = self.restarted, False
        return restarted


class CancelOnPublish(RecordingPublisher):
    """Cancels each job it is given (as tenant "alice"): a request that wrongly gets through answers 409 at
    once instead of waiting for a worker the app under test does not have."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        super().__init__()
        self.session_factory = session_factory

    def publish(self, job_id: str, queue: str) -> None:
        super().publish(job_id, queue)
        with self.session_factory() as session:
            jobs.cancel(session, job_id, "alice", utcnow())


@dataclass
class Service:
    """One running app under test."""

    settings: Settings
    publisher: RecordingPublisher
    http: TestClient  # no credentials
    session_factory: sessionmaker[Session]

    def job(self, job_id: str) -> Job:
        """The job's row as the store has it now (detached from its session)."""
        with self.session_factory() as s:
            row = s.get(Job, job_id)
            assert row is not None, f"no job {job_id} in the store"
            s.expunge(row)
            return row

    def wait_dispatched(self, job_id: str, timeout_s: float = 10.0) -> None:
        """Waits until the API's dispatch relay (its own thread) has published the job and marked it so."""
        def dispatched() -> bool:
            with self.session_factory() as s:
                row = s.get(Job, job_id)
                return row is not None and row.dispatched_at is not None

        wait_for(dispatched, f"the dispatch relay to publish {job_id} and mark it dispatched", timeout_s)

    def client(self, tenant: str) -> TestClient:
        """A client whose requests carry a fresh API key of `tenant`."""
        with self.session_factory() as s:
            _, key = keys.create_key(s, tenant, utcnow())
        return self.client_with_key(key)

    def client_with_key(self, key: str) -> TestClient:
        c = TestClient(self.http.app, base_url=LOCAL_URL)
        c.headers["Authorization"] = f"Bearer {key}"
        return c


@contextmanager
def embedded_tenants(settings: Settings, tokenizer: PromptTokenizer, sessions: sessionmaker[Session],
                     ) -> Iterator[Callable[[str], TestClient]]:
    """An embedded server (HTTP -> store -> in-process queue -> EmbeddedRuntime -> engine) and a factory of
    tenants' clients, each carrying a fresh API key of its tenant."""
    from conveyor.worker.embedded import EmbeddedRuntime

    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=tokenizer, runtime=runtime)
    with TestClient(app, base_url=LOCAL_URL) as http:
        def client(tenant: str) -> TestClient:
            with sessions() as session:
                _, key = keys.create_key(session, tenant, utcnow())
            c = TestClient(http.app, base_url=LOCAL_URL)
            c.headers["Authorization"] = f"Bearer {key}"
            return c

        yield client


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]  # type: ignore[no-any-return]
