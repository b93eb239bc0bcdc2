"""``outbox tenant ...``, ``--tenant`` and ``status --by tenant`` against the
real database (docs/how-to/tenants.md)."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from outbox import store
from support import EMAIL, claim


def test_enqueue_and_list_by_tenant(run: Any, engine: sa.Engine) -> None:
    ids = {}
    for tenant in ("acme", "beta"):
        result = run(
            "enqueue", "--channel", "email", "--payload", json.dumps(EMAIL),
            "--tenant", tenant, "--json",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        ids[tenant] = json.loads(result.stdout)["id"]
    listed = run("list", "--tenant", "acme", "--json")
    assert [m["id"] for m in json.loads(listed.stdout)["messages"]] == [ids["acme"]]
    assert json.loads(listed.stdout)["messages"][0]["tenant"] == "acme"
    refused = run("enqueue", "--channel", "email", "--payload", json.dumps(EMAIL),
                  "--tenant", "not a tenant")  # fmt: skip
    assert refused.exit_code == 2 and "tenant: must be" in refused.output
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 2


def test_status_by_tenant_counts_due_in_flight_and_delivered(run: Any, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        import outbox

        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 3, tenant="acme")
        outbox.enqueue(conn, "email", EMAIL)
    claims = [c for c in claim(engine, batch=2)]
    shown = run("status", "--by", "tenant", "--json")
    assert shown.exit_code == 0, shown.output
    by_tenant = {t["tenant"]: t for t in json.loads(shown.stdout)["tenants"]}
    assert by_tenant["acme"]["due"] + by_tenant[None]["due"] == 2
    assert by_tenant["acme"]["in_flight"] + by_tenant[None]["in_flight"] == len(claims) == 2
    text = run("status", "--by", "tenant")
    assert "acme" in text.output and "(none)" in text.output


def test_weight_pause_bind_and_secret_are_shown_and_read_by_the_doors(
    run: Any, engine: sa.Engine
) -> None:
    assert run("tenant", "set", "acme", "--weight", "3").exit_code == 0
    assert run("tenant", "pause", "beta").exit_code == 0
    assert run("tenant", "secret", "acme-key", "acme").exit_code == 0
    assert run("tenant", "bind", "outbox_producer", "acme").exit_code == 0
    missing = run("tenant", "bind", "no_such_role_here", "acme")
    assert missing.exit_code == 2 and "no database role" in missing.output
    shown = {t["tenant"]: t for t in json.loads(run("tenant", "show", "--json").stdout)["tenants"]}
    assert shown["acme"] == {
        "tenant": "acme", "weight": 3, "paused": False,
        "roles": ["outbox_producer"], "secrets": ["acme-key"],
    }  # fmt: skip
    assert shown["beta"]["paused"] is True
    with engine.connect() as conn:
        (settings,) = store.tenant_settings(conn, "beta")
    assert settings.paused
    assert run("tenant", "resume", "beta").exit_code == 0
    unsecret = run("tenant", "unsecret", "acme-key", "--json")
    assert json.loads(unsecret.stdout) == {"secret_id": "acme-key", "changed": True}
    assert json.loads(run("tenant", "unbind", "outbox_producer", "--json").stdout)["changed"]
    assert run("tenant", "pause", "bad name").exit_code == 2


def test_cancel_and_redrive_take_a_tenant(run: Any, engine: sa.Engine) -> None:
    import outbox

    with engine.begin() as conn:
        acme = outbox.enqueue(conn, "email", EMAIL, ordering_key="k", tenant="acme")
        beta = outbox.enqueue(conn, "email", EMAIL, ordering_key="k", tenant="beta")
    cancelled = run("cancel", "--ordering-key", "k", "--tenant", "acme", "--yes", "--json")
    assert cancelled.exit_code == 0, cancelled.output
    with engine.connect() as conn:
        status = dict(conn.execute(sa.text("SELECT id, status FROM outbox_message")).all())
    assert status == {acme: "cancelled", beta: "pending"}
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_message SET status = 'dead', settled_at = now() WHERE id = :id"),
            {"id": beta},
        )
    redriven = run("redrive", "--status", "dead", "--tenant", "acme", "--yes", "--json")
    assert redriven.exit_code == 0, redriven.output
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT status FROM outbox_message WHERE id = :id"), {"id": beta}
            ).scalar_one()
            == "dead"
        )
    assert run("redrive", "--status", "dead", "--tenant", "beta", "--yes").exit_code == 0
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT status FROM outbox_message WHERE id = :id"), {"id": beta}
            ).scalar_one()
            == "pending"
        )


def test_history_and_show_by_tenant(run: Any, engine: sa.Engine) -> None:
    import outbox

    with engine.begin() as conn:
        acme = outbox.enqueue(conn, "email", EMAIL, tenant="acme")
        beta = outbox.enqueue(conn, "email", EMAIL, tenant="beta")
    claims = claim(engine)
    with engine.begin() as conn:
        store.settle(
            conn,
            [store.Settlement(c.id, c.claim_token, "delivered") for c in claims],
            store.Backoff(1, 60, 3),
        )
    recipient = EMAIL["to"][0]
    both = json.loads(run("history", "--recipient", recipient, "--json").stdout)["attempts"]
    assert sorted((a["message_id"], a["tenant"]) for a in both) == [(acme, "acme"), (beta, "beta")]
    only = run("history", "--recipient", recipient, "--tenant", "acme", "--json")
    assert only.exit_code == 0, only.output
    assert [a["message_id"] for a in json.loads(only.stdout)["attempts"]] == [acme]
    assert run("show", str(acme), "--tenant", "acme").exit_code == 0
    elsewhere = run("show", str(acme), "--tenant", "beta")
    assert elsewhere.exit_code == 1
    assert f"no message with id {acme} of tenant 'beta'" in elsewhere.output
    assert run("history", "--recipient", recipient, "--tenant", "no way").exit_code == 2


def test_pause_and_resume_a_channel_for_one_tenant(run: Any, engine: sa.Engine) -> None:
    import outbox

    with engine.begin() as conn:
        held = outbox.enqueue(conn, "email", EMAIL, tenant="acme")
        other = outbox.enqueue(conn, "email", EMAIL, tenant="beta")
    paused = run("pause", "email", "--tenant", "acme", "--reason", "\x1b[31min review", "--json")
    assert paused.exit_code == 0, paused.output
    assert json.loads(paused.stdout) == {
        "channel": "email", "tenant": "acme", "paused": True, "changed": True,
    }  # fmt: skip
    again = run("pause", "email", "--tenant", "acme")
    assert again.output.strip() == "channel email for tenant acme was already paused"
    status = run("status")
    assert "channel email is PAUSED for tenant acme" in status.output
    assert "outbox resume email --tenant acme" in status.output
    assert "\x1b" not in status.output  # the reason is inert text
    shown = json.loads(run("tenant", "show", "acme", "--json").stdout)
    assert [(c["channel"], c["paused"]) for c in shown["channels"]] == [("email", True)]
    assert [c.id for c in claim(engine)] == [other]
    resumed = run("resume", "email", "--tenant", "acme")
    assert resumed.output.strip() == "channel email for tenant acme resumed"
    assert [c.id for c in claim(engine)] == [held]
    assert run("pause", "email", "--tenant", "not a tenant").exit_code == 2


def test_a_rate_limit_for_one_tenants_channel(run: Any, engine: sa.Engine) -> None:
    set_ = run("limit", "set", "webhook", "--tenant", "acme", "--rate", "0.5", "--burst", "2")
    assert set_.exit_code == 0, set_.output
    assert set_.output.strip() == "webhook for tenant acme: at most 0.5/s, 2 at once"
    shown = json.loads(run("limit", "show", "--json").stdout)
    assert shown["tenants"] == [
        {"tenant": "acme", "channel": "webhook", "paused": False, "reason": None,
         "limit_per_second": 0.5, "limit_burst": 2.0, "tokens": 2.0},
    ]  # fmt: skip
    assert "acme" in run("limit", "show").output
    both = run("limit", "set", "webhook", "--tenant", "acme", "--destination", "a.example",
               "--rate", "1")  # fmt: skip
    assert both.exit_code == 2 and "not both" in both.output
    bad = run("limit", "set", "webhook", "--tenant", "acme", "--rate", "-1")
    assert bad.exit_code == 2 and "rate" in bad.output
    cleared = run("limit", "clear", "webhook", "--tenant", "acme", "--json")
    assert json.loads(cleared.stdout) == {"channel": "webhook", "tenant": "acme", "changed": True}
    assert run("limit", "clear", "webhook", "--tenant", "acme").output.strip() == (
        "no limit was set"
    )
    with engine.connect() as conn:
        assert store.tenant_channels(conn) == []
