"""`make run`: the whole relay end to end on this machine, then exit 0.

    python -m outbox_cli.local

* Database: ``DATABASE_URL`` when set; else the Postgres on 127.0.0.1:5432
  when it answers; else an embedded Postgres (pgserver) in ``.local/pgdata``.
  On either of the last two, the demo's own database ``outbox_demo``: made
  with a marker comment, and dropped by the next run only when it still
  carries it and nobody is connected (a database of that name that the demo
  did not make is left alone). ``OUTBOX_DEV_DB=local`` (or ``embedded``,
  ``url``) forces a choice; ``OUTBOX_LOCAL_DBNAME`` and ``OUTBOX_LOCAL_PGDATA``
  change the database's name and the embedded server's folder.
* AWS: an in-process moto server on 127.0.0.1 with fake credentials; SES has
  the sender domain verified. Channels other than email get their provider
  set up when they exist (SNS platform endpoint, Secrets Manager webhook
  secret plus a local receiver that verifies signatures, ...).
* It migrates, enqueues a mix of messages (the outcomes each should reach are
  part of the scenario), then drives the real handlers from ``functions/``:
  dispatcher ticks that hand off through an in-process Lambda invoker to the
  channel functions, and reaper ticks, until every message is settled.

Development only: imports moto, pgserver and rich, which no Lambda ships
(the ``local`` extra: ``pip install -e '.[local]'``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from base64 import b64encode
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa

from outbox import channels, store
from outbox.channels import Deadline, Message, Outcome, SchemaChannel
from outbox.states import STATUSES, TERMINAL_STATUSES

from . import devdb, missing_extra
from .invoke import LambdaContext, load_module

REPO = Path(__file__).resolve().parents[2]
FUNCTIONS = REPO / "functions"
LOCAL_POSTGRES = devdb.LOCAL_POSTGRES
DEMO_DATABASE = os.environ.get("OUTBOX_LOCAL_DBNAME") or "outbox_demo"
PGDATA = Path(os.environ.get("OUTBOX_LOCAL_PGDATA") or REPO / ".local" / "pgdata")
SENDER_DOMAIN = "shop.example.com"
TIME_LIMIT_SECONDS = 60.0

# The relay's settings for the demo: short backoff so retries happen within seconds.
RELAY_ENV = {
    "BATCH_SIZE": "50",
    # A short lease, so the claim of a lost hand-off expires within the demo;
    # still longer than a sender may run plus an event may wait (docs/design.md, invariant 4).
    "LEASE_SECONDS": "5",
    "SENDER_TIMEOUT_SECONDS": "3",
    "MAX_EVENT_AGE_SECONDS": "1",
    "MAX_ATTEMPTS": "3",
    "BACKOFF_BASE_SECONDS": "0.2",
    "BACKOFF_CAP_SECONDS": "1",
    "MIN_DEFERRAL_SECONDS": "0.2",
    "DISPATCH_BUDGET_SECONDS": "0.4",
    "POLL_INTERVAL_SECONDS": "0.05",
    "SETTLE_MARGIN_SECONDS": "1",
    "RETENTION_DAYS": "7",
    "POWERTOOLS_SERVICE_NAME": "outbox",
    "POWERTOOLS_LOG_LEVEL": "ERROR",
    "POWERTOOLS_METRICS_DISABLED": "true",
    "POWERTOOLS_METRICS_NAMESPACE": "OutboxRelay",
    "POWERTOOLS_TRACE_DISABLED": "true",
}
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


# --- the demo's scripted channel ----------------------------------------------


class FlakyChannel(SchemaChannel):
    """Demo only (registered by this script, never in the relay): a provider
    that answers "try again" to the first ``fail_times`` attempts of a message.
    No local provider produces a transient failure on demand, so this one does."""

    name = "flaky"
    schema = {
        "type": "object",
        "required": ["fail_times"],
        "properties": {"fail_times": {"type": "integer", "minimum": 0}, "note": {"type": "string"}},
    }

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        if message.attempt <= message.payload["fail_times"]:
            return Outcome.retry(f"demo provider unavailable (attempt {message.attempt})")
        return Outcome.delivered(f"flaky-{message.id}-{uuid.uuid4().hex[:8]}")


# --- the scenario -------------------------------------------------------------


@dataclass
class DemoMessage:
    channel: str
    payload: Any
    expect: str  # the status it must end in
    note: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    lose_first_handoff: bool = False
    show_history: bool = False
    id: int = 0


@dataclass
class Demo:
    """What the providers hand the scenario: ARNs, URLs, received webhooks."""

    endpoint_url: str
    resources: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _client(service: str, demo: Demo) -> Any:
    import boto3

    make: Any = boto3.client  # the service is a plain str here, not a literal
    return make(service, endpoint_url=demo.endpoint_url, region_name="us-east-1")


def _email(demo: Demo) -> list[DemoMessage]:
    ses = _client("sesv2", demo)
    ses.create_email_identity(EmailIdentity=SENDER_DOMAIN)
    order = {"from": f"orders@{SENDER_DOMAIN}", "subject": "Your order shipped"}
    messages = [
        DemoMessage(
            "email",
            {
                **order,
                "to": [f"customer{i}@example.net"],
                "text": f"Order {1000 + i} is on its way.",
            },
            "delivered",
            options={
                "dedupe_key": f"order-{1000 + i}-shipped",
                "ordering_key": f"customer-{i % 3}",
            },
        )
        for i in range(24)
    ]
    messages.append(
        DemoMessage(
            "email",
            {
                **order,
                "from": "noreply@unverified.example.org",
                "to": ["ada@example.net"],
                "text": "x",
            },
            "failed",
            note="SES rejects an unverified sender (MessageRejected): a permanent failure",
        )
    )
    return messages


def _flaky(demo: Demo) -> list[DemoMessage]:
    return [
        DemoMessage(
            "flaky",
            {"fail_times": 0, "note": "lost hand-off"},
            "delivered",
            note="its first hand-off is lost (an event never run): the reaper takes the "
            "claim back when the lease ends without counting an attempt (no sender took "
            "it), the next hand-off delivers",
            lose_first_handoff=True,
            show_history=True,
        ),
        DemoMessage(
            "flaky",
            {"fail_times": 2, "note": "recovers"},
            "delivered",
            note="two transient failures, then delivered (scripted demo channel)",
            show_history=True,
        ),
        DemoMessage(
            "flaky",
            {"fail_times": 99, "note": "never recovers"},
            "dead",
            note="transient failures until MAX_ATTEMPTS is spent: dead (scripted demo channel)",
        ),
    ]


def _sms(demo: Demo) -> list[DemoMessage]:
    return [
        DemoMessage("sms", {"to": "+15555550100", "message": "Your code is 424242"}, "delivered"),
        DemoMessage(
            "sms",
            {"to": "+15555550199", "message": "Your code is 424242"},
            "suppressed",
            note="the number opted out of SMS (moto: numbers ending in 99): suppressed",
        ),
    ]


def _push(demo: Demo) -> list[DemoMessage]:
    sns = _client("sns", demo)
    app = sns.create_platform_application(
        Name="outbox-demo", Platform="GCM", Attributes={"PlatformCredential": "fake-server-key"}
    )["PlatformApplicationArn"]
    token = "demo-device-token"  # noqa: S105 - a fake device token for moto
    endpoint = sns.create_platform_endpoint(PlatformApplicationArn=app, Token=token)["EndpointArn"]
    demo.resources.update(platform_application_arn=app, endpoint_arn=endpoint)
    return [
        DemoMessage(
            "push",
            {"endpoint_arn": endpoint, "title": "Order shipped", "body": "On its way"},
            "delivered",
        )
    ]


def _webhook(demo: Demo) -> list[DemoMessage]:
    secret = "whsec_" + b64encode(os.urandom(24)).decode()
    arn = _client("secretsmanager", demo).create_secret(
        Name="outbox-demo/webhook", SecretString=secret
    )["ARN"]
    receiver = WebhookReceiver(secret)
    demo.resources["webhook_receiver"] = receiver
    # Local only: lets the webhook channel reach the receiver on 127.0.0.1 over
    # plain http. Off by default, and never set in template.yaml.
    demo.env.update(WEBHOOK_SECRET_ARN=arn, WEBHOOK_ALLOW_INSECURE="true")
    return [
        DemoMessage(
            "webhook",
            {"url": receiver.url, "event_type": "order.shipped", "body": {"order": 1001}},
            "delivered",
        )
    ]


def _eventbridge(demo: Demo) -> list[DemoMessage]:
    _client("events", demo).create_event_bus(Name="outbox-demo")
    demo.env.update(EVENT_BUS_NAME="outbox-demo")
    return [
        DemoMessage(
            "eventbridge",
            {"source": "shop.orders", "detail_type": "OrderShipped", "detail": {"order": 1002}},
            "delivered",
        )
    ]


def _sqs(demo: Demo) -> list[DemoMessage]:
    url = _client("sqs", demo).create_queue(QueueName="outbox-demo")["QueueUrl"]
    demo.resources["queue_url"] = url
    return [
        DemoMessage("sqs", {"queue_url": url, "body": json.dumps({"order": 1003})}, "delivered")
    ]


# channel -> provider set-up returning the messages it contributes. A channel
# takes part when the relay has it (outbox.channels.names()).
SCENARIO: dict[str, Callable[[Demo], list[DemoMessage]]] = {
    "email": _email,
    "sms": _sms,
    "push": _push,
    "webhook": _webhook,
    "eventbridge": _eventbridge,
    "sqs": _sqs,
    "flaky": _flaky,
}


# --- a local webhook receiver (Standard Webhooks signatures) -------------------


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 that answers 204 to correctly signed
    requests and 401 to anything else; it keeps what it accepted."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.received: list[dict[str, Any]] = []
        self.rejected = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.verify(body, dict(self.headers.items())):
                    receiver.received.append(json.loads(body or b"null"))
                    self.send_response(204)
                else:
                    receiver.rejected += 1
                    self.send_response(401)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/orders"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def verify(self, body: bytes, headers: dict[str, str]) -> bool:
        from standardwebhooks import Webhook

        try:
            Webhook(self.secret).verify(body, headers)
        except Exception:
            return False
        return True

    def close(self) -> None:
        self.server.shutdown()


# --- database and AWS ------------------------------------------------------------


@contextlib.contextmanager
def database(say: Callable[[str], None]) -> Iterator[str]:
    """The database URL to use, and say which one it is."""
    try:
        forced = devdb.dev_db_choice()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    url = os.environ.get("DATABASE_URL")
    if url and forced in ("", "url"):
        say("database: DATABASE_URL (your own database; the demo adds rows to it)")
        yield url
        return
    if forced == "url":
        raise SystemExit(f"{devdb.DEV_DB_VARIABLE}=url but DATABASE_URL is not set")
    if forced in ("", "local") and devdb.answers(LOCAL_POSTGRES):
        say(f"database: local Postgres on 127.0.0.1:5432, database {DEMO_DATABASE!r} (recreated)")
        yield _own_database(LOCAL_POSTGRES, say)
        return
    if forced == "local":
        raise SystemExit(f"{devdb.DEV_DB_VARIABLE}=local but no Postgres answers on 127.0.0.1:5432")
    shown = PGDATA.relative_to(REPO) if PGDATA.is_relative_to(REPO) else PGDATA
    problem = missing_extra("the embedded Postgres", "local", "pgserver")
    if problem is not None:
        raise SystemExit(f"Error: {problem}")
    say(f"database: embedded Postgres (pgserver) in {shown}")
    with devdb.embedded(PGDATA) as server_url:
        yield _own_database(server_url, say)


def _own_database(server_url: str, say: Callable[[str], None]) -> str:
    """The demo's database, made afresh: one an earlier run made is dropped and
    made again. One of the same name that the demo did not make (an older
    release's, or yours), or one in use (a --keep-running demo), is left alone,
    and the demo takes the next free name of its own instead."""
    names = [DEMO_DATABASE] + [f"{DEMO_DATABASE}_{n}" for n in range(2, 10)]
    for name in names:
        try:
            url = devdb.recreate_own_database(server_url, name)
        except devdb.NotOwnDatabase:
            say(f"database {name!r} exists without make run's mark: left alone")
            continue
        except devdb.DatabaseInUse:
            say(f"database {name!r} is in use (a --keep-running demo?): left alone")
            continue
        if name != DEMO_DATABASE:
            say(f"database: using {name!r} instead")
        return url
    raise SystemExit(
        f"databases {names[0]!r} to {names[-1]!r} are all taken or in use: drop those you no "
        "longer need, or pick another name with OUTBOX_LOCAL_DBNAME=<name>"
    )


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log lines
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


# --- driving the handlers ----------------------------------------------------------


def _load_function(role: str) -> Any:
    """Import functions/<role>/app.py (its cold start) and return its handler."""
    folder = FUNCTIONS / role
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return load_module(folder / "app.py", f"outbox_fn_{role}").handler


class LocalLambda:
    """The in-process Lambda service: each channel's function behind a
    synchronous invoke with a fresh context per event, as Lambda would."""

    def __init__(self, handlers: dict[str, Any], timeout_seconds: float) -> None:
        self.handlers = handlers
        self.timeout_seconds = timeout_seconds
        # Message ids whose first hand-off is lost, as if the function crashed
        # before it settled: their claims stay until the reaper takes them back.
        self.lose_once: set[int] = set()
        self.lost: list[int] = []
        self.invocations = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def target(self, channel: str) -> Callable[[dict[str, Any]], Any]:
        def invoke(event: dict[str, Any]) -> Any:
            with self._lock:
                self.invocations += 1
            # Lambda's Invoke serialises the payload: so do we.
            event = json.loads(json.dumps(event))
            with self._lock:
                lost = [m for m in event["messages"] if m["id"] in self.lose_once]
                self.lose_once -= {m["id"] for m in lost}
                self.lost.extend(m["id"] for m in lost)
            if lost:
                event["messages"] = [m for m in event["messages"] if m not in lost]
                if not event["messages"]:
                    return None
            context = LambdaContext(f"outbox-{channel}", self.timeout_seconds)
            try:
                return self.handlers[channel](event, context)
            except Exception as exc:
                # An async invoke that crashed: the claim stays until the reaper.
                with self._lock:
                    self.errors.append(f"{channel}: {type(exc).__name__}: {exc}")
                return None

        return invoke


def _flaky_handler() -> Any:
    from outbox.runtime import Runtime

    runtime = Runtime()

    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        return runtime.send("flaky", event, context)

    return handler


def main(argv: list[str] | None = None) -> int:
    import argparse

    problem = missing_extra("make run", "local", "rich", "moto", "boto3", "aws_lambda_powertools")
    if problem is not None:
        raise SystemExit(f"Error: {problem}")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from outbox import migrate
    from outbox.handoff import CallableInvoker

    parser = argparse.ArgumentParser(prog="python -m outbox_cli.local", description=__doc__)
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="after the demo, keep its database and moto server up (until Ctrl-C) "
        "for `outbox worker`, `outbox invoke` and the operator commands",
    )
    args = parser.parse_args(argv)
    out = Console(highlight=False, emoji=False)
    started = time.monotonic()
    own_database = os.environ.get("DATABASE_URL")
    channels.register("flaky", cast(channels.ChannelFactory, FlakyChannel))
    os.environ.update(FAKE_AWS)
    with contextlib.ExitStack() as stack:
        database_url = stack.enter_context(database(out.print))
        endpoint = stack.enter_context(moto_server())
        out.print(f"AWS: in-process moto server at {endpoint} (fake credentials)")
        os.environ.update({**RELAY_ENV, "DATABASE_URL": database_url, "AWS_ENDPOINT_URL": endpoint})
        os.environ.pop("DB_SECRET_ARN", None)
        os.environ.pop("DB_IAM_USER", None)

        from outbox.db import create_engine
        from outbox.relay_settings import DatabaseSettings

        engine = create_engine(DatabaseSettings.from_env(os.environ), pool_size=4)
        stack.callback(engine.dispose)
        out.print(f"schema: migrated to revision {migrate.upgrade(engine)}")

        # Providers and the message mix, for the channels the relay has.
        demo = Demo(endpoint)
        available = set(channels.names())
        mix: list[DemoMessage] = []
        for channel, setup in SCENARIO.items():
            if channel not in available:
                continue
            if channel != "flaky" and not (FUNCTIONS / channel / "app.py").is_file():
                out.print(f"[yellow]channel {channel}: no functions/{channel}/app.py yet; left out")
                continue
            mix.extend(setup(demo))
        receiver = demo.resources.get("webhook_receiver")
        if receiver is not None:
            stack.callback(receiver.close)
        os.environ.update(demo.env)
        os.environ["CHANNEL_FUNCTIONS"] = json.dumps(
            {c: f"outbox-{c}" for c in sorted({m.channel for m in mix})}
        )
        mix = _enqueue(engine, mix, out)
        in_play = sorted({m.channel for m in mix})
        out.print(
            f"enqueued {len(mix)} messages on {', '.join(in_play)}"
            + (
                f" (the relay also has: {', '.join(sorted(available - set(in_play)))})"
                if available - set(in_play)
                else ""
            )
        )

        # The real handlers, with the environment set (their cold start reads it).
        dispatcher = _load_function("dispatcher")
        reaper = _load_function("reaper")
        handlers = {}
        for channel in in_play:
            if (FUNCTIONS / channel / "app.py").is_file():
                handlers[channel] = _load_function(channel)
            elif channel == "flaky":
                handlers[channel] = _flaky_handler()
        lam = LocalLambda(handlers, float(RELAY_ENV["SENDER_TIMEOUT_SECONDS"]))
        lam.lose_once = {m.id for m in mix if m.lose_first_handoff}
        sys.modules["outbox_fn_dispatcher"].runtime._invoker = CallableInvoker(
            {c: lam.target(c) for c in handlers}
        )
        ids = [m.id for m in mix]

        ticks = reaps = reclaimed = 0

        def reap_tick(name: str) -> dict[str, Any]:
            nonlocal reaps, reclaimed
            reaps += 1
            result: dict[str, Any] = reaper(
                {"execution_id": f"demo-reap-{name}"}, LambdaContext("outbox-reaper", 60)
            )
            reclaimed += result["reclaimed"] + result["not_started"] + result["dead"]
            return result

        with Progress(
            TextColumn("[bold]draining"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=out,
        ) as progress:
            task = progress.add_task("drain", total=len(ids), detail="")
            while True:
                settled, counts = _progress(engine, ids)
                progress.update(
                    task,
                    completed=settled,
                    detail=" ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                )
                if settled == len(ids) or time.monotonic() - started > TIME_LIMIT_SECONDS:
                    break
                ticks += 1
                dispatched: dict[str, Any] = dispatcher(
                    {"execution_id": f"demo-dispatch-{ticks}"},
                    LambdaContext("outbox-dispatcher", 60),
                )
                # In sleep mode each dispatcher run starts with the reaper's
                # lease step (a run woken at a lease's end is for it).
                reclaimed += dispatched.get("released_leases", 0)
                if ticks % 5 == 0:
                    reap_tick(str(ticks))
        backlog = reap_tick("final")["backlog"]
        out.print(
            f"{ticks} dispatcher ticks, {lam.invocations} channel-function invocations "
            f"({len(lam.lost)} hand-off(s) lost on purpose), {reaps} reaper ticks "
            f"(expired claims taken back: {reclaimed}; backlog now: pending "
            f"{backlog['pending']}, claimed {backlog['claimed']})"
        )
        status = _report(engine, mix, lam, demo, out, Table, started)
        shown_url = None if database_url == own_database else _plain_url(database_url)
        secret_arn = demo.env.get("WEBHOOK_SECRET_ARN")
        for line in _next_steps(shown_url, endpoint, args.keep_running, secret_arn):
            out.print(line, soft_wrap=True, markup=False, highlight=False, emoji=False)
        if args.keep_running:
            stop = threading.Event()
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, lambda *_: stop.set())
            stop.wait()
        return status
    return 1  # pragma: no cover


def _plain_url(url: str) -> str:
    """The URL as a user types it (the driver is the relay's business)."""
    return url.replace("postgresql+pg8000://", "postgresql://", 1)


def _next_steps(
    database_url: str | None,
    endpoint: str,
    keep_running: bool,
    webhook_secret_arn: str | None = None,
) -> list[str]:
    """What to try next, printed at the end of the run. ``database_url`` is None
    for the user's own DATABASE_URL (never printed: it may hold a password).
    ``webhook_secret_arn``: the demo's signing secret in moto (an ARN, not the
    secret), so a webhook enqueued from another shell is signed as in the demo."""
    url = database_url or "$DATABASE_URL"
    embedded = database_url is not None and "127.0.0.1:5432" not in database_url
    lines = ["", "Next (docs/how-to/cli.md: After make run), in a shell in this folder:"]
    lines.append("  . .venv/bin/activate")
    if not keep_running:
        if not embedded:
            lines += [
                f"  export DATABASE_URL={url}",
                "  outbox status; outbox list --status dead,failed; outbox show <id>",
            ]
        lines.append(
            "  python -m outbox_cli.local --keep-running   # the same demo, then keeps its "
            "database and moto server up for `outbox worker` and `outbox invoke`"
        )
        return lines
    exports = " ".join(f"{k}={v}" for k, v in FAKE_AWS.items() if k != "AWS_SESSION_TOKEN")
    return [
        *lines,
        f"  export DATABASE_URL={url} AWS_ENDPOINT_URL={endpoint} {exports}",
        "  export WEBHOOK_ALLOW_INSECURE=true   # the demo's webhook receiver is plain http",
        *(
            [f"  export WEBHOOK_SECRET_ARN={webhook_secret_arn}   # signs webhooks (in moto)"]
            if webhook_secret_arn
            else []
        ),
        "  outbox status",
        "  outbox enqueue --channel email --payload "
        f'\'{{"from": "orders@{SENDER_DOMAIN}", "to": ["ada@example.net"], '
        '"subject": "Hi", "text": "Hello"}\'',
        "  outbox invoke EmailFunction --claim 10 --env-vars env.local.json   # one function, "
        "on the message just enqueued",
        "  outbox worker --until-empty   # or the whole relay in one process",
        "The database and the moto server stay up until Ctrl-C.",
    ]


def _enqueue(engine: sa.Engine, mix: list[DemoMessage], out: Any) -> list[DemoMessage]:
    """Enqueue through the producer API; a channel whose payload shape this
    script does not know is left out (said so), rather than failing the run."""
    import outbox

    kept: list[DemoMessage] = []
    for m in mix:
        try:
            with engine.begin() as conn:
                m.id = outbox.enqueue(conn, m.channel, m.payload, **m.options)
            kept.append(m)
        except outbox.ValidationError as exc:
            out.print(
                f"[yellow]skipped a {m.channel} message: the demo payload does not fit ({exc})"
            )
    return kept


def _progress(engine: sa.Engine, ids: list[int]) -> tuple[int, dict[str, int]]:
    with engine.connect() as conn:
        rows = store.statuses_of(conn, ids)
    counts: dict[str, int] = {}
    for status in rows.values():
        counts[status] = counts.get(status, 0) + 1
    settled = sum(n for s, n in counts.items() if s in TERMINAL_STATUSES)
    return settled, counts


def _report(
    engine: sa.Engine,
    mix: list[DemoMessage],
    lam: LocalLambda,
    demo: Demo,
    out: Any,
    table_cls: Any,
    started: float,
) -> int:
    with engine.connect() as conn:
        groups = [g for g in store.channel_status_counts(conn)]
        final = store.statuses_of(conn, [m.id for m in mix])
        histories = {m.id: store.attempt_history(conn, m.id) for m in mix if m.show_history}

    shown = [s for s in STATUSES if any(g.status == s for g in groups)]
    table = table_cls(title="messages per channel and status")
    table.add_column("channel")
    for s in shown:
        table.add_column(s, justify="right")
    by_channel: dict[str, dict[str, int]] = {}
    for g in groups:
        by_channel.setdefault(g.channel, {})[g.status] = g.count
    for channel, counts in sorted(by_channel.items()):
        table.add_row(channel, *(str(counts.get(s, "")) for s in shown))
    out.print(table)

    for m in mix:
        if m.id not in histories:
            continue
        attempts = table_cls(title=f"attempt history of message {m.id} ({m.channel}: {m.note})")
        for column in ("attempt", "outcome", "error", "provider id", "ms"):
            attempts.add_column(column)
        for a in histories[m.id]:
            attempts.add_row(
                str(a.attempt),
                a.outcome,
                a.error or "",
                a.provider_message_id or "",
                "" if a.duration_ms is None else str(a.duration_ms),
            )
        out.print(attempts)

    receiver = demo.resources.get("webhook_receiver")
    if receiver is not None:
        out.print(
            f"webhook receiver: {len(receiver.received)} verified, {receiver.rejected} rejected"
        )
    for m in mix:
        if m.note:
            out.print(f"  message {m.id} ({m.channel}): {m.note} -> {final.get(m.id)}")
    wrong = [m for m in mix if final.get(m.id) != m.expect]
    for error in lam.errors:
        out.print(f"[red]channel function raised: {error}")
    elapsed = time.monotonic() - started
    if wrong or lam.errors:
        for m in wrong:
            out.print(
                f"[red]message {m.id} ({m.channel}) ended {final.get(m.id)}, expected {m.expect}"
            )
        out.print(f"[red]local run FAILED after {elapsed:.1f}s")
        return 1
    out.print(f"[green]local run OK: every message reached its expected state in {elapsed:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
