"""Wake on enqueue from Python (outbox.wake): the nudge goes after the commit,
never before it or for a rolled-back transaction, coalesced, off the hot path.

The Lambda API is a real HTTP server on 127.0.0.1 (``FakeLambda``) reached by
the nudger's own boto3 client through ``AWS_ENDPOINT_URL_LAMBDA``; it records
each Invoke with how many messages a fresh database connection could see at
that moment, and can answer as Lambda does when throttling or when the
function does not exist.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import wake
from support import EMAIL

FUNCTION = "outbox-DispatcherFunction"
WAIT = 60.0  # the most any test waits for the thread; a bound, never a verdict


@dataclass
class Invoke:
    path: str
    invocation_type: str | None
    payload: dict[str, Any]
    visible: int  # messages committed when the request arrived


@dataclass
class FakeLambda:
    """Lambda's Invoke API on loopback: answers 202, or the error it is told to."""

    engine: sa.Engine
    calls: list[Invoke] = field(default_factory=list)
    error: tuple[int, str] | None = None  # (status, x-amzn-ErrorType)
    url: str = ""

    def wait_for(self, n: int) -> None:
        deadline = time.monotonic() + WAIT
        while len(self.calls) < n:
            assert time.monotonic() < deadline, f"{len(self.calls)} Invoke calls, wanted {n}"
            time.sleep(0.01)

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with fake.engine.connect() as conn:
                    visible = conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar()
                fake.calls.append(
                    Invoke(
                        self.path,
                        self.headers.get("X-Amz-Invocation-Type"),
                        json.loads(body),
                        int(visible or 0),
                    )
                )
                if fake.error is None:
                    self.send_response(202)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status, code = fake.error
                reply = json.dumps({"Type": "User", "message": f"{code} from the fake"}).encode()
                self.send_response(status)
                self.send_header("x-amzn-ErrorType", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def fake_lambda(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeLambda]:
    fake = FakeLambda(engine)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", fake.url)
    monkeypatch.setenv("OUTBOX_DISPATCHER_FUNCTION", FUNCTION)
    wake.reset()
    try:
        yield fake
    finally:
        nudger = wake.current()
        if nudger is not None:
            nudger.close(timeout=WAIT)
        wake.reset()
        server.shutdown()
        server.server_close()


def nudger() -> wake.Nudger:
    current = wake.current()
    assert current is not None
    return current


def finish(fake: FakeLambda) -> None:
    """Let the thread settle everything it was handed (close flushes and joins)."""
    n = nudger()
    n.close(timeout=WAIT)
    assert n._thread is None or not n._thread.is_alive()


def slow_commit(conn: sa.Connection, seconds: float) -> None:
    """Make this transaction's COMMIT take ``seconds`` (a deferred trigger sleeps)."""
    conn.execute(sa.text("CREATE TEMP TABLE IF NOT EXISTS slow_commit (x int)"))
    conn.execute(
        sa.text(
            "CREATE OR REPLACE FUNCTION pg_temp.sleep_at_commit() RETURNS trigger "
            f"LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep({seconds}); RETURN NULL; END $$"
        )
    )
    conn.execute(
        sa.text(
            "CREATE CONSTRAINT TRIGGER sleep_at_commit AFTER INSERT ON slow_commit "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pg_temp.sleep_at_commit()"
        )
    )
    conn.execute(sa.text("INSERT INTO slow_commit VALUES (1)"))


def test_one_nudge_after_the_commit_with_the_agreed_event(fake_lambda: FakeLambda) -> None:
    with fake_lambda.engine.begin() as conn:
        for _ in range(3):
            outbox.enqueue(conn, "email", EMAIL)
        # Nothing is handed to the thread before the commit: there is none yet.
        assert nudger()._thread is None and fake_lambda.calls == []
        slow_commit(conn, 1.0)  # a nudge sent at the commit event would see 0 rows
    finish(fake_lambda)
    (call,) = fake_lambda.calls
    assert call.path == f"/2015-03-31/functions/{FUNCTION}/invocations"
    assert call.invocation_type == "Event"
    assert call.payload == {"version": 1, "source": "outbox.nudge"}
    assert call.visible == 3  # sent after the COMMIT had finished
    assert nudger().sent == 1


def test_no_nudge_for_a_rolled_back_transaction(fake_lambda: FakeLambda) -> None:
    engine = fake_lambda.engine
    with pytest.raises(RuntimeError), engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
        raise RuntimeError("the business change failed")
    with engine.connect() as conn:  # rolled back, then the same connection commits other work
        outbox.enqueue(conn, "email", EMAIL)
        conn.rollback()
        conn.execute(sa.text("SELECT 1"))
        conn.commit()
    assert nudger()._thread is None  # nothing was ever handed over
    finish(fake_lambda)
    assert fake_lambda.calls == []


def test_a_commit_that_fails_sends_no_nudge(fake_lambda: FakeLambda) -> None:
    engine = fake_lambda.engine
    with pytest.raises(sa.exc.DBAPIError), engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
        # A deferred constraint that fails at COMMIT: the commit event has run.
        conn.execute(sa.text("CREATE TEMP TABLE fails_at_commit (x int)"))
        conn.execute(
            sa.text(
                "CREATE FUNCTION pg_temp.fail() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'refused at commit'; END $$"
            )
        )
        conn.execute(
            sa.text(
                "CREATE CONSTRAINT TRIGGER fail AFTER INSERT ON fails_at_commit DEFERRABLE "
                "INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION pg_temp.fail()"
            )
        )
        conn.execute(sa.text("INSERT INTO fails_at_commit VALUES (1)"))
    finish(fake_lambda)
    assert fake_lambda.calls == []
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar() == 0


def test_a_savepoint_waits_for_the_outer_commit(fake_lambda: FakeLambda) -> None:
    engine = fake_lambda.engine
    with engine.connect() as conn:
        with conn.begin_nested():
            outbox.enqueue(conn, "email", EMAIL)
        assert nudger()._thread is None  # released, not committed
        conn.rollback()  # the outer transaction rolls the released savepoint back
        with conn.begin_nested():
            outbox.enqueue(conn, "email", EMAIL)
        assert nudger()._thread is None
        conn.commit()
    finish(fake_lambda)
    (call,) = fake_lambda.calls
    assert call.visible == 1


def test_an_orm_session_nudges_after_its_commit_only(fake_lambda: FakeLambda) -> None:
    from sqlalchemy.orm import Session

    with Session(fake_lambda.engine) as session:
        outbox.enqueue(session, "email", EMAIL)
        session.rollback()
        assert nudger()._thread is None
        outbox.enqueue(session, "email", EMAIL)
        outbox.enqueue(session, "email", EMAIL)
        session.commit()
    finish(fake_lambda)
    (call,) = fake_lambda.calls
    assert call.visible == 2


def test_an_autocommit_connection_nudges_at_once(fake_lambda: FakeLambda) -> None:
    # A connection of its own, not one of the session's pool, which other
    # tests have used: only this test's state is under test.
    own = sa.create_engine(fake_lambda.engine.url, poolclass=sa.pool.NullPool)
    try:
        with own.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            outbox.enqueue(conn, "email", EMAIL)
            fake_lambda.wait_for(1)  # no commit asked for: the row commits by itself
            assert len(fake_lambda.calls) == 1
    finally:
        own.dispose()
    # The nudge goes as soon as the statement has answered, which can be a
    # moment before the server's own commit of it is visible (the rows come
    # back before the commit's WAL flush): the dispatcher's linger covers that
    # moment, so the row is not asked to be visible at the call, only committed.
    with fake_lambda.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 1


def test_one_listener_per_engine_and_one_nudge_per_transaction_at_most(
    fake_lambda: FakeLambda,
) -> None:
    engine = fake_lambda.engine
    for _ in range(3):
        with engine.begin() as conn:
            for _ in range(200):
                outbox.enqueue(conn, "email", EMAIL)
            assert list(conn.dispatch.commit).count(wake._on_commit) == 1
    assert list(engine.dispatch.commit).count(wake._on_commit) == 1
    with engine.connect() as conn:  # a connection that never enqueued hears it too: harmless
        conn.execute(sa.text("SELECT 1"))
        conn.commit()
    finish(fake_lambda)
    # at most one a transaction, not one an enqueue; the last covers every row
    assert 1 <= len(fake_lambda.calls) <= 3 and fake_lambda.calls[-1].visible == 600


def burst(conn: sa.Connection, messages: int) -> None:
    for _ in range(messages // 100):
        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 100)


def test_a_burst_in_one_transaction_makes_one_nudge(fake_lambda: FakeLambda) -> None:
    with fake_lambda.engine.begin() as conn:
        burst(conn, 10_000)
    finish(fake_lambda)
    assert [c.visible for c in fake_lambda.calls] == [10_000]


def test_a_burst_of_transactions_is_coalesced(fake_lambda: FakeLambda) -> None:
    """10,000 messages in 300 transactions: at most one Invoke per interval
    while they run, plus the one pending at the end; however long they take."""
    started = time.monotonic()
    for _ in range(100):
        with fake_lambda.engine.begin() as conn:
            outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 50)
        for _ in range(2):
            with fake_lambda.engine.begin() as conn:
                for _ in range(25):
                    outbox.enqueue(conn, "email", EMAIL)
    elapsed = time.monotonic() - started
    finish(fake_lambda)
    calls = len(fake_lambda.calls)
    assert 1 <= calls <= 2 + elapsed / wake.MIN_INTERVAL_SECONDS
    assert fake_lambda.calls[-1].visible == 10_000  # the last commit was covered


def test_producer_threads_share_the_nudger(fake_lambda: FakeLambda) -> None:
    """A web server's worker threads enqueue at once: every commit is covered,
    no thread sees an error, and the nudges stay one per interval."""
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            for _ in range(25):
                with fake_lambda.engine.begin() as conn:
                    outbox.enqueue(conn, "email", EMAIL)
        except BaseException as exc:  # reported below
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=produce) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    finish(fake_lambda)
    assert errors == []
    assert 1 <= len(fake_lambda.calls) <= 2 + elapsed / wake.MIN_INTERVAL_SECONDS
    assert fake_lambda.calls[-1].visible == 200


def test_commits_during_an_interval_share_one_nudge(fake_lambda: FakeLambda) -> None:
    """With an interval longer than the burst: the first commit's nudge, then
    one for all the others."""
    nudger().min_interval = 3600.0
    with fake_lambda.engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
    fake_lambda.wait_for(1)
    for _ in range(500):
        with fake_lambda.engine.begin() as conn:
            outbox.enqueue(conn, "email", EMAIL)
    assert len(fake_lambda.calls) == 1  # the rest wait for the interval
    finish(fake_lambda)  # at exit the pending one goes without waiting
    assert [c.visible for c in fake_lambda.calls] == [1, 501]


def wrong_setting_logs(
    fake: FakeLambda, caplog: pytest.LogCaptureFixture, transactions: int
) -> list[logging.LogRecord]:
    nudger().min_interval = 0.0
    caplog.set_level(logging.DEBUG, logger="outbox.wake")
    for n in range(1, transactions + 1):
        with fake.engine.begin() as conn:
            outbox.enqueue(conn, "email", EMAIL)
        fake.wait_for(n)
    finish(fake)
    with fake.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar() == transactions
    return [r for r in caplog.records if r.name == "outbox.wake" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "error",
    [
        (404, "ResourceNotFoundException"),
        (403, "AccessDeniedException"),
    ],
)
def test_a_wrong_function_warns_once_and_the_enqueues_commit(
    fake_lambda: FakeLambda, caplog: pytest.LogCaptureFixture, error: tuple[int, str]
) -> None:
    fake_lambda.error = error
    (warning,) = wrong_setting_logs(fake_lambda, caplog, transactions=3)
    text = warning.getMessage()
    assert FUNCTION in text and error[1] in text and "OUTBOX_DISPATCHER_FUNCTION" in text
    assert nudger().sent == 0


def test_a_throttled_nudge_is_dropped_quietly(
    fake_lambda: FakeLambda, caplog: pytest.LogCaptureFixture
) -> None:
    fake_lambda.error = (429, "TooManyRequestsException")
    assert wrong_setting_logs(fake_lambda, caplog, transactions=3) == []
    assert len(fake_lambda.calls) == 3  # one each: no retries behind the producer's back


def test_a_malformed_setting_warns_once_and_nudges_nothing(
    fake_lambda: FakeLambda, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OUTBOX_DISPATCHER_FUNCTION", "not a function!")
    wake.reset()
    for _ in range(3):
        with fake_lambda.engine.begin() as conn:
            outbox.enqueue(conn, "email", EMAIL)
    warnings = [r for r in caplog.records if r.name == "outbox.wake"]
    assert len(warnings) == 1 and "OUTBOX_DISPATCHER_FUNCTION" in warnings[0].getMessage()
    assert wake.current() is None


def test_configure_in_code_overrides_the_environment(fake_lambda: FakeLambda) -> None:
    arn = f"arn:aws:lambda:us-east-1:123456789012:function:{FUNCTION}"
    wake.configure(arn)
    with fake_lambda.engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
    finish(fake_lambda)
    (call,) = fake_lambda.calls
    assert call.path.endswith("/invocations") and "arn%3Aaws%3Alambda" in call.path
    wake.configure(None)
    with fake_lambda.engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
    assert wake.current() is None
    with pytest.raises(outbox.ConfigError, match="OUTBOX_DISPATCHER_FUNCTION"):
        wake.configure("arn:aws:s3:::a-bucket")


# --- whole processes: the setting off, the exit, a fork ------------------------------


def run_producer(code: str, env: dict[str, str], database_url: str) -> str:
    script = textwrap.dedent(
        """
        import os, sys, threading
        import sqlalchemy as sa
        import outbox
        from outbox import wake
        from outbox.relay_settings import DatabaseSettings
        from outbox.db import create_engine
        EMAIL = {"from": "a@example.com", "to": ["b@example.net"], "subject": "s", "text": "t"}
        engine = create_engine(DatabaseSettings(url=os.environ["URL"], sslmode="disable"))
        def commit_one():
            with engine.begin() as conn:
                outbox.enqueue(conn, "email", EMAIL)
        """
    ) + textwrap.dedent(code)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    clean.pop("AWS_ENDPOINT_URL_LAMBDA", None)
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**clean, **env, "URL": database_url},
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=True,
    )
    return out.stdout.strip()


def test_with_the_setting_off_no_boto3_and_no_thread(engine: sa.Engine, database_url: str) -> None:
    out = run_producer(
        """
        commit_one()
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"boto3", "botocore"})
        print(heavy, threading.active_count(), wake.current())
        """,
        {},
        database_url,
    )
    assert out == "[] 1 None"


def test_a_process_that_exits_after_its_commit_still_nudges(
    fake_lambda: FakeLambda, database_url: str
) -> None:
    out = run_producer(
        """
        commit_one()
        print(sorted(m for m in sys.modules if m == "boto3"))
        """,
        {"OUTBOX_DISPATCHER_FUNCTION": FUNCTION, "AWS_ENDPOINT_URL_LAMBDA": fake_lambda.url},
        database_url,
    )
    assert out in ("[]", "['boto3']")  # the thread imports it, maybe not yet
    fake_lambda.wait_for(1)  # sent by the exit flush at the latest
    assert fake_lambda.calls[0].visible == 1


def test_a_forked_child_nudges_with_its_own_thread(
    fake_lambda: FakeLambda, database_url: str
) -> None:
    run_producer(
        """
        import time
        commit_one()
        while wake.current().sent < 1:
            time.sleep(0.01)
        pid = os.fork()
        if pid == 0:
            engine.dispose(close=False)  # the parent's connections are the parent's
            nudger = wake.current()
            assert nudger._thread is None and nudger._own_client is None
            commit_one()
            nudger.close(timeout=30)
            os._exit(0 if nudger.sent == 1 else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """,
        {"OUTBOX_DISPATCHER_FUNCTION": FUNCTION, "AWS_ENDPOINT_URL_LAMBDA": fake_lambda.url},
        database_url,
    )
    assert [c.visible for c in fake_lambda.calls] == [1, 2]
