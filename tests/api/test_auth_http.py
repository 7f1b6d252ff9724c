"""API keys: bearer auth, tenants, revocation; auth off only on loopback."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import keys
from conveyor.core.store.tables import DEFAULT_TENANT, ApiKey
from tests.support.service import Service, error_of


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer cvk_wrong"}, {"Authorization": "Basic abc"}]
)
def test_missing_or_wrong_key_is_401(service: Service, headers: dict[str, str]) -> None:
    for r in (
        service.http.post("/v1/jobs", json={"prompt": "x"}, headers=headers),
        service.http.get("/v1/jobs", headers=headers),
        service.http.get("/v1/queues", headers=headers),
    ):
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        error = error_of(r)
        assert error["code"] == "unauthorized" and error["field"] == "Authorization"
        assert str(error["message"]).startswith("Authorization: ")


def test_revoked_key_is_401(service: Service, session: Session) -> None:
    row, plaintext = keys.create_key(session, "carol", utcnow())
    client = service.client_with_key(plaintext)
    assert client.post("/v1/jobs", json={"prompt": "x"}).status_code == 202
    assert keys.revoke_key(session, row.id, utcnow())
    assert not keys.revoke_key(session, row.id, utcnow())
    r = client.get("/v1/jobs")
    assert r.status_code == 401
    assert error_of(r)["message"] == "Authorization: the API key is invalid or revoked"


def test_keys_are_stored_hashed(session: Session) -> None:
    row, plaintext = keys.create_key(session, "dave", utcnow())
    stored = session.get(ApiKey, row.id)
    assert stored is not None and plaintext not in (stored.key_hash, stored.prefix)
    assert plaintext.startswith(stored.prefix) and len(plaintext) > 40
    assert keys.tenant_for_key(session, plaintext) == "dave"


def test_auth_off_means_default_tenant(make_service: Callable[..., Service]) -> None:
    svc = make_service(auth_enabled=False)
    r = svc.http.post("/v1/jobs", json={"prompt": "x"})
    assert r.status_code == 202
    with svc.session_factory() as s:
        from conveyor.core.store import jobs

        job = jobs.get(s, r.json()["id"])
        assert job is not None and job.tenant_id == DEFAULT_TENANT


def test_auth_defaults_on_unless_loopback(make_settings: Callable[..., Settings]) -> None:
    assert make_settings(auth_enabled=None, host="127.0.0.1").auth_enabled is False
    assert make_settings(auth_enabled=None, host="::1").auth_enabled is False
    assert make_settings(auth_enabled=None, host="localhost").auth_enabled is False
    assert make_settings(auth_enabled=None, host="0.0.0.0").auth_enabled is True


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_non_loopback_without_auth_is_refused(make_settings: Callable[..., Settings], host: str) -> None:
    with pytest.raises(ValueError, match="refusing to listen on non-loopback address"):
        make_settings(host=host, auth_enabled=False).check_bind()
    make_settings(host=host, auth_enabled=True).check_bind()
    make_settings(host="127.0.0.1", auth_enabled=False).check_bind()


def test_health_endpoints_need_no_key(service: Service) -> None:
    # /metrics and the docs are closed with auth on: tests/api/test_exposure_http.py
    assert service.http.get("/healthz").json() == {"status": "ok"}
    assert service.http.get("/readyz").status_code in (200, 503)


def test_unknown_route_uses_the_error_shape(alice: TestClient) -> None:
    r = alice.get("/v1/nothing")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"
