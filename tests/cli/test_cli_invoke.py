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
    project: Path, *args: str, event: Any = None, env: dict[str, str] | None = None
) -> Result:
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
        env={"LEASE_SECONDS": "300"},
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
    assert "PROBE_UNRESOLVED" in result.stderr  # an intrinsic nothing resolved: said, left unset
    assert out["lambda_env"] == {
        "AWS_LAMBDA_FUNCTION_NAME": "ProbeFunction",
        "AWS_LAMBDA_FUNCTION_TIMEOUT": "7",
    }
    assert out["function_name"] == "ProbeFunction" and out["memory"] == 512
    assert 6000 < out["remaining_ms"] <= 7000  # the template's Timeout is the deadline
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
    # The dispatcher would hand off to Lambda: with no function for a channel
    # in CHANNEL_FUNCTIONS, its rows fail as unroutable (nothing leaves the machine).
    env_file.write_text(
        json.dumps({"Parameters": {"DATABASE_URL": database_url, "CHANNEL_FUNCTIONS": "{}"}})
    )
    # Not declared in the template: --env-vars ignores it (as SAM does), the
    # process environment reaches the handler as it is.
    dispatcher = invoke(
        project,
        "DispatcherFunction",
        "event.json",
        "--env-vars",
        "env.json",
        env={"DISPATCH_BUDGET_SECONDS": "0.3"},
    )
    assert dispatcher.exit_code == 0, dispatcher.output
    report = json.loads(dispatcher.stdout)
    assert report["claimed"] == 3 and report["unroutable"] == 3
    assert statuses(engine) == {"failed": 3}


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
        env={"DATABASE_URL": None},  # type: ignore[dict-item]
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
        "for role in ('dispatcher', 'reaper', 'email', 'migrate'):\n"
        f"    sys.path.insert(0, '{REPO}/functions/' + role)\n"
        f"    runpy.run_path('{REPO}/functions/' + role + '/app.py')\n"
        "    sys.path.pop(0)\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'click', 'rich', 'moto', 'yaml', 'pgserver', 'outbox_cli'})\n"
        "bad += [m for m in ('outbox.worker',) if m in sys.modules]\n"
        "print(bad)\n"
    )
    env = {**os.environ, "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
