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

DISTRIBUTION = "outbox-relay"


def missing_extra(what: str, extra: str, *modules: str) -> str | None:
    """The one line that says which extra to install, when a module ``what``
    needs is missing; None when all are there. Every command that needs an
    optional library asks this before importing it, so that a missing extra is
    a one-line answer instead of a ModuleNotFoundError traceback."""
    from importlib.util import find_spec

    for module in modules:
        if find_spec(module) is None:
            return f"{what} needs {module}: pip install '{DISTRIBUTION}[{extra}]'"
    return None


def main() -> None:
    """The ``outbox`` command; says which extra to install when its libraries are missing."""
    import sys

    problem = missing_extra("the outbox command", "cli", "click", "rich")
    if problem is not None:
        sys.stderr.write(f"Error: {problem}\n")
        sys.exit(1)
    from outbox_cli.cli import main as cli_main

    cli_main()
