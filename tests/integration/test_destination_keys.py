"""One key a webhook receiver (migration 0019, issue 31 item 4): every
spelling of a host (case, trailing dot, the default port, leading zeros, IDN
and full-width forms) is one destination, in SQL and in Python alike, so an
operator's limit holds whatever spelling a producer writes; a host ``*``
(the channel-wide key) is refused at enqueue and never becomes a key."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

import outbox
from outbox import migrate, store
from outbox.limits import check_destination, webhook_destination
from support import claim


def full_width(ascii_text: str) -> str:
    """The full-width spelling (U+FF01...) that NFKC, so IDNA, reads as ASCII."""
    return "".join(chr(ord(c) + 0xFEE0) for c in ascii_text)


SPELLINGS = [
    "https://hooks.example.com/a",
    "https://HOOKS.Example.Com/b",
    "https://hooks.example.com./c",
    "https://hooks.example.com:443/d",
    "https://hooks.example.com:0443/e",
    "https://Hooks.Example.COM.:443/f",
    f"https://{full_width('hooks')}.example.com/g",
    "https://hooks。example.com/h",  # the ideographic full stop is a dot to IDNA
]


def destination_of(conn: sa.Connection, url: str) -> str:
    return str(
        conn.execute(
            sa.text("SELECT outbox_destination_of('webhook', CAST(:p AS jsonb))"),
            {"p": json.dumps({"url": url})},
        ).scalar_one()
    )


def hook(url: str) -> dict[str, Any]:
    return {"url": url, "event_type": "t", "body": {}}


@pytest.mark.parametrize(
    ("url", "key"),
    [
        *((url, "hooks.example.com") for url in SPELLINGS),
        ("https://hooks.example.com:8443/a", "hooks.example.com:8443"),
        ("https://hooks.example.com:08443/a", "hooks.example.com:8443"),
        ("http://hooks.example.com:80/a", "hooks.example.com"),
        ("http://hooks.example.com:443/a", "hooks.example.com:443"),  # not http's default
        ("https://[2001:DB8::1]:443/a", "[2001:db8::1]"),
        ("https://bücher.example/", "xn--bcher-kva.example"),
        ("https://BÜCHER.example./", "xn--bcher-kva.example"),
        ("https://xn--bcher-kva.example/", "xn--bcher-kva.example"),
        ("https://例え.テスト:8443/", "xn--r8jz45g.xn--zckzah:8443"),
        ("https://münchen.de/", "xn--mnchen-3ya.de"),
        ("https://*/x", ""),  # no host name: no key, never the channel-wide one
        ("https://a..b/x", ""),
    ],
)
def test_every_spelling_of_a_receiver_is_one_key(engine: sa.Engine, url: str, key: str) -> None:
    with engine.connect() as conn:
        assert destination_of(conn, url) == key


@pytest.mark.parametrize(
    "host",
    [
        "bücher.example",
        "例え.テスト",
        "münchen.de",
        f"{full_width('example')}.com",
        "παράδειγμα.δοκιμή",
        "a.b.c",
    ],
)
def test_the_key_is_the_name_the_connection_resolves(engine: sa.Engine, host: str) -> None:
    # Python's IDNA codec is what the webhook channel resolves and connects with
    connected = host.encode("idna").decode("ascii")
    with engine.connect() as conn:
        assert destination_of(conn, f"https://{host}/") == connected
    assert webhook_destination(host) == connected


@pytest.mark.parametrize(
    "host_and_port",
    [
        "Hooks.Example.COM.:0443",
        "hooks.example.com:8443",
        "[2001:DB8::1]:443",
        "BÜCHER.example.",
        "例え.テスト:8443",
        f"{full_width('hooks')}.example.com",
        "x_y.example",
    ],
)
def test_a_limit_is_keyed_as_the_rows_are(engine: sa.Engine, host_and_port: str) -> None:
    with engine.connect() as conn:
        assert check_destination("webhook", host_and_port) == destination_of(
            conn, f"https://{host_and_port}/p"
        )


def test_a_limit_holds_every_spelling_of_its_receiver(engine: sa.Engine) -> None:
    # the attack: an operator holds the receiver to 1 a second, a producer
    # writes its URLs a different way each time
    with engine.begin() as conn:
        destination = store.check_destination("webhook", "Hooks.Example.COM:443")
        store.set_limit(conn, "webhook", destination, 1, 1)
        outbox.enqueue_many(
            conn,
            [{"channel": "webhook", "payload": hook(url)} for url in SPELLINGS * 3],
        )
    assert len(claim(engine)) == 1
    with engine.connect() as conn:
        keys = conn.execute(
            sa.text("SELECT DISTINCT destination FROM outbox_message WHERE channel = 'webhook'")
        ).scalars()
        assert set(keys) == {"hooks.example.com"}


def test_a_host_star_is_refused_at_enqueue_and_never_waits_for_ever(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        with pytest.raises(outbox.ValidationError, match="must name a host"):
            outbox.enqueue(conn, "webhook", hook("https://*/x"))
        # the same row by hand, past the checks, under a channel-wide limit:
        # it gets no key of its own, so the channel's bucket serves it
        store.set_limit(conn, "webhook", store.check_destination("webhook", "*"), 100, 10)
        conn.execute(
            sa.text("INSERT INTO outbox_message (channel, payload) VALUES ('webhook', :p)"),
            {"p": json.dumps(hook("https://*/x"))},
        )
    [claimed] = claim(engine)
    with engine.connect() as conn:
        assert (
            conn.execute(
                sa.text("SELECT destination FROM outbox_message WHERE id = :id"), {"id": claimed.id}
            ).scalar_one()
            == ""
        )


def test_the_upgrade_rekeys_rows_and_merges_destinations(
    empty_database: tuple[str, sa.Engine],
) -> None:
    _, database = empty_database
    migrate.upgrade(database, "0018")
    with database.begin() as conn:
        for url in ("https://A.example:443/1", "https://a.example./2", "https://b.example/3"):
            conn.execute(
                sa.text("INSERT INTO outbox_message (channel, payload) VALUES ('webhook', :p)"),
                {"p": json.dumps(hook(url))},
            )
        conn.execute(
            sa.text(
                "UPDATE outbox_message SET status = 'dead', settled_at = now() "
                "WHERE payload ->> 'url' LIKE '%/2'"
            )
        )
        assert set(conn.execute(sa.text("SELECT destination FROM outbox_message")).scalars()) == {
            "a.example:443",
            "a.example.",
            "b.example",
        }
        # learned and limited rows under old spellings
        conn.execute(
            sa.text(
                "INSERT INTO outbox_destination (channel, destination, rate, limit_rate, "
                "limit_burst, limit_source) VALUES "
                "('webhook', 'a.example:443', 5, 2, 4, 'operator'), "
                "('webhook', 'a.example.', 7, NULL, NULL, NULL), "
                "('webhook', 'b.example', 3, NULL, NULL, NULL), "
                "('webhook', '*', NULL, 50, 50, 'operator')"
            )
        )
    migrate.upgrade(database)
    with database.connect() as conn:
        assert set(conn.execute(sa.text("SELECT destination FROM outbox_message")).scalars()) == {
            "a.example",
            "b.example",
        }
        rows = conn.execute(
            sa.text(
                "SELECT destination, limit_rate, limit_burst, limit_source "
                "FROM outbox_destination ORDER BY destination"
            )
        ).all()
    assert [tuple(r) for r in rows] == [
        ("*", 50, 50, "operator"),
        ("a.example", 2, 4, "operator"),
        ("b.example", None, None, None),
    ]
    # and back: 0018's function again, the rows as they are
    migrate.downgrade(database, "0018")
    with database.connect() as conn:
        assert destination_of(conn, "https://A.example:443/") == "a.example:443"
