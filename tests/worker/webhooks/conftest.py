"""Fixtures for the webhook tests: the loopback receiver, an allowlisted delivery client, a fresh secret, and
the service (app, store, sender) for the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.settings import Settings
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.webhooks.ssrf import SsrfPolicy
from conveyor.worker.webhooks.pinned import webhook_client
from conveyor.worker.webhooks.sender import WebhookSender
from tests.support.webhook_receiver import Receiver
from tests.support.webhook_service import WEBHOOK_TABLES, NullPublisher, WebhookService


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def loopback_client() -> Iterator[httpx.Client]:
    """A delivery client whose operator allowlist permits the loopback receiver."""
    with webhook_client(SsrfPolicy(allow=("127.0.0.1",))) as client:
        yield client


@pytest.fixture
def webhook_service(database_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
                    receiver: Receiver) -> Iterator[WebhookService]:
    """The app on SQLite or Postgres with the loopback receiver allowlisted; webhook tables emptied."""
    from conveyor.api.app import create_app
    from conveyor.api.prompt_tokenizer import PromptTokenizer

    settings = make_settings(database_url=database_url, webhook_allowlist=["127.0.0.1"])
    db_engine = make_db_engine(database_url)
    sessions = make_session_factory(db_engine)
    _empty_webhook_tables(sessions)
    app = create_app(settings, publisher=NullPublisher(), tokenizer=PromptTokenizer(demo_model_dir),
                     session_factory=sessions)
    sender = WebhookSender(sessions, settings)
    try:
        yield WebhookService(settings, app, sessions, sender)
    finally:
        sender.stop()
        _empty_webhook_tables(sessions)
        db_engine.dispose()


def _empty_webhook_tables(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        for table in WEBHOOK_TABLES:
            session.execute(text(f"DELETE FROM {table}"))
        session.commit()
