"""Standard Webhooks signing: `webhook-id`, `webhook-timestamp`, `webhook-signature` headers.

The signature is `v1,` + base64(HMAC-SHA256(key, f"{id}.{timestamp}.{body}")) where the key is the
base64-decoded part of a `whsec_...` secret. During a rotation window a tenant has several active secrets;
the header then carries one signature per secret, space-separated, and a receiver holding either secret
accepts the message. Secret values never appear in reprs, logs or error messages.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets as random_bytes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

SECRET_PREFIX = "whsec_"
SIGNATURE_VERSION = "v1"
DEFAULT_TOLERANCE_S = 300


class SignatureError(ValueError):
    """A message whose headers or signature do not verify."""


@dataclass(frozen=True)
class WebhookSecret:
    """One of a tenant's signing secrets; `expires_at` ends its rotation window (None: no end)."""

    value: str = field(repr=False)
    expires_at: datetime | None = None

    def is_active(self, now: datetime) -> bool:
        return self.expires_at is None or now < self.expires_at


def active_secrets(secrets: Sequence[WebhookSecret], now: datetime) -> list[str]:
    """The secret values to sign with at `now`: every secret whose rotation window is still open."""
    return [secret.value for secret in secrets if secret.is_active(now)]


def generate_secret(num_bytes: int = 32) -> str:
    """A new `whsec_` secret from 24 to 32 random bytes."""
    if not 24 <= num_bytes <= 32:
        raise ValueError(f"num_bytes must be between 24 and 32, got {num_bytes}")
    return SECRET_PREFIX + base64.b64encode(random_bytes.token_bytes(num_bytes)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_` secret (its base64 part, decoded)."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"webhook secret must start with {SECRET_PREFIX!r}")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
    except binascii.Error:
        raise ValueError("webhook secret is not valid base64 after the prefix") from None
    if not key:
        raise ValueError("webhook secret is empty")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One `v1,<base64>` signature of `{msg_id}.{timestamp}.{body}`."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def signature_headers(msg_id: str, timestamp: int, body: bytes, secrets: Sequence[str]) -> dict[str, str]:
    """The three Standard Webhooks headers, signed with every active secret."""
    if not secrets:
        raise ValueError("at least one webhook secret is needed to sign")
    signatures = " ".join(sign(secret, msg_id, timestamp, body) for secret in secrets)
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp), "webhook-signature": signatures}


def verify(body: bytes, headers: Mapping[str, str], secrets: Sequence[str], *, now: int,
           tolerance_s: int = DEFAULT_TOLERANCE_S) -> None:
    """Raise SignatureError unless a `v1` signature matches one of `secrets` and the timestamp is fresh."""
    lowered = {name.lower(): value for name, value in headers.items()}
    msg_id = lowered.get("webhook-id")
    timestamp = lowered.get("webhook-timestamp")
    signature_header = lowered.get("webhook-signature")
    if not (msg_id and timestamp and signature_header):
        raise SignatureError("missing webhook-id, webhook-timestamp or webhook-signature header")
    if not timestamp.isdigit():
        raise SignatureError("webhook-timestamp is not unix seconds")
    if abs(now - int(timestamp)) > tolerance_s:
        raise SignatureError(f"webhook-timestamp is more than {tolerance_s} s away from now")
    offered = signature_header.split()
    for secret in secrets:
        expected = sign(secret, msg_id, int(timestamp), body)
        if any(hmac.compare_digest(expected, candidate) for candidate in offered):
            return
    raise SignatureError("no webhook-signature matches a known secret")
