"""The ``outbox`` command and the development tools around the relay.

Apart from the runtime package ``outbox`` on purpose: the Lambda layer ships
``outbox`` alone, and nothing in ``outbox`` imports this package.

* ``cli``: the commands (``outbox migrate | enqueue | status | list | show |
  redrive | cancel | prune | worker | invoke``);
* ``render``: how their results look, as tables or as JSON;
* ``local``: ``make run``, the relay end to end on this machine;
* ``invoke``: a function of template.yaml run in process (no Docker);
* ``devdb``: a Postgres for local runs and the tests.
"""


def main() -> None:
    """The ``outbox`` command; says which extra to install when its libraries are missing."""
    try:
        from outbox_cli.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if exc.name not in ("click", "rich"):
            raise
        import sys

        sys.stderr.write(
            f"Error: the outbox command needs {exc.name}: pip install 'outbox-relay[cli]'\n"
        )
        sys.exit(1)
    cli_main()
