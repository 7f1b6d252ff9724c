"""What answers without an API key: /metrics behind its own token, the docs only when enabled.

Off-loopback (auth on) both are closed by default; on loopback with auth off everything is open as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import pytest

from conveyor.core.settings import Settings
from tests.support.service import Service, error_of

TOKEN = "metrics-token-9f2c41d7e8b3"
DOCS = ("/docs", "/redoc", "/openapi.json")


@pytest.fixture
def database_url(migrated_sqlite_url: str) -> str:
    """SQLite only: what is exposed is decided before any query, the same on every store."""
    return migrated_sqlite_url


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


def assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    error = error_of(response)
    assert error["code"] == "unauthorized" and error["field"] == "Authorization"


def test_auth_on_closes_metrics_even_to_tenant_keys(make_service: Callable[..., Service]) -> None:
    svc = make_service()  # auth on, no metrics token
    assert_unauthorized(svc.http.get("/metrics"))
    # A tenant's key reads its own jobs, never the cluster-wide metrics of every tenant.
    assert_unauthorized(svc.client("alice").get("/metrics"))


def test_metrics_token_opens_metrics(make_service: Callable[..., Service]) -> None:
    svc = make_service(metrics_token=TOKEN)
    wrong = ({}, bearer("wrong"), bearer(""), bearer(TOKEN + "x"), {"Authorization": f"Basic {TOKEN}"})
    for headers in wrong:
        assert_unauthorized(svc.http.get("/metrics", headers=headers))
    assert_unauthorized(svc.client("alice").get("/metrics"))
    r = svc.http.get("/metrics", headers=bearer(TOKEN))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "conveyor_http_responses_total" in r.text
    assert svc.http.get("/metrics", headers={"authorization": f"bearer {TOKEN}"}).status_code == 200


def test_a_set_token_is_required_with_auth_off_too(make_service: Callable[..., Service]) -> None:
    svc = make_service(auth_enabled=False, metrics_token=TOKEN)
    assert_unauthorized(svc.http.get("/metrics"))
    assert svc.http.get("/metrics", headers=bearer(TOKEN)).status_code == 200


def test_loopback_without_auth_keeps_everything_open(make_service: Callable[..., Service]) -> None:
    svc = make_service(auth_enabled=None, host="127.0.0.1")
    assert svc.settings.auth_enabled is False and svc.settings.docs_enabled is True
    assert svc.http.get("/metrics").status_code == 200
    for path in DOCS:
        assert svc.http.get(path).status_code == 200, path


def test_auth_on_turns_the_docs_off(make_service: Callable[..., Service]) -> None:
    svc = make_service()
    alice = svc.client("alice")
    for path in DOCS:
        assert svc.http.get(path).status_code == 404, path
        assert alice.get(path).status_code == 404, path
    assert svc.http.get("/healthz").status_code == 200  # probes stay open
    assert svc.http.get("/readyz").status_code in (200, 503)


def test_docs_enabled_serves_them_with_auth_on(make_service: Callable[..., Service]) -> None:
    svc = make_service(docs_enabled=True)
    for path in DOCS:
        assert svc.http.get(path).status_code == 200, path
    schema = svc.http.get("/openapi.json").json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/queues"} <= set(schema["paths"])
    assert_unauthorized(svc.http.get("/v1/jobs"))  # the docs open, the API does not


def test_docs_default_follows_auth(make_settings: Callable[..., Settings]) -> None:
    assert make_settings(auth_enabled=None, host="0.0.0.0").docs_enabled is False
    assert make_settings(auth_enabled=None, host="127.0.0.1").docs_enabled is True
    assert make_settings(auth_enabled=False).docs_enabled is True
    assert make_settings(auth_enabled=True, docs_enabled=True).docs_enabled is True
    assert make_settings(auth_enabled=False, docs_enabled=False).docs_enabled is False


def test_metrics_token_setting(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert make_settings().metrics_token is None
    assert make_settings(metrics_token="  ").metrics_token is None  # set but empty: no token, not ""
    monkeypatch.setenv("CONVEYOR_METRICS_TOKEN", TOKEN)
    settings = Settings()
    assert settings.metrics_token is not None and settings.metrics_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(settings) and TOKEN not in str(settings.model_dump())


def test_the_token_is_never_logged_or_echoed(
    make_service: Callable[..., Service], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        svc = make_service(metrics_token=TOKEN)
        wrong = svc.http.get("/metrics", headers=bearer(TOKEN[:-1]))
        svc.http.get("/metrics", headers=bearer(TOKEN))
    assert TOKEN[:-1] not in wrong.text
    assert TOKEN[:-1] not in caplog.text


def test_auth_on_without_a_token_warns_once_at_startup(
    make_service: Callable[..., Service], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor.api.app"):
        make_service()
        make_service(metrics_token=TOKEN)
        make_service(auth_enabled=False)
    assert [r.getMessage() for r in caplog.records if r.name == "conveyor.api.app"] == [
        "authentication is on and CONVEYOR_METRICS_TOKEN is unset: /metrics answers 401"
    ]
