"""MkDocs hook: fills the generated parts of the pages while the site is built.

A page asks for a part with an HTML comment on a line of its own:
``<!-- generated: settings -->`` (every setting of ``outbox.settings``, with the
template parameter that feeds it) or ``<!-- generated: parameters -->`` (the
template's other parameters). Inline, ``{{ head_revision }}`` and
``{{ revision_chain }}`` (TOKENS) name the migrations.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # MkDocs loads a hook by its path, not as a package
    sys.path.insert(0, str(ROOT))

from docgen import configuration  # noqa: E402

MARKERS = {
    "<!-- generated: settings -->": lambda t: configuration.settings_table(t),
    "<!-- generated: parameters -->": lambda t: configuration.parameters_table(t),
}


def revision_chain() -> list[str]:
    """The relay's migration revisions, base first (the order they apply in)."""
    from alembic.script import ScriptDirectory

    from outbox import migrate

    script = ScriptDirectory.from_config(migrate._config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


# Inline values a page names with a token, never typed (they change with
# every migration): the head revision, and the chain in the order it applies.
TOKENS = {
    "{{ head_revision }}": lambda: revision_chain()[-1],
    "{{ revision_chain }}": lambda: ", ".join(revision_chain()),
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for token, make in TOKENS.items():
        if token in markdown:
            markdown = markdown.replace(token, make())
    if not any(marker in markdown for marker in MARKERS):
        return markdown
    template = configuration.load_template()
    for marker, make in MARKERS.items():
        markdown = markdown.replace(marker, make(template))
    return markdown
