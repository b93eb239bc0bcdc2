"""The operator commands against the real Postgres: what they print, what they
change, and that bad arguments or unknown ids change nothing."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

import outbox
from outbox import store
from outbox_cli.cli import cli, parse_duration
from support import (
    EMAIL,
    ScriptedChannel,
    attempts,
    enqueue,
    expire_leases,
    install_channel,
    make_due,
    row,
    settings,
    settle_all,
    statuses,
)

BACKOFF = settings().backoff()


def snapshot(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        messages = conn.execute(
            sa.text(
                "SELECT id, status, attempts, available_at, settled_at, last_error "
                "FROM outbox_message ORDER BY id"
            )
        ).all()
        history = conn.execute(sa.text("SELECT * FROM outbox_attempt ORDER BY id")).all()
    return [tuple(r) for r in messages] + [tuple(r) for r in history]


def one_error_line(result: Result, *fragments: str) -> None:
    assert result.exit_code != 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_migrate_is_idempotent_and_reports_the_revision(run: Any) -> None:
    from alembic.script import ScriptDirectory

    from outbox.migrate import _MIGRATIONS

    head = ScriptDirectory(str(_MIGRATIONS)).get_current_head()
    first = run("migrate")
    assert first.exit_code == 0, first.output
    assert first.stdout == f"already at revision {head}\n"  # the suite's database is migrated
    again = run("migrate", "--json")
    assert json.loads(again.stdout) == {"revision": head, "previous": head}


def test_enqueue_inline_and_from_file_with_options(
    run: Any, engine: sa.Engine, tmp_path: Any
) -> None:
    first = run(
        "enqueue",
        "--channel",
        "email",
        "--payload",
        json.dumps(EMAIL),
        "--dedupe-key",
        "order-1",
        "--ordering-key",
        "customer-7",
        "--priority",
        "5",
        "--delay",
        "10m",
        "--json",
    )
    assert first.exit_code == 0, first.output
    message_id = json.loads(first.stdout)["id"]
    with engine.connect() as conn:
        r = row(conn, message_id)
        due_in = conn.execute(
            sa.text(
                "SELECT EXTRACT(EPOCH FROM available_at - now()) FROM outbox_message WHERE id = :id"
            ),
            {"id": message_id},
        ).scalar_one()
    assert (r.channel, r.dedupe_key, r.ordering_key, r.priority, r.payload) == (
        "email",
        "order-1",
        "customer-7",
        5,
        EMAIL,
    )
    assert 590 < float(due_in) <= 600

    payload_file = tmp_path / "payload.json"
    payload_file.write_text(json.dumps(EMAIL))
    repeat = run(
        "enqueue", "--channel", "email", "--payload", f"@{payload_file}", "--dedupe-key", "order-1"
    )
    assert repeat.exit_code == 0 and int(repeat.stdout) == message_id  # the dedupe key answered
    stdin = run("enqueue", "--channel", "email", "--payload", "@-", input=json.dumps(EMAIL))
    assert stdin.exit_code == 0, stdin.output
    assert int(stdin.stdout) > message_id  # a new row (the conflict above used an identity value)
    assert statuses(engine) == {"pending": 2}


def test_enqueue_with_a_ttl_and_a_failure_policy(run: Any, engine: sa.Engine) -> None:
    result = run(
        "enqueue",
        "--channel",
        "email",
        "--payload",
        json.dumps(EMAIL),
        "--ordering-key",
        "customer-7",
        "--delay",
        "10m",
        "--ttl",
        "1h",
        "--on-predecessor-failure",
        "cancel",
        "--json",
    )
    assert result.exit_code == 0, result.output
    message_id = json.loads(result.stdout)["id"]
    with engine.connect() as conn:
        policy, expires_in = conn.execute(
            sa.text(
                "SELECT on_predecessor_failure, EXTRACT(EPOCH FROM expires_at - now()) "
                "FROM outbox_message WHERE id = :id"
            ),
            {"id": message_id},
        ).one()
    assert policy == "cancel"
    assert 4190 < float(expires_in) <= 4200  # the hour counts from when it is due


def test_enqueue_with_a_cooldown(run: Any, engine: sa.Engine) -> None:
    result = run(
        "enqueue",
        "--channel",
        "email",
        "--payload",
        json.dumps(EMAIL),
        "--cooldown",
        "1h",
        "--cooldown-key",
        "user-7:digest",
        "--on-cooldown",
        "suppress",
        "--json",
    )
    assert result.exit_code == 0, result.output
    message_id = json.loads(result.stdout)["id"]
    with engine.connect() as conn:
        cooldown = conn.execute(
            sa.text(
                "SELECT cooldown_key, EXTRACT(EPOCH FROM cooldown), on_cooldown "
                "FROM outbox_message WHERE id = :id"
            ),
            {"id": message_id},
        ).one()
    assert (cooldown[0], float(cooldown[1]), cooldown[2]) == ("user-7:digest", 3600.0, "suppress")
    shown = run("show", str(message_id), "--json")
    assert shown.exit_code == 0, shown.output
    message = json.loads(shown.stdout)["message"]
    assert (message["cooldown_key"], message["cooldown_seconds"], message["on_cooldown"]) == (
        "user-7:digest",
        3600.0,
        "suppress",
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--channel", "email", "--payload", json.dumps(EMAIL), "--cooldown", "1h"],
            "cooldown_key",
        ),
        (["--channel", "email", "--payload", "{not json"], "not valid JSON"),
        (["--channel", "email", "--payload", "{}"], "payload"),
        (["--channel", "carrier-pigeon", "--payload", "{}"], "unknown channel"),
        (["--channel", "email", "--payload", "@/nonexistent/payload.json"], "cannot read"),
        (["--channel", "email", "--payload", json.dumps(EMAIL), "--priority", "99999"], "priority"),
        (["--channel", "email", "--payload", json.dumps(EMAIL), "--delay", "soon"], "duration"),
        (["--payload", json.dumps(EMAIL)], "--channel"),
    ],
)
def test_enqueue_rejects_bad_input_and_writes_nothing(
    run: Any, engine: sa.Engine, args: list[str], fragment: str
) -> None:
    result = run("enqueue", *args)
    one_error_line(result, fragment)
    assert result.exit_code == 2
    assert snapshot(engine) == []


def test_status_counts_per_channel_and_status(run: Any, engine: sa.Engine) -> None:
    enqueue(engine, 3)
    settle_all(engine, "failed")
    enqueue(engine, 2)
    with engine.begin() as conn:
        claims = store.claim(conn, 1, 60)
    expire_leases(engine, [claims[0].id])
    result = run("status", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    groups = {(g["channel"], g["status"]): g for g in data["channels"]}
    assert {k: g["count"] for k, g in groups.items()} == {
        ("email", "failed"): 3,
        ("email", "pending"): 1,
        ("email", "claimed"): 1,
    }
    assert groups[("email", "claimed")]["expired_claims"] == 1
    assert data["pending"] == 1 and data["expired_claims"] == 1 and data["claimed"] == 1
    assert data["oldest_due_age_seconds"] >= 0
    table = run("status")
    assert table.exit_code == 0
    assert "email" in table.stdout and "1 past their lease" in table.stdout


def test_status_shows_messages_held_behind_a_failed_one(run: Any, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        head, *_ = outbox.enqueue_many(
            conn, [{"channel": "email", "payload": EMAIL, "ordering_key": "K"}] * 3
        )
    settle_all(engine, "failed")
    assert json.loads(run("status", "--json").stdout)["held"] == 2
    assert "held 2: pending behind a failed" in run("status").stdout
    assert "cancelled 1" in run("cancel", str(head)).stdout  # the key goes on
    assert json.loads(run("status", "--json").stdout)["held"] == 0


def test_list_filters_and_limits(run: Any, engine: sa.Engine) -> None:
    enqueue(engine, 2)
    failed = settle_all(engine, "failed")
    pending = enqueue(engine, 3)
    every = json.loads(run("list", "--json").stdout)
    assert [m["id"] for m in every["messages"]] == sorted(failed + pending, reverse=True)
    assert every["next_after"] is None
    only_failed = json.loads(run("list", "--status", "failed", "--json").stdout)["messages"]
    assert sorted(m["id"] for m in only_failed) == failed
    assert all("payload" not in m for m in only_failed)
    both = json.loads(run("list", "--status", "failed,pending", "--limit", "2", "--json").stdout)
    assert [m["id"] for m in both["messages"]] == sorted(pending, reverse=True)[:2]
    install_channel(ScriptedChannel())
    assert json.loads(run("list", "--channel", "scripted", "--json").stdout)["messages"] == []
    one_error_line(run("list", "--channel", "carrier-pigeon"), "unknown channel 'carrier-pigeon'")
    assert str(pending[0]) in run("list").stdout
    one_error_line(run("list", "--status", "lost"), "unknown status 'lost'")
    one_error_line(run("list", "--limit", "0"), "--limit")


def test_show_gives_the_row_and_its_attempt_history(run: Any, engine: sa.Engine) -> None:
    (message_id,) = enqueue(engine, 1, max_attempts=5)
    settle_all(engine, "retry", error="SES: Throttling")
    make_due(engine)
    settle_all(engine, "failed", error="MessageRejected")
    result = run("show", str(message_id), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["message"]["status"] == "failed" and data["message"]["payload"] == EMAIL
    assert [(a["attempt"], a["outcome"], a["error"]) for a in data["attempts"]] == [
        (1, "retry", "SES: Throttling"),
        (2, "failed", "MessageRejected"),
    ]
    text = run("show", str(message_id)).stdout
    assert "MessageRejected" in text and "Throttling" in text
    one_error_line(run("show", "999"), "no message with id 999")
    one_error_line(run("show", "abc"), "abc")


def test_redrive_by_id_keeps_history_and_unknown_ids_change_nothing(
    run: Any, engine: sa.Engine
) -> None:
    dead = enqueue(engine, 2, max_attempts=1)
    settle_all(engine, "retry")
    (pending,) = enqueue(engine, 1)
    before = snapshot(engine)
    one_error_line(run("redrive", str(dead[0]), "4242"), "unknown message id(s): 4242")
    one_error_line(run("redrive", str(dead[0]), str(pending)), f"{pending} is pending")
    one_error_line(run("redrive"), "give message ids")
    one_error_line(run("redrive", "--status", "delivered"), "cannot redrive status 'delivered'")
    one_error_line(run("redrive", str(dead[0]), "--status", "dead"), "not both")
    assert snapshot(engine) == before

    result = run("redrive", str(dead[0]), "--json")
    assert json.loads(result.stdout) == {
        "action": "redrive",
        "dry_run": False,
        "count": 1,
        "ids": [dead[0]],
    }
    with engine.connect() as conn:
        r = row(conn, dead[0])
        assert (r.status, r.attempts, r.settled_at) == ("pending", 1, None)  # numbering goes on
        assert [a.outcome for a in attempts(conn, dead[0])] == ["dead"]  # history kept
        assert row(conn, dead[1]).status == "dead"


def test_redrive_by_status_channel_and_since(run: Any, engine: sa.Engine) -> None:
    old = enqueue(engine, 2, max_attempts=1)
    settle_all(engine, "retry")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET settled_at = now() - interval '2 hours' "
                "WHERE id = ANY(:ids)"
            ),
            {"ids": old},
        )
    recent = enqueue(engine, 3, max_attempts=1)
    settle_all(engine, "retry")
    failed = enqueue(engine, 1)
    settle_all(engine, "failed")

    install_channel(ScriptedChannel())
    before = snapshot(engine)
    one_error_line(run("redrive", "--status", "dead", "--channel", "emial"), "unknown channel")
    assert snapshot(engine) == before
    none = run("redrive", "--status", "dead", "--channel", "scripted", "--json")
    assert json.loads(none.stdout)["count"] == 0
    result = run("redrive", "--status", "dead", "--since", "1h", "--yes", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ids"] == recent
    both = json.loads(
        run("redrive", "--status", "dead,failed", "--channel", "email", "--yes", "--json").stdout
    )
    assert both["ids"] == sorted(old + failed)
    assert statuses(engine) == {"pending": 6}


def test_cancel_only_pending_rows_all_or_nothing(run: Any, engine: sa.Engine) -> None:
    pending = enqueue(engine, 3)
    (done,) = enqueue(engine, 1, dedupe_key="x")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_message SET priority = 9 WHERE id = :id"), {"id": done})
    with engine.begin() as conn:
        claims = store.claim(conn, 1, 60)  # the priority 9 row
        store.settle(
            conn, [store.Settlement(claims[0].id, claims[0].claim_token, "delivered")], BACKOFF
        )
    before = snapshot(engine)
    one_error_line(run("cancel", str(pending[0]), str(done)), f"{done} is delivered")
    one_error_line(run("cancel", str(pending[0]), "777"), "unknown message id(s): 777")
    one_error_line(run("cancel"), "IDS")
    one_error_line(run("cancel", str(pending[0]), "--channel", "email"), "not both")
    one_error_line(run("cancel", "0"), "positive")
    assert snapshot(engine) == before

    result = run("cancel", str(pending[0]), str(pending[1]), "--json")
    assert json.loads(result.stdout) == {
        "action": "cancel",
        "dry_run": False,
        "count": 2,
        "ids": pending[:2],
    }
    assert "cancelled 1 message(s)" in run("cancel", str(pending[2])).stdout
    assert statuses(engine) == {"cancelled": 3, "delivered": 1}


def test_prune_deletes_only_terminal_rows_older_than_the_window(
    run: Any, engine: sa.Engine
) -> None:
    old = enqueue(engine, 2)
    settle_all(engine, "failed")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_message SET settled_at = now() - interval '8 days'"))
    recent = enqueue(engine, 1)
    settle_all(engine, "failed")
    (pending,) = enqueue(engine, 1)
    before = snapshot(engine)
    one_error_line(run("prune", "--older-than", "a while"), "duration")
    one_error_line(run("prune", "--older-than", "7d", "--status", "pending"), "cannot prune")
    assert snapshot(engine) == before

    # Without --status, failed (dead, expired) rows wait for an operator, as
    # they do under the reaper's routine retention: they go only when named.
    assert json.loads(run("prune", "--older-than", "7d", "--yes", "--json").stdout)["count"] == 0
    assert snapshot(engine) == before
    assert json.loads(
        run("prune", "--older-than", "7d", "--status", "failed", "--yes", "--json").stdout
    ) == {"action": "prune", "dry_run": False, "count": 2}
    with engine.connect() as conn:
        left = conn.execute(sa.text("SELECT id FROM outbox_message ORDER BY id")).scalars().all()
        kept_history = conn.execute(
            sa.text("SELECT count(*) FROM outbox_attempt WHERE message_id = ANY(:ids)"),
            {"ids": old},
        ).scalar_one()
    # the attempt history has its own retention (ATTEMPT_RETENTION_DAYS, the reaper)
    assert left == [*recent, pending] and kept_history == 2


def test_prune_defaults_to_the_configured_retention(database_url: str, engine: sa.Engine) -> None:
    """Without --older-than, prune uses RETENTION_DAYS (7 by default), the
    window the reaper's routine retention uses."""
    enqueue(engine, 3)
    settle_all(engine, "delivered")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET settled_at = now() - make_interval(days => d) "
                "FROM (VALUES (1, 8), (2, 3), (3, 1)) AS age(id, d) WHERE outbox_message.id = age.id"
            )
        )
    runner = CliRunner()

    def prune(retention: str | None) -> dict[str, Any]:
        env = {"DATABASE_URL": database_url, "RETENTION_DAYS": retention}
        result = runner.invoke(cli, ["prune", "--yes", "--json"], env=env)
        assert result.exit_code == 0, result.output
        return dict(json.loads(result.stdout))

    assert prune(None)["count"] == 1  # the default 7 days: the 8-day-old row
    assert prune("2")["count"] == 1  # the 3-day-old row
    assert statuses(engine) == {"delivered": 1}
    bad = runner.invoke(
        cli, ["prune", "--yes"], env={"DATABASE_URL": database_url, "RETENTION_DAYS": "soon"}
    )
    one_error_line(bad, "RETENTION_DAYS")


def test_uncancel_brings_cancelled_messages_back_all_or_nothing(
    run: Any, engine: sa.Engine
) -> None:
    first, second, pending = enqueue(engine, 3)
    run("cancel", str(first), str(second), "--reason", "oops")
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_message SET attempts = 2 WHERE id = :id"), {"id": first}
        )
    before = snapshot(engine)
    one_error_line(run("uncancel", str(first), str(pending)), f"{pending} is pending")
    one_error_line(run("uncancel", str(first), "777"), "unknown message id(s): 777")
    one_error_line(run("uncancel"), "IDS")
    assert snapshot(engine) == before
    assert json.loads(run("uncancel", str(first), "--dry-run", "--json").stdout)["dry_run"]
    assert snapshot(engine) == before

    result = run("uncancel", str(first), str(second), "--json")
    assert json.loads(result.stdout) == {
        "action": "uncancel",
        "dry_run": False,
        "count": 2,
        "ids": [first, second],
    }
    with engine.connect() as conn:
        back = conn.execute(
            sa.text(
                "SELECT status, attempts, attempts_at_redrive, settled_at, last_error "
                "FROM outbox_message WHERE id = :id"
            ),
            {"id": first},
        ).one()
    # a fresh set of attempts numbered on from the last one, the reason cleared
    assert tuple(back) == ("pending", 2, 2, None, None)
    assert statuses(engine) == {"pending": 3}
    one_error_line(run("uncancel", str(first)), f"{first} is pending")


def test_uncancel_refuses_a_message_whose_ordering_key_went_ahead(
    run: Any, engine: sa.Engine
) -> None:
    """Cancelling the head of a key lets the next one go; once it has gone
    (here: delivered), bringing the head back would send it out of order."""
    head, later = enqueue(engine, 2, ordering_key="order-7")
    one_more = enqueue(engine, 1, ordering_key="order-8")
    run("cancel", str(head), *map(str, one_more))
    settle_all(engine, "delivered")  # the key's next message, and nothing of order-8
    before = snapshot(engine)
    one_error_line(run("uncancel", str(head), *map(str, one_more)), f"cannot uncancel {head}")
    assert snapshot(engine) == before  # all or nothing: order-8's row stayed cancelled too
    assert json.loads(run("uncancel", *map(str, one_more), "--json").stdout)["count"] == 1
    with engine.connect() as conn:
        assert store.statuses_of(conn, [head, later]) == {head: "cancelled", later: "delivered"}


def test_commands_without_a_database_or_schema_say_so(database_url: str, engine: sa.Engine) -> None:
    runner = CliRunner()
    no_url = runner.invoke(cli, ["status"], env={"DATABASE_URL": ""})
    one_error_line(no_url, "DATABASE_URL")
    missing = database_url.rsplit("/", 1)[0] + "/outbox_no_such_database"
    one_error_line(runner.invoke(cli, ["list"], env={"DATABASE_URL": missing}), "does not exist")
    unknown_command = runner.invoke(cli, ["lsit"], env={"DATABASE_URL": database_url})
    one_error_line(unknown_command, "No such command")


def _refusal(database_url: str, **parts: Any) -> tuple[Result, dict[str, Any]]:
    """``outbox list`` against the test server with parts of its URL replaced:
    the error line, and the JSON error of the same command."""
    url = sa.engine.make_url(database_url).set(**parts)
    if "host" in parts:  # the embedded server's socket path would win over host and port
        url = url.difference_update_query(["unix_sock"])
    env = {"DATABASE_URL": url.render_as_string(hide_password=False)}
    runner = CliRunner()
    text = runner.invoke(cli, ["list"], env=env)
    as_json = runner.invoke(cli, ["list", "--json"], env=env)
    assert as_json.exit_code == 1 and as_json.stderr == "", as_json.output
    error: dict[str, Any] = json.loads(as_json.stdout)["error"]
    return text, error


def test_a_login_the_server_refuses_is_not_an_unreachable_database(database_url: str) -> None:
    # The server answered, so "cannot reach" would send the operator to the network.
    text, error = _refusal(database_url, username="outbox_no_such_role", password="s3cret-pw")
    expected = 'the database refused the login: role "outbox_no_such_role" does not exist'
    one_error_line(text, expected)
    assert text.exit_code == 1
    assert error == {"kind": "database_login_refused", "message": expected}
    for output in (text.output, json.dumps(error)):
        assert "s3cret-pw" not in output and "postgresql" not in output


def test_a_database_the_server_does_not_have_is_named_as_missing(database_url: str) -> None:
    text, error = _refusal(database_url, database="outbox_no_such_database")
    expected = 'no such database: database "outbox_no_such_database" does not exist'
    one_error_line(text, expected)
    assert text.exit_code == 1
    assert error == {"kind": "database_missing", "message": expected}


def test_a_server_that_does_not_answer_is_unreachable(database_url: str) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    text, error = _refusal(database_url, host="127.0.0.1", port=port)
    one_error_line(text, "cannot reach the database: ")
    assert error["kind"] == "database_unavailable"
    assert error["message"].startswith("cannot reach the database: ")


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "45s", "30m", "12h", "7d", "2w", "1.5h")] == [
        90,
        45,
        1800,
        43200,
        604800,
        1209600,
        5400,
    ]
