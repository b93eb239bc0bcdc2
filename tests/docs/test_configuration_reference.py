"""The configuration reference is generated (docgen.configuration): it lists
every declared setting with its default and the template parameter that feeds
it, and every other parameter of the template. The checker below reads the
generated Markdown the way a reader does; it runs on the real output
(expecting nothing) and on doctored copies (expecting each doctoring reported),
so it cannot pass vacuously. The parameter column is checked against
template.yaml in tests/template/test_template.py."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

import pytest

from docgen import configuration
from outbox import settings as table
from outbox.settings import SETTINGS, Setting
from support import DOCS, configuration_rows, documented_default


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return configuration.load_template()


def reference_violations(text: str, settings: Iterable[Setting[Any]]) -> list[str]:
    """Each variable of the table is a declared setting with its default, and
    each declared setting has a row."""
    declared = {s.name: s for s in settings}
    found, documented = [], set()
    for row in configuration_rows(text):
        for name in row.variables:
            documented.add(name)
            setting = declared.get(name)
            if setting is None:
                found.append(f"{name} is not a declared setting")
                continue
            stated, expected = documented_default(row.default), setting.document(setting.default)
            if stated != expected:
                found.append(f"{name}'s default is {stated!r}, the setting's {expected!r}")
    found += [f"{name} has no row" for name in declared if name not in documented]
    return found


def test_the_reference_lists_every_setting_with_its_default(template: dict[str, Any]) -> None:
    assert reference_violations(configuration.settings_table(template), SETTINGS) == []


def test_a_new_or_changed_setting_appears_without_editing_a_page(
    template: dict[str, Any],
) -> None:
    extra = table.Int(name="NEW_SETTING", default=1, low=0, high=2, meaning="just declared")
    changed = [
        dataclasses.replace(s, default=50) if s.name == "BATCH_SIZE" else s for s in SETTINGS
    ]
    text = configuration.settings_table(template, [*changed, extra])
    assert reference_violations(text, [*changed, extra]) == []
    rows = {r.variables: r for r in configuration_rows(text)}
    assert rows[("NEW_SETTING",)].parameter == "not set"
    assert documented_default(rows[("BATCH_SIZE",)].default) == "50"
    assert rows[("BATCH_SIZE",)].parameter == "`BatchSize`"


def test_the_checker_catches_a_table_out_of_step(template: dict[str, Any]) -> None:
    text = configuration.settings_table(template)
    rows = {r.variables: r.line for r in configuration_rows(text)}
    broken = (
        text.replace(rows[("BATCH_SIZE",)], rows[("BATCH_SIZE",)].replace("| `100` |", "| `10` |"))
        .replace(rows[("DEDUPE_WINDOW_DAYS",)] + "\n", "")
        .replace(
            rows[("POLL_INTERVAL_SECONDS",)],
            rows[("POLL_INTERVAL_SECONDS",)] + "\n| `POLL_INTERVAL` | — | `1` | a stale name |",
        )
    )
    extra = table.Int(name="NEW_SETTING", default=1, low=0, high=2, meaning="undocumented")
    assert reference_violations(broken, [*SETTINGS, extra]) == [
        "BATCH_SIZE's default is '10', the setting's '100'",
        "POLL_INTERVAL is not a declared setting",
        "DEDUPE_WINDOW_DAYS has no row",
        "NEW_SETTING has no row",
    ]
    with pytest.raises(ValueError, match="four cells"):
        configuration_rows(text.replace(rows[("BATCH_SIZE",)], rows[("BATCH_SIZE",)] + " x |"))


def test_the_template_column_says_how_the_template_sets_each_variable(
    template: dict[str, Any],
) -> None:
    rows = {
        r.variables: r.parameter for r in configuration_rows(configuration.settings_table(template))
    }
    assert rows[("DB_SECRET_ARN",)] == (
        "`DatabaseSecretArn`, `MigrateDatabaseSecretArn` (`DatabaseAuth=secret`)"
    )
    assert rows[("DB_SSLMODE",)] == "fixed `verify-full`"
    assert rows[("DATABASE_URL",)] == "never set: the default applies"
    assert rows[("POWERTOOLS_SERVICE_NAME",)] == "the stack's name"
    assert rows[("CHANNEL_CONCURRENCY",)].startswith("built from `EmailConcurrency`, ")
    assert rows[("CHANNEL_FUNCTIONS",)] == "the stack's own resources"
    assert rows[("SES_CONFIGURATION_SET",)] == "`SesConfigurationSet`; the stack's own resources"


def test_default_cells_state_a_value_or_nothing() -> None:
    assert [
        documented_default(c)
        for c in ("100", "0.2", "`never`", "`{}`", "", "empty (required)", "(none)")
    ] == ["100", "0.2", "never", "{}", "", "", ""]


def test_the_page_asks_for_both_generated_tables() -> None:
    page = (DOCS / "reference" / "configuration.md").read_text()
    assert "<!-- generated: settings -->" in page
    assert "<!-- generated: parameters -->" in page


def test_every_other_parameter_says_what_it_sets(template: dict[str, Any]) -> None:
    rows = {
        line.split("`")[1]: line.rsplit("|", 2)[1].strip()
        for line in configuration.parameters_table(template).splitlines()[2:]
    }
    assert [name for name, meaning in rows.items() if not meaning] == []
    assert rows["EmailConcurrency"].startswith("Reserved concurrency of the email channel")
    assert rows["LogRetentionDays"] == "Days the relay's log group keeps its logs."
    # Every parameter has a Description (tests/template/test_quick_path.py);
    # without one, the table says where the parameter is used.
    bare = copy.deepcopy(template)
    del bare["Parameters"]["LogRetentionDays"]["Description"]
    assert "| `LogRetentionDays` | `30` | used by `RelayLogGroup` |" in (
        configuration.parameters_table(bare)
    )
    assert "BatchSize" not in rows  # a variable's value: in the settings table
