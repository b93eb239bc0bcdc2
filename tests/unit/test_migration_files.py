"""The migration files read in chain order: listed by name, they are the
revisions from the first to the head, each named for its position and its
revision id (``01_0001_outbox_tables.py``). A new migration is named for the
next position, so that it sorts last."""

from __future__ import annotations

import re
from pathlib import Path

from alembic.script import ScriptDirectory

import outbox
from outbox.migrations import revision_module

MIGRATIONS = Path(outbox.__file__).parent / "migrations"
FILE_NAME = re.compile(r"^(?P<position>\d{2})_(?P<revision>[0-9a-z]+)_[a-z0-9_]+\.py$")


def chain() -> list[tuple[str, str]]:
    """(file name, revision id) of every revision, from the first to the head."""
    scripts = list(ScriptDirectory(str(MIGRATIONS)).walk_revisions())  # head first
    return [(Path(s.path).name, s.revision) for s in reversed(scripts)]


def file_names() -> list[str]:
    return sorted(p.name for p in (MIGRATIONS / "versions").glob("*.py") if p.name != "__init__.py")


def test_the_files_sort_in_chain_order() -> None:
    in_chain_order = [name for name, _ in chain()]
    assert file_names() == in_chain_order, (
        "the migration files do not sort in chain order: name each "
        "<position>_<revision>_<what>.py, its place in the chain first (01, 02, ...)"
    )


def test_each_file_is_named_for_its_position_and_revision() -> None:
    for position, (name, revision) in enumerate(chain(), start=1):
        match = FILE_NAME.match(name)
        assert match, f"{name}: name it {position:02d}_{revision}_<what>.py"
        assert (int(match["position"]), match["revision"]) == (position, revision), (
            f"{name} is revision {revision}, number {position} in the chain: "
            f"name it {position:02d}_{revision}_<what>.py"
        )


def test_a_migration_reuses_another_by_its_revision_id() -> None:
    for _, revision in chain():
        assert revision_module(revision).revision == revision
