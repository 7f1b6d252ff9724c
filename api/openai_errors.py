"""OpenAI's error shape for the OpenAI-compatible routes, so the `openai` SDK raises the right classes.

`{"error": {"message", "type", "param", "code"}}`; request validation is 400 (not the 422 the rest of the API
answers). Routes opt in with `APIRouter(route_class=OpenAIRoute)`: errors raised while solving dependencies
(auth, body parsing) and in the handler are translated; everything else keeps the Conveyor shape.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.errors import ApiError, field_name

CODES = {401: "invalid_api_key", 404: "not_found"}


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


def from_validation_error(exc: RequestValidationError) -> OpenAIError:
    first: dict[str, Any] = exc.errors()[0]
    param = field_name(first.get("loc", ())) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg"))
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
                return from_validation_error(exc).response()
            except StarletteHTTPException as exc:
                code = CODES.get(exc.status_code, "http_error")
                return OpenAIError(exc.status_code, str(exc.detail), code=code).response()

        return openai_handler
