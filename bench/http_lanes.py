"""The HTTP bench's clients: lanes of a few connections each, created once for the run.

httpcore's connection pool scans all its connections, and every request waiting for one, each time a request
starts or ends (and compares the idle ones with each other). With one client of 128 connections, an open loop
of 100 submissions/s took about 13 ms of the bench's CPU per job, most of it there: 70% of a core on the
2-core machine the bench shares with the server. Small pools do the same work for a fraction of that. A job
keeps its lane from submit to final answer; a closed loop's slot has a lane of its own.
"""

from __future__ import annotations

import ssl
from types import TracebackType

import httpx

SUBMIT_TIMEOUT_S = 30.0  # a long poll sets its own, longer, read timeout
# Idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them: a request sent on a
# connection the server is closing fails with ReadError.
KEEPALIVE_S = 2.0


class Lanes:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        count: int,
        connections: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`count` lanes of `connections` each, and one more client for the queue sampler."""
        assert count >= 1 and connections >= 1
        tls = ssl.create_default_context()  # once: each client would load the CA bundle again
        limits = httpx.Limits(
            max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=KEEPALIVE_S
        )
        self.clients = [
            httpx.AsyncClient(
                base_url=base_url.rstrip("/"),
                headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                timeout=SUBMIT_TIMEOUT_S,
                limits=limits,
                verify=tls,
                transport=transport,
            )
            for _ in range(count + 1)
        ]

    @property
    def sampler(self) -> httpx.AsyncClient:
        return self.clients[-1]

    def lane(self, i: int) -> httpx.AsyncClient:
        return self.clients[i % (len(self.clients) - 1)]

    async def __aenter__(self) -> Lanes:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for client in self.clients:
            await client.aclose()
