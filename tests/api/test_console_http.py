"""The operator console over HTTP (SQLite and PostgreSQL): off unless enabled; with auth on, a sign-in with
an API key (an admin key sees every tenant, a tenant's key only its own jobs); every value escaped; every
action a confirmed POST that changes nothing without the session and the CSRF token."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import update

from conveyor.core.clock import utcnow
from conveyor.core.store import batches, jobs, keys, workers
from conveyor.core.store.tables import BatchLine, Delivery
from tests.support.service import LOCAL_URL, Service

XSS = "<script>alert(1)</script>"


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, page
    return match.group(1)


def key_of(service: Service, tenant: str, *, admin: bool = False) -> str:
    with service.session_factory() as session:
        return keys.create_key(session, tenant, utcnow(), admin=admin)[1]


def signed_in(service: Service, key: str) -> TestClient:
    browser = TestClient(service.http.app, base_url=LOCAL_URL)
    form = browser.get("/console/sign-in")
    assert form.status_code == 200 and "Sign in" in form.text
    answer = browser.post("/console/sign-in", data={"key": key, "csrf": csrf_of(form.text)},
                          follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/console", answer.text
    cookie = answer.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    return browser


def submit(service: Service, tenant: str, prompt: str) -> str:
    answer = service.client(tenant).post("/v1/jobs", json={"prompt": prompt, "max_tokens": 4})
    assert answer.status_code == 202, answer.text
    return str(answer.json()["id"])


def test_the_console_is_off_unless_enabled(service: Service) -> None:
    assert service.http.get("/console").status_code == 404
    assert service.http.get("/console/sign-in").status_code == 404


def test_with_auth_on_a_page_asks_to_sign_in_and_a_bad_key_is_refused(make_service: Callable[..., Service],
                                                                       ) -> None:
    service = make_service(console_enabled=True)
    anonymous = TestClient(service.http.app, base_url=LOCAL_URL)
    assert anonymous.get("/console/jobs", follow_redirects=False).headers["location"] == "/console/sign-in"
    form = anonymous.get("/console/sign-in").text
    refused = anonymous.post("/console/sign-in", data={"key": "cvk_wrong", "csrf": csrf_of(form)})
    assert refused.status_code == 200 and "unknown or revoked" in refused.text
    assert anonymous.get("/console", follow_redirects=False).status_code == 303


def test_an_admin_sees_every_tenant_and_a_prompt_of_html_shows_as_text(make_service: Callable[..., Service],
                                                                        ) -> None:
    service = make_service(console_enabled=True)
    mine, theirs = submit(service, "alice", XSS), submit(service, "bob", "hello")
    admin_key = key_of(service, "ops", admin=True)
    admin = signed_in(service, admin_key)

    listing = admin.get("/console/jobs").text
    assert mine in listing and theirs in listing
    page = admin.get(f"/console/jobs/{mine}").text
    assert XSS not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    answer = admin.get("/console")
    overview = answer.text
    assert "interactive" in overview and "every tenant" in overview
    assert answer.headers["X-Frame-Options"] == "DENY" and "frame-ancestors 'none'" in (
        answer.headers["Content-Security-Policy"])
    assert '<script src="/console/static/console.js" defer></script>' in overview  # its one script
    script = admin.get("/console/static/console.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert admin_key not in overview + listing + page  # only its public prefix, as `conveyor keys list`


def test_a_tenants_key_never_shows_another_tenants_job(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True)
    mine, theirs = submit(service, "alice", "mine"), submit(service, "bob", "theirs")
    alice = signed_in(service, key_of(service, "alice"))
    listing = alice.get("/console/jobs", params={"tenant": "bob"}).text  # the filter cannot widen it
    assert mine in listing and theirs not in listing
    hidden = alice.get(f"/console/jobs/{theirs}")
    assert hidden.status_code == 404 and "Not found" in hidden.text and "another tenant" in hidden.text
    assert alice.post(f"/console/jobs/{theirs}/cancel", data={"csrf": csrf_of(listing)}).status_code == 404
    assert service.job(theirs).status == "queued"


def test_an_action_needs_its_csrf_token_and_a_session(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True)
    job_id = submit(service, "alice", "hello")
    alice = signed_in(service, key_of(service, "alice"))
    confirm = alice.get(f"/console/jobs/{job_id}/cancel")
    assert confirm.status_code == 200 and "Cancel job" in confirm.text

    assert alice.post(f"/console/jobs/{job_id}/cancel").status_code == 403  # no token
    assert alice.post(f"/console/jobs/{job_id}/cancel", data={"csrf": "forged"}).status_code == 403
    # The token without the session: sent to sign in.
    stranger = TestClient(service.http.app, base_url=LOCAL_URL)
    answer = stranger.post(f"/console/jobs/{job_id}/cancel", data={"csrf": csrf_of(confirm.text)},
                           follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/console/sign-in"
    assert service.job(job_id).status == "queued"  # nothing changed

    done = alice.post(f"/console/jobs/{job_id}/cancel", data={"csrf": csrf_of(confirm.text)},
                      follow_redirects=False)
    assert done.status_code == 303 and service.job(job_id).status == "cancelled"
    retry = alice.get(f"/console/jobs/{job_id}/retry")
    alice.post(f"/console/jobs/{job_id}/retry", data={"csrf": csrf_of(retry.text)})
    assert service.job(job_id).status == "queued" and service.job(job_id).history


def test_a_revoked_key_ends_its_sessions(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True)
    key = key_of(service, "alice")
    alice = signed_in(service, key)
    assert alice.get("/console").status_code == 200
    with service.session_factory() as session:
        [row] = [k for k in keys.list_keys(session) if key.startswith(k.prefix) and k.tenant_id == "alice"]
        keys.revoke_key(session, row.id, utcnow())
    assert alice.get("/console", follow_redirects=False).status_code == 303


def test_with_auth_off_it_opens_without_signing_in(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True, auth_enabled=False)
    job_id = service.http.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2}).json()["id"]
    listing = service.http.get("/console/jobs")
    assert listing.status_code == 200 and job_id in listing.text and "auth off" in listing.text
    api_404 = service.http.get("/v1/jobs/job_0123456789abcdef0123456789abcdef")
    assert api_404.status_code == 404 and api_404.json()["error"]["code"] == "not_found"  # the API's JSON


def test_the_jobs_of_one_queue_and_the_overviews_figures(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True, auth_enabled=False)
    chat = service.http.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2}).json()["id"]
    doc = service.http.post("/v1/jobs", json={"prompt": "doc", "max_tokens": 2, "queue": "documents"}).json()
    lane = f"{service.settings.default_model_id()}:documents"
    listing = service.http.get("/console/jobs", params={"lane": lane}).text
    assert doc["id"] in listing and chat not in listing
    assert service.http.get("/console/jobs", params={"lane": "nope:x"}).status_code == 422
    with service.session_factory() as session:
        assert jobs.claim(session, chat, "w1", utcnow()) is not None
        assert jobs.fail(session, chat, 1, code="engine_error", message="boom", now=utcnow())
    overview = service.http.get("/console").text
    assert f'href="/console/jobs?lane={lane.replace(":", "%3A")}"' in overview
    assert "on time (1 h)" in overview
    assert "Failures in the last hour, by code" in overview and "engine_error" in overview
    assert overview.count('<svg class="spark"') == len(service.settings.lanes())  # succeeded per minute


def test_workers_tenants_and_purges_are_an_admins(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True)
    waiting = [submit(service, "alice", "a"), submit(service, "bob", "b")]
    with service.session_factory() as session:
        workers.register(session, "w-1", hostname="gpu-7", pid=42, queues=service.settings.lanes(),
                         now=utcnow())
        workers.heartbeat(session, "w-1", utcnow(), {"kv_used": 0.5, "running": 3.0, "waiting": 1.0,
                                                     "preemptions": 2.0, "step_s": 0.0125})
    alice = signed_in(service, key_of(service, "alice"))
    for path in ("/console/workers", "/console/tenants", "/console/purge?lane=x"):
        assert alice.get(path).status_code == 403, path
    admin = signed_in(service, key_of(service, "ops", admin=True))
    fleet = admin.get("/console/workers").text
    assert "gpu-7 (42)" in fleet and "KV 50%, 3 running, 1 waiting, 2 preemptions, 12.5 ms/step" in fleet
    tenants_page = admin.get("/console/tenants").text
    assert "alice" in tenants_page and "bob" in tenants_page

    lane = f"{service.settings.default_model_id()}:interactive"
    confirm = admin.get("/console/purge", params={"lane": lane})
    assert confirm.status_code == 200 and f"Purge {lane}?" in confirm.text
    assert admin.post("/console/purge", data={"lane": lane}).status_code == 403  # no CSRF token
    assert all(service.job(j).status == "queued" for j in waiting)
    done = admin.post("/console/purge", data={"lane": lane, "csrf": csrf_of(confirm.text)})
    assert done.status_code == 200 and "Purged 2 job(s)" in done.text
    assert all(service.job(j).status == "cancelled" for j in waiting)


def test_a_batch_page_shows_its_progress_and_cancels_it(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True)
    with service.session_factory() as session:
        mine = batches.create(session, tenant_id="alice", input_url="s3://b/in.jsonl", output_url=None,
                              queue="documents", now=utcnow(), run_at=utcnow() + timedelta(hours=1))
        theirs = batches.create(session, tenant_id="bob", input_url="s3://b/x.jsonl", output_url=None,
                                queue="documents", now=utcnow())
        session.add(BatchLine(batch_id=mine.id, line=3, custom_id="req-3", status="failed",
                              error={"code": "invalid_request", "message": "max_tokens: <too> large"}))
        session.commit()
    alice = signed_in(service, key_of(service, "alice"))
    detail = alice.get(f"/console/batches/{mine.id}").text
    assert "Failed lines" in detail and "req-3" in detail and "max_tokens: &lt;too&gt; large" in detail
    listing = alice.get("/console/batches").text
    assert mine.id in listing and theirs.id not in listing and "<progress" in listing
    assert alice.get(f"/console/batches/{theirs.id}").status_code == 404
    confirm = alice.get(f"/console/batches/{mine.id}/cancel")
    assert "Cancel batch" in confirm.text
    done = alice.post(f"/console/batches/{mine.id}/cancel", data={"csrf": csrf_of(confirm.text)})
    assert done.status_code == 200 and "cancelling" in done.text


def test_a_delivery_is_resent_from_its_jobs_page(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True, webhook_allowlist=["127.0.0.1"])
    alice_api = service.client("alice")
    job_id = alice_api.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2,
                                              "webhook": "http://127.0.0.1:9/hook?token=s3cret"}).json()["id"]
    alice_api.post(f"/v1/jobs/{job_id}/cancel")
    [delivery] = alice_api.get(f"/v1/jobs/{job_id}/deliveries").json()["data"]
    with service.session_factory() as session:  # as if its attempts had run out
        session.execute(update(Delivery).where(Delivery.id == delivery["id"]).values(status="failed"))
        session.commit()
    alice = signed_in(service, key_of(service, "alice"))
    job_page = alice.get(f"/console/jobs/{job_id}").text
    assert "job.cancelled" in job_page and "s3cret" not in job_page  # the target without its query
    confirm = alice.get(f"/console/jobs/{job_id}/deliveries/{delivery['id']}/resend")
    assert "Send job.cancelled again?" in confirm.text
    assert alice.get(f"/console/jobs/{job_id}/deliveries/dlv_nope/resend").status_code == 404
    done = alice.post(f"/console/jobs/{job_id}/deliveries/{delivery['id']}/resend",
                      data={"csrf": csrf_of(confirm.text)}, follow_redirects=False)
    assert done.status_code == 303
    assert alice_api.get(f"/v1/jobs/{job_id}/deliveries").json()["data"][0]["status"] == "pending"


def test_a_job_is_found_by_its_id_and_a_batchs_jobs_listed(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True, auth_enabled=False)
    job_id = service.http.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 2}).json()["id"]
    found = service.http.get("/console/jobs", params={"find": f" {job_id} "}, follow_redirects=False)
    assert found.status_code == 303 and found.headers["location"] == f"/console/jobs/{job_id}"
    assert service.http.get("/console/jobs", params={"find": "job_nope"}).status_code == 404
    with service.session_factory() as session:
        batch = batches.create(session, tenant_id="default", input_url="s3://b/in.jsonl", output_url=None,
                               queue="documents", now=utcnow())
    listing = service.http.get("/console/jobs", params={"batch": batch.id}).text
    assert job_id not in listing and "No jobs." in listing  # not a line of that batch


def test_jobs_are_filtered_by_model_time_and_metadata(make_service: Callable[..., Service]) -> None:
    service = make_service(console_enabled=True, auth_enabled=False)
    tagged = service.http.post("/v1/jobs", json={"prompt": "a", "max_tokens": 2, "metadata": {"doc": "42"}})
    other = service.http.post("/v1/jobs", json={"prompt": "b", "max_tokens": 2, "metadata": {"doc": "7"}})
    tagged_id, other_id = tagged.json()["id"], other.json()["id"]
    by_meta = service.http.get("/console/jobs", params={"meta": "doc=42", "hours": "", "status": ""}).text
    assert tagged_id in by_meta and other_id not in by_meta
    model = service.settings.default_model_id()
    recent = service.http.get("/console/jobs", params={"hours": "1", "model": model})
    assert tagged_id in recent.text and other_id in recent.text
    for bad in ({"hours": "-3"}, {"hours": "soon"}, {"meta": "no-equals"}, {"model": "nope"}):
        assert service.http.get("/console/jobs", params=bad).status_code == 422, bad
