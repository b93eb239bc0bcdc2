"""No template parameter can widen an IAM grant with a wildcard.

Every parameter that reaches the ``Resource`` of a policy statement (by
``Ref`` or inside a ``Sub``) must carry an ``AllowedPattern`` that accepts a
real value and refuses ``*`` and ``?`` (IAM's two wildcards) wherever they are
put in it: ``SesIdentity=*`` would let the email function send as any
identity, ``SqsQueueArns=*`` reach every queue. CloudFormation matches a
``CommaDelimitedList``'s pattern against each item, as this test does."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest
from test_template import TEMPLATE

from docgen.configuration import load_template

SECRET = "arn:aws:secretsmanager:us-east-1:123456789012:secret:outbox/db-AbCdEf"
# A value each parameter must accept (and, with a wildcard put in, refuse).
EXAMPLES: dict[str, list[str]] = {
    "DatabaseIamUser": ["outbox_app"],
    "MigrateDatabaseIamUser": ["outbox_migrator"],
    "DatabaseResourceId": ["prx-0123abcd", "cluster-ABCDEF0123"],
    "DatabaseSecretArn": [SECRET],
    "MigrateDatabaseSecretArn": [SECRET],
    "WebhookDefaultSecretArn": [SECRET],
    "WebhookSecretArns": [SECRET],
    "DatabaseSecretKmsKeyArn": ["arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd"],
    "EventBusName": ["orders"],
    "OutcomeEventBusName": ["outcomes"],
    "ExtraEventBusArns": [
        "arn:aws:events:us-east-1:123456789012:event-bus/orders",
        "arn:aws-us-gov:events:us-gov-west-1:123456789012:event-bus/aws.partner/x.com/1/app",
    ],
    "SesConfigurationSet": ["transactional"],
    "SesIdentity": ["example.com", "mail.example.co.uk", "no-reply+orders@example.com"],
    "SqsQueueArns": [
        "arn:aws:sqs:us-east-1:123456789012:orders",
        "arn:aws:sqs:eu-west-1:123456789012:orders_2.fifo",
    ],
}
WILDCARDS = ("*", "?")


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(TEMPLATE)


def _references(node: Any, parameters: dict[str, Any], in_resource: bool = False) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            inside = in_resource or key in ("Resource", "NotResource")
            if inside and key == "Ref" and value in parameters:
                yield value
            elif inside and key == "Fn::Sub":
                text = value if isinstance(value, str) else value[0]
                yield from (n for n in re.findall(r"\$\{(\w+)\}", text) if n in parameters)
                yield from _references(value, parameters, inside)
            else:
                yield from _references(value, parameters, inside)
    elif isinstance(node, list):
        for item in node:
            yield from _references(item, parameters, in_resource)


def granted_parameters(template: dict[str, Any]) -> set[str]:
    """The parameters that reach the Resource of some policy statement."""
    return set(_references(template["Resources"], template["Parameters"]))


def wildcard_violations(template: dict[str, Any]) -> list[str]:
    found = []
    for name in sorted(granted_parameters(template)):
        param = template["Parameters"][name]
        if "AllowedValues" in param:
            wild = [v for v in map(str, param["AllowedValues"]) if set(v) & set(WILDCARDS)]
            if wild:
                found.append(f"parameter {name}: AllowedValues holds a wildcard {wild}")
            continue
        if "AllowedPattern" not in param:
            found.append(f"parameter {name}: reaches an IAM Resource with no AllowedPattern")
            continue
        pattern = re.compile(param["AllowedPattern"])
        default = str(param.get("Default", ""))
        for item in default.split(",") if param["Type"] == "CommaDelimitedList" else [default]:
            if not pattern.fullmatch(item):
                found.append(f"parameter {name}: its default item {item!r} is refused")
        examples = EXAMPLES.get(name)
        if not examples:
            found.append(f"parameter {name}: no example value to check its pattern with")
            continue
        wild: set[str] = {w for w in WILDCARDS if pattern.fullmatch(w)}
        for example in examples:
            if not pattern.fullmatch(example):
                found.append(f"parameter {name}: refuses the real value {example!r}")
            wild |= {
                candidate
                for w in WILDCARDS
                for i in range(len(example) + 1)
                for candidate in (example[:i] + w + example[i:], example[:i] + w)
                if pattern.fullmatch(candidate)
            }
        if wild:
            shortest = min(wild, key=lambda v: (len(v), v))
            found.append(f"parameter {name}: accepts a wildcard, e.g. {shortest!r}")
    return found


def test_no_parameter_reaching_an_iam_resource_accepts_a_wildcard(
    template: dict[str, Any],
) -> None:
    granted = granted_parameters(template)
    assert {"SesIdentity", "SqsQueueArns", "ExtraEventBusArns", "WebhookSecretArns"} <= granted
    assert wildcard_violations(template) == []


def test_the_wildcard_check_catches_an_open_parameter(template: dict[str, Any]) -> None:
    bad = copy.deepcopy(template)
    params = bad["Parameters"]
    del params["SqsQueueArns"]["AllowedPattern"]  # as it was: any value
    params["SesIdentity"]["AllowedPattern"] = "^[A-Za-z0-9.@*+-]*$"
    params["ExtraEventBusArns"]["AllowedPattern"] = "^(arn:aws[a-z-]*:events:.*)?$"
    params["EventBusName"]["AllowedPattern"] = "^[A-Z]+$"  # refuses what it must take
    params["SesConfigurationSet"]["AllowedValues"] = ["a", "*"]
    assert wildcard_violations(bad) == [
        "parameter EventBusName: its default item 'default' is refused",
        "parameter EventBusName: refuses the real value 'orders'",
        "parameter ExtraEventBusArns: accepts a wildcard, e.g. 'arn:aws:events:*'",
        "parameter SesConfigurationSet: AllowedValues holds a wildcard ['*']",
        "parameter SesIdentity: accepts a wildcard, e.g. '*'",
        "parameter SqsQueueArns: reaches an IAM Resource with no AllowedPattern",
    ]
