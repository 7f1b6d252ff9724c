"""Every table of the store, imported once so that `Base.metadata` is complete (Alembic, schema tests)."""

from __future__ import annotations

from api.store import models
from api.store.batches import Batch as _batch_tables  # noqa: F401
from api.store.files import File as _file_tables  # noqa: F401
from api.store.models import Base
from api.store.webhook_models import Delivery as _webhook_tables  # noqa: F401

__all__ = ["Base", "models"]
