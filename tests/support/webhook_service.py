"""The service under test for the end-to-end webhook tests: the real app (TestClient), its store, and a
webhook sender whose passes the tests run themselves with an injected `now` (no thread, no sleeping)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import jobs, keys
from conveyor.worker.webhooks.sender import WebhookSender
from tests.support.service import LOCAL_URL

WEBHOOK_TABLES = ("webhook_attempts", "webhook_deliveries", "webhook_subscriptions", "webhook_secrets")


class NullPublisher:
    """The broker is not under test here: jobs are moved through the store as a worker would."""

    def publish(self, job_id: str, queue: str) -> None:
        pass

    def ping(self) -> bool:
        return True


@dataclass
class WebhookService:
    settings: Settings
    app: Any
    sessions: sessionmaker[Session]
    sender: WebhookSender

    def client(self, tenant: str) -> TestClient:
        with self.sessions() as session:
            _, key = keys.create_key(session, tenant, utcnow())
        client = TestClient(self.app, base_url=LOCAL_URL)
        client.headers["Authorization"] = f"Bearer {key}"
        return client

    def submit(self, client: TestClient, **fields: Any) -> str:
        response = client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 4, **fields})
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    def succeed(self, job_id: str, now: datetime) -> None:
        """Plays the worker: claim and complete the job."""
        with self.sessions() as session:
            job = jobs.claim(session, job_id, "worker-test", now)
            assert job is not None
            assert jobs.complete(session, job_id, job.attempts, result_text="hi there", finish_reason="stop",
                                 prompt_tokens=2, completion_tokens=2, preemptions=0, first_token_at=now,
                                 now=now)
