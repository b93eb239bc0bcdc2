"""Signed webhooks over HTTPS, following the Standard Webhooks specification.

Every request carries ``webhook-id`` (``msg_<outbox id>``: the same on every
retry of a message, the receiver's idempotency key), ``webhook-timestamp``
(Unix seconds) and ``webhook-signature`` (``v1,<base64 HMAC-SHA256 of
"id.timestamp.body">``, one per secret, space-separated, while a secret is
being rotated). The body is ``{"type": event_type, "timestamp": ..., "data": body}``.

The signing secret lives in Secrets Manager (the payload's ``secret_id``, which
must be one the operator listed in ``WEBHOOK_SECRET_ARNS``, else the function's
``WEBHOOK_SECRET_ARN``) as one or more whitespace-separated
``whsec_<base64>`` values, read through Powertools Parameters (cached) and
never logged. The destination passes the SSRF guard (``outbox.netguard``):
resolved once, checked, and connected to by address while TLS still verifies
the certificate for the host name. Redirects are never followed and at most
``MAX_RESPONSE_BYTES`` of a response body are read. A connection whose
answer was read in full, with nothing after it, is kept for the next call
to the same checked address, port and name (``IdleConnections``), so a
receiver is not made to accept a new connection, and a TLS handshake, for
every message.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import re
import ssl
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

from .. import aws, netguard
from ..errors import ValidationError
from ..settings import WEBHOOK_ALLOW_INSECURE, WEBHOOK_SECRET_ARN, WEBHOOK_SECRET_ARNS
from ..watchdog import WATCHDOG
from . import Deadline, Message, Outcome, SchemaChannel
from .aws import THROTTLE_DELAY_SECONDS

MAX_RESPONSE_BYTES = 64 * 1024
SECRET_MAX_AGE_SECONDS = 300
CONNECT_TIMEOUT_SECONDS = 5.0
CUTOFF_LEAD_SECONDS = 0.1
MAX_RETRY_AFTER_SECONDS = 3600.0
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Retry-After means "come back then" only on these (RFC 9110: 503, and 429 of
# RFC 6585); on any other status it is ignored and the backoff applies.
RETRY_AFTER_STATUSES = frozenset({429, 503})
USER_AGENT = "outbox-relay-webhooks/1"
SECRET_PREFIX = "whsec_"  # noqa: S105 (the Standard Webhooks secret prefix)
# A kept connection is reused only within this many seconds of its last
# answer: under the idle timeouts of common servers (Node.js 5 s, AWS load
# balancers 60 s, nginx 75 s), so that a server seldom closes one just as it
# is reused, and a Lambda environment thawed after a while starts afresh.
KEEP_ALIVE_SECONDS = 4.0
# Idle connections kept per target (more than a sender's threads,
# SEND_CONCURRENCY, 8 by default), and targets kept (the least recent go).
IDLE_PER_TARGET = 16
IDLE_TARGETS = 64
_Key = tuple[str, str, int, str]  # scheme, checked address, port, TLS server name


def webhook_id(message_id: int) -> str:
    """Stable for every attempt of one outbox message."""
    return f"msg_{message_id}"


def parse_secrets(value: str | bytes) -> list[bytes]:
    """The signing keys in a secret value: ``whsec_<base64>`` tokens separated
    by whitespace (several during a rotation). Errors never echo the value."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    keys = []
    for token in str(value).split():
        raw = token.removeprefix(SECRET_PREFIX)
        raw += "=" * (-len(raw) % 4)  # unpadded base64 is common in whsec_ secrets
        try:
            key = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("signing secret is not whsec_<base64>") from None
        if len(key) < 16:
            raise ValueError("signing secret is shorter than 16 bytes")
        keys.append(key)
    if not keys:
        raise ValueError("signing secret is empty")
    return keys


def signature(keys: list[bytes], msg_id: str, timestamp: int, body: str) -> str:
    signed = f"{msg_id}.{timestamp}.{body}".encode()
    return " ".join(
        "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
        for key in keys
    )


_DELAY_SECONDS = re.compile(r"[0-9]+")


def retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header, capped; None when it is not
    one of RFC 9110's two forms: ASCII digits (``str.isdigit`` would take ``²``
    and ``١٢``) or an HTTP date. Whatever the receiver sent, never an exception."""
    if not value:
        return None
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):
        return min(float(value), MAX_RETRY_AFTER_SECONDS)  # (very many digits: inf, capped)
    if not value.isascii():
        return None
    try:
        when = parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def classify_status(status: int, headers: Any = None) -> Outcome:
    """What an HTTP status means for the message."""
    if 200 <= status < 300:
        return Outcome.delivered()
    if 300 <= status < 400:
        return Outcome.failed(f"HTTP {status}: redirect not followed")
    if status == 410:
        return Outcome.failed("HTTP 410: endpoint gone")
    if status in RETRY_AFTER_STATUSES:
        # The receiver asks the relay to slow down: the whole destination waits
        # (until Retry-After when it says, else the relay's own backoff), and
        # no attempt or deferral is counted for any message.
        delay = retry_after(headers.get("Retry-After") if headers is not None else None)
        if delay is not None:
            return Outcome.throttled(f"HTTP {status} with Retry-After", delay)
        return Outcome.throttled(f"HTTP {status}")
    if status in RETRY_STATUSES or 500 <= status < 600:
        return Outcome.retry(f"HTTP {status}")
    if 400 <= status < 500:
        return Outcome.failed(f"HTTP {status}")
    # 1xx as a final answer, or 600 and up: not HTTP semantics anyone agreed
    # on. Transient, as the calendar worker this replaces treats the unknown.
    return Outcome.retry(f"HTTP {status}: unexpected status")


def _connection_outcome(exc: Exception, out_of_time: bool) -> Outcome:
    """A POST that got no status line: always worth another try."""
    import urllib3

    if isinstance(exc, urllib3.exceptions.NewConnectionError):  # (a ConnectTimeoutError)
        return Outcome.retry("connection failed (refused or unreachable)")
    if out_of_time or isinstance(exc, TimeoutError | urllib3.exceptions.ConnectTimeoutError):
        return Outcome.retry("timeout: no answer before the deadline")
    from urllib3.util.ssl_match_hostname import CertificateError

    if isinstance(exc, ssl.SSLError | CertificateError | urllib3.exceptions.SSLError):
        return Outcome.retry("TLS handshake or certificate check failed")
    return Outcome.retry(f"connection failed ({type(exc).__name__})")


def _nothing_unread(conn: Any) -> bool:
    """Whether ``conn`` is open with nothing waiting to be read on it. Between
    answers there is nothing to read: an EOF means the receiver closed it, and
    anything else is an answer no request asked for, which the next request
    on this connection would take as its own. TLS decrypts whole records and
    keeps what the reader did not ask for inside the ``SSLSocket``, where
    ``select`` does not see it: ``pending`` does."""
    from urllib3.util.wait import wait_for_read

    sock = conn.sock
    if sock is None:
        return False
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False
    return not wait_for_read(sock, timeout=0.0)


class IdleConnections:
    """Connections that answered in full and may carry another request, by
    target: the scheme, the address the SSRF guard checked for this very
    call (the guard runs on every call, so a name that now resolves
    elsewhere is checked and gets a connection of its own), the port, and
    the TLS server name (a connection verified for one name never carries
    another name's request).

    Not urllib3's ``HTTPConnectionPool``: the deadline watchdog must hold a
    connection's socket from before its request is written, and that pool
    hands its connections out only through private methods."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: OrderedDict[_Key, list[tuple[float, Any]]] = OrderedDict()
        _every_idle_set.add(self)

    def take(self, key: _Key) -> Any | None:
        """A kept connection to ``key`` that is still open, else None."""
        now = time.monotonic()
        stale = []
        found = None
        with self._lock:
            kept = self._idle.get(key) or []
            while kept and found is None:
                since, conn = kept.pop()  # the most recent first
                # Checked again here: an EOF or a stray answer may have
                # come while it was idle.
                if now - since < KEEP_ALIVE_SECONDS and _nothing_unread(conn):
                    found = conn
                else:
                    stale.append(conn)
        for conn in stale:
            conn.close()
        return found

    def give(self, key: _Key, conn: Any) -> None:
        """Keep ``conn`` for the next call to ``key``."""
        closing = []
        with self._lock:
            kept = self._idle.setdefault(key, [])
            self._idle.move_to_end(key)
            if len(kept) < IDLE_PER_TARGET:
                kept.append((time.monotonic(), conn))
            else:
                closing.append(conn)
            while len(self._idle) > IDLE_TARGETS:
                closing.extend(c for _, c in self._idle.popitem(last=False)[1])
        for stale in closing:
            stale.close()

    def forget_in_child(self) -> None:
        """A forked process must not write on its parent's sockets."""
        self._lock = threading.Lock()
        self._idle = OrderedDict()


_every_idle_set: weakref.WeakSet[IdleConnections] = weakref.WeakSet()


def _forget_idle_in_child() -> None:
    for idle in list(_every_idle_set):
        idle.forget_in_child()


os.register_at_fork(after_in_child=_forget_idle_in_child)


class SecretUnavailable(Exception):
    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.error)
        self.outcome = outcome


class WebhookChannel(SchemaChannel):
    name = "webhook"
    schema: Mapping[str, Any] = {
        "type": "object",
        "required": ["url", "event_type", "body"],
        "additionalProperties": False,
        "properties": {
            "url": {"type": "string", "minLength": 8, "maxLength": 2048},
            "event_type": {"type": "string", "minLength": 1, "maxLength": 256},
            "body": {"type": "object"},
            "secret_id": {"type": "string", "minLength": 1, "maxLength": 2048},
        },
    }

    def __init__(
        self,
        *,
        allow_insecure: bool | None = None,
        default_secret_id: str | None = None,
        allowed_secret_ids: Iterable[str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        resolver: netguard.Resolver | None = None,
        secrets: Any = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        if allow_insecure is None:
            allow_insecure = WEBHOOK_ALLOW_INSECURE.read(os.environ)
        self.allow_insecure = allow_insecure
        self.default_secret_id = default_secret_id or WEBHOOK_SECRET_ARN.read(os.environ)
        if allowed_secret_ids is None:
            allowed_secret_ids = WEBHOOK_SECRET_ARNS.read(os.environ)
        # A payload's secret_id may name only the secrets the operator listed:
        # otherwise any producer could have any body signed with any key.
        self.allowed_secret_ids = frozenset(allowed_secret_ids) | (
            {self.default_secret_id} if self.default_secret_id else set()
        )
        self.resolver = resolver
        self.max_response_bytes = max_response_bytes
        self._ssl_context = ssl_context
        self._secrets = secrets
        self._secret_locks: dict[str, threading.Lock] = {}
        self._secret_locks_lock = threading.Lock()
        self._libraries_quiet = False
        self._idle = IdleConnections()

    @property
    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            context = ssl.create_default_context()
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            self._ssl_context = context
        return self._ssl_context

    @property
    def secrets(self) -> Any:
        with self._secret_locks_lock:  # one provider (one cache) for every thread
            if self._secrets is None:
                from aws_lambda_powertools.utilities.parameters import SecretsProvider

                self._secrets = SecretsProvider(boto3_client=aws.client("secretsmanager"))
            return self._secrets

    def check(self, payload: dict[str, Any]) -> None:
        try:
            netguard.check_url(payload["url"], allow_insecure=self.allow_insecure)
        except netguard.ForbiddenDestination as exc:
            raise ValidationError("payload.url", str(exc)) from None

    def _secret_lock(self, secret_id: str) -> threading.Lock:
        with self._secret_locks_lock:
            return self._secret_locks.setdefault(secret_id, threading.Lock())

    def signing_keys(self, secret_id: str) -> list[bytes]:
        try:
            # Single flight: a cold batch's send threads all want the same
            # key at once; one asks Secrets Manager, the others then read the
            # provider's cache (each of them a GetSecretValue call before).
            with self._secret_lock(secret_id):
                value = self.secrets.get(secret_id, max_age=SECRET_MAX_AGE_SECONDS)
        except Exception as exc:
            # Powertools wraps the botocore error; classify the original.
            cause = exc.__cause__ or exc.__context__ or exc
            codes = aws.error_codes(cause)
            error = f"signing secret unavailable ({aws.describe(cause)})"
            if "ResourceNotFoundException" in codes:
                raise SecretUnavailable(Outcome.failed(error)) from None
            if aws.is_throttling(codes):
                raise SecretUnavailable(Outcome.deferred(error, THROTTLE_DELAY_SECONDS)) from None
            raise SecretUnavailable(Outcome.retry(error)) from None
        try:
            return parse_secrets(value)
        except ValueError as exc:
            raise SecretUnavailable(Outcome.failed(str(exc))) from None

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        if not self._libraries_quiet:
            # urllib3 logs each request line (path and query: where tokens hide)
            # at DEBUG; observability keeps it quiet. Here, not at construction:
            # a producer validating a payload must not need the Lambda runtime.
            from ..observability import quiet_libraries

            quiet_libraries()
            self._libraries_quiet = True
        p = message.payload
        secret_id = p.get("secret_id") or self.default_secret_id
        if not secret_id:
            return Outcome.failed("no signing secret: set payload.secret_id or WEBHOOK_SECRET_ARN")
        if secret_id not in self.allowed_secret_ids:
            return Outcome.failed(
                "payload.secret_id is not a signing secret this function may use "
                "(WEBHOOK_SECRET_ARNS, template parameter WebhookSecretArns)"
            )
        try:
            keys = self.signing_keys(secret_id)
        except SecretUnavailable as exc:
            return exc.outcome
        try:
            target = netguard.resolve(
                p["url"], allow_insecure=self.allow_insecure, resolver=self.resolver
            )
        except netguard.ForbiddenDestination as exc:
            return Outcome.failed(f"destination refused: {exc}")
        except OSError as exc:
            return Outcome.retry(f"DNS lookup failed ({type(exc).__name__})")

        msg_id = webhook_id(message.id)
        timestamp = int(time.time())
        body = json.dumps(
            {
                "type": p["event_type"],
                "timestamp": datetime.fromtimestamp(timestamp, UTC)
                .isoformat()
                .replace("+00:00", "Z"),
                "data": p["body"],
            },
            separators=(",", ":"),
            ensure_ascii=False,
        )
        headers = {
            "Host": target.host_header,
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(keys, msg_id, timestamp, body),
        }
        outcome = self._post(target, headers, body.encode("utf-8"), deadline)
        if outcome.kind == "delivered":
            return Outcome.delivered(msg_id)
        return outcome

    def _post(
        self, target: netguard.Target, headers: dict[str, str], body: bytes, deadline: Deadline
    ) -> Outcome:
        """One POST, over by the deadline whatever the receiver does, on a kept
        connection to the target when there is one."""
        key = (target.scheme, target.address, target.port, target.hostname)
        kept = self._idle.take(key)
        if kept is not None:
            outcome = self._exchange(kept, key, target, headers, body, deadline, reused=True)
            if outcome is not None:
                return outcome
            # The receiver closed the kept connection as the request went out
            # (its idle timeout ran out meanwhile), so the request is sent
            # once more on a new connection, as HTTP clients do. Had it reached
            # the receiver after all, the webhook-id is the same.
            if deadline.remaining() <= 0:
                return Outcome.retry("connection closed by the receiver")
        elif deadline.remaining() <= 0:
            return Outcome.deferred("deadline near: not started")
        outcome = self._exchange(
            self._connect(target), key, target, headers, body, deadline, reused=False
        )
        assert outcome is not None  # (None only for a kept connection)
        return outcome

    def _connect(self, target: netguard.Target) -> Any:
        """A new connection to the checked address (not yet opened: the
        request opens it, under the watchdog, with the timeout it sets)."""
        from urllib3.connection import HTTPConnection, HTTPSConnection

        if target.scheme == "https":
            # Connect to the checked address; SNI and the certificate check use the name.
            return HTTPSConnection(
                target.address,
                target.port,
                ssl_context=self.ssl_context,
                server_hostname=target.hostname,
                assert_hostname=target.hostname,
            )
        return HTTPConnection(target.address, target.port)

    def _exchange(
        self,
        conn: Any,
        key: _Key,
        target: netguard.Target,
        headers: dict[str, str],
        body: bytes,
        deadline: Deadline,
        *,
        reused: bool,
    ) -> Outcome | None:
        """The request and its answer on ``conn``: connect and the TLS
        handshake are bounded by a socket timeout (CPython applies it to the
        whole handshake and to the whole send), and the watchdog shuts the
        socket at the deadline, which ends a read that a dripping receiver
        would otherwise keep alive byte by byte. None when ``reused`` and the
        receiver had closed the connection before any answer."""
        remaining = deadline.remaining()
        keep = False
        try:
            # Cut a moment before the deadline: the sender stops waiting at
            # the deadline itself, and this call's answer should reach it.
            cutoff = max(remaining - CUTOFF_LEAD_SECONDS, 0.0)
            with WATCHDOG.guard(cutoff, lambda: conn.sock) as watch:
                try:
                    # For the connect and the send; request applies it to a kept socket too.
                    conn.timeout = max(min(remaining, CONNECT_TIMEOUT_SECONDS), 0.001)
                    conn.request(
                        "POST",
                        target.path,
                        body=body,
                        headers=headers,
                        preload_content=False,
                        decode_content=False,
                    )
                    conn.timeout = max(deadline.remaining(), 0.001)  # for the answer
                    response = conn.getresponse()
                except Exception as exc:
                    if reused and isinstance(exc, ConnectionError) and not watch.fired:
                        return None
                    return _connection_outcome(exc, watch.fired or deadline.expired())
                if watch.fired:
                    # Cut off mid-answer: http.client takes a truncated status
                    # line or header block as complete, so trust none of it.
                    response.close()
                    return Outcome.retry("timeout: no answer before the deadline")
                try:
                    # The status is the answer; a body that stalls or breaks changes nothing.
                    self._drain(response, deadline)
                except Exception:  # noqa: S110 - the receiver's own problem, ignored
                    pass
                finally:
                    # Kept only when the answer was read to its end in time, the
                    # receiver neither closed the connection nor said it would, and
                    # it sent nothing after the answer. An answer with neither a
                    # length nor chunked coding ends only at the connection's end:
                    # http.client closes the connection for it (conn.is_closed).
                    keep = (
                        response.isclosed()
                        and not watch.fired
                        and not conn.is_closed
                        and _nothing_unread(conn)
                    )
                    response.close()
                return classify_status(response.status, response.headers)
        finally:
            if keep:
                self._idle.give(key, conn)
            else:
                conn.close()

    def _drain(self, response: Any, deadline: Deadline) -> int:
        """Read (and drop) at most ``max_response_bytes`` of the body."""
        read = 0
        while read < self.max_response_bytes and not deadline.expired():
            chunk = response.read(min(16384, self.max_response_bytes - read), decode_content=False)
            if not chunk:
                break
            read += len(chunk)
        return read
