"""``python3 -m docgen.quick_path``: the quick path's parameters (samconfig.toml's
``try`` environment) as one ``--parameter-overrides`` string.

``make deploy-try`` adds the user's database parameters to it: given on the
command line, ``sam deploy`` would replace the environment's list, not add to it.
Standard library only, so it runs before any venv exists.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

SAMCONFIG = Path(__file__).resolve().parents[1] / "samconfig.toml"
QUICK_PATH = "try"


def overrides(samconfig: Path = SAMCONFIG, environment: str = QUICK_PATH) -> list[str]:
    parameters = tomllib.loads(samconfig.read_text())[environment]["deploy"]["parameters"]
    raw = parameters.get("parameter_overrides", [])
    return raw.split() if isinstance(raw, str) else list(raw)


if __name__ == "__main__":
    print(" ".join(overrides()))
