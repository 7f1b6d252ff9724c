"""The webhook sender: claims due deliveries from the store, sends each attempt, records it.

Runs as a thread in every worker process and in the embedded runtime, never in the request path. Several
senders may run at once: a claim is a conditional UPDATE, so each attempt is sent by exactly one of them.

Within one sender, deliveries go out from `webhook_concurrency` pool threads with one task per receiver (the
target's scheme, host and port). A task sends its receiver's due deliveries one after another, oldest due
first, so a receiver gets at most one request at a time from a sender, in order, while other receivers are
served in parallel: a receiver that stalls for webhook_timeout_s holds one thread, not every tenant's
webhooks, and later passes leave its deliveries out until its task ends. Each attempt is isolated: an
exception in one is recorded against it and retried on the schedule, a payload that can never be encoded
fails for good (worker/webhooks/delivery.py), and the rest go on.

`tick(now)` runs one pass with time injected and waits for the sends it started (the tests drive it this
way); the thread starts a pass every POLL_S without waiting, while a pool thread is free.
"""

from __future__ import annotations

import logging
import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta

import httpx
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.background import BackgroundLoop
from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import webhooks
from conveyor.core.store.tables import Delivery
from conveyor.core.webhooks.delivery_attempt import AttemptResult
from conveyor.core.webhooks.ssrf import SsrfPolicy
from conveyor.worker.webhooks.delivery import deliver, unexpected_error
from conveyor.worker.webhooks.pinned import webhook_client

log = logging.getLogger(__name__)

POLL_S = 0.5
BATCH = 50           # due deliveries looked at per pass
LEASE_FACTOR = 4     # a claimed attempt is retried by another sender after LEASE_FACTOR timeouts + 60 s
_DEFAULT_PORTS = {"http": 80, "https": 443}


class WebhookSender:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, *,
                 client: httpx.Client | None = None, rng: random.Random | None = None) -> None:
        self._sessions = sessions
        self._timeout_s = settings.webhook_timeout_s
        self._lease = timedelta(seconds=settings.webhook_timeout_s * LEASE_FACTOR + 60)
        self._client = client or webhook_client(SsrfPolicy(allow=tuple(settings.webhook_allowlist)))
        self._rng = rng or random.Random()
        self._concurrency = settings.webhook_concurrency
        self._pool = ThreadPoolExecutor(max_workers=self._concurrency, thread_name_prefix="webhook-send")
        self._lock = threading.Lock()
        self._busy: dict[str, set[str]] = {}   # receiver -> its URLs seen while a task serves it
        self._loop = BackgroundLoop.every("webhook-sender", POLL_S, self._pass, on_error=_log_failed_pass)

    def tick(self, now: datetime | None = None) -> int:
        """Sends every delivery due at `now` (default: the clock, read per attempt) to receivers this sender
        is not already serving, and waits for them; returns the attempts sent."""
        return sum(task.result() for task in self._dispatch(now))

    def _dispatch(self, now: datetime | None) -> list[Future[int]]:
        """Starts one task per idle receiver with due deliveries, as many as the pool has free threads."""
        with self._lock:
            free = len(self._busy) < self._concurrency
            busy_urls = {url for urls in self._busy.values() for url in urls}
        if not free:
            return []
        with self._sessions() as session:
            due = webhooks.due(session, now or utcnow(), BATCH, busy_urls)
        return [self._pool.submit(self._send_all, receiver, items, now)
                for receiver, items in self._take_receivers(_by_receiver(due))]

    def _take_receivers(self, groups: dict[str, list[webhooks.Due]]) -> list[tuple[str, list[webhooks.Due]]]:
        """The groups whose receiver is idle, now marked busy, up to the free pool threads."""
        taken: list[tuple[str, list[webhooks.Due]]] = []
        with self._lock:
            for receiver, items in groups.items():
                urls = {item.url for item in items}
                if receiver in self._busy:   # another URL of a busy receiver: later passes leave it out too
                    self._busy[receiver] |= urls
                elif len(self._busy) < self._concurrency:
                    self._busy[receiver] = urls
                    taken.append((receiver, items))
        return taken

    def _send_all(self, receiver: str, items: list[webhooks.Due], now: datetime | None) -> int:
        """One receiver's deliveries, in order (a pool thread)."""
        sent = 0
        try:
            for item in items:
                if self._loop.stopping:
                    break   # shutting down: the rest stay due for the next sender
                sent += self._send_isolated(item, now)
        finally:
            with self._lock:
                del self._busy[receiver]
        return sent

    def _send_isolated(self, item: webhooks.Due, now: datetime | None) -> bool:
        try:
            return self._send(item, now)
        except Exception:   # the store failed around this attempt: the claim's lease brings it back later
            log.exception("webhook %s: attempt %d not claimed or not recorded", item.id, item.attempts + 1)
            return False

    def _send(self, item: webhooks.Due, now: datetime | None) -> bool:
        """Claims, sends and records one attempt. No store connection is held while the request is out:
        `webhook_concurrency` of them may wait on slow receivers at once."""
        at = now or utcnow()
        with self._sessions() as session:
            delivery = webhooks.claim(session, item.id, item.attempts, at, at + self._lease)
        if delivery is None:
            return False   # another sender took this attempt
        number = item.attempts + 1
        attempt = number - delivery.schedule_start
        try:
            result = self._attempt(delivery, attempt, at)
        except Exception as exc:   # this delivery's own trouble: recorded against it, the others go on
            log.exception("webhook %s: attempt %d failed unexpectedly", item.id, number)
            result = unexpected_error(item.id, attempt, now=at, error=exc, rng=self._rng)
        with self._sessions() as session:
            webhooks.record(session, delivery, number, result, at)
        return True

    def _attempt(self, delivery: Delivery, attempt: int, at: datetime) -> AttemptResult:
        with self._sessions() as session:
            secrets = self._secrets(session, delivery.tenant_id, at)
        return deliver(delivery.url, delivery.id, delivery.payload, secrets, client=self._client, now=at,
                       attempt=attempt, rng=self._rng, timeout_s=self._timeout_s)

    @staticmethod
    def _secrets(session: Session, tenant_id: str, now: datetime) -> list[str]:
        """The tenant's signing secrets; a tenant that never asked for one gets one (rotate to read it)."""
        if webhooks.ensure_secret(session, tenant_id, now) is not None:
            session.commit()
        return webhooks.active_secrets(session, tenant_id, now)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        """Stops passing; a send in flight ends within its timeout, deliveries not started stay due."""
        self._loop.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def _pass(self) -> None:
        """A pass of the thread: starts the sends, does not wait for them."""
        self._dispatch(None)


def _log_failed_pass(_exc: Exception) -> None:
    log.exception("webhook sender pass failed")   # the store may be briefly unreachable; the next pass tries


def _by_receiver(due: list[webhooks.Due]) -> dict[str, list[webhooks.Due]]:
    """The due deliveries grouped by receiver, each group in due order."""
    groups: dict[str, list[webhooks.Due]] = {}
    for item in due:
        groups.setdefault(_receiver(item.url), []).append(item)
    return groups


def _receiver(url: str) -> str:
    """Who answers a URL: scheme, host and port (paths and query strings of one host share its capacity)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return url   # its attempt fails on its own; it only needs a group
    port = parsed.port or _DEFAULT_PORTS.get(parsed.scheme)
    return f"{parsed.scheme}://{parsed.host}:{port}"
