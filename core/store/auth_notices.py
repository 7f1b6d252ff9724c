"""Notices that an API key was revoked or a tenant's limits changed: what tells every API process to drop
its cached copy (core/store/auth_cache.py) at once, rather than when the copy expires.

Sent by the store functions that make the change (keys.revoke_key, tenants.set_overrides), inside their
transaction: on PostgreSQL a NOTIFY on CHANNEL, which the server delivers to every listening session when
the transaction commits, and never if it rolls back. So a process hears of a change exactly once it is
visible to its reads (core/store/auth_listener.py listens). On SQLite there is nobody to tell: the embedded
service is one process, and a change made from another (the CLI) reaches it when its cached copy expires
(`auth_cache_s`).

A notice's payload is `key:<sha256 of the key>` or `tenant:<tenant id>`; NOTIFY payloads are text of at
most 8000 bytes, and a tenant id is at most 64 characters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sqlalchemy import text
from sqlalchemy.orm import Session

CHANNEL = "conveyor_auth"
Kind = Literal["key", "tenant"]
_KINDS: dict[str, Kind] = {"key": "key", "tenant": "tenant"}
_NOTIFY = text("SELECT pg_notify(:channel, :payload)")


@dataclass(frozen=True)
class AuthNotice:
    kind: Kind
    subject: str  # a key's hash (keys.hash_key), or a tenant's id

    def encode(self) -> str:
        return f"{self.kind}:{self.subject}"


def decode(payload: str) -> AuthNotice | None:
    """The notice a payload holds; None for anything else (its reader then forgets everything)."""
    prefix, _, subject = payload.partition(":")
    kind = _KINDS.get(prefix)
    return AuthNotice(kind, subject) if kind is not None and subject else None


def key_revoked(key_hash: str) -> AuthNotice:
    return AuthNotice("key", key_hash)


def limits_changed(tenant_id: str) -> AuthNotice:
    return AuthNotice("tenant", tenant_id)


def send(session: Session, notice: AuthNotice) -> None:
    """Sends the notice with the session's transaction (delivered at its commit); nothing on SQLite."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(_NOTIFY, {"channel": CHANNEL, "payload": notice.encode()})
