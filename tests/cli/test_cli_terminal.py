"""What producers and remote servers wrote never drives the operator's terminal.

`outbox list`, `show` and `history` print ordering keys, dedupe keys, errors,
payloads and provider ids that someone else chose. Rich markup in them prints
literally; escape sequences (OSC 8 links, OSC 52 clipboard writes, clear
screen), other control characters and bidi overrides are removed; `--json`
keeps every value exact."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

import outbox
from outbox import store
from support import EMAIL, settings

BACKOFF = settings().backoff()

MARKUP = "acme [/]"
HYPERLINK = "\x1b]8;;http://x\x07link\x1b]8;;\x07"
CLIPBOARD = "\x1b]52;c;ZXZpbA==\x07"
CLEAR_SCREEN = "\x1b[2J"
BIDI = "\u202egnp.exe\u202c \u2066x\u2069"
C1_CSI = "\x9b31m"  # an 8-bit CSI: some terminals read it as ESC [
HOSTILE = (MARKUP, HYPERLINK, CLIPBOARD, CLEAR_SCREEN, BIDI, C1_CSI)
# What must never reach a terminal from the data: ESC, BEL, the other C0
# controls but tab and newline, DEL, C1, and the bidi overrides and isolates.
FORBIDDEN = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# Rich's own styling on a terminal: SGR sequences only.
SGR = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def run(engine: sa.Engine, database_url: str) -> Any:
    runner = CliRunner()

    def invoke(*args: str, **env: str) -> Result:
        return runner.invoke(cli_command(), list(args), env={"DATABASE_URL": database_url, **env})

    return invoke


def cli_command() -> Any:
    from outbox_cli.cli import cli

    return cli


def seed_hostile(engine: sa.Engine) -> int:
    """One email message whose every free-text field holds hostile text, as a
    producer, a custom channel or a provider could leave it."""
    payload = {**EMAIL, "to": ["ada@example.net"], "subject": "".join(HOSTILE)}
    with engine.begin() as conn:
        message_id = outbox.enqueue(
            conn, "email", payload, ordering_key=MARKUP + BIDI, dedupe_key=HYPERLINK
        )
        (claim,) = store.claim(conn, 10, 60)
        store.settle(
            conn, [store.Settlement(claim.id, claim.claim_token, "failed", error="x")], BACKOFF
        )
        # As a custom channel or a provider could word them (written here
        # directly, whatever the settle keeps of an error).
        conn.execute(
            sa.text("UPDATE outbox_message SET last_error = :e WHERE id = :id"),
            {"e": CLIPBOARD + MARKUP + CLEAR_SCREEN, "id": message_id},
        )
        conn.execute(
            sa.text(
                "UPDATE outbox_attempt SET error = :e, provider_message_id = :p "
                "WHERE message_id = :id"
            ),
            {"e": HYPERLINK + MARKUP + C1_CSI, "p": CLEAR_SCREEN + BIDI, "id": message_id},
        )
    return message_id


def assert_inert(text: str, folded: bool = False) -> None:
    assert not FORBIDDEN.search(text), repr(FORBIDDEN.findall(text))
    # printed literally, brackets and all (a narrow column may fold it at its space)
    assert ("[/]" if folded else MARKUP) in text


@pytest.mark.parametrize("columns", [None, "100", "160"])
def test_list_show_and_history_print_hostile_text_inert(
    run: Any, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, columns: str | None
) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    message_id = seed_hostile(engine)
    for args in (
        ("list",),
        ("list", "--ordering-key", MARKUP + BIDI),
        ("show", str(message_id)),
        ("history", "--recipient", "ada@example.net"),
    ):
        result = run(*args)
        assert result.exit_code == 0, (args, result.output)
        assert_inert(result.stdout, folded=columns is not None)
    listed = run("list").stdout
    assert "ZXZpbA==" not in listed  # the whole OSC 52 sequence is gone, not just its ESC
    assert "http://x" not in listed


def test_json_keeps_every_hostile_value_exact_and_escaped(run: Any, engine: sa.Engine) -> None:
    message_id = seed_hostile(engine)
    listed = run("list", "--json")
    shown = run("show", str(message_id), "--json")
    history = run("history", "--recipient", "ada@example.net", "--json")
    for result in (listed, shown, history):
        assert result.exit_code == 0, result.output
        assert not FORBIDDEN.search(result.stdout)  # escaped as \\uXXXX, not raw
    (row,) = json.loads(listed.stdout)["messages"]
    assert row["ordering_key"] == MARKUP + BIDI
    assert row["last_error"] == CLIPBOARD + MARKUP + CLEAR_SCREEN
    message = json.loads(shown.stdout)
    assert message["message"]["dedupe_key"] == HYPERLINK
    assert message["message"]["payload"]["subject"] == "".join(HOSTILE)
    (attempt,) = message["attempts"]
    assert attempt["error"] == HYPERLINK + MARKUP + C1_CSI
    assert attempt["provider_message_id"] == CLEAR_SCREEN + BIDI
    (sent,) = json.loads(history.stdout)["attempts"]
    assert (sent["error"], sent["provider_message_id"]) == (
        HYPERLINK + MARKUP + C1_CSI,
        CLEAR_SCREEN + BIDI,
    )


def test_on_a_real_terminal_only_rich_styles_reach_it(engine: sa.Engine, database_url: str) -> None:
    """`outbox show` and `list` on a pseudo-terminal of 120 columns: Rich styles
    its tables there (SGR sequences); nothing else from the data gets through."""
    message_id = seed_hostile(engine)
    for args in (["show", str(message_id)], ["list"]):
        output, code = on_a_terminal(args, database_url, columns=120)
        assert code == 0, output
        assert SGR.search(output), "not treated as a terminal"
        assert_inert(SGR.sub("", output).replace("\r\n", "\n"), folded=True)


def on_a_terminal(args: list[str], database_url: str, columns: int) -> tuple[str, int]:
    main, child = pty.openpty()
    env = {**os.environ, "DATABASE_URL": database_url, "COLUMNS": str(columns), "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox_cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=child,
        stderr=child,
        env=env,
    )
    os.close(child)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([main], [], [], 60)
            if not ready:
                break
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(main)
        code = process.wait(timeout=60)
    return b"".join(chunks).decode("utf-8"), code


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (MARKUP, MARKUP),
        (HYPERLINK, "link"),
        (CLIPBOARD, ""),
        (CLEAR_SCREEN + "x", "x"),
        ("a\x1b[31;1mred\x1b[0m", "ared"),
        ("\x1bPq#0;2;0;0;0\x1b\\after", "after"),  # DCS (sixel) up to its terminator
        ("\x1b]0;title", ""),  # an OSC left open swallows the rest, never the terminal
        ("\x9b2J\x9d0;t\x07ok", "ok"),  # the 8-bit forms of CSI and OSC
        ("bell\x07 back\x08 del\x7f", "bell back del"),
        ("\u202eabc\u202c\u2067d\u2069\u200f", "abcd"),
        ("tab\there", "tab here"),
        ("line\r\nbreak", "line\u2424break"),
        ("a\u2028b\x85c", "a\u2424b\u2424c"),  # Unicode's line and next-line separators
        ("é [b]ü[/b] 日本", "é [b]ü[/b] 日本"),
        (None, ""),
        (42, "42"),
    ],
)
def test_inert(raw: Any, shown: str) -> None:
    from outbox_cli.render import inert

    assert inert(raw) == shown


def test_status_prints_a_pause_reason_inert(run: Any, engine: sa.Engine) -> None:
    """A pause reason is text someone typed (or wrote into the table)."""
    seed_hostile(engine)
    paused = run("pause", "email", "--reason", CLIPBOARD + MARKUP + BIDI)
    assert paused.exit_code == 0, paused.output
    result = run("status")
    assert result.exit_code == 0, result.output
    assert_inert(result.stdout)
    assert "PAUSED" in result.stdout and "ZXZpbA==" not in result.stdout
    status = json.loads(run("status", "--json").stdout)
    assert status["paused_channels"][0]["reason"] == CLIPBOARD + MARKUP + BIDI
