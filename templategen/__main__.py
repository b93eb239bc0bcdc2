"""`make template`: write template.yaml from templategen/ (``--check``: only say
whether it is current)."""

from __future__ import annotations

import sys

from templategen import TEMPLATE, DeclarationError, render


def main(argv: list[str]) -> int:
    try:
        text = render()
    except DeclarationError as exc:
        print(f"templategen: {exc}", file=sys.stderr)
        return 2
    current = TEMPLATE.read_text() if TEMPLATE.exists() else None
    if argv == ["--check"]:
        if text != current:
            print(f"{TEMPLATE.name} is not what templategen writes: run make template")
            return 1
        return 0
    if argv:
        print("usage: python -m templategen [--check]", file=sys.stderr)
        return 2
    if text != current:
        TEMPLATE.write_text(text)
        print(f"wrote {TEMPLATE.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
