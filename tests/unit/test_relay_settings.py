"""Settings: validated once, errors name the setting."""

from __future__ import annotations

import json
import ssl

import boto3
import pytest

from outbox import ConfigError
from outbox.errors import ValidationError
from outbox.handoff import HandOff
from outbox.relay_settings import DatabaseSettings, RelaySettings
from outbox.runtime import Runtime

BASE = {"DATABASE_URL": "postgresql://postgres@127.0.0.1/test"}


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({}, "DATABASE_URL"),
        ({**BASE, "DB_SECRET_ARN": "arn:aws:secretsmanager:us-east-1:1:secret:x"}, "DB_SECRET_ARN"),
        ({"DB_IAM_USER": "relay"}, "DB_HOST"),
        ({**BASE, "BATCH_SIZE": "many"}, "BATCH_SIZE"),
        ({**BASE, "BATCH_SIZE": "0"}, "BATCH_SIZE"),
        (
            {
                **BASE,
                "LEASE_SECONDS": "60",
                "SENDER_TIMEOUT_SECONDS": "30",
                "MAX_EVENT_AGE_SECONDS": "60",
            },
            "LEASE_SECONDS",
        ),
        ({**BASE, "CHANNEL_FUNCTIONS": "{nope"}, "CHANNEL_FUNCTIONS"),
        ({**BASE, "CHANNEL_FUNCTIONS": '{"email": ""}'}, "CHANNEL_FUNCTIONS"),
        ({**BASE, "CHANNEL_CONCURRENCY": "10"}, "CHANNEL_CONCURRENCY"),
        ({**BASE, "CHANNEL_CONCURRENCY": '{"email": -1}'}, "CHANNEL_CONCURRENCY"),
        ({**BASE, "UNRESERVED_CHANNEL_CONCURRENCY": "0"}, "UNRESERVED_CHANNEL_CONCURRENCY"),
        ({**BASE, "CHANNEL_CONCURRENCY": '{"email": "10"}'}, "CHANNEL_CONCURRENCY"),
        ({**BASE, "CHANNEL_CONCURRENCY": '{"email": true}'}, "CHANNEL_CONCURRENCY"),
        ({**BASE, "CHANNEL_MAX_IN_FLIGHT": "{nope"}, "CHANNEL_MAX_IN_FLIGHT"),
        ({**BASE, "CHANNEL_MAX_IN_FLIGHT": '{"sms": 2.5}'}, "CHANNEL_MAX_IN_FLIGHT"),
        ({**BASE, "BACKOFF_BASE_SECONDS": "10", "BACKOFF_CAP_SECONDS": "5"}, "BACKOFF_CAP_SECONDS"),
        ({**BASE, "DB_SSLMODE": "prefer"}, "DB_SSLMODE"),
        ({**BASE, "MAX_DEFERRALS": "-1"}, "MAX_DEFERRALS"),
        ({**BASE, "MIN_DEFERRAL_SECONDS": "nan"}, "MIN_DEFERRAL_SECONDS"),
        ({**BASE, "DEFAULT_TTL_SECONDS": "1.5"}, "DEFAULT_TTL_SECONDS"),
        ({**BASE, "DEFAULT_TTL_SECONDS": "-60"}, "DEFAULT_TTL_SECONDS"),
        ({"DB_SECRET_ARN": "arn:x", "DB_SSLMODE": "disable"}, "DB_SSLMODE"),
        ({**BASE, "ATTEMPT_RETENTION_DAYS": "-1"}, "ATTEMPT_RETENTION_DAYS"),
        ({**BASE, "DEDUPE_WINDOW_DAYS": "a month"}, "DEDUPE_WINDOW_DAYS"),
        ({**BASE, "OUTCOME_EVENT_BUS": "bus with spaces"}, "OUTCOME_EVENT_BUS"),
        ({**BASE, "OUTCOME_EVENTS_DELIVERED": "yes"}, "OUTCOME_EVENTS_DELIVERED"),
    ],
)
def test_bad_configuration_fails_at_cold_start_naming_the_setting(
    env: dict[str, str], setting: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        Runtime(env)
    assert caught.value.setting == setting and setting in str(caught.value)


def test_defaults_keep_the_lease_longer_than_timeout_plus_event_age() -> None:
    s = RelaySettings.from_env(BASE)
    assert s.lease_seconds > s.sender_timeout_seconds + s.max_event_age_seconds


def test_the_send_log_and_dedupe_keys_have_retentions_of_their_own() -> None:
    s = RelaySettings.from_env(BASE)
    assert (s.retention_days, s.attempt_retention_days, s.dedupe_window_days) == (7, 90, 30)
    s = RelaySettings.from_env({**BASE, "ATTEMPT_RETENTION_DAYS": "3", "DEDUPE_WINDOW_DAYS": "0"})
    assert (s.attempt_retention_days, s.dedupe_window_days) == (3, 0)


def test_in_flight_budget_from_reserved_concurrency_chunk_timeout_and_event_age() -> None:
    env = {**BASE, "CHANNEL_CONCURRENCY": '{"email": 10, "sms": 5}'}
    # The least of the bound C * K * (1 + floor(min(event age, lease - timeout) / timeout))
    # (10 * 32 * (1 + 60 // 30) = 960) and an event running in every environment and one
    # waiting for every other ((10 + 5) * 32 = 480; (5 + 3) * 32 = 256).
    assert RelaySettings.from_env(env).in_flight_budgets() == {"email": 480, "sms": 256}
    faster = {**env, "SENDER_TIMEOUT_SECONDS": "20", "HANDOFF_CHUNK_SIZE": "10"}
    assert RelaySettings.from_env(faster).in_flight_budgets() == {"email": 150, "sms": 80}
    # An event age that leaves one wave: the bound is the lesser.
    short = {**env, "MAX_EVENT_AGE_SECONDS": "20"}
    assert RelaySettings.from_env(short).in_flight_budgets() == {"email": 320, "sms": 160}
    override = {**env, "CHANNEL_MAX_IN_FLIGHT": '{"sms": 40, "push": 7}'}
    assert RelaySettings.from_env(override).in_flight_budgets() == {
        "email": 480,
        "sms": 40,
        "push": 7,
    }
    assert RelaySettings.from_env(BASE).in_flight_budgets() == {}  # no budget: batch-bound


def test_an_unreserved_channel_is_budgeted_from_the_assumed_concurrency() -> None:
    # 0: the function reserves nothing (a new account's quota leaves no room
    # for a reservation), so the budget assumes UNRESERVED_CHANNEL_CONCURRENCY
    # (default 2) invocations at once instead: (2 + 1) * 32.
    env = {**BASE, "CHANNEL_CONCURRENCY": '{"email": 0, "sms": 5}'}
    assert RelaySettings.from_env(env).in_flight_budgets() == {"email": 96, "sms": 256}
    wider = {**env, "UNRESERVED_CHANNEL_CONCURRENCY": "4"}
    assert RelaySettings.from_env(wider).in_flight_budgets() == {"email": 192, "sms": 256}
    override = {**env, "CHANNEL_MAX_IN_FLIGHT": '{"email": 50}'}
    assert RelaySettings.from_env(override).in_flight_budgets() == {"email": 50, "sms": 256}


def test_issue_9_settings_are_read_with_production_defaults() -> None:
    defaults = RelaySettings.from_env(BASE)
    assert (defaults.max_attempts, defaults.backoff_base_seconds) == (8, 30.0)
    assert (defaults.backoff_cap_seconds, defaults.max_deferrals) == (1800.0, 20)
    assert (defaults.min_deferral_seconds, defaults.default_ttl_seconds) == (5.0, 86_400)
    chosen = RelaySettings.from_env(
        {**BASE, "MAX_DEFERRALS": "3", "MIN_DEFERRAL_SECONDS": "0.5", "DEFAULT_TTL_SECONDS": "0"}
    )
    assert (chosen.max_deferrals, chosen.min_deferral_seconds) == (3, 0.5)
    assert chosen.default_ttl_seconds == 0


def test_tls_is_verified_unless_the_url_is_local() -> None:
    from outbox.db import create_engine, tls_context

    remote = DatabaseSettings.from_env({"DB_IAM_USER": "relay", "DB_HOST": "db.example.internal"})
    assert remote.sslmode == "verify-full"
    context = tls_context(remote)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    local = DatabaseSettings.from_env(BASE)
    assert local.sslmode == "disable"
    # A local URL may still ask for TLS.
    assert DatabaseSettings.from_env({**BASE, "DB_SSLMODE": "verify-full"}).sslmode == "verify-full"
    engine = create_engine(remote)
    assert engine.url.host == "db.example.internal" and engine.url.password is None


def test_credentials_from_a_secrets_manager_secret_never_enter_the_url(aws: None) -> None:
    from outbox.db import create_engine

    secret = {
        "username": "relay",
        "password": "s3cr3t-Pa55",
        "host": "db.example.internal",
        "port": 5433,
        "dbname": "app",
    }
    arn = boto3.client("secretsmanager").create_secret(
        Name="outbox/db", SecretString=json.dumps(secret)
    )["ARN"]
    engine = create_engine(DatabaseSettings.from_env({"DB_SECRET_ARN": arn}))
    assert (engine.url.username, engine.url.host, engine.url.port, engine.url.database) == (
        "relay",
        "db.example.internal",
        5433,
        "app",
    )
    assert engine.url.password is None and "s3cr3t" not in repr(engine.url)


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (None, "event"),
        ({"channel": "email", "messages": []}, "event.version"),
        ({"version": 1, "messages": [{}]}, "event.channel"),
        ({"version": 1, "channel": "email", "messages": []}, "event.messages"),
        (
            {
                "version": 1,
                "channel": "email",
                "messages": [{"id": "1", "attempt": 1, "claim_token": "x"}],
            },
            "event.messages[0].id",
        ),
        (
            {
                "version": 1,
                "channel": "email",
                "messages": [{"id": 1, "attempt": 0, "claim_token": "x"}],
            },
            "event.messages[0].attempt",
        ),
        (
            {
                "version": 1,
                "channel": "email",
                "messages": [{"id": 1, "attempt": 1, "claim_token": "x"}],
            },
            "event.messages[0].claim_token",
        ),
        (
            {
                "version": 1,
                "channel": "email",
                "messages": [
                    {"id": 1, "attempt": 1, "claim_token": "00000000-0000-0000-0000-000000000000"}
                ]
                * 1001,
            },
            "event.messages",
        ),
    ],
)
def test_malformed_hand_off_events_are_refused_naming_the_field(event: object, field: str) -> None:
    from outbox import ValidationError

    with pytest.raises(ValidationError) as caught:
        HandOff.from_event(event)
    assert caught.value.field == field


def test_outcome_events_are_off_unless_a_bus_is_named() -> None:
    from outbox.relay_settings import OutcomeEventSettings

    assert OutcomeEventSettings.from_env(BASE) == OutcomeEventSettings(bus="")
    arn = "arn:aws:events:us-east-1:123456789012:event-bus/outcomes"
    named = OutcomeEventSettings.from_env(
        {**BASE, "OUTCOME_EVENT_BUS": arn, "OUTCOME_EVENTS_DELIVERED": "TRUE"}
    )
    assert named.bus == arn and named.include_delivered
    assert named.lease_seconds > 60  # outlives a reaper run: a live publisher keeps its events


def test_a_hand_off_keeps_its_tokens_as_canonical_text_whatever_the_spelling() -> None:
    """The sender keeps each claim token as ``str(uuid.UUID)`` text: the
    spelling ``to_event`` writes passes as it is, another one is made canonical,
    so the same claim spelt twice is still one claim."""
    import uuid

    token = uuid.uuid4()
    spellings = [str(token), str(token).upper(), "{" + str(token) + "}", token.hex, token.urn]
    event = {
        "version": 1,
        "channel": "email",
        "messages": [{"id": 7, "claim_token": t, "attempt": 1} for t in spellings],
    }
    [claim] = HandOff.from_event(event).claims
    assert claim.claim_token == str(token)
    with pytest.raises(ValidationError, match="claim_token"):
        HandOff.from_event({**event, "messages": [{"id": 7, "claim_token": 42, "attempt": 1}]})


@pytest.mark.parametrize(
    ("url", "sslmode"),
    [
        ("postgresql://u@db.example.com/x", "verify-full"),
        ("postgresql://u@10.0.0.5:5432/x", "verify-full"),
        ("postgresql://u@127.0.0.1/x", "disable"),
        ("postgresql://u@localhost/x", "disable"),
        ("postgresql://u@[::1]/x", "disable"),
        ("postgresql://u@/x?unix_sock=/tmp/.s.PGSQL.5432", "disable"),
    ],
)
def test_a_remote_url_without_sslmode_is_verified_not_plaintext(url: str, sslmode: str) -> None:
    # Before: every DATABASE_URL without sslmode connected without TLS, a
    # remote one included, without a word. (No connection is made here.)
    assert DatabaseSettings.from_env({"DATABASE_URL": url}).sslmode == sslmode


def test_the_secrets_database_holds_unless_db_name_is_set(aws: None) -> None:
    # Issue 32, item 4: with DatabaseHost set (a proxy), DatabaseName's default
    # `postgres` silently replaced the secret's dbname.
    from outbox.db import create_engine

    secret = {"username": "relay", "password": "pw", "host": "db.internal", "dbname": "app"}
    arn = boto3.client("secretsmanager").create_secret(
        Name="outbox/db-name", SecretString=json.dumps(secret)
    )["ARN"]
    proxy = {"DB_SECRET_ARN": arn, "DB_HOST": "proxy.internal"}

    def database(env: dict[str, str]) -> str | None:
        return create_engine(DatabaseSettings.from_env(env)).url.database

    assert database(proxy) == "app"
    assert database({**proxy, "DB_NAME": ""}) == "app"
    assert database({**proxy, "DB_NAME": "other"}) == "other"
    assert database({"DB_SECRET_ARN": arn, "DB_NAME": "other"}) == "other"
    nameless = boto3.client("secretsmanager").create_secret(
        Name="outbox/db-nameless", SecretString=json.dumps({**secret, "dbname": None})
    )["ARN"]
    assert database({"DB_SECRET_ARN": nameless}) == "postgres"
    assert database({"DB_IAM_USER": "relay", "DB_HOST": "db.internal"}) == "postgres"
