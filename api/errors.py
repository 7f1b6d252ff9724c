"""One error shape everywhere: {"error": {"code": ..., "message": ..., "field": ...}}."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.request_rules import text_problem

LOCATIONS = ("body", "query", "path", "header", "cookie")
UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "url", "none"})


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


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":  # its loc is ("body", <offset>), not a field
        return _unparsable_body(f"not valid JSON: {errors[0].get('ctx', {}).get('error', 'invalid JSON')}")
    field, message = validation_message(errors)
    return error_response(422, "invalid_request", message, field)


def _unparsable_body(reason: str) -> JSONResponse:
    """One answer for every body that cannot be parsed: bad JSON, undecodable bytes, broken multipart."""
    return error_response(422, "invalid_request", f"body: {reason}", "body")


def validation_message(errors: Sequence[Any]) -> tuple[str | None, str]:
    """(field, "field: what is wrong") for the most telling of pydantic's errors."""
    error = _most_specific(errors)
    field = field_name(error.get("loc", ()))
    message = f"{field}: {error.get('msg', 'invalid value')}" if field else str(error.get("msg"))
    return field or None, message


def _most_specific(errors: Sequence[Any]) -> dict[str, Any]:
    """The first error, unless it is a union member's type mismatch and a later error about the same field
    says what is wrong: `"stop": ["\\udfff"]` fails as a string too, but the news is its bad item."""
    first: dict[str, Any] = errors[0]
    if not str(first.get("type", "")).endswith("_type"):
        return first
    field = field_name(first.get("loc", ()))
    for error in errors[1:]:
        name = field_name(error.get("loc", ()))
        same_field = name == field or name.startswith((f"{field}[", f"{field}."))
        if same_field and not str(error.get("type", "")).endswith("_type"):
            return dict(error)
    return first


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:  # FastAPI's answer to a body it could not decode (not UTF-8, bad multipart)
        return _unparsable_body(f"could not be parsed ({exc.detail})")
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail), None, getattr(exc, "headers", None))


async def _store_unavailable(_request: Request, _exc: Exception) -> JSONResponse:
    # Connection details stay in the server log: they may name hosts and users.
    return error_response(503, "store_unavailable", "the job store is unreachable; retry shortly", None,
                          {"Retry-After": "1"})


async def _internal_error(_request: Request, _exc: Exception) -> JSONResponse:
    return error_response(500, "internal_error", "internal server error")


def field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; union member tags are dropped."""
    parts = list(loc[1:] if loc and loc[0] in LOCATIONS else loc)
    out = str(parts[0]) if parts else ""
    for part in parts[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(str(part)):
            out += f".{part}"
    return out


def _is_union_tag(part: str) -> bool:
    """pydantic names the failing member of a union in loc: 'str', 'list[constrained-str]', 'WebhookSpec'."""
    return "[" in part or "-" in part or part in UNION_TAGS or part[:1].isupper()
