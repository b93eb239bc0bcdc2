"""The settled rows' partitions (migration 0018, docs/design.md "Hot rows and
history"): resolved rows are kept by UTC day, retention drops whole days.

``outbox_message`` is partitioned by status: the live rows (``pending``,
``claimed``) in ``outbox_message_live``, the unresolved ones (``failed``,
``dead``, ``expired``) in ``outbox_message_unresolved``, and every other final
state in ``outbox_message_resolved``, one partition a UTC day. A row that no
day partition covers (a day the reaper did not make in time; a settle time an
operator wrote by hand) lands in the default partition; the rows of an install
upgraded to 0018 stay in the partition of everything settled before it. Those
two are pruned row by row (``CATCH_ALL_PARTITIONS``); day partitions go whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from ..states import TERMINAL_STATUSES, UNRESOLVED_STATUSES
from ._sql import array_literal, statement

__all__ = [
    "CATCH_ALL_PARTITIONS",
    "HISTORY_DAYS_AHEAD",
    "RESOLVED_STATUSES",
    "history_partitions",
    "make_history_partitions",
    "prunable_before",
    "prune_before",
]

# Final states whose rows are kept by day (the rest wait for an operator).
RESOLVED_STATUSES = tuple(s for s in TERMINAL_STATUSES if s not in UNRESOLVED_STATUSES)
# Days ahead of today whose partitions the reaper keeps made.
HISTORY_DAYS_AHEAD = 2
# The partitions that are not one day's: pruned row by row (a closed set: the
# statements below name them).
CATCH_ALL_PARTITIONS = (
    "outbox_message_resolved_default",
    "outbox_message_resolved_before_0018",
)

_MAKE = statement("SELECT outbox_make_history_partitions(:days_ahead)")
_PARTITIONS = statement(
    "SELECT name, upper_bound FROM outbox_history_partitions() ORDER BY upper_bound"
)
_DROP = statement("SELECT partition_name, rows FROM outbox_drop_history_before(:cutoff, :dry_run)")
_EXISTING = statement(
    "SELECT n FROM unnest(CAST(:names AS text[])) AS n "
    "WHERE to_regclass(quote_ident(n)) IS NOT NULL"
)
_CATCH_ALL_COUNT = {
    name: statement(f"SELECT count(*) FROM {name} WHERE settled_at < :cutoff")
    for name in CATCH_ALL_PARTITIONS
}
_CATCH_ALL_DELETE = {
    name: statement(
        f"""
        WITH doomed AS (
            SELECT id FROM {name} WHERE settled_at < :cutoff
            LIMIT :batch_size
            FOR UPDATE SKIP LOCKED
        )
        DELETE FROM {name} AS m USING doomed WHERE m.id = doomed.id
        """
    )
    for name in CATCH_ALL_PARTITIONS
}
# Rows of some statuses only, wherever they are: the unresolved table, or
# resolved rows an operator names by status (a day partition holds them all).
_ROWS_COUNT = statement(
    """
    SELECT count(*) FROM outbox_message
    WHERE status = ANY(CAST(:statuses AS text[])) AND settled_at < :cutoff
    """
)
_ROWS_DELETE = statement(
    """
    WITH doomed AS (
        SELECT id FROM outbox_message
        WHERE status = ANY(CAST(:statuses AS text[])) AND settled_at < :cutoff
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM outbox_message AS m USING doomed
    WHERE m.id = doomed.id AND m.status = ANY(CAST(:statuses AS text[]))
    """
)


def make_history_partitions(conn: sa.Connection, days_ahead: int = HISTORY_DAYS_AHEAD) -> int:
    """Make the day partitions of today and ``days_ahead`` days after it that
    are missing (moving in what the default partition caught of those days);
    returns how many were made. A partition whose table is busy is left for
    the next run."""
    return int(conn.execute(_MAKE, {"days_ahead": days_ahead}).scalar_one())


def history_partitions(conn: sa.Connection) -> list[sa.Row[Any]]:
    """Each ranged partition of the resolved rows: ``name``, ``upper_bound``."""
    return list(conn.execute(_PARTITIONS).all())


def _catch_alls(conn: sa.Connection) -> list[str]:
    names = conn.execute(_EXISTING, {"names": array_literal(CATCH_ALL_PARTITIONS)}).scalars()
    return [n for n in CATCH_ALL_PARTITIONS if n in set(names)]


def _split(statuses: Sequence[str]) -> tuple[bool, list[str]]:
    """Whether the day partitions are pruned whole (every resolved status is
    asked for), and the statuses pruned row by row."""
    whole_days = set(RESOLVED_STATUSES) <= set(statuses)
    by_row = [s for s in statuses if not (whole_days and s in RESOLVED_STATUSES)]
    return whole_days, by_row


def prunable_before(
    conn: sa.Connection, cutoff: Any, statuses: Sequence[str], *, exact: bool = False
) -> int:
    """How many rows ``prune_before`` would remove: whole day partitions that
    end by ``cutoff``, and the rows settled before it of the catch-all
    partitions and of the statuses pruned by row; ``exact``: every row of
    ``statuses`` settled before ``cutoff``."""
    whole_days, by_row = _split(statuses)
    if exact:
        whole_days, by_row = False, list(statuses)
    total = 0
    if whole_days:
        total += sum(r.rows for r in conn.execute(_DROP, {"cutoff": cutoff, "dry_run": True}))
        for name in _catch_alls(conn):
            total += int(conn.execute(_CATCH_ALL_COUNT[name], {"cutoff": cutoff}).scalar_one())
    if by_row:
        total += int(
            conn.execute(
                _ROWS_COUNT, {"statuses": array_literal(by_row), "cutoff": cutoff}
            ).scalar_one()
        )
    return total


def prune_before(
    conn: sa.Connection,
    cutoff: Any,
    batch_size: int,
    statuses: Sequence[str],
    *,
    exact: bool = False,
) -> int:
    """Remove settled rows of ``statuses`` before ``cutoff``; returns how many.

    When every resolved status is asked for, the day partitions that end by
    ``cutoff`` are dropped whole (however many rows: a drop writes no row's
    WAL) and up to ``batch_size`` rows of the catch-all partitions are
    deleted; rows of the other statuses, up to ``batch_size``, are deleted.
    ``exact`` (an operator's cutoff): the days are dropped all the same, and
    the rows before ``cutoff`` in the day it falls in are deleted too."""
    whole_days, by_row = _split(statuses)
    removed = 0
    if whole_days:
        removed += sum(r.rows for r in conn.execute(_DROP, {"cutoff": cutoff, "dry_run": False}))
        if not exact:
            for name in _catch_alls(conn):
                removed += conn.execute(
                    _CATCH_ALL_DELETE[name], {"cutoff": cutoff, "batch_size": batch_size}
                ).rowcount
    if exact:
        by_row = list(statuses)
    if by_row:
        removed += conn.execute(
            _ROWS_DELETE,
            {"statuses": array_literal(by_row), "cutoff": cutoff, "batch_size": batch_size},
        ).rowcount
    return removed
