"""The webhook SSRF guard against a table of targets, proven without connecting.

The resolver is stubbed (``socket.getaddrinfo`` or the channel's resolver) and
the suite's socket guard fails any connect outside 127.0.0.0/8, so a refused
target that were nevertheless dialled would fail the test, not reach anything.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from outbox import netguard
from outbox.channels import Deadline, Message
from outbox.channels.webhook import WebhookChannel

# (url, why) refused by shape alone: check_url at enqueue and resolve at send.
LITERAL_TARGETS = [
    ("https://127.0.0.1/hook", "loopback"),
    ("https://127.8.9.10/hook", "loopback"),
    ("https://[::1]/hook", "loopback"),
    ("https://10.0.0.5/hook", "private"),
    ("https://172.16.3.4/hook", "private"),
    ("https://172.31.255.255/hook", "private"),
    ("https://192.168.1.1/hook", "private"),
    ("https://[fc00::1]/hook", "private"),
    ("https://[fd12:3456::1]/hook", "private"),
    ("https://169.254.10.1/hook", "link-local"),
    ("https://[fe80::1]/hook", "link-local"),
    ("https://169.254.169.254/latest/meta-data/", "metadata"),
    ("https://[fd00:ec2::254]/latest/meta-data/", "metadata"),
    ("https://224.0.0.1/hook", "multicast"),
    ("https://[ff02::1]/hook", "multicast"),
    ("https://0.0.0.0/hook", "unspecified"),
    ("https://[::]/hook", "unspecified"),
    ("https://100.64.0.1/hook", "CGNAT"),
    ("https://100.100.100.200/hook", "CGNAT"),
    ("https://240.0.0.1/hook", "reserved"),
    ("https://255.255.255.255/hook", "broadcast"),
    ("https://192.0.2.10/hook", "documentation"),
    ("https://[2001:db8::1]/hook", "documentation"),
    ("https://[::ffff:127.0.0.1]/hook", "IPv4-mapped loopback"),
    ("https://[::ffff:169.254.169.254]/hook", "IPv4-mapped metadata"),
    ("https://[::ffff:a9fe:a9fe]/hook", "IPv4-mapped metadata, hex"),
    ("https://[::ffff:10.1.2.3]/hook", "IPv4-mapped private"),
    ("https://[::127.0.0.1]/hook", "IPv4-compatible loopback"),
    ("https://[64:ff9b::a9fe:a9fe]/hook", "NAT64 metadata"),
    ("https://[2002:a9fe:a9fe::1]/hook", "6to4 metadata"),
    ("https://2130706433/hook", "decimal loopback"),
    ("https://0x7f000001/hook", "hex loopback"),
    ("https://0x7f.1/hook", "hex dotted loopback"),
    ("https://017700000001/hook", "octal loopback"),
    ("https://0177.0.0.1/hook", "octal dotted loopback"),
    ("https://127.1/hook", "short-form loopback"),
    ("https://2852039166/hook", "decimal metadata"),
    ("https://0xa9.0xfe.0xa9.0xfe/hook", "hex metadata"),
    ("https://0x08080808/hook", "hex spelling of a public IP: ambiguous, refused"),
    ("https://[fe80::1%25eth0]/hook", "scoped link-local"),
]

BAD_SHAPES = [
    ("http://example.com/hook", "plain http"),
    ("ftp://example.com/hook", "scheme"),
    ("file:///etc/passwd", "scheme"),
    ("https://user:pw@example.com/hook", "credentials"),
    ("https://example.com@10.0.0.1/hook", "credentials trick"),
    ("https:///hook", "no host"),
    ("https://example.com/hook#frag", "fragment"),
    ("https://exa mple.com/hook", "whitespace"),
    ("https://example.com:0/hook", "port 0"),
    ("https://example.com:99999/hook", "bad port"),
]


@pytest.mark.parametrize(("url", "why"), LITERAL_TARGETS + BAD_SHAPES)
def test_check_url_refuses(url: str, why: str) -> None:
    with pytest.raises(netguard.ForbiddenDestination):
        netguard.check_url(url)


@pytest.mark.parametrize(("url", "why"), LITERAL_TARGETS + BAD_SHAPES)
def test_resolve_refuses_without_a_lookup(
    url: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_dns(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a literal or malformed host must not be looked up")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with pytest.raises(netguard.ForbiddenDestination):
        netguard.resolve(url)


@pytest.mark.parametrize(
    "url",
    [
        "https://10.0.0.5/x",
        "https://169.254.169.254/x",
        "https://[fd00:ec2::254]/x",
        "https://[::ffff:169.254.169.254]/x",
        "https://192.168.0.1/x",
        "https://0x7f.1/x",
    ],
)
def test_local_development_mode_still_refuses_everything_but_loopback(url: str) -> None:
    with pytest.raises(netguard.ForbiddenDestination):
        netguard.check_url(url, allow_insecure=True)
    with pytest.raises(netguard.ForbiddenDestination):
        netguard.resolve(url, allow_insecure=True, resolver=lambda h, p: ["127.0.0.1"])


def test_local_development_mode_allows_http_and_loopback_only() -> None:
    netguard.check_url("http://127.0.0.1:8080/hook", allow_insecure=True)
    netguard.check_url("http://[::1]:8080/hook", allow_insecure=True)
    target = netguard.resolve(
        "http://localhost:8080/hook?a=1", allow_insecure=True, resolver=lambda h, p: ["127.0.0.1"]
    )
    assert (target.scheme, target.hostname, target.port, target.path, target.address) == (
        "http",
        "localhost",
        8080,
        "/hook?a=1",
        "127.0.0.1",
    )


PRIVATE_ANSWERS = [
    ["10.1.2.3"],
    ["127.0.0.1"],
    ["169.254.169.254"],
    ["fd00:ec2::254"],
    ["::ffff:192.168.0.10"],
    ["100.64.3.3"],
    ["93.184.216.34", "10.0.0.1"],  # one bad answer among good ones is enough
]


@pytest.mark.parametrize("answers", PRIVATE_ANSWERS)
def test_a_name_resolving_to_a_forbidden_address_is_refused(
    answers: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    looked_up: list[str] = []

    def fake_getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        looked_up.append(host)
        return [
            (
                socket.AF_INET6 if ":" in a else socket.AF_INET,
                socket.SOCK_STREAM,
                6,
                "",
                (a, port, 0, 0) if ":" in a else (a, port),
            )
            for a in answers
        ]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    netguard.check_url("https://hooks.example.com/in")  # the shape is fine
    with pytest.raises(netguard.ForbiddenDestination, match="resolves to"):
        netguard.resolve("https://hooks.example.com/in")
    assert looked_up == ["hooks.example.com"]


def test_a_public_answer_is_the_address_to_connect_to() -> None:
    target = netguard.resolve(
        "https://hooks.example.com:8443/in", resolver=lambda h, p: ["93.184.216.34"]
    )
    assert target.address == "93.184.216.34"
    assert target.hostname == "hooks.example.com"
    assert target.host_header == "hooks.example.com:8443"


@pytest.mark.parametrize("answers", PRIVATE_ANSWERS)
def test_the_webhook_channel_refuses_a_private_answer_and_never_connects(
    answers: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    connects: list[Any] = []
    real_connect = socket.socket.connect

    def recording_connect(self: socket.socket, address: Any) -> Any:
        connects.append(address)
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    channel = WebhookChannel(
        allow_insecure=False,
        resolver=lambda host, port: answers,
        secrets=_StaticSecrets("whsec_" + "A" * 43 + "="),
        default_secret_id="arn:secret",
    )
    payload = {"url": "https://hooks.example.com/in", "event_type": "order.shipped", "body": {}}
    channel.validate(payload)
    outcome = channel.send(Message(1, "webhook", payload, 1), Deadline(5))
    assert outcome.kind == "failed"
    assert outcome.error is not None and outcome.error.startswith("destination refused")
    assert "hooks.example.com" not in outcome.error
    assert connects == []


class _StaticSecrets:
    def __init__(self, value: str) -> None:
        self.value = value

    def get(self, name: str, max_age: int = 0) -> str:
        return self.value


def test_a_redirect_to_a_private_address_is_never_followed() -> None:
    """The receiver answers 301 to http://10.0.0.7/internal: the send fails and
    no second request is made (the socket guard would also fail the test)."""
    from channel_support import loopback_resolver, receiver

    channel = WebhookChannel(
        allow_insecure=True,
        resolver=loopback_resolver(),
        secrets=_StaticSecrets("whsec_" + "A" * 43 + "="),
        default_secret_id="arn:secret",
    )
    with receiver(None) as rx:
        payload = {"url": rx.url("/redirect"), "event_type": "e", "body": {}}
        outcome = channel.send(Message(1, "webhook", payload, 1), Deadline(5))
    assert (outcome.kind, outcome.error) == ("failed", "HTTP 301: redirect not followed")
    assert [r.path for r in rx.requests] == ["/redirect"]
