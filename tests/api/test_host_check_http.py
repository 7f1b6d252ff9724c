"""Only the configured host names are answered, and no browser page of another origin changes anything
(issue 51, item 8; api/host_check.py).

Before, with auth off, a page on attacker.example whose name resolved to 127.0.0.1 (DNS rebinding) read a
job's prompt from the console, took a CSRF token from the purge page and purged the queue; any page could
cancel a job with a body-less cross-site POST; and the trailing-slash redirect put the request's `Host`
into its `Location`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest
from fastapi.testclient import TestClient

from conveyor.core.settings import Settings
from tests.support.service import Service, error_of

ATTACKER = "attacker.example:8001"
OWN = "localhost:8001"


@pytest.fixture
def database_url(migrated_sqlite_url: str) -> str:
    """SQLite only: the names are judged before any query, the same on every store."""
    return migrated_sqlite_url


@pytest.fixture
def open_service(make_service: Callable[..., Service]) -> Service:
    """Auth off on loopback, the console on: what DNS rebinding reaches."""
    return make_service(auth_enabled=False, console_enabled=True)


def browser(service: Service, host: str) -> TestClient:
    """A browser at http://<host>: it sends that name as `Host`, and its own origin with every POST."""
    client = TestClient(service.http.app, base_url=f"http://{host}")
    client.headers["Origin"] = f"http://{host}"
    return client


def submit(service: Service, prompt: str) -> str:
    created = service.http.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 2})
    assert created.status_code == 202, created.text
    return str(created.json()["id"])


def assert_host_refused(answer: httpx.Response, host: str) -> None:
    assert answer.status_code == 400, answer.text
    error = error_of(answer)
    assert (error["code"], error["field"]) == ("host_not_allowed", "Host")
    assert repr(host) in error["message"] and "allowed_hosts" in error["message"]


def test_a_rebound_name_reads_nothing_and_purges_nothing(open_service: Service) -> None:
    job_id = submit(open_service, "my secret prompt")
    lane = f"{open_service.settings.default_model_id()}:interactive"
    attacker = browser(open_service, ATTACKER)
    page = attacker.get(f"/console/jobs/{job_id}")
    assert_host_refused(page, ATTACKER)
    assert "my secret prompt" not in page.text
    assert_host_refused(attacker.get(f"/v1/jobs/{job_id}"), ATTACKER)
    assert_host_refused(attacker.get("/console/purge", params={"lane": lane}), ATTACKER)
    own = browser(open_service, OWN)
    token = re.search(r'name="csrf" value="([^"]+)"', own.get("/console/purge", params={"lane": lane}).text)
    assert token is not None
    assert_host_refused(attacker.post("/console/purge", data={"lane": lane, "csrf": token.group(1)},
                                      cookies=own.cookies), ATTACKER)
    assert_host_refused(attacker.post("/v1/jobs", json={"prompt": "x"}), ATTACKER)
    assert open_service.job(job_id).status == "queued"
    for name in (OWN, "127.0.0.1:8001", "[::1]:8001", "LocalHost.", "localhost"):
        seen = browser(open_service, name).get(f"/console/jobs/{job_id}")
        assert seen.status_code == 200 and "my secret prompt" in seen.text, name


def test_a_page_of_another_origin_changes_nothing(open_service: Service) -> None:
    job_id = submit(open_service, "hello")
    other_port = browser(open_service, OWN)
    # Another port of the same host is the same site to a browser, not the same origin.
    for origin in ("http://localhost:3000", "https://evil.example", "null"):
        other_port.headers["Origin"] = origin
        refused = other_port.post(f"/v1/jobs/{job_id}/cancel")
        assert refused.status_code == 403, refused.text
        assert error_of(refused)["code"] == "origin_not_allowed" and origin in error_of(refused)["message"]
    assert open_service.job(job_id).status == "queued"
    assert other_port.get(f"/v1/jobs/{job_id}").status_code == 200  # reading is not changing
    assert browser(open_service, OWN).post(f"/v1/jobs/{job_id}/cancel").status_code == 200  # its own page
    api_client = open_service.http  # sends no Origin
    assert api_client.post(f"/v1/jobs/{submit(open_service, 'x')}/cancel").status_code == 200


def test_redirects_carry_no_host(open_service: Service) -> None:
    client = TestClient(open_service.http.app, base_url=f"http://{OWN}")
    for path, target in (("/console/", "/console"), ("/v1/jobs/", "/v1/jobs")):
        answer = client.get(path, follow_redirects=False)
        assert answer.status_code == 307 and answer.headers["location"] == target, (path, answer.headers)


def test_configured_names_replace_the_loopback_ones(make_service: Callable[..., Service]) -> None:
    service = make_service(allowed_hosts=["conveyor.example.com", "*.svc.cluster.local"])
    alice = service.client("alice")
    for name, status in (("conveyor.example.com", 200), ("conveyor-api.conveyor.svc.cluster.local:8000", 200),
                         ("svc.cluster.local", 400), ("localhost", 400), ("conveyor.example.com.evil", 400)):
        alice.base_url = f"http://{name}"  # type: ignore[assignment]
        assert alice.get("/v1/jobs").status_code == status, name


@pytest.mark.parametrize(("host", "names"), [
    ("127.0.0.1", ["localhost", "127.0.0.1", "::1"]),
    ("::1", ["localhost", "127.0.0.1", "::1"]),
    ("127.0.0.2", ["localhost", "127.0.0.1", "::1", "127.0.0.2"]),
    ("10.0.0.7", ["10.0.0.7"]),
    ("0.0.0.0", ["*"]),  # every address: auth is on, and the names clients use are the operator's to list
])
def test_the_default_names_follow_the_bind_address(host: str, names: list[str]) -> None:
    assert Settings(host=host, auth_enabled=True).allowed_hosts == names


def test_configured_names_are_normalised_or_refused_naming_the_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_ALLOWED_HOSTS", "Conveyor.Example.com., [::1], *.svc.cluster.local")
    assert Settings().allowed_hosts == ["conveyor.example.com", "::1", "*.svc.cluster.local"]
    for bad, reason in (("conveyor.example.com:443", "without scheme, port or path"),
                        ("https://conveyor.example.com", "without scheme, port or path"),
                        ("conv*.example.com", "a wildcard is `*`")):
        with pytest.raises(ValueError, match=re.escape(reason)):
            Settings(allowed_hosts=[bad])

