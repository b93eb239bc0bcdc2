"""The settings table (outbox.settings) against what reads it: the parsers
the functions run at cold start and the channels (template.yaml is checked in
tests/template/test_template.py; the generated configuration reference in
tests/docs/test_configuration_reference.py).

Each checker returns what it finds out of step; the tests run it on the real
table (expecting nothing) and on a doctored copy
(expecting each doctoring reported), so no check can pass vacuously.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from unittest import mock

import pytest

from outbox import ConfigError, aws, wake
from outbox import settings as table
from outbox.channels.email import EmailChannel
from outbox.channels.eventbridge import EventBridgeChannel
from outbox.channels.webhook import WebhookChannel
from outbox.migrations import revision_module
from outbox.relay_settings import DatabaseSettings, OutcomeEventSettings, RelaySettings
from outbox.runtime import Runtime
from outbox.settings import SETTINGS, Setting
from outbox.worker import Worker

SECRET_ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:outbox/db-AbCdEf"
BASE = {"DATABASE_URL": "postgresql://postgres@127.0.0.1/test"}
# Room for either edge of any one setting: the lease rule (lease > sender
# timeout + event age) and the backoff rule (cap >= base) hold whichever of
# these five is moved to a bound.
ROOMY = {
    **BASE,
    "LEASE_SECONDS": "86400",
    "SENDER_TIMEOUT_SECONDS": "1",
    "MAX_EVENT_AGE_SECONDS": "0",
    "BACKOFF_BASE_SECONDS": "0",
    "BACKOFF_CAP_SECONDS": "604800",
}
# Where a default cannot be seen from BASE: one way to reach the database must
# be set, and a local URL turns TLS off by default.
DEFAULT_ENV = {
    "DATABASE_URL": {"DB_SECRET_ARN": SECRET_ARN},
    "DB_SSLMODE": {"DB_SECRET_ARN": SECRET_ARN},
}

# An AWS client is made with these, never the instance metadata service.
OFFLINE_AWS = {
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
}
_RELAY_ROLE = revision_module("0003").relay_role
_PRODUCER_ROLE = revision_module("0009").producer_role


def relay_reads(env: Mapping[str, str]) -> dict[str, Any]:
    """What the relay makes of ``env``, by variable: the settings objects a
    function builds at cold start (``Runtime``), what the channels, the
    migration and an AWS client take from it. ConfigError when it is refused."""
    with mock.patch.dict(os.environ, {**env, **OFFLINE_AWS}, clear=True):
        runtime = Runtime(os.environ)
        relay, db, events = runtime.settings, runtime.database, runtime.outcome_events
        webhook = WebhookChannel()
        email = EmailChannel(client=object())
        return {
            **{f.name.upper(): getattr(relay, f.name) for f in dataclasses.fields(relay)},
            "DATABASE_URL": db.url,
            "DB_SECRET_ARN": db.secret_arn,
            "DB_IAM_USER": db.iam_user,
            "DB_HOST": db.host,
            "DB_PORT": db.port,
            "DB_NAME": db.name,
            "DB_SSLMODE": db.sslmode,
            "DB_CA_BUNDLE": db.ca_bundle,
            "DB_CONNECT_TIMEOUT": db.connect_timeout,
            "OUTBOX_RELAY_ROLE": _RELAY_ROLE(),
            "OUTBOX_PRODUCER_ROLE": _PRODUCER_ROLE(),
            "OUTBOX_SCHEMA": db.schema,
            "OUTBOX_DISPATCHER_FUNCTION": wake.dispatcher_function(os.environ),  # producers
            "OUTCOME_EVENT_BUS": events.bus,
            "OUTCOME_EVENTS_DELIVERED": events.include_delivered,
            "OUTCOME_EVENTS_RETRYING": events.include_retrying,
            "OUTCOME_EVENTS_INCLUDE_KEYS": events.include_keys,
            "SES_CONFIGURATION_SET": email.configuration_set,
            "SES_SUPPRESSION_CHECK": email.check_suppression,
            "WEBHOOK_SECRET_ARN": webhook.default_secret_id,
            "WEBHOOK_SECRET_ARNS": tuple(
                sorted(webhook.allowed_secret_ids - {webhook.default_secret_id})
            ),
            "WEBHOOK_ALLOW_INSECURE": webhook.allow_insecure,
            "EVENT_BUS_NAME": EventBridgeChannel(client=object()).event_bus,
            "PROVIDER_READ_TIMEOUT_SECONDS": aws.client("events").meta.config.read_timeout,
            "WAKE_SCHEDULE_NAME": runtime.wake_schedule.name if runtime.wake_schedule else "",
            "REAPER_FUNCTION": runtime.reaper_function,
            "WORKER_STOP_GRACE_SECONDS": Worker(engine=None, settings=relay).stop_grace_seconds,  # type: ignore[arg-type]
            "WORKER_PREPARED_CLAIM": Worker(engine=None, settings=relay).prepared_claim,  # type: ignore[arg-type]
            # observability reads these two at import, with the setting itself
            "POWERTOOLS_SERVICE_NAME": table.POWERTOOLS_SERVICE_NAME.read(os.environ),
            "POWERTOOLS_METRICS_NAMESPACE": table.POWERTOOLS_METRICS_NAMESPACE.read(os.environ),
        }


def _edges(setting: Setting[Any]) -> tuple[list[str], list[str]]:
    """(values at the bounds, values just outside them) of a bounded setting."""
    low, high = getattr(setting, "low", None), getattr(setting, "high", None)
    if low is None or high is None:
        return [], []
    if isinstance(setting, table.Float):
        outside = [math.nextafter(low, -math.inf), math.nextafter(high, math.inf)]
    else:
        outside = [low - 1, high + 1]
    if isinstance(setting, table.ChannelMap):
        return [f'{{"email": {low}}}', f'{{"email": {high}}}'], [
            f'{{"email": {v}}}' for v in outside
        ]
    return [repr(low), repr(high)], [repr(v) for v in outside]


def malformed(setting: Setting[Any]) -> list[str]:
    """Text a setting of this kind must refuse (free text refuses nothing)."""
    if isinstance(setting, table.ChannelMap):
        common = ["[1]", "{nope", '{"email": true}']
        return common + (['{"email": ""}'] if setting.low is None else ['{"email": "10"}'])
    if isinstance(setting, table.Text | table.TextList):
        return ["not valid!"] if setting.pattern else []
    return {
        table.Int: ["1.5", "many"],
        table.Float: ["fast", "nan"],
        table.Bool: ["yes", "1", "off"],
        table.Choice: ["prefer", "VERIFY-FULL"],
        table.DaysOrNever: ["soon", "-1", "2.5"],
        # (the bad limits one by one: tests/unit/test_rate_limits_config.py)
        table.RateLimits: ["email", "email=0", "webhook:a b=5", "nope=1/0"],
    }[type(setting)]


def parser_violations(
    settings: Iterable[Setting[Any]], reads: Callable[[Mapping[str, str]], dict[str, Any]]
) -> list[str]:
    found = []

    def outcome(env: Mapping[str, str]) -> dict[str, Any] | ConfigError:
        try:
            return reads(env)
        except ConfigError as exc:
            return exc

    for s in settings:
        env = DEFAULT_ENV.get(s.name, BASE)
        got = outcome(env)
        if isinstance(got, ConfigError):
            found.append(f"{s.name}: the defaults are refused ({got})")
            continue
        if s.name not in got:
            found.append(f"{s.name}: nothing the relay runs reads it")
            continue
        if got[s.name] != s.default:
            found.append(f"{s.name}: the relay's default is {got[s.name]!r}, not {s.default!r}")
        at_edge, outside = _edges(s)
        for text in at_edge:
            got = outcome({**ROOMY, s.name: text})
            if isinstance(got, ConfigError):
                found.append(f"{s.name}: {text} is refused, though it is a bound ({got})")
            elif got[s.name] != s.parse(text):
                found.append(f"{s.name}: {text} reads as {got[s.name]!r}")
        for text in outside + malformed(s):
            got = outcome({**ROOMY, s.name: text})
            if not isinstance(got, ConfigError):
                found.append(f"{s.name}: {text} is accepted")
            elif got.setting != s.name or s.name not in str(got):
                found.append(f"{s.name}: {text} is refused naming {got.setting}")
    return found


def test_the_relay_reads_every_setting_with_the_tables_default_and_bounds() -> None:
    assert parser_violations(SETTINGS, relay_reads) == []


def test_the_parser_check_catches_a_table_out_of_step() -> None:
    doctored = {
        "BATCH_SIZE": {"default": 50},
        "LEASE_SECONDS": {"low": 6},
        "RETENTION_DAYS": {"high": 3651},
        "POLL_INTERVAL_SECONDS": {"low": 0.02},
        "SES_SUPPRESSION_CHECK": {"default": False},
        "DB_PORT": {"default": 5433},
    }
    copy = [dataclasses.replace(s, **doctored.get(s.name, {})) for s in SETTINGS]
    copy.append(table.Int(name="BATCH_SIZES", default=1, low=1, high=2, meaning="a typo"))
    assert parser_violations(copy, relay_reads) == [
        "DB_PORT: the relay's default is 5432, not 5433",
        "BATCH_SIZE: the relay's default is 100, not 50",
        "LEASE_SECONDS: 5 is accepted",
        "RETENTION_DAYS: 3651 is refused, though it is a bound (configuration "
        "RETENTION_DAYS: must be between 1 and 3650, got 3651)",
        "POLL_INTERVAL_SECONDS: 0.019999999999999997 is accepted",
        "SES_SUPPRESSION_CHECK: the relay's default is True, not False",
        "BATCH_SIZES: nothing the relay runs reads it",
    ]


def test_the_settings_objects_default_to_the_table_without_the_environment() -> None:
    """RelaySettings() and friends, built in code (tests, bench, the worker),
    mean the same as an empty environment."""
    for cls, env in (
        (RelaySettings, {}),
        (DatabaseSettings, {"DB_SECRET_ARN": SECRET_ARN}),
        (OutcomeEventSettings, {}),
    ):
        built, read = cls(), cls.from_env(env)  # type: ignore[attr-defined]
        for f in dataclasses.fields(cls):
            if "setting" in f.metadata and f.name not in ("secret_arn",):
                assert getattr(built, f.name) == getattr(read, f.name), (cls, f.name)
                assert getattr(built, f.name) == f.metadata["setting"].default


def test_the_table_declares_each_variable_once_with_a_meaning() -> None:
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names)) and len(names) >= 40
    assert all(s.meaning and "\n" not in s.meaning for s in SETTINGS)
    # each under its own variable's name: outbox.settings.BATCH_SIZE is BATCH_SIZE
    assert [s.name for s in SETTINGS if getattr(table, s.name, None) is not s] == []


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        ("SES_SUPPRESSION_CHECK", "no"),  # once meant true (anything but "false")
        ("WEBHOOK_ALLOW_INSECURE", "1"),  # once meant false (anything but "true")
        ("WEBHOOK_SECRET_ARN", "outbox/webhook"),  # a name, not an ARN
        ("EVENT_BUS_NAME", "bus with spaces"),
        ("PROVIDER_READ_TIMEOUT_SECONDS", "0"),
        ("OUTBOX_RELAY_ROLE", "relay; DROP TABLE outbox_message"),
    ],
)
def test_a_channels_setting_fails_the_cold_start_naming_it(variable: str, text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Runtime({**BASE, variable: text})
    assert caught.value.setting == variable


def test_booleans_are_true_or_false_in_any_case() -> None:
    for variable in (
        "SES_SUPPRESSION_CHECK",
        "WEBHOOK_ALLOW_INSECURE",
        "OUTCOME_EVENTS_DELIVERED",
        "OUTCOME_EVENTS_RETRYING",
        "OUTCOME_EVENTS_INCLUDE_KEYS",
    ):
        assert relay_reads({**BASE, variable: " TRUE "})[variable] is True
        assert relay_reads({**BASE, variable: "False"})[variable] is False


def test_the_commands_batch_size_option_has_the_settings_bounds() -> None:
    import click

    from outbox_cli.cli import cli

    worker = cli.commands["worker"]
    option = next(p for p in worker.params if p.name == "batch_size")
    assert isinstance(option.type, click.IntRange)
    assert (option.type.min, option.type.max) == (table.BATCH_SIZE.low, table.BATCH_SIZE.high)


def test_a_hand_off_chunk_fits_one_hand_off_event() -> None:
    from outbox.handoff import MAX_MESSAGES_PER_EVENT

    assert table.HANDOFF_CHUNK_SIZE.high == MAX_MESSAGES_PER_EVENT
