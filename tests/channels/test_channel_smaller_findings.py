"""The channels' smaller findings of issue 23: every AWS channel's throttling
defers without an attempt (SES's real code, ``ThrottlingException``,
included); a custom channel whose ``send`` returns None gets a clear outcome
and holds up no other row; ``Retry-After`` is read strictly; a URL whose path
is not ASCII is sent, percent-encoded, instead of retried until dead."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.stub import Stubber
from channel_support import REGION, deliver, loopback_resolver, receiver, settled

import outbox
import support
from outbox import netguard, sender, store
from outbox.channels import Deadline, Message, Outcome
from outbox.channels.email import EmailChannel
from outbox.channels.eventbridge import EventBridgeChannel
from outbox.channels.push import PushChannel
from outbox.channels.sms import SmsChannel
from outbox.channels.sqs import SqsChannel
from outbox.channels.webhook import WebhookChannel, retry_after
from outbox.errors import ValidationError
from support import EMAIL, ScriptedChannel, install_channel

# --- throttling, on every AWS channel ------------------------------------------

# What each AWS service answers when the account's rate is exceeded: SES v2's
# documented code, the query protocol's, and the HTTP 429 form.
THROTTLING = ("ThrottlingException", "Throttling", "TooManyRequestsException")

PUSH = {"endpoint_arn": "arn:aws:sns:us-east-1:123456789012:endpoint/GCM/app/abc-123", "body": "b"}
SQS = {"queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/orders", "body": "b"}
EVENT = {"source": "shop", "detail_type": "OrderShipped", "detail": {"order": 1}}
# channel, the boto3 service, the operation that is throttled, a payload
AWS_CHANNELS: list[tuple[Any, str, str, dict[str, Any]]] = [
    (lambda c: EmailChannel(c, check_suppression=False), "sesv2", "send_email", EMAIL),
    (lambda c: EmailChannel(c), "sesv2", "get_suppressed_destination", EMAIL),
    (
        SmsChannel,
        "sns",
        "check_if_phone_number_is_opted_out",
        {"to": "+15555550100", "message": "m"},
    ),
    (PushChannel, "sns", "publish", PUSH),
    (EventBridgeChannel, "events", "put_events", EVENT),
    (SqsChannel, "sqs", "send_message", SQS),
]


@pytest.mark.parametrize("code", THROTTLING)
@pytest.mark.parametrize(
    ("make", "service", "operation", "payload"),
    AWS_CHANNELS,
    ids=[f"{service}.{operation}" for _, service, operation, _ in AWS_CHANNELS],
)
def test_every_aws_channel_pauses_the_destination_on_throttling(
    make: Any, service: str, operation: str, payload: dict[str, Any], code: str
) -> None:
    # Stubber: moto never throttles. The ClientError is botocore's own, parsed
    # from an error response as a real one would be.
    client = boto3.client(service, region_name=REGION)
    stub = Stubber(client)
    stub.add_client_error(operation, service_error_code=code, http_status_code=400)
    channel = make(client)
    channel.validate(payload)
    with stub:
        outcome = channel.send(Message(1, channel.name, payload, 1), Deadline(5))
    # throttled: the destination pauses (for the relay's own pause: AWS names no time)
    assert (outcome.kind, outcome.delay_seconds, outcome.pause) == ("deferred", None, "destination")
    assert outcome.error is not None and code in outcome.error


def test_ses_throttling_exception_counts_no_attempt(engine: sa.Engine, aws: None) -> None:
    """End to end (SES's send throttled): the row is pending again, no attempt
    and no deferral counted; the account (destination '') is paused."""
    client = boto3.client("sesv2", region_name=REGION)
    stub = Stubber(client)
    stub.add_client_error(
        "send_email", service_error_code="ThrottlingException", http_status_code=400
    )
    with stub:
        message_id, report = deliver(
            engine, "email", EMAIL, channel=EmailChannel(client, check_suppression=False)
        )
    row, attempts = settled(engine, message_id)
    assert report.statuses == {"not_started": 1}
    assert (row.status, row.attempts, row.deferrals) == ("pending", 0, 0)
    assert [a.outcome for a in attempts] == ["not_started"]
    with engine.connect() as conn:
        [paused] = store.destination_figures(conn)
    assert (paused.channel, paused.destination, paused.throttled_total) == ("email", "", 1)


# --- a custom channel whose send returns None -------------------------------


class ForgetsToReturn(ScriptedChannel):
    """A custom channel with a bug: ``send`` returns None for message ``bad``."""

    def __init__(self) -> None:
        super().__init__(name="forgetful")
        self.bad = 0

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        if message.id == self.bad:
            return None  # type: ignore[return-value]
        return super().send(message, deadline)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_send_that_returns_none_fails_its_row_at_once_and_holds_up_nobody(
    engine: sa.Engine, concurrency: int
) -> None:
    # The channel really sent, then returned None: sending again would send
    # again (before, up to max_attempts times). An answer the relay does not
    # know is final: failed, naming the channel and what it returned.
    channel = install_channel(ForgetsToReturn())
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, [{"channel": "forgetful", "payload": {"n": 1}}] * 5)
    channel.bad = ids[1]
    with engine.begin() as conn:
        rows = store.claim_and_receive(conn, 10, 120, 3, ["forgetful"])
    report = sender.send_then_settle(
        engine,
        "forgetful",
        rows,
        support.settings(send_concurrency=concurrency),
        lambda: 30.0,
    )()
    assert sorted(channel.sent) == sorted(set(ids) - {ids[1]})  # the rows after it were sent
    assert report.statuses == {"delivered": 4, "failed": 1}
    error = "channel 'forgetful' returned None, not an Outcome: delivery refused"
    with engine.connect() as conn:
        bad = support.row(conn, ids[1])
        (attempt,) = support.attempts(conn, ids[1])
    assert (bad.status, bad.attempts, bad.last_error) == ("failed", 1, error)
    assert (attempt.outcome, attempt.error) == ("failed", error)
    # nothing claims it again: one provider call, whatever max_attempts says
    with engine.begin() as conn:
        assert store.claim(conn, 10, 120, ["forgetful"]) == []


class SendsThenReturns(ScriptedChannel):
    """Makes the provider call, then returns what it was given."""

    def __init__(self, name: str, answer: Any) -> None:
        super().__init__(name=name)
        self.answer = answer
        self.calls = 0

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        self.calls += 1
        return self.answer  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (None, "returned None, not an Outcome"),
        ("ok", "returned str, not an Outcome"),
        ({"kind": "delivered"}, "returned dict, not an Outcome"),
        (Outcome("sent"), "returned unknown outcome 'sent'"),
    ],
)
def test_an_answer_the_relay_does_not_know_is_one_call_and_failed(
    engine: sa.Engine, answer: Any, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    channel = SendsThenReturns("oddball", answer)
    message_id, _ = deliver(engine, "oddball", {"n": 1}, channel=channel)
    row, _ = settled(engine, message_id)
    assert (row.status, row.attempts) == ("failed", 1)
    assert row.last_error == f"channel 'oddball' {said}: delivery refused"
    assert channel.calls == 1
    assert any(
        r.levelname == "ERROR" and "programming error" in r.getMessage() for r in caplog.records
    )


# --- Retry-After, strictly ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("7", 7.0),
        (" 7 ", 7.0),
        ("0", 0.0),
        ("9" * 400, 3600.0),  # capped, never an overflow
        ("²", None),  # str.isdigit says yes; not ASCII digits
        ("١٢", None),  # Arabic-Indic digits: float() would read 12
        ("+7", None),
        ("-7", None),
        ("7.5", None),
        ("1e3", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # an HTTP date in the past
        ("Wed, 21 Oct 99999 07:28:00 GMT", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT\u00b2", None),
        ("soon", None),
        ("", None),
    ],
)
def test_retry_after_reads_ascii_digits_or_an_http_date(value: str, seconds: float | None) -> None:
    assert retry_after(value) == seconds


@pytest.mark.parametrize(
    "header",
    [
        b"\xb2",  # Latin-1 superscript two: what http.client reads as "²"
        "١٢".encode(),
        b"9" * 400,
        b"Mon, 99 Foo 2015 99:99:99 GMT",
        b"Wed, 21 Oct 99999 07:28:00 GMT",
    ],
)
def test_a_strange_retry_after_from_a_real_receiver_is_the_relays_own_pause(
    signing_secret: tuple[str, str], header: bytes
) -> None:
    from urllib.parse import quote

    arn, _ = signing_secret
    channel = WebhookChannel(
        allow_insecure=True, default_secret_id=arn, resolver=loopback_resolver()
    )
    with receiver() as rx:
        payload = {"url": rx.url("/retry-after?" + quote(header)), "event_type": "t", "body": {}}
        channel.validate(payload)
        outcome = channel.send(Message(7, "webhook", payload, 1), Deadline(5))
    assert len(rx.requests) == 1
    assert (outcome.kind, outcome.pause) == ("deferred", "destination")  # throttled
    if header.isdigit():
        assert outcome.delay_seconds == 3600.0  # capped
    else:  # an unreadable Retry-After is no Retry-After: the relay's own pause
        assert (outcome.delay_seconds, outcome.error) == (None, "HTTP 503")


# --- a URL whose path is not ASCII -----------------------------------------------


def test_a_non_ascii_path_and_query_are_sent_percent_encoded(
    engine: sa.Engine, signing_secret: tuple[str, str]
) -> None:
    arn, _ = signing_secret
    channel = WebhookChannel(
        allow_insecure=True, default_secret_id=arn, resolver=loopback_resolver()
    )
    with receiver() as rx:
        url = rx.url("/ok/café/日本?q=✓&x=%41")
        message_id, _ = deliver(
            engine, "webhook", {"url": url, "event_type": "t", "body": {}}, channel=channel
        )
    row, attempts = settled(engine, message_id)
    assert (row.status, [a.outcome for a in attempts]) == ("delivered", ["delivered"])
    (request,) = rx.requests
    # UTF-8, percent-encoded (RFC 3987's IRI to URI); what was ASCII is kept as it was
    assert request.path == "/ok/caf%C3%A9/%E6%97%A5%E6%9C%AC?q=%E2%9C%93&x=%41"


def test_the_ssrf_guard_is_unchanged_for_a_non_ascii_path() -> None:
    internal = ["10.0.0.7"]
    with pytest.raises(netguard.ForbiddenDestination):
        netguard.resolve("https://hooks.example.com/café", resolver=lambda h, p: internal)
    target = netguard.resolve("https://hooks.example.com/café", resolver=lambda h, p: ["8.8.8.8"])
    assert (target.hostname, target.address, target.path) == (
        "hooks.example.com",
        "8.8.8.8",
        "/caf%C3%A9",
    )


def test_a_url_that_is_not_valid_unicode_is_refused_at_enqueue(engine: sa.Engine) -> None:
    with engine.begin() as conn, pytest.raises(ValidationError, match=r"payload\.url"):
        outbox.enqueue(
            conn,
            "webhook",
            {"url": "https://hooks.example.com/\udcff", "event_type": "t", "body": {}},
        )
