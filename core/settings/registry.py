"""The model registry: the served models (`[models.ID]`), each with its folder, its engine settings where
they differ from the deployment's, its queue limits and its LoRA adapters."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from conveyor.core.lanes import LANE_MAX_CHARS, LANE_SEPARATOR
from conveyor.core.settings.engine import PER_MODEL_FIELDS, EngineSettings
from conveyor.core.settings.queues import QueueSettings, renamed_queue_fields


class UnknownModelError(LookupError):
    """A request named a model this deployment does not serve; the message names it and the served ones."""


class AdapterSettings(BaseModel):
    """A LoRA adapter of a registry model (`[models.ID.adapters]`): served under its own id as `model`."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="a PEFT adapter folder, or s3://bucket/prefix/ holding one "
                      "(downloaded by each worker of the base model when it starts)")
    tenants: list[str] | None = Field(
        None, description="the tenants that may use it; unset = every tenant. To others it does not exist "
        "(404 model_not_found), as an unknown model")


class ModelSettings(BaseModel):
    """One served model of the registry (`[models.ID]`): its folder, and where it differs from the
    deployment, its engine settings (any of PER_MODEL_FIELDS) and queue limits (partial, as `queues`)."""

    model_config = ConfigDict(extra="allow")

    path: str = Field(min_length=1, description="this model: a local Hugging Face folder, a GGUF file, a hub "
                      "id (owner/name), package:DIST or preset:NAME (see [Model sources](../guides/"
                      "model-sources.md))")
    queues: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="this model's queue limits where they differ from `queues`")
    adapters: dict[str, AdapterSettings] = Field(
        default_factory=dict, description="LoRA adapters served on this model, by id (`support = "
        "\"/adapters/support\"`, or a table with `path` and `tenants`)")

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapter_paths(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        return {name: {"path": spec} if isinstance(spec, str) else spec for name, spec in value.items()}

    @model_validator(mode="after")
    def _known_overrides(self) -> ModelSettings:
        for name, value in (self.model_extra or {}).items():
            if name not in PER_MODEL_FIELDS:
                raise ValueError(f"{name}: not a per-model setting; a model may set path, queues and "
                                 f"{', '.join(PER_MODEL_FIELDS)}")
            info = EngineSettings.model_fields[name]
            try:
                checked = TypeAdapter(Annotated[info.annotation, info]).validate_python(value)
            except ValidationError as exc:
                raise ValueError(f"{name}: {exc.errors()[0]['msg']}") from None
            (self.model_extra or {})[name] = checked
        for name, given in self.queues.items():
            try:
                QueueSettings(**renamed_queue_fields(given))  # each field as `queues` checks it
            except ValidationError as exc:
                error = exc.errors()[0]
                where = ".".join(map(str, error["loc"]))
                raise ValueError(f"queues.{name}.{where}: {error['msg']}") from None
        return self

    def overrides(self) -> dict[str, Any]:
        """The per-model settings given, by name."""
        return dict(self.model_extra or {})


def check_lane(model_id: str, queue: str) -> None:
    """A model's queue makes a lane (core/lanes.py): its name may not hold the separator, and the lane must
    fit the store's queue columns."""
    if LANE_SEPARATOR in queue:
        raise ValueError(f"queues: a queue's name may not hold {LANE_SEPARATOR!r}, got {queue!r}")
    length = len(model_id) + len(LANE_SEPARATOR) + len(queue)
    if length > LANE_MAX_CHARS:
        raise ValueError(f"models: the model {model_id!r} and queue {queue!r} make a name of {length} "
                         f"characters, beyond {LANE_MAX_CHARS}: shorten the model's id or the queue's name")
