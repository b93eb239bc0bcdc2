"""One pooled SQLAlchemy engine per process, reused across Lambda invocations.

Credentials come from ``DATABASE_URL`` locally, or in AWS from a Secrets
Manager secret (RDS format, cached and re-read on rotation) or an RDS IAM auth
token minted per connection. TLS is verified whenever we are not on a local
URL: pg8000 talks plaintext unless it is handed an SSL context, so we always
hand it one. Nothing here issues a session ``SET``: that would pin the
connection behind RDS Proxy.
"""

from __future__ import annotations

import json
import ssl
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from .config import DatabaseSettings

_SECRET_MAX_AGE_SECONDS = 300


def tls_context(settings: DatabaseSettings) -> ssl.SSLContext:
    """A verifying context: the system roots (enough for RDS Proxy, whose
    certificates chain to Amazon Trust Services) plus an optional CA bundle
    (the RDS global bundle, for direct connections to an instance)."""
    context = ssl.create_default_context(cafile=settings.ca_bundle)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _secret_credentials(secret_arn: str, force_fetch: bool = False) -> dict[str, Any]:
    from aws_lambda_powertools.utilities import parameters

    raw = parameters.get_secret(
        secret_arn, max_age=_SECRET_MAX_AGE_SECONDS, force_fetch=force_fetch
    )
    return json.loads(raw) if isinstance(raw, str) else dict(raw)


def _base_url(settings: DatabaseSettings) -> URL:
    if settings.url:
        url = make_url(settings.url)
        if url.drivername in ("postgresql", "postgres"):
            url = url.set(drivername="postgresql+pg8000")
        return url
    if settings.secret_arn:
        secret = _secret_credentials(settings.secret_arn)
        return URL.create(
            "postgresql+pg8000",
            username=secret["username"],
            host=settings.host or secret["host"],
            port=int(settings.port if settings.host else secret.get("port", settings.port)),
            database=settings.name if settings.host else secret.get("dbname", settings.name),
        )
    return URL.create(
        "postgresql+pg8000",
        username=settings.iam_user,
        host=settings.host,
        port=settings.port,
        database=settings.name,
    )


def create_engine(settings: DatabaseSettings, *, pool_size: int = 1) -> sa.Engine:
    """Build the engine. In Lambda one connection serves the whole invocation."""
    url = _base_url(settings)
    connect_args: dict[str, Any] = {
        "timeout": settings.connect_timeout,
        "application_name": "outbox-relay",
    }
    if settings.sslmode != "disable":
        connect_args["ssl_context"] = tls_context(settings)
    engine = sa.create_engine(
        url,
        connect_args=connect_args,
        pool_size=pool_size,
        max_overflow=0 if pool_size == 1 else pool_size,
        pool_pre_ping=True,
        # Below RDS Proxy's default idle client timeout, and short enough that a
        # rotated secret or an expired IAM token is picked up on reconnect.
        pool_recycle=600,
    )
    if settings.secret_arn or settings.iam_user:
        _mint_credentials_per_connection(engine, settings)
    return engine


def _mint_credentials_per_connection(engine: sa.Engine, settings: DatabaseSettings) -> None:
    @sa.event.listens_for(engine, "do_connect")
    def _provide_password(dialect: Any, conn_rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        if settings.secret_arn:
            cparams["password"] = _secret_credentials(settings.secret_arn)["password"]
        else:
            import boto3

            # from_env guarantees both with DB_IAM_USER
            assert settings.host is not None and settings.iam_user is not None
            client = boto3.client("rds")
            cparams["password"] = client.generate_db_auth_token(
                DBHostname=settings.host, Port=settings.port, DBUsername=settings.iam_user
            )
