"""The sample database stack's custom resource (examples/database.yaml) sets
the relay user's password as a SCRAM verifier it computes itself: check that
verifier against the one Postgres computes for the same password and salt."""

from __future__ import annotations

import base64
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from cfnlint.decode import cfn_yaml

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "database.yaml"


def relay_user_code(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    template = cfn_yaml.load(str(SAMPLE))
    code = str(template["Resources"]["RelayUserFunction"]["Properties"]["Code"]["ZipFile"])
    for name in ("boto3", "cfnresponse"):  # the Lambda runtime's modules, not needed here
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    namespace: dict[str, Any] = {}
    exec(compile(code, "RelayUserFunction", "exec"), namespace)  # noqa: S102 - our own file
    return namespace


def test_the_scram_verifier_is_the_one_postgres_computes(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    password = "a generated password: 9f!x" + uuid.uuid4().hex
    role = f"outbox_scram_{uuid.uuid4().hex[:8]}"
    with engine.connect() as conn:
        conn.execute(sa.text("SET password_encryption = 'scram-sha-256'"))
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'"))
        stored = conn.execute(
            sa.text("SELECT rolpassword FROM pg_authid WHERE rolname = :r"), {"r": role}
        ).scalar_one()
        conn.execute(sa.text(f"DROP ROLE {role}"))
        conn.commit()
    # SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>
    salt_b64 = stored.split("$")[1].split(":")[1]
    code = relay_user_code(monkeypatch)
    monkeypatch.setattr(code["os"], "urandom", lambda n: base64.b64decode(salt_b64))
    assert code["scram_verifier"](password) == stored
