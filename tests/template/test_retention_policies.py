"""What deleting or replacing the stack does to what it keeps: every resource
that holds data or keys says so itself (``DeletionPolicy`` and
``UpdateReplacePolicy``, cfn-lint I3011), and a KMS key is retained, since
what it encrypted (the SES feedback topic's notices SNS still holds) cannot
be read once it is gone (issue 31, item 8)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from docgen.configuration import load_template

TEMPLATE = Path(__file__).resolve().parents[2] / "template.yaml"
POLICIES = ("DeletionPolicy", "UpdateReplacePolicy")
# Resources that hold data or keys; what CloudFormation does by default with
# them on a delete or a replacement is left to no one's memory.
STATEFUL_TYPES = {
    "AWS::KMS::Key",
    "AWS::Logs::LogGroup",
    "AWS::SQS::Queue",
    "AWS::S3::Bucket",
    "AWS::DynamoDB::Table",
    "AWS::RDS::DBInstance",
    "AWS::RDS::DBCluster",
    "AWS::SecretsManager::Secret",
}
# A key that encrypted something must outlive the stack (and a replacement).
RETAINED_TYPES = {"AWS::KMS::Key"}


def policy_violations(template: dict[str, Any]) -> list[str]:
    found = []
    for name, resource in template["Resources"].items():
        kind = resource["Type"]
        if kind not in STATEFUL_TYPES:
            continue
        for policy in POLICIES:
            value = resource.get(policy)
            if value is None:
                found.append(f"{name} ({kind}): no {policy}")
            elif kind in RETAINED_TYPES and value != "Retain":
                found.append(f"{name} ({kind}): {policy} is {value}, not Retain")
    return found


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(TEMPLATE)


def test_every_stateful_resource_says_what_a_delete_or_replacement_does(
    template: dict[str, Any],
) -> None:
    assert policy_violations(template) == []
    keys = [r for r in template["Resources"].values() if r["Type"] == "AWS::KMS::Key"]
    assert keys and all(r["DeletionPolicy"] == r["UpdateReplacePolicy"] == "Retain" for r in keys)


def test_the_check_catches_a_missing_or_wrong_policy(template: dict[str, Any]) -> None:
    bad = copy.deepcopy(template)
    res = bad["Resources"]
    res["SesFeedbackTopicKey"]["DeletionPolicy"] = "Delete"
    res["SesFeedbackTopicKey"].pop("UpdateReplacePolicy", None)
    del res["FailureQueue"]["DeletionPolicy"]
    assert policy_violations(bad) == [
        "FailureQueue (AWS::SQS::Queue): no DeletionPolicy",
        "SesFeedbackTopicKey (AWS::KMS::Key): DeletionPolicy is Delete, not Retain",
        "SesFeedbackTopicKey (AWS::KMS::Key): no UpdateReplacePolicy",
    ]
