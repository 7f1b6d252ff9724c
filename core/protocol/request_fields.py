"""Field types of the request schemas: text and JSON the store can hold (core/protocol/request_rules.py says
why), and the bounds of every sampling field, so a value a request may carry can neither fail the engine nor
the insert. Here in core, not in api/, because the batch line parser (worker/) validates OpenAI bodies with
the same pydantic models (core/protocol/openai_request.py) as the synchronous routes. Each refusal names the
field (422 on /v1/jobs, 400 on the OpenAI routes, a line error in a batch).

The sampling bounds mirror engine/sampling_params.py's exported constants: neither the API process nor core
may import the engine (import-linter), so they are repeated here, once, and
tests/api/test_input_bounds_http.py checks that both agree.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from conveyor.core.protocol.request_rules import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_PRIORITY,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TTL_S,
    json_problem,
    text_problem,
)

MAX_INT32 = 2**31 - 1  # max_tokens, min_tokens, top_k and token ids: the engine's tensors are int32/int64
MAX_TOP_K = MAX_INT32
MIN_SEED = -(2**63)  # torch.Generator takes 64 bits; the signed range keeps each seed a distinct stream
MAX_SEED = 2**63 - 1
MIN_TEMPERATURE = 1e-6  # below it (but above 0, greedy) float32 logits / temperature overflow
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
MIN_OPENAI_PENALTY = -2.0  # presence_penalty and frequency_penalty: OpenAI's range
MAX_OPENAI_PENALTY = 2.0


# Told to clients (and schema-driven fuzzers) in the schema; enforced, with a clearer message, by
# _storable_text. Lone surrogates cannot be excluded by an ECMA-262 pattern without refusing every character
# outside the BMP, so only the validator refuses them.
NO_NUL_PATTERN = "^[^\\u0000]*$"


def _storable_text(value: object) -> object:
    if isinstance(value, str):
        problem = text_problem(value)
        if problem is not None:
            raise PydanticCustomError("invalid_text", problem)
    return value


def _storable_json(value: dict[str, Any]) -> dict[str, Any]:
    problem = json_problem(value)
    if problem is not None:
        raise PydanticCustomError("invalid_json_value", problem)
    return value


def _temperature(value: float) -> float:
    if 0.0 < value < MIN_TEMPERATURE:
        raise PydanticCustomError("temperature_range", f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    return value


class StorableText:
    """Annotated marker for text we store: `Annotated[str, Field(max_length=...), STORABLE]`. Put length
    constraints before it, so pydantic keeps them on the str (with its usual messages)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        # Checked before str validation: pydantic's own length checks fail on lone surrogates vaguely.
        return core_schema.no_info_before_validator_function(_storable_text, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema.setdefault("pattern", NO_NUL_PATTERN)  # a stricter pattern of the field wins
        return json_schema


STORABLE = StorableText()
StoredText = Annotated[str, STORABLE]
NonEmptyText = Annotated[str, Field(min_length=1), STORABLE]
StoredJsonObject = Annotated[dict[str, Any], AfterValidator(_storable_json)]

# Numbers and booleans are strict: JSON's 5 is an integer, but "5", true and 5.0 are refused rather than
# coerced (a float field takes 5 as 5.0), so a client's mistake is told, not guessed at.
TokenCount = Annotated[int, Field(strict=True, ge=1, le=MAX_INT32)]
# max_tokens may be 0 for a request that only scores its prompt (prompt_logprobs, or echo with logprobs).
OutputTokens = Annotated[int, Field(strict=True, ge=0, le=MAX_INT32,
                                    description="0 only to score the prompt (prompt_logprobs)")]
MinTokens = Annotated[int, Field(strict=True, ge=0, le=MAX_INT32)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_INT32)]
TopK = Annotated[int, Field(strict=True, ge=-1, le=MAX_TOP_K, description="0 or -1 = off")]
Seed = Annotated[int, Field(strict=True, ge=MIN_SEED, le=MAX_SEED)]
Logprobs = Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]  # alternatives per token
Count = Annotated[int, Field(strict=True, ge=1, le=MAX_INT32)]  # OpenAI's best_of (only 1 is served)
Priority = Annotated[int, Field(strict=True, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
                                description="lower is served first (vLLM's meaning); default 0")]
DeadlineSeconds = Annotated[float, Field(
    strict=True, gt=0, le=MAX_TTL_S, allow_inf_nan=False,
    description="seconds after submission by which the result is wanted: a soft target the schedulers order "
    "by (a late job still runs)")]
OnDeadlineMiss = Annotated[Literal["accept", "reject"], Field(
    description="reject: refuse the job (429 deadline_unattainable, with Retry-After) when its predicted "
    "finish is past its deadline; accept (the default): take it and show the prediction")]
ChoiceCount = Annotated[int, Field(strict=True, ge=1, le=MAX_N, description="choices from the one prompt")]
# An embedding's components kept (Matryoshka); the engine holds it to the model's size.
Dimensions = Annotated[int, Field(strict=True, ge=1, le=MAX_INT32)]
EncodingFormat = Literal["float", "base64"]
StrictFlag = Annotated[bool, Field(strict=True)]
_GREEDY_OR_WARM = Field(json_schema_extra={"anyOf": [{"const": 0}, {"minimum": MIN_TEMPERATURE}]},
                        description="0 = greedy")
Temperature = Annotated[
    float, Field(strict=True, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False), AfterValidator(_temperature),
    _GREEDY_OR_WARM,
]
OPENAI_MAX_TEMPERATURE = 2.0  # OpenAI's own range
OpenAITemperature = Annotated[
    float, Field(strict=True, ge=0.0, le=OPENAI_MAX_TEMPERATURE, allow_inf_nan=False),
    AfterValidator(_temperature), _GREEDY_OR_WARM,
]
ANTHROPIC_MAX_TEMPERATURE = 1.0  # Anthropic's range (its Messages API)
AnthropicTemperature = Annotated[
    float, Field(strict=True, ge=0.0, le=ANTHROPIC_MAX_TEMPERATURE, allow_inf_nan=False),
    AfterValidator(_temperature), _GREEDY_OR_WARM,
]
TopP = Annotated[float, Field(strict=True, gt=0.0, le=1.0, allow_inf_nan=False)]
MinP = Annotated[float, Field(strict=True, ge=0.0, le=1.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[
    float, Field(strict=True, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
]
OpenAIPenalty = Annotated[
    float, Field(strict=True, ge=MIN_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY, allow_inf_nan=False)
]
StopStrings = Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)]
Stop = NonEmptyText | StopStrings
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
# The chat roles any request may use; core/protocol/openai_request.py says which of them a chat template must
# name. Storable first: a role that is not text (a lone surrogate) is told so, not "should be 'system'...".
ChatRole = Annotated[Literal["system", "developer", "user", "assistant", "tool"], STORABLE]
