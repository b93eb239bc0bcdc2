"""How the commands' results look: rich tables for people, JSON for programs.

The JSON convention (every command's ``--json``):

* one JSON object on stdout, nothing else there;
* snake_case keys; ids are integers; times are ISO 8601 with their UTC offset;
  durations are numbers of seconds in keys ending ``_seconds``;
* a listing is ``{"<things>": [...], ...}`` (never a bare array), with
  ``next_after`` when there may be more;
* a change is ``{"action": "redrive", "dry_run": false, "count": 2, "ids": [...]}``;
* an error is ``{"error": {"kind": "not_found", "message": "..."}}`` with the
  same exit code as without ``--json`` (2 for bad arguments, 1 otherwise).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import click

from outbox.limits import CHANNEL_WIDE

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
TIME_COLUMNS = ("due", "created", "finished")


def jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Mapping):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


# Escape sequences, whole: CSI (7- or 8-bit) up to its final byte; OSC, DCS,
# SOS, PM and APC up to their terminator (BEL or ST), or to the end of the text
# when left open; any other ESC with its intermediate and final bytes.
_ESCAPE_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?"
)
_LINE_BREAK = re.compile(r"\r\n|[\r\n\x85\u2028\u2029]")
# What is left to drop: C0 controls (tab and line breaks are replaced before),
# DEL, C1, and the bidi marks, overrides and isolates that reorder a line.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# Shown instead of a line break, so that text can never begin a line of its own
# (a fake row of a table) and grep still finds each row whole.
NEWLINE_SYMBOL = "\u2424"


def inert(value: Any) -> str:
    """``value`` as text that cannot drive a terminal. Producers, custom channels
    and providers choose keys, errors, payloads and ids: their escape sequences
    (OSC 8 links, OSC 52 clipboard writes, clear screen, colours), other
    control characters and bidi overrides are removed, a tab becomes a space and
    a line break a visible symbol. ``--json`` prints the exact values."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the common case: nothing to remove
        return text
    text = _ESCAPE_SEQUENCE.sub("", text)
    text = _LINE_BREAK.sub(NEWLINE_SYMBOL, text.replace("\t", " "))
    return _CONTROL.sub("", text)


def cell(value: Any) -> Any:
    """A table cell: inert text, never read as Rich markup (``acme [/]`` prints as
    it is)."""
    from rich.text import Text

    return Text(inert(value))


def add_row(table: Any, *values: Any) -> None:
    """The one way a row reaches a table: every value through ``cell``."""
    table.add_row(*(cell(v) for v in values))


# JSON leaves these raw under ensure_ascii=False though a terminal may act on
# them (DEL, the 8-bit C1 controls, bidi overrides, line separators). They
# occur only inside strings, where their \uXXXX escapes decode to the same text.
_JSON_UNSAFE = re.compile(r"[\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def json_text(value: Any, indent: int | None = None) -> str:
    """Exact JSON whose every character is safe on a terminal."""
    text = json.dumps(value, indent=indent, ensure_ascii=False)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def emit_json(value: Any) -> None:
    click.echo(json_text(jsonable(value), indent=2))


# Wider than any row can be (a whole payload in ``show`` is at most 256 KiB):
# the width of output that goes to no terminal and asks for none.
UNBOUNDED_WIDTH = 1 << 20


def console() -> Any:
    """Where tables go. On a terminal, or with ``COLUMNS``, at that width (at
    least 100, so that ids and times fit beside some free text) and free text
    folds to it. Piped or redirected (a file, CI, grep), rich would assume 80
    columns and fold every row; there a table is as wide as its widest row, so
    a row is one line."""
    from rich.console import Console

    sized = Console()
    if sized.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        width = max(100, sized.width)  # rich reads COLUMNS itself
    else:
        width = UNBOUNDED_WIDTH
    return Console(highlight=False, emoji=False, soft_wrap=False, width=width)


def when(value: dt.datetime | None) -> str:
    """A time in a table: UTC, to the second, one unbreakable cell."""
    if value is None:
        return ""
    return value.astimezone(dt.UTC).strftime(TIME_FORMAT)


def _table(*columns: str, title: str | None = None, wide: Sequence[str] = ()) -> Any:
    """A table whose cells never wrap, except the ``wide`` (free text) columns,
    which fold into what width is left; ids, statuses and times stay whole on
    one line (a time column is never narrower than a time)."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        if column in wide:
            table.add_column(column, overflow="fold", ratio=1, min_width=8)
        else:
            width = len(TIME_FORMAT.replace("%Y", "2026")) if column in TIME_COLUMNS else None
            table.add_column(column, no_wrap=True, min_width=width)
    return table


def render_error(kind: str, message: str, as_json: bool) -> None:
    if as_json:
        click.echo(json_text({"error": {"kind": kind, "message": message}}))
    else:
        click.echo(f"Error: {inert(message)}", err=True)


def render_revision(previous: str | None, revision: str | None, as_json: bool) -> None:
    """What ``outbox migrate`` did: ``previous`` the revision it found (None: no schema)."""
    if as_json:
        emit_json({"revision": revision, "previous": previous})
    elif previous is None:
        click.echo(f"schema created at revision {revision}")
    elif previous == revision:
        click.echo(f"already at revision {revision}")
    else:
        click.echo(f"upgraded from {previous} to {revision}")


def render_enqueued(message_id: int, channel: str, created: bool, as_json: bool) -> None:
    if as_json:
        # created false: a replay of its dedupe key, the existing message's id
        emit_json({"id": message_id, "channel": channel, "created": created})
    else:
        click.echo(message_id)


def render_status(
    groups: Sequence[Any],
    backlog: Any,
    statuses: Sequence[str],
    as_json: bool,
    paused: Sequence[Any] = (),
    destinations: Sequence[Any] = (),
    snapshot: Any = None,
    tenant_paused: Sequence[Any] = (),
) -> None:
    if as_json:
        emit_json(
            {
                "channels": [
                    {
                        "channel": g.channel,
                        "status": g.status,
                        "count": g.count,
                        "oldest_due_age_seconds": round(g.oldest_due_age_seconds, 3),
                        "expired_claims": g.expired_claims,
                    }
                    for g in groups
                ],
                "pending": backlog.pending,
                "due": backlog.due,
                "oldest_due_age_seconds": round(backlog.oldest_due_age_seconds, 3),
                "claimed": backlog.claimed,
                "expired_claims": backlog.expired_claims,
                "dead": backlog.dead,
                "held": backlog.held,
                "paused_channels": [
                    {
                        "channel": p.channel,
                        "reason": p.reason,
                        "paused_at": p.paused_at,
                        "paused_until": p.paused_until,
                    }
                    for p in paused
                ],
                "paused_tenant_channels": [
                    {"tenant": t.tenant, "channel": t.channel, "reason": t.reason}
                    for t in tenant_paused
                ],
                "destinations": [destination_json(d) for d in destinations],
                "oldest_snapshot": None
                if snapshot is None
                else {
                    "age_seconds": round(snapshot.age_seconds, 3),
                    "xid_age": snapshot.xid_age,
                    "sessions": snapshot.sessions,
                    "hidden_sessions": snapshot.hidden_sessions,
                    "prepared": snapshot.prepared,
                    "slots": snapshot.slots,
                },
            }
        )
        return
    render_status_table(groups, statuses)
    for p in paused:
        why = f": {inert(p.reason)}" if p.reason else ""
        since = p.paused_at.isoformat(timespec="seconds")
        channel = inert(p.channel)
        until = (
            f" until {p.paused_until.isoformat(timespec='seconds')} (or"
            if p.paused_until is not None
            else " ("
        )
        click.echo(
            f"channel {channel} is PAUSED since {since}{why}{until} outbox resume {channel})"
        )
    for t in tenant_paused:
        why = f": {inert(t.reason)}" if t.reason else ""
        channel, tenant = inert(t.channel), inert(t.tenant)
        click.echo(
            f"channel {channel} is PAUSED for tenant {tenant}{why} "
            f"(outbox resume {channel} --tenant {tenant})"
        )
    if destinations:
        render_destinations(destinations, False)
    click.echo(
        f"pending {backlog.pending} (due {backlog.due}, oldest due "
        f"{backlog.oldest_due_age_seconds:.1f}s), claimed {backlog.claimed} "
        f"({backlog.expired_claims} past their lease), dead {backlog.dead}"
    )
    if backlog.held:
        click.echo(
            f"held {backlog.held}: pending behind a failed, dead or expired message of their "
            "ordering key; redrive or cancel that message to let them go"
        )
    if snapshot is not None:
        render_snapshot(snapshot)


def render_snapshot(s: Any) -> None:
    """The oldest snapshot holding back vacuum (``store.OldestSnapshot``)."""
    held = f"{s.sessions} sessions, {s.prepared} prepared transactions, {s.slots} slots"
    click.echo(
        f"oldest snapshot {s.age_seconds:.1f}s ({s.xid_age} transactions old; {held} hold one)"
    )
    if s.hidden_sessions:
        click.echo(
            f"{s.hidden_sessions} sessions of other roles hide their start: their age is not "
            "in the seconds (GRANT pg_monitor to the relay's role to see it)"
        )


def destination_label(destination: str) -> str:
    """A limit's destination as a person reads it."""
    if destination == CHANNEL_WIDE:
        return "the whole channel"
    return inert(destination) if destination else "the account"


def destination_json(d: Any) -> dict[str, Any]:
    """One destination's figures (``store.DestinationFigures``) as JSON."""
    return {
        "channel": d.channel,
        "destination": d.destination,
        "limit_per_second": d.limit_rate,
        "limit_burst": d.limit_burst,
        "limit_source": d.limit_source,
        "rate_per_second": None if d.rate is None else round(d.rate, 3),
        "paused_until": d.paused_until,
        "throttled_last_minute": d.throttled_last_minute,
        "throttled_total": d.throttled_total,
    }


def tenant_channel_json(t: Any) -> dict[str, Any]:
    """One tenant's channel (``store.TenantChannel``) as JSON."""
    return {
        "tenant": t.tenant,
        "channel": t.channel,
        "paused": t.paused,
        "reason": t.reason,
        "limit_per_second": t.limit_rate,
        "limit_burst": t.limit_burst,
        "tokens": None if t.tokens is None else round(t.tokens, 3),
    }


def render_tenant_channels(rows: Sequence[Any]) -> None:
    """The tenants' channels paused or limited for them alone."""
    table = _table(
        "tenant",
        "channel",
        "paused",
        "reason",
        "limit/s",
        "burst",
        "tokens",
        title="tenants' channels",
    )
    for t in rows:
        add_row(
            table,
            t.tenant,
            t.channel,
            "yes" if t.paused else "",
            t.reason or "",
            "" if t.limit_rate is None else f"{t.limit_rate:g}",
            "" if t.limit_burst is None else f"{t.limit_burst:g}",
            "" if t.tokens is None else f"{t.tokens:.1f}",
        )
    console().print(table)


def render_destinations(
    destinations: Sequence[Any], as_json: bool, tenants: Sequence[Any] = ()
) -> None:
    """The destinations with a limit or that asked the relay to slow down: the
    limit, the rate it learned, how often they throttled, until when paused;
    and the limits of tenants' channels (``tenants``)."""
    if as_json:
        emit_json(
            {
                "destinations": [destination_json(d) for d in destinations],
                "tenants": [tenant_channel_json(t) for t in tenants],
            }
        )
        return
    if tenants:
        render_tenant_channels(tenants)
    if not destinations:
        if not tenants:
            click.echo("no limits set, and no destination has throttled")
        return
    table = _table(
        "channel",
        "destination",
        "limit/s",
        "burst",
        "set by",
        "learned rate/s",
        "throttled (1 min)",
        "throttled",
        "paused until",
        title="destinations",
    )
    for d in destinations:
        add_row(
            table,
            d.channel,
            f"({destination_label(d.destination)})"
            if d.destination in ("", CHANNEL_WIDE)
            else d.destination,
            "" if d.limit_rate is None else f"{d.limit_rate:g}",
            "" if d.limit_burst is None else f"{d.limit_burst:g}",
            d.limit_source or "",
            "" if d.rate is None else f"{d.rate:.2f}",
            d.throttled_last_minute,
            d.throttled_total,
            "" if d.paused_until is None else d.paused_until.isoformat(timespec="seconds"),
        )
    console().print(table)


def render_status_table(
    groups: Sequence[Any], statuses: Sequence[str], title: str = "messages"
) -> None:
    """Messages per channel (rows) and status (columns)."""
    counts: dict[str, dict[str, int]] = {}
    for g in groups:
        counts.setdefault(g.channel, {})[g.status] = g.count
    shown = [s for s in statuses if any(s in c for c in counts.values())] or ["pending"]
    table = _table("channel", *shown, "total", title=title)
    for channel, by_status in sorted(counts.items()):
        add_row(table, channel, *(by_status.get(s, 0) for s in shown), sum(by_status.values()))
    console().print(table)


def render_messages(rows: Sequence[Any], next_after: int | None, as_json: bool) -> None:
    """A page of ``outbox list``; ``next_after`` continues it."""
    if as_json:
        emit_json({"messages": [dict(r._mapping) for r in rows], "next_after": next_after})
        return
    table = _table(
        "id",
        "channel",
        "status",
        "attempts",
        "due",
        "created",
        "ordering_key",
        "last_error",
        wide=("ordering_key", "last_error"),
    )
    for r in rows:
        add_row(
            table,
            r.id,
            r.channel,
            r.status,
            r.attempts,
            when(r.available_at) if r.status == "pending" else "",
            when(r.created_at),
            r.ordering_key,
            r.last_error,
        )
    console().print(table)
    if next_after is not None:
        click.echo(f"more: the same command with --after {next_after}")


def render_message(
    message: Mapping[str, Any], history: Sequence[Mapping[str, Any]], as_json: bool
) -> None:
    """``outbox show``: one message, payload included, and its attempts."""
    if as_json:
        emit_json({"message": dict(message), "attempts": [dict(a) for a in history]})
        return
    out = console()
    fields = _table("field", "value", title=f"message {message['id']}", wide=("value",))
    fields.show_header = False
    for key, value in message.items():
        if value is None:
            continue
        if key == "payload":  # decoded, or the stored text of one beyond the limits
            shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        elif isinstance(value, dt.datetime):
            shown = when(value)
        else:
            shown = str(jsonable(value))
        add_row(fields, key, shown)
    out.print(fields)
    attempts = _table(
        "attempt",
        "outcome",
        "error",
        "provider_message_id",
        "finished",
        "ms",
        title="attempts",
        wide=("error", "provider_message_id"),
    )
    for a in history:
        add_row(
            attempts,
            a["attempt"],
            a["outcome"],
            a["error"],
            a["provider_message_id"],
            when(a["finished_at"]),
            a["duration_ms"],
        )
    out.print(attempts)


def render_history(rows: Sequence[Any], as_json: bool) -> None:
    """``outbox history``: the attempts that went to one recipient, newest first."""
    if as_json:
        emit_json({"attempts": [dict(r._mapping) for r in rows]})
        return
    table = _table(
        "finished",
        "channel",
        "message_id",
        "attempt",
        "outcome",
        "error",
        "provider_message_id",
        "message_status",
        title=f"attempts, newest first ({len(rows)})",
        wide=("error", "provider_message_id"),
    )
    for r in rows:
        add_row(
            table,
            when(r.finished_at),
            r.channel,
            r.message_id,
            r.attempt,
            r.outcome,
            r.error,
            r.provider_message_id,
            r.message_status or "(pruned)",
        )
    console().print(table)


_PAST = {"redrive": "redriven", "cancel": "cancelled", "uncancel": "uncancelled", "prune": "pruned"}


def render_change(
    action: str, count: int, ids: Sequence[int] | None, dry_run: bool, as_json: bool
) -> None:
    """What a redrive, cancel or prune changed (or, with --dry-run, would change)."""
    if as_json:
        result: dict[str, Any] = {"action": action, "dry_run": dry_run, "count": count}
        if ids is not None:
            result["ids"] = list(ids)
        emit_json(result)
        return
    verb = f"would {action}" if dry_run else _PAST[action]
    listed = f": {', '.join(map(str, ids))}" if ids else ""
    click.echo(f"{verb} {count} message(s){listed}")


def render_worker_report(report: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(report)
        return
    statuses = ", ".join(f"{k} {v}" for k, v in sorted(report["statuses"].items())) or "none"
    click.echo(
        f"worker stopped: {report['batches']} batch(es), claimed {report['claimed']}, "
        f"released {report['released']}, reaped {report['reaped']}; settled: {statuses}"
    )


def render_tenants(tenants: Sequence[Any], as_json: bool, channels: Sequence[Any] = ()) -> None:
    """What an operator set per tenant: weight, pause, bound roles, secrets;
    and per tenant and channel (``channels``): a pause, a limit."""
    if as_json:
        emit_json(
            {
                "tenants": [t._asdict() for t in tenants],
                "channels": [tenant_channel_json(c) for c in channels],
            }
        )
        return
    if not tenants and not channels:
        click.echo("no tenant has settings, a bound role or a secret")
        return
    if channels:
        render_tenant_channels(channels)
    if not tenants:
        return
    table = _table("tenant", "weight", "paused", "roles", "secrets", title="tenants")
    for t in tenants:
        add_row(
            table,
            t.tenant,
            t.weight,
            "yes" if t.paused else "",
            ", ".join(t.roles),
            ", ".join(t.secrets),
        )
    console().print(table)


def render_tenant_status(rows: Sequence[Any], as_json: bool) -> None:
    """``outbox status --by tenant``: per tenant, due, the oldest due row's
    age, in flight, delivered and unresolved."""
    if as_json:
        emit_json({"tenants": [{**r._asdict(), "tenant": r.tenant or None} for r in rows]})
        return
    if not rows:
        click.echo("no messages")
        return
    table = _table(
        "tenant",
        "due",
        "oldest due",
        "in flight",
        "delivered",
        "failed/dead/expired",
        title="messages by tenant",
    )
    for r in rows:
        add_row(
            table,
            r.tenant or "(none)",
            r.due,
            f"{r.oldest_due_age_seconds:.0f}s",
            r.in_flight,
            r.delivered,
            r.unresolved,
        )
    console().print(table)
