"""A kept connection is reused only when nothing is left unread on it (issue
31, item 5): a receiver that sends a second answer to one request must not
have that answer read as the next message's. Against raw socket receivers on
127.0.0.1 that write exactly the bytes a test scripts, over TLS and plain HTTP.

What the relay can tell apart is an answer that is already there when the
next request would go out: on the socket, or inside the TLS layer, which
reads whole records and keeps what the caller did not ask for, out of sight
of ``select``. An answer the receiver writes after the next request went out
looks, on the wire, like the answer to that request."""

from __future__ import annotations

import io
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from channel_support import loopback_resolver

from outbox.channels import Deadline, Message, Outcome
from outbox.channels.webhook import WebhookChannel
from support import LocalCA


def answer(status: str, body: bytes = b"ok", length: bool = True, version: str = "1.1") -> bytes:
    head = f"HTTP/{version} {status}\r\n"
    if length:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


STRAY = answer("200 OK", b"stray")
FAIL = answer("500 Internal Server Error", b"fail")


def sized_answer(total: int) -> bytes:
    """A 200 of exactly ``total`` bytes, headers included."""
    data = answer("200 OK", b"x" * total)
    data = answer("200 OK", b"x" * (2 * total - len(data)))
    assert len(data) == total
    return data


# The relay's first read of a TLS answer asks the TLS layer for one buffer
# (http.client reads through a BufferedReader); an answer of exactly that
# size, written in one TLS record with a stray answer after it, leaves the
# stray decrypted and waiting inside the client's TLS object, where the
# socket shows nothing to read.
FILLS_ONE_READ = sized_answer(io.DEFAULT_BUFFER_SIZE)


@dataclass
class RawReceiver:
    """Answers each request with the bytes ``script`` gives for its number
    (1 for the first request it reads, on any connection); ``close`` after
    an answer ends that connection."""

    script: Callable[[int], tuple[bytes, bool]]
    tls: ssl.SSLContext | None = None
    connections: int = 0
    requests: list[str] = field(default_factory=list)  # each request's webhook-id
    sockets: list[socket.socket] = field(default_factory=list)  # each connection's
    port: int = 0

    def url(self, host: str = "webhook.test") -> str:
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/in"

    def serve(self, listener: socket.socket) -> None:
        while True:
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._connection, args=(raw,), daemon=True).start()

    def _connection(self, raw: socket.socket) -> None:
        try:
            sock = self.tls.wrap_socket(raw, server_side=True) if self.tls else raw
            self.sockets.append(sock)
            with sock, sock.makefile("rb") as reader:
                while (webhook_id := _read_request(reader)) is not None:
                    self.requests.append(webhook_id)
                    data, close = self.script(len(self.requests))
                    sock.sendall(data)  # one write: one TLS record (under 16 KiB)
                    if close:
                        return
        except (OSError, ssl.SSLError):
            return  # the relay closed a connection it would not reuse


def _read_request(reader: Any) -> str | None:
    if not reader.readline():
        return None
    length, webhook_id = 0, ""
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.lower() == "content-length":
            length = int(value)
        elif name.lower() == "webhook-id":
            webhook_id = value.strip()
    reader.read(length)
    return webhook_id


@contextmanager
def raw_receiver(
    script: Callable[[int], tuple[bytes, bool]], tls: ssl.SSLContext | None = None
) -> Iterator[RawReceiver]:
    rx = RawReceiver(script, tls)
    listener = socket.create_server(("127.0.0.1", 0))
    rx.port = listener.getsockname()[1]
    threading.Thread(target=rx.serve, args=(listener,), daemon=True).start()
    try:
        yield rx
    finally:
        listener.close()


def send_all(ch: WebhookChannel, url: str, count: int) -> list[Outcome]:
    outcomes = []
    for n in range(1, count + 1):
        payload = {"url": url, "event_type": "t", "body": {"n": n}}
        ch.validate(payload)
        outcomes.append(ch.send(Message(n, "webhook", payload, 1), Deadline(5.0)))
    return outcomes


def channel(arn: str, **kw: Any) -> WebhookChannel:
    return WebhookChannel(
        allow_insecure=True, default_secret_id=arn, resolver=loopback_resolver(), **kw
    )


def test_a_stray_answer_inside_tls_is_not_read_as_the_next_messages_answer(
    signing_secret: tuple[str, str], local_ca: LocalCA
) -> None:
    # The first request gets its 200 and, in the same record, a second 200
    # nobody asked for; every later request gets a 500.
    def script(n: int) -> tuple[bytes, bool]:
        return (FILLS_ONE_READ + STRAY if n == 1 else FAIL), False

    # (One record holds at most 16 KiB: a larger read buffer, as a later
    # Python may have, would take both answers at once and drop the stray.)
    assert len(FILLS_ONE_READ + STRAY) <= 16384
    ch = channel(signing_secret[0], ssl_context=local_ca.client_context())
    with raw_receiver(script, local_ca.server_context()) as rx:
        first, second = send_all(ch, rx.url(), 2)
    assert first.kind == "delivered"
    # The receiver answered the second message 500: not delivered, and it
    # went out on a new connection, not the one with the stray answer on it.
    assert (second.kind, second.error) == ("retry", "HTTP 500")
    assert rx.requests == ["msg_1", "msg_2"]
    assert rx.connections == 2


def test_a_stray_answer_on_the_socket_is_not_read_as_the_next_messages_answer(
    signing_secret: tuple[str, str],
) -> None:
    # Plain HTTP: the first request's 200, then, while the connection waits
    # for the next message, a second 200 written on it; later requests get 500.
    def script(n: int) -> tuple[bytes, bool]:
        return (answer("200 OK") if n == 1 else FAIL), False

    ch = channel(signing_secret[0])
    with raw_receiver(script) as rx:
        (first,) = send_all(ch, rx.url(), 1)
        rx.sockets[0].sendall(STRAY)
        time.sleep(0.05)  # (on loopback, there long before this)
        (second,) = send_all(ch, rx.url(), 1)
    assert first.kind == "delivered"
    assert (second.kind, second.error) == ("retry", "HTTP 500")
    assert rx.connections == 2


@pytest.mark.parametrize(
    "first_answer",
    [
        answer("200 OK", length=False),  # HTTP/1.1, no length: the body ends at close
        answer("200 OK", length=False, version="1.0"),
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n\r\nok",
    ],
    ids=["http-1.1", "http-1.0", "http-1.0-keep-alive"],
)
def test_an_answer_read_until_close_is_never_reused(
    signing_secret: tuple[str, str], first_answer: bytes
) -> None:
    # Without a length or chunked coding, the answer's end is the connection's
    # end: nothing after it can be told from its body, so never kept.
    def script(n: int) -> tuple[bytes, bool]:
        return (first_answer, True) if n == 1 else (answer("200 OK"), False)

    ch = channel(signing_secret[0])
    with raw_receiver(script) as rx:
        outcomes = send_all(ch, rx.url(), 3)
    assert [o.kind for o in outcomes] == ["delivered"] * 3
    assert rx.requests == ["msg_1", "msg_2", "msg_3"]
    # The first connection ended with its answer; the second was kept.
    assert rx.connections == 2
