"""The service's settings: one `Settings` (service.py), whose parts are the engine's settings a model may
set for itself (engine.py), the tenants' default limits (tenants.py), the model registry (registry.py) and the
queues' limits (queues.py). Imported from here."""

from conveyor.core.settings.engine import DEFAULT_MAX_LORAS, PER_MODEL_FIELDS, EngineSettings
from conveyor.core.settings.queues import QueueSettings, default_queues, renamed_queue_fields
from conveyor.core.settings.registry import AdapterSettings, ModelSettings, UnknownModelError
from conveyor.core.settings.service import (
    CONFIG_FILE_ENV,
    DEFAULT_MODEL,
    Settings,
    is_loopback,
    load_settings,
)
from conveyor.core.settings.tenants import TenantDefaults

__all__ = [
    "CONFIG_FILE_ENV", "DEFAULT_MAX_LORAS", "DEFAULT_MODEL", "PER_MODEL_FIELDS", "AdapterSettings",
    "EngineSettings", "ModelSettings", "QueueSettings", "Settings", "TenantDefaults", "UnknownModelError",
    "default_queues", "is_loopback", "load_settings", "renamed_queue_fields",
]
