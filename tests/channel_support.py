"""Helpers for the channel tests: an end-to-end drive through the real sender
runtime, a throwaway TLS CA, and local HTTP(S) receivers on 127.0.0.1."""

from __future__ import annotations

import base64
import datetime as dt
import http.server
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

import outbox
import support
from outbox import channels, sender, store
from outbox.channels import Channel
from outbox.handoff import HandOff
from support import LocalCA, make_ca

ACCOUNT = "123456789012"
REGION = "us-east-1"


def deliver(
    engine: sa.Engine,
    channel_name: str,
    payload: Any,
    *,
    channel: Channel | None = None,
    ordering_key: str | None = None,
    remaining: float = 30.0,
    message_id: int | None = None,
) -> tuple[int, sender.SendReport]:
    """enqueue (unless ``message_id``) -> claim -> sender.run, as the functions do."""
    if channel is not None:
        channels.register(channel_name, lambda: channel)
    if message_id is None:
        with engine.begin() as conn:
            message_id = outbox.enqueue(conn, channel_name, payload, ordering_key=ordering_key)
    with engine.begin() as conn:
        claims = store.claim(conn, 10, 120, [channel_name])
    assert [c.id for c in claims] == [message_id]
    report = sender.run(
        engine,
        HandOff(channel_name, tuple(claims)).to_event(),
        support.settings(),
        lambda: remaining,
        channel_name=channel_name,
        channel=channel,
    )
    return message_id, report


def settled(engine: sa.Engine, message_id: int) -> tuple[sa.Row[Any], list[sa.Row[Any]]]:
    with engine.connect() as conn:
        return support.row(conn, message_id), support.attempts(conn, message_id)


# TLS: support.make_ca (re-exported here for the channel tests).
__all__ = ["LocalCA", "make_ca"]


# --- local webhook receivers --------------------------------------------------


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A scripted HTTP(S) receiver on 127.0.0.1. Paths choose the answer:

    /status/<code> answers that status, /status/<code>/retry-after with Retry-After: 7;

    /retry-after?<value> 503 with that Retry-After (the percent-decoded bytes, raw);
    /ok and any path below it 200, /nocontent 204, /gone 410, /bad 400, /redirect 301 (to an internal
    address), /throttle-seconds 429 Retry-After: 7, /throttle-date 429 with an
    HTTP date two minutes ahead, /unavailable 503, /hang (answers after
    ``hang_seconds``), /huge 200 with a 100 MB body, /flaky 500 once then 200.
    """

    port: int = 0
    scheme: str = "http"
    requests: list[Received] = field(default_factory=list)
    huge_bytes_written: int = 0
    flaky_calls: int = 0
    hang_seconds: float = 5.0
    release: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"


def _handler(receiver: Receiver) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            receiver.requests.append(
                Received("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            )
            path = self.path.split("?", 1)[0]
            if path.startswith("/status/"):  # /status/<code>[/retry-after]
                _, _, code, *rest = path.split("/")
                self._answer(int(code), {"Retry-After": "7"} if rest == ["retry-after"] else None)
            elif path == "/hang":
                receiver.release.wait(receiver.hang_seconds)
                self._answer(200)
            elif path == "/huge":
                self._huge()
            elif path == "/flaky":
                receiver.flaky_calls += 1
                self._answer(500 if receiver.flaky_calls == 1 else 200)
            elif path == "/redirect":
                self._answer(301, {"Location": "http://10.0.0.7/internal"})
            elif path == "/throttle-seconds":
                self._answer(429, {"Retry-After": "7"})
            elif path == "/retry-after":  # 503 with the query's Retry-After bytes, as they are
                value = urllib.parse.unquote_to_bytes(self.path.split("?", 1)[1])
                self.send_response(503)
                self._headers_buffer.append(b"Retry-After: " + value + b"\r\n")  # type: ignore[attr-defined]
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif path.startswith("/ok/"):  # any path below /ok: 200
                self._answer(200)
            elif path == "/throttle-date":
                when = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=120)
                self._answer(429, {"Retry-After": when.strftime("%a, %d %b %Y %H:%M:%S GMT")})
            else:
                status = {
                    "/ok": 200,
                    "/nocontent": 204,
                    "/gone": 410,
                    "/bad": 400,
                    "/unavailable": 503,
                }.get(path, 404)
                self._answer(status)

        def _answer(self, status: int, headers: dict[str, str] | None = None) -> None:
            payload = b"" if status == 204 else b'{"ok":true}'
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if status != 204:
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _huge(self) -> None:
            total = 100 * 1024 * 1024
            self.send_response(200)
            self.send_header("Content-Length", str(total))
            self.end_headers()
            chunk = b"x" * 65536
            try:
                while receiver.huge_bytes_written < total:
                    self.wfile.write(chunk)
                    receiver.huge_bytes_written += len(chunk)
            except OSError:
                pass  # the client stopped reading and closed: what we want
            self.close_connection = True

    return Handler


@contextmanager
def receiver(tls: LocalCA | None = None, hang_seconds: float = 5.0) -> Iterator[Receiver]:
    state = Receiver(scheme="https" if tls else "http", hang_seconds=hang_seconds)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    if tls is not None:
        context = tls.server_context()
        server.socket = context.wrap_socket(server.socket, server_side=True)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()


@contextmanager
def silent_server(accepted: list[socket.socket] | None = None) -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers:
    a provider that hangs. Yields its port; ``accepted`` (when given) fills
    with the connections it took, so a test can wait for calls to be hanging."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = [] if accepted is None else accepted
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                accepted.append(conn)
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(2)
        for conn in accepted:
            conn.close()
        listener.close()


def loopback_resolver(calls: list[str] | None = None) -> Callable[[str, int], list[str]]:
    """Every name resolves to 127.0.0.1 (records the names asked for)."""

    def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append(host)
        return ["127.0.0.1"]

    return resolve


def new_secret() -> str:
    """A fresh Standard Webhooks signing secret."""
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def elapsed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


# --- a receiver that drips its answer -----------------------------------------

DRIP_MODES = ("status", "headers", "body")


@dataclass
class DripReceiver:
    """Reads each request, then answers one byte at a time: ``status`` drips an
    endless status line, ``headers`` endless header lines, ``body`` a 200 with
    a body that never ends. Per-``recv`` timeouts never fire against it."""

    scheme: str = "http"
    port: int = 0
    requests: int = 0
    open_connections: int = 0

    def url(self, path: str = "/drip", host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"


@contextmanager
def drip_receiver(
    mode: str, tls: LocalCA | None = None, interval: float = 0.05, lasts: float = 30.0
) -> Iterator[DripReceiver]:
    assert mode in DRIP_MODES
    state = DripReceiver(scheme="https" if tls else "http")
    server_context = tls.server_context() if tls else None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    state.port = listener.getsockname()[1]
    stop = threading.Event()
    # What goes out at once, then the bytes dripped (cycled) after it.
    head, unit = {
        "status": (b"HTTP/1.1 200 ", b"O"),
        "headers": (b"HTTP/1.1 200 OK\r\n", b"X-Drip: 1\r\n"),
        "body": (b"HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\n\r\n", b"x"),
    }[mode]

    def serve(conn: socket.socket) -> None:
        state.open_connections += 1
        try:
            conn.settimeout(2)
            if server_context is not None:
                conn = server_context.wrap_socket(conn, server_side=True)
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                received += chunk
            state.requests += 1
            ends = time.monotonic() + lasts
            conn.sendall(head)
            position = 0
            while not stop.is_set() and time.monotonic() < ends:
                conn.sendall(unit[position % len(unit) : position % len(unit) + 1])
                position += 1
                stop.wait(interval)
        except OSError:
            pass  # the client gave up and closed: what we want
        finally:
            state.open_connections -= 1
            conn.close()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        stop.set()
        thread.join(2)
        listener.close()
