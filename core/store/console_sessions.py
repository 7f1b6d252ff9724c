"""The operator console's sessions (table console_sessions), kept in the store so that every API process
knows them: signing out ends a session at once, everywhere, and the CSRF token of its forms is derived from
it (api/console/viewer.py).

A session is known by a random secret, the value of the browser's cookie; the store keeps only its SHA-256
(the row's id), so a copy of the store opens no session. Expired rows are deleted as new sessions open.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session

from conveyor.core.store.tables import ConsoleSession

SESSION_S = 12 * 3600  # a session lasts this long


def open_session(session: Session, key_id: str | None, now: datetime) -> str:
    """A new session of the API key `key_id` (None: with auth off, nobody's), committed; its secret."""
    secret = secrets.token_urlsafe(32)
    session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at <= now))
    session.add(ConsoleSession(id=session_id(secret), key_id=key_id, created_at=now,
                               expires_at=now + timedelta(seconds=SESSION_S)))
    session.commit()
    return secret


def find(session: Session, secret: str, now: datetime) -> ConsoleSession | None:
    """The session whose secret this is, unless it ended or expired."""
    row = session.get(ConsoleSession, session_id(secret))
    return row if row is not None and row.expires_at > now else None


def end(session: Session, secret: str) -> None:
    """The session ends (signed out): its secret opens nothing any more. Committed."""
    session.execute(delete(ConsoleSession).where(ConsoleSession.id == session_id(secret)))
    session.commit()


def session_id(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
