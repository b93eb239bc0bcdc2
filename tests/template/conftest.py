"""Reporting for the built-artifact test: each handler's cold import time,
printed in the terminal summary."""

from __future__ import annotations

from pathlib import Path

import pytest

_IMPORT_TIMES = pytest.StashKey[dict[str, float]]()
_LAYER_PACKAGE = Path(__file__).resolve().parents[2] / ".aws-sam/build/OutboxLayer/python/outbox"


@pytest.fixture(scope="session")
def import_times(request: pytest.FixtureRequest) -> dict[str, float]:
    """Handler name -> seconds its module took to import, filled by the tests."""
    return request.config.stash.setdefault(_IMPORT_TIMES, {})


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    times = config.stash.get(_IMPORT_TIMES, {})
    if not times:
        return
    shipped = any(_LAYER_PACKAGE.glob("__pycache__/*.cpython-312.pyc"))
    how = "with the shipped bytecode" if shipped else "without bytecode: compiled at import"
    terminalreporter.section(f"cold import of each built handler (Python 3.12, {how})")
    for name, seconds in sorted(times.items()):
        terminalreporter.write_line(f"{name:<12} {seconds * 1000:7.0f} ms")
