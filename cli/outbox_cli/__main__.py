"""``python -m outbox_cli``: the ``outbox`` command."""

from outbox_cli.cli import main

main()
