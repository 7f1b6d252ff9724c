"""Only the configured host names are answered, and a browser page of another origin changes nothing.

- `Host`: a request naming a host outside `allowed_hosts` (core/settings/allowed_hosts.py) gets 400, on
  every route, before anything reads its body: a DNS-rebinding page (attacker.example pointed at
  127.0.0.1) reaches neither the API nor the console.
- `Origin`: a POST, PUT, PATCH or DELETE that a browser sends from another origin (another site, or another
  port of the same host, which is the same site to the browser) gets 403. Browsers send `Origin` with every
  such request; API clients send none and are not judged.
- Redirects say only the path (a relative `Location`): the trailing-slash redirect built its URL from the
  request's own `Host` header.

Starlette's TrustedHostMiddleware does the first alone, and falls short of it here: it cuts `Host` at the
first colon (an IPv6 literal, `[::1]:8000`, is never allowed), answers in plain text rather than the API's
error shape, and its `www` redirect builds a URL from the request. Hence this one.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.api.errors import error_response
from conveyor.core.settings.allowed_hosts import ANY_HOST, normalised_host

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_PORTS = ("80", "443")


class HostCheck:
    """ASGI middleware; the app serves no WebSocket, so HTTP requests are all it judges."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope["method"], headers.get("host"), headers.get("origin"))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, _relative_redirects(send, scope, headers.get("host")))

    def _refusal(self, method: str, host: str | None, origin: str | None) -> Response | None:
        if host is not None and not host_allowed(host_name(host), self.allowed_hosts):
            message = (f"Host: {host!r} is not a name this server answers to; its operator lists the names "
                       "clients use in allowed_hosts (CONVEYOR_ALLOWED_HOSTS)")
            return error_response(400, "host_not_allowed", message, "Host")
        if method in STATE_CHANGING and origin is not None and not same_origin(origin, host):
            message = (f"Origin: a page of {origin!r} may not change anything here; only this server's own "
                       "pages may (and API clients, which send no Origin)")
            return error_response(403, "origin_not_allowed", message, "Origin")
        return None


def host_name(host: str) -> str:
    """The name a `Host` header gives, without its port: `[::1]:8000` -> `::1`, `Example.COM.:80` ->
    `example.com`."""
    if host.startswith("["):
        return normalised_host(host.partition("]")[0])
    name, colon, port = host.rpartition(":")
    return normalised_host(name if colon and port.isdigit() else host)


def host_allowed(name: str, allowed: list[str]) -> bool:
    for pattern in allowed:
        if pattern == ANY_HOST or name == pattern:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def same_origin(origin: str, host: str | None) -> bool:
    """Whether `origin` (a browser's `Origin` header) is the request's own: the same host and port as its
    `Host` header. The scheme is left aside: a TLS proxy in front speaks http to this server."""
    if host is None or origin == "null":  # "null": a sandboxed frame, a file, a redirect: no origin to own
        return False
    parts = urlsplit(origin)
    if not parts.scheme or not parts.netloc:
        return False
    return _without_default_port(parts.netloc) == _without_default_port(host)


def _without_default_port(netloc: str) -> str:
    """`host:port` without a port that says nothing: 80 or 443, either (a TLS proxy is reached on 443 and
    may speak to this server on 80)."""
    name, colon, port = netloc.lower().rpartition(":")
    return name if colon and port in DEFAULT_PORTS else netloc.lower()


def _relative_redirects(send: Send, scope: Scope, host: str | None) -> Send:
    """`send`, with a redirect's absolute `Location` to this server made relative (its path and query)."""
    own = f"{scope.get('scheme', 'http')}://{host}" if host is not None else None

    async def send_relative(message: Message) -> None:
        if message["type"] == "http.response.start" and own is not None and 300 <= message["status"] < 400:
            headers = MutableHeaders(scope=message)
            location = headers.get("location", "")
            if location.startswith(own + "/") or location == own:
                headers["location"] = location[len(own):] or "/"
        await send(message)

    return send_relative
