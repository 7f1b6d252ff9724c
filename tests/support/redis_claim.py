"""One Redis database index per test process, claimed on the shared server so that no two processes flush
each other's: pytest-xdist workers of one run, and two runs on one machine, alike.

A claim is a key in database 0 (`conveyor-test:db:<n>`, set only if absent, with an expiry that outlives any
run); it is deleted when the process' session ends. Database 0 itself is never handed out.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis

CLAIM_TTL_S = 3 * 3600  # a run killed without cleanup frees its index after this long
DATABASES = range(1, 16)  # redis-server's default 16 databases, less 0 (where the claims live)


@contextmanager
def claimed_database(server: str) -> Iterator[int]:
    """Claims a free database index on `server` (redis://host:port) for the duration of the block."""
    owner = f"{os.getpid()}:{uuid.uuid4().hex}"
    client = redis.Redis.from_url(f"{server}/0", socket_connect_timeout=5)
    try:
        index = next((n for n in _preferred_order() if client.set(_key(n), owner, nx=True, ex=CLAIM_TTL_S)),
                     None)
        if index is None:
            raise RuntimeError(f"every Redis database 1-15 on {server} is claimed by another test process; "
                               f"delete the stale keys with: redis-cli --scan --pattern 'conveyor-test:db:*'")
        try:
            yield index
        finally:
            if client.get(_key(index)) == owner.encode():
                client.delete(_key(index))
    finally:
        client.close()


def _preferred_order() -> list[int]:
    """Worker gwN tries index N+1 first, so a run's workers rarely contend for the same key."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    start = int(worker[2:]) if worker[2:].isdigit() else 0
    return [DATABASES[(start + i) % len(DATABASES)] for i in range(len(DATABASES))]


def _key(index: int) -> str:
    return f"conveyor-test:db:{index}"
