"""`make run` (python -m outbox_cli.local) end to end, as a subprocess: on this
machine's Postgres (the normal path) and forced onto the embedded one; and the
quickstart (docs/quickstart.md) run as written against its --keep-running mode."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_cli import devdb
from support import DOCS, doc_blocks

# What the demo must not inherit from the test run: the suite's own database
# and moto, and the switch that chose the suite's database (OUTBOX_DEV_DB=
# embedded make test would override each test's own choice).
NOT_INHERITED = (
    "DATABASE_URL",
    "AWS_ENDPOINT_URL",
    devdb.DEV_DB_VARIABLE,
    *devdb.DEPRECATED_DEV_DB_VARIABLES,
)


def inherited_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}


def run_local(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = inherited_env()
    return subprocess.run(
        [sys.executable, "-m", "outbox_cli.local"],
        env={**clean, "COLUMNS": "120", **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


def check_output(result: subprocess.CompletedProcess[str], database_line: str) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    out = " ".join(result.stdout.split())  # rich wraps long lines
    assert database_line in out
    assert "AWS: in-process moto server at http://127.0.0.1:" in out
    assert "messages per channel and status" in out
    assert "attempt history of message" in out
    assert "two transient failures, then delivered" in out and "-> delivered" in out
    assert "MessageRejected" in out and "-> failed" in out
    assert "MAX_ATTEMPTS is spent" in out and "-> dead" in out
    assert "expired claims taken back: 1;" in out  # the lost hand-off, via the reaping step
    assert "lease expired" in out  # ... in its attempt history
    assert "local run OK" in out


def test_make_run_on_the_local_postgres(server_url: str) -> None:
    name = f"outbox_demo_{uuid.uuid4().hex[:8]}"
    host = make_url(server_url).host
    if host not in ("127.0.0.1", "localhost"):
        # The suite's server is not the demo's local Postgres (the embedded
        # one, on a unix socket; CI on another server): the demo runs on a
        # database of it given as DATABASE_URL.
        env = {"DATABASE_URL": devdb.recreate_database(server_url, name)}
        line = "database: DATABASE_URL"
    else:
        env, line = {"OUTBOX_LOCAL_DBNAME": name}, f"database {name!r} (recreated)"
    try:
        result = run_local(env)
        check_output(result, line)
        if "OUTBOX_LOCAL_DBNAME" in env:  # it says how to look at what it left
            assert "Next (docs/how-to/cli.md: After make run)" in result.stdout
            assert (
                f"  export DATABASE_URL=postgresql://postgres@127.0.0.1:5432/{name}\n"
                in result.stdout
            )
            assert "  outbox status; outbox list --status dead,failed" in result.stdout
            assert "python -m outbox_cli.local --keep-running" in result.stdout
            engine = sa.create_engine(make_url(server_url).set(database=name))
            with engine.connect() as conn:
                marker = conn.execute(
                    sa.text(
                        "SELECT shobj_description(oid, 'pg_database') FROM pg_database "
                        "WHERE datname = current_database()"
                    )
                ).scalar()
                assert marker == devdb.OWN_DATABASE_MARKER  # so the next run may drop it
                rows = conn.execute(
                    sa.text(
                        "SELECT channel, status, count(*) FROM outbox_message "
                        "GROUP BY 1, 2 ORDER BY 1, 2"
                    )
                ).all()
            engine.dispose()
            assert [tuple(r) for r in rows] == [
                ("email", "delivered", 24),
                ("email", "failed", 1),
                ("eventbridge", "delivered", 1),
                ("flaky", "dead", 1),
                ("flaky", "delivered", 2),
                ("push", "delivered", 1),
                ("sms", "delivered", 1),
                ("sms", "suppressed", 1),
                ("sqs", "delivered", 1),
                ("webhook", "delivered", 1),
            ]
    finally:
        admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_make_run_on_the_embedded_postgres(tmp_path: Path) -> None:
    pgdata = tmp_path / "pgdata"
    result = run_local({"OUTBOX_LOCAL_DB": "embedded", "OUTBOX_LOCAL_PGDATA": str(pgdata)})
    check_output(result, f"database: embedded Postgres (pgserver) in {pgdata}")
    assert (pgdata / "PG_VERSION").is_file()
    # Its server stops with the run: the next steps offer --keep-running, no URL.
    assert "export DATABASE_URL" not in result.stdout
    assert "python -m outbox_cli.local --keep-running" in result.stdout


def test_keep_running_serves_the_worker_and_invoke_recipes(tmp_path: Path) -> None:
    """`python -m outbox_cli.local --keep-running`: after the demo its database and
    moto server stay up, and the commands it prints work against them."""
    name = f"outbox_demo_{uuid.uuid4().hex[:8]}"
    clean = inherited_env()
    demo = subprocess.Popen(
        [sys.executable, "-m", "outbox_cli.local", "--keep-running"],
        env={
            **clean,
            "COLUMNS": "120",
            "OUTBOX_LOCAL_DB": "embedded",
            "OUTBOX_LOCAL_PGDATA": str(tmp_path / "pgdata"),
            "OUTBOX_LOCAL_DBNAME": name,
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    assert demo.stdout is not None
    try:
        lines: list[str] = []
        for line in demo.stdout:
            lines.append(line)
            if "stay up until Ctrl-C" in line:
                break
        printed = "".join(lines)
        assert "local run OK" in printed, printed
        exports = [ln.split("export ", 1)[1] for ln in lines if ln.startswith("  export ")]
        env = dict(clean)
        for assignment in " ".join(e.split("#")[0] for e in exports).split():
            key, _, value = assignment.partition("=")
            env[key] = value
        assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        # a webhook enqueued from this shell is signed with the demo's secret
        assert env["WEBHOOK_SECRET_ARN"].startswith("arn:aws:secretsmanager:")

        def outbox_cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-c", "from outbox_cli import main; main()", *args],
                env=env,
                cwd=Path(__file__).resolve().parents[2],
                capture_output=True,
                text=True,
                timeout=120,
            )

        payload = (
            '{"from": "orders@shop.example.com", "to": ["ada@example.net"], '
            '"subject": "Hi", "text": "Hello"}'
        )
        for _ in range(2):
            assert outbox_cli("enqueue", "--channel", "email", "--payload", payload).returncode == 0
        worker = outbox_cli("worker", "--until-empty", "--channels", "email")
        assert worker.returncode == 0, worker.stderr
        assert worker.stdout.rstrip().endswith("settled: delivered 2"), worker.stdout
        assert outbox_cli("enqueue", "--channel", "email", "--payload", payload).returncode == 0
        invoked = outbox_cli(
            "invoke", "EmailFunction", "--claim", "10", "--env-vars", "env.local.json"
        )
        assert invoked.returncode == 0, invoked.stderr
        assert json.loads(invoked.stdout)["statuses"] == {"delivered": 1}

        # The quickstart, every command as the page writes it, in this shell.
        quickstart = doc_blocks(DOCS / "quickstart.md")
        (tmp_path / "send_one.py").write_text(quickstart["quickstart-script"].code)

        def run_as_written(block: str) -> str:
            printed = []
            for line in quickstart[block].code.splitlines():
                program, *args = shlex.split(line)
                if program == "outbox":
                    done = outbox_cli(*args)
                else:
                    assert program == "python", line
                    done = subprocess.run(
                        [sys.executable, *args],
                        env=env,
                        cwd=tmp_path,
                        capture_output=True,
                        text=True,
                        timeout=120,
                    )
                assert done.returncode == 0, f"{line}: {done.stdout}{done.stderr}"
                printed.append(done.stdout)
            return "".join(printed)

        assert "already at revision" in run_as_written("quickstart-commands")  # the demo migrated
        enqueued = run_as_written("quickstart-run-script")
        assert enqueued.startswith("enqueued message "), enqueued
        assert run_as_written("quickstart-run-script") == enqueued  # a replay: the same id
        assert run_as_written("quickstart-worker").rstrip().endswith("settled: delivered 1")
        checked = run_as_written("quickstart-check")
        message_id = enqueued.split()[-1]
        (history_row,) = [ln for ln in checked.splitlines() if f" {message_id} " in ln]
        assert history_row.split()[-1] == "delivered" and " delivered " in history_row

        # Step 7: the receiver as the page writes it, on a free port, and the
        # webhook sent to it; its signature verified with standardwebhooks.
        (tmp_path / "receiver.py").write_text(quickstart["quickstart-receiver"].code)
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        (receive,) = quickstart["quickstart-receive"].code.splitlines()
        receiver = subprocess.Popen(
            [sys.executable, *shlex.split(receive)[1:]],
            env={**env, "RECEIVER_PORT": str(port)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert receiver.stdout is not None
            listening = receiver.stdout.readline()  # (empty if it exited)
            assert listening == f"listening on http://127.0.0.1:{port}/hooks\n", listening
            for line in quickstart["quickstart-send-webhook"].code.splitlines():
                program, *args = shlex.split(line.replace(":8765/", f":{port}/"))
                assert program == "outbox", line
                done = outbox_cli(*args)
                assert done.returncode == 0, f"{line}: {done.stdout}{done.stderr}"
            out, err = receiver.communicate(timeout=120)
        finally:
            receiver.kill()
        assert receiver.returncode == 0, err
        assert re.fullmatch(r"verified msg_\d+ order\.shipped \{'order': 42\}\n", out), (out, err)
    finally:
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) == 0


def test_an_unknown_database_choice_is_refused() -> None:
    result = run_local({"OUTBOX_DEV_DB": "oracle"})
    assert result.returncode != 0
    assert result.stderr.strip() == "OUTBOX_DEV_DB must be local, embedded or url, not 'oracle'"


def test_the_old_names_of_the_switch_still_work_and_say_so() -> None:
    for old in ("OUTBOX_LOCAL_DB", "OUTBOX_TEST_DB"):
        result = run_local({old: "oracle"})
        assert result.returncode != 0
        assert result.stderr.splitlines() == [
            f"note: {old} is deprecated: use OUTBOX_DEV_DB=oracle",
            "OUTBOX_DEV_DB must be local, embedded or url, not 'oracle'",
        ]


# --- the demo's own database ---------------------------------------------------------


def database_names(server_url: str) -> set[str]:
    admin = sa.create_engine(server_url)
    try:
        with admin.connect() as conn:
            return set(conn.execute(sa.text("SELECT datname FROM pg_database")).scalars())
    finally:
        admin.dispose()


def tables(url: str) -> list[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return list(
                conn.execute(
                    sa.text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
                ).scalars()
            )
    finally:
        engine.dispose()


@pytest.fixture
def demo_name(server_url: str) -> Iterator[str]:
    name = f"outbox_demo_{uuid.uuid4().hex[:8]}"
    yield name
    devdb.drop_database(server_url, name)


def test_the_demo_recreates_only_a_database_it_made(server_url: str, demo_name: str) -> None:
    url = devdb.recreate_own_database(server_url, demo_name)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE left_by_the_last_run (id int)"))
    engine.dispose()
    assert tables(url) == ["left_by_the_last_run"]
    # Made by an earlier run (it carries the marker): dropped and made again.
    assert devdb.recreate_own_database(server_url, demo_name) == url
    assert tables(url) == []


def test_a_database_of_the_demos_name_that_it_did_not_make_is_left_alone(
    server_url: str, demo_name: str
) -> None:
    url = devdb.recreate_database(server_url, demo_name)  # someone else's: no marker
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE theirs (id int)"))
    engine.dispose()
    with pytest.raises(devdb.NotOwnDatabase):
        devdb.recreate_own_database(server_url, demo_name)
    assert tables(url) == ["theirs"]
    if make_url(server_url).host in ("127.0.0.1", "localhost"):  # the demo's own Postgres
        # The demo runs all the same, in the next name of its own.
        try:
            result = run_local({"OUTBOX_DEV_DB": "local", "OUTBOX_LOCAL_DBNAME": demo_name})
            output = result.stdout + result.stderr
            assert result.returncode == 0, output[-3000:]
            assert f"database {demo_name!r} exists without make run's mark: left alone" in output
            assert f"database: using '{demo_name}_2' instead" in output
            assert f"/{demo_name}_2" in output  # the export line names the one it used
            assert tables(url) == ["theirs"]
        finally:
            devdb.drop_database(server_url, f"{demo_name}_2")


def test_the_demos_database_in_use_is_not_dropped(server_url: str, demo_name: str) -> None:
    """Without FORCE: a session on it (a --keep-running demo, someone's psql) is
    never cut; the run stops and says so."""
    url = devdb.recreate_own_database(server_url, demo_name)
    engine = sa.create_engine(url)
    try:
        with engine.connect():
            with pytest.raises(devdb.DatabaseInUse):
                devdb.recreate_own_database(server_url, demo_name)
            assert demo_name in database_names(server_url)
    finally:
        engine.dispose()
