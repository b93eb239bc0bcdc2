"""A pass of the relay with every logger the way ``LogLevel=DEBUG`` leaves
them: Lambda sets the root logger to the application
log level and Powertools the ``outbox`` logger. Producer, senders over moto
(email, SMS), a signed webhook, the reaper and a database secret fetch all
run; every record from every logger is scanned for payloads, addresses,
phone numbers, claim tokens and secret values."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import boto3
import pytest
import sqlalchemy as sa
from channel_support import REGION, deliver, loopback_resolver, receiver
from logscan import Collector, find_leaks, secret_values

import outbox
from outbox import reaper, store
from outbox.channels.webhook import WebhookChannel
from outbox.db import _base_url, _secret_credentials
from outbox.observability import logger as outbox_logger
from outbox.relay_settings import DatabaseSettings
from support import EMAIL, LocalCA, expire_leases, receive, settings

DB_PASSWORD = "db-Password-7f3a91c2e4"
PHONE = "+15555550123"
SMS_TEXT = "Your login code is 552211"


@pytest.fixture
def debug_everywhere() -> Iterator[Collector]:
    root = logging.getLogger()
    collector = Collector()
    collector.formatter_ = outbox_logger.registered_formatter  # type: ignore[assignment]
    saved = root.level, outbox_logger.log_level
    root.setLevel(logging.DEBUG)
    root.addHandler(collector)
    outbox_logger.setLevel("DEBUG")
    logging.getLogger("outbox").addHandler(collector)
    try:
        yield collector
    finally:
        logging.getLogger("outbox").removeHandler(collector)
        root.removeHandler(collector)
        root.setLevel(saved[0])
        outbox_logger.setLevel(saved[1])


def test_a_debug_pass_logs_no_payload_secret_or_token(
    engine: sa.Engine,
    aws: None,
    local_ca: LocalCA,
    signing_secret: tuple[str, str],
    debug_everywhere: Collector,
) -> None:
    arn, webhook_secret = signing_secret
    secrets = boto3.client("secretsmanager", region_name=REGION)
    db_secret = secrets.create_secret(
        Name="outbox/db",
        SecretString=json.dumps(
            {"username": "relay", "password": DB_PASSWORD, "host": "db.internal", "port": 5432}
        ),
    )["ARN"]
    boto3.client("ses", region_name=REGION).verify_email_identity(EmailAddress=EMAIL["from"])

    # The database secret, as the functions read it at connect time.
    assert _secret_credentials(db_secret)["password"] == DB_PASSWORD
    assert _base_url(DatabaseSettings(secret_arn=db_secret)).username == "relay"
    # Producer and senders: email and SMS through moto, a signed webhook.
    _, email_report = deliver(engine, "email", EMAIL)
    _, sms_report = deliver(engine, "sms", {"to": PHONE, "message": SMS_TEXT})
    webhook = WebhookChannel(
        allow_insecure=True,
        default_secret_id=arn,
        ssl_context=local_ca.client_context(),
        resolver=loopback_resolver(),
    )
    with receiver(local_ca) as rx:
        _, webhook_report = deliver(
            engine,
            "webhook",
            {
                "url": rx.url("/ok", "webhook.test") + "?token=s3cr3t-query-token",
                "event_type": "t",
                "body": {"phone": PHONE},
            },
            channel=webhook,
        )
    assert [r.statuses["delivered"] for r in (email_report, sms_report, webhook_report)] == [
        1,
        1,
        1,
    ]
    # The reaper over an expired claim.
    with engine.begin() as conn:
        outbox.enqueue(conn, "email", EMAIL)
        claims = store.claim(conn, 10, 120)
    receive(engine, claims)  # a sender took it, then died
    expire_leases(engine)
    assert reaper.run(engine, settings(), lambda: 10.0).reclaimed == 1

    records = debug_everywhere.records
    assert any(r.get("message") == "settled" for r in records)  # DEBUG capture is live
    needles = [
        DB_PASSWORD,
        webhook_secret,
        webhook_secret.removeprefix("whsec_"),
        PHONE,
        SMS_TEXT,
        "s3cr3t-query-token",
        *secret_values(),
    ]
    leaks = [
        (r.get("logger") or r.get("name"), r.get("message"), problems)
        for r in records
        if (problems := find_leaks(r, needles))
    ]
    assert leaks == [], leaks[:5]
