"""The relay's Alembic migrations (outbox.migrate runs them)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType


def revision_module(revision: str) -> ModuleType:
    """The module of the migration with this revision id, for a migration that
    reuses another's code. By id, not by file name: a file's name starts with
    its place in the chain (``03_0003_relay_role.py``), which may change."""
    (path,) = Path(__file__).with_name("versions").glob(f"[0-9][0-9]_{revision}_*.py")
    return importlib.import_module(f"{__name__}.versions.{path.stem}")
