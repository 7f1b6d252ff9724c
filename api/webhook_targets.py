"""The SSRF guard applied when a webhook target is given (subscription or job submit): a refused target is
a 422 naming the field. Every delivery runs the full guard again and connects to the address it approved.

A host name that does not resolve yet is accepted here (DNS may be set up after the subscription), with
what can be judged without DNS still enforced: the scheme, cloud metadata names, the allowlist.
"""

from __future__ import annotations

import ipaddress

import httpx

from conveyor.api.errors import ApiError
from conveyor.core.settings import Settings
from conveyor.core.webhooks.ssrf import (
    METADATA_HOSTS,
    Resolver,
    SsrfPolicy,
    TargetRefused,
    check_target,
    system_resolver,
    url_problem,
)


def check_webhook_target(url: str, settings: Settings, field: str,
                         resolver: Resolver = system_resolver) -> None:
    """Raises ApiError(422, field) when the SSRF guard refuses `url`."""
    policy = SsrfPolicy(allow=tuple(settings.webhook_allowlist))
    try:
        check_target(url, policy, resolver)
    except TargetRefused as exc:
        if not _refused_only_for_dns(url, policy, resolver):
            raise ApiError(422, "webhook_target_refused", f"{field}: {exc}", field) from None


def _refused_only_for_dns(url: str, policy: SsrfPolicy, resolver: Resolver) -> bool:
    if url_problem(url) is not None:  # not a URL at all: no DNS record can make it one
        return False
    parsed = httpx.URL(url)
    host = parsed.host.lower().rstrip(".")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    if host in METADATA_HOSTS or _resolves(host, port, resolver):
        return False
    return parsed.scheme == "https" or policy.permits_host(host, port)


def _resolves(host: str, port: int, resolver: Resolver) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        return bool(resolver(host, port))
    except OSError:
        return False


def check_job_webhook(webhook: dict[str, object] | None, settings: Settings) -> None:
    """A job's (or batch's) own `webhook` target, when it has one."""
    if webhook is not None:
        check_webhook_target(str(webhook["url"]), settings, "webhook")
