"""Every function under its own role, with IAM enforced.

The SAM-translated template's roles are made in a moto server on loopback
(tests/iam_world.py names each call's resource as IAM does); each function
runs as `outbox invoke` runs it, in a process of its own (a cold start: no
client, secret or limit cached from another run), with the credentials of
its role assumed through STS, on its real paths: the dispatcher with work
due (a hand-off, its successor) and with work later (its wake schedule moved,
the reaper woken), every channel function with a live claim, the reaper with
an outcome event waiting, the feedback function and migrate.

Both directions: nothing is refused, and with any one statement of a role
removed some path of that function fails and the refusal names the
statement's action (every permission is needed). docs/how-to/deploy.md lists
what this cannot check."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from iam_world import (
    ACCOUNT,
    REGION,
    STACK,
    Authorizer,
    Resolver,
    Role,
    function_roles,
    relay_secret,
    repo_root,
    translated,
)
from pgcluster import cluster

from support import EMAIL

REPO = repo_root()
SENDER = EMAIL["from"]
DB_PASSWORD = "iam-harness-pw"
BUS = "orders"
OUTCOME_BUS = "outcomes"
QUEUE = "relay-target"
WAKE_SCHEDULE = f"{STACK}-dispatcher-wake"
FAR_AHEAD = "at(2099-12-31T23:59:59)"  # the template's WakeSchedule, as deployed
TOPIC = "orders-topic"
# Statements moto cannot put to the test, by Sid (docs/how-to/deploy.md).
UNCHECKABLE = {
    "ReadSesSendRate": "moto has no SES v2 GetAccount: the call is answered 404 before any"
    " authorization (the relay then learns the rate from throttling answers)",
}


class Receiver(BaseHTTPRequestHandler):
    """A webhook receiver on loopback that takes every delivery."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Stack:
    """The moto account the stack was "deployed" to, and how to run a function in it."""

    endpoint: str
    authorizer: Authorizer
    roles: dict[str, Role]
    parameters: dict[str, str]
    webhook_url: str
    push_endpoint: str
    engine: sa.Engine
    env_file: Path
    credentials: dict[str, dict[str, str]] = field(default_factory=dict)
    arn: dict[str, str] = field(default_factory=dict)  # what the harness made, by name

    def client(self, service: str) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id="admin",
            aws_secret_access_key="admin",
        )

    def apply(self, role: Role) -> None:
        """Make the role in moto hold exactly ``role``'s policies."""
        iam = self.client("iam")
        for name in iam.list_role_policies(RoleName=role.name)["PolicyNames"]:
            iam.delete_role_policy(RoleName=role.name, PolicyName=name)
        for name, document in role.policies.items():
            # IAM takes a document without a Version as 2008-10-17; moto
            # insists on one (SAM writes none for a function's inline policy).
            document = {"Version": "2012-10-17", **document}
            iam.put_role_policy(
                RoleName=role.name, PolicyName=name, PolicyDocument=json.dumps(document)
            )

    def invoke(self, function: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`outbox invoke FUNCTION ...` in a process of its own, as the function's role."""
        creds = self.credentials[function]
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", "/tmp"),
            "AWS_ACCESS_KEY_ID": creds["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
            "AWS_SESSION_TOKEN": creds["SessionToken"],
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            # No call may leave this machine: anything not sent to the moto
            # endpoint would meet a proxy that is not there.
            "HTTPS_PROXY": "http://127.0.0.1:9",
            "HTTP_PROXY": "http://127.0.0.1:9",
            "NO_PROXY": "127.0.0.1,localhost",
            "WEBHOOK_ALLOW_INSECURE": "true",  # the receiver is on loopback
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        overrides = " ".join(f"{k}={v}" for k, v in self.parameters.items())
        command = [sys.executable, "-m", "outbox_cli", "invoke", function, *args]
        command += ["--parameter-overrides", overrides, "--env-vars", str(self.env_file), "--json"]
        return subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from moto.core.config import default_user_config
    from moto.server import ThreadedMotoServer

    from outbox import migrate
    from outbox.db import create_engine
    from outbox.relay_settings import DatabaseSettings
    from outbox_cli import devdb, invoke

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    saved_lambda = dict(default_user_config["lambda"])
    default_user_config["lambda"]["use_docker"] = False  # an invoke is accepted, not run
    with contextlib.ExitStack() as cleanup:
        # A database as a deployed stack has one: TLS, verified against the
        # CA bundle the template names, and a password read from the secret.
        pg = cleanup.enter_context(cluster(DB_PASSWORD, tls=True))
        url = devdb.recreate_database(devdb.pg8000_url(pg.url(password=DB_PASSWORD)), "relay")
        engine = create_engine(DatabaseSettings(url=url, sslmode="disable"))
        cleanup.callback(engine.dispose)
        migrate.upgrade(engine)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        cleanup.callback(server.stop)
        authorizer = Authorizer()
        cleanup.callback(authorizer.install())
        cleanup.callback(default_user_config["lambda"].update, saved_lambda)
        receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
        threading.Thread(target=receiver.serve_forever, daemon=True).start()
        cleanup.callback(receiver.shutdown)
        host, port = server.get_host_and_port()
        world = Stack(
            endpoint=f"http://{host}:{port}",
            authorizer=authorizer,
            roles={},
            parameters={},
            webhook_url=f"http://127.0.0.1:{receiver.server_address[1]}/hooks",
            push_endpoint="",
            engine=engine,
            env_file=tmp_path_factory.mktemp("iam") / "env.json",
        )
        assert pg.ca is not None
        deploy(world, url, pg.port, pg.ca.ca_file, invoke)
        yield world


def deploy(world: Stack, database_url: str, port: int, ca_file: Path, invoke: Any) -> None:
    """What `sam deploy` and the operator would have made: the resources the
    policies name, the functions, and each function's role from the template."""
    secrets = world.client("secretsmanager")
    arn = {
        name: secrets.create_secret(Name=name, SecretString=value)["ARN"]
        for name, value in {
            "relay-db": relay_secret(database_url, DB_PASSWORD),
            "migrator-db": relay_secret(database_url, DB_PASSWORD),
            "webhook-default": "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "webhook-tenant": "whsec_" + "QWxhZGRpbjpvcGVuIHNlc2FtZSB0aGlz",
        }.items()
    }
    sesv2 = world.client("sesv2")
    sesv2.create_email_identity(EmailIdentity=SENDER)
    sesv2.create_configuration_set(ConfigurationSetName="SesConfigurationSetResource")
    sns = world.client("sns")
    application = sns.create_platform_application(
        Name="app", Platform="GCM", Attributes={"PlatformCredential": "key"}
    )["PlatformApplicationArn"]
    world.push_endpoint = sns.create_platform_endpoint(
        PlatformApplicationArn=application, Token="device-token"
    )["EndpointArn"]
    world.arn["topic"] = sns.create_topic(Name=TOPIC)["TopicArn"]
    sqs = world.client("sqs")
    sqs.create_queue(QueueName=QUEUE)
    events = world.client("events")
    for bus in (BUS, OUTCOME_BUS):
        events.create_event_bus(Name=bus)
    world.arn.update(arn)
    world.parameters = {
        "DatabaseSecretArn": arn["relay-db"],
        "MigrateDatabaseSecretArn": arn["migrator-db"],
        "DatabasePort": str(port),
        "DatabaseCaBundle": str(ca_file),
        "PacingMode": "sleep",
        "OutcomeEventBusName": OUTCOME_BUS,
        "SesIdentity": SENDER,
        "WebhookDefaultSecretArn": arn["webhook-default"],
        "WebhookSecretArns": arn["webhook-tenant"],
        "EventBusName": BUS,
        "SqsQueueArns": f"arn:aws:sqs:{REGION}:{ACCOUNT}:{QUEUE}",
    }
    world.env_file.write_text(
        json.dumps(
            {
                # One row a claim and no time to linger: the claim is full,
                # so the run ends with work left and starts its successor.
                "DispatcherFunction": {"DISPATCH_BUDGET_SECONDS": "0", "BATCH_SIZE": "1"},
            }
        )
    )

    template = invoke.load_template(REPO / "template.yaml")
    conditions = invoke.Resolver(template, world.parameters, REGION).conditions
    cfn = translated(template, world.parameters)
    resources = cfn["Resources"]
    functions = [k for k, v in resources.items() if v["Type"] == "AWS::Lambda::Function"]
    lambda_arn = {f: f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{f}" for f in functions}
    refs = {name: name for name in resources}  # `sam local`'s Ref: the logical id
    refs.update(
        {
            name: f"arn:aws:iam::{ACCOUNT}:policy/{name}"
            for name, r in resources.items()
            if r["Type"] == "AWS::IAM::ManagedPolicy"
        }
    )
    arns = {
        **lambda_arn,
        "WakeScheduleRole": f"arn:aws:iam::{ACCOUNT}:role/WakeScheduleRole",
        "FailureQueue": f"arn:aws:sqs:{REGION}:{ACCOUNT}:FailureQueue",
        "ScheduleDeadLetterQueue": f"arn:aws:sqs:{REGION}:{ACCOUNT}:ScheduleDeadLetterQueue",
    }
    world.arn.update(arns)
    resolver = Resolver(
        invoke.Resolver(template, world.parameters, REGION).parameters, conditions, refs, arns
    )
    world.roles = function_roles(cfn, resolver)
    assert set(world.roles) == set(functions)

    iam = world.client("iam")
    iam.create_role(RoleName="WakeScheduleRole", AssumeRolePolicyDocument="{}")
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("app.py", "def handler(event, context):\n    return event\n")
    lam = world.client("lambda")
    sts = world.client("sts")
    for function, role in world.roles.items():
        made = iam.create_role(RoleName=role.name, AssumeRolePolicyDocument=json.dumps(role.trust))
        world.apply(role)
        lam.create_function(
            FunctionName=function,
            Runtime="python3.12",
            Role=made["Role"]["Arn"],
            Handler="app.handler",
            Code={"ZipFile": archive.getvalue()},
        )
        world.credentials[function] = sts.assume_role(
            RoleArn=made["Role"]["Arn"], RoleSessionName=function
        )["Credentials"]
    world.client("scheduler").create_schedule(
        Name=WAKE_SCHEDULE,
        ScheduleExpression=FAR_AHEAD,
        FlexibleTimeWindow={"Mode": "OFF"},
        Target={"Arn": lambda_arn["DispatcherFunction"], "RoleArn": arns["WakeScheduleRole"]},
    )


# --- the paths ----------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """A function's run: what is due first, its arguments, and what it must have done."""

    name: str
    function: str
    prepare: Callable[[Stack], list[str]]
    done: Callable[[Stack, dict[str, Any]], bool]


def _clear(world: Stack) -> None:
    with world.engine.begin() as conn:
        conn.execute(
            sa.text(
                "TRUNCATE outbox_attempt, outbox_message, outbox_outcome_event, outbox_dedupe, "
                "outbox_channel_pause, outbox_destination, outbox_cooldown RESTART IDENTITY"
            )
        )


def _enqueue(
    world: Stack, channel: str, payload: dict[str, Any], n: int = 1, delay: int = 0
) -> None:
    """Through the SQL door, as a producer writes (it checks the JSON's
    shape; the function checks the rest, here with loopback webhooks allowed)."""
    with world.engine.begin() as conn:
        for _ in range(n):
            conn.execute(
                sa.text(
                    "SELECT outbox_enqueue(channel => :channel, payload => CAST(:payload AS jsonb),"
                    " delay => make_interval(secs => :delay))"
                ),
                {"channel": channel, "payload": json.dumps(payload), "delay": delay},
            )


def _outcome_event_waiting(world: Stack) -> None:
    """A message that failed: its outcome event waits for the reaper."""
    from outcome_support import lease_ends, settle_all

    _enqueue(world, "email", EMAIL)
    settle_all(world.engine, "failed", "refused")
    lease_ends(world.engine)


def _channel(
    channel: str, payload: Callable[[Stack], dict[str, Any]]
) -> Callable[[Stack], list[str]]:
    def prepare(world: Stack) -> list[str]:
        _enqueue(world, channel, payload(world))
        return ["--claim", "1"]

    return prepare


def _delivered(world: Stack, result: dict[str, Any]) -> bool:
    return result.get("statuses") == {"delivered": 1}


def _hand_off(world: Stack) -> list[str]:
    _enqueue(world, "email", EMAIL, n=3)
    return ["events/dispatcher.json"]


def _later(world: Stack) -> list[str]:
    # The schedule as deployed: far ahead, so a run that moves it shows.
    world.client("scheduler").update_schedule(
        Name=WAKE_SCHEDULE,
        ScheduleExpression=FAR_AHEAD,
        FlexibleTimeWindow={"Mode": "OFF"},
        Target={"Arn": world.arn["DispatcherFunction"], "RoleArn": world.arn["WakeScheduleRole"]},
    )
    _outcome_event_waiting(world)
    _enqueue(world, "email", EMAIL, delay=3600)
    return ["events/dispatcher.json"]


def _schedule_moved(world: Stack, result: dict[str, Any]) -> bool:
    held = world.client("scheduler").get_schedule(Name=WAKE_SCHEDULE)["ScheduleExpression"]

    return bool(result.get("wake_at")) and held == result["wake_at"] and result["reaper_woken"]


def _reaper(world: Stack) -> list[str]:
    _outcome_event_waiting(world)
    return ["events/reaper.json"]


PATHS = [
    Route(
        "migrate",
        "MigrateFunction",
        lambda w: ["events/migrate-invoke.json"],
        lambda w, r: bool(r.get("revision")),
    ),
    Route(
        "hand-off and successor",
        "DispatcherFunction",
        _hand_off,
        lambda w, r: r.get("handed_off") == 1 and r.get("successor") is True,
    ),
    Route("wake schedule and reaper", "DispatcherFunction", _later, _schedule_moved),
    Route(
        "outcome events",
        "ReaperFunction",
        _reaper,
        lambda w, r: r.get("outcome_events", {}).get("published") == 1,
    ),
    Route(
        "feedback",
        "FeedbackFunction",
        lambda w: ["events/feedback-bounce.json"],
        lambda w, r: r.get("unmatched") == 1,
    ),
    Route("email", "EmailFunction", _channel("email", lambda w: EMAIL), _delivered),
    Route(
        "sms",
        "SmsFunction",
        _channel("sms", lambda w: {"to": "+15555550100", "message": "Your code is 1234"}),
        _delivered,
    ),
    Route(
        "push",
        "PushFunction",
        _channel("push", lambda w: {"endpoint_arn": w.push_endpoint, "body": "Shipped"}),
        _delivered,
    ),
    Route(
        "webhook",
        "WebhookFunction",
        _channel(
            "webhook",
            lambda w: {"url": w.webhook_url, "event_type": "order.shipped", "body": {"order": 7}},
        ),
        _delivered,
    ),
    Route(
        "eventbridge",
        "EventBridgeFunction",
        _channel(
            "eventbridge",
            lambda w: {"source": "shop.orders", "detail_type": "Shipped", "detail": {"order": 7}},
        ),
        _delivered,
    ),
    Route(
        "sqs",
        "SqsFunction",
        _channel(
            "sqs",
            lambda w: {
                "queue_url": f"https://sqs.{REGION}.amazonaws.com/{ACCOUNT}/{QUEUE}",
                "body": "7",
            },
        ),
        _delivered,
    ),
]


@dataclass
class Run:
    path: Route
    ok: bool
    result: dict[str, Any]
    refusals: list[Any]
    stderr: str
    stdout: str


def run(world: Stack, path: Route) -> Run:
    """The path from empty tables, its function's calls checked against its role."""
    _clear(world)
    args = path.prepare(world)
    world.authorizer.refusals.clear()
    world.authorizer.allowed.clear()
    world.authorizer.enforcing = True
    try:
        process = world.invoke(path.function, *args)
    finally:
        world.authorizer.enforcing = False
    try:
        result = json.loads(process.stdout) if process.returncode == 0 else {}
    except ValueError:
        result = {}
    ok = process.returncode == 0 and isinstance(result, dict) and path.done(world, result)
    return Run(path, ok, result, list(world.authorizer.refusals), process.stderr, process.stdout)


def actions(statement: dict[str, Any]) -> set[str]:
    action = statement["Action"]
    return set(action if isinstance(action, list) else [action])


# --- what a role must not do ------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """A call a function's role must be refused (a Deny's reason to be)."""

    name: str
    function: str
    call: Callable[[Stack, Callable[[str], Any]], Any]


PROBES = [
    Probe(
        "sms publishes to a topic",
        "SmsFunction",
        lambda w, client: client("sns").publish(TopicArn=w.arn["topic"], Message="x"),
    ),
    Probe(
        "sms publishes to a device",
        "SmsFunction",
        lambda w, client: client("sns").publish(TargetArn=w.push_endpoint, Message="x"),
    ),
] + [
    # The relay's user is not the migrator's (the migrator owns the tables).
    Probe(
        f"{f} reads the migrator's secret",
        f,
        lambda w, client: client("secretsmanager").get_secret_value(SecretId=w.arn["migrator-db"]),
    )
    for f in (
        "DispatcherFunction",
        "ReaperFunction",
        "EmailFunction",
        "SmsFunction",
        "PushFunction",
        "WebhookFunction",
        "EventBridgeFunction",
        "SqsFunction",
        "FeedbackFunction",
    )
]


def refused(world: Stack, probe: Probe) -> bool:
    """Whether the probe's call, as the function's role, is refused."""
    import boto3
    from botocore.exceptions import ClientError

    creds = world.credentials[probe.function]

    def client(service: str) -> Any:
        return boto3.client(
            service,
            endpoint_url=world.endpoint,
            region_name=REGION,
            aws_access_key_id=creds["AccessKeyId"],
            aws_secret_access_key=creds["SecretAccessKey"],
            aws_session_token=creds["SessionToken"],
        )

    world.authorizer.enforcing = True
    try:
        probe.call(world, client)
    except ClientError as exc:
        return exc.response["Error"]["Code"] in ("AccessDenied", "AccessDeniedException", "403")
    finally:
        world.authorizer.enforcing = False
    return False


def lambdas_own(policy: str) -> bool:
    """SAM's policy for a function's async failure destination: Lambda sends
    there with the role, the code never does."""
    return policy.endswith("EventInvokeConfigOnFailureSQSPolicy")


# --- the tests ------------------------------------------------------------------------


def test_every_function_runs_under_its_own_role_and_nothing_is_refused(stack: Stack) -> None:
    assert {p.function for p in PATHS} == set(stack.roles)  # every function has a path
    asked: set[str] = set()
    for path in PATHS:
        outcome = run(stack, path)
        assert outcome.refusals == [], (path.name, outcome.refusals, outcome.stderr[-4000:])
        assert outcome.ok, (path.name, outcome.stdout[-2000:], outcome.stderr[-4000:])
        asked |= {check.action for _, check in stack.authorizer.allowed}
    # Every action a role grants was asked for by some path (none is granted idly).
    granted = {
        a
        for role in stack.roles.values()
        for policy, _, s in role.statements()
        if s.get("Sid") not in UNCHECKABLE and not lambdas_own(policy) and s["Effect"] == "Allow"
        for a in actions(s)
    }
    assert granted <= asked, granted - asked
    # And what no role may do, none can.
    assert [p.name for p in PROBES if not refused(stack, p)] == []


def test_every_statement_of_every_role_is_needed(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """One statement removed at a time: an Allow's removal fails some path of
    that function on a refusal of the statement's action; a Deny's removal
    lets some probe's call through."""
    rows = []
    for function, role in stack.roles.items():
        paths = [p for p in PATHS if p.function == function]
        for policy, index, statement in role.statements():
            label = statement.get("Sid") or f"{policy}[{index}]"
            if label in UNCHECKABLE or lambdas_own(policy):
                reason = UNCHECKABLE.get(label, "Lambda's own use of the role (async failures)")
                rows.append((function, label, None, f"not checked: {reason}"))
                continue
            stack.apply(role.without(policy, index))
            try:
                if statement["Effect"] == "Deny":
                    let_through = [
                        p.name for p in PROBES if p.function == function and not refused(stack, p)
                    ]
                    rows.append((function, label, bool(let_through), ", ".join(let_through) or "-"))
                    continue
                runs = [run(stack, p) for p in paths]
            finally:
                stack.apply(role)
            failed = [r.path.name for r in runs if not r.ok]
            refused_actions = {f.action for r in runs for f in r.refusals}
            needed = bool(failed) and bool(refused_actions & actions(statement))
            rows.append((function, label, needed, ", ".join(failed) or "-"))
    with capsys.disabled():
        print("\nIAM, each statement of each role removed in turn:")
        print("  (needed: a path failed on its refusal, or a Deny's probe got through)")
        for function, label, needed, what in rows:
            verdict = {True: "needed", False: "NOT NEEDED", None: "-"}[needed]
            print(f"  {function:20} {label:34} {verdict:10} {what}")
    assert [r for r in rows if r[2] is False] == []
