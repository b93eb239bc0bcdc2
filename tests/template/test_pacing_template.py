"""The template's side of pacing (docs/how-to/pacing.md): least privilege for
what the dispatcher now calls, the wake schedule and its role, the schedules
and the optional costs; each check also run on a broken copy."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from template.test_template import _as_list, _strings, statements

from docgen.configuration import load_template

WAKE_ARN = (
    "arn:${AWS::Partition}:scheduler:${AWS::Region}:${AWS::AccountId}"
    ":schedule/default/${AWS::StackName}-dispatcher-wake"
)


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template()


def _getatts(node: Any) -> set[str]:
    out = set()
    for item in _as_list(node):
        if isinstance(item, dict) and "Fn::GetAtt" in item:
            target = item["Fn::GetAtt"]
            out.add(str(target[0] if isinstance(target, list) else target.split(".")[0]))
    return out


def pacing_violations(template: dict[str, Any]) -> list[str]:
    found = []
    res = template["Resources"]
    by_resource: dict[str, list[dict[str, Any]]] = {}
    for name, st in statements(template):
        by_resource.setdefault(name, []).append(st)

    scheduler = [
        st
        for st in by_resource.get("DispatcherFunction", [])
        if any(a.startswith("scheduler:") for a in _strings(st.get("Action")))
    ]
    actions = {a for st in scheduler for a in _strings(st.get("Action"))}
    if actions != {"scheduler:GetSchedule", "scheduler:UpdateSchedule"}:
        found.append(f"dispatcher: scheduler actions {sorted(actions)}")
    if {r for st in scheduler for r in _strings(st.get("Resource"))} != {WAKE_ARN}:
        found.append("dispatcher: scheduler actions on more than the wake schedule")

    pass_role = [
        st
        for st in by_resource.get("DispatcherFunction", [])
        if "iam:PassRole" in _strings(st.get("Action"))
    ]
    if len(pass_role) != 1:
        found.append("dispatcher: no single iam:PassRole statement")
    else:
        st = pass_role[0]
        if _getatts(st["Resource"]) != {"WakeScheduleRole"}:
            found.append("dispatcher: passes a role other than the wake schedule's")
        condition = st.get("Condition", {}).get("StringEquals", {})
        if condition.get("iam:PassedToService") != "scheduler.amazonaws.com":
            found.append("dispatcher: PassRole not limited to scheduler.amazonaws.com")

    wake_invokes = [
        st
        for st in by_resource.get("DispatcherWakePolicy", [])
        if "lambda:InvokeFunction" in _strings(st.get("Action"))
    ]
    targets = {t for st in wake_invokes for t in _getatts(st["Resource"])}
    if targets != {"DispatcherFunction", "ReaperFunction"}:
        found.append(f"dispatcher wakes {sorted(targets)}, not exactly itself and the reaper")
    policy = res.get("DispatcherWakePolicy", {}).get("Properties", {})
    if policy.get("Roles") != [{"Ref": "DispatcherFunctionRole"}]:
        found.append("DispatcherWakePolicy is not on the dispatcher's role alone")

    role = res.get("WakeScheduleRole", {}).get("Properties", {})
    trust = role.get("AssumeRolePolicyDocument", {}).get("Statement", [])
    principals = [st.get("Principal") for st in trust]
    if principals != [{"Service": "scheduler.amazonaws.com"}]:
        found.append(f"WakeScheduleRole trusts {principals}")
    role_grants = {
        (a, t)
        for st in by_resource.get("WakeScheduleInvokePolicy", [])
        for a in _strings(st.get("Action"))
        for t in _getatts(st["Resource"])
    }
    if role_grants != {
        ("lambda:InvokeFunction", "DispatcherFunction"),
        ("sqs:SendMessage", "ScheduleDeadLetterQueue"),
    }:
        found.append(f"WakeScheduleRole may {sorted(role_grants)}")

    wake = res.get("WakeSchedule", {}).get("Properties", {})
    target = wake.get("Target", {})
    if target.get("RetryPolicy", {}).get("MaximumRetryAttempts") != 0:
        found.append("WakeSchedule: retries are not off")
    if not target.get("DeadLetterConfig", {}).get("Arn"):
        found.append("WakeSchedule: no dead-letter queue")
    if wake.get("ScheduleExpressionTimezone") != "UTC":
        found.append("WakeSchedule: not in UTC (the dispatcher writes UTC times)")
    for name in ("WakeSchedule", "WakeScheduleRole", "WakeScheduleInvokePolicy"):
        if res.get(name, {}).get("Condition") != "Sleeps":
            found.append(f"{name}: made in poll mode too")
    return found


def test_pacing_grants_are_least_privilege(template: dict[str, Any]) -> None:
    assert pacing_violations(template) == []


def test_the_pacing_check_catches_a_broken_template(template: dict[str, Any]) -> None:
    bad = copy.deepcopy(template)
    res = bad["Resources"]
    dispatcher = res["DispatcherFunction"]["Properties"]["Policies"]
    sleeping = next(p for p in dispatcher if isinstance(p, dict) and "Fn::If" in p)
    statements_ = sleeping["Fn::If"][1]["Statement"]
    statements_[0]["Action"].append("scheduler:CreateSchedule")
    statements_[1].pop("Condition")
    res["DispatcherWakePolicy"]["Properties"]["PolicyDocument"]["Statement"][0]["Resource"].append(
        {"Fn::GetAtt": ["EmailFunction", "Arn"]}
    )
    res["WakeSchedule"]["Properties"]["Target"]["RetryPolicy"]["MaximumRetryAttempts"] = 185
    res["WakeScheduleRole"].pop("Condition")
    assert pacing_violations(bad) == [
        "dispatcher: scheduler actions ['scheduler:CreateSchedule', 'scheduler:GetSchedule', "
        "'scheduler:UpdateSchedule']",
        "dispatcher: PassRole not limited to scheduler.amazonaws.com",
        "dispatcher wakes ['DispatcherFunction', 'EmailFunction', 'ReaperFunction'], "
        "not exactly itself and the reaper",
        "WakeSchedule: retries are not off",
        "WakeScheduleRole: made in poll mode too",
    ]


def test_the_schedules_follow_the_pacing_mode(template: dict[str, Any]) -> None:
    params = template["Parameters"]
    assert params["PacingMode"]["Default"] == "sleep"
    assert min(params["SafetyNetMinutes"]["AllowedValues"]) >= 5
    assert params["SafetyNetMinutes"]["Default"] >= 10  # lets a paused Aurora stay paused
    assert params["ReaperScheduleMinutes"]["Default"] >= 10
    for function, minutes in (
        ("DispatcherFunction", "SafetyNetMinutes"),
        ("ReaperFunction", "ReaperScheduleMinutes"),
    ):
        event = template["Resources"][function]["Properties"]["Events"]["EveryMinute"]
        sleeps, polls = event["Properties"]["ScheduleExpression"]["Fn::If"][1:]
        assert sleeps == {"Fn::Sub": f"cron(0/${{{minutes}}} * * * ? *)"}
        assert polls == "rate(1 minute)"
    for name in ("DispatcherFunction", "ReaperFunction"):
        tracing = template["Resources"][name]["Properties"]["Tracing"]
        assert params[tracing["Ref"]]["Default"] == "PassThrough"
    assert template["Resources"]["Dashboard"]["Condition"] == "WithDashboard"
    alarm = template["Resources"]["OldestPendingAgeAlarm"]["Properties"]
    assert alarm["TreatMissingData"] == "notBreaching"
    # The window holds at least one report of the reaper's slowest schedule.
    assert alarm["Period"] * alarm["EvaluationPeriods"] >= 60 * max(
        params["ReaperScheduleMinutes"]["AllowedValues"]
    )
    assert alarm.get("DatapointsToAlarm") == 1
