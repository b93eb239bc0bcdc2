"""The template's observability: metrics per stack, a dashboard and alarms that
watch only metrics the code emits, OK actions on every alarm, a throttle alarm,
and the quick-try deploy (no VPC, no secret parameter needed, arm64).

The emitted metric names are collected from the code itself (every call of
``observability.count``/``gauge``, following wrappers that pass a name through),
so a metric added anywhere in the package is seen without a list to maintain.
"""

from __future__ import annotations

import ast
import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cfnlint.decode import cfn_yaml
from template.test_template import ROOT, _channel_map, functions

from docgen.configuration import load_template

PACKAGE = ROOT / "layers" / "outbox" / "outbox"


def metric_sinks(package: Path = PACKAGE) -> set[tuple[str, int]]:
    """(function, argument index) of observability's recording functions: every
    public one whose first parameter is ``name`` (count, gauge, timing, ...)."""
    tree = ast.parse((package / "observability.py").read_text())
    return {
        (node.name, 0)
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and not node.name.startswith("_")
        and node.args.args
        and node.args.args[0].arg == "name"
    }


METRIC_SINKS = metric_sinks()


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template()


# --- the metric names the code emits ---------------------------------------------


def _module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    found: dict[str, ast.expr] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and node.value is not None:
                found[target.id] = node.value
    return found


def _callee(call: ast.Call, direct_only: bool) -> str | None:
    """The called function's name: ``f(...)`` or ``observability.f(...)`` (any
    ``x.f(...)`` unless ``direct_only``, for wrappers that may be methods)."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        value = call.func.value
        if not direct_only or (isinstance(value, ast.Name) and value.id == "observability"):
            return call.func.attr
    return None


def _loop_values(tree: ast.Module, call: ast.Call, name: str) -> list[str] | None:
    """The strings a loop variable takes: ``for a, b in (("X", 1), ("Y", 2))``
    gives ``a`` the values X and Y. None when ``name`` is no such variable."""
    for loop in ast.walk(tree):
        if not (isinstance(loop, ast.For) and any(n is call for n in ast.walk(loop))):
            continue
        targets = loop.target.elts if isinstance(loop.target, ast.Tuple) else [loop.target]
        names = [t.id if isinstance(t, ast.Name) else None for t in targets]
        if name not in names or not isinstance(loop.iter, ast.Tuple | ast.List):
            continue
        index, values = names.index(name), []
        for item in loop.iter.elts:
            element = item.elts[index] if isinstance(item, ast.Tuple) else item
            if not (isinstance(element, ast.Constant) and isinstance(element.value, str)):
                return None
            values.append(element.value)
        return values
    return None


def _enclosing_functions(tree: ast.Module) -> dict[ast.Call, ast.FunctionDef]:
    """Each call inside a function, mapped to the innermost function around it."""
    owner: dict[ast.Call, ast.FunctionDef] = {}

    def visit(node: ast.AST, fn: ast.FunctionDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call) and fn is not None:
                owner[child] = fn
            visit(child, child if isinstance(child, ast.FunctionDef) else fn)

    visit(tree, None)
    return owner


def emitted_metric_names(package: Path = PACKAGE) -> set[str]:
    """Every metric name passed to count()/gauge(), or to a function that passes
    its argument on to them. A name the scan cannot resolve fails the test: keep
    metric names literal (or module constants) so the dashboard can be checked."""
    trees = {
        path: ast.parse(path.read_text(), str(path))
        for path in sorted(package.rglob("*.py"))
        if path.name != "observability.py" and "migrations" not in path.parts
    }
    sinks = set(METRIC_SINKS)
    names: set[str] = set()
    unresolved: list[str] = []
    while True:
        new_sinks: set[tuple[str, int]] = set()
        unresolved.clear()
        for path, tree in trees.items():
            constants = _module_constants(tree)
            owners = _enclosing_functions(tree)
            for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
                for sink, index in sinks:
                    if _callee(call, direct_only=(sink, index) in METRIC_SINKS) != sink:
                        continue
                    arg = call.args[index] if len(call.args) > index else None
                    arg = arg or next((k.value for k in call.keywords if k.arg == "name"), None)
                    where = f"{path.relative_to(package)}:{call.lineno}"
                    if arg is None:
                        unresolved.append(where)
                    elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        names.add(arg.value)
                    elif isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name):
                        table = constants.get(arg.value.id)
                        if isinstance(table, ast.Dict):
                            names.update(
                                v.value
                                for v in table.values
                                if isinstance(v, ast.Constant) and isinstance(v.value, str)
                            )
                        else:
                            unresolved.append(where)
                    elif isinstance(arg, ast.Name):
                        value = constants.get(arg.id)
                        fn = owners.get(call)
                        params = (
                            [a.arg for a in fn.args.args if a.arg not in ("self", "cls")]
                            if fn
                            else []
                        )
                        looped = _loop_values(tree, call, arg.id)
                        if isinstance(value, ast.Constant) and isinstance(value.value, str):
                            names.add(value.value)
                        elif looped is not None:
                            names.update(looped)
                        elif fn is not None and arg.id in params:
                            new_sinks.add((fn.name, params.index(arg.id)))
                        else:
                            unresolved.append(where)
                    else:
                        unresolved.append(where)
        if new_sinks <= sinks:
            break
        sinks |= new_sinks
    assert not unresolved, f"metric names the scan cannot resolve: {unresolved}"
    return names


def test_the_scan_finds_metrics_behind_wrappers_and_tables(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "from .observability import count, gauge\n"
        "_M = {'ok': 'Delivered', 'bad': 'Failed'}\n"
        "NAME = 'Constant'\n"
        "def by_channel(name, items):\n"
        "    for c in items:\n"
        "        count(name, 1, channel=c)\n"
        "def run(key):\n"
        "    by_channel('Wrapped', [])\n"
        "    count(_M[key])\n"
        "    gauge(NAME, 0)\n"
        "    gauge(name='Keyword', value=1)\n"
        "    for metric, n in (('Looped', 1), ('Looped2', 2)):\n"
        "        count(metric, n)\n"
        "    'text'.count(key)  # str.count: not a metric\n"
    )
    found = emitted_metric_names(tmp_path)
    assert {"Delivered", "Failed", "Constant", "Wrapped", "Keyword", "Looped", "Looped2"} <= found
    (tmp_path / "b.py").write_text("from .observability import count\ncount(make_name())\n")
    with pytest.raises(AssertionError, match="cannot resolve"):
        emitted_metric_names(tmp_path)


def test_the_recording_functions_are_found() -> None:
    assert {("count", 0), ("gauge", 0), ("timing", 0)} <= METRIC_SINKS


def test_the_package_emits_the_core_metrics() -> None:
    names = emitted_metric_names()
    assert {
        "Delivered",
        "Retried",
        "Failed",
        "Dead",
        "HandedOff",
        "HandOffFailed",
        "Reclaimed",
        "PendingMessages",
        "OldestPendingAgeSeconds",
        "DeadMessages",
        "PausedChannels",
        "Paused",
        "SendMilliseconds",
    } <= names


# --- the metric names the template watches -----------------------------------------


def emf_namespace(template: dict[str, Any]) -> str:
    value = template["Globals"]["Function"]["Environment"]["Variables"][
        "POWERTOOLS_METRICS_NAMESPACE"
    ]
    assert isinstance(value, str)
    return value


def dashboard_body(template: dict[str, Any], name: str = "Dashboard") -> dict[str, Any]:
    """The dashboard JSON with every ${...} of its Fn::Sub replaced by a stand-in."""
    sub = template["Resources"][name]["Properties"]["DashboardBody"]["Fn::Sub"]
    text = sub if isinstance(sub, str) else sub[0]
    text = re.sub(r"\$\{OldestPendingAgeAlarmSeconds\}", "300", text)
    text = re.sub(r"\$\{([A-Za-z0-9:.]+)\}", r"<\1>", text)
    body: dict[str, Any] = json.loads(text)
    return body


def _dashboard_metrics(body: dict[str, Any]) -> Iterator[tuple[str, str, list[Any]]]:
    """(namespace, metric name, dimensions) of every metric the dashboard draws."""
    for widget in body["widgets"]:
        for entry in widget.get("properties", {}).get("metrics", []):
            if len(entry) >= 2 and isinstance(entry[0], str) and isinstance(entry[1], str):
                dims = [x for x in entry[2:] if not isinstance(x, dict)]
                yield entry[0], entry[1], dims
            for item in entry:
                if isinstance(item, dict) and "expression" in item:
                    yield from _search_metrics(item["expression"])


_SEARCH = re.compile(r"SEARCH\('\{([^}]*)\}([^']*)'")


def _search_metrics(expression: str) -> Iterator[tuple[str, str, list[Any]]]:
    for schema, terms in _SEARCH.findall(expression):
        namespace, *dims = [p.strip() for p in schema.split(",")]
        names = re.findall(r'MetricName="([^"]+)"', terms)
        assert names, f"a SEARCH without an exact MetricName: {expression}"
        for name in names:
            yield namespace, name, dims


def _alarm_metrics(template: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(alarm, namespace, metric name) of every metric an alarm reads."""
    for name, resource in template["Resources"].items():
        if resource["Type"] != "AWS::CloudWatch::Alarm":
            continue
        props = resource["Properties"]
        if "MetricName" in props:
            yield name, props["Namespace"], props["MetricName"]
        for query in props.get("Metrics", []):
            metric = query.get("MetricStat", {}).get("Metric")
            if metric:
                yield name, metric["Namespace"], metric["MetricName"]


def metric_name_violations(template: dict[str, Any], emitted: set[str]) -> list[str]:
    namespace = emf_namespace(template)
    found = []
    for ns, metric, _ in _dashboard_metrics(dashboard_body(template)):
        if ns == namespace and metric not in emitted:
            found.append(f"dashboard: {metric} is not emitted by the code")
        elif ns not in (namespace, "AWS/Lambda"):
            found.append(f"dashboard: namespace {ns} is neither the relay's nor AWS/Lambda")
    for alarm, ns, metric in _alarm_metrics(template):
        if ns == namespace and metric not in emitted:
            found.append(f"{alarm}: {metric} is not emitted by the code")
    return found


def test_dashboard_and_alarms_watch_only_metrics_the_code_emits(
    template: dict[str, Any],
) -> None:
    emitted = emitted_metric_names()
    assert metric_name_violations(template, emitted) == []
    # and the check can fail: a dashboard line and an alarm on names nobody emits
    bad = copy.deepcopy(template)
    sub = bad["Resources"]["Dashboard"]["Properties"]["DashboardBody"]
    sub["Fn::Sub"] = sub["Fn::Sub"].replace(
        'MetricName=\\"Delivered\\"', 'MetricName=\\"Delivred\\"'
    )
    bad["Resources"]["DeadMessagesAlarm"]["Properties"]["MetricName"] = "DeadMessage"
    assert metric_name_violations(bad, emitted) == [
        "dashboard: Delivred is not emitted by the code",
        "DeadMessagesAlarm: DeadMessage is not emitted by the code",
    ]


def test_the_dashboard_shows_what_an_operator_needs(template: dict[str, Any]) -> None:
    namespace = emf_namespace(template)
    drawn = list(_dashboard_metrics(dashboard_body(template)))
    per_channel = {m for ns, m, dims in drawn if ns == namespace and "channel" in dims}
    relay_wide = {m for ns, m, dims in drawn if ns == namespace}
    assert {
        "PendingMessages",  # backlog per channel
        "OldestPendingAgeSeconds",  # oldest due age per channel
        "Delivered",
        "Retried",
        "Failed",
        "Dead",
        "HandOffFailed",
        "LeaseLost",
        "Paused",
        "SendMilliseconds",  # provider call duration per channel
    } <= per_channel
    assert {"Reclaimed", "PausedChannels"} <= relay_wide  # lease expiries, pauses
    lambda_metrics: dict[str, set[str]] = {}
    for ns, metric, dims in drawn:
        if ns == "AWS/Lambda":
            lambda_metrics.setdefault(metric, set()).add(dims[1].strip("<>"))
    every_function = set(functions(template))
    assert lambda_metrics["Errors"] == every_function
    assert lambda_metrics["Throttles"] == every_function
    senders = set(_channel_map(template).values())  # the channel functions
    assert senders and senders <= lambda_metrics["Duration"]
    # every relay metric is filtered to this stack's service
    text = template["Resources"]["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"]
    searches = re.findall(r"SEARCH\('[^']*'", text)
    assert searches and all('service=\\"${AWS::StackName}\\"' in s for s in searches)


# --- metrics per stack, alarms ---------------------------------------------------------


def test_metrics_service_is_the_stack_so_stacks_never_share_metrics(
    template: dict[str, Any],
) -> None:
    env = template["Globals"]["Function"]["Environment"]["Variables"]
    assert env["POWERTOOLS_SERVICE_NAME"] == {"Ref": "AWS::StackName"}
    namespace = emf_namespace(template)
    for resource in template["Resources"].values():
        props = resource.get("Properties", {})
        if resource["Type"] == "AWS::CloudWatch::Alarm" and props.get("Namespace") == namespace:
            assert {"Name": "service", "Value": {"Ref": "AWS::StackName"}} in props["Dimensions"]
    for props in functions(template).values():  # no function overrides them
        variables = props.get("Environment", {}).get("Variables", {})
        assert not {"POWERTOOLS_SERVICE_NAME", "POWERTOOLS_METRICS_NAMESPACE"} & set(variables)


def test_every_alarm_has_ok_actions_like_its_alarm_actions(
    template: dict[str, Any],
) -> None:
    alarms = {
        n: r["Properties"]
        for n, r in template["Resources"].items()
        if r["Type"] == "AWS::CloudWatch::Alarm"
    }
    assert len(alarms) >= 14
    for name, props in alarms.items():
        assert props.get("OKActions") == props.get("AlarmActions") is not None, name


def test_one_throttle_alarm_watches_every_function_but_the_dispatcher(
    template: dict[str, Any],
) -> None:
    """The dispatcher's reserved concurrency throttles a storm of nudges by
    design (docs/how-to/pacing.md): its throttles are no alarm."""
    props = template["Resources"]["ThrottlesAlarm"]["Properties"]
    watched = {
        q["MetricStat"]["Metric"]["Dimensions"][0]["Value"]["Ref"]
        for q in props["Metrics"]
        if "MetricStat" in q and q["MetricStat"]["Metric"]["MetricName"] == "Throttles"
    }
    assert watched == set(functions(template)) - {"DispatcherFunction"}
    assert len(props["Metrics"]) - 1 <= 10  # CloudWatch: at most 10 metrics per alarm
    [expression] = [q for q in props["Metrics"] if q.get("ReturnData")]
    assert expression["Expression"] == "SUM(METRICS())"
    assert props["Threshold"] == 0 and props["ComparisonOperator"] == "GreaterThanThreshold"


# --- the quick-try deploy ---------------------------------------------------------------


def test_the_vpc_is_optional(template: dict[str, Any]) -> None:
    params = template["Parameters"]
    for name in ("SubnetIds", "SecurityGroupIds"):
        assert params[name]["Type"] == "CommaDelimitedList"  # accepts the empty value
        assert params[name]["Default"] == ""
    assert template["Conditions"]["InVpc"] == {
        "Fn::Not": [{"Fn::Equals": [{"Fn::Join": ["", {"Ref": "SubnetIds"}]}, ""]}]
    }
    vpc = template["Globals"]["Function"]["VpcConfig"]["Fn::If"]
    assert vpc[0] == "InVpc"
    assert vpc[1] == {
        "SubnetIds": {"Ref": "SubnetIds"},
        "SecurityGroupIds": {"Ref": "SecurityGroupIds"},
    }
    assert vpc[2] == {"Ref": "AWS::NoValue"}
    for name, props in functions(template).items():
        assert "VpcConfig" not in props, f"{name} overrides the optional VPC"
    rules = template["Rules"]
    assert rules["VpcNeedsSecurityGroups"]["RuleCondition"] == {
        "Fn::Not": [{"Fn::EachMemberEquals": [{"Ref": "SubnetIds"}, ""]}]
    }


def test_iam_auth_needs_no_secret_parameter(template: dict[str, Any]) -> None:
    params = template["Parameters"]
    without_default = sorted(n for n, p in params.items() if "Default" not in p)
    assert without_default == []  # a quick try passes only what it uses
    assert params["DatabaseSecretArn"]["Default"] == ""
    # DatabaseAuth=secret still needs one (a rule), and uses it only when given
    assert template["Rules"]["SecretAuthNeedsSecret"]["Assertions"][0]["Assert"] == {
        "Fn::Not": [{"Fn::Equals": [{"Ref": "DatabaseSecretArn"}, ""]}]
    }


def test_functions_default_to_arm64_with_a_layer_for_both(template: dict[str, Any]) -> None:
    params = template["Parameters"]["Architecture"]
    assert params["Default"] == "arm64"
    assert set(params["AllowedValues"]) == {"arm64", "x86_64"}
    assert template["Globals"]["Function"]["Architectures"] == [{"Ref": "Architecture"}]
    for name, props in functions(template).items():
        assert "Architectures" not in props, name
    layer = template["Resources"]["OutboxLayer"]
    assert layer["Metadata"]["BuildArchitecture"] == "arm64"
    assert set(layer["Properties"]["CompatibleArchitectures"]) == {"arm64", "x86_64"}


def test_samconfig_has_a_dev_environment() -> None:
    import tomllib

    config = tomllib.loads((ROOT / "samconfig.toml").read_text())
    assert config["version"] == 0.1
    assert config["dev"]["global"]["parameters"]["stack_name"] == "outbox-relay-dev"
    deploy = config["dev"]["deploy"]["parameters"]
    assert "CAPABILITY_IAM" in deploy["capabilities"]
    assert deploy["resolve_s3"] is True
    assert deploy["confirm_changeset"] is False
    assert config["dev"]["build"]["parameters"]["cached"] is True


def test_the_sample_database_stack_lints_clean_and_outputs_the_relay_parameters() -> None:
    from cfnlint.api import ManualArgs, lint

    path = ROOT / "examples" / "database.yaml"
    # as `sam validate --lint --region us-east-1` (make sam-check) lints it
    matches = lint(path.read_text(), config=ManualArgs(regions=["us-east-1"]))
    assert [str(m) for m in matches] == []
    sample = cfn_yaml.load(str(path))
    types = {r["Type"] for r in sample["Resources"].values()}
    assert {
        "AWS::RDS::DBCluster",
        "AWS::RDS::DBInstance",
        "AWS::RDS::DBProxy",
        "AWS::RDS::DBProxyTargetGroup",
        "AWS::SecretsManager::Secret",
    } <= types
    [cluster] = [r for r in sample["Resources"].values() if r["Type"] == "AWS::RDS::DBCluster"]
    assert cluster["Properties"]["Engine"] == "aurora-postgresql"
    assert "ServerlessV2ScalingConfiguration" in cluster["Properties"]
    [instance] = [r for r in sample["Resources"].values() if r["Type"] == "AWS::RDS::DBInstance"]
    assert instance["Properties"]["DBInstanceClass"] == "db.serverless"
    [proxy] = [r for r in sample["Resources"].values() if r["Type"] == "AWS::RDS::DBProxy"]
    assert proxy["Properties"]["RequireTLS"] is True
    relay = cfn_yaml.load(str(ROOT / "template.yaml"))
    outputs = set(sample["Outputs"])
    for parameter in (
        "SubnetIds",
        "SecurityGroupIds",
        "DatabaseSecretArn",
        "MigrateDatabaseSecretArn",
        "DatabaseHost",
        "DatabaseName",
    ):
        assert parameter in outputs and parameter in relay["Parameters"]
    overrides = sample["Outputs"]["RelayParameterOverrides"]["Value"]["Fn::Sub"][0]
    given = {pair.split("=")[0] for pair in overrides.split()}
    assert given <= set(relay["Parameters"])
    assert {"DatabaseSecretArn", "MigrateDatabaseSecretArn", "DatabaseRelayRole"} <= given
    # the relay and the migrator are different users, each known to the proxy
    assert sample["Outputs"]["DatabaseSecretArn"]["Value"] == {"Ref": "RelaySecret"}
    assert sample["Outputs"]["MigrateDatabaseSecretArn"]["Value"] == {"Ref": "DatabaseSecret"}
    proxy_secrets = [a["SecretArn"] for a in proxy["Properties"]["Auth"]]
    assert proxy_secrets == [{"Ref": "DatabaseSecret"}, {"Ref": "RelaySecret"}]
