"""Webhook sending: the address-pinning transport, the retry schedule, one delivery attempt and the sender
loop. The domain it shares with the API and the store (events, signing, SSRF policy, the attempt record)
lives in api/webhooks and is re-exported here."""

from __future__ import annotations

from api.webhooks.attempt import AttemptResult
from api.webhooks.events import EVENT_TYPES, build_event, encode_event, matches, validate_filter
from api.webhooks.signing import (
    SignatureError,
    WebhookSecret,
    active_secrets,
    generate_secret,
    sign,
    signature_headers,
    verify,
)
from api.webhooks.ssrf import SsrfPolicy, TargetRefused, check_target, forbidden_reason
from worker.webhooks.backoff import (
    MAX_ATTEMPTS,
    RETRY_DELAYS,
    next_attempt_at,
    parse_retry_after,
    retry_delay,
)
from worker.webhooks.delivery import deliver
from worker.webhooks.pinned import PinnedTransport, webhook_client

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
