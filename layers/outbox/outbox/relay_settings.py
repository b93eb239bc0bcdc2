"""The relay's settings objects (``RelaySettings``, ``DatabaseSettings``,
``OutcomeEventSettings``), read from the environment once, at cold start,
with clear errors.

Every number that shapes the state machine (batch size, lease, attempts,
backoff, retention) is a template parameter that reaches the functions as an
environment variable; secrets never do: only the ARN of the secret holding them.

Each field below names its setting in ``outbox.settings``, which holds the
variable's name, default, bounds and meaning; this module adds the rules
that span settings (one way to reach the database, the lease rule, the
backoff cap) and the objects the relay passes around.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy.engine import make_url

from . import settings as declared
from .errors import ConfigError
from .limits import RateLimit
from .settings import from_setting
from .store import Backoff


def _read_fields(cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    """Each field of ``cls`` that names a setting, read from that setting."""
    return {
        f.name: f.metadata["setting"].read(env)
        for f in dataclasses.fields(cls)
        if "setting" in f.metadata
    }


def _check_database_url(url: str) -> None:
    """One clear error for a URL the relay cannot use; never echoes it (it may
    hold a password). The parsing is ``db.parse_database_url``'s."""
    from .db import parse_database_url

    parse_database_url(url)


@dataclasses.dataclass(frozen=True)
class DatabaseSettings:
    """Where the database is and how to authenticate to it.

    Exactly one of: ``url`` (local development), ``secret_arn`` (a Secrets
    Manager secret in the RDS format), or ``iam_user`` with ``host`` (RDS IAM auth).
    """

    url: str | None = from_setting(declared.DATABASE_URL)
    secret_arn: str | None = from_setting(declared.DB_SECRET_ARN)
    host: str | None = from_setting(declared.DB_HOST)
    port: int = from_setting(declared.DB_PORT)
    name: str | None = from_setting(declared.DB_NAME)
    iam_user: str | None = from_setting(declared.DB_IAM_USER)
    # TLS: "verify-full" (the only choice in AWS), or "disable" for a local URL.
    sslmode: str = from_setting(declared.DB_SSLMODE)
    ca_bundle: str | None = from_setting(declared.DB_CA_BUNDLE)
    connect_timeout: float = from_setting(declared.DB_CONNECT_TIMEOUT)
    # Where the outbox lives: the relay's connections resolve names there only.
    schema: str = from_setting(declared.OUTBOX_SCHEMA)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DatabaseSettings:
        values = _read_fields(cls, env)
        chosen = [
            s.name
            for s in (declared.DATABASE_URL, declared.DB_SECRET_ARN, declared.DB_IAM_USER)
            if s.is_set(env)
        ]
        if not chosen:
            raise ConfigError("DATABASE_URL", "set DATABASE_URL, DB_SECRET_ARN or DB_IAM_USER")
        if len(chosen) > 1:
            raise ConfigError(chosen[1], f"set only one of {', '.join(chosen)}")
        url = values["url"]
        if values["iam_user"] and not values["host"]:
            raise ConfigError("DB_HOST", "required with DB_IAM_USER")
        if not declared.DB_SSLMODE.is_set(env) and url and _is_local(url):
            # A URL to this machine: no TLS by default. Any other host keeps
            # the setting's default, verified TLS (a remote URL without
            # sslmode used to connect in plaintext without a word); the URL's
            # own sslmode, when it has one, decides either way.
            values["sslmode"] = "disable"
        if values["sslmode"] == "disable" and not url:
            raise ConfigError("DB_SSLMODE", "TLS can only be disabled for a local DATABASE_URL")
        if url:
            _check_database_url(url)
        return cls(**values)


def _is_local(url: str) -> bool:
    """Whether a DATABASE_URL names this machine: a unix socket, localhost or
    a loopback address (a URL that does not parse is checked later)."""
    import ipaddress

    try:
        parsed = make_url(url)
    except Exception:
        return True
    host = parsed.host
    if not host or "unix_sock" in parsed.query or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class RelaySettings:
    """The numbers that shape claiming, leasing, retrying and pruning; what
    each one means, its default and its bounds are in ``outbox.settings``."""

    batch_size: int = from_setting(declared.BATCH_SIZE)
    lease_seconds: int = from_setting(declared.LEASE_SECONDS)
    max_attempts: int = from_setting(declared.MAX_ATTEMPTS)
    backoff_base_seconds: float = from_setting(declared.BACKOFF_BASE_SECONDS)
    backoff_cap_seconds: float = from_setting(declared.BACKOFF_CAP_SECONDS)
    max_deferrals: int = from_setting(declared.MAX_DEFERRALS)
    min_deferral_seconds: float = from_setting(declared.MIN_DEFERRAL_SECONDS)
    default_ttl_seconds: int = from_setting(declared.DEFAULT_TTL_SECONDS)
    retention_days: int = from_setting(declared.RETENTION_DAYS)
    # None: failed, dead and expired rows wait for an operator.
    unresolved_retention_days: int | None = from_setting(declared.UNRESOLVED_RETENTION_DAYS)
    attempt_retention_days: int = from_setting(declared.ATTEMPT_RETENTION_DAYS)
    dedupe_window_days: int = from_setting(declared.DEDUPE_WINDOW_DAYS)
    # The longest a sender runs (its Lambda timeout) and the longest an async
    # event may wait in Lambda's queue: invariant 4 of docs/design.md
    # wants both inside the lease.
    sender_timeout_seconds: int = from_setting(declared.SENDER_TIMEOUT_SECONDS)
    max_event_age_seconds: int = from_setting(declared.MAX_EVENT_AGE_SECONDS)
    handoff_chunk_size: int = from_setting(declared.HANDOFF_CHUNK_SIZE)
    send_concurrency: int = from_setting(declared.SEND_CONCURRENCY)
    settle_margin_seconds: float = from_setting(declared.SETTLE_MARGIN_SECONDS)
    dispatch_budget_seconds: float = from_setting(declared.DISPATCH_BUDGET_SECONDS)
    poll_interval_seconds: float = from_setting(declared.POLL_INTERVAL_SECONDS)
    pacing_mode: str = from_setting(declared.PACING_MODE)
    idle_linger_seconds: float = from_setting(declared.IDLE_LINGER_SECONDS)
    # (from_setting gives a map a default_factory: no instance shares one.)
    channel_functions: dict[str, str] = from_setting(declared.CHANNEL_FUNCTIONS)  # noqa: RUF009
    # Reserved concurrency of each channel's function (the template builds it
    # from the <Channel>Concurrency parameters), and explicit in-flight budgets
    # that override the derived one: see in_flight_budgets().
    channel_concurrency: dict[str, int] = from_setting(declared.CHANNEL_CONCURRENCY)  # noqa: RUF009
    # What an entry of 0 (no reservation) counts as.
    unreserved_channel_concurrency: int = from_setting(declared.UNRESERVED_CHANNEL_CONCURRENCY)
    channel_max_in_flight: dict[str, int] = from_setting(declared.CHANNEL_MAX_IN_FLIGHT)  # noqa: RUF009
    # Applied to the database at cold start by whatever claims (the
    # dispatcher, `outbox worker`): docs/how-to/rate-limits.md.
    rate_limits: tuple[RateLimit, ...] = from_setting(declared.RATE_LIMITS)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RelaySettings:
        settings = cls(**_read_fields(cls, os.environ if env is None else env))
        settings.check_lease()
        return settings

    def backoff(self) -> Backoff:
        """The retry policy these settings describe."""
        return Backoff(
            self.backoff_base_seconds,
            self.backoff_cap_seconds,
            self.max_attempts,
            max_deferrals=self.max_deferrals,
            min_deferral_seconds=self.min_deferral_seconds,
            default_ttl_seconds=self.default_ttl_seconds or None,
        )

    def in_flight_budgets(self) -> dict[str, int]:
        """Per channel, the most rows the dispatcher keeps claimed at once.

        A channel's function runs at most C invocations at once (its reserved
        concurrency); each takes one event of up to K rows (HANDOFF_CHUNK_SIZE)
        and is over within T (SENDER_TIMEOUT_SECONDS), however it spreads the
        K rows over its SEND_CONCURRENCY threads: send concurrency makes an
        invocation shorter, but the bound must hold for the slowest one. An
        event must start within W = min(MAX_EVENT_AGE_SECONDS, LEASE_SECONDS - T)
        of its hand-off: later, Lambda drops it for age, or its lease runs out
        before the sender can finish. In the worst case (every invocation runs
        its full T) C invocations start at once and C more every T, so within W
        the channel starts C * (1 + floor(W / T)) events: the bound.

        Rows claimed up to that bound are safe but wait in Lambda's queue, first
        in first out, and a message due now (another tenant's password reset)
        waits behind all of them. So the budget is at most an event running in
        every environment and one waiting for every other one:

            budget = min(C * K * (1 + floor(W / T)), (C + ceil(C / 2)) * K)

        (defaults: min(960, 480) email rows in flight). With the dispatcher
        looking again every ROOM_POLL_SECONDS while a channel is at its budget,
        that keeps every environment busy (the drain through the Lambda
        simulator, bench/README.md) and cuts the wait of a message due behind a
        backlog to about half an event's time. A function that reserves nothing
        (C = 0) has no such bound: C is then UNRESERVED_CHANNEL_CONCURRENCY, an
        assumption. CHANNEL_MAX_IN_FLIGHT replaces the formula for a channel
        (up to the bound, for a single tenant whose Lambda queue is slow to
        deliver); a channel with neither setting has no budget (the batch size
        bounds it).
        """
        window = min(self.max_event_age_seconds, self.lease_seconds - self.sender_timeout_seconds)
        waves = 1 + max(0, window) // self.sender_timeout_seconds
        budgets = {}
        for channel, reserved in self.channel_concurrency.items():
            concurrency = reserved or self.unreserved_channel_concurrency
            bound = concurrency * self.handoff_chunk_size * waves
            lead = (concurrency + (concurrency + 1) // 2) * self.handoff_chunk_size
            budgets[channel] = min(bound, lead)
        budgets.update(self.channel_max_in_flight)
        return budgets

    def check_rate_limit_channels(self, known: Iterable[str]) -> None:
        """ConfigError naming RATE_LIMITS for a limit on a channel that is not
        in ``known`` (the channels this claimer serves)."""
        known = sorted(set(known))
        for limit in self.rate_limits:
            if limit.channel not in known:
                raise ConfigError(
                    "RATE_LIMITS",
                    f"unknown channel {limit.channel!r} (known: {', '.join(known) or 'none'})",
                )

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


@dataclasses.dataclass(frozen=True)
class OutcomeEventSettings:
    """Where outcome events go. An empty bus turns publishing off (the events
    are then dropped after the retention window)."""

    bus: str = from_setting(declared.OUTCOME_EVENT_BUS)
    include_delivered: bool = from_setting(declared.OUTCOME_EVENTS_DELIVERED)
    include_retrying: bool = from_setting(declared.OUTCOME_EVENTS_RETRYING)
    include_keys: bool = from_setting(declared.OUTCOME_EVENTS_INCLUDE_KEYS)
    # How long a publisher holds the events it took: longer than the reaper
    # runs (60 s), so a live publisher never has them taken from it. A
    # publisher that dies leaves them to be published again after this.
    lease_seconds: int = 300

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OutcomeEventSettings:
        return cls(**_read_fields(cls, os.environ if env is None else env))
