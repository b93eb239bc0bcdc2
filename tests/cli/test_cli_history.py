"""`outbox enqueue --json` on a replayed or conflicting dedupe key, and
`outbox history --recipient`: the send log that answers "did they get it?"."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import Result

import outbox
from outbox import store
from support import EMAIL, settings

BACKOFF = settings().backoff()


def error_line(result: Result) -> str:
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    return line


def settle_due(engine: sa.Engine, outcome: str, provider_id: str | None = None) -> list[int]:
    with engine.begin() as conn:
        claims = store.claim(conn, 1000, 60)
        store.settle(
            conn,
            [
                store.Settlement(
                    c.id,
                    c.claim_token,
                    outcome,
                    error=None if outcome == "delivered" else "MessageRejected",
                    provider_message_id=provider_id,
                )
                for c in claims
            ],
            BACKOFF,
        )
    return sorted(c.id for c in claims)


def test_enqueue_json_says_whether_it_created_the_message(run: Any, engine: sa.Engine) -> None:
    payload = json.dumps(EMAIL)
    args = ("enqueue", "--channel", "email", "--payload", payload, "--dedupe-key", "order-1")
    first = json.loads(run(*args, "--json").stdout)
    again = json.loads(run(*args, "--json").stdout)
    assert first["created"] is True
    assert again == {**first, "created": False}

    changed = json.dumps({**EMAIL, "subject": "Changed"})
    line = error_line(
        run("enqueue", "--channel", "email", "--payload", changed, "--dedupe-key", "order-1")
    )
    assert "dedupe_key" in line and "'order-1'" in line and f"message {first['id']}" in line
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 1

    other = json.dumps({**EMAIL, "to": ["second@example.net"]})
    fanned = json.loads(
        run(
            "enqueue", "--channel", "email", "--payload", other, "--dedupe-key", "order-1", "--json"
        ).stdout
    )
    assert fanned["created"] is True and fanned["id"] != first["id"]


def test_history_lists_a_recipients_attempts_newest_first_after_the_messages_are_pruned(
    run: Any, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        to_both = outbox.enqueue(
            conn, "email", {**EMAIL, "to": ["Ada@Example.net"], "cc": ["bob@example.net"]}
        )
    (first,) = settle_due(engine, "failed")  # MessageRejected
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_attempt SET finished_at = now() - interval '1 hour'"))
        to_ada = outbox.enqueue(conn, "email", {**EMAIL, "to": ["ada@example.net"]})
        to_bob = outbox.enqueue(conn, "email", {**EMAIL, "to": ["bob@example.net"]})
        sms = outbox.enqueue(conn, "sms", {"to": "+15555550100", "message": "shipped"})
    settle_due(engine, "delivered", provider_id="ses-1")
    assert first == to_both

    result = run("history", "--recipient", "ada@EXAMPLE.net", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["attempts"]
    assert [(r["message_id"], r["outcome"]) for r in rows] == [
        (to_ada, "delivered"),
        (to_both, "failed"),
    ]
    assert rows[0]["provider_message_id"] == "ses-1" and rows[1]["error"] == "MessageRejected"
    assert rows[0]["message_status"] == "delivered" and rows[0]["channel"] == "email"
    assert "ada@" not in result.stdout.lower()  # the address is never printed back

    bob = json.loads(run("history", "--recipient", "bob@example.net", "--json").stdout)["attempts"]
    assert [r["message_id"] for r in bob] == [to_bob, to_both]
    phone = json.loads(run("history", "--recipient", "+15555550100", "--json").stdout)["attempts"]
    assert [r["message_id"] for r in phone] == [sms]
    assert json.loads(
        run("history", "--recipient", "+15555550100", "--channel", "email", "--json").stdout
    ) == {"attempts": []}
    nobody = run("history", "--recipient", "nobody@example.net", "--json")
    assert json.loads(nobody.stdout) == {"attempts": []}

    # the messages go after their retention; the send log stays
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_message SET settled_at = now() - interval '8 days'"))
        assert store.prune(conn, 7 * 86400, 100) == 4
    after = json.loads(run("history", "--recipient", "ada@example.net", "--json").stdout)[
        "attempts"
    ]
    assert [(r["message_id"], r["message_status"]) for r in after] == [
        (to_ada, None),
        (to_both, None),
    ]
    table = run("history", "--recipient", "ada@example.net", "--channel", "email")
    assert table.exit_code == 0 and "(pruned)" in table.stdout and "delivered" in table.stdout


def test_history_rows_stay_on_one_line_without_a_terminal(
    run: Any, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Piped or redirected, each attempt is one line, long provider ids included."""
    monkeypatch.delenv("COLUMNS", raising=False)
    provider_id = "0100018f-" + "e" * 120
    with engine.begin() as conn:
        sent = [outbox.enqueue(conn, "email", EMAIL) for _ in range(3)]
    settle_due(engine, "delivered", provider_id=provider_id)
    result = run("history", "--recipient", EMAIL["to"][0])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    title, header, rule, *rows = lines
    assert title.strip() == "attempts, newest first (3)" and set(rule.strip()) == {"─"}
    # an unfolded header: its first and last names on the one line
    assert header.split()[0] == "finished" and header.split()[-1] == "message_status"
    assert [int(row.split()[3]) for row in rows] == sorted(sent, reverse=True)
    assert all(provider_id in row and row.split()[-1] == "delivered" for row in rows)


def test_history_refuses_bad_arguments(run: Any) -> None:
    assert "--recipient" in error_line(run("history", "--recipient", " "))
    assert "pigeon" in error_line(run("history", "--recipient", "a@b.c", "--channel", "pigeon"))
    assert "--recipient" in error_line(run("history"))


def test_a_bounce_shows_in_the_recipients_history(run: Any, engine: sa.Engine) -> None:
    """Provider feedback writes attempt rows too: the send
    log answers "did they get it?" with the bounce, not just the delivery."""
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "email", {**EMAIL, "to": ["ada@example.net"]})
    settle_due(engine, "delivered", provider_id="ses-bounce-1")
    with engine.begin() as conn:
        (result,) = store.record_feedback(
            conn,
            [
                store.Feedback(
                    "ses-bounce-1", "bounced", "ada@example.net", "Permanent/General", "General"
                )
            ],
        )
    assert result.new_status == "bounced"
    rows = json.loads(run("history", "--recipient", "Ada@example.net", "--json").stdout)["attempts"]
    assert [(r["message_id"], r["outcome"], r["message_status"]) for r in rows] == [
        (message_id, "bounced", "bounced"),
        (message_id, "delivered", "bounced"),
    ]
