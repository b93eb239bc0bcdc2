"""The quick path a new account can deploy (docs/how-to/deploy.md): every
parameter says what it is for (a guided deploy and the console show it), and
samconfig.toml's try environment reserves no concurrency, which a new
account's Lambda quota could not hold, and gives every channel an in-flight
budget all the same. Each checker runs on the real files (expecting nothing)
and on a doctored copy (expecting the doctoring reported)."""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from docgen import configuration
from outbox.relay_settings import RelaySettings

ROOT = Path(__file__).resolve().parents[2]
SAMCONFIG = ROOT / "samconfig.toml"
QUICK_PATH = "try"


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return configuration.load_template(ROOT / "template.yaml")


@pytest.fixture(scope="module")
def samconfig() -> dict[str, Any]:
    return tomllib.loads(SAMCONFIG.read_text())


def description_violations(template: dict[str, Any]) -> list[str]:
    return [
        f"{name} has no Description"
        for name, param in template["Parameters"].items()
        if not str(param.get("Description") or "").strip()
    ]


def overrides(samconfig: dict[str, Any], environment: str) -> dict[str, str]:
    """An environment's parameter_overrides (a list of KEY=VALUE, or one string)."""
    raw = samconfig[environment]["deploy"]["parameters"].get("parameter_overrides", [])
    items = raw.split() if isinstance(raw, str) else raw
    return dict(item.split("=", 1) for item in items)


def reservations(template: dict[str, Any], given: dict[str, str]) -> dict[str, int]:
    """Function -> the concurrency it reserves with ``given`` over the defaults
    (the template's !If [Reserves<X>, !Ref <X>Concurrency, AWS::NoValue])."""
    params = template["Parameters"]
    found = {}
    for name, resource in template["Resources"].items():
        if resource["Type"] != "AWS::Serverless::Function":
            continue
        node = resource["Properties"].get("ReservedConcurrentExecutions")
        if isinstance(node, dict) and "Fn::If" in node:
            node = node["Fn::If"][1]  # its value when reserved; 0 means none
        parameter = node["Ref"]
        found[name] = int(given.get(parameter, params[parameter]["Default"]))
    return found


def quick_path_violations(template: dict[str, Any], samconfig: dict[str, Any]) -> list[str]:
    params = template["Parameters"]
    given = overrides(samconfig, QUICK_PATH)
    found = [f"{QUICK_PATH}: {key} is not a parameter" for key in given if key not in params]
    for key, value in given.items():
        param = params.get(key, {})
        if param.get("Type") == "Number" and not (
            param.get("MinValue", float("-inf"))
            <= float(value)
            <= param.get("MaxValue", float("inf"))
        ):
            found.append(f"{QUICK_PATH}: {key}={value} is outside the parameter's range")
    for function, reserved in sorted(reservations(template, given).items()):
        if reserved:
            found.append(f"{QUICK_PATH}: {function} reserves {reserved}")
    # What a guided deploy must ask: a parameter without a default that works.
    for name in ("DatabaseSecretArn", "MigrateDatabaseSecretArn"):
        if name in given:
            found.append(f"{QUICK_PATH}: sets {name}, which is the user's to give")
    return found


def test_every_parameter_has_a_description(template: dict[str, Any]) -> None:
    assert len(template["Parameters"]) >= 70
    assert description_violations(template) == []
    bad = copy.deepcopy(template)
    del bad["Parameters"]["DatabasePort"]["Description"]
    bad["Parameters"]["LogLevel"]["Description"] = " "
    assert description_violations(bad) == [
        "DatabasePort has no Description",
        "LogLevel has no Description",
    ]


def test_the_quick_path_reserves_no_concurrency(
    template: dict[str, Any], samconfig: dict[str, Any]
) -> None:
    # The defaults reserve 49 in all: more than a new account can spare.
    assert sum(reservations(template, {}).values()) == 49
    assert quick_path_violations(template, samconfig) == []
    bad = copy.deepcopy(samconfig)
    listed = bad[QUICK_PATH]["deploy"]["parameters"]["parameter_overrides"]
    listed.remove("EmailConcurrency=0")
    listed.remove("ReaperConcurrency=0")
    listed += ["SmsConcurrency=-1", "SmsConcurency=0"]
    assert quick_path_violations(template, bad) == [
        "try: SmsConcurency is not a parameter",
        "try: SmsConcurrency=-1 is outside the parameter's range",
        "try: EmailFunction reserves 10",
        "try: ReaperFunction reserves 1",
        "try: SmsFunction reserves -1",
    ]


def test_the_quick_path_still_budgets_every_channel(
    template: dict[str, Any], samconfig: dict[str, Any]
) -> None:
    # The dispatcher's CHANNEL_CONCURRENCY with the try environment's values:
    # each channel 0, so its budget assumes UnreservedChannelConcurrency.
    params = {name: str(p.get("Default")) for name, p in template["Parameters"].items()}
    params |= overrides(samconfig, QUICK_PATH)
    variables = template["Resources"]["DispatcherFunction"]["Properties"]["Environment"][
        "Variables"
    ]
    env = {
        "CHANNEL_CONCURRENCY": re.sub(
            r"\$\{([A-Za-z0-9]+)\}",
            lambda m: params[m[1]],
            variables["CHANNEL_CONCURRENCY"]["Fn::Sub"],
        ),
        "UNRESERVED_CHANNEL_CONCURRENCY": params[
            variables["UNRESERVED_CHANNEL_CONCURRENCY"]["Ref"]
        ],
        "DATABASE_URL": "postgresql://localhost/x",
    }
    budgets = RelaySettings.from_env(env).in_flight_budgets()
    # 2 assumed invocations, each an event of 32 running, and one more waiting, for every channel.
    assert budgets == dict.fromkeys(["email", "sms", "push", "webhook", "eventbridge", "sqs"], 96)


def test_make_deploy_try_passes_the_try_environments_parameters(
    samconfig: dict[str, Any],
) -> None:
    # `make deploy-try` hands these to sam with the user's database parameters
    # (sam would replace the environment's list with a command line's).
    from docgen import quick_path

    given = dict(item.split("=", 1) for item in quick_path.overrides())
    assert given == overrides(samconfig, QUICK_PATH) and given
