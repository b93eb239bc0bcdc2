"""The CLI is safe and consistent: --version and --database-url, a dry run and
a confirmation before any change chosen by a filter (refused without a
terminal unless --yes), one JSON convention including errors, and a list that
pages, filters by key, keeps every timestamp on one line and, without a
terminal, every row."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

import outbox
from outbox import states, store
from outbox_cli import cli as cli_module
from outbox_cli.cli import cli
from support import EMAIL, attempts, enqueue, make_due, row, settings, settle_all, statuses

BACKOFF = settings().backoff()


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if an operator sat at a terminal (the prompt reads the runner's input)."""
    monkeypatch.setattr(cli_module, "_stdin_is_a_terminal", lambda: True)


def snapshot(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT * FROM outbox_message ORDER BY id")).all()
    return [tuple(r) for r in rows]


def json_error(result: Result) -> dict[str, Any]:
    """Under --json an error is one JSON object on stdout, and nothing on stderr."""
    assert result.exit_code != 0
    assert result.stderr == ""
    error: dict[str, Any] = json.loads(result.stdout)["error"]
    assert set(error) == {"kind", "message"}
    return error


def test_version_option_matches_the_package() -> None:
    for flag in ("--version", "-V"):
        result = CliRunner().invoke(cli, [flag])
        assert result.exit_code == 0
        assert result.stdout.strip() == f"outbox, version {outbox.__version__}"


def test_database_url_option_wins_over_the_environment(
    engine: sa.Engine, database_url: str
) -> None:
    enqueue(engine, 1)
    runner = CliRunner()
    result = runner.invoke(
        cli,
        ["--database-url", database_url, "status", "--json"],
        env={"DATABASE_URL": "postgresql://nobody@127.0.0.1:9/none", "DB_SECRET_ARN": "arn:x"},
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pending"] == 1
    missing = runner.invoke(cli, ["status", "--json"], env={"DATABASE_URL": ""})
    assert missing.exit_code == 2 and json_error(missing)["kind"] == "config"


def test_prune_counts_asks_and_refuses_without_a_terminal(
    run: Any, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue(engine, 3)
    settle_all(engine, "delivered")
    before = snapshot(engine)

    refused = run("prune", "--older-than", "0s")
    assert refused.exit_code == 2
    assert "refusing without --yes" in refused.stderr and "3 message(s)" in refused.stderr
    error = json_error(run("prune", "--older-than", "0s", "--json"))
    assert error["kind"] == "confirmation_required" and "--yes" in error["message"]
    dry = run("prune", "--older-than", "0s", "--dry-run", "--json")
    assert json.loads(dry.stdout) == {"action": "prune", "dry_run": True, "count": 3}
    assert "would prune 3 message(s)" in run("prune", "--older-than", "0s", "--dry-run").stdout
    assert snapshot(engine) == before

    monkeypatch.setattr(cli_module, "_stdin_is_a_terminal", lambda: True)
    declined = run("prune", "--older-than", "0s", input="n\n")
    assert declined.exit_code == 1 and "nothing changed" in declined.stderr
    assert "delete 3 message(s) settled before" in declined.stderr  # the question
    assert snapshot(engine) == before
    agreed = run("prune", "--older-than", "0s", input="y\n")
    assert agreed.exit_code == 0, agreed.output
    assert "pruned 3 message(s)" in agreed.stdout
    assert snapshot(engine) == []


def test_prune_never_deletes_more_than_it_counted(
    run: Any, engine: sa.Engine, terminal: None
) -> None:
    """A row that settles while the operator reads the question is not deleted:
    the count and the delete share one cutoff from the database clock."""
    enqueue(engine, 2)
    settle_all(engine, "delivered")

    def settle_one_more_then_agree(*args: Any, **kwargs: Any) -> bool:
        enqueue(engine, 1)
        settle_all(engine, "failed")
        return True

    import click

    original = click.confirm
    click.confirm = settle_one_more_then_agree  # type: ignore[assignment]
    try:
        result = run("prune", "--older-than", "0s", "--json")
    finally:
        click.confirm = original
    assert json.loads(result.stdout)["count"] == 2
    assert statuses(engine) == {"failed": 1}


def test_bulk_redrive_shows_asks_and_refuses_without_a_terminal(
    run: Any, engine: sa.Engine, terminal: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = enqueue(engine, 2, max_attempts=1)
    settle_all(engine, "retry")
    before = snapshot(engine)
    dry = json.loads(run("redrive", "--status", "dead", "--dry-run", "--json").stdout)
    assert dry == {"action": "redrive", "dry_run": True, "count": 2, "ids": dead}
    declined = run("redrive", "--status", "dead", input="n\n")
    assert declined.exit_code == 1 and "redrive 2 message(s)?" in declined.stderr
    monkeypatch.setattr(cli_module, "_stdin_is_a_terminal", lambda: False)
    refused = run("redrive", "--status", "dead", "--json")
    assert refused.exit_code == 2 and json_error(refused)["kind"] == "confirmation_required"
    assert snapshot(engine) == before
    monkeypatch.setattr(cli_module, "_stdin_is_a_terminal", lambda: True)
    agreed = run("redrive", "--status", "dead", input="y\n")
    assert agreed.exit_code == 0, agreed.output
    assert statuses(engine) == {"pending": 2}


def test_redrive_by_id_dry_run_checks_the_ids_and_changes_nothing(
    run: Any, engine: sa.Engine
) -> None:
    (dead,) = enqueue(engine, 1, max_attempts=1)
    settle_all(engine, "retry")
    before = snapshot(engine)
    dry = json.loads(run("redrive", str(dead), "--dry-run", "--json").stdout)
    assert dry == {"action": "redrive", "dry_run": True, "count": 1, "ids": [dead]}
    assert json_error(run("redrive", "4242", "--dry-run", "--json"))["kind"] == "not_found"
    assert snapshot(engine) == before


def test_bulk_cancel_by_channel_or_ordering_key(
    run: Any, engine: sa.Engine, terminal: None
) -> None:
    keyed = enqueue(engine, 2, ordering_key="customer-7")
    other = enqueue(engine, 1, ordering_key="customer-8")
    before = snapshot(engine)
    dry = json.loads(run("cancel", "--ordering-key", "customer-7", "--dry-run", "--json").stdout)
    assert dry == {"action": "cancel", "dry_run": True, "count": 2, "ids": keyed}
    assert run("cancel", "--ordering-key", "customer-7", input="\n").exit_code == 1  # default: no
    assert snapshot(engine) == before
    done = run("cancel", "--ordering-key", "customer-7", "--yes", "--json")
    assert json.loads(done.stdout)["ids"] == keyed
    with engine.connect() as conn:
        assert store.statuses_of(conn, keyed + other) == {
            keyed[0]: "cancelled",
            keyed[1]: "cancelled",
            other[0]: "pending",
        }
    everything = run("cancel", "--channel", "email", "--yes")
    assert "cancelled 1 message(s)" in everything.stdout


def test_errors_under_json_are_one_object_on_stdout(run: Any, engine: sa.Engine) -> None:
    bad_status = run("list", "--status", "lost", "--json")
    assert bad_status.exit_code == 2
    assert json_error(bad_status) == {
        "kind": "bad_argument",
        "message": "unknown status 'lost'; choose from " + ", ".join(states.STATUSES),
    }
    missing = run("show", "999", "--json")
    assert missing.exit_code == 1 and json_error(missing)["kind"] == "not_found"
    bad_option = run("list", "--colour", "--json")
    assert bad_option.exit_code == 2 and json_error(bad_option)["kind"] == "bad_argument"
    (pending,) = enqueue(engine, 1)
    wrong_state = run("redrive", str(pending), "--json")
    assert json_error(wrong_state)["kind"] == "conflict"


def test_list_pages_with_limit_and_after(run: Any, engine: sa.Engine) -> None:
    ids = enqueue(engine, 5)
    seen: list[int] = []
    after: list[str] = []
    while True:
        page = json.loads(run("list", "--limit", "2", *after, "--json").stdout)
        seen += [m["id"] for m in page["messages"]]
        if page["next_after"] is None:
            break
        after = ["--after", str(page["next_after"])]
    assert seen == sorted(ids, reverse=True)
    text = run("list", "--limit", "2").stdout
    assert f"--after {sorted(ids)[-2]}" in text


def test_list_finds_by_dedupe_and_ordering_key_and_shows_the_due_time(
    run: Any, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        first = outbox.enqueue(conn, "email", EMAIL, dedupe_key="order-42", delay=3600)
        second = outbox.enqueue(conn, "email", EMAIL, ordering_key="customer-7")
        due_at = conn.execute(
            sa.text("SELECT available_at FROM outbox_message WHERE id = :id"), {"id": first}
        ).scalar_one()
    by_dedupe = json.loads(run("list", "--dedupe-key", "order-42", "--json").stdout)
    assert [m["id"] for m in by_dedupe["messages"]] == [first]
    by_ordering = json.loads(run("list", "--ordering-key", "customer-7", "--json").stdout)
    assert [m["id"] for m in by_ordering["messages"]] == [second]
    assert json.loads(run("list", "--ordering-key", "nobody", "--json").stdout)["messages"] == []
    text = run("list", "--dedupe-key", "order-42").stdout
    assert "due" in text
    assert due_at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") in text


def list_rows(text: str, ids: Sequence[str]) -> dict[str, str]:
    """The line of ``outbox list``'s table that starts with each of ``ids``;
    asserts that the table has no other lines (a folded row would add some)."""
    lines = [line for line in text.splitlines() if line.strip()]
    header, rule, *rows = lines
    assert header.split()[0] == "id" and header.split()[-1] == "last_error", text
    assert set(rule.strip()) == {"─"}, text
    by_id = {line.split()[0]: line for line in rows}
    assert sorted(by_id) == sorted(ids) and len(rows) == len(ids), text
    return by_id


def test_list_rows_stay_on_one_line_without_a_terminal(
    run: Any, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Piped or redirected, a table is as wide as its widest row: each row is
    one line that grep finds whole, however long its free text."""
    monkeypatch.delenv("COLUMNS", raising=False)
    failed = enqueue(engine, 3)
    error = "MessageRejected: " + "a very long provider error " * 8
    settle_all(engine, "failed", error=error)
    key = "customer-" + "7" * 120
    held = enqueue(engine, 2, ordering_key=key, delay=60)
    result = run("list")
    assert result.exit_code == 0, result.output
    rows = list_rows(result.stdout, [str(i) for i in failed + held])
    for i in failed:
        assert error.strip() in rows[str(i)]
    for i in held:
        assert key in rows[str(i)]
        assert len(re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", rows[str(i)])) == 2  # due, created
    assert max(len(line) for line in result.stdout.splitlines()) > 300  # no fold at 80 or 100


def test_list_tables_fold_free_text_to_columns_but_never_a_timestamp(
    run: Any, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A width asked for with COLUMNS holds: long free text folds in its own
    column; every time stays whole on one line."""
    monkeypatch.setenv("COLUMNS", "120")
    enqueue(engine, 3)
    settle_all(engine, "failed", error="MessageRejected: " + "a very long provider error " * 8)
    enqueue(engine, 2, ordering_key="customer-" + "7" * 120, delay=60)
    text = run("list").stdout
    stamps = re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", text)
    assert len(stamps) == 3 + 2 * 2, text  # created for all, due for the pending ones
    assert max(len(line) for line in text.splitlines()) <= 120


def test_channel_filters_accept_a_channel_present_only_in_the_database(
    run: Any, engine: sa.Engine
) -> None:
    """A custom channel this process has not registered, but whose messages
    are in the outbox (written by another service), can be filtered on."""
    with engine.begin() as conn:
        custom = conn.execute(
            sa.text(
                "INSERT INTO outbox_message (channel, payload) VALUES ('carrier_pigeon', '{}') "
                "RETURNING id"
            )
        ).scalar_one()
    listed = json.loads(run("list", "--channel", "carrier_pigeon", "--json").stdout)
    assert [m["id"] for m in listed["messages"]] == [custom]
    unknown = run("list", "--channel", "carrier-owl", "--json")
    assert unknown.exit_code == 2
    assert "unknown channel 'carrier-owl'" in json_error(unknown)["message"]
    hostile = run("list", "--channel", "x'; DROP TABLE outbox_message; --", "--json")
    assert hostile.exit_code == 2 and json_error(hostile)["kind"] == "bad_argument"


def test_redrive_numbers_attempts_on_and_gives_a_fresh_budget(run: Any, engine: sa.Engine) -> None:
    """A redriven message's next attempt is 3, not a second 1; it has its two
    attempts again (and the backoff starts over); the claim fields and the
    last error of its dead end are gone, the history stays."""
    (message_id,) = enqueue(engine, 1, max_attempts=2)
    for _ in range(2):
        settle_all(engine, "retry", error="Throttling")
        make_due(engine)
    with engine.connect() as conn:
        assert row(conn, message_id).status == "dead"
    assert run("redrive", str(message_id)).exit_code == 0
    with engine.connect() as conn:
        r = row(conn, message_id)
    assert (r.status, r.attempts, r.last_error, r.claimed_at, r.claim_token) == (
        "pending",
        2,
        None,
        None,
        None,
    )
    with engine.begin() as conn:
        (claim,) = store.claim(conn, 10, 60)
    assert claim.attempt == 3
    settle_all_claimed = [store.Settlement(claim.id, claim.claim_token, "retry", error="Boom")]
    with engine.begin() as conn:
        assert store.settle(conn, settle_all_claimed, BACKOFF) == {message_id: "pending"}
        backoff = conn.execute(
            sa.text("SELECT EXTRACT(EPOCH FROM available_at - now()) FROM outbox_message")
        ).scalar_one()
    assert float(backoff) <= BACKOFF.base_seconds  # the first retry's backoff again
    make_due(engine)
    settle_all(engine, "retry", error="Boom")
    with engine.connect() as conn:
        assert row(conn, message_id).status == "dead"
        numbers = [(a.attempt, a.outcome) for a in attempts(conn, message_id)]
    assert numbers == [(1, "retry"), (2, "dead"), (3, "retry"), (4, "dead")]
