from __future__ import annotations

import httpx
import pytest

from conveyor.core.webhooks.ssrf import Resolver, SsrfPolicy, TargetRefused, check_target
from conveyor.worker.webhooks.pinned import PinnedTransport, webhook_client
from tests.support.webhook_receiver import Receiver

PUBLIC = "93.184.216.34"


def _resolver(table: dict[str, list[str]]) -> Resolver:
    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"unknown host {host}")
        return table[host]
    return resolve


@pytest.mark.parametrize(("url", "reason"), [
    ("https://127.0.0.1/hook", "loopback"),
    ("https://10.1.2.3/hook", "private"),
    ("https://172.16.0.9/hook", "private"),
    ("https://192.168.1.1/hook", "private"),
    ("https://169.254.169.254/latest/meta-data", "cloud metadata"),
    ("https://169.254.10.1/hook", "link-local"),
    ("https://100.64.0.1/hook", "CGNAT"),
    ("https://0.0.0.0/hook", "unspecified"),
    ("https://224.0.0.1/hook", "multicast"),
    ("https://240.0.0.1/hook", "reserved"),
    ("https://[::1]/hook", "loopback"),
    ("https://[fe80::1]/hook", "link-local"),
    ("https://[fd12:3456::1]/hook", "private"),
    ("https://[fd00:ec2::254]/hook", "cloud metadata"),
    ("https://[::ffff:127.0.0.1]/hook", "loopback"),
    ("https://[::ffff:10.0.0.1]/hook", "private"),
    ("https://[::ffff:169.254.169.254]/hook", "cloud metadata"),
    ("https://[2002:a00:1::]/hook", "private"),           # 6to4 wrapping 10.0.0.1
    ("https://metadata.google.internal/computeMetadata/v1/", "cloud metadata"),
    ("http://hooks.example.com/hook", "plain http"),
    ("ftp://hooks.example.com/hook", "scheme"),
])
def test_refused_targets_name_the_url_and_the_reason(url: str, reason: str) -> None:
    resolve = _resolver({"hooks.example.com": [PUBLIC]})
    with pytest.raises(TargetRefused, match=reason) as refused:
        check_target(url, SsrfPolicy(), resolve)
    assert url in str(refused.value)


def test_hostname_resolving_to_a_private_address_is_refused() -> None:
    resolve = _resolver({"internal.example.com": [PUBLIC, "192.168.0.5"]})
    with pytest.raises(TargetRefused, match=r"internal\.example\.com resolves to 192\.168\.0\.5, a private"):
        check_target("https://internal.example.com/hook", SsrfPolicy(), resolve)


def test_unresolvable_host_is_refused() -> None:
    with pytest.raises(TargetRefused, match="does not resolve"):
        check_target("https://nowhere.example.com/", SsrfPolicy(), _resolver({}))


def test_public_https_target_is_permitted_with_its_addresses() -> None:
    resolve = _resolver({"hooks.example.com": [PUBLIC]})
    target = check_target("https://hooks.example.com:8443/h", SsrfPolicy(), resolve)
    assert (target.host, target.port, target.addresses) == ("hooks.example.com", 8443, (PUBLIC,))


@pytest.mark.parametrize(("allow", "url"), [
    (("127.0.0.1",), "http://127.0.0.1:8080/hook"),
    (("127.0.0.0/8",), "http://[::ffff:127.0.0.2]/hook"),
    (("10.0.0.0/8",), "https://internal.example.com/hook"),
    (("internal.example.com",), "http://internal.example.com/hook"),
    (("internal.example.com:8080",), "http://internal.example.com:8080/hook"),
])
def test_allowlist_permits_exceptions(allow: tuple[str, ...], url: str) -> None:
    check_target(url, SsrfPolicy(allow=allow), _resolver({"internal.example.com": ["10.0.0.7"]}))


@pytest.mark.parametrize(("allow", "url"), [
    (("127.0.0.1",), "http://127.0.0.2/hook"),
    (("internal.example.com:8080",), "http://internal.example.com:9090/hook"),
    (("10.0.0.0/8",), "https://mixed.example.com/hook"),              # one address outside the allowlist
    (("169.254.0.0/16",), "https://169.254.169.254/"),                 # metadata stays refused
])
def test_allowlist_is_narrow(allow: tuple[str, ...], url: str) -> None:
    resolve = _resolver({"internal.example.com": ["10.0.0.7"],
                         "mixed.example.com": ["10.0.0.7", "127.0.0.1"]})
    with pytest.raises(TargetRefused):
        check_target(url, SsrfPolicy(allow=allow), resolve)


def test_pinned_transport_connects_to_the_checked_address_keeping_host_and_sni() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    resolve = _resolver({"hooks.example.com": [PUBLIC]})
    transport = PinnedTransport(SsrfPolicy(), resolve, inner=httpx.MockTransport(answer))
    with httpx.Client(transport=transport) as client:
        assert client.post("https://hooks.example.com/h?x=1", content=b"{}").status_code == 204
    (request,) = seen
    assert str(request.url) == f"https://{PUBLIC}/h?x=1"
    assert request.headers["host"] == "hooks.example.com"
    assert request.extensions["sni_hostname"] == "hooks.example.com"


def test_dns_rebinding_after_the_check_is_refused_at_send_time() -> None:
    answers = iter([[PUBLIC], ["127.0.0.1"]])

    def rebinding(host: str, port: int) -> list[str]:
        return next(answers)

    check_target("https://rebind.example.com/h", SsrfPolicy(), rebinding)   # at subscription time
    sent: list[httpx.Request] = []
    inner = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(200))
    with webhook_client(SsrfPolicy(), rebinding, inner=inner) as client, \
            pytest.raises(TargetRefused, match="loopback"):
        client.post("https://rebind.example.com/h", content=b"{}")
    assert sent == []


def test_pinned_client_reaches_a_loopback_receiver_by_an_allowlisted_name(receiver: Receiver) -> None:
    port = httpx.URL(receiver.url).port
    resolve = _resolver({"hooks.internal": ["127.0.0.1"]})
    with webhook_client(SsrfPolicy(allow=(f"hooks.internal:{port}",)), resolve) as client:
        assert client.post(f"http://hooks.internal:{port}/hooks", content=b"{}").status_code == 200
    assert receiver.received[0].headers["host"] == f"hooks.internal:{port}"
