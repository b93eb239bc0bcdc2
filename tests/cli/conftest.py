"""Fixtures for the CLI tests."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

from outbox_cli.cli import cli


@pytest.fixture
def run(engine: sa.Engine, database_url: str) -> Any:
    """`outbox ARGS...` against the test database (over empty tables), in
    process; ``input`` is what it reads from stdin."""
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None) -> Result:
        return runner.invoke(cli, list(args), env={"DATABASE_URL": database_url}, input=input)

    return invoke
