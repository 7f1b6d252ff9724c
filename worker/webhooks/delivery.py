"""One webhook delivery attempt: sign, POST, classify the answer, schedule the retry.

Outcomes: `delivered` (2xx); `retry` (5xx, 429, timeout, connection error; `next_attempt_at` set);
`disabled` (410 Gone: the subscription must be disabled); `failed` (any other status, redirects included,
a refused target, a payload that cannot be encoded as JSON, or a retryable error after the last scheduled
attempt). `timeout_s` bounds each httpx phase (connect, write, each read) and the body: a body still
arriving `timeout_s` after the start is a timeout. The body is read only up to RESPONSE_EXCERPT_BYTES, so a
huge answer costs nothing. Secrets are used only to sign; they never reach the result, an error message or a
log line.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import httpx

from conveyor.core.webhooks.delivery_attempt import AttemptResult, Outcome
from conveyor.core.webhooks.events import encode_event
from conveyor.core.webhooks.signing import signature_headers
from conveyor.core.webhooks.ssrf import TargetRefused
from conveyor.worker.webhooks.backoff import next_attempt_at, parse_retry_after

DEFAULT_TIMEOUT_S = 15.0
RESPONSE_EXCERPT_BYTES = 1024
ERROR_TEXT_CHARS = 500
USER_AGENT = "Conveyor-Webhooks/1"

log = logging.getLogger(__name__)


class _DeadlineExceeded(Exception):
    pass


def deliver(target_url: str, event_id: str, payload: dict[str, Any], secrets: Sequence[str], *,
            client: httpx.Client, now: datetime, attempt: int = 1, rng: random.Random | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S,
            clock: Callable[[], float] = time.monotonic) -> AttemptResult:
    """Send attempt `attempt` of event `event_id` (the body is `payload`, the event, as compact JSON)."""
    try:
        body = encode_event(payload)
    except (TypeError, ValueError) as exc:   # e.g. a lone surrogate: no later attempt can send these bytes
        log.warning("webhook %s attempt %d: payload cannot be encoded as JSON (%s)", event_id, attempt,
                    type(exc).__name__)
        return _result(event_id, attempt, now, "failed", None, 0.0,
                       f"payload cannot be encoded as JSON: {exc}", None, None)
    headers = signature_headers(event_id, int(now.timestamp()), body, secrets)
    headers |= {"content-type": "application/json", "user-agent": USER_AGENT}
    started = clock()
    status: int | None = None
    excerpt: str | None = None
    retry_after: str | None = None
    outcome: Outcome
    try:
        with client.stream("POST", target_url, content=body, headers=headers, timeout=timeout_s) as response:
            status, retry_after = response.status_code, response.headers.get("retry-after")
            excerpt = _read_excerpt(response, deadline=started + timeout_s, clock=clock)
        outcome = _classify(status)
        error = None if outcome == "delivered" else f"HTTP {status}"
    except TargetRefused as exc:
        return _result(event_id, attempt, now, "failed", None, clock() - started, str(exc), None, None)
    except (httpx.TimeoutException, _DeadlineExceeded):
        outcome, error = "retry", f"timed out after {timeout_s:g} s"
    except httpx.HTTPError as exc:
        outcome, error = "retry", f"{type(exc).__name__}: {exc}"
    duration = clock() - started
    next_at = None
    if outcome == "retry":
        wait = parse_retry_after(retry_after, now)
        next_at = next_attempt_at(attempt, now=now, rng=rng or random.Random(), retry_after=wait)
        if next_at is None:
            outcome, error = "failed", f"{error}; retries exhausted after attempt {attempt}"
    log.info("webhook %s attempt %d to %s: %s (%s)", event_id, attempt, _redact(target_url), outcome,
             status if status is not None else error)
    return _result(event_id, attempt, now, outcome, status, duration, error, excerpt, next_at)


def unexpected_error(event_id: str, attempt: int, *, now: datetime, error: Exception,
                     rng: random.Random | None = None) -> AttemptResult:
    """The record of an attempt that raised where no failure was expected (a bug, a store hiccup while
    signing). It may pass, so it follows the retry schedule like a 5xx; the schedule bounds it."""
    text = f"unexpected error: {type(error).__name__}: {error}"
    next_at = next_attempt_at(attempt, now=now, rng=rng or random.Random())
    if next_at is None:
        return _result(event_id, attempt, now, "failed", None, 0.0,
                       f"{text}; retries exhausted after attempt {attempt}", None, None)
    return _result(event_id, attempt, now, "retry", None, 0.0, text, None, next_at)


def _classify(status: int) -> Outcome:
    if status == 429 or status >= 500:
        return "retry"
    if 200 <= status < 300:
        return "delivered"
    return "disabled" if status == 410 else "failed"


def _read_excerpt(response: httpx.Response, *, deadline: float, clock: Callable[[], float]) -> str:
    """Up to RESPONSE_EXCERPT_BYTES of the body; a body still trickling in after the deadline is a timeout."""
    received = b""
    for chunk in response.iter_raw():
        received += chunk
        if len(received) >= RESPONSE_EXCERPT_BYTES:
            break
        if clock() > deadline:
            raise _DeadlineExceeded
    return received[:RESPONSE_EXCERPT_BYTES].decode(errors="replace")


def _redact(url: str) -> str:
    """The URL without query string or credentials, which may carry receiver tokens."""
    parsed = httpx.URL(url)
    return str(parsed.copy_with(query=None, userinfo=b"", fragment=None))


def _result(event_id: str, attempt: int, at: datetime, outcome: Outcome, status: int | None, duration: float,
            error: str | None, excerpt: str | None, next_at: datetime | None) -> AttemptResult:
    return AttemptResult(event_id=event_id, attempt=attempt, attempted_at=at, outcome=outcome,
                         status_code=status, duration_s=duration,
                         error=_storable(error[:ERROR_TEXT_CHARS]) if error else None,
                         response_excerpt=excerpt, next_attempt_at=next_at)


def _storable(text: str) -> str:
    """The text with lone surrogates escaped: an exception's message may quote the payload that held them,
    and the store (UTF-8) refuses them."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
