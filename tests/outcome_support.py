"""Helpers for the outcome-event tests (importable as ``outcome_support``)."""

from __future__ import annotations

import json
from typing import Any

import boto3
import sqlalchemy as sa

from outbox import outcomes, store

BUS = "outbox-outcomes"
BACKOFF = store.Backoff(1, 60, 3)


class Bus:
    """An event bus with a rule sending every ``outbox.relay`` event to a queue."""

    def __init__(self) -> None:
        self.events = boto3.client("events")
        sqs = boto3.client("sqs")
        self.sqs = sqs
        self.queue_url = sqs.create_queue(QueueName="outcomes")["QueueUrl"]
        queue_arn = sqs.get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=["QueueArn"])[
            "Attributes"
        ]["QueueArn"]
        self.events.create_event_bus(Name=BUS)
        self.events.put_rule(
            Name="outcomes",
            EventBusName=BUS,
            EventPattern=json.dumps({"source": [outcomes.SOURCE]}),
        )
        self.events.put_targets(
            Rule="outcomes", EventBusName=BUS, Targets=[{"Id": "queue", "Arn": queue_arn}]
        )

    def received(self) -> list[dict[str, Any]]:
        """Every event delivered to the queue since the last call."""
        out = []
        while True:
            batch = self.sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10).get(
                "Messages", []
            )
            if not batch:
                return out
            for message in batch:
                out.append(json.loads(message["Body"]))
                self.sqs.delete_message(
                    QueueUrl=self.queue_url, ReceiptHandle=message["ReceiptHandle"]
                )


def settle_all(engine: sa.Engine, outcome: str, error: str | None = None) -> dict[int, str]:
    """Claim everything due and settle it all with one outcome (provider id p-<id>)."""
    with engine.begin() as conn:
        claims = store.claim(conn, 100, 60)
    settlements = [
        store.Settlement(c.id, c.claim_token, outcome, error, f"p-{c.id}") for c in claims
    ]
    with engine.begin() as conn:
        return store.settle(conn, settlements, BACKOFF)


def lease_ends(engine: sa.Engine) -> None:
    """The database clock after the publisher's lease ran out."""
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_outcome_event SET publish_after = now()"))
