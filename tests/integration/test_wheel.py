"""The distribution as a producer gets it: the wheel is built from this checkout,
installed bare into a fresh venv with SQLAlchemy and a driver only, and enqueues
into the real Postgres. Offline: the dependencies come from the wheels that
`make venv` keeps in .venv/wheelhouse."""

from __future__ import annotations

import email
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa

import outbox

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"

PRODUCER = """
import json, sys
import sqlalchemy as sa
import outbox

engine = sa.create_engine(sys.argv[1])
with engine.begin() as conn:
    ids = [
        outbox.enqueue(conn, "email", {"from": "shop@example.com", "to": ["ada@example.net"],
                                       "subject": "Shipped", "text": "On its way."},
                       dedupe_key="wheel-1"),
        outbox.enqueue(conn, "webhook", {"url": "https://hooks.example.com/a",
                                         "event_type": "order.shipped", "body": {"id": 1}}),
    ]
try:
    with engine.begin() as conn:
        outbox.enqueue(conn, "email", {"to": "not-a-list"})
    refused = None
except outbox.ValidationError as exc:
    refused = exc.field
heavy = {"aws_lambda_powertools", "boto3", "botocore", "alembic", "click", "rich", "outbox_cli"}
print(json.dumps({
    "ids": ids,
    "refused": refused,
    "version": outbox.__version__,
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in heavy),
}))
"""


def run(*args: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=240, **kwargs
    )  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not any(WHEELHOUSE.glob("click-*.whl")):
        pytest.fail(f"no dependency wheels in {WHEELHOUSE}: run `make venv`")
    dist = tmp_path_factory.mktemp("dist")
    built = run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, ROOT)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (found,) = dist.glob("outbox_relay-*.whl")
    return found


def fresh_venv(where: Path, *requirements: str | Path) -> Path:
    """A new venv with only ``requirements`` installed, from the wheelhouse."""
    assert run(sys.executable, "-m", "venv", "--without-pip", where).returncode == 0
    python = where / "bin" / "python"
    installed = run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "-q",
        "--no-index",
        "--find-links",
        WHEELHOUSE,
        *requirements,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    return python


@pytest.fixture(scope="module")
def producer_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fresh_venv(tmp_path_factory.mktemp("producer") / "venv", wheel, "pg8000")


def test_the_wheel_installs_bare_and_enqueues(
    producer_venv: Path, engine: sa.Engine, database_url: str
) -> None:
    listed = run(sys.executable, "-m", "pip", "--python", producer_venv, "list", "--format=json")
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert {"outbox-relay", "sqlalchemy", "fastjsonschema", "pg8000"} <= names
    assert not names & {"click", "rich", "alembic", "aws-lambda-powertools", "boto3", "botocore"}

    url = sa.engine.make_url(database_url).set(drivername="postgresql+pg8000")
    out = run(producer_venv, "-c", PRODUCER, url.render_as_string(hide_password=False))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["refused"] == "payload"
    assert result["version"] == outbox.__version__
    assert result["loaded"] == []
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, channel, status FROM outbox_message ORDER BY id")
        ).all()
    assert [tuple(r) for r in rows] == [
        (result["ids"][0], "email", "pending"),
        (result["ids"][1], "webhook", "pending"),
    ]


def test_the_metadata_publishes_the_users_extras_and_no_dev_tools(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(archive.read(name))
    assert sorted(metadata.get_all("Provides-Extra")) == ["cli", "lambda", "local", "worker"]
    required = " ".join(metadata.get_all("Requires-Dist"))
    assert "pytest" not in required and "mypy" not in required and "ruff" not in required
    classifiers = metadata.get_all("Classifier")
    assert "Programming Language :: Python :: 3.12" in classifiers
    assert "Typing :: Typed" in classifiers
    assert metadata["Requires-Python"] == ">=3.11"


def test_the_command_without_its_extra_says_what_to_install(producer_venv: Path) -> None:
    out = run(producer_venv.parent / "outbox", "--version")
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "Error: the outbox command needs click: pip install 'outbox-relay[cli]'"
    )


def test_the_cli_extra_is_enough_for_the_operator_commands(
    wheel: Path, tmp_path: Path, engine: sa.Engine, database_url: str
) -> None:
    """`pip install 'outbox-relay[cli]'`: the operator commands run, and the
    Lambda runtime's libraries are still absent."""
    python = fresh_venv(tmp_path / "venv", f"{wheel}[cli]")
    listed = run(sys.executable, "-m", "pip", "--python", python, "list", "--format=json")
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert {"click", "rich", "alembic", "pg8000"} <= names
    assert not names & {"aws-lambda-powertools", "boto3", "botocore"}
    outbox_command = python.parent / "outbox"
    assert (
        run(outbox_command, "--version").stdout.strip() == f"outbox, version {outbox.__version__}"
    )
    url = sa.engine.make_url(database_url).render_as_string(hide_password=False)
    migrated = run(outbox_command, "--database-url", url, "migrate", "--json")
    assert migrated.returncode == 0, migrated.stderr
    enqueued = run(
        outbox_command,
        "--database-url",
        url,
        "enqueue",
        "--channel",
        "sqs",
        "--payload",
        json.dumps(
            {"queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/q", "body": "x"}
        ),
        "--json",
    )
    assert enqueued.returncode == 0, enqueued.stderr
    status = run(outbox_command, "--database-url", url, "status", "--json")
    assert json.loads(status.stdout)["pending"] == 1

    # The commands of the other extras are listed, explain themselves, and
    # say in one line which extra they need instead of a traceback.
    listed_commands = run(outbox_command, "--help").stdout
    assert "worker" in listed_commands and "invoke" in listed_commands
    for command in ("worker", "invoke"):
        helped = run(outbox_command, command, "--help")
        assert helped.returncode == 0 and "Usage: outbox " + command in helped.stdout
    worker = run(outbox_command, "--database-url", url, "worker", "--once")
    assert (worker.returncode, worker.stdout, worker.stderr) == (
        1,
        "",
        "Error: outbox worker needs aws_lambda_powertools: pip install 'outbox-relay[worker]'\n",
    )
    invoked = run(outbox_command, "invoke", "EmailFunction", "events/email.json", cwd=ROOT)
    assert (invoked.returncode, invoked.stdout, invoked.stderr) == (
        1,
        "",
        "Error: outbox invoke needs yaml: pip install 'outbox-relay[local]'\n",
    )
    as_json = run(outbox_command, "worker", "--once", "--json")
    assert json.loads(as_json.stdout)["error"]["kind"] == "missing_extra"


def test_the_worker_extra_runs_the_worker(
    wheel: Path, tmp_path: Path, engine: sa.Engine, database_url: str
) -> None:
    """`pip install 'outbox-relay[worker]'`: `outbox worker` claims, reaps and
    stops, with no development library installed."""
    python = fresh_venv(tmp_path / "venv", f"{wheel}[worker]")
    listed = run(sys.executable, "-m", "pip", "--python", python, "list", "--format=json")
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert {"click", "alembic", "pg8000", "aws-lambda-powertools", "boto3"} <= names
    assert not names & {"moto", "pgserver", "aws-sam-translator", "pytest"}
    url = sa.engine.make_url(database_url).render_as_string(hide_password=False)
    worker = run(
        python.parent / "outbox",
        "--database-url",
        url,
        "worker",
        "--once",
        "--json",
        env={**os.environ, "POWERTOOLS_LOG_LEVEL": "WARNING"},
    )
    assert worker.returncode == 0, worker.stderr[-3000:]
    report = json.loads(worker.stdout[worker.stdout.index("{\n") :])  # after any log line
    assert report["batches"] == 1 and report["claimed"] == 0


WAKE_WITHOUT_BOTO3 = """
import sys
import sqlalchemy as sa
import outbox
from outbox import wake

engine = sa.create_engine(sys.argv[1])
for _ in range(3):
    with engine.begin() as conn:
        outbox.enqueue(conn, "email", {"from": "shop@example.com", "to": ["ada@example.net"],
                                       "subject": "Shipped", "text": "On its way."})
wake.current().close(timeout=60)  # let the thread report before the process ends
"""


def test_wake_on_enqueue_without_boto3_warns_once_and_enqueues(
    producer_venv: Path, engine: sa.Engine, database_url: str
) -> None:
    """OUTBOX_DISPATCHER_FUNCTION on a bare install: one warning naming what to
    install, and every enqueue commits. The opt-in SQL script ships in the package."""
    url = sa.engine.make_url(database_url).set(drivername="postgresql+pg8000")
    out = run(
        producer_venv,
        "-c",
        WAKE_WITHOUT_BOTO3,
        url.render_as_string(hide_password=False),
        env={**os.environ, "OUTBOX_DISPATCHER_FUNCTION": "outbox-DispatcherFunction"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("pip install boto3") == 1, out.stderr
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar() == 3
    located = run(
        producer_venv,
        "-c",
        "import outbox, pathlib; print((pathlib.Path(outbox.__file__).parent / 'sql' / "
        "'wake_on_enqueue.sql').is_file())",
    )
    assert located.stdout.strip() == "True", located.stderr
