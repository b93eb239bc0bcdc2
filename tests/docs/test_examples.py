"""The code examples of the docs run. A page marks a fenced block with
``<!-- test: NAME -->`` on the line before it, and a test runs the block as it
stands, so a snippet that no longer works fails the tests. Which test runs
which block is listed in RUN_BY; a marked block no test knows fails here."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from outbox import channels
from support import DOCS, doc_blocks

RUN_BY = {
    "producer": "tests/docs/test_examples.py",
    "producer-cooldown": "tests/integration/test_cooldown.py",
    "custom-channel": "tests/docs/test_examples.py",
    "custom-channel-stack": "tests/template/test_generated.py",
    "psql-enqueue": "tests/integration/test_sql_enqueue.py",
    "grants": "tests/integration/test_grants.py",
    "own-schema": "tests/integration/test_schema_recipe.py",
    "quickstart-commands": "tests/cli/test_cli_local.py",
    "quickstart-script": "tests/cli/test_cli_local.py",
    "quickstart-run-script": "tests/cli/test_cli_local.py",
    "quickstart-worker": "tests/cli/test_cli_local.py",
    "quickstart-check": "tests/cli/test_cli_local.py",
    "quickstart-receiver": "tests/cli/test_cli_local.py",
    "quickstart-receive": "tests/cli/test_cli_local.py",
    "quickstart-send-webhook": "tests/cli/test_cli_local.py",
}


def marked_blocks() -> dict[str, str]:
    found: dict[str, str] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for name in doc_blocks(page):
            assert name not in found, f"{name} is marked on {found[name]} and {page}"
            found[name] = str(page.relative_to(DOCS))
    return found


def test_every_marked_block_is_run_by_a_test() -> None:
    assert sorted(marked_blocks()) == sorted(RUN_BY)


def test_the_markers_are_found_as_written(tmp_path: Any) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        'text\n\n<!-- test: one -->\n```python title="x"\nprint(1)\n```\n\n'
        "```sh\nnot marked\n```\n<!-- test: two -->\n```sql\nSELECT 1;\nSELECT 2;\n```\n"
    )
    blocks = doc_blocks(page)
    assert {n: (b.language, b.code) for n, b in blocks.items()} == {
        "one": ("python", "print(1)\n"),
        "two": ("sql", "SELECT 1;\nSELECT 2;\n"),
    }


def test_the_producer_example_enqueues_in_the_callers_transaction(
    engine: sa.Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producing guide's first example, run as written; what it leaves to
    the reader (the database URL, the application's `orders` table) is the
    test's."""
    code = doc_blocks(DOCS / "how-to" / "producing.md")["producer"].code
    metadata = sa.MetaData()
    orders = sa.Table(
        f"docs_orders_{id(code)}",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("state", sa.Text),
    )
    metadata.create_all(engine)
    try:
        made: list[str] = []
        real_create_engine = sa.create_engine

        def create_engine(url: str, **kwargs: Any) -> sa.Engine:
            made.append(url)
            return real_create_engine(database_url, **kwargs)

        monkeypatch.setattr(sa, "create_engine", create_engine)
        namespace: dict[str, Any] = {"orders": orders}
        exec(compile(code, "producing.md", "exec"), namespace)  # noqa: S102
        namespace["engine"].dispose()
        assert made == ["postgresql+psycopg://app@db/app"]
        with engine.connect() as conn:
            assert conn.execute(sa.select(orders.c.state)).scalars().all() == ["shipped"]
            row = conn.execute(
                sa.text(
                    "SELECT channel, dedupe_key, ordering_key, expires_at IS NOT NULL "
                    "FROM outbox_message"
                )
            ).one()
        assert tuple(row) == ("email", "order-42-shipped", "customer-7", True)
    finally:
        metadata.drop_all(engine)


def test_the_custom_channel_example_registers_its_channel() -> None:
    code = doc_blocks(DOCS / "how-to" / "channels.md")["custom-channel"].code
    namespace: dict[str, Any] = {}
    exec(compile(code, "channels.md", "exec"), namespace)  # noqa: S102
    channel = namespace["SlackChannel"]()
    assert channel.name == "slack"
    assert "slack" in channels.names()


def test_the_readmes_and_the_home_pages_producer_example_is_the_one_the_tests_run() -> None:
    for page in (DOCS.parent / "README.md", DOCS / "index.md"):
        example = page.read_text().split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"
        assert example == doc_blocks(DOCS / "how-to" / "producing.md")["producer"].code, page
