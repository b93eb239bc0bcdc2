"""Settings read from the environment once, at cold start, with clear errors.

Every number that shapes the state machine (batch size, lease, attempts,
backoff, retention) is a template parameter that reaches the functions as an
environment variable; secrets never do: only the ARN of the secret holding them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError


def _number(
    env: Mapping[str, str], name: str, default: float, lo: float, hi: float, kind: type
) -> Any:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ConfigError(name, f"must be {what}, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ConfigError(name, f"must be between {lo} and {hi}, got {value}")
    return value


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    return int(_number(env, name, default, lo, hi, int))


def _float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    return float(_number(env, name, default, lo, hi, float))


def _channel_counts(env: Mapping[str, str], name: str, lo: int, hi: int) -> dict[str, int]:
    """A JSON object mapping channel names to whole numbers in [lo, hi]."""
    raw = env.get(name) or "{}"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(name, f"must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(name, "must be a JSON object mapping channel names to numbers")
    for channel, number in value.items():
        if isinstance(number, bool) or not isinstance(number, int) or not lo <= number <= hi:
            raise ConfigError(name, f"{channel!r} must be a whole number from {lo} to {hi}")
    return dict(value)


def _days_or_never(env: Mapping[str, str], name: str) -> int | None:
    raw = (env.get(name) or "never").strip().lower()
    if raw == "never":
        return None
    if not raw.isdigit():
        raise ConfigError(name, f"must be a whole number of days or never, got {raw!r}")
    return _int({name: raw}, name, 0, 1, 3650)


def _check_database_url(url: str) -> None:
    """One clear error for a malformed URL; never echoes it (it may hold a password)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
        port = parsed.port
    except (ArgumentError, ValueError, TypeError):
        raise ConfigError(
            "DATABASE_URL", "is not a valid URL (postgresql://user:password@host:port/database)"
        ) from None
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise ConfigError("DATABASE_URL", "must be a postgresql:// URL")
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError("DATABASE_URL", "has a port outside 1 to 65535")


@dataclass(frozen=True)
class DatabaseSettings:
    """Where the database is and how to authenticate to it.

    Exactly one of: ``url`` (local development), ``secret_arn`` (a Secrets
    Manager secret in the RDS format), or ``iam_user`` with ``host`` (RDS IAM auth).
    """

    url: str | None = None
    secret_arn: str | None = None
    host: str | None = None
    port: int = 5432
    name: str = "postgres"
    iam_user: str | None = None
    # TLS: "verify-full" (the only choice in AWS), or "disable" for a local URL.
    sslmode: str = "verify-full"
    ca_bundle: str | None = None
    connect_timeout: float = 10.0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DatabaseSettings:
        url = env.get("DATABASE_URL") or None
        secret_arn = env.get("DB_SECRET_ARN") or None
        iam_user = env.get("DB_IAM_USER") or None
        chosen = [
            n
            for n, v in (
                ("DATABASE_URL", url),
                ("DB_SECRET_ARN", secret_arn),
                ("DB_IAM_USER", iam_user),
            )
            if v
        ]
        if not chosen:
            raise ConfigError("DATABASE_URL", "set DATABASE_URL, DB_SECRET_ARN or DB_IAM_USER")
        if len(chosen) > 1:
            raise ConfigError(chosen[1], f"set only one of {', '.join(chosen)}")
        if iam_user and not env.get("DB_HOST"):
            raise ConfigError("DB_HOST", "required with DB_IAM_USER")
        sslmode = env.get("DB_SSLMODE") or ("disable" if url else "verify-full")
        if sslmode not in ("verify-full", "disable"):
            raise ConfigError("DB_SSLMODE", f"must be verify-full or disable, got {sslmode!r}")
        if sslmode == "disable" and not url:
            raise ConfigError("DB_SSLMODE", "TLS can only be disabled for a local DATABASE_URL")
        if url:
            _check_database_url(url)
        return cls(
            url=url,
            secret_arn=secret_arn,
            host=env.get("DB_HOST") or None,
            port=_int(env, "DB_PORT", 5432, 1, 65535),
            name=env.get("DB_NAME") or "postgres",
            iam_user=iam_user,
            sslmode=sslmode,
            ca_bundle=env.get("DB_CA_BUNDLE") or None,
            connect_timeout=_float(env, "DB_CONNECT_TIMEOUT", 10.0, 1.0, 120.0),
        )


@dataclass(frozen=True)
class RelaySettings:
    """The numbers that shape claiming, leasing, retrying and pruning."""

    batch_size: int = 100
    lease_seconds: int = 120
    # Retries span 31 to 62 minutes from the first failure to dead (the seven
    # jittered delays 30 s .. 30 min before attempts 2..8): a real provider
    # outage, not half a minute of one, is what a message must outlive.
    max_attempts: int = 8
    backoff_base_seconds: float = 30.0
    backoff_cap_seconds: float = 1800.0
    # Deferrals (throttling) a message may take before each counts an attempt.
    max_deferrals: int = 20
    # The shortest deferral: "retry after 0 s" must not loop a message.
    min_deferral_seconds: float = 5.0
    # A message not delivered this long after it was first due ends expired
    # (unless it set its own deliver-by time); 0: no default.
    default_ttl_seconds: int = 86_400
    retention_days: int = 7
    # failed, dead and expired rows wait for an operator (redrive, cancel,
    # `outbox prune`): None keeps them until then; a number prunes them
    # after that many days (at least 1).
    unresolved_retention_days: int | None = None
    # The send log (outbox_attempt) and the dedupe keys each have their own
    # retention, independent of the messages'.
    attempt_retention_days: int = 90
    dedupe_window_days: int = 30
    # The longest a sender runs (its Lambda timeout) and the longest an async
    # event may wait in Lambda's queue: invariant 4 of docs/design.md
    # wants both inside the lease.
    sender_timeout_seconds: int = 30
    max_event_age_seconds: int = 60
    # A multiple of send_concurrency: an event's provider calls go in waves of
    # that many, and a part-filled last wave leaves threads idle (20 over 8: 0.8
    # of the rate the threads could reach at 100 ms a call, 0.66 at 20 ms). Four
    # waves spread the event's receipt and settle over enough calls to reach 0.9
    # of that rate at 20 ms a call (bench/README.md, "provider").
    handoff_chunk_size: int = 32
    send_concurrency: int = 8
    # Stop starting provider calls this long before the lease or the Lambda ends,
    # leaving time for the settle transaction.
    settle_margin_seconds: float = 3.0
    dispatch_budget_seconds: float = 50.0
    poll_interval_seconds: float = 0.2
    channel_functions: dict[str, str] = field(default_factory=dict)
    # Reserved concurrency of each channel's function (the template builds it
    # from the <Channel>Concurrency parameters), and explicit in-flight budgets
    # that override the derived one: see in_flight_budgets().
    channel_concurrency: dict[str, int] = field(default_factory=dict)
    channel_max_in_flight: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RelaySettings:
        env = os.environ if env is None else env
        raw_functions = env.get("CHANNEL_FUNCTIONS") or "{}"
        try:
            functions = json.loads(raw_functions)
        except json.JSONDecodeError as exc:
            raise ConfigError("CHANNEL_FUNCTIONS", f"must be a JSON object: {exc}") from None
        if not isinstance(functions, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in functions.items()
        ):
            raise ConfigError("CHANNEL_FUNCTIONS", "must map channel names to function names")
        settings = cls(
            batch_size=_int(env, "BATCH_SIZE", 100, 1, 10_000),
            lease_seconds=_int(env, "LEASE_SECONDS", 120, 5, 86_400),
            max_attempts=_int(env, "MAX_ATTEMPTS", 8, 1, 1_000),
            backoff_base_seconds=_float(env, "BACKOFF_BASE_SECONDS", 30.0, 0.0, 86_400.0),
            backoff_cap_seconds=_float(env, "BACKOFF_CAP_SECONDS", 1800.0, 0.0, 604_800.0),
            max_deferrals=_int(env, "MAX_DEFERRALS", 20, 0, 10_000),
            min_deferral_seconds=_float(env, "MIN_DEFERRAL_SECONDS", 5.0, 0.0, 3600.0),
            default_ttl_seconds=_int(env, "DEFAULT_TTL_SECONDS", 86_400, 0, 366 * 86_400),
            retention_days=_int(env, "RETENTION_DAYS", 7, 1, 3650),
            unresolved_retention_days=_days_or_never(env, "UNRESOLVED_RETENTION_DAYS"),
            attempt_retention_days=_int(env, "ATTEMPT_RETENTION_DAYS", 90, 0, 3650),
            dedupe_window_days=_int(env, "DEDUPE_WINDOW_DAYS", 30, 0, 3650),
            sender_timeout_seconds=_int(env, "SENDER_TIMEOUT_SECONDS", 30, 1, 900),
            max_event_age_seconds=_int(env, "MAX_EVENT_AGE_SECONDS", 60, 0, 21_600),
            handoff_chunk_size=_int(env, "HANDOFF_CHUNK_SIZE", 32, 1, 1_000),
            send_concurrency=_int(env, "SEND_CONCURRENCY", 8, 1, 256),
            settle_margin_seconds=_float(env, "SETTLE_MARGIN_SECONDS", 3.0, 0.0, 600.0),
            dispatch_budget_seconds=_float(env, "DISPATCH_BUDGET_SECONDS", 50.0, 0.0, 900.0),
            poll_interval_seconds=_float(env, "POLL_INTERVAL_SECONDS", 0.2, 0.01, 60.0),
            channel_functions=functions,
            channel_concurrency=_channel_counts(env, "CHANNEL_CONCURRENCY", 1, 10_000),
            channel_max_in_flight=_channel_counts(env, "CHANNEL_MAX_IN_FLIGHT", 1, 1_000_000),
        )
        settings.check_lease()
        return settings

    def in_flight_budgets(self) -> dict[str, int]:
        """Per channel, the most rows the dispatcher keeps claimed at once.

        A channel's function runs at most C invocations at once (its reserved
        concurrency); each takes one event of up to K rows (HANDOFF_CHUNK_SIZE)
        and is over within T (SENDER_TIMEOUT_SECONDS), however it spreads the
        K rows over its SEND_CONCURRENCY threads: send concurrency makes an
        invocation shorter, but the budget must hold for the slowest one. An
        event must start within W = min(MAX_EVENT_AGE_SECONDS, LEASE_SECONDS - T)
        of its hand-off: later, Lambda drops it for age, or its lease runs out
        before the sender can finish. In the worst case (every invocation runs
        its full T) C invocations start at once and C more every T, so within W
        the channel starts C * (1 + floor(W / T)) events:

            budget = C * K * (1 + floor(W / T))

        (defaults: 10 * 32 * (1 + 60 // 30) = 960 email rows in flight). Rows
        claimed beyond it would only wait in Lambda's queue until they are
        dropped. CHANNEL_MAX_IN_FLIGHT replaces the formula for a channel; a
        channel with neither setting has no budget (the batch size bounds it).
        """
        window = min(self.max_event_age_seconds, self.lease_seconds - self.sender_timeout_seconds)
        waves = 1 + max(0, window) // self.sender_timeout_seconds
        budgets = {
            channel: concurrency * self.handoff_chunk_size * waves
            for channel, concurrency in self.channel_concurrency.items()
        }
        budgets.update(self.channel_max_in_flight)
        return budgets

    def check_lease(self) -> None:
        """docs/design.md, invariant 4: a sender and its queued event must fit inside the lease."""
        needed = self.sender_timeout_seconds + self.max_event_age_seconds
        if self.lease_seconds <= needed:
            raise ConfigError(
                "LEASE_SECONDS",
                f"{self.lease_seconds}s must exceed SENDER_TIMEOUT_SECONDS + "
                f"MAX_EVENT_AGE_SECONDS ({needed}s), or a claim can expire mid-send",
            )
        if self.backoff_cap_seconds < self.backoff_base_seconds:
            raise ConfigError("BACKOFF_CAP_SECONDS", "must not be below BACKOFF_BASE_SECONDS")


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw not in ("true", "false"):
        raise ConfigError(name, f"must be true or false, got {raw!r}")
    return raw == "true"


_EVENT_BUS = re.compile(
    r"^(arn:aws[a-z-]*:events:[a-z0-9-]+:[0-9]{12}:event-bus/)?[A-Za-z0-9/_.-]+$"
)


@dataclass(frozen=True)
class OutcomeEventSettings:
    """Where outcome events go. An empty bus turns publishing off (the events
    are then dropped after the retention window)."""

    bus: str = ""
    include_delivered: bool = False
    # How long a publisher holds the events it took: longer than the reaper
    # runs (60 s), so a live publisher never has them taken from it. A
    # publisher that dies leaves them to be published again after this.
    lease_seconds: int = 300

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OutcomeEventSettings:
        env = os.environ if env is None else env
        bus = (env.get("OUTCOME_EVENT_BUS") or "").strip()
        if bus and not _EVENT_BUS.match(bus):
            raise ConfigError("OUTCOME_EVENT_BUS", f"not an event bus name or ARN: {bus!r}")
        return cls(
            bus=bus,
            include_delivered=_bool(env, "OUTCOME_EVENTS_DELIVERED", False),
        )
