"""OpenAI's error shape for the OpenAI-compatible routes, so the `openai` SDK raises the right classes.

`{"error": {"message", "type", "param", "code"}}`; request validation is 400 (not the 422 the rest of the API
answers). Routes opt in with `APIRouter(route_class=OpenAIRoute)`: errors raised while solving dependencies
(auth, body parsing) and in the handler are translated, an unreachable store and unexpected errors included
(503, 500), so the schema can promise OpenAI's shape for every error of these routes; only what answers
before a route does (the body-size middleware's 413) keeps the Conveyor shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from conveyor.api.errors import ApiError, body_problem, parse_failure
from conveyor.core.protocol.field_errors import validation_message
from conveyor.core.protocol.refusal import Refusal

CODES = {401: "invalid_api_key", 404: "not_found"}
log = logging.getLogger(__name__)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": error_type(self.status), "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 401:
        return "authentication_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def from_api_error(exc: ApiError) -> OpenAIError:
    """Conveyor's 422 (a bad field) is OpenAI's 400; other statuses keep their meaning."""
    status = 400 if exc.status == 422 else exc.status
    code = CODES.get(exc.status, exc.code)
    return OpenAIError(status, exc.message, code=code, param=exc.field, headers=exc.headers)


def from_refusal(refusal: Refusal) -> OpenAIError:
    """The shared OpenAI rules' refusal (core/protocol/openai_request.py): 404 for a model not served, else
    400."""
    if refusal.kind == "model_not_found":
        return OpenAIError(404, refusal.message, code="model_not_found", param=refusal.param)
    code = "unsupported_parameter" if refusal.kind == "unsupported" else "invalid_request"
    return OpenAIError(400, refusal.message, code=code, param=refusal.param)


def from_validation_error(errors: Sequence[Any], content_type: str | None = "application/json",
                          ) -> OpenAIError:
    """pydantic's errors (a request's, or a JobCreate built from one) as OpenAI's 400."""
    problem = body_problem(errors, content_type)
    if problem is not None:  # the body as a whole: not JSON, not an object, empty
        return OpenAIError(400, f"body: {problem}", code="invalid_request", param="body")
    param, message = validation_message(errors)
    return OpenAIError(400, message, code="invalid_request", param=param)


class OpenAIRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as exc:
                return exc.response()
            except ApiError as exc:
                return from_api_error(exc).response()
            except RequestValidationError as exc:
                return from_validation_error(exc.errors(), request.headers.get("content-type")).response()
            except StarletteHTTPException as exc:
                if exc.status_code == 400:  # a body FastAPI could not read (api/errors.py: parse_failure)
                    return OpenAIError(400, f"body: {parse_failure(exc)}", code="invalid_request",
                                       param="body").response()
                code = CODES.get(exc.status_code, "http_error")
                return OpenAIError(exc.status_code, str(exc.detail), code=code).response()
            except OperationalError:  # connection details stay out of the body (they may name hosts)
                return OpenAIError(503, "the job store is unreachable; retry shortly",
                                   code="store_unavailable", headers={"Retry-After": "1"}).response()
            except Exception:
                log.exception("unhandled exception: %s %s", request.method, request.url.path)
                return OpenAIError(500, "internal server error", code="internal_error").response()

        return openai_handler
