"""An S3-compatible server on loopback for the batch I/O tests: moto's ThreadedMotoServer on an ephemeral
port, run in a child process so the memory it uses to serve objects is not traced in the test process."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from conveyor.core.s3 import make_s3_client

_SERVE = """
import logging
import sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # serve until the test process closes our stdin (or kills us)
server.stop()
"""


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A boto3 client with dummy credentials from the environment (the standard chain), and a fresh bucket."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    client = make_s3_client(moto_endpoint, "us-east-1")
    return client


@pytest.fixture
def bucket(s3: Any) -> str:
    name = "batch-" + uuid.uuid4().hex[:12]
    s3.create_bucket(Bucket=name)
    return name
