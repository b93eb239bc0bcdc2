"""``python -m outbox_cli``: the ``outbox`` command."""

from outbox_cli import main

main()
