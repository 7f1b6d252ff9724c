"""The webhook sender: claims due deliveries from the store, sends each attempt, records it.

Runs as a thread in every worker process and in the embedded runtime, never in the request path. Several
senders may run at once: a claim is a conditional UPDATE, so each attempt is sent by exactly one of them.
`tick(now)` is the whole logic for one pass with time injected; the thread only calls it periodically.
"""

from __future__ import annotations

import logging
import random
import threading
from datetime import datetime, timedelta

import httpx
from sqlalchemy.orm import Session, sessionmaker

from core.clock import utcnow
from core.settings import Settings
from core.store import webhooks
from core.webhooks.ssrf import SsrfPolicy
from worker.webhooks.delivery import deliver
from worker.webhooks.pinned import webhook_client

log = logging.getLogger(__name__)

POLL_S = 0.5
BATCH = 20           # deliveries claimed per pass
LEASE_FACTOR = 4     # a claimed attempt is retried by another sender after LEASE_FACTOR timeouts + 60 s


class WebhookSender:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, *,
                 client: httpx.Client | None = None, rng: random.Random | None = None) -> None:
        self._sessions = sessions
        self._timeout_s = settings.webhook_timeout_s
        self._lease = timedelta(seconds=settings.webhook_timeout_s * LEASE_FACTOR + 60)
        self._client = client or webhook_client(SsrfPolicy(allow=tuple(settings.webhook_allowlist)))
        self._rng = rng or random.Random()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, now: datetime | None = None) -> int:
        """Sends every delivery due at `now` (default: the clock, read per attempt); returns attempts sent."""
        with self._sessions() as session:
            due = webhooks.due(session, now or utcnow(), BATCH)
        return sum(self._send(delivery_id, attempts, now or utcnow()) for delivery_id, attempts in due)

    def _send(self, delivery_id: str, attempts: int, now: datetime) -> bool:
        with self._sessions() as session:
            delivery = webhooks.claim(session, delivery_id, attempts, now, now + self._lease)
            if delivery is None:
                return False   # another sender took this attempt
            secrets = self._secrets(session, delivery.tenant_id, now)
            number = attempts + 1
            result = deliver(delivery.url, delivery.id, delivery.payload, secrets, client=self._client,
                             now=now, attempt=number - delivery.schedule_start, rng=self._rng,
                             timeout_s=self._timeout_s)
            webhooks.record(session, delivery, number, result, now)
            return True

    @staticmethod
    def _secrets(session: Session, tenant_id: str, now: datetime) -> list[str]:
        """The tenant's signing secrets; a tenant that never asked for one gets one (rotate to read it)."""
        if webhooks.ensure_secret(session, tenant_id, now) is not None:
            session.commit()
        return webhooks.active_secrets(session, tenant_id, now)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="webhook-sender", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.tick()
            except Exception:   # the store may be briefly unreachable; the next pass retries
                log.exception("webhook sender pass failed")
