"""The store side of the Responses routes: a POST /v1/responses body as the job it submits (judged by the chat
rules, core/protocol/responses_request.py), and reading, cancelling and forgetting the job behind a response
id, always within the caller's tenant (another tenant's response is a 404, as its job is)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError

from conveyor.api.chat_jobs import default_chat_max_tokens, served_of
from conveyor.api.deps import Services
from conveyor.api.openai_errors import OpenAIError, from_refusal, from_validation_error
from conveyor.api.schemas.jobs import JobCreate
from conveyor.api.served_models import ServedModel
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.responses_request import ResponseCreate, TranslatedResponse
from conveyor.core.store import jobs
from conveyor.core.store.tables import Job
from conveyor.core.views.response_objects import earlier_turns, job_id_of, status_of

DEFAULT_QUEUE = "interactive"
T = TypeVar("T")


def job_body(model: ServedModel, body: ResponseCreate, history: list[dict[str, Any]]) -> JobCreate:
    """The job a response runs: its chat request judged as /v1/chat/completions judges one (400 naming the
    Responses field), its placement extras as POST /v1/jobs judges them. Tokenizes for the default
    max_output_tokens ("as many as fit"): call it in a worker thread."""
    try:
        translated = body.chat_request(history)
        messages = translated.messages(served_of(model))
    except Refusal as refusal:
        raise from_refusal(refusal) from None
    max_tokens = translated.chat.requested_max_tokens()
    if max_tokens is None:
        max_tokens = default_chat_max_tokens(model, messages, translated.chat.chat_options(model.tool_parser))
    return _job_create(model, body, translated, messages, max_tokens)


def _job_create(model: ServedModel, body: ResponseCreate, translated: TranslatedResponse,
                messages: list[dict[str, Any]], max_tokens: int) -> JobCreate:
    fields = {"queue": DEFAULT_QUEUE, **body.placement(), **translated.chat.job_params()}
    try:
        return JobCreate.model_validate(dict(messages=messages, model=model.id, max_tokens=max_tokens,
                                             metadata=body.metadata, **fields))
    except ValidationError as exc:
        raise from_validation_error(exc.errors()) from exc


def earlier_conversation(services: Services, tenant: str, previous_response_id: str) -> list[dict[str, Any]]:
    """The conversation a turn with previous_response_id continues: 404 for a response the tenant does not
    have, 400 for one that has not completed."""
    def read(job: Job) -> list[dict[str, Any]]:
        status = status_of(job)
        if status not in ("completed", "incomplete"):
            raise OpenAIError(400, f"previous_response_id: response {previous_response_id} is {status}; "
                              "continue from it once it has completed", param="previous_response_id")
        return earlier_turns(job)

    return with_response(services, tenant, previous_response_id, read, param="previous_response_id")


def with_response(services: Services, tenant: str, response_id: str, use: Callable[[Job], T],
                  param: str | None = None) -> T:
    """`use` applied to the job behind the tenant's response, in its session (its lazy fields readable);
    404 when the tenant has no such response."""
    job_id = job_id_of(response_id)
    with services.session_factory() as session:
        job = jobs.get(session, job_id, tenant) if job_id is not None else None
        if job is None or job.responses_request is None:
            raise OpenAIError(404, f"{param or 'id'}: no response {response_id}", code="not_found",
                              param=param or "id")
        return use(job)


def forget(services: Services, tenant: str, job_id: str) -> None:
    """A `store: false` response, answered: its job goes (with its webhook deliveries)."""
    with services.session_factory() as session:
        jobs.delete_finished(session, job_id, tenant)
