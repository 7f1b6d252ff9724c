"""Structured outputs end to end on the embedded server (demo model): the job API, the OpenAI SDK (plain and
streamed) and a batch file all return JSON that parses and validates against the schema."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
from test_openai_chat_sdk import MESSAGES, Server, embedded  # noqa: F401 (the module-scoped fixture)

from tests.support.live_server import wait_for

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2},
    },
    "required": ["color", "count", "ok", "name", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: dict[str, Any] = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


def _job(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {server.key}"}
    created = httpx.post(f"{server.url}/v1/jobs", json=body, headers=headers)
    assert created.status_code in (200, 201, 202), created.text
    job_id = created.json()["id"]
    r = httpx.get(f"{server.url}/v1/jobs/{job_id}", params={"wait": 60}, headers=headers, timeout=90)
    job = r.json()
    assert job["status"] == "succeeded", job
    return job


def test_jobs_api_schema_choice_regex(embedded: Server) -> None:  # noqa: F811
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
        job = _job(embedded, {"prompt": "The queue", "max_tokens": 120, "temperature": temperature,
                              "seed": seed, "response_format": RESPONSE_FORMAT})
        assert job["result"]["finish_reason"] == "stop", job
        jsonschema.validate(json.loads(job["result"]["text"]), SCHEMA)
    choice = _job(embedded, {"prompt": "Pick", "max_tokens": 10, "choice": ["alpha", "beta gamma"]})
    assert choice["result"]["text"] in ("alpha", "beta gamma")
    regex = _job(embedded, {"prompt": "Code", "max_tokens": 10, "regex": "[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex["result"]["text"])


def test_openai_sdk_plain_and_streamed(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    chat = client.chat.completions.create(model=embedded.model, messages=MESSAGES, max_tokens=120,
                                          temperature=0, response_format=RESPONSE_FORMAT)  # type: ignore[arg-type]
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), SCHEMA)
    stream = client.chat.completions.create(model=embedded.model, messages=MESSAGES, max_tokens=120,
                                            temperature=1.0, seed=5, stream=True,
                                            response_format=RESPONSE_FORMAT)  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    completion = client.completions.create(model=embedded.model, prompt="The queue", max_tokens=120,
                                           extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


def test_openai_bad_schema_is_a_400_naming_response_format(embedded: Server) -> None:  # noqa: F811
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    try:
        embedded.client().chat.completions.create(model=embedded.model, messages=MESSAGES,
                                                  response_format=bad)  # type: ignore[arg-type]
    except openai.BadRequestError as exc:
        assert exc.param == "response_format"
    else:
        raise AssertionError("a bad schema must be refused")


def test_batch_file_lines_follow_their_schema_and_a_bad_line_is_an_error(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    body = {"model": embedded.model, "messages": MESSAGES, "max_tokens": 120,
            "response_format": RESPONSE_FORMAT}
    bad = {**body, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body, "temperature": 1.0, "seed": i}} for i in range(3)]
    lines.insert(1, {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": bad})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("s.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")

    def closed() -> bool:
        return client.batches.retrieve(batch.id).status in ("completed", "failed", "cancelled", "expired")

    wait_for(closed, f"batch {batch.id} to close")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id and done.error_file_id, done
    results = [json.loads(r) for r in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == ["c0", "c1", "c2"]
    for r in results:
        jsonschema.validate(json.loads(r["response"]["body"]["choices"][0]["message"]["content"]), SCHEMA)
    errors = client.files.content(done.error_file_id).text
    assert "bad" in errors and "response_format" in errors


def test_vllm_structured_outputs_and_guided_fields_constrain_alike(embedded: Server) -> None:  # noqa: F811
    """vLLM's structured_outputs object and its older guided_* fields are the same constraints as
    response_format, regex and choice; what cannot run is a 400 naming the field that was sent."""
    client = embedded.client()

    def chat(**extra: Any) -> str:
        answer = client.chat.completions.create(model=embedded.model, messages=MESSAGES, max_tokens=120,
                                                temperature=0, extra_body=extra)
        return answer.choices[0].message.content or ""

    jsonschema.validate(json.loads(chat(structured_outputs={"json": SCHEMA})), SCHEMA)
    jsonschema.validate(json.loads(chat(guided_json=SCHEMA)), SCHEMA)
    assert chat(structured_outputs={"choice": ["alpha", "beta gamma"]}) in ("alpha", "beta gamma")
    assert chat(guided_choice=["alpha", "beta gamma"]) in ("alpha", "beta gamma")
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", chat(guided_regex="[A-Z]{2}-[0-9]{3}"))
    # Any JSON object: the random demo model may run past max_tokens inside one, so its start is what shows
    # the constraint (the engine's tests check json_object to the end).
    assert chat(structured_outputs={"json_object": True}).lstrip().startswith("{")
    refused = [({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
               ({"structured_outputs": {}}, "structured_outputs"),
               ({"guided_regex": "a+", "regex": "b+"}, "guided_regex"),
               ({"guided_json": {"type": "nonsense"}}, "guided_json")]
    for extra, param in refused:
        try:
            chat(**extra)
        except openai.BadRequestError as exc:
            assert exc.body is not None and exc.body.get("param") == param, (extra, exc.body)  # type: ignore[union-attr]
        else:
            raise AssertionError(f"{extra} should be refused")
