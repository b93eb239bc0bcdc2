"""Providers that admit a steady rate: the issue 21 table, through ``outbox
worker`` and through the Lambda path.

Two providers, each a token bucket that admits ``rate`` calls a second (one
second's worth at once) and refuses the rest:

* ``webhook``: a real HTTP receiver on 127.0.0.1 that answers ``429
  Retry-After: 1`` beyond its rate;
* ``ses``: the email channel (``EmailChannel``, its own ``classify``) over a
  stubbed ``sesv2`` client whose ``send_email`` raises botocore's
  ``ThrottlingException`` "Maximum sending rate exceeded." beyond its rate,
  after ``--ses-latency-ms`` a call (and "Daily message quota exceeded." once
  its quota is spent, for the quota cell).

Two ways to send:

* ``worker``: ``--workers`` command loops (``Worker.run``, as ``outbox worker
  --channels <channel>`` runs it) in this process;
* ``lambda``: the real dispatcher, senders and reaper through the Lambda
  simulator of tests/reliability (``lambda_sim.serving``): one queue for the
  channel function, ``--concurrency`` execution environments (its reserved
  concurrency), each with its own send threads.

With ``--limit`` the destination has a configured limit (``outbox limit set``:
that rate, burst one second's worth); without, the relay learns the rate from
the answers (docs/how-to/rate-limits.md). Figures: wall time from the start
to the last admitted call, against the ideal (the rows less the second's worth
the provider's bucket starts with, at its rate: "of the bound"); refused calls
(counted at the provider) per delivered message; the most calls admitted
within any one second ("busiest second"); attempts counted for throttling and
dead rows (from the database). The two-receiver cell (``--other-rows``) also
measures, after the relay, a bare ``http.client`` loop at the relay's
concurrency against a receiver like the unlimited one: the unlimited
receiver's rate is given against both (``other_of_bound``,
``other_of_bare_client``).

    .venv/bin/python -m bench.ratelimit --rows 600 --rate 20
    .venv/bin/python -m bench.ratelimit --path lambda --provider ses --rows 3000 --rate 10
    .venv/bin/python -m bench.ratelimit --rows 600 --rate 20 --limit 20 --workers 4
    .venv/bin/python -m bench.ratelimit --rows 300 --rate 10 --other-rows 3000
    .venv/bin/python -m bench.ratelimit --quota 500 --path lambda --provider ses --rows 2000
"""

from __future__ import annotations

import argparse
import bisect
import http.client
import http.server
import json
import multiprocessing
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from . import common

SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # a bench-only signing key
_TESTS = Path(__file__).resolve().parents[1] / "tests"
PROVIDERS = ("webhook", "ses")
PATHS = ("worker", "lambda")
# What SES answers past its rate, and once its daily quota is spent.
SES_RATE_EXCEEDED = "Maximum sending rate exceeded."
SES_QUOTA_EXCEEDED = "Daily message quota exceeded."


def _sender_instance() -> str:
    """The sender instance making this call: a simulated execution environment
    (its send threads are named after it), else this process (the worker
    loops of one process share its send threads)."""
    name = threading.current_thread().name
    return name.rsplit("-send_", 1)[0] if "-send_" in name else "process"


class Admitting:
    """A token bucket at the provider: ``rate`` a second, one second's worth at
    once (None: admits everything), each answer after ``latency`` seconds.
    With ``quota``: after that many admitted calls every call is refused as
    over quota, until ``quota`` is set to None."""

    def __init__(self, rate: float | None, latency: float = 0.0, quota: int | None = None) -> None:
        self.rate = rate
        self.latency = latency
        self.quota = quota
        self.tokens = rate or 0.0
        self.at = time.monotonic()
        self.admitted: list[float] = []  # when, on the monotonic clock
        self.refused = 0
        self.refused_at: list[float] = []
        # Calls the provider would have admitted but nobody made: tokens that
        # overflowed its full bucket (what a sender asking below the rate, or
        # resuming late after a pause, loses).
        self.unused = 0.0
        self.over_quota: Counter[str] = Counter()  # refused for the quota, by sender instance
        # Each refusal for the quota: (sender instance, call started, answered).
        self.quota_refusals: list[tuple[str, float, float]] = []
        self.lock = threading.Lock()

    def admit(self) -> bool:
        with self.lock:
            now = time.monotonic()
            if self.rate is not None:
                refilled = self.tokens + (now - self.at) * self.rate
                self.unused += max(0.0, refilled - self.rate)
                self.tokens = min(self.rate, refilled)
                self.at = now
                if self.tokens < 1:
                    self.refused += 1
                    self.refused_at.append(now)
                    return False
                self.tokens -= 1
            self.admitted.append(now)
            return True

    def quota_spent(self, call_started: float) -> bool:
        """Whether this call (started at ``call_started``) is refused for the
        quota (counted by the calling sender instance: a simulated
        environment, or the process)."""
        with self.lock:
            if self.quota is None or len(self.admitted) < self.quota:
                return False
            self.refused += 1
            instance = _sender_instance()
            self.over_quota[instance] += 1
            self.quota_refusals.append((instance, call_started, time.monotonic()))
            return True

    def started_after_hearing(self) -> Counter[str]:
        """By sender instance, the refused calls it started after it had heard
        its own first quota answer (the calls it could have kept back: those
        already under way on its other send threads cannot be called back)."""
        heard: dict[str, float] = {}
        for instance, _, answered in self.quota_refusals:
            heard[instance] = min(answered, heard.get(instance, answered))
        return Counter(
            instance for instance, started, _ in self.quota_refusals if started > heard[instance]
        )

    def busiest_second(self) -> int:
        """The most calls admitted within any one second."""
        times, most, first = sorted(self.admitted), 0, 0
        for last, at in enumerate(times):
            while at - times[first] >= 1.0:
                first += 1
            most = max(most, last - first + 1)
        return most


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog (read when the server binds, so a class attribute):
    # ten simulated environments open up to 80 connections at once, and the
    # default of 5 made the kernel reset some of them.
    request_queue_size = 512


@contextmanager
def receiver(rate: float | None, latency: float = 0.0) -> Iterator[tuple[Admitting, int]]:
    """A webhook receiver on 127.0.0.1: the bucket, and its port."""
    state = Admitting(rate, latency)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def parse_request(self) -> bool:
            # The request line has just been read: the receiver's latency runs
            # from here, so that this server's own parsing is not counted on
            # top of it (a receiver "with 20 ms latency" answers 20 ms after
            # the request came, not 20 ms after Python parsed it).
            self.arrived = time.monotonic()
            return super().parse_request()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            if state.latency:
                time.sleep(max(state.latency - (time.monotonic() - self.arrived), 0.0))
            if state.admit():
                self.send_response(200)
            else:
                self.send_response(429)
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _serve(rate: float | None, latency: float, ports: Any, stop: Any, results: Any) -> None:
    """A receiver in a process of its own until ``stop``; then what it admitted."""
    with receiver(rate, latency) as (state, port):
        ports.put(port)
        stop.wait()
        with state.lock:
            results.put((state.admitted, state.refused))


@contextmanager
def receiver_process(rate: float | None, latency: float = 0.0) -> Iterator[tuple[Admitting, int]]:
    """``receiver`` in a process of its own, as a real receiver is: in this
    process it would share the relay's interpreter lock, and at a few hundred
    calls a second the bench would measure the two taking turns. The bucket
    returned holds what the receiver admitted once the context has exited."""
    context = multiprocessing.get_context("spawn")
    ports, results, stop = context.Queue(), context.Queue(), context.Event()
    process = context.Process(
        target=_serve, args=(rate, latency, ports, stop, results), daemon=True
    )
    process.start()
    state = Admitting(rate, latency)
    try:
        yield state, ports.get(timeout=60)
    finally:
        stop.set()
        state.admitted, state.refused = results.get(timeout=60)
        process.join(timeout=10)


def bare_client_rate(latency: float, threads: int, calls: int = 1000) -> float:
    """The baseline of the two-receiver cell: what a bare ``http.client``
    loop, ``threads`` at once on kept connections and doing nothing else,
    gets from a receiver like the unlimited one (in a process of its own,
    each answer after ``latency``), in calls a second: what this machine
    allows a sender at that concurrency, measured in the same run."""
    with receiver_process(None, latency) as (_, port):
        left, lock = [calls], threading.Lock()

        def loop() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port)
            try:
                while True:
                    with lock:
                        if left[0] == 0:
                            return
                        left[0] -= 1
                    conn.request("POST", "/in", body=b'{"n":1}')
                    conn.getresponse().read()
            finally:
                conn.close()

        loops = [threading.Thread(target=loop) for _ in range(threads)]
        began = time.monotonic()
        for thread in loops:
            thread.start()
        for thread in loops:
            thread.join()
        return calls / (time.monotonic() - began)


class SesStub:
    """A ``sesv2`` client whose ``send_email`` admits what ``bucket`` admits and
    otherwise raises what SES raises: ``ThrottlingException`` "Maximum sending
    rate exceeded." past the rate, "Daily message quota exceeded." past the
    quota. Only ``send_email`` is called (the suppression check is off)."""

    def __init__(self, bucket: Admitting) -> None:
        self.bucket = bucket

    @staticmethod
    def _throttling(message: str) -> Exception:
        from botocore.exceptions import ClientError

        return ClientError(
            {
                "Error": {"Code": "ThrottlingException", "Message": message},
                "ResponseMetadata": {"HTTPStatusCode": 400},
            },
            "SendEmail",
        )

    def send_email(self, **request: Any) -> dict[str, Any]:
        started = time.monotonic()
        if self.bucket.latency:
            time.sleep(self.bucket.latency)
        if self.bucket.quota_spent(started):
            raise self._throttling(SES_QUOTA_EXCEEDED)
        if not self.bucket.admit():
            raise self._throttling(SES_RATE_EXCEEDED)
        return {"MessageId": str(uuid.uuid4())}


class _Secrets:
    def get(self, name: str, max_age: int = 0) -> str:
        return SECRET


def _insert_hooks(engine: sa.Engine, port: int, host: str, rows: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload) "
                "SELECT 'webhook', jsonb_build_object('url', CAST(:url AS text),"
                " 'event_type', 'bench', 'body', jsonb_build_object('n', g))"
                " FROM generate_series(1, :rows) AS g"
            ),
            {"url": f"http://{host}:{port}/in", "rows": rows},
        )


def _insert_emails(engine: sa.Engine, rows: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload) "
                f"SELECT 'email', {common.payload_sql()} FROM generate_series(1, :rows) AS g"
            ),
            {"rows": rows},
        )


def _register_webhook() -> None:
    from outbox import channels
    from outbox.channels.webhook import WebhookChannel

    channel = WebhookChannel(
        allow_insecure=True,
        default_secret_id="bench",
        resolver=lambda host, port: ["127.0.0.1"],
        secrets=_Secrets(),
    )
    channels.register("webhook", lambda: channel)


def _register_ses(bucket: Admitting) -> None:
    from outbox import channels
    from outbox.channels.email import EmailChannel

    channel = EmailChannel(client=SesStub(bucket), configuration_set="", check_suppression=False)
    channels.register("email", lambda: channel)


def _lambda_settings(channel: str, concurrency: int) -> Any:
    """The template's defaults (batch, chunk, send concurrency, lease, sender
    timeout, event age), the channel routed to its function: the simulator's
    scaled-down durations are for its retry windows, which throttling never
    reaches, while its one-second sender timeout would give up calls that a
    busy local receiver answers late."""
    from outbox.relay_settings import RelaySettings

    if str(_TESTS) not in sys.path:
        sys.path.insert(0, str(_TESTS))
    return RelaySettings(
        channel_functions={channel: f"{channel}-sender"},
        channel_concurrency={channel: concurrency},
    )


@contextmanager
def _senders(
    path: str, engine: sa.Engine, channel: str, workers: int, concurrency: int
) -> Iterator[Any]:
    """The relay sending ``channel``'s rows until the block ends; yields its settings."""
    if path == "worker":
        from outbox.relay_settings import RelaySettings
        from outbox.worker import Worker

        settings = RelaySettings()
        stop = threading.Event()
        threads = [
            threading.Thread(
                target=Worker(engine, settings, channels=[channel], stop=stop).run, daemon=True
            )
            for _ in range(workers)
        ]
        for thread in threads:
            thread.start()
        try:
            yield settings
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        return
    settings = _lambda_settings(channel, concurrency)
    from reliability import lambda_sim

    with lambda_sim.serving(engine, settings, {channel: concurrency}):
        yield settings


def _left(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM outbox_message WHERE status IN ('pending', 'claimed')"
                )
            ).scalar_one()
        )


def _wait_until(condition: Callable[[], bool], timeout: float, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return False


def _outcome_counts(engine: sa.Engine) -> tuple[dict[str, int], int, int, dict[int, int]]:
    """(rows by status, attempts counted (every provider here only throttles,
    so each would be counted for throttling), deferrals, delivered rows by
    their attempt count)."""
    with engine.connect() as conn:
        counts = {
            str(r[0]): int(r[1])
            for r in conn.execute(
                sa.text("SELECT status, count(*) FROM outbox_message GROUP BY status")
            )
        }
        outcomes = {
            str(r[0]): int(r[1])
            for r in conn.execute(
                sa.text("SELECT outcome, count(*) FROM outbox_attempt GROUP BY outcome")
            )
        }
        counted_errors = {
            str(r[0]): int(r[1])
            for r in conn.execute(
                sa.text(
                    "SELECT outcome || ': ' || COALESCE(error, ''), count(*) FROM outbox_attempt"
                    " WHERE outcome IN ('retry', 'failed', 'dead') GROUP BY 1"
                )
            )
        }
        if counted_errors:
            print("attempts counted:", counted_errors, file=sys.stderr)
        attempts = {
            int(r[0]): int(r[1])
            for r in conn.execute(
                sa.text(
                    "SELECT attempts, count(*) FROM outbox_message"
                    " WHERE status = 'delivered' GROUP BY attempts"
                )
            )
        }
    counted = sum(outcomes.get(o, 0) for o in ("retry", "failed", "dead"))
    return counts, counted, outcomes.get("deferred", 0), attempts


def _trace(engine: sa.Engine) -> dict[str, Any] | None:
    """The limited destination's learned rate now, and whether it is paused."""
    from outbox.store.rates import RATE_NOW_SQL

    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                f"SELECT {RATE_NOW_SQL} AS rate, d.paused_until > now() AS paused,"
                " d.throttled_total FROM outbox_destination AS d"
                " WHERE d.destination LIKE 'limited%' OR d.channel = 'email'"
            )
        ).first()
    if row is None:
        return None
    return {
        "rate": None if row.rate is None else round(float(row.rate), 2),
        "paused": bool(row.paused),
        "throttled": int(row.throttled_total),
    }


def _resume_gaps(rx: Admitting) -> list[float]:
    """For each run of refusals, the seconds from its first refused call to
    the next admitted one (a throttle's pause as the provider saw it)."""
    admitted, gaps, until = sorted(rx.admitted), [], 0.0
    for at in sorted(rx.refused_at):
        if at < until:
            continue
        after = bisect.bisect_right(admitted, at)
        if after == len(admitted):
            break
        until = admitted[after]
        gaps.append(round(until - at, 3))
    return gaps


def run(
    url: str,
    rows: int,
    rate: float,
    *,
    provider: str = "webhook",
    path: str = "worker",
    limit: float | None = None,
    workers: int = 1,
    concurrency: int = 10,
    other_rows: int = 0,
    other_latency: float = 0.02,
    ses_latency: float = 0.02,
    trace: bool = False,
    timeout: float | None = None,
) -> dict[str, Any]:
    """``rows`` to a ``provider`` admitting ``rate`` a second, sent along
    ``path`` (``workers`` command loops, or the Lambda path at reserved
    ``concurrency``); with ``limit``, a configured limit (rate, burst one
    second's worth) for that destination, else the relay learns it; with
    ``other_rows`` (webhook only), as many to a second receiver that admits
    everything, each answer after ``other_latency`` seconds, in the same run."""
    from outbox import store

    if path == "worker":
        # Loaded before the clock starts, as a worker process has its modules
        # before it sends: the cell times the relay, not Python's imports.
        import outbox.relay_settings
        import outbox.worker  # noqa: F401

    engine = common.engine_for(url, pool_size=4 * workers + concurrency + 4)
    started = 0.0
    samples: list[dict[str, Any]] = []
    other: Admitting | None = None
    try:
        with ExitStack() as stack:
            if provider == "webhook":
                _register_webhook()
                channel = "webhook"
                rx, port = stack.enter_context(receiver(rate))
                _insert_hooks(engine, port, "limited.bench", rows)
                destination = f"limited.bench:{port}"
                if other_rows:
                    other, other_port = stack.enter_context(receiver_process(None, other_latency))
                    _insert_hooks(engine, other_port, "other.bench", other_rows)
            else:
                channel, destination = "email", ""
                rx = Admitting(rate, ses_latency)
                _register_ses(rx)
                _insert_emails(engine, rows)
            if limit is not None:
                with engine.begin() as conn:
                    store.set_limit(conn, channel, destination, limit, limit)
            started = time.monotonic()
            rx.at, rx.tokens = started, rate  # the provider's bucket starts full, now
            settings = stack.enter_context(_senders(path, engine, channel, workers, concurrency))
            deadline = started + (timeout or max(120.0, 3 * rows / rate))
            while time.monotonic() < deadline:
                time.sleep(0.1)
                if trace:
                    samples.append(
                        {"t": round(time.monotonic() - started, 2), **(_trace(engine) or {})}
                    )
                if _left(engine) == 0:
                    break
            elapsed = max(rx.admitted) - started if rx.admitted else 0.0
        counts, counted, deferrals, by_attempts = _outcome_counts(engine)
        with engine.connect() as conn:
            learned = conn.execute(
                sa.text(
                    "SELECT rate FROM outbox_destination WHERE channel = :c AND destination = :d"
                ),
                {"c": channel, "d": destination},
            ).scalar_one_or_none()
    finally:
        engine.dispose()
    delivered = len(rx.admitted)
    # The provider's bucket starts full: one second's worth comes at once.
    ideal = max(rows - rate, 0) / rate
    cell: dict[str, Any] = {
        "path": path,
        "provider": provider,
        "rows": rows,
        "receiver_admits_per_s": rate,
        "limit_per_s": limit,
        "workers": workers if path == "worker" else None,
        "reserved_concurrency": concurrency if path == "lambda" else None,
        "wall_s": round(elapsed, 1),
        "ideal_s": round(ideal, 1),
        "of_bound": round(ideal / elapsed, 3) if elapsed else None,
        "refused_calls": rx.refused,
        "refused_per_delivered": round(rx.refused / max(delivered, 1), 4),
        "busiest_second": rx.busiest_second(),
        "attempts_counted_for_throttling": counted,
        "deferrals": deferrals,
        "delivered_by_attempts": by_attempts,
        "delivered": counts.get("delivered", 0),
        "dead": counts.get("dead", 0),
        "left": counts.get("pending", 0) + counts.get("claimed", 0),
        "learned_rate_per_s": None if learned is None else round(float(learned), 2),
        # The provider's unspent capacity, in seconds of its rate: the bound lost.
        "unused_at_provider_s": round(rx.unused / rate, 2),
        "batch_size": settings.batch_size,
        "send_concurrency": settings.send_concurrency,
    }
    if path == "lambda":
        cell["chunk_size"] = settings.handoff_chunk_size
    if provider == "ses":
        cell["ses_latency_ms"] = round(ses_latency * 1000)
    if other_rows and other is not None:
        span = max(other.admitted) - started
        senders = workers if path == "worker" else concurrency
        bound = senders * settings.send_concurrency / other_latency
        bare = bare_client_rate(other_latency, senders * settings.send_concurrency)
        first, last = min(other.admitted), max(other.admitted)
        steady = (len(other.admitted) - 1) / (last - first) if last > first else 0.0
        cell.update(
            other_rows=other_rows,
            other_latency_ms=round(other_latency * 1000),
            other_rows_per_s=round(other_rows / span, 1),
            other_first_call_s=round(first - started, 2),
            other_bound_rows_per_s=round(bound, 1),
            other_of_bound=round(other_rows / span / bound, 3),
            # From its first call to its last: the relay's start (its first
            # reaper pass and claims, the throttled receiver's first batch)
            # is not counted against what the receiver gets while sent to.
            other_steady_rows_per_s=round(steady, 1),
            other_steady_of_bound=round(steady / bound, 3),
            bare_client_rows_per_s=round(bare, 1),
            other_of_bare_client=round(other_rows / span / bare, 3),
            other_steady_of_bare_client=round(steady / bare, 3),
        )
    if trace:
        cell["trace"] = samples
        per_second = Counter(int(at - started) for at in rx.admitted)
        cell["admitted_per_second"] = [per_second[i] for i in range(int(elapsed) + 1)]
        cell["resume_gaps_s"] = _resume_gaps(rx)
    return cell


def run_quota(
    url: str,
    rows: int,
    quota: int,
    *,
    path: str = "lambda",
    workers: int = 1,
    concurrency: int = 10,
    ses_latency: float = 0.02,
    settle_seconds: float = 3.0,
) -> dict[str, Any]:
    """A daily quota spent mid-backlog: the SES stub admits ``quota`` calls,
    then answers "Daily message quota exceeded." to every call. The channel
    must pause within one batch (every sender instance makes at most one
    refused call after the first, bar calls already under way); after an
    operator's resume (the quota raised) every row is delivered with one
    attempt (none was counted while paused)."""
    from outbox import store

    engine = common.engine_for(url, pool_size=4 * workers + concurrency + 4)
    try:
        bucket = Admitting(None, ses_latency, quota=quota)
        _register_ses(bucket)
        _insert_emails(engine, rows)

        def paused() -> bool:
            with engine.connect() as conn:
                return any(p.channel == "email" for p in store.paused_channels(conn))

        started = time.monotonic()
        with _senders(path, engine, "email", workers, concurrency) as settings:
            paused_in_time = _wait_until(paused, timeout=120)
            paused_after = time.monotonic() - started
            time.sleep(settle_seconds)  # every sender instance has heard it and settled
            with bucket.lock:
                refused_while_paused = dict(bucket.over_quota)
                after_hearing = bucket.started_after_hearing()
                bucket.quota = None  # the quota is raised
            with engine.begin() as conn:
                store.resume_channel(conn, "email")
            drained = _wait_until(lambda: _left(engine) == 0, timeout=max(120.0, rows / 20))
        counts, counted, deferrals, attempts = _outcome_counts(engine)
    finally:
        engine.dispose()
    instances = len(refused_while_paused)
    refused = sum(refused_while_paused.values())
    return {
        "path": path,
        "provider": "ses",
        "rows": rows,
        "quota": quota,
        "workers": workers if path == "worker" else None,
        "reserved_concurrency": concurrency if path == "lambda" else None,
        "batch_size": settings.batch_size,
        "send_concurrency": settings.send_concurrency,
        "ses_latency_ms": round(ses_latency * 1000),
        "paused": paused_in_time,
        "paused_after_s": round(paused_after, 2),
        "refused_for_quota": refused,
        "sender_instances_refused": instances,
        "most_refused_by_one_instance": max(refused_while_paused.values(), default=0),
        "refused_by_instance": sorted(refused_while_paused.values(), reverse=True),
        # Of those, the calls an instance started after its own first refusal.
        "refused_started_after_hearing": sum(after_hearing.values()),
        "most_started_after_hearing_by_one_instance": max(after_hearing.values(), default=0),
        "drained_after_resume": drained,
        "delivered": counts.get("delivered", 0),
        "dead": counts.get("dead", 0),
        "attempts_counted_for_throttling": counted,
        "deferrals": deferrals,
        "delivered_by_attempts": attempts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--rate", type=float, default=20.0, help="the provider admits, a second")
    parser.add_argument("--provider", choices=PROVIDERS, default="webhook")
    parser.add_argument("--path", choices=PATHS, default="worker")
    parser.add_argument("--limit", type=float, default=None, help="a configured limit")
    parser.add_argument("--workers", type=int, default=1, help="worker loops (path worker)")
    parser.add_argument(
        "--concurrency", type=int, default=10, help="reserved concurrency (path lambda)"
    )
    parser.add_argument("--other-rows", type=int, default=0, help="to an unlimited receiver")
    parser.add_argument("--ses-latency-ms", type=float, default=20.0)
    parser.add_argument(
        "--quota", type=int, default=None, help="the quota cell: SES admits this many"
    )
    parser.add_argument("--trace", action="store_true", help="sample the learned rate")
    parser.add_argument("--output", type=Path, default=None, help="append the cell (JSON lines)")
    args = parser.parse_args(argv)
    undo = common.quiet_process()
    dbs = common.Databases(common.server_url())
    try:
        dbs.prepare_template()
        with dbs.fresh("ratelimit") as url:
            senders = {
                "path": args.path,
                "workers": args.workers,
                "concurrency": args.concurrency,
                "ses_latency": args.ses_latency_ms / 1000,
            }
            if args.quota is not None:
                cell = {
                    "name": "ratelimit_quota",
                    **run_quota(url, args.rows, args.quota, **senders),
                }
            else:
                cell = {
                    "name": "ratelimit",
                    **run(
                        url,
                        args.rows,
                        args.rate,
                        provider=args.provider,
                        limit=args.limit,
                        other_rows=args.other_rows,
                        trace=args.trace,
                        **senders,
                    ),
                }
    finally:
        dbs.close()
        undo()
    cell["command"] = "python -m bench.ratelimit " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    cell["at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.output is not None:
        with args.output.open("a") as out:
            out.write(json.dumps({k: v for k, v in cell.items() if k != "trace"}) + "\n")
    print(json.dumps(cell, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
