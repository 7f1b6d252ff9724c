"""The host names the HTTP service answers to (`allowed_hosts`): what a request's `Host` header may name.

A page on attacker.example whose name the attacker points at 127.0.0.1 (DNS rebinding) is, for the browser,
attacker.example's own: it reads the answers. With auth off nothing else stands in its way, so a server on
loopback answers only to the loopback names. Bound to every address (0.0.0.0, ::) the names clients use
(an Ingress host, a Service's DNS names, the pod IP a kubelet probe sends) are not known here, and auth is
on (Settings.check_bind): any name is answered unless the operator lists them. The check itself is the
API's (api/host_check.py).
"""

from __future__ import annotations

import ipaddress

ANY_HOST = "*"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("", "0.0.0.0", "::")


def default_allowed_hosts(bind: str, loopback: bool) -> list[str]:
    """The names a server bound to `bind` answers to when none are configured: the loopback names (and
    the bind address) on loopback, the bind address alone on another one, any on every address."""
    if bind in WILDCARD_BINDS:
        return [ANY_HOST]
    names = [*LOOPBACK_NAMES] if loopback else []
    own = normalised_host(bind)
    return names if own in names else [*names, own]


def allowed_host_entry(entry: str) -> str:
    """One configured name, normalised (lower case, no trailing dot, an IPv6 address unbracketed).
    ValueError naming what is wrong: a port, a scheme or a path, or a wildcard that is not `*` or
    `*.<domain>`."""
    name = normalised_host(entry)
    if not name:
        raise ValueError("a host name may not be empty")
    if any(mark in name for mark in ("/", "@", " ")) or (":" in name and not _is_ip(name)):
        raise ValueError(f"{entry!r} is not a host name: name it without scheme, port or path (e.g. "
                         "conveyor.example.com)")
    if "*" in name and name != ANY_HOST and not (name.startswith("*.") and "*" not in name[2:]):
        raise ValueError(f"{entry!r}: a wildcard is `*` (any host) or `*.<domain>` (its subdomains)")
    return name


def normalised_host(name: str) -> str:
    return name.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
