"""The error bodies and what each route declares it answers (the `responses=` of its decorator), so the
OpenAPI document lists exactly the statuses and shapes a client can get.

Conveyor's routes answer `{"error": {"code", "message", "field"}}`; the OpenAI-compatible routes answer
OpenAI's `{"error": {"message", "type", "param", "code"}}` and the Anthropic ones Anthropic's `{"type":
"error", "error": {"type", "message"}}`, except the 413 of the body-size middleware, which answers before any
route does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

Responses = dict[int | str, dict[str, Any]]

DESCRIPTIONS = {
    401: "no valid API key (Authorization: Bearer)",
    403: "the key may not ask for this; `error.field` names what it asked for",
    404: "no such object for this tenant",
    409: "conflicts with the object's state",
    413: "request body too large",
    422: "a field is invalid; `error.field` names it",
    429: "the queue is full; retry after `Retry-After` seconds",
    500: "an unexpected server error (logged)",
    503: "the job store is unreachable; retry shortly",
}
OPENAI_DESCRIPTIONS = {
    400: "a parameter is invalid or unsupported; `error.param` names it",
    401: "no valid API key (Authorization: Bearer)",
    403: "a priority or service tier outside what the tenant may ask for",
    404: "unknown model",
    409: "the job was cancelled",
    413: "request body too large (Conveyor's error shape: answered before the route)",
    429: "the queue is full; retry after `Retry-After` seconds",
    500: "the job failed, or an unexpected server error",
    503: "the job expired unstarted, or the job store is unreachable",
    504: "the job ran past its timeout",
}
ANTHROPIC_DESCRIPTIONS = {
    400: "invalid_request_error: a field is invalid or unsupported; the message names it",
    401: "authentication_error: no valid API key (x-api-key, or Authorization: Bearer)",
    403: "permission_error: a priority outside what the tenant may ask for",
    404: "not_found_error: unknown model",
    409: "invalid_request_error: the job was cancelled",
    413: "request too large (Conveyor's error shape: answered before the route)",
    429: "rate_limit_error: the queue is full; retry after `Retry-After` seconds",
    500: "api_error: the job failed, or an unexpected server error",
    503: "overloaded_error: the job expired unstarted, or the job store is unreachable",
    504: "api_error: the job ran past its timeout",
}
RETRY_AFTER = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


def error_responses(*statuses: int) -> Responses:
    """A Conveyor route's error answers: `statuses`, plus 500 and 503 (the store is unreachable), which any
    route can give. Each is named: a `default` would make every undeclared status look declared."""
    return {status: _declared(status, ErrorBody, DESCRIPTIONS) for status in (*statuses, 500, 503)}


def openai_error_responses(*statuses: int) -> Responses:
    """An OpenAI-compatible route's error answers, in OpenAI's shape (413 excepted, see the module doc)."""
    return {
        status: _declared(status, ErrorBody if status == 413 else OpenAIErrorBody, OPENAI_DESCRIPTIONS)
        for status in (*statuses, 500, 503)
    }


def anthropic_error_responses(*statuses: int) -> Responses:
    """An Anthropic route's error answers, in Anthropic's shape (413 excepted, as for OpenAI's)."""
    return {
        status: _declared(status, ErrorBody if status == 413 else AnthropicErrorBody, ANTHROPIC_DESCRIPTIONS)
        for status in (*statuses, 500, 503)
    }


def _declared(status: int, model: type[BaseModel], descriptions: dict[int, str]) -> dict[str, Any]:
    declared: dict[str, Any] = {"model": model, "description": descriptions[status]}
    if status == 429:
        declared["headers"] = RETRY_AFTER
    return declared


def sse_schema(data: str) -> dict[str, Any]:
    """A text/event-stream response's schema: each event, as clients (and schema checkers) parse it, with
    its `data` described."""
    return {"type": "object", "required": ["data"],
            "properties": {"event": {"type": "string"}, "data": {"type": "string", "description": data}}}
