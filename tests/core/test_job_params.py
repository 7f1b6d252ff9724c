"""JobParams (core/protocol/job_params.py), the one typed model of a job's params: held field for field to
the engine's SamplingParams, StructuredOutput and PoolingParams, each field carried by the worker's one
mapping (worker/sampling.py), and the rows the previous release wrote read back as they ran then."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.api.schemas.jobs import JobCreate
from conveyor.core.model_adapters import LORA_PARAM, with_lora
from conveyor.core.protocol.chat_options import job_params as chat_job_params
from conveyor.core.protocol.embedding_request import EmbeddingCreate
from conveyor.core.protocol.job_params import (
    DEFAULT_MAX_TOKENS,
    NON_SAMPLING_FIELDS,
    SAMPLING_FIELDS,
    JobParams,
    StoredStructured,
)
from conveyor.core.protocol.openai_request import CHAT, ChatCompletionCreate, parse_body
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured_output.constraint import StructuredOutput
from conveyor.worker.batches.lines import BatchRequest, CustomIdSet, LineLimits, parse_line
from conveyor.worker.engine_requests import pooling_params_from_json
from conveyor.worker.sampling import sampling_params_from_json

ENGINE_FIELDS = sorted(field.name for field in dataclasses.fields(SamplingParams))
# For every SamplingParams field: a value other than the engine's default, as a job stores it and as the
# engine then holds it.
NON_DEFAULT: dict[str, tuple[Any, Any]] = {
    "max_tokens": (7, 7),
    "min_tokens": (2, 2),
    "temperature": (0.5, 0.5),
    "top_k": (5, 5),
    "top_p": (0.5, 0.5),
    "min_p": (0.1, 0.1),
    "seed": (42, 42),
    "stop": ("END", ["END"]),  # a batch line stores a string as sent
    "stop_token_ids": ([2], [2]),
    "ignore_eos": (True, True),
    "repetition_penalty": (1.2, 1.2),
    "presence_penalty": (0.5, 0.5),
    "frequency_penalty": (-0.5, -0.5),
    "logprobs": (3, 3),
    "prompt_logprobs": (2, 2),
    "structured": ({"regex": "[0-9]+"}, StructuredOutput(regex="[0-9]+")),
    "skip_special_tokens": (False, False),
    "include_stop_str_in_output": (True, True),
    "speculate": (False, False),
}
SCHEMA = {"type": "object"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CALL_SCHEMA = {"type": "array", "minItems": 1, "items": {"anyOf": [{
    "type": "object", "required": ["name", "arguments"], "additionalProperties": False,
    "properties": {"name": {"const": "get_weather"}, "arguments": TOOLS[0]["function"]["parameters"]}}]}}
# What the previous release's writers stored (each writer's output, recorded from that release), and the
# engine's parameters it ran them with.
PLAIN_JOB = {"max_tokens": 8, "min_tokens": 0, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
             "seed": None, "stop": [], "stop_token_ids": [], "ignore_eos": False, "repetition_penalty": 1.0,
             "logprobs": None}
PREVIOUS_ROWS: dict[str, tuple[dict[str, Any], SamplingParams]] = {
    "POST /v1/jobs": (PLAIN_JOB, SamplingParams(max_tokens=8, temperature=0.0)),
    "POST /v1/jobs, every newer field": (
        {"n": 2, "max_tokens": 64, "min_tokens": 0, "temperature": 0.7, "top_p": 0.9, "top_k": 0,
         "min_p": 0.0, "seed": 7, "stop": ["END"], "stop_token_ids": [], "ignore_eos": False,
         "include_stop_str_in_output": True, "repetition_penalty": 1.0, "presence_penalty": 0.5,
         "logprobs": 2, "prompt_logprobs": 1, "structured": {"json_schema": SCHEMA}},
        SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=7, stop=["END"], presence_penalty=0.5,
                       logprobs=2, prompt_logprobs=1, structured=StructuredOutput(json_schema=SCHEMA),
                       include_stop_str_in_output=True)),
    "OpenAI chat, tool_choice required": (
        {**PLAIN_JOB, "max_tokens": 50, "structured": {"json_schema": TOOL_CALL_SCHEMA}},
        SamplingParams(max_tokens=50, temperature=0.0,
                       structured=StructuredOutput(json_schema=TOOL_CALL_SCHEMA))),
    "OpenAI chat, tools read by the mistral parser": (
        {**PLAIN_JOB, "max_tokens": 50, "temperature": 1.0, "logprobs": 3, "skip_special_tokens": False},
        SamplingParams(max_tokens=50, logprobs=3, skip_special_tokens=False)),
    "batch line for an adapter": (
        {"temperature": 0.0, "stop": "\n", "logprobs": 2, "structured": {"json_object": True},
         "max_tokens": 12, LORA_PARAM: "sql-lora"},
        SamplingParams(max_tokens=12, temperature=0.0, stop=["\n"], logprobs=2,
                       structured=StructuredOutput(json_object=True))),
}
EMBEDDING_ROW = {"max_tokens": 0, "dimensions": 8, "encoding_format": "base64", "truncate": True}


def test_the_sampling_fields_are_the_engines_and_the_others_are_named() -> None:
    assert set(ENGINE_FIELDS) == SAMPLING_FIELDS
    assert {"n", LORA_PARAM, "encoding_format", "dimensions", "truncate"} == NON_SAMPLING_FIELDS
    assert set(JobParams.model_fields) == SAMPLING_FIELDS | NON_SAMPLING_FIELDS


def test_the_stored_structured_form_and_the_pooling_fields_are_the_engines() -> None:
    structured = {field.name for field in dataclasses.fields(StructuredOutput)}
    assert set(StoredStructured.model_fields) == structured
    pooling = {field.name for field in dataclasses.fields(PoolingParams)}
    assert pooling - {"normalize"} <= NON_SAMPLING_FIELDS  # normalize: the model's own, never a job's


def test_an_unset_field_is_the_engines_default() -> None:
    assert JobParams().stored() == {}
    assert sampling_params_from_json({}) == SamplingParams()
    assert pooling_params_from_json({}) == PoolingParams()
    assert JobParams().max_tokens == DEFAULT_MAX_TOKENS == SamplingParams().max_tokens


@pytest.mark.parametrize("name", ENGINE_FIELDS)
def test_each_sampling_field_reaches_the_engine(name: str) -> None:
    assert name in NON_DEFAULT, f"give {name} a non-default value in NON_DEFAULT"
    stored, engine_value = NON_DEFAULT[name]
    assert engine_value != getattr(SamplingParams(), name)
    written = JobParams.written({name: stored})
    assert written == {name: stored}
    assert getattr(sampling_params_from_json(written), name) == engine_value


@pytest.mark.parametrize("form", [{"json_schema": SCHEMA}, {"json_schema": json.dumps(SCHEMA)},
                                  {"json_object": True}, {"regex": "[a-z]+"}, {"choice": ["yes", "no"]}])
def test_each_structured_kind_reaches_the_engine(form: dict[str, Any]) -> None:
    assert sampling_params_from_json({"structured": form}).structured == StructuredOutput(**form)


def test_an_embedding_jobs_fields_reach_the_engine() -> None:
    assert pooling_params_from_json(EMBEDDING_ROW) == PoolingParams(dimensions=8, truncate=True)


@pytest.mark.parametrize("shape", sorted(PREVIOUS_ROWS))
def test_a_row_of_the_previous_release_reads_back_and_runs_as_before(shape: str) -> None:
    row, engine = PREVIOUS_ROWS[shape]
    assert JobParams.from_stored(row).stored() == row
    assert sampling_params_from_json(row) == engine


def test_an_embedding_row_of_the_previous_release_reads_back_and_runs_as_before() -> None:
    assert JobParams.from_stored(EMBEDDING_ROW).stored() == EMBEDDING_ROW
    assert pooling_params_from_json(EMBEDDING_ROW) == PoolingParams(dimensions=8, truncate=True)


def test_the_writers_store_the_shapes_they_stored() -> None:
    plain = JobCreate.model_validate({"prompt": "Summarize the report.", "max_tokens": 8, "temperature": 0})
    assert plain.sampling_params() == PLAIN_JOB
    for shape, parser, body in [
        ("OpenAI chat, tool_choice required", "hermes", {"tool_choice": "required", "temperature": 0}),
        ("OpenAI chat, tools read by the mistral parser", "mistral", {"logprobs": True, "top_logprobs": 3}),
    ]:
        assert _openai_chat_job(body, parser) == PREVIOUS_ROWS[shape][0], shape
    embedding = EmbeddingCreate.model_validate({"input": ["a"], "dimensions": 8, "encoding_format": "base64",
                                                "truncate": True})
    assert embedding.job_params() == EMBEDDING_ROW
    line = {"custom_id": "q1", "url": CHAT, "body": {
        "model": "sql-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
        "temperature": 0, "stop": "\n", "logprobs": True, "top_logprobs": 2,
        "response_format": {"type": "json_object"}}}
    adapter = LineLimits(adapters=frozenset({"sql-lora"}))
    request = parse_line(1, json.dumps(line).encode(), CustomIdSet(), adapter)
    assert isinstance(request, BatchRequest)
    assert request.params == PREVIOUS_ROWS["batch line for an adapter"][0]


def test_speculate_is_stored_only_when_a_writer_turns_it_off() -> None:
    """Each door stores `speculate: false` as sent and leaves the default out (rows keep their shape); the
    worker maps it onto the engine's SamplingParams.speculate."""
    job = JobCreate.model_validate({"prompt": "Summarize.", "speculate": False}).sampling_params()
    assert job["speculate"] is False
    default = JobCreate.model_validate({"prompt": "Summarize.", "speculate": True}).sampling_params()
    assert "speculate" not in default
    chat = _openai_chat_job({"speculate": False}, "hermes")
    assert chat["speculate"] is False and sampling_params_from_json(chat).speculate is False
    line = {"custom_id": "q1", "url": CHAT, "body": {"messages": [{"role": "user", "content": "hi"}],
                                                     "speculate": False}}
    request = parse_line(1, json.dumps(line).encode(), CustomIdSet(), LineLimits())
    assert isinstance(request, BatchRequest) and request.params["speculate"] is False
    assert sampling_params_from_json(PLAIN_JOB).speculate is True, "a row without it speculates"
    with pytest.raises(ValidationError, match="speculate"):
        JobParams.written({"speculate": "no"})


def _openai_chat_job(sent: dict[str, Any], parser: str) -> dict[str, Any]:
    """The params the OpenAI chat route stores (api/routes/openai.py: the body as a JobCreate)."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body = parse_body(CHAT, {"messages": messages, "tools": TOOLS, "max_tokens": 50, **sent})
    assert isinstance(body, ChatCompletionCreate)
    job = JobCreate.model_validate({"messages": messages, "max_tokens": body.requested_max_tokens(),
                                    **body.job_params()})
    return chat_job_params(job.sampling_params(), job.chat_options(parser))  # type: ignore[arg-type]


def test_a_writer_cannot_store_a_misspelt_key_or_a_wrong_value() -> None:
    with pytest.raises(ValidationError, match="temprature"):
        JobParams.written({"temprature": 0.5})
    with pytest.raises(ValidationError, match="max_tokens"):
        JobParams.written({"max_tokens": "8"})
    with pytest.raises(ValidationError, match=LORA_PARAM):
        with_lora({"max_tokens": 1}, "")
    assert with_lora({"max_tokens": 1}, "sql-lora") == {"max_tokens": 1, LORA_PARAM: "sql-lora"}


def test_reading_ignores_a_newer_writers_keys_and_names_a_bad_value() -> None:
    assert JobParams.from_stored({"max_tokens": 4, "newer_field": 1}).stored() == {"max_tokens": 4}
    assert JobParams.from_stored(None) == JobParams()
    with pytest.raises(ValueError, match=r"^temperature: "):
        sampling_params_from_json({"temperature": "hot"})
    with pytest.raises(ValueError, match=r"^structured\.regex: "):
        sampling_params_from_json({"structured": {"regex": 5}})
    with pytest.raises(ValueError, match=r"^max_tokens must be"):  # the engine's own rule
        sampling_params_from_json({"max_tokens": 0})
    with pytest.raises(ValueError, match=r"^dimensions: "):
        pooling_params_from_json({"dimensions": 0})


def test_the_stored_json_schema_is_the_models() -> None:
    schema = JobParams.model_json_schema()
    assert set(schema["properties"]) == set(JobParams.model_fields)
    assert schema["additionalProperties"] is False  # written: a misspelt key is refused
    # The store reads these keys in SQL (core/store/token_usage.py, core/store/lora_adapters.py, the tally
    # triggers of migration 0016): they must stay the model's.
    assert {"max_tokens", "n", LORA_PARAM} <= set(JobParams.model_fields)
