"""The API's cache of keys and limits over HTTP, in one process (SQLite and PostgreSQL): a cached key is
answered with no lookup in the thread pool, on either header; a key revoked with no notice (SQLite, or a
change made straight in the database) is refused once auth_cache_s has passed; on PostgreSQL a revocation and
a limit change through the store apply at once, though the cache would keep them a minute.
Two API processes: tests/api/test_auth_cache_processes.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.orm import Session

from conveyor.api import auth
from conveyor.core.clock import utcnow
from conveyor.core.store import keys, tenants
from conveyor.core.store.tables import ApiKey
from tests.support.live_server import wait_for
from tests.support.service import Service, error_of

NOTICE_S = 5.0  # a notice is heard within moments; this bounds a failing test, far below the TTL
LONG_TTL_S = 60.0


def _counting_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys api/auth.py hands to the thread pool to look up (it does so only when not cached)."""
    looked_up: list[str] = []
    real = auth.tenant_of_key

    def counted(services: Any, plaintext: str) -> str:
        looked_up.append(plaintext)
        return real(services, plaintext)

    monkeypatch.setattr(auth, "tenant_of_key", counted)
    return looked_up


def test_a_cached_key_is_answered_without_a_lookup_on_either_header(
    make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = make_service(auth_cache_s=LONG_TTL_S)
    alice = service.client("alice")
    key = alice.headers["Authorization"].removeprefix("Bearer ")
    looked_up = _counting_lookups(monkeypatch)
    assert [alice.get("/v1/jobs").status_code for _ in range(4)] == [200] * 4
    by_x_api_key = service.http.get("/v1/messages/batches", headers={"x-api-key": key})
    assert by_x_api_key.status_code == 200, by_x_api_key.text
    assert looked_up == [key], "only the first request looks the key up"
    for wrong in ("cvk_made-up", "cvk_made-up"):  # refusals are looked up every time, never cached
        assert service.client_with_key(wrong).get("/v1/jobs").status_code == 401
    assert looked_up == [key, "cvk_made-up", "cvk_made-up"]


def test_with_the_cache_off_every_request_looks_its_key_up(
    make_service: Callable[..., Service], monkeypatch: pytest.MonkeyPatch,
) -> None:
    alice = make_service(auth_cache_s=0.0).client("alice")
    looked_up = _counting_lookups(monkeypatch)
    assert [alice.get("/v1/jobs").status_code for _ in range(3)] == [200] * 3
    assert len(looked_up) == 3


def test_a_key_revoked_without_a_notice_is_refused_once_auth_cache_s_has_passed(
    make_service: Callable[..., Service], session: Session,
) -> None:
    """No notice: on SQLite there is none to send, and an UPDATE made straight in the database sends none on
    PostgreSQL either. The cached grant expires after auth_cache_s, and the store says revoked."""
    service = make_service(auth_cache_s=1.0)
    row, plaintext = keys.create_key(session, "carol", utcnow())
    carol = service.client_with_key(plaintext)
    assert carol.get("/v1/jobs").status_code == 200
    session.execute(update(ApiKey).where(ApiKey.id == row.id).values(revoked_at=utcnow()))
    session.commit()
    wait_for(lambda: carol.get("/v1/jobs").status_code == 401, "the cached key to expire", 10.0)
    assert error_of(carol.get("/v1/jobs"))["message"] == "Authorization: the API key is invalid or revoked"


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_on_postgres_a_revocation_is_refused_at_once_though_cached_for_a_minute(
    make_service: Callable[..., Service], session: Session,
) -> None:
    service = make_service(auth_cache_s=LONG_TTL_S)
    row, plaintext = keys.create_key(session, "carol", utcnow())
    carol = service.client_with_key(plaintext)
    anthropic = TestClient(service.http.app, base_url=str(service.http.base_url),
                           headers={"x-api-key": plaintext})
    assert carol.get("/v1/jobs").status_code == 200
    assert keys.revoke_key(session, row.id, utcnow())
    wait_for(lambda: carol.get("/v1/jobs").status_code == 401, "the revocation's notice", NOTICE_S)
    refused = anthropic.get("/v1/messages/batches")
    assert refused.status_code == 401 and "x-api-key" in refused.text


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_on_postgres_a_lowered_max_queued_applies_at_once_though_cached_for_a_minute(
    make_service: Callable[..., Service], session: Session,
) -> None:
    service = make_service(auth_cache_s=LONG_TTL_S)
    alice = service.client("alice")
    body = {"prompt": "hello there", "max_tokens": 4}
    assert [alice.post("/v1/jobs", json=body).status_code for _ in range(2)] == [202, 202]
    tenants.set_overrides(session, "alice", {"max_queued": 1}, utcnow())

    def refused() -> bool:
        answer = alice.post("/v1/jobs", json=body)
        return answer.status_code == 429 and error_of(answer)["code"] == "tenant_queue_full"

    wait_for(refused, "the limit change's notice", NOTICE_S)
