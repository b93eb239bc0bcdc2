"""`outbox invoke` against the real template.yaml and the shipped env.local.json,
as a newcomer runs it: a local Postgres over loopback, AWS through a moto
server on 127.0.0.1. Every function of the template must run without a
warning; a channel function must deliver a live claim; overrides and the env
file must take precedence the way `sam local invoke` gives it."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

import outbox
from outbox import store
from outbox_cli import invoke
from outbox_cli.cli import cli
from support import EMAIL, statuses

REPO = Path(__file__).resolve().parents[2]
SENDER = "relay@example.com"  # EMAIL's sender: a verified identity in moto


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def newcomer(
    database_url: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """The repository as the current directory and the shell a newcomer has:
    DATABASE_URL (plain postgresql://, loopback, no TLS) and the moto endpoint.
    The process environment and sys.path are restored afterwards (invoke runs
    the handler in this process)."""
    monkeypatch.chdir(REPO)
    saved_env, saved_path = dict(os.environ), list(sys.path)
    shell = {
        "DATABASE_URL": database_url.replace("postgresql+pg8000://", "postgresql://"),
        "AWS_ENDPOINT_URL": moto_endpoint,
    }
    os.environ.update(shell)
    for name in ("CHANNEL_FUNCTIONS", "DISPATCH_BUDGET_SECONDS", "LEASE_SECONDS"):
        os.environ.pop(name, None)
    yield shell
    os.environ.clear()
    os.environ.update(saved_env)
    sys.path[:] = saved_path
    # The invoked functions' engines (a Lambda keeps its own until it is recycled).
    for name, module in list(sys.modules.items()):
        engine = getattr(getattr(module, "runtime", None), "_engine", None)
        if name.startswith("outbox_fn_") and engine is not None:
            engine.dispose()


def run(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(cli, ["invoke", *args], input=stdin)


def verified_sender(endpoint: str) -> None:
    import boto3
    from botocore.exceptions import ClientError

    try:
        boto3.client("sesv2", endpoint_url=endpoint).create_email_identity(EmailIdentity=SENDER)
    except ClientError as exc:  # the module's moto server already has it
        assert exc.response["Error"]["Code"] == "AlreadyExistsException"


def lambda_function(endpoint: str, name: str) -> None:
    """A function of that name in moto's Lambda, so an async invoke of it is accepted."""
    import boto3
    from botocore.exceptions import ClientError

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("app.py", "def handler(event, context):\n    return event\n")
    role = f"arn:aws:iam::123456789012:role/role-{name}"
    try:
        boto3.client("iam", endpoint_url=endpoint).create_role(
            RoleName=f"role-{name}", AssumeRolePolicyDocument="{}"
        )
    except ClientError as exc:
        assert exc.response["Error"]["Code"] == "EntityAlreadyExists"
    try:
        boto3.client("lambda", endpoint_url=endpoint).create_function(
            FunctionName=name,
            Runtime="python3.12",
            Role=role,
            Handler="app.handler",
            Code={"ZipFile": buffer.getvalue()},
        )
    except ClientError as exc:
        assert exc.response["Error"]["Code"] == "ResourceConflictException"


def template() -> dict[str, Any]:
    return invoke.load_template(REPO / "template.yaml")


def event_file(logical_id: str) -> str:
    """The function's sample event: events/<its folder>.json (the migrate
    function's plain invoke: its custom-resource event answers to S3; the
    feedback function's: an SES bounce through SNS)."""
    folder = Path(template()["Resources"][logical_id]["Properties"]["CodeUri"]).name
    special = {"migrate": "migrate-invoke", "feedback": "feedback-bounce"}
    return f"events/{special.get(folder, folder)}.json"


def quiet(result: Result) -> None:
    """No note about an unresolved value, no Python warning, no traceback."""
    assert "note:" not in result.stderr, result.stderr
    assert "Warning:" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_every_function_of_the_template_runs_with_the_shipped_env_file(
    newcomer: dict[str, str], engine: sa.Engine
) -> None:
    functions = invoke.function_names(template())
    assert {"DispatcherFunction", "ReaperFunction", "MigrateFunction", "EmailFunction"} <= set(
        functions
    )
    endpoint = newcomer["AWS_ENDPOINT_URL"]
    # The template's CHANNEL_FUNCTIONS resolves as `sam local` resolves it: each
    # channel to its function's logical id. A function of that name in moto's
    # Lambda takes the dispatcher's hand-off.
    lambda_function(endpoint, "EmailFunction")
    with engine.begin() as conn:
        (message_id,) = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}])

    results: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ["MigrateFunction", "ReaperFunction", "DispatcherFunction"]
        for name in [*first, *(f for f in functions if f not in first)]:
            result = run(name, event_file(name), "--env-vars", "env.local.json", "--json")
            assert result.exit_code == 0, (name, result.output)
            quiet(result)
            assert result.stderr.startswith(f"invoking {name} (app.handler, Timeout ")
            results[name] = json.loads(result.stdout)
            if results[name].get("unknown"):  # a sample event's placeholder claims
                assert "no such claim for id(s) 1: " in result.stderr
                assert f"`outbox invoke {name} --claim N`" in result.stderr
    assert [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        # (a library's deprecations and the interpreter's resource hygiene aside)
        if not issubclass(w.category, DeprecationWarning | ResourceWarning)
    ] == []

    with engine.connect() as conn:
        head = conn.execute(sa.text("SELECT version_num FROM outbox_alembic_version")).scalar_one()
    assert results["MigrateFunction"] == {"revision": head}
    assert results["ReaperFunction"]["backlog"]["pending"] == 1
    # One pass (env.local.json sets DISPATCH_BUDGET_SECONDS=0), handed to "EmailFunction".
    dispatched = results["DispatcherFunction"]
    assert (dispatched["claimed"], dispatched["handed_off"], dispatched["batches"]) == (1, 1, 1)
    with engine.connect() as conn:
        assert store.statuses_of(conn, [message_id]) == {message_id: "claimed"}
    # The sample events carry placeholder claim tokens: they reach the
    # function, which finds nothing it owns and sends nothing, and says the
    # claim was never live (id 1 is an email, claimed under a real token).
    for name in ("EmailFunction", "SmsFunction", "PushFunction", "WebhookFunction"):
        assert results[name] == {
            "received": 1,
            "owned": 0,
            "lease_lost": [],
            "duplicates": [],
            "unknown": [1],
            "statuses": {},
        }
    for name in ("EventBridgeFunction", "SqsFunction"):
        assert results[name]["owned"] == 0 and results[name]["statuses"] == {}
    # The sample bounce names an SES message id no email of this database has.
    assert results["FeedbackFunction"]["unmatched"] == 1


def test_a_live_claim_is_delivered_with_the_templates_sender_timeout(
    newcomer: dict[str, str], engine: sa.Engine, tmp_path: Path
) -> None:
    """The channel functions' `Timeout: !Ref SenderTimeoutSeconds` must resolve
    (30 s): with Lambda's 3 s default and the 3 s settle margin every row of a
    live claim was left "deadline near: not started"."""
    verified_sender(newcomer["AWS_ENDPOINT_URL"])
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 2)
        claims = store.claim(conn, 10, 120, ["email"])
    event = {
        "version": 1,
        "channel": "email",
        "messages": [
            {"id": c.id, "claim_token": str(c.claim_token), "attempt": c.attempt} for c in claims
        ],
    }
    (tmp_path / "live.json").write_text(json.dumps(event))
    result = run("EmailFunction", str(tmp_path / "live.json"), "--env-vars", "env.local.json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["statuses"] == {"delivered": 2}
    assert statuses(engine) == {"delivered": len(ids)}


def test_invoke_claim_hands_a_live_claim_to_the_channel_function(
    newcomer: dict[str, str], engine: sa.Engine
) -> None:
    verified_sender(newcomer["AWS_ENDPOINT_URL"])
    with engine.begin() as conn:
        emails = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 3)
        (sms,) = outbox.enqueue_many(
            conn, [{"channel": "sms", "payload": {"to": "+15555550100", "message": "hi"}}]
        )
    result = run("EmailFunction", "--claim", "2", "--env-vars", "env.local.json")
    assert result.exit_code == 0, result.output
    quiet(result)
    assert json.loads(result.stdout) == {
        "received": 2,
        "owned": 2,
        "lease_lost": [],
        "duplicates": [],
        "unknown": [],
        "statuses": {"delivered": 2},
    }
    assert "claimed 2 email message(s)" in result.stderr
    with engine.connect() as conn:
        final = store.statuses_of(conn, [*emails, sms])
    assert sorted(final.values()) == ["delivered", "delivered", "pending", "pending"]
    assert final[sms] == "pending"  # only the function's own channel is claimed

    again = run("EmailFunction", "--claim", "10", "--env-vars", "env.local.json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["statuses"] == {"delivered": 1}
    assert statuses(engine) == {"delivered": 3, "pending": 1}


def test_invoke_claim_with_nothing_due_says_so_and_changes_nothing(
    newcomer: dict[str, str], engine: sa.Engine
) -> None:
    result = run("SmsFunction", "--claim", "5", "--env-vars", "env.local.json")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: --claim: no due pending sms message to claim"
    )
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["ReaperFunction", "--claim", "1"],
            "--claim: ReaperFunction is not a channel function",
        ),
        (["EmailFunction"], "give either EVENT_FILE or --claim N"),
        (["EmailFunction", "events/email.json", "--claim", "1"], "give either EVENT_FILE"),
        (
            ["ReaperFunction", "events/reaper.json", "--parameter-overrides", "NoSuch=1"],
            "the template has no parameter NoSuch",
        ),
        (
            ["ReaperFunction", "events/reaper.json", "--parameter-overrides", "oops"],
            "'oops' is not Key=Value",
        ),
    ],
)
def test_bad_invoke_arguments_are_one_line_and_run_nothing(
    newcomer: dict[str, str], engine: sa.Engine, args: list[str], message: str
) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert result.stdout == ""


def test_a_dispatcher_without_a_channel_function_map_refuses_to_start(
    newcomer: dict[str, str], engine: sa.Engine, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 2)
    env = json.loads((REPO / "env.local.json").read_text())
    env["DispatcherFunction"]["CHANNEL_FUNCTIONS"] = ""
    (tmp_path / "env.json").write_text(json.dumps(env))
    result = run(
        "DispatcherFunction", "events/dispatcher.json", "--env-vars", str(tmp_path / "env.json")
    )
    assert result.exit_code == 1
    assert "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "Error: DispatcherFunction failed at init: ConfigError: configuration CHANNEL_FUNCTIONS: "
            "is empty"
        )
    )
    assert statuses(engine) == {"pending": 2}  # nothing claimed, nothing failed


def test_a_database_that_refuses_the_session_is_one_line(
    newcomer: dict[str, str], engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Asked for TLS on purpose (the shell wins over the loopback default): the
    # local Postgres has none.
    monkeypatch.setenv("DB_SSLMODE", "verify-full")
    result = run("ReaperFunction", "events/reaper.json", "--env-vars", "env.local.json")
    assert result.exit_code == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: ReaperFunction raised InterfaceError: the database refused the connection: "
        "Server refuses SSL (a local Postgres has no TLS: DB_SSLMODE=disable)"
    )
    error = json.loads(result.stdout)
    assert error["errorType"] == "InterfaceError" and error["stackTrace"] == []


# --- resolution and precedence, without running anything --------------------------


def spec(
    name: str,
    env_vars: dict[str, Any] | None = None,
    shell: dict[str, str] | None = None,
    overrides: list[str] | None = None,
) -> invoke.FunctionSpec:
    return invoke.function_spec(
        template(),
        REPO,
        name,
        env_vars,
        shell or {},
        invoke.parse_parameter_overrides(overrides or []),
    )


def test_parameter_defaults_and_intrinsics_resolve_as_sam_local_resolves_them() -> None:
    resolver = invoke.Resolver(template())
    assert None not in resolver.conditions.values(), resolver.conditions  # all decided
    assert resolver.conditions["UseSecretAuth"] and not resolver.conditions["UseIamAuth"]
    # A list parameter's Ref is a list: !Join ["", !Ref SqsQueueArns] on its "" default.
    assert resolver.conditions["HasSqsQueues"] is False
    assert resolver.resolve({"Fn::Select": [1, {"Fn::Split": [",", "a,b"]}]}) == "b"
    assert resolver.resolve({"Fn::Sub": "${AWS::StackName}-${AWS::AccountId}"}) == (
        "local-123456789012"
    )

    email = spec("EmailFunction")
    # Only a parameter without a default can leave a variable unresolved.
    assert set(email.unresolved) <= {"DB_SECRET_ARN"}, email.unresolved
    assert email.timeout_seconds == 30  # Globals: !Ref SenderTimeoutSeconds, its default
    assert email.memory_mb == 512
    env = email.environment
    defaults = {k: str(v.get("Default")) for k, v in template()["Parameters"].items()}
    assert env["MAX_ATTEMPTS"] == defaults["MaxAttempts"]
    assert env["LEASE_SECONDS"] == defaults["LeaseSeconds"]
    assert env["POLL_INTERVAL_SECONDS"] == "0.2" and env["DB_PORT"] == "5432"
    # With SesConfigurationSet empty the stack creates one; `sam local` resolves a
    # Ref to a resource as its logical id, and so does `outbox invoke`.
    assert env["SES_CONFIGURATION_SET"] == "SesConfigurationSetResource"
    assert env["SES_SUPPRESSION_CHECK"] == "false"
    assert env["DB_SSLMODE"] == "verify-full"  # no loopback DATABASE_URL in this shell
    assert "DB_IAM_USER" not in env  # !If [UseIamAuth, ..., !Ref AWS::NoValue]
    assert email.layer_dirs == [REPO / "layers" / "outbox"]

    dispatcher = spec("DispatcherFunction")
    assert dispatcher.timeout_seconds == 60  # its own Timeout beats the Globals one
    assert json.loads(dispatcher.environment["CHANNEL_FUNCTIONS"]) == {
        "email": "EmailFunction",
        "sms": "SmsFunction",
        "push": "PushFunction",
        "webhook": "WebhookFunction",
        "eventbridge": "EventBridgeFunction",
        "sqs": "SqsFunction",
    }
    assert spec("MigrateFunction").timeout_seconds == 300
    assert invoke.channel_of(template(), "SqsFunction") == "sqs"
    assert invoke.channel_of(template(), "ReaperFunction") is None


def test_parameter_overrides_then_shell_then_env_file_in_sams_order() -> None:
    overrides = [
        "SenderTimeoutSeconds=45 MaxAttempts=9 DatabaseAuth=iam",
        "ParameterKey=DatabaseIamUser,ParameterValue=relay "
        "'ParameterKey=SesConfigurationSet,ParameterValue=set one'",
    ]
    email = spec("EmailFunction", overrides=overrides)
    assert email.timeout_seconds == 45
    assert email.environment["MAX_ATTEMPTS"] == "9"
    assert email.environment["SES_CONFIGURATION_SET"] == "set one"
    # The condition follows the parameter: IAM auth sets the user, drops the secret.
    assert email.environment["DB_IAM_USER"] == "relay"
    assert "DB_SECRET_ARN" not in email.environment and email.unresolved == {}

    env_vars = {
        "Parameters": {"MAX_ATTEMPTS": 7, "BATCH_SIZE": "10", "LEASE_SECONDS": "200"},
        "EmailFunction": {"BATCH_SIZE": "20", "SES_SUPPRESSION_CHECK": True},
        "NotDeclaredAnywhere": {"X": "1"},
    }
    shell = {"MAX_ATTEMPTS": "8", "RETENTION_DAYS": "3", "DATABASE_URL": "postgresql://a@b/c"}
    email = spec("EmailFunction", env_vars, shell, overrides)
    env = email.environment
    assert env["MAX_ATTEMPTS"] == "7"  # env file over shell over template
    assert env["RETENTION_DAYS"] == "3"  # shell over template
    assert env["BATCH_SIZE"] == "20"  # the function's section over Parameters
    assert env["SES_SUPPRESSION_CHECK"] == "true"  # stringified as SAM does
    assert env["LEASE_SECONDS"] == "200"
    assert "DATABASE_URL" not in env  # not declared by the template: never from the file
    assert (
        email.sources["MAX_ATTEMPTS"] == "env-vars" and email.sources["RETENTION_DAYS"] == "shell"
    )
    assert email.ignored_env_sections == ["NotDeclaredAnywhere"]  # said, as a likely typo
    reaper = spec("ReaperFunction", env_vars, shell, overrides)
    assert reaper.environment["BATCH_SIZE"] == "10"  # EmailFunction's section is its own


@pytest.mark.parametrize(
    ("shell", "sslmode"),
    [
        ({"DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/db"}, "disable"),
        ({"DATABASE_URL": "postgresql://postgres@localhost/db"}, "disable"),
        ({"DATABASE_URL": "postgresql://postgres@[::1]:5432/db"}, "disable"),
        ({"DATABASE_URL": "postgresql://postgres@/db?unix_sock=/tmp/.s.PGSQL.5432"}, "disable"),
        ({"DATABASE_URL": "postgresql://app@db.example.com/db"}, "verify-full"),
        ({}, "verify-full"),
        (
            {"DATABASE_URL": "postgresql://postgres@127.0.0.1/db", "DB_SSLMODE": "verify-full"},
            "verify-full",
        ),
    ],
)
def test_tls_is_off_by_default_only_for_a_database_on_this_machine(
    shell: dict[str, str], sslmode: str
) -> None:
    assert spec("ReaperFunction", shell=shell).environment["DB_SSLMODE"] == sslmode


def test_the_shipped_env_file_names_only_what_the_template_declares() -> None:
    """env.local.json stays in step with template.yaml: SAM ignores a variable
    the function does not declare, so a stale one would do nothing, silently."""
    env = json.loads((REPO / "env.local.json").read_text())
    declared = {
        name: set(spec(name).environment) | set(spec(name).unresolved)
        for name in env
        if name != "Parameters"
    }
    every_function = set().union(
        *(
            set(spec(f).environment) | set(spec(f).unresolved)
            for f in invoke.function_names(template())
        )
    )
    assert set(env["Parameters"]) <= every_function
    for function, variables in declared.items():
        assert set(env[function]) <= variables, function
