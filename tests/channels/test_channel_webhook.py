"""The webhook channel against real local HTTP and HTTPS receivers on 127.0.0.1.

Signatures are checked with the independent ``standardwebhooks`` package.
Loopback receivers need the local-development mode (``allow_insecure``); the
name ``webhook.test`` is resolved by a stub to 127.0.0.1 and TLS verifies the
test CA's certificate for that name.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import sqlalchemy as sa
from channel_support import (
    LocalCA,
    deliver,
    elapsed,
    loopback_resolver,
    new_secret,
    receiver,
    settled,
)
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

import outbox
import support
from outbox import store
from outbox.channels import Deadline, Message
from outbox.channels.webhook import MAX_RESPONSE_BYTES, WebhookChannel, retry_after


def channel_for(ca: LocalCA | None, secret_arn: str, **kw: Any) -> WebhookChannel:
    return WebhookChannel(
        allow_insecure=True,
        default_secret_id=secret_arn,
        ssl_context=ca.client_context() if ca else None,
        resolver=loopback_resolver(),
        **kw,
    )


def payload(url: str, **extra: Any) -> dict[str, Any]:
    return {"url": url, "event_type": "order.shipped", "body": {"order": 42, "note": "é"}, **extra}


def send(channel: WebhookChannel, url: str, deadline: float = 30.0, message_id: int = 7) -> Any:
    """One send; the default deadline is one a loopback answer meets however
    busy the machine (the deadline tests give their own)."""
    p = payload(url)
    channel.validate(p)
    return channel.send(Message(message_id, "webhook", p, 1), Deadline(deadline))


def verify(secret: str, request: Any) -> Any:
    return Webhook(secret).verify(request.body, request.headers)


def test_end_to_end_https_delivery_is_signed_and_verifiable(
    engine: sa.Engine, local_ca: LocalCA, signing_secret: tuple[str, str]
) -> None:
    arn, secret = signing_secret
    names: list[str] = []
    channel = WebhookChannel(
        allow_insecure=True,
        default_secret_id=arn,
        ssl_context=local_ca.client_context(),
        resolver=loopback_resolver(names),
    )
    with receiver(local_ca) as rx:
        url = rx.url("/ok", host="webhook.test")
        message_id, report = deliver(engine, "webhook", payload(url), channel=channel)
    row, attempts = settled(engine, message_id)
    assert report.statuses == {"delivered": 1}
    assert row.status == "delivered"
    assert row.provider_message_id == f"msg_{message_id}"
    assert [a.outcome for a in attempts] == ["delivered"]
    assert names == ["webhook.test"]  # resolved once, connected by address
    (request,) = rx.requests
    assert request.headers["host"] == f"webhook.test:{rx.port}"
    assert request.headers["webhook-id"] == f"msg_{message_id}"
    assert request.headers["content-type"] == "application/json"
    body = verify(secret, request)
    assert body["type"] == "order.shipped"
    assert body["data"] == {"order": 42, "note": "é"}
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(request.body, request.headers)


STATUS_TABLE = [
    ("/ok", "delivered", None, None),
    ("/nocontent", "delivered", None, None),
    ("/gone", "failed", "HTTP 410: endpoint gone", None),
    ("/bad", "failed", "HTTP 400", None),
    ("/redirect", "failed", "HTTP 301: redirect not followed", None),
    # 429 and 503 ask the whole destination to slow down: throttled (a pause
    # of the destination, no attempt and no deferral counted), after the
    # Retry-After when there is one, else after the relay's own pause.
    ("/unavailable", "deferred", "HTTP 503", None),
    ("/status/401", "failed", "HTTP 401", None),
    ("/status/403", "failed", "HTTP 403", None),
    ("/status/412", "failed", "HTTP 412", None),
    ("/status/408", "retry", "HTTP 408", None),
    ("/status/429", "deferred", "HTTP 429", None),
    ("/status/500", "retry", "HTTP 500", None),
    ("/status/502", "retry", "HTTP 502", None),
    ("/status/504", "retry", "HTTP 504", None),
    # Retry-After: how long the destination waits...
    ("/throttle-seconds", "deferred", "HTTP 429 with Retry-After", 7.0),
    ("/throttle-date", "deferred", "HTTP 429 with Retry-After", 120.0),
    ("/status/503/retry-after", "deferred", "HTTP 503 with Retry-After", 7.0),
    # ...but only on 429 and 503: elsewhere the header is ignored.
    ("/status/500/retry-after", "retry", "HTTP 500", None),
    ("/status/408/retry-after", "retry", "HTTP 408", None),
    ("/status/504/retry-after", "retry", "HTTP 504", None),
    # Outside 2xx-5xx: transient (retry), never a permanent failure.
    ("/status/150", "retry", "HTTP 150: unexpected status", None),
    ("/status/600", "retry", "HTTP 600: unexpected status", None),
    ("/status/799", "retry", "HTTP 799: unexpected status", None),
]


@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
@pytest.mark.parametrize(("path", "kind", "error", "delay"), STATUS_TABLE)
def test_every_status_row_of_the_classification_table(
    tls: bool,
    path: str,
    kind: str,
    error: str | None,
    delay: float | None,
    local_ca: LocalCA,
    signing_secret: tuple[str, str],
) -> None:
    arn, secret = signing_secret
    ca = local_ca if tls else None
    channel = channel_for(ca, arn)
    with receiver(ca) as rx:
        outcome = send(channel, rx.url(path, host="webhook.test" if tls else "127.0.0.1"))
    assert outcome.kind == kind
    assert outcome.error == error
    throttling = (error or "").startswith(("HTTP 429", "HTTP 503"))
    assert outcome.pause == ("destination" if throttling else None)
    if delay is None:
        assert outcome.delay_seconds is None
    else:
        assert outcome.delay_seconds == pytest.approx(delay, abs=2)
    # Exactly one request: a redirect is never followed (its target is internal).
    assert len(rx.requests) == 1
    verify(secret, rx.requests[0])


def test_retry_after_parsing() -> None:
    assert retry_after("30") == 30
    assert retry_after("999999") == 3600  # capped
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0  # in the past
    assert retry_after("soon") is None
    assert retry_after(None) is None


def test_a_receiver_that_hangs_is_given_up_by_the_deadline(
    local_ca: LocalCA, signing_secret: tuple[str, str]
) -> None:
    arn, _ = signing_secret
    channel = channel_for(local_ca, arn)
    with receiver(local_ca, hang_seconds=60) as rx:
        outcome, seconds = elapsed(lambda: send(channel, rx.url("/hang", "webhook.test"), 0.7))
    assert outcome.kind == "retry"
    assert outcome.error == "timeout: no answer before the deadline"
    # Not before the 0.7 s deadline; and ending well before the receiver's
    # 60 s answer proves the cut-off (the bound leaves a busy machine room).
    assert 0.6 <= seconds < 15


def test_a_hanging_receiver_through_the_sender_runtime_leaves_the_row_pending(
    engine: sa.Engine, signing_secret: tuple[str, str]
) -> None:
    arn, _ = signing_secret
    channel = channel_for(None, arn)
    with receiver(None, hang_seconds=60) as rx:
        (message_id, _), seconds = elapsed(
            lambda: deliver(
                engine, "webhook", payload(rx.url("/hang")), channel=channel, remaining=1.5
            )
        )
    row, attempts = settled(engine, message_id)
    assert seconds < 15  # cut at the 1.5 s of Lambda time, long before the 60 s answer
    assert row.status == "pending" and row.attempts == 1
    assert row.last_error in {
        "timeout: no answer before the deadline",
        "provider call exceeded its deadline",
    }
    assert [a.outcome for a in attempts] == ["retry"]


def test_a_huge_response_body_is_read_only_up_to_the_cap(
    local_ca: LocalCA, signing_secret: tuple[str, str]
) -> None:
    arn, _ = signing_secret
    channel = channel_for(local_ca, arn)
    with receiver(local_ca) as rx:
        outcome, seconds = elapsed(lambda: send(channel, rx.url("/huge", "webhook.test")))
    assert outcome.kind == "delivered"
    assert seconds < 15  # the cap, not the 100 MB (a busy machine is slow, never this slow)
    # The receiver offered 100 MB; the client stopped after the cap (what the
    # receiver managed to write is the cap plus what socket buffers absorbed).
    assert rx.huge_bytes_written < 16 * 1024 * 1024
    assert MAX_RESPONSE_BYTES == 64 * 1024


def test_secret_rotation_sends_one_signature_per_secret(local_ca: LocalCA, aws: None) -> None:
    import boto3

    old, new = new_secret(), new_secret()
    arn = boto3.client("secretsmanager").create_secret(
        Name="webhooks/rotating", SecretString=f"{new} {old}"
    )["ARN"]
    channel = channel_for(local_ca, "unused-default", allowed_secret_ids=[arn])
    with receiver(local_ca) as rx:
        p = payload(rx.url("/ok", "webhook.test"), secret_id=arn)
        channel.validate(p)
        outcome = channel.send(Message(9, "webhook", p, 1), Deadline(5))
    assert outcome.kind == "delivered"
    (request,) = rx.requests
    signatures = request.headers["webhook-signature"].split(" ")
    assert len(signatures) == 2 and all(s.startswith("v1,") for s in signatures)
    verify(old, request)  # a receiver still on the old secret accepts it
    verify(new, request)  # and so does one already on the new secret
    with pytest.raises(WebhookVerificationError):
        verify(new_secret(), request)


def test_webhook_id_is_stable_across_attempts(
    engine: sa.Engine, local_ca: LocalCA, signing_secret: tuple[str, str]
) -> None:
    arn, secret = signing_secret
    channel = channel_for(local_ca, arn)
    with receiver(local_ca) as rx:
        url = rx.url("/flaky", "webhook.test")
        message_id, first = deliver(engine, "webhook", payload(url), channel=channel)
        support.make_due(engine)
        _, second = deliver(engine, "webhook", None, channel=channel, message_id=message_id)
    assert first.statuses == {"pending": 1} and second.statuses == {"delivered": 1}
    row, attempts = settled(engine, message_id)
    assert row.status == "delivered"
    assert [a.outcome for a in attempts] == ["retry", "delivered"]
    ids = [r.headers["webhook-id"] for r in rx.requests]
    assert ids == [f"msg_{message_id}", f"msg_{message_id}"]
    for request in rx.requests:
        verify(secret, request)


def test_missing_or_malformed_secrets_fail_without_a_request(local_ca: LocalCA, aws: None) -> None:
    import boto3

    bad = boto3.client("secretsmanager").create_secret(
        Name="webhooks/bad", SecretString="whsec_%%%%-not-base64"
    )["ARN"]
    with receiver(local_ca) as rx:
        url = rx.url("/ok", "webhook.test")
        gone = channel_for(local_ca, "arn:aws:secretsmanager:us-east-1:123456789012:secret:nope")
        missing = send(gone, url)
        malformed = send(channel_for(local_ca, bad), url)
        unset = send(WebhookChannel(allow_insecure=True, resolver=loopback_resolver()), url)
    assert missing.kind == "failed"
    assert missing.error is not None
    assert missing.error.startswith("signing secret unavailable (ResourceNotFoundException")
    assert malformed.kind == "failed"
    assert malformed.error == "signing secret is not whsec_<base64>"
    assert unset.kind == "failed" and "WEBHOOK_SECRET_ARN" in (unset.error or "")
    assert rx.requests == []


def test_a_receiver_that_is_not_listening_is_retried(signing_secret: tuple[str, str]) -> None:
    arn, _ = signing_secret
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outcome = send(channel_for(None, arn), f"http://127.0.0.1:{port}/ok")
    assert outcome.kind == "retry"
    assert outcome.error is not None and outcome.error.startswith("connection failed")


def test_a_certificate_for_another_name_is_refused(
    local_ca: LocalCA, signing_secret: tuple[str, str]
) -> None:
    arn, _ = signing_secret
    with receiver(local_ca) as rx:
        outcome = send(channel_for(local_ca, arn), rx.url("/ok", "other.test"))
    assert outcome.kind == "retry"
    assert outcome.error == "TLS handshake or certificate check failed"
    assert rx.requests == []


def test_enqueue_refuses_bad_urls_naming_the_field(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WEBHOOK_ALLOW_INSECURE", raising=False)
    for url in ("http://hooks.example.com/in", "https://169.254.169.254/", "https://0x7f.1/"):
        with engine.begin() as conn, pytest.raises(outbox.ValidationError) as caught:
            outbox.enqueue(conn, "webhook", payload(url))
        assert caught.value.field == "payload.url"
    with engine.begin() as conn, pytest.raises(outbox.ValidationError) as caught:
        outbox.enqueue(conn, "webhook", {"url": "https://hooks.example.com/", "body": {}})
    assert caught.value.field == "payload"
    with engine.connect() as conn:
        assert store.backlog(conn).pending == 0


def test_dns_rebinding_cannot_redirect_the_connection(
    monkeypatch: pytest.MonkeyPatch, signing_secret: tuple[str, str]
) -> None:
    """The name is resolved once and the HTTP client is handed the checked
    address: later answers (here a private one) are never asked for."""
    arn, _ = signing_secret
    answers = iter([["127.0.0.1"], ["10.0.0.1"], ["10.0.0.1"]])
    resolved: list[str] = []

    def rebinding(host: str, port: int) -> list[str]:
        resolved.append(host)
        return next(answers)

    real_getaddrinfo = socket.getaddrinfo

    def only_literals(host: Any, *args: Any, **kwargs: Any) -> Any:
        assert host == "127.0.0.1", f"the HTTP client looked up {host!r} itself"
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", only_literals)
    channel = WebhookChannel(allow_insecure=True, default_secret_id=arn, resolver=rebinding)
    with receiver(None) as rx:
        outcome = send(channel, f"http://rebind.test:{rx.port}/ok")
    assert outcome.kind == "delivered"
    assert resolved == ["rebind.test"]
    assert rx.requests[0].headers["host"] == f"rebind.test:{rx.port}"


def test_the_body_is_the_standard_webhooks_envelope(
    local_ca: LocalCA, signing_secret: tuple[str, str]
) -> None:
    arn, _ = signing_secret
    with receiver(local_ca) as rx:
        send(channel_for(local_ca, arn), rx.url("/ok", "webhook.test"))
    envelope = json.loads(rx.requests[0].body)
    assert set(envelope) == {"type", "timestamp", "data"}
    assert envelope["timestamp"].endswith("Z")


def test_the_signing_secret_is_cached(local_ca: LocalCA) -> None:
    # Stubber: exactly one GetSecretValue is answered; a second call would raise.
    import boto3
    from aws_lambda_powertools.utilities.parameters import SecretsProvider
    from botocore.stub import Stubber

    client = boto3.client("secretsmanager", region_name="us-east-1")
    stub = Stubber(client)
    secret = new_secret()
    stub.add_response(
        "get_secret_value",
        {"ARN": "arn:aws:secretsmanager:us-east-1:123456789012:secret:s", "SecretString": secret},
    )
    channel = channel_for(local_ca, "s", secrets=SecretsProvider(boto3_client=client))
    with stub, receiver(local_ca) as rx:
        first = send(channel, rx.url("/ok", "webhook.test"), message_id=1)
        second = send(channel, rx.url("/ok", "webhook.test"), message_id=2)
    assert (first.kind, second.kind) == ("delivered", "delivered")
    for request in rx.requests:
        verify(secret, request)


def test_nothing_secret_or_personal_reaches_the_logs(
    engine: sa.Engine,
    local_ca: LocalCA,
    signing_secret: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    arn, secret = signing_secret
    channel = channel_for(local_ca, arn)
    caplog.set_level("DEBUG")
    with receiver(local_ca) as rx:
        for path in ("/ok", "/gone", "/redirect", "/unavailable"):
            url = rx.url(path, "webhook.test") + "?token=s3cr3t-token"
            deliver(engine, "webhook", payload(url), channel=channel)
    # Every logger at DEBUG, botocore's included (observability pins it at WARNING).
    text = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "settled" in text
    for needle in (secret, secret.removeprefix("whsec_"), "s3cr3t-token", "webhook.test", "é"):
        assert needle not in text


def test_a_secret_id_outside_the_operators_list_signs_nothing(
    local_ca: LocalCA, signing_secret: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any producer can name a secret_id: only the listed ones (and the
    default) may sign, or one tenant's payload could borrow another's key."""
    import boto3

    arn, _ = signing_secret
    other = boto3.client("secretsmanager").create_secret(
        Name="webhooks/another-tenant", SecretString=new_secret()
    )["ARN"]
    listed = boto3.client("secretsmanager").create_secret(
        Name="webhooks/listed", SecretString=new_secret()
    )["ARN"]
    monkeypatch.setenv("WEBHOOK_SECRET_ARNS", f" {listed} , ")
    channel = WebhookChannel(
        allow_insecure=True,
        default_secret_id=arn,
        ssl_context=local_ca.client_context(),
        resolver=loopback_resolver(),
    )
    assert channel.allowed_secret_ids == {arn, listed}
    with receiver(local_ca) as rx:
        url = rx.url("/ok", "webhook.test")
        refused = channel.send(Message(1, "webhook", payload(url, secret_id=other), 1), Deadline(5))
        assert rx.requests == []
        by_list = channel.send(
            Message(2, "webhook", payload(url, secret_id=listed), 1), Deadline(5)
        )
        by_default = channel.send(Message(3, "webhook", payload(url), 1), Deadline(5))
    assert refused.kind == "failed" and "WEBHOOK_SECRET_ARNS" in (refused.error or "")
    assert (by_list.kind, by_default.kind) == ("delivered", "delivered")
    assert len(rx.requests) == 2


def test_send_threads_fetch_a_cold_secret_once(signing_secret: tuple[str, str]) -> None:
    # A cold batch's send threads all asked Secrets Manager for the same key
    # at once (8 GetSecretValue calls for a batch of 10): one fetches, the
    # others wait for its answer.
    import threading

    import boto3
    from aws_lambda_powertools.utilities.parameters import SecretsProvider

    arn, _ = signing_secret
    client = boto3.client("secretsmanager")
    calls: list[str] = []

    def slow_and_counted(**kwargs: Any) -> None:
        calls.append(kwargs["params"]["SecretId"])
        threading.Event().wait(0.05)  # widen the window the threads race in

    client.meta.events.register(
        "provide-client-params.secrets-manager.GetSecretValue", slow_and_counted
    )
    channel = WebhookChannel(default_secret_id=arn, secrets=SecretsProvider(boto3_client=client))
    start = threading.Barrier(8)
    keys: list[list[bytes]] = []

    def fetch() -> None:
        start.wait()
        keys.append(channel.signing_keys(arn))

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [arn]
    assert len(keys) == 8 and all(k == keys[0] for k in keys)
