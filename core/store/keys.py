"""Tenants and API keys. A key is shown once at creation; only its sha256 and a display prefix are stored."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

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


def revoke_key(session: Session, key_id: str, now: datetime) -> bool:
    statement = update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)).values(revoked_at=now)
    applied: bool = session.execute(statement).rowcount == 1  # type: ignore[attr-defined]
    session.commit()
    return applied


def list_keys(session: Session) -> list[ApiKey]:
    return list(session.execute(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)).scalars())


def tenant_for_key(session: Session, plaintext: str) -> str | None:
    """The tenant of an active key, or None for unknown and revoked keys."""
    active = ApiKey.revoked_at.is_(None)
    query = select(ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(plaintext), active)
    return session.execute(query).scalar_one_or_none()


def is_admin_key(session: Session, plaintext: str) -> bool:
    """Whether an active key is an admin key (False for unknown and revoked keys)."""
    active = ApiKey.revoked_at.is_(None)
    query = select(ApiKey.is_admin).where(ApiKey.key_hash == hash_key(plaintext), active)
    return bool(session.execute(query).scalar_one_or_none())
