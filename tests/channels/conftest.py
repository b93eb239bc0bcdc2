"""Fixtures for the channel tests (moto resources, a test CA, webhook secrets)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from channel_support import LocalCA, make_ca, new_secret


@pytest.fixture(scope="session")
def local_ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return make_ca(Path(tmp_path_factory.mktemp("tls")))


@pytest.fixture
def signing_secret(aws: None) -> Iterator[tuple[str, str]]:
    """A Secrets Manager secret (in moto) holding one whsec_ key: (arn, value)."""
    import boto3

    value = new_secret()
    arn = boto3.client("secretsmanager").create_secret(Name="webhooks/signing", SecretString=value)[
        "ARN"
    ]
    yield arn, value
