"""Every table of the store, imported once so that `Base.metadata` is complete (Alembic, schema tests)."""

from __future__ import annotations

from api.store import models
from api.store.models import Base

__all__ = ["Base", "models"]
