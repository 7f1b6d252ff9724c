"""HTTP behaviour below the routes: a 500 keeps the connection usable; OPTIONS and 405 carry `Allow`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from tests.support.live_server import serving
from tests.support.service import LOCAL_URL, RecordingPublisher, Service, error_of

SECRET = "s3cr3t-in-the-exception-message"


@pytest.fixture
def database_url(migrated_sqlite_url: str) -> str:
    """SQLite only: none of this touches the store's dialect."""
    return migrated_sqlite_url


@pytest.fixture
def failing_app(
    make_settings: Callable[..., Settings], database_url: str, prompt_tokenizer: PromptTokenizer
) -> FastAPI:
    """The real app plus one test-only route that raises, as a bug in any handler would."""
    app = create_app(make_settings(database_url=database_url, auth_enabled=False),
                     publisher=RecordingPublisher(), tokenizer=prompt_tokenizer)

    @app.get("/test-only/boom")
    def boom() -> None:
        raise RuntimeError(SECRET)

    return app


@pytest.fixture
def one_connection(failing_app: FastAPI) -> Iterator[httpx.Client]:
    """A client under uvicorn that holds at most one connection, so every request reuses the same one."""
    with serving(failing_app) as base_url, httpx.Client(
        base_url=base_url, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1), timeout=30
    ) as client:
        yield client


def client_port(response: httpx.Response) -> int:
    """The client side's port of the connection that carried `response`."""
    port: int = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    return port


def test_a_500_keeps_the_pooled_connection(one_connection: httpx.Client) -> None:
    first = one_connection.get("/healthz")
    failed = one_connection.get("/test-only/boom")
    assert failed.status_code == 500
    assert error_of(failed) == {"code": "internal_error", "message": "internal server error", "field": None}
    assert SECRET not in failed.text and "Traceback" not in failed.text
    assert failed.headers.get("connection", "").lower() != "close"
    after = one_connection.get("/healthz")  # uvicorn used to close the connection under this request
    assert after.status_code == 200
    assert client_port(first) == client_port(failed) == client_port(after)


def test_a_500_is_logged_with_its_traceback(failing_app: FastAPI, caplog: pytest.LogCaptureFixture) -> None:
    # raise_server_exceptions stays on: nothing reaches it
    with TestClient(failing_app, base_url=LOCAL_URL) as client:
        r = client.get("/test-only/boom")
    assert r.status_code == 500
    record = next(r for r in caplog.records if r.name == "conveyor.api.middleware")
    assert record.exc_info is not None and SECRET in str(record.exc_info[1])
    assert "GET /test-only/boom" in record.getMessage()


@pytest.mark.parametrize(("path", "allow"), [
    ("/v1/jobs", "GET, OPTIONS, POST"),  # two routes share the path
    ("/v1/jobs/job_x", "DELETE, GET, OPTIONS"),
    ("/v1/webhooks/wh_x", "DELETE, GET, OPTIONS"),
    ("/healthz", "GET, OPTIONS"),
])
def test_options_answers_with_allow(service: Service, path: str, allow: str) -> None:
    r = service.http.options(path)  # no key: the methods of a path are no secret
    assert r.status_code == 204 and r.headers["Allow"] == allow and r.content == b""


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("PATCH", "/v1/jobs", "GET, OPTIONS, POST"),
    ("DELETE", "/v1/jobs", "GET, OPTIONS, POST"),
    ("PUT", "/v1/jobs/job_x", "DELETE, GET, OPTIONS"),
    ("GET", "/v1/jobs/job_x/cancel", "OPTIONS, POST"),
])
def test_405_lists_every_method_of_the_path(
    service: Service, method: str, path: str, allow: str
) -> None:
    r = service.client("alice").request(method, path)
    assert r.status_code == 405 and r.headers["Allow"] == allow
    assert error_of(r)["code"] == "method_not_allowed"


def test_options_on_an_unknown_path_is_404(service: Service) -> None:
    r = service.http.options("/v1/nothing")
    assert r.status_code == 404 and "Allow" not in r.headers
