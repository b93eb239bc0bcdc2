"""The docs name the migration revisions with tokens the build fills in
(docgen/hooks.py), so a new migration never leaves a page behind."""

from __future__ import annotations

import re

from docgen import hooks
from outbox import migrate
from support import DOCS

# What a page would type where the head revision belongs.
TYPED = re.compile(r'already at revision \d|"revision": "\d|the chain runs \d')


def test_no_page_types_the_head_revision() -> None:
    typed = [
        f"{page.relative_to(DOCS)}: {m.group(0)}"
        for page in sorted(DOCS.rglob("*.md"))
        for m in TYPED.finditer(page.read_text())
    ]
    assert typed == []


def test_the_tokens_become_the_head_and_the_chain_in_the_order_it_applies() -> None:
    page = hooks.on_page_markdown("at {{ head_revision }}; {{ revision_chain }}.")
    chain = hooks.revision_chain()
    assert page == f"at {migrate.head()}; {', '.join(chain)}."
    assert chain[0] == "0001" and chain[-1] == migrate.head() and len(set(chain)) == len(chain)
