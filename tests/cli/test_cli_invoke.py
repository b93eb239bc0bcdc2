"""`outbox invoke`: a function of template.yaml run in process, as
`sam local invoke` would run it in a container."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result

import outbox
from outbox_cli.cli import cli
from support import EMAIL, statuses

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A project folder: the fixture template.yaml, the real functions/ and
    layers/, plus the probe function. The current directory, so the default
    ./template.yaml is the one used."""
    shutil.copy(FIXTURES / "template.yaml", tmp_path / "template.yaml")
    functions = tmp_path / "functions"
    functions.mkdir()
    for role in ("dispatcher", "reaper", "email"):
        (functions / role).symlink_to(REPO / "functions" / role)
    shutil.copytree(FIXTURES / "functions" / "probe", functions / "probe")
    (tmp_path / "layers").symlink_to(REPO / "layers")
    monkeypatch.chdir(tmp_path)
    saved_env, saved_path = dict(os.environ), list(sys.path)
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved_env)
    sys.path[:] = saved_path


def invoke(
    project: Path, *args: str, event: Any = None, env: dict[str, str | None] | None = None
) -> Result:
    """``outbox invoke *args``; ``env`` adds variables, and unsets those set to None."""
    if event is not None:
        (project / "event.json").write_text(json.dumps(event))
    return CliRunner().invoke(cli, ["invoke", *args], env=env)


def test_probe_gets_handler_env_context_and_its_folder_first(project: Path) -> None:
    (project / "env.json").write_text(
        json.dumps(
            {
                "ProbeFunction": {"PROBE_FROM_ENV_FILE": "from-file"},
                "Parameters": {"MAX_ATTEMPTS": "9"},
            }
        )
    )
    result = invoke(
        project,
        "ProbeFunction",
        "event.json",
        "--env-vars",
        "env.json",
        event={"hello": "world"},
        # DATABASE_URL unset: the note below is about the template's parameter,
        # whatever the shell running the tests has (`DATABASE_URL=... make test`).
        env={"LEASE_SECONDS": "300", "DATABASE_URL": None},
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["event"] == {"hello": "world"}
    assert out["helper"] == "probe-helper"
    assert out["first_on_path"] == str((project / "functions" / "probe").resolve())
    assert out["env"] == {
        "PROBE_LITERAL": "literal",
        "PROBE_FLAG": "true",
        "PROBE_FROM_ENV_FILE": "from-file",  # the function's section of --env-vars
        "MAX_ATTEMPTS": "9",  # Parameters of --env-vars, over the template's !Ref
        "LEASE_SECONDS": "300",  # the shell, over the template's literal
    }
    # What nothing resolves is said, and left unset: a parameter without a
    # default, and a !GetAtt (it exists only in CloudFormation).
    assert "note: PROBE_UNRESOLVED left unset: Fn::GetAtt has no local value" in result.stderr
    assert (
        "note: DATABASE_URL left unset: parameter DatabaseUrl has no default "
        "(--parameter-overrides DatabaseUrl=...)" in result.stderr
    )
    assert out["lambda_env"] == {
        "AWS_LAMBDA_FUNCTION_NAME": "ProbeFunction",
        "AWS_LAMBDA_FUNCTION_TIMEOUT": "7",
    }
    assert out["function_name"] == "ProbeFunction" and out["memory"] == 512
    # The template's Timeout (7 s) is the deadline; read a moment after the call
    # began (a busy machine's moment can be long: the bound allows two seconds).
    assert 5000 < out["remaining_ms"] <= 7000
    assert len(out["request_id"]) == 36 and out["arn"].endswith(":function:ProbeFunction")


def test_function_found_by_its_function_name(project: Path) -> None:
    result = invoke(project, "outbox-probe", "event.json", "--json", event=[1, 2])
    assert result.exit_code == 0, result.output
    assert len(result.stdout.strip().splitlines()) == 1
    assert json.loads(result.stdout)["event"] == [1, 2]


def test_real_reaper_and_dispatcher_against_the_database(
    project: Path, engine: sa.Engine, database_url: str
) -> None:
    with engine.begin() as conn:
        outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 3)
    env_file = project / "env.json"
    env_file.write_text(json.dumps({"Parameters": {"DATABASE_URL": database_url}}))
    event = {"execution_id": "local-test"}
    reaper = invoke(project, "ReaperFunction", "event.json", "--env-vars", "env.json", event=event)
    assert reaper.exit_code == 0, reaper.output
    assert json.loads(reaper.stdout)["backlog"]["pending"] == 3
    # A dispatcher with no channel function map would fail every row it claims
    # as unroutable: it refuses to start instead, in one line, and claims nothing.
    env_file.write_text(
        json.dumps({"Parameters": {"DATABASE_URL": database_url, "CHANNEL_FUNCTIONS": "{}"}})
    )
    dispatcher = invoke(project, "DispatcherFunction", "event.json", "--env-vars", "env.json")
    assert dispatcher.exit_code == 1, dispatcher.output
    assert (
        dispatcher.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "Error: DispatcherFunction failed at init: ConfigError: configuration CHANNEL_FUNCTIONS"
        )
    )
    assert "Traceback" not in dispatcher.stderr
    assert json.loads(dispatcher.stdout)["errorType"] == "ConfigError"
    assert statuses(engine) == {"pending": 3}


def test_handler_exception_prints_traceback_and_error_document(project: Path) -> None:
    result = invoke(project, "ProbeFunction", "event.json", event={"explode": "kaboom"})
    assert result.exit_code == 1
    error = json.loads(result.stdout)
    assert error["errorType"] == "RuntimeError" and "kaboom" in error["errorMessage"]
    assert "Traceback" in result.stderr and "app.py" in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("Error: ProbeFunction raised RuntimeError")
    )


def test_handler_init_failure_names_the_setting(project: Path) -> None:
    (project / "env.json").write_text(json.dumps({"Parameters": {"DATABASE_URL": ""}}))
    result = invoke(
        project,
        "ReaperFunction",
        "event.json",
        "--env-vars",
        "env.json",
        event={},
        env={"DATABASE_URL": None},
    )
    assert result.exit_code == 1
    assert "DATABASE_URL" in result.stderr and "ConfigError" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["NoSuchFunction", "event.json"],
            "unknown function 'NoSuchFunction'; the template has: "
            "DispatcherFunction, EmailFunction, ProbeFunction, ReaperFunction, SlowFunction",
        ),
        (["ProbeFunction", "missing.json"], "cannot read event file missing.json"),
        (["ProbeFunction", "bad.json"], "event file bad.json is not valid JSON"),
        (
            ["ProbeFunction", "event.json", "--env-vars", "missing.json"],
            "cannot read env vars file",
        ),
        (
            ["ProbeFunction", "event.json", "--template", "nope.yaml"],
            "cannot read template nope.yaml",
        ),
        (["ProbeFunction", "event.json", "--template", "bad.yaml"], "has no Resources"),
    ],
)
def test_bad_arguments_name_the_problem(project: Path, args: list[str], fragment: str) -> None:
    (project / "bad.json").write_text("{oops")
    (project / "bad.yaml").write_text("just: a mapping\n")
    result = invoke(project, *args, event={})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert result.stdout == ""


def test_running_past_the_timeout_is_an_error(project: Path) -> None:
    result = invoke(project, "SlowFunction", "event.json", event={})
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {"remaining_ms": 0}  # the deadline passed
    assert "past its 1s Timeout" in result.stderr


def test_handlers_never_import_the_cli_or_dev_tools() -> None:
    """The Lambda import path stays lean: no click, rich, moto, yaml or pgserver."""
    code = (
        "import sys, runpy\n"
        "for role in ('dispatcher', 'reaper', 'email', 'migrate', 'feedback'):\n"
        f"    sys.path.insert(0, '{REPO}/functions/' + role)\n"
        f"    runpy.run_path('{REPO}/functions/' + role + '/app.py')\n"
        "    sys.path.pop(0)\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'click', 'rich', 'moto', 'yaml', 'pgserver', 'outbox_cli'})\n"
        "bad += [m for m in ('outbox.worker',) if m in sys.modules]\n"
        "print(bad)\n"
    )
    env = {
        **os.environ,
        "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
        "CHANNEL_FUNCTIONS": '{"email": "outbox-email"}',
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("sample", "status", "recorded"),
    [
        ("feedback-bounce", "bounced", "bounced"),
        ("feedback-complaint", "complained", "complained"),
        ("feedback-delivery", "delivered", "delivery_confirmed"),
        ("feedback-eventbridge-bounce", "bounced", "bounced"),
    ],
)
def test_the_feedback_samples_run_through_the_real_template(
    engine: sa.Engine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    sample: str,
    status: str,
    recorded: str,
) -> None:
    from outbox import feedback, store

    event_file = REPO / "events" / f"{sample}.json"
    (notification,) = feedback.notifications(json.loads(event_file.read_text()))
    provider_id = notification["mail"]["messageId"]
    with engine.begin() as conn:  # to the samples' recipient: feedback matches it
        mid = outbox.enqueue(conn, "email", {**EMAIL, "to": ["recipient@example.com"]})
    with engine.begin() as conn:
        (claim,) = store.claim(conn, 1, 60)
        store.settle(
            conn,
            [store.Settlement(mid, claim.claim_token, "delivered", None, provider_id)],
            store.Backoff(1, 60, 5),
        )
    saved_env, saved_path = dict(os.environ), list(sys.path)
    monkeypatch.chdir(REPO)
    try:
        result = CliRunner().invoke(
            cli,
            ["invoke", "FeedbackFunction", str(event_file), "--json"],
            # the template's DB_SSLMODE is verify-full; a local Postgres has no TLS
            env={"DATABASE_URL": database_url, "DB_SSLMODE": "disable"},
        )
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["recorded"] == {recorded: 1}
    assert statuses(engine) == {status: 1}


def test_a_long_invocation_says_it_is_still_running(project: Path) -> None:
    from outbox_cli import invoke as invoke_module

    template = invoke_module.load_template(project / "template.yaml")
    spec = invoke_module.function_spec(template, project, "SlowFunction", shell={})
    said: list[str] = []
    outcome = invoke_module.invoke(spec, {}, progress=said.append, progress_every=0.25)
    assert outcome.timed_out  # it sleeps 1.2 s on a 1 s Timeout
    assert len(said) >= 3
    assert all(
        line.startswith("SlowFunction still running: ") and line.endswith("s of its 1s Timeout")
        for line in said
    ), said


def test_each_invocation_starts_with_a_logger_free_of_earlier_keys(
    project: Path, engine: sa.Engine, database_url: str
) -> None:
    """As in a fresh Lambda environment: the correlation id one invocation set
    is not on the next function's log lines (here they share one logger)."""
    from outbox.observability import logger
    from outbox_cli import invoke as invoke_module

    (project / "env.json").write_text(json.dumps({"Parameters": {"DATABASE_URL": database_url}}))
    reaper = invoke(
        project,
        "ReaperFunction",
        "event.json",
        "--env-vars",
        "env.json",
        event={"execution_id": "x-1"},
    )
    assert reaper.exit_code == 0, reaper.output
    assert logger.get_current_keys().get("correlation_id") == "x-1"
    template = invoke_module.load_template(project / "template.yaml")
    probe = invoke_module.function_spec(template, project, "ProbeFunction", shell={})
    assert invoke_module.invoke(probe, {}).error is None
    assert "correlation_id" not in logger.get_current_keys()


def test_a_custom_resource_event_is_refused_before_anything_runs(server_url: str) -> None:
    """events/migrate.json is CloudFormation's request: its ResponseURL is
    CloudFormation's S3 bucket, which a local run cannot answer. One line says
    so and what to run instead, and the database is left alone."""
    import uuid

    from outbox_cli import devdb

    name = f"outbox_refused_{uuid.uuid4().hex[:8]}"
    url = devdb.recreate_database(server_url, name)
    try:
        result = CliRunner().invoke(
            cli,
            [
                "invoke",
                "MigrateFunction",
                str(REPO / "events" / "migrate.json"),
                "--template",
                str(REPO / "template.yaml"),
            ],
            env={"DATABASE_URL": url},
        )
        assert result.exit_code == 2  # refused before the banner: nothing was invoked
        assert "invoking" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.startswith("Error")]
        assert len(lines) == 1 and "custom-resource event" in lines[0], result.stderr
        assert "migrate-invoke.json" in lines[0] and "Traceback" not in result.output
        engine = sa.create_engine(url)
        assert sa.inspect(engine).get_table_names() == []  # nothing ran
        engine.dispose()
    finally:
        devdb.drop_database(server_url, name)
