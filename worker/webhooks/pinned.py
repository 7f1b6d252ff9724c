"""An httpx transport that checks every webhook request with the SSRF guard and connects to the checked
address, so a DNS answer that changes between check and connect (DNS rebinding) cannot redirect it.

The request URL's host is replaced by the approved IP; the `Host` header keeps the original name, and for
https the original name is sent as SNI and verified against the certificate (httpcore's `sni_hostname`).
Connections are not kept alive: a pooled connection, keyed by IP, must never carry another host's request.
"""

from __future__ import annotations

import ipaddress

import httpx

from conveyor.core.webhooks.ssrf import Resolver, SsrfPolicy, check_target, system_resolver


class PinnedTransport(httpx.BaseTransport):
    def __init__(self, policy: SsrfPolicy, resolver: Resolver = system_resolver,
                 inner: httpx.BaseTransport | None = None) -> None:
        self._policy = policy
        self._resolver = resolver
        self._inner = inner or httpx.HTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        target = check_target(str(request.url), self._policy, self._resolver)
        address = target.addresses[0]
        if not _is_ip(target.host):
            request.extensions = {**request.extensions, "sni_hostname": target.host}
        request.url = request.url.copy_with(host=address)   # the Host header was set from the original URL
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


def webhook_client(policy: SsrfPolicy, resolver: Resolver = system_resolver, *,
                   inner: httpx.BaseTransport | None = None) -> httpx.Client:
    """The client deliveries use: SSRF-checked and pinned, no redirects, no proxies from the environment."""
    transport = PinnedTransport(policy, resolver, inner)
    return httpx.Client(transport=transport, follow_redirects=False, trust_env=False)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
