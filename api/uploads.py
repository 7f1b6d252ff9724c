"""The size cap of streamed uploads (POST /v1/files): the JSON body cap (BodySizeLimit, which buffers) does
not apply there; this one counts bytes as they arrive and stops the upload past `max_bytes`."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.api.errors import ApiError, error_response

UPLOAD_ROUTES = frozenset({("POST", "/v1/files")})  # BodySizeLimit lets these through unbuffered


def is_upload(scope: Scope) -> bool:
    return scope["type"] == "http" and (scope["method"], scope["path"]) in UPLOAD_ROUTES


class UploadSizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not is_upload(scope):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(413, "file_too_large", self._message(), "file")(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # raised inside the route's form parsing: a 413 like any ApiError
                raise ApiError(413, "file_too_large", self._message(), "file")
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"file: uploads are limited to {self.max_bytes} bytes"
