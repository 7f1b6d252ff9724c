"""Anthropic's error shape for the Anthropic routes (/v1/messages, its Message Batches), so the `anthropic`
SDK raises the right classes: `{"type": "error", "error": {"type", "message"}}`, the type following the
status (core/views/anthropic_objects.py: invalid_request_error 400, authentication_error 401, ...).

Routes opt in with `APIRouter(route_class=AnthropicRoute)`: every error raised while solving dependencies
(auth, body parsing) or in the handler is translated, the shared rules' refusals, the OpenAI-shaped errors of
the code both conventions share (api/chat_jobs.py, api/openai_sync.py), Conveyor's own (admission's 429, a
403 priority) and an unreachable store or unexpected error (503, 500) included. A request validation error
is Anthropic's 400 (not the 422 the rest of the API answers). Only what answers before a route does (the
body-size middleware's 413) keeps the Conveyor shape. `anthropic_errors(rename)` also renames the field an
error names to the request's own (core/protocol/anthropic_request.py: `anthropic_field`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.api.errors import ApiError, body_problem, parse_failure
from conveyor.api.openai_errors import OpenAIError
from conveyor.core.protocol.field_errors import validation_message
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.views.anthropic_objects import error_body, error_type

Rename = Callable[[str | None], str | None]  # a field as the shared rules name it -> as the request named it
log = logging.getLogger(__name__)


class AnthropicError(Exception):
    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers

    def body(self) -> dict[str, Any]:
        return error_body(error_type(self.status), self.message)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _keep(field: str | None) -> str | None:
    return field


def renamed(message: str, field: str | None, rename: Rename) -> str:
    """`message` ("field: reason") with its leading field as the request named it."""
    new = rename(field)
    if field is None or new is None or new == field or not message.startswith(f"{field}:"):
        return message
    return new + message[len(field):]


def from_refusal(refusal: Refusal, rename: Rename = _keep) -> AnthropicError:
    """A refusal of the shared rules: 404 for a model not served, else 400."""
    status = 404 if refusal.kind == "model_not_found" else 400
    return AnthropicError(status, renamed(refusal.message, refusal.param, rename))


def from_openai_error(exc: OpenAIError, rename: Rename = _keep) -> AnthropicError:
    """An error of the code the OpenAI routes share (a model not served, a job that failed): same status."""
    return AnthropicError(exc.status, renamed(exc.message, exc.param, rename), headers=exc.headers)


def from_api_error(exc: ApiError, rename: Rename = _keep) -> AnthropicError:
    """Conveyor's 422 (a bad field) is Anthropic's 400; other statuses keep their meaning."""
    status = 400 if exc.status == 422 else exc.status
    return AnthropicError(status, renamed(exc.message, exc.field, rename), headers=exc.headers)


def from_validation_error(errors: Sequence[Any], content_type: str | None = "application/json",
                          ) -> AnthropicError:
    problem = body_problem(errors, content_type)
    if problem is not None:  # the body as a whole: not JSON, not an object, empty
        return AnthropicError(400, f"body: {problem}")
    return AnthropicError(400, validation_message(errors)[1])


@contextmanager
def anthropic_errors(rename: Rename) -> Iterator[None]:
    """Errors raised inside as Anthropic's, naming the request's own fields."""
    try:
        yield
    except Refusal as refusal:
        raise from_refusal(refusal, rename) from None
    except OpenAIError as exc:
        raise from_openai_error(exc, rename) from None
    except ApiError as exc:
        raise from_api_error(exc, rename) from None


class AnthropicRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def anthropic_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except AnthropicError as exc:
                return exc.response()
            except (Refusal, OpenAIError, ApiError) as exc:
                return _translated(exc).response()
            except RequestValidationError as exc:
                return from_validation_error(exc.errors(), request.headers.get("content-type")).response()
            except StarletteHTTPException as exc:
                if exc.status_code == 400:  # a body FastAPI could not read (api/errors.py: parse_failure)
                    return AnthropicError(400, f"body: {parse_failure(exc)}").response()
                return AnthropicError(exc.status_code, str(exc.detail)).response()
            except OperationalError:  # connection details stay out of the body (they may name hosts)
                return AnthropicError(503, "the job store is unreachable; retry shortly",
                                      headers={"Retry-After": "1"}).response()
            except Exception:
                log.exception("unhandled exception: %s %s", request.method, request.url.path)
                return AnthropicError(500, "internal server error").response()

        return anthropic_handler


def _translated(exc: Refusal | OpenAIError | ApiError) -> AnthropicError:
    if isinstance(exc, Refusal):
        return from_refusal(exc)
    return from_openai_error(exc) if isinstance(exc, OpenAIError) else from_api_error(exc)
