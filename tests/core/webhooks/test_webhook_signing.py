from __future__ import annotations

import base64
import time
from datetime import datetime, timedelta, timezone

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from conveyor.core.webhooks.signing import (
    SignatureError,
    WebhookSecret,
    active_secrets,
    generate_secret,
    signature_headers,
    verify,
)

BODY = b'{"type":"job.succeeded","timestamp":"2026-11-30T05:00:00Z","data":{"id":"job_1"}}'


@pytest.mark.parametrize("num_bytes", [24, 32])
def test_generated_secrets_carry_the_requested_random_bytes(num_bytes: int) -> None:
    first, second = generate_secret(num_bytes), generate_secret(num_bytes)
    assert first.startswith("whsec_") and first != second
    assert len(base64.b64decode(first.removeprefix("whsec_"))) == num_bytes


def test_secret_size_outside_24_to_32_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="num_bytes"):
        generate_secret(16)


def test_signature_verifies_with_the_independent_verifier(secret: str) -> None:
    headers = signature_headers("msg_1", int(time.time()), BODY, [secret])
    assert headers["webhook-signature"].startswith("v1,")
    assert Webhook(secret).verify(BODY, headers)["data"] == {"id": "job_1"}
    verify(BODY, headers, [secret], now=int(time.time()))


def test_tampered_body_and_other_secret_are_rejected_by_both_verifiers(secret: str) -> None:
    headers = signature_headers("msg_1", int(time.time()), BODY, [secret])
    tampered = BODY.replace(b"job_1", b"job_2")
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(tampered, headers)
    with pytest.raises(SignatureError, match="no webhook-signature"):
        verify(tampered, headers, [secret], now=int(time.time()))
    with pytest.raises(SignatureError):
        verify(BODY, headers, [generate_secret()], now=int(time.time()))


def test_stale_timestamp_is_rejected(secret: str) -> None:
    headers = signature_headers("msg_1", 1_000_000, BODY, [secret])
    with pytest.raises(SignatureError, match="away from now"):
        verify(BODY, headers, [secret], now=1_000_000 + 301)
    verify(BODY, headers, [secret], now=1_000_000 + 299)


def test_rotation_window_signs_with_old_and_new_then_only_new() -> None:
    now = datetime.now(timezone.utc)
    old = WebhookSecret(generate_secret(), expires_at=now + timedelta(hours=24))
    new = WebhookSecret(generate_secret())
    during = active_secrets([old, new], now)
    headers = signature_headers("msg_rot", int(now.timestamp()), BODY, during)
    assert len(headers["webhook-signature"].split(" ")) == 2
    for receiver_secret in (old.value, new.value):
        Webhook(receiver_secret).verify(BODY, headers)
        verify(BODY, headers, [receiver_secret], now=int(now.timestamp()))

    after = active_secrets([old, new], now + timedelta(hours=25))
    assert after == [new.value]
    headers = signature_headers("msg_rot2", int(now.timestamp()), BODY, after)
    Webhook(new.value).verify(BODY, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(old.value).verify(BODY, headers)


def test_secret_values_stay_out_of_reprs_and_errors() -> None:
    value = generate_secret()
    assert value not in repr(WebhookSecret(value))
    with pytest.raises(ValueError) as refused:
        signature_headers("msg_1", 1, BODY, ["not-a-whsec-" + value])
    assert value not in str(refused.value)
