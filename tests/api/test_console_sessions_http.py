"""The console's sessions, tokens and links (issue 51, items 4, 10, 11, 12 and 13), SQLite and PostgreSQL:
a session lives in the store and signing out ends it; an action's CSRF token is derived from the session, so
a planted cookie forges nothing; a malformed cookie or token is a refusal, never a 500; the "Older jobs" link
keeps each filter one value; a console that is off says how to turn it on, and "Sign out" shows only where
there is a sign-in to end."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from fastapi.testclient import TestClient

from conveyor.core.clock import utcnow
from conveyor.core.store import jobs, keys
from tests.support.service import LOCAL_URL, Service, error_of

SESSION, SIGN_IN = "conveyor_console", "conveyor_console_csrf"
SIGN_OUT = 'action="/console/sign-out"'


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, page
    return match.group(1)


def browser(service: Service) -> TestClient:
    return TestClient(service.http.app, base_url=LOCAL_URL, raise_server_exceptions=False)


def signed_in(service: Service, tenant: str) -> TestClient:
    with service.session_factory() as session:
        key = keys.create_key(session, tenant, utcnow())[1]
    client = browser(service)
    form = client.get("/console/sign-in").text
    answer = client.post("/console/sign-in", data={"key": key, "csrf": csrf_of(form)}, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    return client


def plant(client: TestClient, name: str, value: str) -> None:
    """A cookie for the console's host, as a page on another of its ports sets it: it replaces the one the
    console set (the jar names the host `localhost.local`)."""
    client.cookies.set(name, value, domain="localhost.local", path="/console")


def submit(service: Service, tenant: str) -> str:
    answer = service.client(tenant).post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2})
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def test_signing_out_ends_the_session_everywhere(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True)
    alice = signed_in(service, "alice")
    page = alice.get("/console")
    assert page.status_code == 200 and SIGN_OUT in page.text
    copied = alice.cookies[SESSION]
    out = alice.post("/console/sign-out", data={"csrf": csrf_of(page.text)}, follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/console/sign-in"
    elsewhere = browser(service)  # the same cookie, kept by another browser (or read before sign-out)
    plant(elsewhere, SESSION, copied)
    answer = elsewhere.get("/console", follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/console/sign-in"


def test_a_planted_csrf_cookie_forges_no_action(make_service: Callable[..., Service]) -> None:
    """A page on another port of 127.0.0.1 can set a cookie for the console's host; before, that cookie and
    the same value in a form were a valid token, and cancelled the job."""
    for auth in (True, False):
        service = make_service(console_enabled=True, auth_enabled=auth)
        job_id = submit(service, "alice" if auth else "default")
        victim = signed_in(service, "alice") if auth else browser(service)
        assert victim.get(f"/console/jobs/{job_id}").status_code == 200  # a session, with its own token
        plant(victim, SIGN_IN, "planted")
        forged = victim.post(f"/console/jobs/{job_id}/cancel", data={"csrf": "planted"},
                             follow_redirects=False)
        assert forged.status_code == 403 and "csrf" in forged.text, (auth, forged.text)
        assert service.job(job_id).status == "queued"
        confirm = victim.get(f"/console/jobs/{job_id}/cancel")
        done = victim.post(f"/console/jobs/{job_id}/cancel", data={"csrf": csrf_of(confirm.text)},
                           follow_redirects=False)
        assert done.status_code == 303 and service.job(job_id).status == "cancelled"


def test_a_token_of_another_session_is_refused(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True)
    job_id = submit(service, "alice")
    alice, other = signed_in(service, "alice"), signed_in(service, "alice")
    their_token = csrf_of(other.get(f"/console/jobs/{job_id}/cancel").text)
    assert alice.post(f"/console/jobs/{job_id}/cancel", data={"csrf": their_token}).status_code == 403
    assert service.job(job_id).status == "queued"


def test_malformed_cookies_and_tokens_are_refused_not_500(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True)
    for cookie in (b"key_x." + b"9" * 5000 + b".mac", b"key_x.\xb2.mac", b"\xe9" * 43, b"a" * 43):
        anonymous = browser(service)
        answer = anonymous.get("/console", headers=[(b"cookie", SESSION.encode() + b"=" + cookie)],
                               follow_redirects=False)
        assert answer.status_code == 303, (cookie[:20], answer.status_code)
    job_id = submit(service, "alice")
    alice = signed_in(service, "alice")
    assert alice.get(f"/console/jobs/{job_id}").status_code == 200
    plant(alice, SIGN_IN, "x")
    refused = alice.post(f"/console/jobs/{job_id}/cancel", data={"csrf": "é"})
    assert refused.status_code == 403 and service.job(job_id).status == "queued"
    stranger = browser(service)
    stranger.get("/console/sign-in")
    signing = stranger.post("/console/sign-in", data={"key": "cvk_x", "csrf": "é"})
    assert signing.status_code == 403 and "csrf" in signing.text


def test_the_older_jobs_link_keeps_each_filter_one_value(make_service: Callable[..., Service]) -> None:
    """Before, `tenant` went into the link raw: `evil&tenant=tenantA` became two values, and page 2 showed
    tenantA's jobs."""
    service = make_service(console_enabled=True, auth_enabled=False)
    evil, victim = "evil&tenant=tenantA", "tenantA"
    with service.session_factory() as session:
        for tenant, count in ((evil, 51), (victim, 1)):
            keys.create_key(session, tenant, utcnow())  # the tenant, which a job must name
            for _ in range(count):
                new = jobs.NewJob(tenant_id=tenant, queue=service.settings.lanes()[0], prompt="x",
                                  messages=None, params={"max_tokens": 1}, meta=None, webhook=None,
                                  idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=None,
                                  timeout_s=None)
                victim_id = jobs.add(session, new, utcnow()).id
    console = browser(service)
    first = console.get("/console/jobs", params={"tenant": evil, "hours": "24"})
    link = re.search(r'<a href="([^"]+)">Older jobs</a>', first.text)
    assert link is not None, first.text
    older = html.unescape(link.group(1))
    query = parse_qs(urlsplit(older).query)
    assert set(query) == {"cursor", "tenant", "hours"}
    assert query["tenant"] == [evil] and query["hours"] == ["24"]
    second = console.get(older)
    assert second.status_code == 200 and victim_id not in second.text and "job_" in second.text


def test_a_console_that_is_off_says_how_to_turn_it_on(service: Service) -> None:
    for method, path in (("GET", "/console"), ("GET", "/console/jobs/job_x"), ("POST", "/console/purge")):
        answer = service.http.request(method, path)
        assert answer.status_code == 404, (method, path)
        assert "console_enabled" in error_of(answer)["message"], answer.text


def test_sign_out_shows_only_where_there_is_a_sign_in(make_service: Callable[..., Service]) -> None:
    open_console = make_service(console_enabled=True, auth_enabled=False)
    page = browser(open_console).get("/console")
    assert page.status_code == 200 and "auth off" in page.text and SIGN_OUT not in page.text
    assert SIGN_OUT in signed_in(make_service(console_enabled=True), "alice").get("/console").text
