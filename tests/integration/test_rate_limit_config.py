"""Rate limits from configuration and from the provider (docs/how-to/rate-limits.md):
``RATE_LIMITS`` is checked at cold start (a bad value fails it, naming the
setting, and changes nothing), written to the database by the first run of a
dispatcher or worker (so every claimer draws from one bucket), overridden by
an operator's ``outbox limit set`` until ``outbox limit clear``, and removed
when the setting no longer names it. Email's limit defaults to SES's
``MaxSendRate`` where nobody set one; an SES that cannot be asked costs a log
line, never a send."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
import sqlalchemy as sa
from botocore.stub import Stubber

import outbox
from outbox import coldstart_limits, store
from outbox.channels import Deadline, Message, Outcome, SchemaChannel, register
from outbox.channels.email import EmailChannel
from outbox.errors import ConfigError
from outbox.limits import RateLimit
from outbox.relay_settings import RelaySettings
from outbox.runtime import Runtime
from outbox.worker import Worker
from support import LambdaContext, claim, install_channel, settings

EMAIL = {"from": "a@example.com", "to": ["b@example.com"], "subject": "s", "text": "t"}


def hooks(engine: sa.Engine, host: str, n: int) -> list[int]:
    with engine.begin() as conn:
        return outbox.enqueue_many(
            conn,
            [
                {
                    "channel": "webhook",
                    "payload": {"url": f"https://{host}/h", "event_type": "t", "body": {"n": i}},
                }
                for i in range(n)
            ],
        )


def limits(engine: sa.Engine) -> dict[tuple[str, str], tuple[Any, Any, Any]]:
    """(channel, destination) -> (limit_rate, limit_burst, limit_source), as stored."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT channel, destination, limit_rate, limit_burst, limit_source "
                "FROM outbox_destination"
            )
        ).all()
    return {(r.channel, r.destination): (r.limit_rate, r.limit_burst, r.limit_source) for r in rows}


def configured(text: str) -> RelaySettings:
    return settings(rate_limits=RelaySettings.from_env({"RATE_LIMITS": text}).rate_limits)


def apply(engine: sa.Engine, text: str, served: list[str] | None = None) -> store.AppliedLimits:
    return coldstart_limits.apply_configured_limits(engine, configured(text), served)


# --- checked at cold start ---------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("email=0", "'email=0': rate must be above 0"),
        ("email=-3", "rate must be above 0"),
        ("email=NaN", "rate must be a finite number"),
        ("email=inf", "rate must be a finite number"),
        ("email=1e9", "rate must be above 0 and at most 100000 a second"),
        ("email=5/0", "burst must be between 1"),
        ("email=5/1e12", "burst must be between 1"),
        ("email=fast", "'fast' is not a number"),
        ("email", "write CHANNEL[:DESTINATION]=RATE[/BURST]"),
        ("webhook:https://hooks.example.com/x=5", "the receiver's host[:port]"),
        ("webhook:hooks example.com=5", "the receiver's host[:port]"),
        ("webhook:*.example.com=5", "the receiver's host[:port]"),
        ("email:*=5", "email has one destination, the account"),
        ("email:example.com=5", "email has one destination, the account"),
        ("Email=5", "'Email' is not a channel name"),
        ("email=5,email=6", "email is named twice"),
        ("webhook:A.example=5,webhook:a.example=6", "is named twice"),
    ],
)
def test_a_bad_value_fails_the_cold_start_naming_the_setting(
    relay_env: dict[str, str], engine: sa.Engine, value: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        Runtime.for_dispatcher({**relay_env, "RATE_LIMITS": value})
    message = str(caught.value)
    assert caught.value.setting == "RATE_LIMITS" and problem in message
    assert message.startswith("configuration RATE_LIMITS: ") and "\n" not in message
    assert limits(engine) == {}  # nothing written


def test_an_unknown_channel_fails_the_cold_start(
    relay_env: dict[str, str], engine: sa.Engine
) -> None:
    # The test environment's dispatcher hands off email only.
    with pytest.raises(ConfigError, match=r"RATE_LIMITS: unknown channel 'sms' \(known: email\)"):
        Runtime.for_dispatcher({**relay_env, "RATE_LIMITS": "email=14,sms=1"})
    assert limits(engine) == {}


def test_the_syntax_takes_ports_queue_urls_and_blanks() -> None:
    read = RelaySettings.from_env(
        {
            "RATE_LIMITS": " email = 14 , webhook:Hooks.Example.com:8443=10/20,"
            "sqs:https://sqs.eu-west-1.amazonaws.com/123456789012/q=5,,"
        }
    ).rate_limits
    assert read == (
        RateLimit("email", "", 14, 14),
        RateLimit("webhook", "hooks.example.com:8443", 10, 20),
        RateLimit("sqs", "https://sqs.eu-west-1.amazonaws.com/123456789012/q", 5, 5),
    )
    assert RelaySettings.from_env({"RATE_LIMITS": "sms=0.5"}).rate_limits == (
        RateLimit("sms", "", 0.5, 1),  # the burst: a second's worth, at least one
    )


# --- applied at cold start, shared by every claimer ------------------------------


def test_the_dispatchers_first_run_writes_the_limits_once(
    relay_env: dict[str, str], engine: sa.Engine
) -> None:
    runtime = Runtime.for_dispatcher({**relay_env, "RATE_LIMITS": "email=14/28"})
    assert limits(engine) == {}  # the cold start only checks
    runtime.apply_configured_limits()
    assert limits(engine) == {("email", ""): (14, 28, "config")}
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_destination"))
    runtime.apply_configured_limits()  # once per environment
    assert limits(engine) == {}


class _AcceptEverything:
    """The channel functions: every hand-off accepted."""

    def __init__(self) -> None:
        self.handed: list[Any] = []

    def can_route(self, channel: str) -> bool:
        return True

    def hand_off(self, handoff: Any) -> None:
        self.handed.extend(handoff.claims)


def test_a_dispatcher_run_claims_within_the_configured_limit(
    relay_env: dict[str, str], engine: sa.Engine
) -> None:
    """The whole path: the handler's first run writes RATE_LIMITS, then claims."""
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 10)
    runtime = Runtime.for_dispatcher(
        {
            **relay_env,
            "RATE_LIMITS": "email=0.001/4",
            "PACING_MODE": "poll",
            "DISPATCH_BUDGET_SECONDS": "0",
        }
    )
    invoker = _AcceptEverything()
    runtime._invoker = invoker
    runtime.dispatch({}, LambdaContext(60))
    assert len(invoker.handed) == 4 and {c.id for c in invoker.handed} <= set(ids)
    assert limits(engine) == {("email", ""): (0.001, 4, "config")}


def test_a_configured_limit_is_one_bucket_for_every_claimer(engine: sa.Engine) -> None:
    limited = hooks(engine, "limited.example", 20)
    free = hooks(engine, "free.example", 5)
    # Two claimers start with the same configuration: a bucket of 3 that
    # refills one token in 1000 s, so no token comes back during the test.
    assert apply(engine, "webhook:limited.example=0.001/3").written == 1
    assert apply(engine, "webhook:limited.example=0.001/3").written == 1  # idempotent
    with engine.connect() as first, engine.connect() as second:
        with first.begin():
            a = store.claim(first, 100, 120)
        with second.begin():
            b = store.claim(second, 100, 120)
    with engine.connect() as conn:
        claimed = set(
            conn.execute(
                sa.text("SELECT id FROM outbox_message WHERE status = 'claimed'")
            ).scalars()
        )
    assert claimed == {c.id for c in a + b}
    assert len(claimed & set(limited)) == 3  # the burst, across both claimers
    assert set(free) <= claimed


def test_the_worker_applies_the_configuration_before_its_first_claim(
    engine: sa.Engine,
) -> None:
    limited = hooks(engine, "limited.example", 10)
    install_channel(AnyWebhook())
    worker = Worker(engine, configured("webhook:limited.example=0.001/2"), channels=["webhook"])
    assert worker.run_once().claimed == 2  # the burst, in the worker's very first claim
    assert worker.run_once().claimed == 0
    with engine.connect() as conn:
        left = conn.execute(
            sa.text("SELECT count(*) FROM outbox_message WHERE status = 'pending'")
        ).scalar_one()
    assert left == len(limited) - 2
    assert limits(engine)[("webhook", "limited.example")] == (0.001, 2, "config")


@dataclass
class AnyWebhook(SchemaChannel):
    """A webhook channel that delivers whatever it is given, without a network."""

    name: str = "webhook"
    schema = {"type": "object"}

    def send(self, message: Message, deadline: Deadline) -> Outcome:
        return Outcome.delivered()


# --- precedence: operator over configuration over provider -------------------------


def test_an_operator_limit_overrides_the_configuration_until_cleared(engine: sa.Engine) -> None:
    apply(engine, "email=14")
    with engine.begin() as conn:
        store.set_limit(conn, "email", "", 2, 4)
    assert limits(engine) == {("email", ""): (2, 4, "operator")}
    assert apply(engine, "email=14").written == 0  # the next cold start leaves it
    assert limits(engine) == {("email", ""): (2, 4, "operator")}
    assert apply(engine, "").removed == 0  # and so does removing the configuration
    with engine.begin() as conn:
        assert store.clear_limit(conn, "email", "") is True
    assert limits(engine) == {}
    apply(engine, "email=14")  # the configuration again, at the next cold start
    assert limits(engine) == {("email", ""): (14, 14, "config")}


def test_a_limit_the_configuration_no_longer_names_is_removed(engine: sa.Engine) -> None:
    apply(engine, "email=14,sms=1/3,webhook:a.example=10,webhook:b.example=10")
    with engine.begin() as conn:
        store.set_limit(conn, "webhook", "c.example", 5)  # the operator's
        # b.example throttled: what was learned stays when its limit goes.
        store.record_throttling(conn, "webhook", {"b.example": store.Throttled(1, 1, 5)})
    applied = apply(engine, "email=14")
    assert applied == store.AppliedLimits(written=1, removed=3)
    assert limits(engine) == {
        ("email", ""): (14, 14, "config"),
        ("webhook", "b.example"): (None, None, None),
        ("webhook", "c.example"): (5, 5, "operator"),
    }


def test_removal_touches_only_the_channels_served(engine: sa.Engine) -> None:
    apply(engine, "email=14,webhook:a.example=10")
    # A worker for webhook alone, configured with nothing: email's stays.
    apply(engine, "", served=["webhook"])
    assert limits(engine) == {("email", ""): (14, 14, "config")}


def test_a_changed_limit_keeps_what_its_bucket_holds(engine: sa.Engine) -> None:
    apply(engine, "webhook:a.example=0.001/10")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_destination SET tokens = 2"))
    apply(engine, "webhook:a.example=0.001/5")
    with engine.connect() as conn:
        tokens = conn.execute(sa.text("SELECT tokens FROM outbox_destination")).scalar_one()
    assert tokens == pytest.approx(2, abs=0.01)  # not refilled by the restart


# --- the provider's own rate --------------------------------------------------------


def ses_client_answering(rate: Any) -> Any:
    client = boto3.client("sesv2", region_name="us-east-1")
    stub = Stubber(client)
    stub.add_response(
        "get_account",
        {"SendQuota": {"Max24HourSend": 50000.0, "MaxSendRate": rate, "SentLast24Hours": 0.0}},
    )
    stub.activate()
    return client


def test_email_defaults_to_ses_max_send_rate(engine: sa.Engine) -> None:
    register("email", lambda: EmailChannel(ses_client_answering(14.0)))
    assert coldstart_limits.refresh_provider_limit(engine, "email") is True
    assert limits(engine) == {("email", ""): (14, 14, "provider")}


def test_the_provider_rate_gives_way_to_the_configuration_and_the_operator(
    engine: sa.Engine,
) -> None:
    register("email", lambda: EmailChannel(ses_client_answering(14.0)))
    apply(engine, "email=5")
    assert coldstart_limits.refresh_provider_limit(engine, "email") is False
    assert limits(engine) == {("email", ""): (5, 5, "config")}
    with engine.begin() as conn:
        store.set_limit(conn, "email", "", 2)
    register("email", lambda: EmailChannel(ses_client_answering(14.0)))
    assert coldstart_limits.refresh_provider_limit(engine, "email") is False
    assert limits(engine) == {("email", ""): (2, 2, "operator")}


def test_the_configuration_replaces_the_provider_rate(engine: sa.Engine) -> None:
    register("email", lambda: EmailChannel(ses_client_answering(14.0)))
    coldstart_limits.refresh_provider_limit(engine, "email")
    apply(engine, "email=5")
    assert limits(engine) == {("email", ""): (5, 5, "config")}
    apply(engine, "")  # and gone again: the provider's comes back at its next cold start
    assert limits(engine) == {}


@pytest.mark.usefixtures("aws")
def test_ses_that_cannot_be_asked_costs_a_log_line_not_a_send(
    relay_env: dict[str, str], engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """moto has no sesv2 GetAccount: the email function's first send asks, is
    refused, logs it once, and sends as ever."""
    boto3.client("sesv2").create_email_identity(EmailIdentity="example.com")
    with engine.begin() as conn:
        ids = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 2)
    from outbox.handoff import HandOff

    runtime = Runtime(relay_env)
    for _ in ids:
        with engine.begin() as conn:
            claims = store.claim(conn, 1, 120)
        event = HandOff("email", tuple(claims)).to_event()
        with caplog.at_level(logging.WARNING, logger="outbox.coldstart_limits"):
            runtime.send("email", event, _Context())
    with engine.connect() as conn:
        statuses = conn.execute(
            sa.text("SELECT status FROM outbox_message WHERE id = ANY(:ids)"), {"ids": ids}
        ).scalars()
        assert set(statuses) == {"delivered"}
    warnings = [r for r in caplog.records if r.name == "outbox.coldstart_limits"]
    assert len(warnings) == 1  # once per environment
    assert limits(engine) == {}


@pytest.mark.parametrize("answer", [0.0, float("nan"), 1e9])
def test_a_provider_rate_out_of_bounds_is_not_stored(engine: sa.Engine, answer: float) -> None:
    register("email", lambda: EmailChannel(ses_client_answering(answer)))
    assert coldstart_limits.refresh_provider_limit(engine, "email") is False
    assert limits(engine) == {}


class _Context:
    def get_remaining_time_in_millis(self) -> int:
        return 30_000


def test_a_provider_that_hangs_holds_up_the_first_send_at_most_briefly(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The question is given up after PROVIDER_ANSWER_SECONDS (here 0.1 s): the
    answer that comes later is dropped, nothing is stored."""
    release = threading.Event()

    class Hanging(EmailChannel):
        def provider_rate_limit(self) -> float | None:
            release.wait(30)
            return 14.0

    monkeypatch.setattr(coldstart_limits, "PROVIDER_ANSWER_SECONDS", 0.1)
    register("email", Hanging)
    try:
        assert coldstart_limits.refresh_provider_limit(engine, "email") is False
    finally:
        release.set()
    assert limits(engine) == {}


# --- a channel limited as a whole ---------------------------------------------------


def claimed_ids(engine: sa.Engine) -> set[int]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text("SELECT id FROM outbox_message WHERE status = 'claimed'")
            ).scalars()
        )


def test_a_channel_limit_holds_all_its_destinations_together(engine: sa.Engine) -> None:
    a = hooks(engine, "a.example", 20)
    b = hooks(engine, "b.example", 20)
    with engine.begin() as conn:
        mail = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 5)
        # A bucket of 5 for the whole webhook channel, one token back in 1000 s.
        assert store.set_limit(conn, "webhook", "*", 0.001, 5) == (0.001, 5)
    with engine.connect() as first, engine.connect() as second:
        with first.begin():
            store.claim(first, 100, 120)
        with second.begin():
            store.claim(second, 100, 120)
    claimed = claimed_ids(engine)  # read from the database, not from the claims
    assert len(claimed & set(a + b)) == 5  # the burst, across both claimers
    assert claimed & set(a) and claimed & set(b)  # the destinations take turns
    assert set(mail) <= claimed  # other channels at full speed
    with engine.connect() as conn:
        tokens = conn.execute(
            sa.text("SELECT tokens FROM outbox_destination WHERE destination = '*'")
        ).scalar_one()
    assert tokens < 1  # paid in the claim's statement


def test_a_channel_limit_and_a_destination_limit_both_hold(engine: sa.Engine) -> None:
    a = hooks(engine, "a.example", 20)
    b = hooks(engine, "b.example", 20)
    apply(engine, "webhook=0.001/6,webhook:a.example=0.001/2")
    assert limits(engine)[("webhook", "*")] == (0.001, 6, "config")
    store_claims = [c.id for c in claim(engine, 100)] + [c.id for c in claim(engine, 100)]
    claimed = claimed_ids(engine)
    assert claimed == set(store_claims)
    assert len(claimed & set(a)) == 2 and len(claimed & set(b)) == 4


def test_an_empty_channel_bucket_never_holds_up_other_channels(engine: sa.Engine) -> None:
    hooks(engine, "a.example", 300)  # due first, ahead in the claim order
    with engine.begin() as conn:
        mail = outbox.enqueue_many(conn, [{"channel": "email", "payload": EMAIL}] * 5)
        # No destination: the whole channel (as `outbox limit set webhook` says it).
        store.set_limit(conn, "webhook", store.check_destination("webhook", ""), 0.001, 1)
    assert len(claim(engine, 10)) == 6  # the webhook's one token, and every email
    assert {c.id for c in claim(engine, 10)} == set()
    assert set(mail) <= claimed_ids(engine)
    with engine.connect() as conn:  # a sleeping relay wakes for the next token
        assert store.next_resume(conn) is not None


def test_many_claimers_never_exceed_a_channel_limit(engine: sa.Engine) -> None:
    hooks(engine, "a.example", 150)
    hooks(engine, "b.example", 150)
    with engine.begin() as conn:
        store.set_limit(conn, "webhook", "*", 5, 5)
        since = conn.execute(sa.text("SELECT now()")).scalar_one()
    start = threading.Barrier(6)

    def claimer() -> None:
        start.wait()
        for _ in range(5):
            claim(engine, 50)

    threads = [threading.Thread(target=claimer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with engine.connect() as conn:
        taken, last = conn.execute(
            sa.text("SELECT count(*), max(claimed_at) FROM outbox_message WHERE status = 'claimed'")
        ).one()
    # The burst, plus the refill over the claims' span by the database's clock.
    span = (last - since).total_seconds()
    assert 5 <= taken <= 5 + 5 * span + 1e-9
