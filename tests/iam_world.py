"""The stack's IAM, enforced: each function's role built from the
SAM-translated template in a moto server that checks every call against the
caller's policies (tests/template/test_iam_enforced.py).

moto checks an action against the caller's policies, but for most services
against the resource "*" only (it names the resource for SQS, IAM and STS),
so a statement scoped to an ARN would be refused and a wrong ARN would pass.
``Authorizer`` names the resource of each call the relay makes, as IAM does
(``REQUESTS``), and checks the ``iam:PassRole`` that Scheduler's
UpdateSchedule implies. Every refusal is recorded. What this cannot check is
listed in docs/how-to/deploy.md ("What the IAM test does not check").
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

REGION = "us-east-1"
ACCOUNT = "123456789012"
PARTITION = "aws"
STACK = "local"  # outbox invoke's AWS::StackName
NO_VALUE = object()


# --- the translated template, resolved --------------------------------------


def translated(template: Mapping[str, Any], parameters: Mapping[str, str]) -> dict[str, Any]:
    """The template as CloudFormation receives it from the SAM transform."""
    from samtranslator.translator.transform import transform

    class NoManagedPolicies:
        """The template names managed policies by ARN only."""

        def load(self) -> dict[str, str]:
            return {}

    packaged = copy.deepcopy(dict(template))
    for resource in packaged["Resources"].values():
        # What `sam package` does: the code is uploaded, the template names it.
        for uri in ("CodeUri", "ContentUri"):
            if uri in resource.get("Properties", {}):
                resource["Properties"][uri] = "s3://packaged/code.zip"
    return dict(transform(packaged, dict(parameters), NoManagedPolicies()))


@dataclass
class Resolver:
    """Ref, Fn::GetAtt, Fn::Sub, Fn::If, Fn::Join, Fn::Split over known values:
    parameters (and pseudo parameters), conditions, and each resource's
    physical id (``refs``) and ARN (``arns``)."""

    parameters: Mapping[str, Any]
    conditions: Mapping[str, bool | None]
    refs: Mapping[str, str]
    arns: Mapping[str, str]

    def ref(self, name: str) -> Any:
        pseudo = {
            "AWS::Region": REGION,
            "AWS::AccountId": ACCOUNT,
            "AWS::Partition": PARTITION,
            "AWS::StackName": STACK,
            "AWS::URLSuffix": "amazonaws.com",
            "AWS::NoValue": NO_VALUE,
        }
        if name in pseudo:
            return pseudo[name]
        if name in self.parameters:
            return self.parameters[name]
        if name in self.refs:
            return self.refs[name]
        raise KeyError(f"Ref {name}: no value in the IAM world")

    def get_att(self, name: str, attribute: str) -> str:
        if attribute != "Arn" or name not in self.arns:
            raise KeyError(f"Fn::GetAtt {name}.{attribute}: no value in the IAM world")
        return self.arns[name]

    def sub(self, text: str, variables: Mapping[str, Any]) -> str:
        def value(match: re.Match[str]) -> str:
            name = match.group(1)
            if name.startswith("!"):
                return "${" + name[1:] + "}"
            if name in variables:
                return str(self.resolve(variables[name]))
            if "." in name and not name.startswith("AWS::"):
                resource, attribute = name.split(".", 1)
                return self.get_att(resource, attribute)
            resolved = self.ref(name)
            return ",".join(resolved) if isinstance(resolved, list) else str(resolved)

        return re.sub(r"\$\{([^}]+)\}", value, text)

    def resolve(self, value: Any) -> Any:
        if isinstance(value, list):
            items = [self.resolve(v) for v in value]
            return [v for v in items if v is not NO_VALUE]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            ((key, arg),) = value.items()
            if key == "Ref":
                return self.ref(arg)
            if key == "Fn::GetAtt":
                name, attribute = arg.split(".", 1) if isinstance(arg, str) else arg
                return self.get_att(name, attribute)
            if key == "Fn::Sub":
                text, variables = (arg, {}) if isinstance(arg, str) else arg
                return self.sub(text, variables)
            if key == "Fn::If":
                condition, yes, no = arg
                chosen = self.conditions[condition]
                assert chosen is not None, f"condition {condition} undecided"
                return self.resolve(yes if chosen else no)
            if key == "Fn::Join":
                separator, items = arg
                return separator.join(str(v) for v in self.resolve(items))
            if key == "Fn::Split":
                separator, text = arg
                return str(self.resolve(text)).split(separator)
        items = {k: self.resolve(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not NO_VALUE}


@dataclass
class Role:
    """One function's role: its trust policy and its policies, resolved.
    ``policies``: name -> document (the managed ones by their logical id)."""

    name: str
    function: str
    trust: dict[str, Any]
    policies: dict[str, dict[str, Any]]
    managed_arns: list[str] = field(default_factory=list)  # AWS managed, attached as they are

    def statements(self) -> Iterator[tuple[str, int, dict[str, Any]]]:
        """(policy, index, statement) for every statement of the role."""
        for policy, document in self.policies.items():
            statement = document["Statement"]
            for i, s in enumerate(statement if isinstance(statement, list) else [statement]):
                yield policy, i, s

    def without(self, policy: str, index: int) -> Role:
        """This role with one statement removed."""
        policies = copy.deepcopy(self.policies)
        statements = policies[policy]["Statement"]
        if not isinstance(statements, list):
            statements = [statements]
        del statements[index]
        if statements:
            policies[policy]["Statement"] = statements
        else:
            del policies[policy]
        return Role(self.name, self.function, self.trust, policies, self.managed_arns)


def function_roles(cfn: Mapping[str, Any], resolver: Resolver) -> dict[str, Role]:
    """Each function's role (by the function's logical id), with the
    ``AWS::IAM::Policy`` resources that name it and the managed policies it
    attaches, resolved."""
    resources = cfn["Resources"]

    def present(logical_id: str) -> bool:
        condition = resources[logical_id].get("Condition")
        return condition is None or bool(resolver.conditions[condition])

    roles: dict[str, Role] = {}
    for logical_id, resource in resources.items():
        if resource["Type"] != "AWS::Lambda::Function" or not present(logical_id):
            continue
        role_ref = resource["Properties"]["Role"]
        role_id = role_ref["Fn::GetAtt"][0]
        properties = resolver.resolve(resources[role_id]["Properties"])
        policies = {p["PolicyName"]: p["PolicyDocument"] for p in properties.get("Policies", [])}
        managed: list[str] = []
        for arn in properties.get("ManagedPolicyArns", []):
            own = [k for k, v in resolver.refs.items() if v == arn and k in resources]
            if own:  # one of the stack's own managed policies
                policies[own[0]] = resolver.resolve(
                    resources[own[0]]["Properties"]["PolicyDocument"]
                )
            else:
                managed.append(arn)
        for other_id, other in resources.items():
            if other["Type"] == "AWS::IAM::Policy" and present(other_id):
                named = [r.get("Ref") for r in other["Properties"]["Roles"]]
                if role_id in named:
                    props = resolver.resolve(other["Properties"])
                    policies[props["PolicyName"]] = props["PolicyDocument"]
        roles[logical_id] = Role(
            f"{logical_id}Role",
            logical_id,
            properties["AssumeRolePolicyDocument"],
            policies,
            managed,
        )
    return roles


# --- what each call asks of IAM ----------------------------------------------


@dataclass(frozen=True)
class Check:
    """One authorization IAM makes for a call: an action on a resource, with
    the condition keys the call supplies."""

    action: str
    resource: str
    conditions: Mapping[str, str] = field(default_factory=dict)


def _arn(service: str, resource: str, region: str = REGION) -> str:
    return f"arn:{PARTITION}:{service}:{region}:{ACCOUNT}:{resource}"


def _json_body(response: Any) -> dict[str, Any]:
    body = response.body
    if isinstance(body, bytes):
        body = body.decode()
    try:
        parsed = json.loads(body or "{}")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _query(response: Any, name: str) -> str | None:
    """A parameter of a query-protocol call (SNS), or of the URL's query."""
    values = parse_qs(urlparse(response.uri).query).get(name)
    if values:
        return values[0]
    value = response.querystring.get(name)
    return value[0] if value else None


def _lambda_invoke(response: Any) -> list[Check]:
    match = re.search(r"/functions/([^/]+)/invocations", unquote(urlparse(response.uri).path))
    assert match, response.uri
    name = match.group(1)
    arn = name if name.startswith("arn:") else _arn("lambda", f"function:{name}")
    return [Check("lambda:InvokeFunction", arn)]


def _schedule(response: Any, operation: str) -> list[Check]:
    name = unquote(urlparse(response.uri).path).rsplit("/", 1)[-1]
    body = _json_body(response)
    group = body.get("GroupName") or _query(response, "groupName") or "default"
    checks = [Check(f"scheduler:{operation}", _arn("scheduler", f"schedule/{group}/{name}"))]
    role_arn = (body.get("Target") or {}).get("RoleArn")
    if operation in ("CreateSchedule", "UpdateSchedule") and role_arn:
        # IAM asks the caller for iam:PassRole on the target's role.
        checks.append(
            Check("iam:PassRole", role_arn, {"iam:PassedToService": "scheduler.amazonaws.com"})
        )
    return checks


def _secret(response: Any) -> list[Check]:
    secret_id = _json_body(response).get("SecretId", "")
    return [Check("secretsmanager:GetSecretValue", secret_id)]


def _send_email(response: Any) -> list[Check]:
    body = _json_body(response)
    sender = str(body.get("FromEmailAddress", ""))
    address = sender.rsplit("<", 1)[-1].rstrip(">").strip()
    checks = [Check("ses:SendEmail", _arn("ses", f"identity/{address}"))]
    if body.get("ConfigurationSetName"):
        checks.append(
            Check("ses:SendEmail", _arn("ses", f"configuration-set/{body['ConfigurationSetName']}"))
        )
    return checks


def _publish(response: Any) -> list[Check]:
    # A direct publish to a phone number has no resource: IAM asks for "*".
    target = _query(response, "TargetArn") or _query(response, "TopicArn") or "*"
    return [Check("sns:Publish", target)]


def _put_events(response: Any) -> list[Check]:
    checks = []
    for entry in _json_body(response).get("Entries", []):
        bus = entry.get("EventBusName") or "default"
        arn = bus if bus.startswith("arn:") else _arn("events", f"event-bus/{bus}")
        checks.append(Check("events:PutEvents", arn))
    return checks


def _send_message(response: Any) -> list[Check]:
    url = _json_body(response).get("QueueUrl") or _query(response, "QueueUrl") or ""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return [Check("sqs:SendMessage", _arn("sqs", name))]


# (signing name, operation) -> the checks IAM makes for it.
REQUESTS: dict[tuple[str, str], Callable[[Any], list[Check]]] = {
    ("lambda", "Invoke"): _lambda_invoke,
    ("scheduler", "GetSchedule"): lambda r: _schedule(r, "GetSchedule"),
    ("scheduler", "UpdateSchedule"): lambda r: _schedule(r, "UpdateSchedule"),
    ("secretsmanager", "GetSecretValue"): _secret,
    ("ses", "SendEmail"): _send_email,
    ("ses", "GetAccount"): lambda r: [Check("ses:GetAccount", "*")],
    ("sns", "Publish"): _publish,
    ("sns", "CheckIfPhoneNumberIsOptedOut"): lambda r: [
        Check("sns:CheckIfPhoneNumberIsOptedOut", "*")
    ],
    ("events", "PutEvents"): _put_events,
    ("sqs", "SendMessage"): _send_message,
}


@dataclass(frozen=True)
class Refusal:
    principal: str
    action: str
    resource: str


class Authorizer:
    """Installed over moto's check while ``enforcing``: a signed call by an
    assumed role is allowed when its policies allow every ``Check`` of it
    (an explicit Deny wins), else refused with AccessDenied and recorded."""

    def __init__(self) -> None:
        self.refusals: list[Refusal] = []
        self.allowed: list[tuple[str, Check]] = []
        self.enforcing = False

    def install(self) -> Callable[[], None]:
        from moto.core.authorization import ActionAuthenticatorMixin

        original = ActionAuthenticatorMixin._authenticate_and_authorize_normal_action
        authorizer = self

        def authorize(response: Any, resource: str = "*") -> None:
            if not authorizer.enforcing:
                return None
            return authorizer.check(response, resource)

        ActionAuthenticatorMixin._authenticate_and_authorize_normal_action = authorize  # type: ignore[method-assign]

        def uninstall() -> None:
            ActionAuthenticatorMixin._authenticate_and_authorize_normal_action = original  # type: ignore[method-assign]

        return uninstall

    def check(self, response: Any, resource: str) -> None:
        from moto.iam.access_control import IAMPolicy, IAMRequest, PermissionResult

        path = response.raw_path
        query = urlparse(response.uri).query
        request = IAMRequest(
            account_id=response.current_account,
            method=response.method,
            path=f"{path}?{query}" if query else path,
            # A GET has no body; moto would sign its query parameters as
            # one (and refuse every such call).
            data={} if response.method == "GET" else response.data,
            body=response.raw_body,
            headers=response.headers,
            action=response._get_action(),
        )
        request.check_signature()
        service, operation = request._action.split(":", 1)
        requested = REQUESTS.get((service, operation))
        checks = requested(response) if requested else [Check(request._action, resource)]
        principal = request._access_key.arn
        policies = request._access_key.collect_policies()
        for check in checks:
            results = [
                IAMPolicy(p).is_action_permitted(
                    check.action, check.resource, incoming_condition_values=dict(check.conditions)
                )
                for p in policies
            ]
            if PermissionResult.DENIED in results or PermissionResult.PERMITTED not in results:
                self.refusals.append(Refusal(principal, check.action, check.resource))
                request._raise_access_denied()
            self.allowed.append((principal, check))


def relay_secret(url: str, password: str) -> str:
    """An RDS-format database secret for ``url`` (a TCP address)."""
    import sqlalchemy as sa

    parsed = sa.make_url(url)
    return json.dumps(
        {
            "engine": "postgres",
            "host": parsed.host,
            "port": parsed.port or 5432,
            "username": parsed.username,
            "password": password,
            "dbname": parsed.database,
        }
    )


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
