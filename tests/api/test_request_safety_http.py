"""Every request judged safely (issue 27): hostile bodies found by a probe of the running service, each now a
4xx naming the field (or the body) before anything is stored. Before: a deeply nested response_format schema
was a 500 (RecursionError in jsonschema), a 5,000-digit integer an unexplained "error parsing the body",
"5" and true were coerced into integer fields, a batch's webhook could not be the README's plain URL, and a
webhook URL with a space or an empty `events` list was stored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.protocol.structured_rules import MAX_STRUCTURED_DEPTH
from conveyor.core.store.tables import Batch, Job, Subscription
from tests.support.hostile_schemas import nested_items, nested_objects
from tests.support.service import CancelOnPublish, Service, error_of

JSON = {"Content-Type": "application/json"}
CHAT = '"messages": [{"role": "user", "content": "hi"}]'
HUGE = "9" * 5000  # past Python's 4,300-digit limit on converting a string to an int


@pytest.fixture
def service(make_service: Callable[..., Service], session_factory: sessionmaker[Session]) -> Service:
    return make_service(publisher=CancelOnPublish(session_factory))


def rows(service: Service, table: Any) -> int:
    with service.session_factory() as session:
        return int(session.execute(select(func.count()).select_from(table)).scalar_one())


def post_raw(service: Service, path: str, raw: str) -> Any:
    return service.client("alice").post(path, content=raw.encode(), headers=JSON)


def problem(response: Any) -> tuple[int, str | None, str]:
    """(status, field, message) in either error shape: Conveyor's or OpenAI's."""
    error = error_of(response)
    return response.status_code, error.get("field", error.get("param")), str(error["message"])


# --- deeply nested schemas --------------------------------------------------------------------------

ROUTES = [("/v1/jobs", {"prompt": "x"}, 422),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400),
          ("/v1/completions", {"prompt": "x"}, 400)]


@pytest.mark.parametrize(("path", "body", "status"), ROUTES)
@pytest.mark.parametrize("schema", [nested_objects(100), nested_items(150)], ids=["objects-100", "items-150"])
def test_deep_response_format_schema_is_refused_naming_the_depth(
    service: Service, path: str, body: dict[str, Any], status: int, schema: dict[str, Any]
) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    r = service.client("alice").post(path, json={**body, "response_format": response_format})
    assert problem(r) == (status, "response_format", "response_format: the JSON Schema is nested deeper than "
                                                     f"{MAX_STRUCTURED_DEPTH} levels"), r.text
    assert rows(service, Job) == 0


@pytest.mark.parametrize(("path", "body", "status"), ROUTES)
def test_schema_with_a_deeply_nested_pattern_is_refused(service: Service, path: str, body: dict[str, Any],
                                                        status: int) -> None:
    schema = {"type": "string", "pattern": "(" * 2000 + ")" * 2000}  # Python's re parser recurses per group
    r = service.client("alice").post(path, json={**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
    status_got, field, message = problem(r)
    assert (status_got, field) == (status, "response_format") and "too deeply nested" in message, r.text


# --- integers too long to convert ------------------------------------------------------------------

@pytest.mark.parametrize(("path", "raw", "status"), [
    ("/v1/jobs", f'{{"prompt": "x", "max_tokens": {HUGE}}}', 422),
    ("/v1/chat/completions", f'{{{CHAT}, "max_tokens": {HUGE}}}', 400),
    ("/v1/completions", f'{{"prompt": "x", "max_tokens": {HUGE}}}', 400),
    ("/v1/batches", f'{{"input": "s3://bucket/in.jsonl", "metadata": {{"n": {HUGE}}}}}', 422),
])
def test_five_thousand_digit_integer_is_named(service: Service, path: str, raw: str, status: int) -> None:
    r = post_raw(service, path, raw)
    assert problem(r) == (status, "body", "body: not valid JSON (an integer has more than 4300 digits; no "
                                          "field takes one)"), r.text
    assert rows(service, Job) == rows(service, Batch) == 0


# --- strict types: JSON's 5 is an integer; "5", true and 5.0 are not ------------------------------

@pytest.mark.parametrize(("fragment", "field"), [
    ('"max_tokens": "5"', "max_tokens"),
    ('"max_tokens": true', "max_tokens"),
    ('"max_tokens": 5.0', "max_tokens"),
    ('"min_tokens": false', "min_tokens"),
    ('"logprobs": true', "logprobs"),
    ('"seed": "1"', "seed"),
    ('"top_k": "40"', "top_k"),
    ('"stop_token_ids": ["2"]', "stop_token_ids[0]"),
    ('"stop_token_ids": [true]', "stop_token_ids[0]"),
    ('"temperature": "0.5"', "temperature"),
    ('"top_p": true', "top_p"),
    ('"ttl": "60"', "ttl"),
    ('"ignore_eos": "yes"', "ignore_eos"),
    ('"ignore_eos": 1', "ignore_eos"),
])
def test_job_field_of_the_wrong_type_is_refused(service: Service, fragment: str, field: str) -> None:
    r = post_raw(service, "/v1/jobs", f'{{"prompt": "x", {fragment}}}')
    status, named, message = problem(r)
    assert (status, named) == (422, field) and message.startswith(f"{field}: Input should be a valid"), r.text
    assert rows(service, Job) == 0


@pytest.mark.parametrize(("path", "fragment", "param"), [
    ("/v1/chat/completions", f'{CHAT}, "max_tokens": "5"', "max_tokens"),
    ("/v1/chat/completions", f'{CHAT}, "max_completion_tokens": true', "max_completion_tokens"),
    ("/v1/chat/completions", f'{CHAT}, "n": true', "n"),
    ("/v1/chat/completions", f'{CHAT}, "logprobs": true, "top_logprobs": "2"', "top_logprobs"),
    ("/v1/chat/completions", f'{CHAT}, "logprobs": 1', "logprobs"),
    ("/v1/chat/completions", f'{CHAT}, "seed": 1.0', "seed"),
    ("/v1/chat/completions", f'{CHAT}, "stream": "false"', "stream"),
    ("/v1/chat/completions", f'{CHAT}, "temperature": "0"', "temperature"),
    ("/v1/completions", '"prompt": "x", "logprobs": true', "logprobs"),
    ("/v1/completions", '"prompt": "x", "max_tokens": "5"', "max_tokens"),
    ("/v1/completions", '"prompt": "x", "best_of": true', "best_of"),
    ("/v1/completions", '"prompt": "x", "echo": 0', "echo"),
])
def test_openai_parameter_of_the_wrong_type_is_refused(service: Service, path: str, fragment: str,
                                                       param: str) -> None:
    r = post_raw(service, path, f"{{{fragment}}}")
    status, named, message = problem(r)
    assert (status, named) == (400, param) and message.startswith(f"{param}: Input should be a valid"), r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert rows(service, Job) == 0


def test_json_integers_still_fill_integer_and_number_fields(service: Service) -> None:
    body = {"prompt": "x", "max_tokens": 5, "min_tokens": 0, "seed": 1, "top_k": 40, "logprobs": 2,
            "temperature": 0, "top_p": 1, "ttl": 60, "stop_token_ids": [2], "ignore_eos": False}
    r = service.client("alice").post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    with service.session_factory() as session:
        [job] = session.scalars(select(Job)).all()
    assert (job.params["max_tokens"], job.params["temperature"], job.params["logprobs"]) == (5, 0.0, 2)


# --- batches: which input, and the webhook in the README's form ------------------------------------

@pytest.mark.parametrize(("body", "sent"), [
    ({"input": "s3://bucket/in.jsonl", "input_file_id": "file-1"}, "both were sent"),
    ({}, "neither was sent"),
    ({"endpoint": "/v1/completions"}, "neither was sent"),
])
def test_batch_needs_exactly_one_input_and_says_which_fields(service: Service, body: dict[str, Any],
                                                             sent: str) -> None:
    r = service.client("alice").post("/v1/batches", json=body)
    assert r.status_code == 422, r.text
    assert error_of(r)["message"] == f"input_file_id, input: send exactly one of them; {sent}"
    assert rows(service, Batch) == 0


@pytest.mark.parametrize("webhook", ["https://example.com/hooks", {"url": "https://example.com/hooks"}])
def test_batch_webhook_may_be_a_plain_url_as_for_a_job(service: Service, webhook: Any) -> None:
    body = {"input": "s3://bucket/in.jsonl", "webhook": webhook}
    r = service.client("alice").post("/v1/batches", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["webhook"] == {"url": "https://example.com/hooks"}
    with service.session_factory() as session:
        [batch] = session.scalars(select(Batch)).all()
    assert batch.webhook == {"url": "https://example.com/hooks"}


def test_webhook_object_keeps_what_was_sent(service: Service) -> None:
    webhook = {"url": "https://example.com/hooks", "events": ["job.*"], "note": "kept"}
    r = service.client("alice").post("/v1/jobs", json={"prompt": "x", "webhook": webhook})
    assert r.status_code == 202, r.text
    plain = service.client("alice").post("/v1/jobs", json={"prompt": "y", "webhook": {"url": webhook["url"]}})
    assert plain.status_code == 202, plain.text
    with service.session_factory() as session:
        stored = {job.prompt: job.webhook for job in session.scalars(select(Job))}
    assert stored == {"x": webhook, "y": {"url": "https://example.com/hooks"}}


# --- webhook URLs and event filters ----------------------------------------------------------------

BAD_URLS = ["https://exa mple.com/", "https://exa\tmple.com/", "https://example.com/\n", "https://ex%20ample.com/",
            "http:/x", "https://", "ftp://example.com/"]


def _webhook_bodies(url: str) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, field) of every place a webhook URL is given."""
    return [("/v1/webhooks", {"url": url}, "url"),
            ("/v1/jobs", {"prompt": "x", "webhook": url}, "webhook"),
            ("/v1/jobs", {"prompt": "x", "webhook": {"url": url}}, "webhook"),
            ("/v1/batches", {"input": "s3://bucket/in.jsonl", "webhook": url}, "webhook"),
            ("/v1/batches", {"input": "s3://bucket/in.jsonl", "webhook": {"url": url}}, "webhook")]


@pytest.mark.parametrize("url", BAD_URLS)
def test_webhook_url_that_is_not_an_absolute_http_url_is_refused(service: Service, url: str) -> None:
    client = service.client("alice")
    for path, body, field in _webhook_bodies(url):
        r = client.post(path, json=body)
        assert r.status_code == 422 and error_of(r)["field"] == field, (path, body, r.text)
        assert str(error_of(r)["message"]).startswith(f"{field}: "), r.text
    assert rows(service, Subscription) == rows(service, Job) == rows(service, Batch) == 0


HOOK = "https://example.com/h"


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/webhooks", {"url": HOOK, "events": []}, "events"),
    ("/v1/jobs", {"prompt": "x", "webhook": {"url": HOOK, "events": []}}, "webhook.events"),
    ("/v1/batches", {"input": "s3://bkt/a.jsonl", "webhook": {"url": HOOK, "events": []}}, "webhook.events"),
    ("/v1/jobs", {"prompt": "x", "webhook": {"url": HOOK, "events": ["job.exploded"]}}, "webhook.events"),
])
def test_empty_or_unknown_event_filter_is_refused(service: Service, path: str, body: dict[str, Any],
                                                  field: str) -> None:
    r = service.client("alice").post(path, json=body)
    assert r.status_code == 422 and error_of(r)["field"] == field, r.text
    assert str(error_of(r)["message"]).startswith(f"{field}: "), r.text
    assert rows(service, Subscription) == rows(service, Job) == rows(service, Batch) == 0
