"""Static checks of template.yaml: least privilege, secrets by ARN, TLS, retries
off with a failure destination and reserved concurrency everywhere, schedules
with a DLQ, and the template, functions/ and events/ in step with each other.

Each checker returns the violations it finds; the tests run it on the real
template (expecting none) and on a deliberately broken copy (expecting the
breakage to be reported), so no check can pass vacuously.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from docgen import configuration
from outbox.errors import ConfigError
from outbox.settings import SETTINGS, DaysOrNever, Number, Setting
from support import ConfigurationRow, configuration_rows

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
NON_CHANNEL_FUNCTIONS = {"dispatcher", "reaper", "migrate", "feedback"}
# Functions whose every event is a wake-up (docs/how-to/pacing.md).
WAKE_UP_FUNCTIONS = {"DispatcherFunction"}
# The one function triggered by SNS: SES events from the configuration set's topic.
FEEDBACK_TRIGGER = ("FeedbackFunction", "SNS", "SesFeedbackTopic")
SCHEDULER_INPUT = {
    "execution_id": "<aws.scheduler.execution-id>",
    "scheduled_time": "<aws.scheduler.scheduled-time>",
    "schedule_arn": "<aws.scheduler.schedule-arn>",
    "attempt_number": "<aws.scheduler.attempt-number>",
}
# The one documented wildcard: SNS direct-to-phone publishing has no resource ARN.
SMS_EXCEPTION = ("SmsFunction", "PublishSmsToPhoneNumbers")
# In the stack's own partition: a literal arn:aws: would leave Publish on "*"
# unrestricted in aws-cn and aws-us-gov.
SMS_DENY_RESOURCE = "arn:${AWS::Partition}:sns:*:*:*"
# Phone-number actions, which have no resource ARN to grant them on.
SMS_ACTIONS = {"sns:Publish", "sns:CheckIfPhoneNumberIsOptedOut"}
# The documented grants on "*": actions IAM knows no resource for.
RESOURCELESS_GRANTS = {
    SMS_EXCEPTION: SMS_ACTIONS,
    # The account's sending rate (docs/how-to/rate-limits.md): read-only.
    ("EmailFunction", "ReadSesSendRate"): {"ses:GetAccount"},
}


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    # The reader the generated configuration page uses: one reading of the template.
    return configuration.load_template(TEMPLATE)


def functions(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: resource.get("Properties", {})
        for name, resource in template["Resources"].items()
        if resource["Type"] == "AWS::Serverless::Function"
    }


def folder_of(props: dict[str, Any]) -> str:
    match = re.fullmatch(r"functions/([a-z0-9_]+)/?", props.get("CodeUri", ""))
    assert match, f"CodeUri {props.get('CodeUri')!r} is not functions/<name>/"
    return match.group(1)


def default(template: dict[str, Any], value: Any) -> Any:
    """The default of a parameter a value refers to (or the literal)."""
    if isinstance(value, dict) and set(value) == {"Ref"}:
        # a pseudo parameter (AWS::StackName, ...) has no default: None
        return template["Parameters"].get(value["Ref"], {}).get("Default")
    return value


def _branches(node: Any) -> Iterator[Any]:
    """A value, or every branch of the Fn::If it is (AWS::NoValue dropped)."""
    if isinstance(node, dict) and set(node) == {"Fn::If"}:
        for branch in node["Fn::If"][1:]:
            yield from _branches(branch)
    elif node != {"Ref": "AWS::NoValue"}:
        yield node


def _as_list(node: Any) -> list[Any]:
    items = node if isinstance(node, list) else [node]
    return [b for item in items for b in _branches(item)]


def statements(template: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(resource name, statement) for every IAM statement the template writes itself."""
    for name, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        documents = []
        if resource["Type"] == "AWS::Serverless::Function":
            for policy in _as_list(props.get("Policies", [])):
                if isinstance(policy, dict) and "Statement" in policy:
                    documents.append(policy)
        elif resource["Type"] in ("AWS::IAM::ManagedPolicy", "AWS::IAM::Policy"):
            documents.append(props["PolicyDocument"])
        elif resource["Type"] == "AWS::IAM::Role":
            documents.extend(p["PolicyDocument"] for p in props.get("Policies", []))
        for document in documents:
            for statement in _as_list(document["Statement"]):
                yield name, statement


def _strings(node: Any) -> list[str]:
    """The literal text of a resource or action value (Fn::Sub templates included)."""
    out = []
    for item in _as_list(node):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and "Fn::Sub" in item:
            sub = item["Fn::Sub"]
            out.append(sub if isinstance(sub, str) else sub[0])
    return out


# --- checkers -----------------------------------------------------------------


def iam_violations(template: dict[str, Any]) -> list[str]:
    found = []
    for name, st in statements(template):
        where = f"{name}/{st.get('Sid', '?')}"
        if "NotAction" in st or "NotResource" in st:
            found.append(f"{where}: NotAction/NotResource")
        for action in _strings(st.get("Action", [])):
            if "*" in action:
                found.append(f"{where}: action wildcard {action!r}")
        for resource in _strings(st.get("Resource", [])):
            if resource.startswith("arn:aws:"):
                found.append(f"{where}: hard-coded partition in {resource!r}")
            if st.get("Effect") == "Deny":
                continue
            if resource == "*":
                actions = _strings(st.get("Action", []))
                allowed = RESOURCELESS_GRANTS.get((name, st.get("Sid")), set())
                if not actions or not set(actions) <= allowed:
                    found.append(f"{where}: Resource '*'")
                continue
            fields = resource.split(":")
            # arn:partition:service:region:account:... never wildcarded in an Allow
            if any("*" in f for f in fields[:5]):
                found.append(f"{where}: wildcard in the ARN's service/region/account {resource!r}")
    sms_denies = [
        st
        for name, st in statements(template)
        if name == SMS_EXCEPTION[0]
        and st.get("Effect") == "Deny"
        and _strings(st.get("Action")) == ["sns:Publish"]
        and SMS_DENY_RESOURCE in _strings(st.get("Resource"))
    ]
    if not sms_denies:
        found.append("SmsFunction: no Deny of sns:Publish on topics and endpoints")
    for name, props in functions(template).items():
        for policy in _as_list(props.get("Policies", [])):
            if isinstance(policy, str):
                found.append(f"{name}: named managed policy {policy!r}")
            elif isinstance(policy, dict) and "Statement" not in policy and "Ref" not in policy:
                found.append(f"{name}: policy template {sorted(policy)}")
    return found


# Actions a channel's code reaches through a library rather than a boto3 call
# of its own (Powertools Parameters reads the webhook signing secrets).
INDIRECT_ACTIONS = {"secretsmanager:GetSecretValue"}


def unused_grant_violations(template: dict[str, Any], root: Path = ROOT) -> list[str]:
    """Every action a channel function is granted is one its channel calls."""
    found = []
    for name, props in functions(template).items():
        folder = folder_of(props)
        source = root / "layers/outbox/outbox/channels" / f"{folder}.py"
        if folder in NON_CHANNEL_FUNCTIONS or not source.is_file():
            continue
        code = source.read_text()
        for fn_name, st in statements(template):
            if fn_name != name or st.get("Effect") != "Allow":
                continue
            for action in _strings(st.get("Action", [])):
                operation = re.sub(r"(?<!^)(?=[A-Z])", "_", action.split(":")[1]).lower()
                if action not in INDIRECT_ACTIONS and f"{operation}(" not in code:
                    found.append(f"{name}: granted {action}, which {source.name} never calls")
    return found


SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIAL|PRIVATE|API_?KEY", re.I)
ARN_PATTERN_PREFIX = "^(arn:"


def environment(template: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    globals_env = template["Globals"]["Function"]["Environment"]["Variables"]
    for key, value in globals_env.items():
        yield "Globals", key, value
    for name, props in functions(template).items():
        for key, value in props.get("Environment", {}).get("Variables", {}).items():
            yield name, key, value


def secret_violations(template: dict[str, Any]) -> list[str]:
    found = []
    for where, key, value in environment(template):
        if key == "DATABASE_URL":
            found.append(f"{where}: DATABASE_URL (a URL can carry a password) in AWS")
        if SECRET_NAME.search(key) and key.endswith("_ARNS"):
            # A list of ARNs: joined from a list parameter of ARNs.
            joined = value.get("Fn::Join") if isinstance(value, dict) else None
            ref = joined[1].get("Ref") if joined and isinstance(joined[1], dict) else None
            if template["Parameters"].get(ref or "", {}).get("Type") != "CommaDelimitedList":
                found.append(f"{where}: {key} is not joined from a list parameter of ARNs")
        elif SECRET_NAME.search(key):
            if not key.endswith("_ARN"):
                found.append(f"{where}: {key} looks like a secret value, pass its ARN")
            for branch in _branches(value):
                ref = branch.get("Ref") if isinstance(branch, dict) else None
                param = template["Parameters"].get(ref or "", {})
                if not str(param.get("AllowedPattern", "")).startswith(ARN_PATTERN_PREFIX):
                    found.append(f"{where}: {key} is not a parameter constrained to an ARN")
        if "INSECURE" in key:
            found.append(f"{where}: {key} is for local development only")
        for branch in _branches(value):
            if isinstance(branch, str) and re.search(r"://[^/\s]*:[^@/\s]+@", branch):
                found.append(f"{where}: {key} carries credentials in a URL")
    for name in template["Parameters"]:
        if SECRET_NAME.search(name) and not name.endswith(("Arn", "Arns")):
            found.append(f"parameter {name}: secrets are passed by ARN")
    sslmode = template["Globals"]["Function"]["Environment"]["Variables"].get("DB_SSLMODE")
    if sslmode != "verify-full":
        found.append(f"DB_SSLMODE is {sslmode!r}, not verify-full")
    for name, props in functions(template).items():
        if "DB_SSLMODE" in props.get("Environment", {}).get("Variables", {}):
            found.append(f"{name}: overrides DB_SSLMODE")
    return found


def reserved_parameter(template: dict[str, Any], props: dict[str, Any]) -> str | None:
    """The parameter a function's ReservedConcurrentExecutions comes from: a
    !Ref of it, or !If [a condition that it is not 0, !Ref it, AWS::NoValue]
    (0 reserves none). None for anything else."""
    node = props.get("ReservedConcurrentExecutions")
    if isinstance(node, dict) and node.get("Ref") in template["Parameters"]:
        return str(node["Ref"])
    if not (isinstance(node, dict) and set(node) == {"Fn::If"}):
        return None
    condition, reserved, otherwise = node["Fn::If"]
    name = reserved.get("Ref") if isinstance(reserved, dict) else None
    not_zero = {"Fn::Not": [{"Fn::Equals": [{"Ref": name}, 0]}]}
    if (
        name in template["Parameters"]
        and template.get("Conditions", {}).get(condition) == not_zero
        and otherwise == {"Ref": "AWS::NoValue"}
    ):
        return str(name)
    return None


def invoke_violations(template: dict[str, Any]) -> list[str]:
    found = []
    params = template["Parameters"]
    lease = params["LeaseSeconds"]["Default"]
    sender_timeout = params["SenderTimeoutSeconds"]["Default"]
    for name, props in functions(template).items():
        config = props.get("EventInvokeConfig")
        if not config:
            found.append(f"{name}: no EventInvokeConfig")
            continue
        if config.get("MaximumRetryAttempts") != 0:
            found.append(f"{name}: async retries are not off")
        destination = config.get("DestinationConfig", {}).get("OnFailure", {})
        if name in WAKE_UP_FUNCTIONS:
            # Its events are wake-ups that carry no data: one throttled out in a
            # storm of nudges is dropped quietly, not sent to the FailureQueue.
            if destination:
                found.append(f"{name}: a failure destination for wake-ups")
        elif destination.get("Type") != "SQS" or not destination.get("Destination"):
            found.append(f"{name}: no OnFailure SQS destination")
        age = default(template, config.get("MaximumEventAgeInSeconds"))
        if not isinstance(age, int) or age + sender_timeout >= lease:
            found.append(f"{name}: MaximumEventAgeInSeconds {age} + timeout not below the lease")
        if reserved_parameter(template, props) is None:
            found.append(f"{name}: ReservedConcurrentExecutions is not a parameter")
        if "DeadLetterQueue" in props:
            found.append(f"{name}: a Lambda DLQ alongside the OnFailure destination")
    return found


def schedule_violations(template: dict[str, Any]) -> list[str]:
    found = []
    for name, props in functions(template).items():
        for event_name, event in props.get("Events", {}).items():
            where = f"{name}/{event_name}"
            topic = event.get("Properties", {}).get("Topic", {})
            if (name, event["Type"], topic.get("Ref")) == FEEDBACK_TRIGGER:
                continue
            if event["Type"] != "ScheduleV2":
                found.append(f"{where}: {event['Type']} (schedules use EventBridge Scheduler)")
                continue
            p = event["Properties"]
            if p.get("RetryPolicy", {}).get("MaximumRetryAttempts") != 0:
                found.append(f"{where}: scheduler retries are not off")
            if not p.get("DeadLetterConfig", {}).get("Arn"):
                found.append(f"{where}: no dead-letter queue")
            if not any("${AWS::StackName}" in n for n in _strings(p.get("Name", []))):
                found.append(f"{where}: schedule name not unique per stack")
            try:
                payload = json.loads(p.get("Input", ""))
            except ValueError:
                payload = None
            if payload != SCHEDULER_INPUT:
                found.append(f"{where}: Input is not the scheduler context the code reads")
    scheduled = {
        folder_of(props)
        for props in functions(template).values()
        if any(e["Type"] == "ScheduleV2" for e in props.get("Events", {}).values())
    }
    if scheduled != {"dispatcher", "reaper"}:
        found.append(f"scheduled functions are {sorted(scheduled)}")
    return found


def _getatt_resource(node: dict[str, Any]) -> str:
    target = node["Fn::GetAtt"]
    return str(target[0] if isinstance(target, list) else target.split(".")[0])


def _channel_map(template: dict[str, Any]) -> dict[str, str]:
    dispatcher = next(p for p in functions(template).values() if folder_of(p) == "dispatcher")
    raw = dispatcher["Environment"]["Variables"]["CHANNEL_FUNCTIONS"]["Fn::Sub"]
    mapping = json.loads(re.sub(r"\$\{([A-Za-z0-9]+)\}", r"\1", raw))
    assert isinstance(mapping, dict)
    return mapping


def layout_violations(template: dict[str, Any], root: Path = ROOT) -> list[str]:
    found = []
    by_folder = {folder_of(props): name for name, props in functions(template).items()}
    folders = {p.parent.name for p in (root / "functions").glob("*/app.py")}
    for folder in sorted(folders - set(by_folder)):
        found.append(f"functions/{folder} has no template entry")
    for folder in sorted(set(by_folder) - folders):
        found.append(f"{by_folder[folder]} has no functions/{folder}/app.py")
    for folder in sorted(folders | set(by_folder)):
        samples = [root / "events" / f"{folder}.json", *(root / "events").glob(f"{folder}-*.json")]
        if not any(p.is_file() for p in samples):
            found.append(f"events/{folder}.json is missing")
    for name, props in functions(template).items():
        if props.get("Handler", template["Globals"]["Function"].get("Handler")) != "app.handler":
            found.append(f"{name}: handler is not app.handler")
    channels = {f: n for f, n in by_folder.items() if f not in NON_CHANNEL_FUNCTIONS}
    mapping = _channel_map(template)
    if mapping != channels:
        found.append(f"CHANNEL_FUNCTIONS {mapping} does not map every channel to its function")
    dispatcher = by_folder.get("dispatcher")
    if dispatcher:
        invoke = [
            st
            for name, st in statements(template)
            if name == dispatcher and "lambda:InvokeFunction" in _strings(st.get("Action"))
        ]
        targets = {_getatt_resource(r) for st in invoke for r in _as_list(st["Resource"])}
        if targets != set(channels.values()):
            found.append(f"the dispatcher may invoke {sorted(targets)}, not exactly the channels")
    return found


def alarm_violations(template: dict[str, Any]) -> list[str]:
    found = []
    # Alarms that exist whatever the parameters: an optional one watches nothing by default.
    alarms = [
        r["Properties"]
        for r in template["Resources"].values()
        if r["Type"] == "AWS::CloudWatch::Alarm" and "Condition" not in r
    ]

    def watched(metric: str) -> set[str]:
        names = set()
        for alarm in alarms:
            if alarm.get("MetricName") != metric:
                continue
            for dim in alarm.get("Dimensions", []):
                value = dim["Value"]
                if isinstance(value, dict) and "Ref" in value:
                    names.add(value["Ref"])
                elif isinstance(value, dict) and "Fn::GetAtt" in value:
                    names.add(_getatt_resource(value))
        return names

    for name, props in functions(template).items():
        # A function with a failure destination is watched by FailureQueueAlarm
        # (its per-function Errors alarm is optional: DetailedAlarms); one without
        # needs an Errors alarm of its own.
        config = props.get("EventInvokeConfig", {})
        if not config.get("DestinationConfig", {}).get("OnFailure") and name not in watched(
            "Errors"
        ):
            found.append(f"{name}: no Errors alarm and no failure destination")
    queues = {n for n, r in template["Resources"].items() if r["Type"] == "AWS::SQS::Queue"}
    for queue in sorted(queues - watched("ApproximateNumberOfMessagesVisible")):
        found.append(f"{queue}: no queue depth alarm")
    for metric in ("OldestPendingAgeSeconds", "DeadMessages"):
        emf = [a for a in alarms if a.get("MetricName") == metric]
        if not any(
            a.get("Namespace") == "OutboxRelay"
            and {"Name": "service", "Value": {"Ref": "AWS::StackName"}} in a.get("Dimensions", [])
            for a in emf
        ):
            found.append(f"no {metric} alarm on OutboxRelay/service=<stack name>")
    return found


# --- the real template passes --------------------------------------------------


def test_no_iam_wildcards_beyond_the_sms_exception(template: dict[str, Any]) -> None:
    assert iam_violations(template) == []


def test_channel_functions_are_granted_only_what_their_channel_calls(
    template: dict[str, Any],
) -> None:
    assert unused_grant_violations(template) == []


def _resources(node: Any) -> list[Any]:
    """Every resource value of a statement, through Fn::If branches and Fn::Split."""
    out = []
    for item in _as_list(node):
        if isinstance(item, dict) and "Fn::Split" in item:
            joined = item["Fn::Split"][1]["Fn::Join"][1]
            out.extend(r for part in joined for r in _resources(part))
        elif isinstance(item, dict) and "Fn::Join" in item:
            parts = item["Fn::Join"][1]
            out.extend(r for part in _as_list(parts) for r in _resources(part))
        else:
            out.append(item)
    return out


def test_webhook_reads_only_the_signing_secrets_the_operator_lists(
    template: dict[str, Any],
) -> None:
    (secret_read,) = [
        st
        for name, st in statements(template)
        if name == "WebhookFunction" and "secretsmanager:GetSecretValue" in _strings(st["Action"])
    ]
    assert set(map(str, _resources(secret_read["Resource"]))) == set(
        map(str, [{"Ref": "WebhookSecretArns"}, {"Ref": "WebhookDefaultSecretArn"}])
    )
    assert not any("*" in r for r in _strings(secret_read["Resource"]))
    env = functions(template)["WebhookFunction"]["Environment"]["Variables"]
    assert env["WEBHOOK_SECRET_ARNS"] == {"Fn::Join": [",", {"Ref": "WebhookSecretArns"}]}


def test_the_migrator_and_the_relay_use_different_database_users(
    template: dict[str, Any],
) -> None:
    fns = functions(template)
    migrate_env = fns["MigrateFunction"]["Environment"]["Variables"]
    assert fns["MigrateFunction"]["Policies"] == [{"Ref": "MigrateDatabaseAccessPolicy"}]
    assert {str(b) for b in _branches(migrate_env["DB_SECRET_ARN"])} == {
        str({"Ref": "MigrateDatabaseSecretArn"})
    }
    assert {str(b) for b in _branches(migrate_env["DB_IAM_USER"])} == {
        str({"Ref": "MigrateDatabaseIamUser"})
    }
    assert migrate_env["OUTBOX_RELAY_ROLE"] == {"Ref": "DatabaseRelayRole"}
    for name, props in fns.items():
        if name != "MigrateFunction":
            assert {"Ref": "MigrateDatabaseAccessPolicy"} not in props["Policies"], name
            assert {"Ref": "DatabaseAccessPolicy"} in props["Policies"], name
            assert "DB_SECRET_ARN" not in props.get("Environment", {}).get("Variables", {})
    migrator = str(template["Resources"]["MigrateDatabaseAccessPolicy"])
    assert "MigrateDatabaseSecretArn" in migrator and "${MigrateDatabaseIamUser}" in migrator
    assert "'DatabaseSecretArn'" not in migrator
    rules = str(template["Rules"])
    for check in ("MigrateDatabaseSecretArn", "MigrateDatabaseIamUser"):
        # required, and not the relay's own user
        assert rules.count(str({"Ref": check})) == 2


def test_retention_never_drops_below_a_day_and_unresolved_rows_wait(
    template: dict[str, Any],
) -> None:
    params = template["Parameters"]
    assert params["RetentionDays"]["MinValue"] == 1
    assert params["UnresolvedRetentionDays"]["Default"] == "never"
    pattern = re.compile(params["UnresolvedRetentionDays"]["AllowedPattern"])
    assert [bool(pattern.match(v)) for v in ("never", "30", "0", "-1", "")] == [
        True,
        True,
        False,
        False,
        False,
    ]


def test_secrets_by_arn_and_tls_required(template: dict[str, Any]) -> None:
    assert secret_violations(template) == []


def test_every_function_has_retries_off_a_failure_destination_and_reserved_concurrency(
    template: dict[str, Any],
) -> None:
    assert len(functions(template)) >= 9
    assert invoke_violations(template) == []


def test_schedules_have_retries_off_a_dlq_and_the_input_the_code_reads(
    template: dict[str, Any],
) -> None:
    assert schedule_violations(template) == []


def test_functions_events_and_channel_map_agree(template: dict[str, Any]) -> None:
    assert layout_violations(template) == []


def test_alarms_cover_every_function_and_queue(template: dict[str, Any]) -> None:
    assert alarm_violations(template) == []


def test_the_lease_rule_holds_for_the_defaults(template: dict[str, Any]) -> None:
    from outbox.relay_settings import RelaySettings

    env = {
        key: str(default(template, value))
        for _, key, value in environment(template)
        if isinstance(default(template, value), int | float | str)
    }
    settings = RelaySettings.from_env(env)  # raises ConfigError naming the setting
    assert settings.lease_seconds > settings.sender_timeout_seconds + settings.max_event_age_seconds


def test_the_smallest_lease_the_template_allows_passes_the_lease_rule(
    template: dict[str, Any],
) -> None:
    """A stack deployed with the parameters' minimums must start: a lease the
    template accepts but the cold start refuses fails every invocation."""
    params = template["Parameters"]
    assert params["LeaseSeconds"]["MinValue"] > (
        params["SenderTimeoutSeconds"]["MinValue"] + params["MaxEventAgeSeconds"]["MinValue"]
    )


def setting_violations(template: dict[str, Any], table: Iterable[Setting[Any]]) -> list[str]:
    """The template against the settings table (outbox.settings): every
    variable a function gets is a declared setting, each setting the table
    says the template sets is set, and what feeds it (a literal, a parameter,
    a list parameter joined, a Sub of parameters) parses, with a parameter's
    default, MinValue/MaxValue, AllowedValues and (for a number of days)
    AllowedPattern the same as the table's."""
    declared = {s.name: s for s in table}
    found = []
    set_by_template = set()
    for where, key, value in environment(template):
        setting = declared.get(key)
        if setting is None:
            found.append(f"{where}: {key} is not a declared setting")
            continue
        set_by_template.add(key)
        if not setting.in_template:
            found.append(f"{where}: {key} is declared as one the template never sets")
        for branch in _branches(value):
            found.extend(_source_violations(template, where, setting, branch))
    for setting in table:
        if setting.in_template and setting.name not in set_by_template:
            found.append(f"{setting.name}: declared as set by the template, which never sets it")
    return found


def _source_violations(
    template: dict[str, Any], where: str, setting: Setting[Any], source: Any
) -> list[str]:
    params = template["Parameters"]

    def refused(text: str, what: str) -> list[str]:
        try:
            setting.parse(text)
        except ConfigError as exc:
            return [f"{where}: {setting.name} from {what} is refused ({exc})"]
        return []

    if isinstance(source, str | int | float):
        return refused(str(source), f"the literal {source!r}")
    if isinstance(source, dict) and set(source) == {"Ref"}:
        name = source["Ref"]
        # a pseudo parameter (AWS::StackName) or a resource: nothing to compare
        return _parameter_violations(setting, name, params[name]) if name in params else []
    if isinstance(source, dict) and set(source) == {"Fn::Join"}:
        _, items = source["Fn::Join"]
        if isinstance(items, dict) and items.get("Ref") in params:
            name = items["Ref"]
            return _parameter_violations(setting, name, params[name])
    if (
        isinstance(source, dict)
        and set(source) == {"Fn::Sub"}
        and isinstance(source["Fn::Sub"], str)
    ):
        # Parameters by their defaults, resources by their names.
        text = re.sub(
            r"\$\{([A-Za-z0-9]+)\}",
            lambda m: str(params.get(m[1], {}).get("Default", m[1])),
            source["Fn::Sub"],
        )
        return refused(text, "its Sub with the parameters' defaults")
    return [f"{where}: {setting.name} is set from {source!r}, which this test cannot check"]


def _parameter_violations(setting: Setting[Any], name: str, param: dict[str, Any]) -> list[str]:
    found = []
    text = str(param.get("Default", ""))
    expected = (
        setting.default if setting.aws_default is None else setting.parse(setting.aws_default)
    )
    try:
        value = setting.read({setting.name: text})
    except ConfigError as exc:
        found.append(f"parameter {name}: default {text!r} is refused ({exc})")
    else:
        if value != expected:
            found.append(
                f"parameter {name}: default {text!r} is not {setting.name}'s "
                f"{setting.document(expected)!r}"
            )
    if isinstance(setting, Number) and param.get("Type") == "Number":
        low, high = setting.template_bounds()
        stated = (param.get("MinValue"), param.get("MaxValue"))
        if stated != (low, high):
            found.append(
                f"parameter {name}: MinValue/MaxValue {stated[0]}/{stated[1]}, "
                f"not {setting.name}'s {setting.document(low)}/{setting.document(high)}"
            )
    choices = getattr(setting, "choices", None)
    allowed = param.get("AllowedValues")
    if (allowed or choices) and sorted(map(str, allowed or [])) != sorted(choices or []):
        found.append(f"parameter {name}: AllowedValues {allowed}, not {setting.name}'s {choices}")
    if isinstance(setting, DaysOrNever):
        pattern = re.compile(param.get("AllowedPattern", ".*"))
        accepted = {n for n in range(0, 2 * setting.high) if pattern.fullmatch(str(n))}
        if accepted != set(range(setting.low, setting.high + 1)) or not pattern.fullmatch("never"):
            found.append(
                f"parameter {name}: AllowedPattern accepts other than never and "
                f"{setting.low} to {setting.high}, what {setting.name} accepts"
            )
    return found


def test_every_variable_the_template_sets_is_a_setting_with_its_default_and_bounds(
    template: dict[str, Any],
) -> None:
    assert setting_violations(template, SETTINGS) == []


def test_the_settings_check_catches_a_template_out_of_step(template: dict[str, Any]) -> None:
    bad = copy.deepcopy(template)
    params, res = bad["Parameters"], bad["Resources"]
    globals_env = bad["Globals"]["Function"]["Environment"]["Variables"]
    globals_env["BATCH_SIZ"] = 100  # a typo: nothing reads it
    del globals_env["DEDUPE_WINDOW_DAYS"]
    globals_env["MIN_DEFERRAL_SECONDS"] = "soon"
    res["WebhookFunction"]["Properties"]["Environment"]["Variables"]["WEBHOOK_ALLOW_INSECURE"] = (
        "true"
    )
    params["BatchSize"]["Default"] = 101
    params["LeaseSeconds"]["MinValue"] = 61
    params["DispatchBudgetSeconds"]["MaxValue"] = 900  # past the dispatcher's 60 s timeout
    params["OutcomeEventsDelivered"]["AllowedValues"] = ["true", "false", "yes"]
    params["OutcomeEventBusName"]["Default"] = ""  # the table says deployed stacks publish
    params["UnresolvedRetentionDays"]["AllowedPattern"] = "^(never|[1-9][0-9]{0,3})$"
    params["EmailConcurrency"]["Default"] = -1  # CHANNEL_CONCURRENCY refuses it
    assert setting_violations(bad, SETTINGS) == [
        "parameter BatchSize: default '101' is not BATCH_SIZE's '100'",
        "parameter LeaseSeconds: MinValue/MaxValue 61/86400, not LEASE_SECONDS's 66/86400",
        "Globals: MIN_DEFERRAL_SECONDS from the literal 'soon' is refused (configuration "
        "MIN_DEFERRAL_SECONDS: must be a number, got 'soon')",
        "parameter UnresolvedRetentionDays: AllowedPattern accepts other than never and "
        "1 to 3650, what UNRESOLVED_RETENTION_DAYS accepts",
        "parameter DispatchBudgetSeconds: MinValue/MaxValue 0/900, "
        "not DISPATCH_BUDGET_SECONDS's 0/55",
        "parameter OutcomeEventBusName: default '' is not OUTCOME_EVENT_BUS's 'default'",
        "parameter OutcomeEventsDelivered: AllowedValues ['true', 'false', 'yes'], "
        "not OUTCOME_EVENTS_DELIVERED's ('true', 'false')",
        "Globals: BATCH_SIZ is not a declared setting",
        "DispatcherFunction: CHANNEL_CONCURRENCY from its Sub with the parameters' defaults is "
        "refused (configuration CHANNEL_CONCURRENCY: 'email' must be a whole number from 0 to "
        "10000)",
        "WebhookFunction: WEBHOOK_ALLOW_INSECURE is declared as one the template never sets",
        "DEDUPE_WINDOW_DAYS: declared as set by the template, which never sets it",
    ]
    # And the table is what it is checked against: a different default there
    # puts the unchanged template out of step.
    table = [dataclasses.replace(s, default=50) if s.name == "BATCH_SIZE" else s for s in SETTINGS]
    assert setting_violations(template, table) == [
        "parameter BatchSize: default '100' is not BATCH_SIZE's '50'"
    ]


def parameter_column_violations(
    template: dict[str, Any], rows: list[ConfigurationRow], unused: list[str]
) -> list[str]:
    """The configuration reference's "template parameter" column against the
    template: each parameter a row names feeds a variable of that row, each
    parameter that feeds a variable (by !Ref or inside a !Sub) is named in its
    row, and ``unused`` (the table of the other parameters) lists exactly those
    that no variable takes as its value."""
    params = template["Parameters"]
    fed_by: dict[str, set[str]] = {}
    taken_as_is: set[str] = set()  # parameters some variable takes by !Ref
    for _, key, value in environment(template):
        for branch in _branches(value):
            if isinstance(branch, dict) and set(branch) == {"Fn::Join"}:
                branch = branch["Fn::Join"][1]
            if isinstance(branch, dict) and branch.get("Ref") in params:
                fed_by.setdefault(key, set()).add(branch["Ref"])
                taken_as_is.add(branch["Ref"])
            if isinstance(branch, dict) and set(branch) == {"Fn::Sub"}:
                named = set(re.findall(r"\$\{([A-Za-z0-9]+)\}", str(branch["Fn::Sub"])))
                fed_by.setdefault(key, set()).update(named & set(params))
    found, documented = [], set()
    for row in rows:
        named = [p for p in re.findall(r"`([^`]+)`", row.parameter) if p in params]
        for param in named:
            documented |= {(v, param) for v in row.variables}
            feeds = sorted(v for v, ps in fed_by.items() if param in ps)
            if not set(feeds) & set(row.variables):
                found.append(f"reference: {param} does not feed {', '.join(row.variables)}")
    for variable, feeding in sorted(fed_by.items()):
        for param in sorted(feeding - {p for v, p in documented if v == variable}):
            found.append(f"reference: {variable}'s row does not name {param}, which feeds it")
    for param in unused:
        if param in taken_as_is:
            found.append(f"reference: {param} is a variable's value, not a parameter of its own")
    for param in sorted(set(params) - taken_as_is - set(unused)):
        found.append(f"reference: {param} is in neither table")
    return found


def _unused_parameters(markdown: str) -> list[str]:
    return [line.split("`")[1] for line in markdown.splitlines()[2:] if line.startswith("| `")]


def test_the_configuration_reference_names_the_parameters_that_feed_each_variable(
    template: dict[str, Any],
) -> None:
    text = configuration.settings_table(template)
    unused = _unused_parameters(configuration.parameters_table(template))
    assert parameter_column_violations(template, configuration_rows(text), unused) == []
    broken = text.replace("| `BATCH_SIZE` | `BatchSize` |", "| `BATCH_SIZE` | `BatchSizes` |")
    broken = broken.replace("| `DB_PORT` | `DatabasePort` |", "| `DB_PORT` | `DatabaseName` |")
    unused_broken = [p for p in unused if p != "SesIdentity"] + ["EventBusName"]
    assert parameter_column_violations(template, configuration_rows(broken), unused_broken) == [
        "reference: DatabaseName does not feed DB_PORT",
        "reference: BATCH_SIZE's row does not name BatchSize, which feeds it",
        "reference: DB_PORT's row does not name DatabasePort, which feeds it",
        "reference: EventBusName is a variable's value, not a parameter of its own",
        "reference: SesIdentity is in neither table",
    ]


def capacity_violations(template: dict[str, Any]) -> list[str]:
    """The dispatcher's CHANNEL_CONCURRENCY names, for every channel it routes,
    the parameter that sets that channel function's reserved concurrency."""
    found = []
    dispatcher = next(p for p in functions(template).values() if folder_of(p) == "dispatcher")
    variables = dispatcher["Environment"]["Variables"]
    raw = variables["CHANNEL_CONCURRENCY"]["Fn::Sub"]
    concurrency = json.loads(re.sub(r"\$\{([A-Za-z0-9]+)\}", r'"\1"', raw))
    for channel, function in sorted(_channel_map(template).items()):
        reserved = reserved_parameter(template, functions(template).get(function, {}))
        if reserved is None or concurrency.get(channel) != reserved:
            found.append(
                f"CHANNEL_CONCURRENCY[{channel!r}] is not {function}'s reserved concurrency"
            )
    for channel in sorted(set(concurrency) - set(_channel_map(template))):
        found.append(f"CHANNEL_CONCURRENCY names {channel!r}, which the dispatcher does not route")
    if variables.get("CHANNEL_MAX_IN_FLIGHT") != {"Ref": "ChannelMaxInFlight"}:
        found.append("CHANNEL_MAX_IN_FLIGHT is not the ChannelMaxInFlight parameter")
    return found


def test_the_dispatchers_budgets_follow_each_channels_reserved_concurrency(
    template: dict[str, Any],
) -> None:
    from outbox.relay_settings import RelaySettings

    assert capacity_violations(template) == []
    # The defaults give the budgets the configuration reference states.
    params = {name: str(p.get("Default")) for name, p in template["Parameters"].items()}
    dispatcher = next(p for p in functions(template).values() if folder_of(p) == "dispatcher")
    raw = dispatcher["Environment"]["Variables"]["CHANNEL_CONCURRENCY"]["Fn::Sub"]
    env = {
        key: str(default(template, value))
        for _, key, value in environment(template)
        if isinstance(default(template, value), int | float | str)
    }
    env["CHANNEL_CONCURRENCY"] = re.sub(r"\$\{([A-Za-z0-9]+)\}", lambda m: params[m[1]], raw)
    budgets = RelaySettings.from_env(env).in_flight_budgets()
    assert budgets == {
        "email": 480,
        "sms": 256,
        "push": 256,
        "webhook": 480,
        "eventbridge": 256,
        "sqs": 256,
    }

    bad = copy.deepcopy(template)
    bad_dispatcher = bad["Resources"]["DispatcherFunction"]["Properties"]
    bad_dispatcher["Environment"]["Variables"]["CHANNEL_CONCURRENCY"]["Fn::Sub"] = raw.replace(
        "${SmsConcurrency}", "${PushConcurrency}"
    ).replace('"sqs"', '"fax"')
    del bad_dispatcher["Environment"]["Variables"]["CHANNEL_MAX_IN_FLIGHT"]
    assert capacity_violations(bad) == [
        "CHANNEL_CONCURRENCY['sms'] is not SmsFunction's reserved concurrency",
        "CHANNEL_CONCURRENCY['sqs'] is not SqsFunction's reserved concurrency",
        "CHANNEL_CONCURRENCY names 'fax', which the dispatcher does not route",
        "CHANNEL_MAX_IN_FLIGHT is not the ChannelMaxInFlight parameter",
    ]


def test_the_layer_is_built_for_the_runtime_without_boto(template: dict[str, Any]) -> None:
    layer = template["Resources"]["OutboxLayer"]
    assert layer["Metadata"]["BuildMethod"] == "python3.12"
    assert template["Globals"]["Function"]["Runtime"] == "python3.12"
    requirements = (ROOT / layer["Properties"]["ContentUri"] / "requirements.txt").read_text()
    names = {
        re.split(r"[<>=\[; ]", line.strip())[0].lower()
        for line in requirements.splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert names & {"boto3", "botocore", "aws-xray-sdk"} == set()


def test_feedback_and_outcome_events_are_wired_with_least_privilege(
    template: dict[str, Any],
) -> None:
    res = template["Resources"]
    feedback = res["FeedbackFunction"]["Properties"]
    assert feedback["Policies"] == [{"Ref": "DatabaseAccessPolicy"}]  # the database, nothing else
    assert feedback["Events"]["SesFeedback"] == {
        "Type": "SNS",
        "Properties": {"Topic": {"Ref": "SesFeedbackTopic"}},
    }
    destination = res["SesFeedbackEventDestination"]["Properties"]["EventDestination"]
    assert destination["SnsDestination"] == {"TopicARN": {"Ref": "SesFeedbackTopic"}}
    assert set(destination["MatchingEventTypes"]) == {"bounce", "complaint", "delivery"}
    (publisher,) = [st for name, st in statements(template) if name == "ReaperFunction"]
    assert publisher["Action"] == "events:PutEvents"
    assert _strings(publisher["Resource"]) == [
        "arn:${AWS::Partition}:events:${AWS::Region}:${AWS::AccountId}:event-bus/"
        "${OutcomeEventBusName}"
    ]
    email_env = res["EmailFunction"]["Properties"]["Environment"]["Variables"]
    assert email_env["SES_CONFIGURATION_SET"]["Fn::If"][0] == "CreateSesConfigurationSet"
    schema = res["SchemaMigration"]["Properties"]
    assert schema["OutcomeEventsDelivered"] == {"Ref": "OutcomeEventsDelivered"}


def test_migrations_run_on_deploy_when_asked(template: dict[str, Any]) -> None:
    schema = template["Resources"]["SchemaMigration"]
    assert schema["Type"] == "Custom::OutboxSchema"
    assert schema["Condition"] == "ApplyMigrations"
    assert schema["Properties"]["ServiceToken"] == {"Fn::GetAtt": ["MigrateFunction", "Arn"]}
    assert schema["Properties"]["LayerVersion"] == {"Ref": "OutboxLayer"}
    assert template["Parameters"]["ApplyMigrationsOnDeploy"]["Default"] == "true"


def test_event_files_are_what_the_triggers_send() -> None:
    from outbox.handoff import HandOff

    for path in sorted((ROOT / "events").glob("*.json")):
        event = json.loads(path.read_text())
        name = path.stem
        if name in ("dispatcher", "reaper"):
            assert set(event) == set(SCHEDULER_INPUT), name
            assert all(isinstance(v, str) and not v.startswith("<") for v in event.values()), name
        elif name.startswith(("dispatcher-", "reaper-")):
            # The wake-ups the relay sends itself (docs/how-to/pacing.md).
            from outbox.runtime import WAKE_SOURCES

            assert event["version"] == 1 and event["source"] in WAKE_SOURCES, name
        elif name == "migrate":
            assert event["RequestType"] == "Create"
            assert event["ResponseURL"].startswith("https://")
            assert event["ResourceType"] == "Custom::OutboxSchema"
        elif name == "migrate-invoke":
            assert event == {}
        elif name.startswith("feedback-"):
            from outbox import feedback

            (notification,) = feedback.notifications(event)
            parsed = feedback.from_notification(notification)
            assert parsed, name
            assert all(p.provider_message_id.startswith("EXAMPLE") for p in parsed), name
        else:
            assert HandOff.from_event(event).channel == name


# --- and a broken one is caught (the checks can fail) ---------------------------


def test_checks_catch_a_broken_template(template: dict[str, Any], tmp_path: Path) -> None:
    bad = copy.deepcopy(template)
    res = bad["Resources"]
    res["ReaperFunction"]["Properties"]["Policies"].append(
        {"Statement": [{"Effect": "Allow", "Action": "sqs:*", "Resource": "*"}]}
    )
    res["EmailFunction"]["Properties"]["Policies"].append("AmazonSESFullAccess")
    sms = res["SmsFunction"]["Properties"]["Policies"][1]["Statement"]
    sms.pop()  # the Deny
    sms[0]["Action"].append("sns:CreateTopic")  # not a phone-number action
    res["PushFunction"]["Properties"]["Policies"][1]["Statement"][0]["Resource"] = {
        "Fn::Sub": "arn:aws:sns:${AWS::Region}:${AWS::AccountId}:endpoint/*"
    }
    # The one documented grant on "*" of the email function reads the sending
    # rate; anything else there is a wildcard.
    (read_rate,) = [
        st
        for policy in res["EmailFunction"]["Properties"]["Policies"]
        if isinstance(policy, dict)
        for st in policy.get("Statement", [])
        if st.get("Sid") == "ReadSesSendRate"
    ]
    read_rate["Action"] = ["ses:GetAccount", "ses:SendEmail"]
    assert len(iam_violations(bad)) == 7
    push = res["PushFunction"]["Properties"]["Policies"][1]["Statement"][0]
    push["Action"] = ["sns:Publish", "sns:GetEndpointAttributes"]
    assert unused_grant_violations(bad) == [
        "SmsFunction: granted sns:CreateTopic, which sms.py never calls",
        "PushFunction: granted sns:GetEndpointAttributes, which push.py never calls",
    ]

    res["WebhookFunction"]["Properties"]["Environment"]["Variables"]["WEBHOOK_SECRET"] = "hunter2"
    bad["Globals"]["Function"]["Environment"]["Variables"]["DB_SSLMODE"] = "require"
    bad["Globals"]["Function"]["Environment"]["Variables"]["DATABASE_URL"] = (
        "postgresql://u:pw@h/db"
    )
    res["WebhookFunction"]["Properties"]["Environment"]["Variables"]["WEBHOOK_ALLOW_INSECURE"] = "1"
    res["WebhookFunction"]["Properties"]["Environment"]["Variables"]["WEBHOOK_SECRET_ARNS"] = "x,y"
    assert len(secret_violations(bad)) == 7

    res["PushFunction"]["Properties"]["EventInvokeConfig"]["MaximumRetryAttempts"] = 2
    del res["SqsFunction"]["Properties"]["EventInvokeConfig"]["DestinationConfig"]
    del res["EmailFunction"]["Properties"]["ReservedConcurrentExecutions"]
    bad["Parameters"]["MaxEventAgeSeconds"]["Default"] = 100
    violations = invoke_violations(bad)
    # (the dispatcher's wake-ups wait at most Lambda's shortest age, not the parameter's)
    assert sum("MaximumEventAge" in v for v in violations) == len(functions(bad)) - 1
    assert len(violations) == len(functions(bad)) + 2

    event = res["ReaperFunction"]["Properties"]["Events"]["EveryMinute"]["Properties"]
    event["RetryPolicy"]["MaximumRetryAttempts"] = 185
    del event["DeadLetterConfig"]
    event["Input"] = "{}"
    event["Name"] = "reaper"
    assert len(schedule_violations(bad)) == 4

    (tmp_path / "functions" / "fax").mkdir(parents=True)
    (tmp_path / "functions" / "fax" / "app.py").write_text("")
    (tmp_path / "events").mkdir()
    for folder in {folder_of(p) for p in functions(template).values()}:
        (tmp_path / "functions" / folder).mkdir(exist_ok=True)
        (tmp_path / "functions" / folder / "app.py").write_text("")
        if folder != "sms":
            (tmp_path / "events" / f"{folder}.json").write_text("{}")
    del res["EmailFunction"]
    assert layout_violations(template, tmp_path) == [
        "functions/fax has no template entry",
        "events/fax.json is missing",
        "events/sms.json is missing",
    ]
    found = layout_violations(bad, tmp_path)
    assert "functions/email has no template entry" in found
    assert any(v.startswith("CHANNEL_FUNCTIONS") for v in found)
    assert any(v.startswith("the dispatcher may invoke") for v in found)
    assert "EmailFunction: no Errors alarm" not in alarm_violations(bad)  # gone, not unwatched
    del res["FailureQueueAlarm"]
    del res["DispatcherErrorsAlarm"]
    res["DispatcherFunction"]["Properties"]["EventInvokeConfig"]["DestinationConfig"] = {
        "OnFailure": {"Type": "SQS", "Destination": "x"}
    }
    assert alarm_violations(bad) == [
        "SqsFunction: no Errors alarm and no failure destination",
        "FailureQueue: no queue depth alarm",
    ]
    assert "DispatcherFunction: a failure destination for wake-ups" in invoke_violations(bad)
