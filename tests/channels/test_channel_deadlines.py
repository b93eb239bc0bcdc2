"""A provider call that hangs past its deadline, for every boto3 channel.

The client is pointed at a local server on 127.0.0.1 that accepts and never
answers. The sender runtime must give up at the deadline (lease or Lambda
time, less the settle margin) and leave the row pending with the attempt
counted, instead of letting the lease expire.
"""

from __future__ import annotations

from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.config import Config
from channel_support import deliver, elapsed, settled, silent_server

from outbox.channels.email import EmailChannel
from outbox.channels.eventbridge import EventBridgeChannel
from outbox.channels.push import PushChannel
from outbox.channels.sms import SmsChannel
from outbox.channels.sqs import SqsChannel
from outbox.sender import DEADLINE_EXCEEDED
from support import EMAIL

CASES: list[tuple[str, str, Any, dict[str, Any]]] = [
    ("email", "sesv2", lambda c: EmailChannel(c, check_suppression=False), EMAIL),
    ("sms", "sns", SmsChannel, {"to": "+15555550100", "message": "hi"}),
    (
        "push",
        "sns",
        PushChannel,
        {"endpoint_arn": "arn:aws:sns:us-east-1:123456789012:endpoint/GCM/app/0a1b", "body": "hi"},
    ),
    (
        "eventbridge",
        "events",
        EventBridgeChannel,
        {"source": "shop", "detail_type": "T", "detail": {}},
    ),
    (
        "sqs",
        "sqs",
        SqsChannel,
        {"queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/q", "body": "x"},
    ),
]


@pytest.mark.parametrize(
    ("name", "service", "factory", "payload"), CASES, ids=[c[0] for c in CASES]
)
def test_a_hanging_provider_is_given_up_at_the_deadline(
    engine: sa.Engine, name: str, service: str, factory: Any, payload: dict[str, Any]
) -> None:
    with silent_server() as port:
        client = boto3.client(
            service,
            region_name="us-east-1",
            endpoint_url=f"http://127.0.0.1:{port}",
            config=Config(connect_timeout=1, read_timeout=60, retries={"total_max_attempts": 1}),
        )
        (message_id, report), seconds = elapsed(
            lambda: deliver(engine, name, payload, channel=factory(client), remaining=1.5)
        )
    row, attempts = settled(engine, message_id)
    # 1.5 s of Lambda time less the 0.5 s settle margin: given up after ~1 s,
    # long before the client's own 60 s read timeout (the bound leaves a busy
    # machine room).
    assert 0.9 <= seconds < 15
    assert report.statuses == {"pending": 1}
    assert (row.status, row.attempts, row.last_error) == ("pending", 1, DEADLINE_EXCEEDED)
    assert [a.outcome for a in attempts] == ["retry"]
