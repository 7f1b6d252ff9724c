"""Tenants and API keys. A key is shown once at creation; only its sha256 and a display prefix are stored.

A revocation is announced to every API process with its commit (core/store/auth_notices.py), so that none
goes on answering the key from its cache (core/store/auth_cache.py)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from conveyor.core.store import auth_notices
from conveyor.core.store.tables import ApiKey, Tenant

KEY_PREFIX = "cvk_"
DISPLAY_PREFIX_CHARS = 12


def hash_key(key: str) -> str:
    # A plain sha256 suffices: keys carry 256 random bits, so there is nothing to brute-force.
    return hashlib.sha256(key.encode()).hexdigest()


def ensure_tenant(session: Session, tenant_id: str, now: datetime) -> Tenant:
    if not tenant_id or len(tenant_id) > 64:
        raise ValueError(f"tenant: must be 1 to 64 characters, got {tenant_id!r}")
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        tenant = Tenant(id=tenant_id, created_at=now)
        session.add(tenant)
        session.flush()
    return tenant


def create_key(session: Session, tenant_id: str, now: datetime, *, admin: bool = False) -> tuple[ApiKey, str]:
    """Creates the tenant if needed and a new key for it; returns the row and the plaintext key. An admin
    key acts as its tenant everywhere, and also sees totals across tenants (GET /v1/queues)."""
    ensure_tenant(session, tenant_id, now)
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(id="key_" + secrets.token_hex(8), tenant_id=tenant_id,
                 prefix=plaintext[:DISPLAY_PREFIX_CHARS], key_hash=hash_key(plaintext), created_at=now,
                 is_admin=admin)
    session.add(row)
    session.commit()
    return row, plaintext


@dataclass(frozen=True)
class KeyGrant:
    """What an active key lets its bearer be."""

    tenant: str
    admin: bool  # also sees totals across tenants


def revoke_key(session: Session, key_id: str, now: datetime) -> bool:
    """Revokes an active key and commits; False when there is no such active key."""
    statement = (update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
                 .values(revoked_at=now).returning(ApiKey.key_hash))
    key_hash = session.execute(statement).scalar_one_or_none()
    if key_hash is not None:
        auth_notices.send(session, auth_notices.key_revoked(key_hash))
    session.commit()
    return key_hash is not None


def list_keys(session: Session) -> list[ApiKey]:
    return list(session.execute(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)).scalars())


def tenant_for_key(session: Session, plaintext: str) -> str | None:
    """The tenant of an active key, or None for unknown and revoked keys."""
    grant = grant_of_hash(session, hash_key(plaintext))
    return grant.tenant if grant is not None else None


def grant_of_hash(session: Session, key_hash: str) -> KeyGrant | None:
    """The grant of the active key of this hash (hash_key), or None for unknown and revoked keys."""
    query = select(ApiKey.tenant_id, ApiKey.is_admin).where(ApiKey.key_hash == key_hash,
                                                             ApiKey.revoked_at.is_(None))
    row = session.execute(query).first()
    return KeyGrant(row.tenant_id, bool(row.is_admin)) if row is not None else None


def is_admin_key(session: Session, plaintext: str) -> bool:
    """Whether an active key is an admin key (False for unknown and revoked keys)."""
    grant = grant_of_hash(session, hash_key(plaintext))
    return grant is not None and grant.admin
