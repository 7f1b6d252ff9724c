"""A job's parameters, typed once: what every door's job stores in the jobs table's `params` column (JSON),
and what the worker reads back to build the engine's request.

Fields: every field of the engine's SamplingParams under the engine's own name (`structured` as the stored
form its StructuredOutput is built from), and the keys a job stores beside them (NON_SAMPLING_FIELDS): its
choices `n`, its LoRA adapter (core/model_adapters.py LORA_PARAM), and an embedding job's
`encoding_format`, `dimensions` and `truncate`. The bounds are the request fields'
(core/protocol/request_fields.py), which mirror the engine's. tests/core/test_job_params.py holds the
sampling fields to SamplingParams' and the worker's one mapping (worker/sampling.py) to every field.

The stored JSON's schema is this model's (`JobParams.model_json_schema()`). A row holds only the keys its
writer set (`stored()`: exclude_unset), so each writer's shape is kept key for key; an unset field reads as
its default, the engine's.

Reading old rows: there is no version key, so every shape an earlier release wrote must still validate. A
field may be added (optional, defaulting to what a row without it always meant), and a bound may widen; no
field is renamed, removed or narrowed. Keys this release does not know (a newer writer's, during a rolling
upgrade) are ignored on read: the job runs as this release runs it, as core/protocol/chat_options.py reads
the `chat` column.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conveyor.core.protocol.field_errors import validation_message
from conveyor.core.protocol.request_fields import (
    ChoiceCount,
    Dimensions,
    EncodingFormat,
    Logprobs,
    MinP,
    MinTokens,
    NonEmptyText,
    OpenAIPenalty,
    OutputTokens,
    RepetitionPenalty,
    Seed,
    Stop,
    StopTokenIds,
    StrictFlag,
    Temperature,
    TopK,
    TopP,
)

DEFAULT_MAX_TOKENS = 16  # the engine's default (engine/sampling_params.py), for a job that sets none


class StoredStructured(BaseModel):
    """The engine's StructuredOutput as a job stores it: one kind set ({"json_schema": {...}},
    {"json_object": true}, {"regex": "..."} or {"choice": [...]}), judged by core/protocol/structured_rules.py
    at the doors and by the engine at the worker."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_schema: dict[str, Any] | str | None = None
    json_object: StrictFlag = False
    regex: str | None = None
    choice: list[str] | None = None


class JobParams(BaseModel):
    """A job's parameters; the sampling fields default to the engine's defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: OutputTokens = DEFAULT_MAX_TOKENS
    min_tokens: MinTokens = 0
    temperature: Temperature = 1.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    min_p: MinP = 0.0
    seed: Seed | None = None
    stop: Stop | None = None  # a string is stored as sent (a batch line's), a list as the job API stores it
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: StrictFlag = False
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: OpenAIPenalty = 0.0
    frequency_penalty: OpenAIPenalty = 0.0
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    structured: StoredStructured | None = None
    skip_special_tokens: StrictFlag = True
    include_stop_str_in_output: StrictFlag = False
    speculate: StrictFlag = True  # False: no drafts for this job, where its model speculates
    # Not the engine's sampling: each choice is a request of its own (worker/choices.py), the adapter is the
    # engine request's, and an embedding job's fields make its PoolingParams and the answer's format.
    n: ChoiceCount = 1
    lora: NonEmptyText | None = None
    encoding_format: EncodingFormat | None = None
    dimensions: Dimensions | None = None
    truncate: StrictFlag = False

    @classmethod
    def written(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The stored form of what a writer built: pydantic's ValidationError (a ValueError) names a misspelt
        key or a value of the wrong type, at the writer rather than in the worker."""
        return cls.model_validate(values).stored()

    @classmethod
    def from_stored(cls, stored: dict[str, Any] | None) -> JobParams:
        """A row's params read back (None: a row without any); unknown keys are ignored (see above).
        ValueError "<field>: <reason>" for a value no writer stores."""
        known = {name: value for name, value in (stored or {}).items() if name in cls.model_fields}
        try:
            return cls.model_validate(known)
        except ValidationError as exc:
            raise ValueError(validation_message(exc.errors())[1]) from None

    def stored(self) -> dict[str, Any]:
        """The JSON the row holds: the fields its writer set, and only those."""
        return self.model_dump(mode="json", exclude_unset=True)

    def stop_strings(self) -> list[str]:
        """`stop` as a list, whichever form it was stored in."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


NON_SAMPLING_FIELDS = frozenset({"n", "lora", "encoding_format", "dimensions", "truncate"})
SAMPLING_FIELDS = frozenset(JobParams.model_fields) - NON_SAMPLING_FIELDS  # SamplingParams' fields
