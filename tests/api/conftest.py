"""Factories for the API tests: an app on the parametrised database (SQLite and Postgres) with a
recording publisher, clients with API keys, and direct store sessions to play the worker's part."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from api_support import RecordingPublisher, Service
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from api.prompt_tokenizer import PromptTokenizer
from core.settings import Settings
from core.store.database import make_db_engine, make_session_factory


@pytest.fixture(scope="session")
def prompt_tokenizer(demo_model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(demo_model_dir)


@pytest.fixture
def session_factory(database_url: str) -> Iterator[sessionmaker[Session]]:
    db_engine = make_db_engine(database_url)
    yield make_session_factory(db_engine)
    db_engine.dispose()


@pytest.fixture
def session(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    with session_factory() as s:
        yield s


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
