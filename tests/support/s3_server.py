"""moto's S3-compatible server on a loopback port, and dummy AWS credentials through the standard chain (the
environment), for tests that run S3 batches through the service."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}


@contextmanager
def moto_server() -> Iterator[str]:
    """The server's endpoint URL while it runs."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    finally:
        server.stop()


def use_dummy_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment's credentials only: no profile, session token or config file of the machine's."""
    for name, value in DUMMY_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
