"""The built artifact works on its own: after ``sam build``, each function's
handler is imported from the built layer and function folders alone, in a fresh
Python 3.12 process whose only other package is boto3 (what the Lambda runtime
provides), and invoked with its ``events/`` file.

The database is the test Postgres; AWS is a moto server on 127.0.0.1 reached
through ``AWS_ENDPOINT_URL`` with fake credentials. ``make sam-check`` builds
and runs this; without a build it is skipped.
"""

from __future__ import annotations

import http.server
import json
import os
import ssl
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from support import make_ca

pytestmark = pytest.mark.build

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / ".aws-sam" / "build"
LAYER = BUILD / "OutboxLayer" / "python"
RUNTIME_PYTHON = Path(
    os.environ.get("OUTBOX_RUNTIME_PYTHON", ROOT / ".tools" / "runtime312" / "bin" / "python")
)
EVENTS = ROOT / "events"
ACCOUNT, REGION = "123456789012", "us-east-1"
SENDER = "relay@example.com"

if not LAYER.is_dir():
    pytest.skip(
        "no sam build output in .aws-sam/build: run `make sam-check` (sam build, then this test)",
        allow_module_level=True,
    )
_SOURCES = [
    ROOT / "template.yaml",
    *ROOT.glob("layers/outbox/**/*.py"),
    *ROOT.glob("functions/*/*.py"),
]
if max(p.stat().st_mtime for p in _SOURCES) > (BUILD / "template.yaml").stat().st_mtime:
    pytest.skip(
        "the sam build in .aws-sam/build is older than the sources: run `make sam-check`",
        allow_module_level=True,
    )
if not RUNTIME_PYTHON.is_file():
    pytest.skip(
        f"no runtime Python at {RUNTIME_PYTHON}: `make sam-check` creates it (Python 3.12 + boto3)",
        allow_module_level=True,
    )

# Runs inside the runtime Python: import the handler (timed), call it with the
# event and a Lambda-like context, write what happened to a JSON file. It also
# reports every loaded module that came from the repository but not from the
# build, which must be none.
RUNNER = r"""
import json, os, socket, sys, time
event_path, out_path, build, root = sys.argv[1:5]
# Names the test's local servers stand in for (the real CloudFormation host).
loopback = set(filter(None, os.environ.get("TEST_RESOLVE_TO_LOOPBACK", "").split(",")))
if loopback:
    real_getaddrinfo = socket.getaddrinfo
    def getaddrinfo(host, *args, **kwargs):
        return real_getaddrinfo("127.0.0.1" if host in loopback else host, *args, **kwargs)
    socket.getaddrinfo = getaddrinfo
out = {}
try:
    started = time.perf_counter()
    import app
    out["import_seconds"] = time.perf_counter() - started

    class Context:
        function_name = "built-test"
        function_version = "$LATEST"
        invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:built-test"
        memory_limit_in_mb = 512
        aws_request_id = "00000000-0000-4000-8000-000000000000"
        log_group_name = "/aws/lambda/built-test"
        log_stream_name = "built-test"
        _deadline = time.monotonic() + 30

        def get_remaining_time_in_millis(self):
            return max(0, int((self._deadline - time.monotonic()) * 1000))

    with open(event_path) as f:
        event = json.load(f)
    out["result"] = app.handler(event, Context())
except BaseException as exc:
    out["error"] = type(exc).__name__
    out["message"] = str(exc)
import outbox, boto3
out["files"] = {"app": app.__file__ if "app" in sys.modules else None,
                "outbox": outbox.__file__, "boto3": boto3.__file__}
out["python"] = list(sys.version_info[:2])
out["strays"] = sorted(
    name for name, module in list(sys.modules.items())
    if (getattr(module, "__file__", None) or "").startswith(root)
    and not (module.__file__.startswith(build) or "/.tools/runtime312/" in module.__file__)
)
with open(out_path, "w") as f:
    json.dump(out, f, default=str)
"""


def _function_dirs() -> dict[str, Path]:
    """functions/<folder> -> its built directory, from the source template's CodeUri."""
    from cfnlint.decode import cfn_yaml

    template = cfn_yaml.load(str(ROOT / "template.yaml"))
    dirs = {}
    for name, resource in template["Resources"].items():
        if resource["Type"] == "AWS::Serverless::Function":
            folder = str(resource["Properties"]["CodeUri"]).rstrip("/").split("/")[-1]
            dirs[folder] = BUILD / name
    return dirs


FUNCTIONS = _function_dirs()
CHANNELS = sorted(set(FUNCTIONS) - {"dispatcher", "reaper", "migrate", "feedback"})


# --- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    from moto.core.models import default_user_config
    from moto.server import ThreadedMotoServer

    # Lambda without Docker: invokes are accepted and answered, not executed.
    saved = dict(default_user_config.get("lambda", {}))
    default_user_config["lambda"] = {**saved, "use_docker": False}
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
    default_user_config["lambda"] = saved


def client(endpoint: str, service: str) -> Any:
    import boto3

    return boto3.client(
        service,
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def invoke(
    folder: str,
    event: dict[str, Any],
    *,
    database_url: str,
    endpoint: str,
    tmp_path: Path,
    times: dict[str, float],
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``folder``'s built handler on ``event`` in a fresh runtime process."""
    function_dir = FUNCTIONS[folder]
    assert (function_dir / "app.py").is_file(), f"{function_dir} was not built"
    event_path = tmp_path / f"{folder}-event.json"
    event_path.write_text(json.dumps(event))
    out_path = tmp_path / f"{folder}-out.json"
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{LAYER}:{function_dir}",
        "PYTHONDONTWRITEBYTECODE": "1",  # /opt and /var/task are read-only in Lambda
        "PYTHONNOUSERSITE": "1",
        "DATABASE_URL": database_url,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_LAMBDA_FUNCTION_NAME": f"outbox-{folder}",
        "POWERTOOLS_SERVICE_NAME": "outbox",
        "POWERTOOLS_METRICS_NAMESPACE": "OutboxRelay",
        "POWERTOOLS_TRACE_DISABLED": "true",
        "LEASE_SECONDS": "120",
        "MAX_ATTEMPTS": "3",
        "DISPATCH_BUDGET_SECONDS": "1",
        "POLL_INTERVAL_SECONDS": "0.05",
        **(extra_env or {}),
    }
    proc = subprocess.run(
        [str(RUNTIME_PYTHON), "-c", RUNNER, str(event_path), str(out_path), str(BUILD), str(ROOT)],
        cwd=tmp_path,  # not the repository: nothing from the source tree on sys.path
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out_path.is_file(), f"{folder} crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out: dict[str, Any] = json.loads(out_path.read_text())
    assert out["python"] == [3, 12]
    assert out["files"]["outbox"].startswith(str(LAYER)), out["files"]
    assert out["strays"] == [], f"modules loaded from the source tree: {out['strays']}"
    if "import_seconds" in out:
        times[folder] = out["import_seconds"]
        assert out["files"]["app"] == str(function_dir / "app.py")
    return out


def result_of(out: dict[str, Any]) -> Any:
    assert "error" not in out, f"{out['error']}: {out['message']}"
    return out["result"]


def load_event(name: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / f"{name}.json").read_text())
    return event


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    from outbox import migrate

    directory = ScriptDirectory(str(migrate._MIGRATIONS))
    head = directory.get_current_head()
    assert head
    return head


# --- the tests ------------------------------------------------------------------


def test_runtime_python_has_only_boto3() -> None:
    """The runtime venv is what Lambda provides: boto3 and its dependencies, no more."""
    proc = subprocess.run(
        [str(RUNTIME_PYTHON), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    names = {p["name"].lower() for p in json.loads(proc.stdout)}
    assert "boto3" in names
    assert names & {"sqlalchemy", "pg8000", "aws-lambda-powertools", "outbox-relay"} == set()


def test_the_layer_holds_the_runtime_package_and_its_pins_only() -> None:
    """The built layer: the `outbox` package, the pinned requirements' packages,
    and nothing of the development package or the command's libraries."""
    top = {p.name.split("-")[0].lower() for p in LAYER.iterdir()}
    assert "outbox" in top
    assert not top & {"outbox_cli", "click", "rich", "moto", "pgserver", "yaml", "boto3"}
    assert not list(LAYER.glob("*.egg-info"))
    modules = {p.stem for p in (LAYER / "outbox").rglob("*.py")}
    assert not modules & {"cli", "local", "invoke", "devdb", "render"}
    pinned = {
        line.split("==")[0].lower().replace("-", "_")
        for line in (ROOT / "layers" / "outbox" / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith((" ", "#"))
    }
    installed = {p.name.split("-")[0].lower() for p in LAYER.glob("*.dist-info")}
    assert installed == pinned


# ELF e_machine of each Lambda architecture.
_ELF_MACHINE = {"arm64": 183, "x86_64": 62}


def test_the_layer_is_built_for_its_architecture_and_runs_on_the_other() -> None:
    """The layer is built once, for BuildArchitecture. Its compiled files must
    all be for that architecture (so Lambda loads them there); they are optional
    speedups with a pure-Python fallback, which is what every other test in this
    module runs on (an x86_64 Python 3.12), so the same layer serves both
    values of the Architecture parameter."""
    from cfnlint.decode import cfn_yaml

    template = cfn_yaml.load(str(ROOT / "template.yaml"))
    built_for = str(template["Resources"]["OutboxLayer"]["Metadata"]["BuildArchitecture"])
    compiled = sorted(LAYER.rglob("*.so"))
    machines = {}
    for path in compiled:
        header = path.read_bytes()[:20]
        assert header[:4] == b"\x7fELF", path
        machines[str(path.relative_to(LAYER))] = int.from_bytes(header[18:20], "little")
    assert set(machines.values()) <= {_ELF_MACHINE[built_for]}, machines
    packages = {name.split("/")[0] for name in machines}
    assert packages <= {"sqlalchemy", "markupsafe"}, f"new compiled packages: {packages}"


def test_migrate_plain_invoke_returns_the_head_revision(
    engine: sa.Engine, database_url: str, moto_endpoint: str, tmp_path: Path, import_times: Any
) -> None:
    out = invoke(
        "migrate",
        load_event("migrate-invoke"),
        database_url=database_url,
        endpoint=moto_endpoint,
        tmp_path=tmp_path,
        times=import_times,
    )
    assert result_of(out) == {"revision": head_revision()}


def test_migrate_custom_resource_answers_cloudformation(
    engine: sa.Engine, database_url: str, moto_endpoint: str, tmp_path: Path, import_times: Any
) -> None:
    """The Create event's answer is PUT to the (here: local, TLS) ResponseURL."""
    received: list[dict[str, Any]] = []
    # The event's own host name (the migrate function answers only
    # CloudFormation's bucket), resolved to the local server in the runner.
    host = "cloudformation-custom-resource-response-useast1.s3.amazonaws.com"
    local = make_ca(tmp_path, names=(host,))
    ca, chain, key = local.ca_file, local.cert_file, local.key_file

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({"path": self.path, "body": json.loads(body)})
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(chain, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        event = load_event("migrate")
        path = event["ResponseURL"].split(".com", 1)[1]
        event["ResponseURL"] = f"https://{host}:{server.server_address[1]}{path}"
        out = invoke(
            "migrate",
            event,
            database_url=database_url,
            endpoint=moto_endpoint,
            tmp_path=tmp_path,
            times={},
            extra_env={"SSL_CERT_FILE": str(ca), "TEST_RESOLVE_TO_LOOPBACK": host},
        )
    finally:
        server.shutdown()
        thread.join()
    assert result_of(out) == {"status": "SUCCESS", "Revision": head_revision()}
    assert len(received) == 1
    answer = received[0]["body"]
    assert received[0]["path"] == path
    assert answer["Status"] == "SUCCESS"
    assert answer["Data"] == {"Revision": head_revision()}
    for field in ("StackId", "RequestId", "LogicalResourceId"):
        assert answer[field] == event[field]
    assert answer["PhysicalResourceId"]


def test_dispatcher_claims_and_hands_off_through_lambda(
    engine: sa.Engine, database_url: str, moto_endpoint: str, tmp_path: Path, import_times: Any
) -> None:
    import outbox
    from support import EMAIL

    iam = client(moto_endpoint, "iam")
    role_name = f"outbox-email-{uuid.uuid4().hex[:8]}"
    role = iam.create_role(RoleName=role_name, AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    function_name = f"outbox-email-{uuid.uuid4().hex[:8]}"
    client(moto_endpoint, "lambda").create_function(
        FunctionName=function_name,
        Runtime="python3.12",
        Role=role,
        Handler="app.handler",
        Code={"ZipFile": _zip({"app.py": "def handler(event, context):\n    return event\n"})},
    )
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "email", EMAIL)

    out = invoke(
        "dispatcher",
        load_event("dispatcher"),
        database_url=database_url,
        endpoint=moto_endpoint,
        tmp_path=tmp_path,
        times=import_times,
        extra_env={"CHANNEL_FUNCTIONS": json.dumps({"email": function_name})},
    )
    report = result_of(out)
    assert report["claimed"] == 1
    assert report["handed_off"] == 1
    assert report["released"] == 0
    with engine.connect() as conn:
        status = conn.execute(
            sa.text("SELECT status FROM outbox_message WHERE id = :id"), {"id": message_id}
        ).scalar_one()
    assert status == "claimed"


def test_reaper_releases_an_expired_claim(
    engine: sa.Engine, database_url: str, moto_endpoint: str, tmp_path: Path, import_times: Any
) -> None:
    import outbox
    from outbox import store
    from support import EMAIL, expire_leases, receive

    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "email", EMAIL)
        claims = store.claim(conn, 10, 120)
        assert [c.id for c in claims] == [message_id]
    receive(engine, claims)  # a sender took it, then died: the attempt counts
    expire_leases(engine, [message_id])

    out = invoke(
        "reaper",
        load_event("reaper"),
        database_url=database_url,
        endpoint=moto_endpoint,
        tmp_path=tmp_path,
        times=import_times,
    )
    report = result_of(out)
    assert report["reclaimed"] == 1
    assert report["dead"] == 0
    assert report["backlog"]["pending"] == 1


def test_email_function_delivers_its_event_through_ses(
    engine: sa.Engine, database_url: str, moto_endpoint: str, tmp_path: Path, import_times: Any
) -> None:
    """A claimed row with the event's id and token really goes out through moto's SES."""
    from moto.ses.models import ses_backends

    import outbox
    from outbox import store
    from support import EMAIL

    event = load_event("email")
    (handed,) = event["messages"]
    client(moto_endpoint, "sesv2").create_email_identity(EmailIdentity="example.com")
    sent_before = len(ses_backends[ACCOUNT][REGION].sent_messages)
    with engine.begin() as conn:
        message_id = outbox.enqueue(conn, "email", EMAIL)
        assert message_id == handed["id"]  # identities restart with each test
        (claim,) = store.claim(conn, 10, 120)
        assert claim.attempt == handed["attempt"]
        # Test setup: give the claim the token the event file carries.
        conn.execute(
            sa.text("UPDATE outbox_message SET claim_token = :token WHERE id = :id"),
            {"token": handed["claim_token"], "id": message_id},
        )

    out = invoke(
        "email",
        event,
        database_url=database_url,
        endpoint=moto_endpoint,
        tmp_path=tmp_path,
        times=import_times,
    )
    assert result_of(out) == {
        "received": 1,
        "owned": 1,
        "lease_lost": [],
        "duplicates": [],
        "unknown": [],
        "statuses": {"delivered": 1},
    }
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT status, provider_message_id FROM outbox_message WHERE id = :id"),
            {"id": message_id},
        ).one()
    assert row.status == "delivered"
    sent = ses_backends[ACCOUNT][REGION].sent_messages[sent_before:]
    assert [m.id for m in sent] == [row.provider_message_id]
    assert sent[0].destinations["ToAddresses"] == EMAIL["to"]


def test_feedback_function_records_the_sample_bounce(
    engine: sa.Engine, database_url: str, moto_endpoint: str, tmp_path: Path, import_times: Any
) -> None:
    import outbox
    from outbox import store
    from support import EMAIL

    event = load_event("feedback-bounce")
    provider_id = json.loads(event["Records"][0]["Sns"]["Message"])["mail"]["messageId"]
    with engine.begin() as conn:
        # to the sample's recipient: feedback matches it
        message_id = outbox.enqueue(conn, "email", {**EMAIL, "to": ["recipient@example.com"]})
        (claim,) = store.claim(conn, 10, 120)
        store.settle(
            conn,
            [store.Settlement(message_id, claim.claim_token, "delivered", None, provider_id)],
            store.Backoff(1, 60, 3),
        )
    out = invoke(
        "feedback",
        event,
        database_url=database_url,
        endpoint=moto_endpoint,
        tmp_path=tmp_path,
        times=import_times,
    )
    assert result_of(out)["moved"] == {"bounced": 1}
    with engine.connect() as conn:
        status = conn.execute(
            sa.text("SELECT status FROM outbox_message WHERE id = :id"), {"id": message_id}
        ).scalar_one()
    assert status == "bounced"


@pytest.mark.parametrize("channel", CHANNELS)
def test_channel_function_refuses_claims_it_does_not_hold(
    channel: str,
    engine: sa.Engine,
    database_url: str,
    moto_endpoint: str,
    tmp_path: Path,
    import_times: Any,
) -> None:
    """With no such claim in the database, the event changes nothing: its
    claims are reported as never live (unknown), not as a lost lease."""
    event = load_event(channel)
    out = invoke(
        channel,
        event,
        database_url=database_url,
        endpoint=moto_endpoint,
        tmp_path=tmp_path,
        times=import_times,
    )
    if out.get("error") == "ValidationError" and "unknown channel" in out.get("message", ""):
        pytest.skip(f"the built layer has no {channel!r} channel yet: {out['message']}")
    ids = [m["id"] for m in event["messages"]]
    assert result_of(out) == {
        "received": len(ids),
        "owned": 0,
        "lease_lost": [],
        "duplicates": [],
        "unknown": ids,
        "statuses": {},
    }
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_message")).scalar_one() == 0


# --- helpers ------------------------------------------------------------------------


def _zip(files: dict[str, str]) -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


def test_no_request_left_the_machine() -> None:
    """The runner's AWS traffic went to moto: the endpoint variable is honoured by boto3."""
    proc = subprocess.run(
        [
            str(RUNTIME_PYTHON),
            "-c",
            "import boto3; print(boto3.client('sesv2', region_name='us-east-1').meta.endpoint_url)",
        ],
        env={"PATH": "/usr/bin:/bin", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "http://127.0.0.1:9"
