"""template.yaml is generated (templategen/): it is what the generator writes
from the channels' declarations, and a channel declared there once gets every
part of the stack a channel has."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from test_template import (
    alarm_violations,
    capacity_violations,
    iam_violations,
    invoke_violations,
    secret_violations,
)

import templategen
from docgen.configuration import load_template
from support import DOCS, doc_blocks
from templategen import Channel, DeclarationError
from templategen.__main__ import main

# A channel of one's own, declared as docs/how-to/channels.md shows.
(SLACK,) = templategen.parse_channels(
    doc_blocks(DOCS / "how-to" / "channels.md")["custom-channel-stack"].code
)


def test_template_yaml_is_what_templategen_writes() -> None:
    assert templategen.TEMPLATE.read_text() == templategen.render(), (
        "template.yaml is not what templategen writes from templategen/: edit "
        "templategen/template.yaml.j2 or templategen/channels.yaml, then run make template"
    )
    assert main(["--check"]) == 0


def test_the_template_keeps_the_channels_in_their_declared_order() -> None:
    declared = [c.name for c in templategen.load_channels()]
    assert declared == ["email", "sms", "push", "webhook", "eventbridge", "sqs"]
    template = load_template(templategen.TEMPLATE)
    variables = template["Resources"]["DispatcherFunction"]["Properties"]["Environment"]
    raw = variables["Variables"]["CHANNEL_FUNCTIONS"]["Fn::Sub"]
    assert list(json.loads(raw)) == declared


@pytest.fixture(scope="module")
def with_slack(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The template with one more channel declared, read as its consumers read it."""
    path = tmp_path_factory.mktemp("generated") / "template.yaml"
    path.write_text(templategen.render([*templategen.load_channels(), SLACK]))
    return load_template(path)


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(templategen.TEMPLATE)


def test_one_declaration_adds_a_channel_everywhere_the_stack_names_one(
    template: dict[str, Any], with_slack: dict[str, Any]
) -> None:
    resources = with_slack["Resources"]
    function = resources["SlackFunction"]
    props = function["Properties"]
    email = template["Resources"]["EmailFunction"]
    assert function["Metadata"] == email["Metadata"]
    assert props["CodeUri"] == "functions/slack/"
    # Reserved unless its parameter is 0.
    assert props["ReservedConcurrentExecutions"] == {
        "Fn::If": ["ReservesSlack", {"Ref": "SlackConcurrency"}, {"Ref": "AWS::NoValue"}]
    }
    assert with_slack["Conditions"]["ReservesSlack"] == {
        "Fn::Not": [{"Fn::Equals": [{"Ref": "SlackConcurrency"}, 0]}]
    }
    assert props["EventInvokeConfig"] == email["Properties"]["EventInvokeConfig"]
    assert props["Environment"] == {
        "Variables": {"SLACK_TOKEN_SECRET_ARN": {"Ref": "SlackTokenSecretArn"}}
    }
    assert props["Policies"][0] == {"Ref": "DatabaseAccessPolicy"}
    assert props["Policies"][1]["Statement"][0]["Sid"] == "ReadTheSlackToken"
    assert with_slack["Parameters"]["SlackConcurrency"]["Default"] == 3
    assert "SlackTokenSecretArn" in with_slack["Parameters"]
    groups = {
        g["Label"]["default"]: g["Parameters"]
        for g in with_slack["Metadata"]["AWS::CloudFormation::Interface"]["ParameterGroups"]
    }
    assert groups["Channels"][-1] == "SlackTokenSecretArn"
    assert groups["Reserved concurrency"][-3:-1] == ["SlackConcurrency", "FeedbackConcurrency"]

    dispatcher = resources["DispatcherFunction"]["Properties"]
    variables = dispatcher["Environment"]["Variables"]
    assert json.loads(variables["CHANNEL_FUNCTIONS"]["Fn::Sub"])["slack"] == "${SlackFunction}"
    assert '"slack": ${SlackConcurrency}}' in variables["CHANNEL_CONCURRENCY"]["Fn::Sub"]
    hand_off = dispatcher["Policies"][-1]["Statement"][0]
    assert {"Fn::GetAtt": ["SlackFunction", "Arn"]} in hand_off["Resource"]

    alarm = resources["SlackErrorsAlarm"]
    assert alarm["Condition"] == "WithDetailedAlarms"
    assert alarm["Properties"]["Dimensions"] == [
        {"Name": "FunctionName", "Value": {"Ref": "SlackFunction"}}
    ]
    throttled = [
        m["MetricStat"]["Metric"]["Dimensions"][0]["Value"]["Ref"]
        for m in resources["ThrottlesAlarm"]["Properties"]["Metrics"]
        if "MetricStat" in m
    ]
    assert "SlackFunction" in throttled
    body = resources["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"]
    # Its duration, errors and throttles lines, and the body still JSON.
    assert body.count('"${SlackFunction}"') == 3
    json.loads(re.sub(r"\$\{[A-Za-z0-9:]+\}", "0", body))
    assert with_slack["Outputs"]["SlackFunctionName"] == {"Value": {"Ref": "SlackFunction"}}
    assert with_slack["Outputs"]["SlackFunctionArn"] == {
        "Value": {"Fn::GetAtt": ["SlackFunction", "Arn"]}
    }

    # Nothing else: the rest of the template is what it was.
    assert set(resources) - set(template["Resources"]) == {"SlackFunction", "SlackErrorsAlarm"}
    changed = {n for n, r in template["Resources"].items() if resources[n] != r}
    assert changed == {"DispatcherFunction", "ThrottlesAlarm", "Dashboard"}


def test_the_added_channel_passes_the_template_checks(with_slack: dict[str, Any]) -> None:
    assert iam_violations(with_slack) == []
    assert secret_violations(with_slack) == []
    assert invoke_violations(with_slack) == []
    assert alarm_violations(with_slack) == []
    assert capacity_violations(with_slack) == []


def _declaration_error(channels: list[Channel]) -> str:
    with pytest.raises(DeclarationError) as caught:
        templategen.render(channels)
    return str(caught.value)


def test_a_declaration_the_template_cannot_hold_is_refused() -> None:
    channels = templategen.load_channels()
    assert _declaration_error([*channels, dataclasses.replace(SLACK, name="Slack")]) == (
        "channel name 'Slack' is not ^[a-z][a-z0-9_-]{0,63}$"
    )
    assert _declaration_error([*channels, dataclasses.replace(SLACK, title="slack-bot")]) == (
        "slack: title 'slack-bot' is not ^[A-Z][A-Za-z0-9]*$"
    )
    assert _declaration_error([*channels, dataclasses.replace(SLACK, concurrency=0)]) == (
        "slack: concurrency is a whole number of 1 or more"
    )
    assert _declaration_error([*channels, dataclasses.replace(SLACK, name="sms")]) == (
        "channel name declared twice: sms"
    )
    assert _declaration_error([*channels, dataclasses.replace(SLACK, title="Feedback")]) == (
        "title Feedback is a function of the relay"
    )
    # One more channel fits the throttles alarm (10 metrics); two do not.
    two = [dataclasses.replace(SLACK, name=f"s{n}", title=f"S{n}") for n in (1, 2)]
    assert _declaration_error([*channels, *two]) == (
        "ThrottlesAlarm would read 11 metrics, more than CloudWatch's 10 in one alarm: "
        "split it in template.yaml.j2"
    )


def test_a_bad_channels_file_is_refused_naming_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "channels.yaml"
    path.write_text("- {name: fax, title: Fax, concurrency: 1, description: Fax., colour: red}\n")
    with pytest.raises(DeclarationError, match=r"channel 1: unknown field colour"):
        templategen.load_channels(path)
    path.write_text("- {name: fax, title: Fax, concurrency: 1}\n")
    with pytest.raises(DeclarationError, match=r"channel 1: .*'description'"):
        templategen.load_channels(path)
    path.write_text("name: fax\n")
    with pytest.raises(DeclarationError, match=r"a list of channels"):
        templategen.load_channels(path)
