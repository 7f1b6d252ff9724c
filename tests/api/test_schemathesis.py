"""Fuzzes the API against its own OpenAPI schema with schemathesis, in-process over ASGI, configured as it is
deployed off-loopback: authentication on with one tenant's key, /metrics behind its token, docs off.

Reproducible: a fixed seed and derandomized Hypothesis, no example database, so a run in CI generates the same
cases as a run here. Each operation gets its schema examples, the coverage cases (boundary values, missing
fields, undeclared methods) and MAX_EXAMPLES fuzzed cases, positive and negative.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis import Case
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Receive, Scope, Send

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.api.routes.scaling import SCALING_PATH
from conveyor.cli.reference.http_page import openapi_document
from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import jobs, keys, workers
from conveyor.core.store.database import make_db_engine, make_session_factory

SEED = 20261130
MAX_EXAMPLES = 25
METRICS_TOKEN = "metrics-token-for-the-fuzzer"
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    # Undeclared methods answer 405 with `Allow`; OPTIONS lists exactly the documented methods.
    "unsupported_method",
    "allow_header_conformance",
    # Operations that declare the bearer scheme must refuse requests without it or with a wrong key.
    "ignored_auth",
)


class InstantWorker:
    """A publisher that runs each job to success the moment it is published, so the synchronous OpenAI
    routes (which wait for their job) answer instead of waiting for a worker that never comes."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory

    def publish(self, job_id: str, queue: str) -> None:
        with self._session_factory() as session:
            job = jobs.claim(session, job_id, "fuzz-worker", utcnow())
            if job is None:
                return
            jobs.complete(session, job_id, job.attempts, result_text="ok", finish_reason="stop",
                          prompt_tokens=1, completion_tokens=1, preemptions=0, first_token_at=None,
                          now=utcnow())

    def depth(self, queue: str) -> int:
        return 0

    def ping(self) -> bool:
        return True


def served_schema() -> dict[str, Any]:
    """The document /openapi.json would serve (that route is off with auth on), as the documentation's HTTP
    reference renders it: it depends on the routes and models only, so an app built on placeholders yields it
    at import time, when schemathesis' pytest integration needs it; test_the_fuzzed_schema_is_the_apps checks
    it against the app under test.

    (schemathesis.pytest.from_fixture, which would load it from a fixture, fails on pytest 9.2: it writes
    the removed `Node._nodeid`.)"""
    return openapi_document()


class AppUnderTest:
    """The ASGI app the schema sends every request to (probes of checks included): it forwards to the app
    the running test built, since schemathesis binds an app when the schema loads, before any fixture."""

    def __init__(self) -> None:
        self.app: FastAPI | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.app is not None, "no app under test: use the `target` fixture"
        await self.app(scope, receive, send)


APP_UNDER_TEST = AppUnderTest()
schema = schemathesis.openapi.from_dict(served_schema(), config=schemathesis.Config.from_dict({
    "seed": SEED,
    "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
    # No exception for /readyz: it is ready with no worker alive, so a 503 would be a fault. Nor for /health:
    # the target registers the worker that InstantWorker plays, so it can take work and /health is 200.
    "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
}))
schema.app = APP_UNDER_TEST


@dataclass
class Target:
    """The app under test and the credentials each operation is called with."""

    app: FastAPI
    api_key: str

    def headers(self, case: Case) -> dict[str, str]:
        # /metrics and /v1/scaling are cluster-wide: they take the metrics token, never a tenant's key.
        secret = METRICS_TOKEN if case.operation.path in ("/metrics", SCALING_PATH) else self.api_key
        # A loopback name: the app answers no other Host by default (schemathesis sends `testserver`).
        return {"Authorization": f"Bearer {secret}", "Host": "localhost"}


@pytest.fixture
def target(
    make_settings: Callable[..., Settings], migrated_sqlite_url: str, prompt_tokenizer: PromptTokenizer
) -> Iterator[Target]:
    sqlite_url = migrated_sqlite_url
    db_engine = make_db_engine(sqlite_url)
    session_factory = make_session_factory(db_engine)
    settings = make_settings(database_url=sqlite_url, metrics_token=METRICS_TOKEN)
    app = create_app(settings, publisher=InstantWorker(session_factory), tokenizer=prompt_tokenizer,
                     session_factory=session_factory)
    with session_factory() as session:
        _, key = keys.create_key(session, "fuzz", utcnow())
        workers.register(session, "fuzz-worker", hostname="fuzz", pid=0, queues=list(settings.queues),
                         now=utcnow())
    APP_UNDER_TEST.app = app
    try:
        yield Target(app, key)
    finally:
        APP_UNDER_TEST.app = None
        db_engine.dispose()


def test_the_fuzzed_schema_is_the_apps(target: Target) -> None:
    assert schema.raw_schema == target.app.openapi()


@schema.parametrize()
# One app per operation, shared by its examples on purpose: a service sees requests one after another. 50
# examples per operation, not hypothesis' 100: the whole suite must run within CI's 15 minutes.
@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_api_conforms_to_its_schema(case: Case, target: Target) -> None:
    case.call_and_validate(headers=target.headers(case))
