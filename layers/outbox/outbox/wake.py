"""Wake on enqueue: nudge the dispatcher once a producer's transaction commits.

Opt-in. With ``OUTBOX_DISPATCHER_FUNCTION`` set (or ``configure(...)`` called),
``outbox.enqueue`` arms the caller's transaction, and when it commits a
background thread invokes the dispatcher function asynchronously with
``NUDGE``. The dispatcher's schedule stays the safety net: a nudge that is lost,
throttled or refused only costs latency, so every failure here is logged and
swallowed, and the producer's transaction never waits on Lambda.

How it keeps that promise:

* After the commit, never before it. SQLAlchemy's ``commit`` event runs just
  *before* the DBAPI commit, so it only hands a ticket (the connection and its
  transaction) to the thread, which sends once the connection has left that
  transaction by committing it. A COMMIT that fails cancels its ticket, and a
  transaction that rolls back never makes one. An ORM ``Session`` commits
  through the same Core connection, so it takes the same path; a savepoint's
  release is not a commit and waits for the outer one. On an AUTOCOMMIT connection the row is
  committed by its own statement, so the nudge is asked for at once.
* Coalesced. One thread per process sends at most one Invoke at a time and at
  most one every ``MIN_INTERVAL_SECONDS``; every commit in between shares the
  next one. A burst of thousands of enqueues makes a handful of calls.
* Off the hot path. ``enqueue`` adds a listener once per engine and a
  dictionary write per transaction; botocore is imported by the thread, only
  when the setting is on (``import outbox`` stays light).
* Bad settings are loud once: a function Lambda does not know or may not be
  invoked by this producer logs one WARNING for the process; a throttle is
  dropped quietly (a run already going, or the schedule, finds the row).
* Forks and exits: a forked child starts its own thread and client on its
  first commit; at exit a pending nudge is flushed for at most
  ``EXIT_FLUSH_SECONDS``.

Pure standard library and SQLAlchemy Core: ``outbox.producer`` imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

from . import aws, settings
from .errors import ConfigError

logger = logging.getLogger(__name__)

# The agreed event: the dispatcher accepts it as "something was just enqueued".
NUDGE = b'{"version": 1, "source": "outbox.nudge"}'
# At most one Invoke per interval per process. The dispatcher a nudge starts
# lingers a few seconds for rows that commit after it (pacing), so commits
# within a second of the last nudge are found by the run it started.
MIN_INTERVAL_SECONDS = 1.0
# A process exiting right after its last commit still sends that nudge, but
# never waits longer than this for Lambda.
EXIT_FLUSH_SECONDS = 2.0
# How long the thread waits for a committing connection to finish its COMMIT
# before giving the ticket up (a COMMIT that slow has bigger problems).
COMMIT_WAIT_SECONDS = 30.0
# Errors that mean the setting is wrong (or the producer lacks the grant), not
# that Lambda had a bad moment.
_MISCONFIGURED = {
    "ResourceNotFoundException",
    "AccessDeniedException",
    "AccessDenied",
    "InvalidParameterValueException",
    "UnrecognizedClientException",
}
_THROTTLED = {"TooManyRequestsException", "ThrottlingException", "Throttling"}


def dispatcher_function(env: Mapping[str, str]) -> str | None:
    """The function ``env`` names for nudges (``OUTBOX_DISPATCHER_FUNCTION``);
    ConfigError when the text cannot be a Lambda function's name or ARN."""
    return settings.OUTBOX_DISPATCHER_FUNCTION.read(env)


@dataclass(eq=False)
class _Ticket:
    """One committing transaction, until the thread knows how it ended."""

    connection: sa.Connection | None  # None: committed already (autocommit)
    transaction: Any = None
    cancelled: bool = False

    def outcome(self) -> bool | None:
        """True once committed, False once rolled back, None while committing."""
        if self.cancelled:
            return False
        if self.connection is None:
            return True
        # The connection drops its transaction only when the COMMIT succeeded;
        # a failed one cancels the ticket first (_on_error).
        if self.connection.get_transaction() is not self.transaction:
            return True
        return None


@dataclass(eq=False)
class Nudger:
    """Sends coalesced nudges to one function from a daemon thread."""

    function: str
    client: Any = None  # the caller's boto3 Lambda client; None: made on first use
    min_interval: float = MIN_INTERVAL_SECONDS
    sent: int = 0  # Invoke calls Lambda accepted (for tests and the bench)
    _tickets: list[_Ticket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _wanted: threading.Event = field(default_factory=threading.Event)
    _closing: bool = False
    _thread: threading.Thread | None = None
    _warned: set[str] = field(default_factory=set)
    _own_client: Any = None

    def submit(self, ticket: _Ticket) -> None:
        """Ask for a nudge once ``ticket``'s transaction has committed (hot path)."""
        with self._lock:
            self._tickets.append(ticket)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="outbox-wake", daemon=True)
                self._thread.start()
        self._wanted.set()

    def close(self, timeout: float = EXIT_FLUSH_SECONDS) -> None:
        """Send what is pending now, without the interval, and stop the thread."""
        self._closing = True
        self._wanted.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # --- the thread ------------------------------------------------------------

    def _run(self) -> None:
        # The client first: a process that exits right after its commit can no
        # longer import what a client needs once the interpreter is shutting down.
        with contextlib.suppress(Exception):  # the first nudge reports it
            self._client()
        while True:
            self._wanted.wait()
            with self._lock:
                self._wanted.clear()
                tickets, self._tickets = self._tickets, []
            if tickets and self._committed(tickets):
                started = time.monotonic()
                self._invoke()
                if not self._closing:
                    # Commits during the wait share the next nudge.
                    self._sleep_until(started + self.min_interval)
            if self._closing and not self._tickets:
                return

    def _committed(self, tickets: list[_Ticket]) -> bool:
        """Whether any of ``tickets`` committed, waiting for those still committing."""
        deadline = time.monotonic() + COMMIT_WAIT_SECONDS
        pause = 0.0005
        while tickets:
            outcomes = [t.outcome() for t in tickets]
            if True in outcomes:
                return True
            tickets = [t for t, done in zip(tickets, outcomes, strict=True) if done is None]
            if not tickets or time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return False

    def _sleep_until(self, moment: float) -> None:
        while not self._closing and (left := moment - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))

    def _invoke(self) -> None:
        try:
            client = self._client()
            client.invoke(FunctionName=self.function, InvocationType="Event", Payload=NUDGE)
        except Exception as exc:  # a nudge never fails the producer
            self._failed(exc)
        else:
            self.sent += 1

    def _client(self) -> Any:
        if self.client is not None or self._own_client is not None:
            return self.client or self._own_client
        # Made here, in the thread: producers without the setting never load botocore.
        region = self.function.split(":")[3] if self.function.startswith("arn:") else None
        self._own_client = aws.nudge_client(region)
        return self._own_client

    def _failed(self, exc: Exception) -> None:
        code = aws.error_code(exc) or ""
        if code in _THROTTLED:
            logger.debug("outbox wake: Lambda throttled the nudge to %s", self.function)
        elif isinstance(exc, ImportError):
            self._warn_once(
                "no botocore",
                "outbox wake: OUTBOX_DISPATCHER_FUNCTION is set but boto3 is not installed "
                "(pip install boto3); messages go out on the dispatcher's schedule",
            )
        elif code in _MISCONFIGURED:
            self._warn_once(
                "misconfigured",
                "outbox wake: cannot invoke the dispatcher %r (%s); messages still go out "
                "on the dispatcher's schedule. Check OUTBOX_DISPATCHER_FUNCTION and the "
                "producer's lambda:InvokeFunction grant (docs/how-to/wake-on-enqueue.md)",
                self.function,
                code or type(exc).__name__,
            )
        else:
            self._warn_once(
                code or type(exc).__name__,
                "outbox wake: a nudge to %r failed (%s); messages still go out on the "
                "dispatcher's schedule",
                self.function,
                code or type(exc).__name__,
            )

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind in self._warned:
            logger.debug(message, *args)
        else:
            self._warned.add(kind)
            logger.warning(message, *args)


# --- the process's nudger ------------------------------------------------------------

_UNSET: Any = object()
_state_lock = threading.Lock()
_nudger: Nudger | None = _UNSET  # _UNSET: read OUTBOX_DISPATCHER_FUNCTION on first use
# Connections we listen on, and the transaction of each that enqueued.
_engines: weakref.WeakSet[sa.Engine] = weakref.WeakSet()
_listening: weakref.WeakSet[sa.Connection] = weakref.WeakSet()
_armed: weakref.WeakKeyDictionary[sa.Connection, Any] = weakref.WeakKeyDictionary()
_committing: weakref.WeakKeyDictionary[sa.Connection, _Ticket] = weakref.WeakKeyDictionary()


def configure(dispatcher_function: str | None, *, client: Any = None) -> None:
    """Nudge ``dispatcher_function`` (a Lambda function name or ARN) after each
    commit that enqueued, instead of what ``OUTBOX_DISPATCHER_FUNCTION`` says;
    ``None`` turns nudges off. ``client``: your own boto3 Lambda client (a
    session, region or endpoint of your choice). ConfigError for a name that
    cannot be a function's."""
    global _nudger
    if dispatcher_function is not None:
        settings.OUTBOX_DISPATCHER_FUNCTION.parse(dispatcher_function)
    with _state_lock:
        _replace(
            None if dispatcher_function is None else Nudger(dispatcher_function, client=client)
        )


def reset() -> None:
    """Forget ``configure``: the next enqueue reads ``OUTBOX_DISPATCHER_FUNCTION`` again."""
    with _state_lock:
        _replace(_UNSET)


def current() -> Nudger | None:
    """The process's nudger, None when nudges are off."""
    global _nudger
    nudger = _nudger
    if nudger is _UNSET:
        with _state_lock:
            if _nudger is _UNSET:
                _nudger = _from_environment()
            nudger = _nudger
    return nudger


def _from_environment() -> Nudger | None:
    try:
        function = dispatcher_function(os.environ)
    except ConfigError as exc:
        logger.warning("outbox wake: nudges are off: %s", exc)
        return None
    return None if function is None else Nudger(function)


def _replace(new: Nudger | None) -> None:
    global _nudger
    old, _nudger = _nudger, new
    if isinstance(old, Nudger):
        old.close(timeout=0)


def arm(conn: sa.Connection) -> None:
    """Nudge the dispatcher once ``conn``'s transaction commits (called by
    ``enqueue`` after its insert; a no-op when nudges are off)."""
    nudger = current()
    if nudger is None:
        return
    if conn._is_autocommit_isolation():
        nudger.submit(_Ticket(None))  # the insert committed by itself
        return
    transaction = conn.get_transaction()
    if _armed.get(conn) is transaction:
        return  # this transaction has enqueued before
    if conn not in _listening:
        _listen(conn)
    _armed[conn] = transaction


def _listen(conn: sa.Connection) -> None:
    """Hear ``conn``'s commits and errors. Once per engine: the connections it
    makes from then on hear the engine's listener (adding one costs more than
    an enqueue's statement); a connection made before that gets its own."""
    engine = conn.engine
    if engine not in _engines:
        event.listen(engine, "commit", _on_commit)
        # SQLAlchemy takes this hook per dialect (per engine), not per connection.
        event.listen(engine, "handle_error", _on_error)
        _engines.add(engine)
    if _on_commit not in list(conn.dispatch.commit):
        event.listen(conn, "commit", _on_commit)
    _listening.add(conn)


def _on_commit(conn: sa.Connection) -> None:
    # Before the DBAPI commit: the ticket waits in the thread until it is done.
    transaction = _armed.pop(conn, None)
    if transaction is None or transaction is not conn.get_transaction():
        return  # this transaction enqueued nothing
    nudger = current()
    if nudger is None:
        return
    ticket = _Ticket(conn, transaction)
    _committing[conn] = ticket
    nudger.submit(ticket)


def _on_error(context: sa.engine.ExceptionContext) -> None:
    # A COMMIT that fails (a deferred constraint, a serialization failure, a
    # lost connection) raises through here while the connection still holds
    # the transaction; a rolled-back one needs nothing: its transaction will
    # never be the one a commit event sees.
    conn = context.connection
    ticket = None if conn is None else _committing.pop(conn, None)
    if conn is not None and ticket is not None and ticket.transaction is conn.get_transaction():
        ticket.cancelled = True


def _after_fork_in_child() -> None:
    # The parent's thread did not come along, and a client the nudger made
    # (its connection pool) must not be shared; the caller's own client stays.
    global _nudger, _state_lock
    _state_lock = threading.Lock()
    if isinstance(_nudger, Nudger):
        _nudger = Nudger(_nudger.function, client=_nudger.client, min_interval=_nudger.min_interval)


def _flush_at_exit() -> None:
    nudger = _nudger
    if isinstance(nudger, Nudger):
        nudger.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_flush_at_exit)
