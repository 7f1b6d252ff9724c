"""What a constrained request asks for: exactly one of a JSON Schema, any JSON object, a regex or a choice.

Plain data, no grammar library: SamplingParams validates it, conveyor.engine.structured_output.grammar
compiles it. `cache_key` is canonical JSON, so the same schema written with other key order or spacing
compiles once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Canonical JSON of one request's constraint; real response schemas are a few KiB. Size alone does not bound
# the compile (a 29 KB schema can take seconds): the compile limits in EngineConfig do.
MAX_STRUCTURED_BYTES = 64 * 1024
MAX_CHOICES = 1024
KINDS = ("json_schema", "json_object", "regex", "choice")


class GrammarLimitError(ValueError):
    """A constraint that did not compile within the engine's time or memory limit: the request's fault (its
    schema is too costly), so a ValueError, told to the caller as an invalid request."""


@dataclass(frozen=True)
class StructuredOutput:
    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._is_set(k))

    @property
    def cache_key(self) -> str:
        """Canonical JSON of (kind, value): equal constraints share one compiled grammar."""
        return json.dumps([self.kind, self._value()], sort_keys=True, separators=(",", ":"))

    def schema_dict(self) -> dict[str, Any]:
        """The JSON Schema as a dict (a str schema is parsed); only for kind json_schema."""
        schema = self.json_schema
        parsed = json.loads(schema) if isinstance(schema, str) else schema
        assert isinstance(parsed, dict), "validate() checked it"
        return parsed

    def validate(self) -> None:
        """Raises ValueError naming the field (structured.<kind>)."""
        chosen = [k for k in KINDS if self._is_set(k)]
        if len(chosen) != 1:
            raise ValueError(f"structured must set exactly one of {', '.join(KINDS)}, got {chosen or 'none'}")
        getattr(self, f"_validate_{chosen[0]}")()
        size = len(self.cache_key.encode())
        if size > MAX_STRUCTURED_BYTES:
            raise ValueError(
                f"structured.{chosen[0]} must be at most {MAX_STRUCTURED_BYTES} bytes of canonical JSON, "
                f"got {size}"
            )

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is not None and value is not False

    def _value(self) -> object:
        return self.schema_dict() if self.kind == "json_schema" else getattr(self, self.kind)

    def _validate_json_schema(self) -> None:
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured.json_schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise ValueError(f"structured.json_schema must be a JSON object, got {type(schema).__name__}")

    def _validate_json_object(self) -> None:
        if self.json_object is not True:
            raise ValueError(f"structured.json_object must be True or False, got {self.json_object!r}")

    def _validate_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise ValueError(f"structured.regex must be a non-empty string, got {self.regex!r}")

    def _validate_choice(self) -> None:
        choice = self.choice
        ok = isinstance(choice, list) and 0 < len(choice) <= MAX_CHOICES
        if not ok or not all(isinstance(c, str) and c for c in choice or []):
            raise ValueError(
                f"structured.choice must be a list of 1 to {MAX_CHOICES} non-empty strings, got {choice!r}"
            )
