"""Webhook target checks against server-side request forgery.

A target must be `https` and every address its host resolves to must be publicly routable. Refused:
loopback, private (RFC 1918, unique-local fc00::/7), link-local (169.254/16, fe80::/10), shared CGNAT
(100.64/10), unspecified, multicast, reserved and other non-global ranges, and the IPv4 forms embedded in
IPv6 (`::ffff:a.b.c.d`, 6to4). Cloud metadata endpoints are refused always, even when allowlisted.

Operator allowlist (`SsrfPolicy.allow`), each entry one of:
  - an address or CIDR (`127.0.0.1`, `10.0.0.0/8`, `::1`): a target whose resolved addresses all fall inside
    allowlisted networks is permitted, over http as well;
  - a host, optionally with a port (`localhost`, `hooks.internal:8080`): that host (on that port, when given)
    is permitted whatever it resolves to, over http as well (IPv6 goes in the first form, unbracketed).

DNS rebinding: the check returns the addresses it approved; `PinnedTransport` (see pinned.py) runs the check
again for every request it sends and connects to the approved address itself, so the address that was
checked is the address that is connected to.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]

METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata"})
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254"))
CGNAT = ipaddress.ip_network("100.64.0.0/10")
_HOST = re.compile(r"[A-Za-z0-9._:-]+")  # a name (IDNA-encoded), an IPv4 or an IPv6 address (unbracketed)


class TargetRefused(ValueError):
    """A webhook target the SSRF guard does not permit."""


@dataclass(frozen=True)
class SsrfPolicy:
    """Operator allowlist entries (see the module docstring for their forms)."""

    allow: tuple[str, ...] = ()

    def networks(self) -> list[IPNetwork]:
        return [network for entry in self.allow if (network := _as_network(entry)) is not None]

    def permits_host(self, host: str, port: int) -> bool:
        for entry in self.allow:
            if _as_network(entry) is not None:
                continue
            name, _, entry_port = entry.lower().rstrip(".").partition(":")
            if name == host and (not entry_port or entry_port == str(port)):
                return True
        return False


@dataclass(frozen=True)
class CheckedTarget:
    url: httpx.URL
    host: str
    port: int
    addresses: tuple[str, ...]   # every address the host resolved to, all approved; connect to [0]


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def check_target(url: str, policy: SsrfPolicy, resolver: Resolver = system_resolver) -> CheckedTarget:
    """Resolve and approve a webhook target URL; raise TargetRefused naming the URL and the reason."""
    parsed = _parse(url)
    host = parsed.host.lower().rstrip(".")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    if host in METADATA_HOSTS:
        raise _refused(url, f"{host} is a cloud metadata endpoint")
    host_allowed = policy.permits_host(host, port)
    addresses = [_parse_address(url, text) for text in _resolve(url, host, port, resolver)]
    networks = policy.networks()
    for address in addresses:
        if _unwrap(address) in METADATA_ADDRESSES:
            raise _refused(url, f"{address} is a cloud metadata address")
    addresses_allowed = all(any(_unwrap(a) in net or a in net for net in networks) for a in addresses)
    if host_allowed or addresses_allowed:
        return CheckedTarget(parsed, host, port, tuple(str(a) for a in addresses))
    if parsed.scheme != "https":
        raise _refused(url, "plain http is not allowed (use https, or allowlist the target)")
    for address in addresses:
        if (reason := forbidden_reason(address)) is not None:
            subject = f"{host} is" if host == str(address) else f"{host} resolves to {address},"
            raise _refused(url, f"{subject} {reason}")
    return CheckedTarget(parsed, host, port, tuple(str(a) for a in addresses))


def forbidden_reason(address: IPAddress) -> str | None:
    """Why an address may not be a webhook target, or None when it is publicly routable."""
    inner = _unwrap(address)
    checks = [
        (inner in METADATA_ADDRESSES, "a cloud metadata address"),
        (inner.is_loopback, "a loopback address"),
        (inner.is_unspecified, "an unspecified address"),
        (inner.is_link_local, "a link-local address"),
        (inner.is_multicast, "a multicast address"),
        (inner in CGNAT, "a shared (CGNAT) address"),
        (inner.is_reserved, "a reserved address"),
        (inner.is_private, "a private address"),
        (not inner.is_global, "not a globally routable address"),
    ]
    return next((reason for failed, reason in checks if failed), None)


def _unwrap(address: IPAddress) -> IPAddress:
    """The IPv4 address carried inside an IPv4-mapped or 6to4 IPv6 address, else the address itself."""
    if isinstance(address, ipaddress.IPv6Address):
        return address.ipv4_mapped or address.sixtofour or address
    return address


def url_problem(url: str) -> str | None:
    """Why `url` is not an absolute http(s) URL with a host name or address, as sent, or None. Whitespace and
    control characters are refused as such: URL parsers drop them (tabs, newlines) or percent-encode them
    (a space in the host), so the URL stored would not be the one given."""
    odd = next((c for c in url if c.isspace() or unicodedata.category(c) == "Cc"), None)
    if odd is not None:
        return f"not a valid URL (it contains whitespace or a control character: {odd!r})"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"not a valid URL ({exc})"
    if parsed.scheme not in ("http", "https"):
        return "the scheme must be https"
    if not parsed.host:
        return "the URL has no host"
    if not _HOST.fullmatch(parsed.raw_host.decode("ascii", "replace")):
        return f"not a valid URL (the host {parsed.host!r} is not a name or an address)"
    return None


def _parse(url: str) -> httpx.URL:
    problem = url_problem(url)
    if problem is not None:
        raise _refused(url, problem)
    return httpx.URL(url)


def _resolve(url: str, host: str, port: int, resolver: Resolver) -> list[str]:
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        addresses = resolver(host, port)
    except OSError as exc:
        raise _refused(url, f"{host} does not resolve ({exc})") from None
    if not addresses:
        raise _refused(url, f"{host} does not resolve")
    return addresses


def _parse_address(url: str, text: str) -> IPAddress:
    try:
        return ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        raise _refused(url, f"the resolver returned {text!r}, not an IP address") from None


def _as_network(entry: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(entry.strip("[]"), strict=False)
    except ValueError:
        return None


def _refused(url: str, reason: str) -> TargetRefused:
    return TargetRefused(f"webhook target {url!r} refused: {reason}")

