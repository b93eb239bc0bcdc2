"""The webhook channel keeps a connection whose answer it read in full, for
the next call to the same checked address, port and TLS name; against real
local receivers on 127.0.0.1 that count the connections they accept.

What must never happen: a kept connection carries a request the SSRF guard
did not check for that call, or a request for another TLS name; a
connection with an answer left unread is reused; a receiver that closed a
kept connection costs the message an attempt."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from channel_support import loopback_resolver, receiver

from outbox.channels import Deadline, Message, Outcome
from outbox.channels.webhook import WebhookChannel
from support import LocalCA

# What the counting receiver does with each request.
KEEP = "keep"  # 200, the connection kept open
ANNOUNCE_CLOSE = "announce-close"  # 200 with Connection: close
CLOSE_AFTER = "close-after"  # 200, then the connection closed without notice
DROP_SECOND = "drop-second"  # the second request on a connection read, no answer, closed
DROP_ALL = "drop-all"  # every request read, no answer, closed
LONG_BODY = "long-body"  # 200 with a 1,000-byte body


class CountingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.requests: list[str] = []  # the webhook-id of each request read
        super().__init__(("127.0.0.1", 0), _Handler)

    def get_request(self) -> Any:
        accepted = super().get_request()
        self.connections += 1
        return accepted


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CountingServer
    on_this_connection = 0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append(self.headers["webhook-id"])
        self.on_this_connection += 1
        mode = self.server.mode
        if mode == DROP_ALL or (mode == DROP_SECOND and self.on_this_connection == 2):
            self.close_connection = True
            return
        body = b"x" * 1000 if mode == LONG_BODY else b"ok"
        self.send_response(200)
        if mode == ANNOUNCE_CLOSE:
            self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if mode == CLOSE_AFTER:
            self.close_connection = True


@contextmanager
def counting(mode: str) -> Iterator[CountingServer]:
    server = CountingServer(mode)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def channel(arn: str, resolver: Any = None, **kw: Any) -> WebhookChannel:
    return WebhookChannel(
        allow_insecure=True,
        default_secret_id=arn,
        resolver=resolver or loopback_resolver(),
        **kw,
    )


def send(ch: WebhookChannel, url: str, message_id: int) -> Outcome:
    payload = {"url": url, "event_type": "t", "body": {"n": message_id}}
    ch.validate(payload)
    return ch.send(Message(message_id, "webhook", payload, 1), Deadline(30.0))


def test_calls_to_one_receiver_share_one_connection(signing_secret: tuple[str, str]) -> None:
    ch = channel(signing_secret[0])
    with counting(KEEP) as rx:
        url = f"http://hooks.test:{rx.server_address[1]}/in"
        outcomes = [send(ch, url, n) for n in (1, 2, 3)]
    assert [o.kind for o in outcomes] == ["delivered"] * 3
    assert rx.requests == ["msg_1", "msg_2", "msg_3"]
    assert rx.connections == 1


@pytest.mark.parametrize("mode", [ANNOUNCE_CLOSE, CLOSE_AFTER])
def test_a_receiver_that_closes_its_connections_gets_a_new_one_each_call(
    signing_secret: tuple[str, str], mode: str
) -> None:
    ch = channel(signing_secret[0])
    with counting(mode) as rx:
        url = f"http://hooks.test:{rx.server_address[1]}/in"
        outcomes = [send(ch, url, n) for n in (1, 2, 3)]
    # Closed without notice (an idle timeout): found closed before reuse, or
    # refused as the request went out and sent again on a new connection;
    # either way each message reached the receiver once, with no attempt lost.
    assert [o.kind for o in outcomes] == ["delivered"] * 3
    assert rx.requests == ["msg_1", "msg_2", "msg_3"]
    assert rx.connections == 3


def test_a_kept_connection_closed_as_the_request_went_out_is_retried_once_on_a_new_one(
    signing_secret: tuple[str, str],
) -> None:
    ch = channel(signing_secret[0])
    with counting(DROP_SECOND) as rx:
        url = f"http://hooks.test:{rx.server_address[1]}/in"
        outcomes = [send(ch, url, n) for n in (1, 2)]
    assert [o.kind for o in outcomes] == ["delivered"] * 2
    # The second message went out on the kept connection, got no answer, and
    # went again (the same webhook-id) on a new one.
    assert rx.requests == ["msg_1", "msg_2", "msg_2"]
    assert rx.connections == 2


def test_a_new_connection_that_gets_no_answer_is_not_sent_again(
    signing_secret: tuple[str, str],
) -> None:
    ch = channel(signing_secret[0])
    with counting(DROP_ALL) as rx:
        outcome = send(ch, f"http://hooks.test:{rx.server_address[1]}/in", 1)
    assert outcome.kind == "retry"
    assert outcome.error is not None and outcome.error.startswith("connection failed")
    assert rx.requests == ["msg_1"]


def test_an_answer_not_read_to_its_end_closes_the_connection(
    signing_secret: tuple[str, str],
) -> None:
    ch = channel(signing_secret[0], max_response_bytes=10)
    with counting(LONG_BODY) as rx:
        url = f"http://hooks.test:{rx.server_address[1]}/in"
        outcomes = [send(ch, url, n) for n in (1, 2)]
    assert [o.kind for o in outcomes] == ["delivered"] * 2
    assert rx.connections == 2


def test_a_kept_connection_never_carries_a_request_the_guard_refuses(
    signing_secret: tuple[str, str],
) -> None:
    # The name resolves to the receiver, then to a private address (a DNS
    # rebinding). The suite's socket guard fails the test on any connect
    # outside 127.0.0.0/8; the kept connection to 127.0.0.1 must not carry
    # the request either.
    answers = [["127.0.0.1"], ["10.0.0.7"]]
    ch = channel(signing_secret[0], resolver=lambda host, port: answers.pop(0))
    with counting(KEEP) as rx:
        url = f"http://hooks.test:{rx.server_address[1]}/in"
        first, second = send(ch, url, 1), send(ch, url, 2)
    assert first.kind == "delivered"
    assert second.kind == "failed"
    assert second.error is not None and second.error.startswith("destination refused")
    assert rx.requests == ["msg_1"]


def test_a_connection_verified_for_one_name_never_carries_another_names_request(
    signing_secret: tuple[str, str], local_ca: LocalCA
) -> None:
    # The certificate names webhook.test, not other.test: a request for
    # other.test on the connection verified for webhook.test would be
    # delivered; on a connection of its own its TLS check fails.
    ch = channel(signing_secret[0], ssl_context=local_ca.client_context())
    with receiver(local_ca) as rx:
        first = send(ch, rx.url("/ok", host="webhook.test"), 1)
        second = send(ch, rx.url("/ok", host="other.test"), 2)
    assert first.kind == "delivered"
    assert second.kind == "retry"
    assert second.error == "TLS handshake or certificate check failed"
    assert len(rx.requests) == 1
