"""`make run` (python -m outbox_cli.local) end to end, as a subprocess: on this
machine's Postgres (the normal path) and forced onto the embedded one; and the
quickstart (docs/quickstart.md) run as written against its --keep-running mode."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from support import DOCS, doc_blocks


def run_local(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "AWS_ENDPOINT_URL")}
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
    assert "expired claims taken back: 1;" in out  # the lost hand-off, via the reaper
    assert "lease expired" in out  # ... in its attempt history
    assert "local run OK" in out


def test_make_run_on_the_local_postgres(server_url: str) -> None:
    name = f"outbox_demo_{uuid.uuid4().hex[:8]}"
    host = make_url(server_url).host
    if host not in ("127.0.0.1", "localhost"):  # pragma: no cover - CI on another server
        env = {
            "DATABASE_URL": make_url(server_url).set(database="postgres").render_as_string(False)
        }
        line = "database: DATABASE_URL"
    else:
        env, line = {"OUTBOX_LOCAL_DBNAME": name}, f"database {name!r} (recreated)"
    try:
        result = run_local(env)
        check_output(result, line)
        if "OUTBOX_LOCAL_DBNAME" in env:  # it says how to look at what it left
            assert "Next (README: After make run)" in result.stdout
            assert (
                f"  export DATABASE_URL=postgresql://postgres@127.0.0.1:5432/{name}\n"
                in result.stdout
            )
            assert "  outbox status; outbox list --status dead,failed" in result.stdout
            assert "python -m outbox_cli.local --keep-running" in result.stdout
            engine = sa.create_engine(make_url(server_url).set(database=name))
            with engine.connect() as conn:
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
    clean = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "AWS_ENDPOINT_URL")}
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

        assert "schema at revision" in run_as_written("quickstart-commands")
        enqueued = run_as_written("quickstart-run-script")
        assert enqueued.startswith("enqueued message "), enqueued
        assert run_as_written("quickstart-run-script") == enqueued  # a replay: the same id
        assert run_as_written("quickstart-worker").rstrip().endswith("settled: delivered 1")
        checked = run_as_written("quickstart-check")
        message_id = enqueued.split()[-1]
        (history_row,) = [ln for ln in checked.splitlines() if f" {message_id} " in ln]
        assert history_row.split()[-1] == "delivered" and " delivered " in history_row
    finally:
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) == 0


def test_an_unknown_database_choice_is_refused() -> None:
    result = run_local({"OUTBOX_LOCAL_DB": "oracle"})
    assert result.returncode != 0
    assert "OUTBOX_LOCAL_DB must be local, embedded or url" in result.stderr
