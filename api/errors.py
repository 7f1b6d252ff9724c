"""One error shape everywhere: {"error": {"code": ..., "message": ..., "field": ...}}."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.core.protocol.field_errors import FieldProblem, untagged, validation_message
from conveyor.core.protocol.request_rules import text_problem

# pydantic's error types at loc ("body",) that mean the body is not an object at all.
WHOLE_BODY_ERRORS = frozenset({"missing", "model_attributes_type", "model_type", "dict_type"})


class ApiError(Exception):
    """An HTTP error raised by the API layer (never by the store)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers



def problem_error(problem: FieldProblem) -> ApiError:
    """A request rule's problem (core/protocol/request_limits.py, core/protocol/embedding_rules.py) as the
    422 naming it."""
    return ApiError(422, problem.code, problem.message, problem.field)


def raise_problem(problem: FieldProblem | None) -> None:
    if problem is not None:
        raise problem_error(problem)


def not_found(kind: str, object_id: str) -> ApiError:
    """The one 404 for an id the tenant cannot see, whether it is missing or another tenant's."""
    return ApiError(404, "not_found", f"id: {kind} {object_id} not found", "id")


def lookup_id(kind: str, object_id: str) -> str:
    """`object_id`, or the 404 of an unknown id when no stored id can look like it: PostgreSQL answers a
    NUL in a query parameter with an error (a 500), not with an empty result."""
    if not can_be_stored_id(object_id):
        raise not_found(kind, object_id)
    return object_id


def can_be_stored_id(object_id: str) -> bool:
    return text_problem(object_id) is None


def error_response(
    status: int, code: str, message: str, field: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "field": field}}
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OperationalError, _store_unavailable)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, exc.field, exc.headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    problem = body_problem(errors, request.headers.get("content-type"))
    if problem is not None:
        return _unparsable_body(problem)
    field, message = validation_message(errors)
    return error_response(422, "invalid_request", message, field)


def body_problem(errors: Sequence[Any], content_type: str | None) -> str | None:
    """What is wrong with the body as a whole (not JSON, not an object, empty), or None when the errors are
    about its fields. FastAPI reports these at loc ("body",) or ("body", <offset>) with pydantic's wording
    ("JSON decode error", "Input should be a valid dictionary"), which names no field and says little."""
    if not errors:
        return None
    error, loc = errors[0], untagged(errors[0].get("loc", ()))
    if error.get("type") == "json_invalid":  # loc ("body", <character offset>)
        reason = error.get("ctx", {}).get("error", "invalid JSON")
        where = f" at position {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
        return f"not valid JSON ({reason}{where})"
    if loc != ("body",) or error.get("type") not in WHOLE_BODY_ERRORS:
        return None  # a field's error, or a rule of the whole model that names its fields itself
    if error.get("type") == "missing":
        return "empty; send a JSON object"
    value = error.get("input")
    if isinstance(value, bytes | str) and "json" not in (content_type or "").lower():
        return f"not read as JSON (Content-Type {content_type or 'missing'}); send it as application/json"
    return f"must be a JSON object, got {_json_type(value)}"


def _json_type(value: object) -> str:
    for kind, name in ((bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "an array")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _unparsable_body(reason: str) -> JSONResponse:
    """One answer for every body that cannot be parsed: bad JSON, undecodable bytes, broken multipart."""
    return error_response(422, "invalid_request", f"body: {reason}", "body")


def parse_failure(exc: StarletteHTTPException) -> str:
    """Why FastAPI could not read the body, from the error it chained to its 400 "There was an error parsing
    the body": a JSON integer over Python's digit limit, nesting beyond its recursion limit, bad bytes."""
    cause = exc.__cause__
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        digits = sys.get_int_max_str_digits()
        return f"not valid JSON (an integer has more than {digits} digits; no field takes one)"
    if isinstance(cause, RecursionError):
        return "not valid JSON (nested too deeply)"
    if isinstance(cause, UnicodeDecodeError):
        return f"could not be parsed (not UTF-8: {cause.reason} at byte {cause.start})"
    return f"could not be parsed ({exc.detail})"


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:  # FastAPI's answer to a body it could not decode (not UTF-8, bad multipart)
        return _unparsable_body(parse_failure(exc))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail), None, getattr(exc, "headers", None))


async def _store_unavailable(_request: Request, _exc: Exception) -> JSONResponse:
    # Connection details stay in the server log: they may name hosts and users.
    return error_response(503, "store_unavailable", "the job store is unreachable; retry shortly", None,
                          {"Retry-After": "1"})


async def _internal_error(_request: Request, _exc: Exception) -> JSONResponse:
    return error_response(500, "internal_error", "internal server error")
