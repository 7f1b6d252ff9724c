"""ASGI middleware: the request body cap (413), HTTP response counting, the /metrics token, `Allow` on
OPTIONS and 405, and unhandled exceptions turned into 500s that keep the connection open."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.api.auth import metrics_authorized
from conveyor.api.errors import error_response
from conveyor.api.metrics import Metrics
from conveyor.api.uploads import is_upload
from conveyor.core.settings import Settings

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class BodySizeLimit:
    """Refuses bodies over `max_bytes`, or over their route's own cap in `larger` ((method, path) -> bytes: a
    Message Batch's body holds all its requests): by Content-Length up front, and by the bytes actually
    received."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: Mapping[tuple[str, str], int] | None = None,
                 ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = dict(larger or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_upload(scope):  # uploads stream, capped by api/uploads.py
            await self.app(scope, receive, send)
            return
        max_bytes = self.larger.get((scope["method"], scope["path"]), self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._too_large(max_bytes, scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                await self._too_large(max_bytes, scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, max_bytes: int, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"body: request body exceeds {max_bytes} bytes"
        response = error_response(413, "body_too_large", message, "body")
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class ResponseCounter:
    """Counts responses by method, route template (never the raw path) and status code."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.http_responses.labels(scope["method"], route, str(status)).inc()


class MetricsAuth:
    """Guards /metrics with the metrics token (conveyor.api.auth.metrics_authorized says when it is needed).

    Checked here, before routing, rather than as a route dependency: a refused scrape never reaches the
    route, whose collector queries the store, and the rule cannot be lost by a change to the route.
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != METRICS_PATH
            or metrics_authorized(self.settings, Headers(scope=scope).get("authorization"))
        ):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401, "unauthorized", "Authorization: /metrics requires the metrics token as a Bearer token",
            "Authorization", {"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


class AllowedMethods:
    """OPTIONS on a known path answers 204 with `Allow`; a 405 lists every method of its path in `Allow`.

    Starlette's router answers 405 from the first route whose path matched, so a path served by two routes
    (GET and POST /v1/jobs) advertised one method only, and OPTIONS, which no route declares, was a 405.
    """

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = routes  # the app's live list: routes included after this middleware count too

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS":
            methods = self._methods(scope)
            if methods and "OPTIONS" not in methods:  # a route that declares OPTIONS answers it itself
                await Response(status_code=204, headers={"Allow": _allow(methods)})(scope, receive, send)
                return

        async def send_with_allow(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                methods = self._methods(scope)
                if methods:
                    MutableHeaders(scope=message)["Allow"] = _allow(methods)
            await send(message)

        await self.app(scope, receive, send_with_allow)

    def _methods(self, scope: Scope) -> set[str]:
        # Asked method by method through BaseRoute.matches, the one routing interface that holds whatever
        # the router keeps inside (FastAPI nests included routers rather than copying their routes).
        return {
            method for method in HTTP_METHODS
            if any(route.matches({**scope, "method": method})[0] is Match.FULL for route in self.routes)
        }


def _allow(methods: set[str]) -> str:
    return ", ".join(sorted(methods | {"OPTIONS"}))


class UnhandledErrors:
    """Turns an exception no handler took into the API's 500 here, inside Starlette's ServerErrorMiddleware.

    ServerErrorMiddleware sends its 500 and then re-raises the exception; uvicorn, seeing an exception after
    the response started, closes the connection, and the client's next request pooled on it is reset. Here
    the exception is logged (the traceback stays in the server log, never in the body) and the connection
    stays usable. A response already under way cannot become a 500: the exception goes on to uvicorn, which
    closes the connection, the only way left to tell the client its body is cut short. After a complete
    response (a background task failed) the exception is only logged.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        progress = _ResponseProgress(send)
        try:
            await self.app(scope, receive, progress.send)
        except Exception:
            if progress.started and not progress.complete:
                raise  # uvicorn logs it and closes the connection
            log.exception("unhandled exception: %s %s", scope["method"], scope["path"])
            if not progress.started:
                await error_response(500, "internal_error", "internal server error")(scope, receive, send)


class _ResponseProgress:
    """How far the response got: started (status and headers sent), complete (the last body chunk sent)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False

    async def send(self, message: Message) -> None:
        # Marked before sending: a start that failed half-way must not be followed by a second one.
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)
