"""Webhook core: event types and filters, Standard Webhooks signing, the SSRF guard with an address-pinning
transport, the retry schedule, and one delivery attempt. No database and no routes: callers store the
subscriptions, secrets and attempts and schedule the next attempt from `AttemptResult.next_attempt_at`."""

from __future__ import annotations

from worker.webhooks.backoff import (
    MAX_ATTEMPTS,
    RETRY_DELAYS,
    next_attempt_at,
    parse_retry_after,
    retry_delay,
)
from worker.webhooks.delivery import AttemptResult, deliver
from worker.webhooks.events import EVENT_TYPES, build_event, encode_event, matches, validate_filter
from worker.webhooks.pinned import PinnedTransport, webhook_client
from worker.webhooks.signing import (
    SignatureError,
    WebhookSecret,
    active_secrets,
    generate_secret,
    sign,
    signature_headers,
    verify,
)
from worker.webhooks.ssrf import SsrfPolicy, TargetRefused, check_target, forbidden_reason

__all__ = [
    "EVENT_TYPES",
    "MAX_ATTEMPTS",
    "RETRY_DELAYS",
    "AttemptResult",
    "PinnedTransport",
    "SignatureError",
    "SsrfPolicy",
    "TargetRefused",
    "WebhookSecret",
    "active_secrets",
    "build_event",
    "check_target",
    "deliver",
    "encode_event",
    "forbidden_reason",
    "generate_secret",
    "matches",
    "next_attempt_at",
    "parse_retry_after",
    "retry_delay",
    "sign",
    "signature_headers",
    "validate_filter",
    "verify",
    "webhook_client",
]
