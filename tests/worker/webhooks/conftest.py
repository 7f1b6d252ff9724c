"""Fixtures for the webhook tests: the loopback receiver, an allowlisted delivery client, a fresh secret."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from webhook_receiver import Receiver

from worker.webhooks import SsrfPolicy, generate_secret, webhook_client


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def loopback_client() -> Iterator[httpx.Client]:
    """A delivery client whose operator allowlist permits the loopback receiver."""
    with webhook_client(SsrfPolicy(allow=("127.0.0.1",))) as client:
        yield client


@pytest.fixture
def secret() -> str:
    return generate_secret()
