"""Requests judged against the real model at submit: prompt + max_tokens beyond the model's context (its
config.json's, when no max_model_len is configured; the configured one when smaller) is a 422 naming
max_tokens on /v1/jobs and OpenAI's 400 on the OpenAI routes, and no job is stored; /v1/queues shows each
queue's limits clamped to what the model can run. The demo model has 1024 positions."""

from __future__ import annotations

from collections.abc import Callable

from conveyor.core.store.tables import Job
from tests.support.service import Service, error_of

MODEL_LEN = 1024  # engine/demo.py's max_position_embeddings


def _jobs(service: Service) -> int:
    with service.session_factory() as session:
        return session.query(Job).count()


def test_over_context_jobs_are_refused_at_submit(service: Service) -> None:
    alice = service.client("alice")
    over = alice.post("/v1/jobs", json={"prompt": "hello", "queue": "documents", "max_tokens": MODEL_LEN})
    assert over.status_code == 422, over.text
    error = error_of(over)
    assert (error["code"], error["field"]) == ("context_too_long", "max_tokens")
    assert f"exceeds max_model_len ({MODEL_LEN})" in error["message"]
    assert _jobs(service) == 0
    fits = alice.post("/v1/jobs", json={"prompt": "hello", "queue": "documents", "max_tokens": MODEL_LEN - 8})
    assert fits.status_code == 202, fits.text


def test_a_configured_max_model_len_below_the_models_is_the_one_judged(
    make_service: Callable[..., Service],
) -> None:
    alice = make_service(max_model_len=64).client("alice")
    over = alice.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 64})
    assert over.status_code == 422 and "max_model_len (64)" in error_of(over)["message"], over.text


def test_openai_routes_answer_an_over_context_request_with_a_400(service: Service) -> None:
    alice = service.client("alice")
    body = {"model": "demo-model", "prompt": "word " * 600, "max_tokens": 500}
    refused = alice.post("/v1/completions", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["type"]) == ("max_tokens", "invalid_request_error")
    assert "max_model_len" in error["message"] and _jobs(service) == 0


def test_queues_show_limits_clamped_to_the_model(service: Service) -> None:
    limits = {q["name"]: q["limits"] for q in service.client("alice").get("/v1/queues").json()["data"]}
    # documents: 32768 prompt tokens and 4096 output tokens configured; interactive: 2048 and 512.
    assert (limits["documents"]["max_prompt_tokens"], limits["documents"]["max_output_tokens"]) == (
        1023,
        1023,
    )
    assert (limits["interactive"]["max_prompt_tokens"], limits["interactive"]["max_output_tokens"]) == (
        1023,
        512,
    )
