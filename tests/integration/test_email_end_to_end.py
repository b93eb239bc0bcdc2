"""The email path end to end: enqueue in a transaction -> the real dispatcher
handler -> the real email function handler -> SES v2 in moto -> delivered."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import boto3
import pytest
import sqlalchemy as sa

import outbox
from outbox.handoff import CallableInvoker
from support import EMAIL, LambdaContext, attempts, row

FUNCTIONS = Path(__file__).resolve().parents[2] / "functions"


def load_handler(name: str) -> ModuleType:
    """Import functions/<name>/app.py as Lambda would, under a unique module name."""
    spec = importlib.util.spec_from_file_location(f"fn_{name}_app", FUNCTIONS / name / "app.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def ses(aws: None) -> Any:
    client = boto3.client("sesv2")
    client.create_email_identity(EmailIdentity="relay@example.com")
    return client


def sent_by_moto() -> list[Any]:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ses.models import ses_backends

    return list(ses_backends[DEFAULT_ACCOUNT_ID]["us-east-1"].sent_messages)


def test_enqueue_dispatch_send_delivered_and_visible_in_moto(
    engine: sa.Engine, relay_env: dict[str, str], ses: Any
) -> None:
    dispatcher_fn, email_fn = load_handler("dispatcher"), load_handler("email")
    results: list[dict[str, Any]] = []
    # The in-process stand-in for Lambda's async invoke of the email function.
    dispatcher_fn.runtime._invoker = CallableInvoker(
        {"email": lambda event: results.append(email_fn.handler(event, LambdaContext(30, "email")))}
    )
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TEMP TABLE orders (id int)"))
        conn.execute(sa.text("INSERT INTO orders VALUES (42)"))
        mid = outbox.enqueue(
            conn, "email", {**EMAIL, "html": "<p>It is on its way.</p>"}, dedupe_key="order-42"
        )

    report = dispatcher_fn.handler({"execution_id": "exec-1"}, LambdaContext(3, "dispatcher"))
    assert report["claimed"] == 1 and report["handed_off"] == 1
    assert results == [
        {
            "received": 1,
            "owned": 1,
            "lease_lost": [],
            "duplicates": [],
            "unknown": [],
            "statuses": {"delivered": 1},
        }
    ]

    with engine.connect() as conn:
        r, history = row(conn, mid), attempts(conn, mid)
    assert r.status == "delivered" and r.provider_message_id
    assert [(a.outcome, a.provider_message_id) for a in history] == [
        ("delivered", r.provider_message_id)
    ]
    (message,) = sent_by_moto()
    assert (
        message.source == "relay@example.com" and message.destinations["ToAddresses"] == EMAIL["to"]
    )
    assert message.subject == EMAIL["subject"]


def test_unverified_sender_is_a_permanent_failure(
    engine: sa.Engine, relay_env: dict[str, str], ses: Any
) -> None:
    email_fn = load_handler("email")
    from outbox import store

    with engine.begin() as conn:
        mid = outbox.enqueue(conn, "email", {**EMAIL, "from": "stranger@elsewhere.example"})
    with engine.begin() as conn:
        claims = store.claim(conn, 10, 120)
    from outbox.handoff import HandOff

    result = email_fn.handler(
        HandOff("email", tuple(claims)).to_event(), LambdaContext(30, "email")
    )
    assert result["statuses"] == {"failed": 1}
    with engine.connect() as conn:
        r = row(conn, mid)
    assert r.status == "failed" and "MessageRejected" in r.last_error
    assert sent_by_moto() == []


def test_reaper_handler_reports_backlog(
    engine: sa.Engine, relay_env: dict[str, str], capsys: Any
) -> None:
    import io
    import json

    from outbox.observability import logger

    reaper_fn = load_handler("reaper")
    with engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
    logs = io.StringIO()
    previous = logger.registered_handler.setStream(logs)  # type: ignore[attr-defined]
    try:
        result = reaper_fn.handler({"execution_id": "exec-2"}, LambdaContext(10, "reaper"))
    finally:
        logger.registered_handler.setStream(previous)  # type: ignore[attr-defined]
    assert result["backlog"]["pending"] == 1
    out = capsys.readouterr().out
    assert '"OldestPendingAgeSeconds"' in out and '"PendingMessages"' in out  # EMF on stdout
    lines = [json.loads(line) for line in logs.getvalue().splitlines()]
    run = next(line for line in lines if line["message"] == "reaper run")
    # The schedule's execution id correlates every log line of the invocation.
    assert run["schedule_execution_id"] == "exec-2" and run["pending"] == 1


def test_a_handler_refuses_a_malformed_event_and_changes_nothing(
    engine: sa.Engine, relay_env: dict[str, str]
) -> None:
    email_fn = load_handler("email")
    with engine.begin() as conn:
        mid = outbox.enqueue(conn, "email", EMAIL)
    with pytest.raises(outbox.ValidationError, match=r"event\.messages"):
        email_fn.handler(
            {"version": 1, "channel": "email", "messages": [{"id": mid}]}, LambdaContext()
        )
    with engine.connect() as conn:
        assert row(conn, mid).status == "pending"
