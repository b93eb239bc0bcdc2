"""Database errors carry no bound parameters and no quoted row data: an enqueue that hits a lock timeout on the application's own
engine, and a settle that fails on the relay's engine, say what went wrong
without the payload's phone number and code or the claim tokens."""

from __future__ import annotations

import traceback

import pytest
import sqlalchemy as sa

import outbox
from outbox import store
from outbox.db import create_engine
from outbox.relay_settings import DatabaseSettings
from support import ScriptedChannel, install_channel

PHONE = "+15555550142"
CODE = "one-time-code-831907"


def error_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(getattr(exc, "orig", None))


def test_an_enqueue_lock_timeout_on_the_applications_engine_shows_no_payload(
    engine: sa.Engine, database_url: str
) -> None:
    # An application's engine as the SQLAlchemy docs build it: parameters shown.
    app_engine = sa.create_engine(database_url)
    try:
        with engine.connect() as holder:
            holder.execute(sa.text("LOCK TABLE outbox_message IN ACCESS EXCLUSIVE MODE"))
            with pytest.raises(sa.exc.DBAPIError) as caught, app_engine.begin() as conn:
                conn.execute(sa.text("SET LOCAL lock_timeout = '200ms'"))
                outbox.enqueue(conn, "sms", {"to": PHONE, "message": f"Your code is {CODE}"})
            holder.rollback()
    finally:
        app_engine.dispose()
    text = error_text(caught.value)
    assert "lock timeout" in text  # the error still says what happened
    assert PHONE not in text and CODE not in text, text
    assert caught.value.params is None


def test_a_failed_settle_on_the_relays_engine_shows_no_claim_token(
    engine: sa.Engine, database_url: str
) -> None:
    install_channel(ScriptedChannel())
    with engine.begin() as conn:
        outbox.enqueue(conn, "scripted", {"n": 1})
    with engine.begin() as conn:
        (claim,) = store.claim(conn, 10, 120)
    relay_engine = create_engine(DatabaseSettings(url=database_url, sslmode="disable"))
    try:
        with engine.connect() as holder:
            holder.execute(sa.text("SELECT id FROM outbox_message FOR UPDATE"))
            with pytest.raises(sa.exc.DBAPIError) as caught, relay_engine.begin() as conn:
                conn.execute(sa.text("SET LOCAL lock_timeout = '200ms'"))
                store.settle(
                    conn,
                    [store.Settlement(claim.id, claim.claim_token, "delivered")],
                    store.Backoff(1, 60, 3),
                )
            holder.rollback()
    finally:
        relay_engine.dispose()
    text = error_text(caught.value)
    assert "lock timeout" in text
    assert str(claim.claim_token) not in text, text


def test_quoted_row_data_in_a_database_error_is_dropped(database_url: str) -> None:
    """Postgres quotes the data in DETAIL and CONTEXT (here the bad JSON
    itself); the relay's engine drops those fields, keeping the message."""
    relay_engine = create_engine(DatabaseSettings(url=database_url, sslmode="disable"))
    try:
        with pytest.raises(sa.exc.DBAPIError) as caught, relay_engine.connect() as conn:
            conn.execute(sa.text("SELECT CAST(:doc AS jsonb)"), {"doc": f'{{"to": "{PHONE}",}}'})
        with relay_engine.connect() as conn:  # and the engine goes on
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    finally:
        relay_engine.dispose()
    text = error_text(caught.value)
    assert "invalid input syntax for type json" in text
    assert PHONE not in text, text
