"""A real HTTP receiver on loopback that records every webhook request and answers from a script."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    delay_s: float = 0.0


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float = field(default_factory=time.monotonic)  # when it arrived


class Receiver:
    """Answers requests with the scripted replies in order, then 200; records what it received."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.replies: list[Reply] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hooks"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _next(self, received: Received) -> Reply:
        with self._lock:
            self.received.append(received)
            return self.replies.pop(0) if self.replies else Reply()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                headers = {name.lower(): value for name, value in self.headers.items()}
                reply = receiver._next(Received(self.path, headers, body))
                time.sleep(reply.delay_s)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):   # the client gave up first
                    self._answer(reply)

            def _answer(self, reply: Reply) -> None:
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
