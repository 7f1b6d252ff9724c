"""Factories for the API tests: an app on the parametrised database (SQLite and Postgres) with a
recording publisher, clients with API keys, and direct store sessions to play the worker's part."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from api.dispatch import RecordingPublisher
from api.settings import Settings
from api.store import keys
from api.store.db import make_engine, make_session_factory
from api.store.models import utcnow
from api.tokens import PromptTokenizer


@pytest.fixture(scope="session")
def prompt_tokenizer(demo_model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(demo_model_dir)


@pytest.fixture
def session_factory(database_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def session(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    with session_factory() as s:
        yield s


@dataclass
class Service:
    """One running app under test."""

    settings: Settings
    publisher: RecordingPublisher
    http: TestClient  # no credentials
    session_factory: sessionmaker[Session]

    def client(self, tenant: str) -> TestClient:
        """A client whose requests carry a fresh API key of `tenant`."""
        with self.session_factory() as s:
            _, key = keys.create_key(s, tenant, utcnow())
        return self.client_with_key(key)

    def client_with_key(self, key: str) -> TestClient:
        c = TestClient(self.http.app)
        c.headers["Authorization"] = f"Bearer {key}"
        return c


@pytest.fixture
def make_service(
    database_url: str, make_settings: Callable[..., Settings], prompt_tokenizer: PromptTokenizer,
    session_factory: sessionmaker[Session],
) -> Iterator[Callable[..., Service]]:
    clients: list[TestClient] = []

    def make(publisher: RecordingPublisher | None = None, **overrides: Any) -> Service:
        settings = make_settings(database_url=database_url, **overrides)
        publisher = publisher or RecordingPublisher()
        app = create_app(settings, publisher=publisher, tokenizer=prompt_tokenizer)
        http = TestClient(app)
        http.__enter__()
        clients.append(http)
        return Service(settings, publisher, http, session_factory)

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def service(make_service: Callable[..., Service]) -> Service:
    return make_service()


@pytest.fixture
def alice(service: Service) -> TestClient:
    return service.client("alice")


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]  # type: ignore[no-any-return]
