"""Every setting of the relay, declared once: its environment variable, type,
default, bounds and meaning.

``outbox.relay_settings`` builds its settings objects from these declarations, the
channels read their own through them, tests check the parsers and
``template.yaml`` against them, and the docs site's configuration reference is
generated from them (docgen/configuration.py): a name, a default or a bound is
written here and nowhere else.

Reading is strict. An unset or blank variable takes the default; anything
else must parse and fall inside the bounds, or ``ConfigError`` names the
variable. Booleans are ``true`` or ``false`` in any case, nothing else (a
typo must not silently mean either). ``Runtime`` reads the whole table at
cold start, so a malformed setting stops the function before its first
invocation, whichever part of the relay would have read it.

``POWERTOOLS_SERVICE_NAME`` and ``POWERTOOLS_METRICS_NAMESPACE`` are
Powertools' own variables; they are declared here because the relay reads
them too (to name its metrics) and the template sets them. Powertools' other
variables (``POWERTOOLS_LOG_LEVEL``, ``POWERTOOLS_METRICS_DISABLED``, ...)
belong to Powertools alone: not declared, not checked.

Pure standard library: the producer package imports this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, NoReturn, TypeVar, cast

from .errors import ConfigError
from .limits import RateLimit, parse_rate_limits

T = TypeVar("T")
N = TypeVar("N", int, float)


@dataclass(frozen=True, kw_only=True)
class Setting(Generic[T]):
    """One environment variable: its name, its default and what it means."""

    name: str
    default: T
    meaning: str
    # False: the template never sets it, so in AWS the default applies (or it
    # is for local runs only). The template test holds the template to it.
    in_template: bool = True
    # The default of the template's parameter, where it differs on purpose
    # from the default of a local run. None: the same default.
    aws_default: str | None = None

    def read(self, env: Mapping[str, str]) -> T:
        """The value ``env`` gives this setting: the default when unset or blank."""
        raw = env.get(self.name)
        if raw is None or not raw.strip():
            return self.default
        return self.parse(raw.strip())

    def is_set(self, env: Mapping[str, str]) -> bool:
        return bool((env.get(self.name) or "").strip())

    def parse(self, text: str) -> T:
        """The value of a non-blank ``text``, or ConfigError naming the setting."""
        raise NotImplementedError

    def document(self, value: T) -> str:
        """``value`` as the configuration reference writes it ("" for none)."""
        if value is None:
            return ""
        return str(value)

    def fail(self, problem: str) -> NoReturn:
        raise ConfigError(self.name, problem)


@dataclass(frozen=True, kw_only=True)
class Number(Setting[N]):
    """A number in [low, high]."""

    low: N
    high: N
    # The template's parameter allows a narrower range where AWS or the stack
    # does (Lambda takes no event age under 60 s; the dispatcher's timeout is
    # 60 s). None: the same range. Local runs may use the wider one.
    aws_bounds: tuple[N, N] | None = None

    def bounded(self, value: N) -> N:
        if not self.low <= value <= self.high:  # also refuses nan
            self.fail(f"must be between {self.low} and {self.high}, got {value}")
        return value

    def template_bounds(self) -> tuple[N, N]:
        return self.aws_bounds or (self.low, self.high)


@dataclass(frozen=True, kw_only=True)
class Int(Number[int]):
    def parse(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            self.fail(f"must be a whole number, got {text!r}")
        return self.bounded(value)


@dataclass(frozen=True, kw_only=True)
class Float(Number[float]):
    def parse(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            self.fail(f"must be a number, got {text!r}")
        return self.bounded(value)

    def document(self, value: float) -> str:
        return str(int(value)) if value.is_integer() else repr(value)


@dataclass(frozen=True, kw_only=True)
class Bool(Setting[bool]):
    choices: tuple[str, ...] = ("true", "false")

    def parse(self, text: str) -> bool:
        lowered = text.lower()
        if lowered not in self.choices:
            self.fail(f"must be true or false, got {text!r}")
        return lowered == "true"

    def document(self, value: bool) -> str:
        return "true" if value else "false"


@dataclass(frozen=True, kw_only=True)
class Choice(Setting[str]):
    choices: tuple[str, ...]

    def parse(self, text: str) -> str:
        if text not in self.choices:
            self.fail(f"must be {' or '.join(self.choices)}, got {text!r}")
        return text


@dataclass(frozen=True, kw_only=True)
class Text(Setting[T]):
    """Free text, or text matching ``pattern``. T is ``str``, or ``str | None``
    when unset means "none"."""

    pattern: str | None = None
    # What the pattern describes, for the error ("an event bus name or ARN").
    expected: str = ""

    def parse(self, text: str) -> T:
        if self.pattern is not None and not re.fullmatch(self.pattern, text):
            self.fail(f"must be {self.expected or 'text matching ' + self.pattern}, got {text!r}")
        return cast(T, text)


@dataclass(frozen=True, kw_only=True)
class TextList(Setting[tuple[str, ...]]):
    """Comma-separated values; blanks around and between them are dropped."""

    pattern: str | None = None
    expected: str = ""

    def parse(self, text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        for item in items:
            if self.pattern is not None and not re.fullmatch(self.pattern, item):
                self.fail(f"must list {self.expected}, got {item!r}")
        return items

    def document(self, value: tuple[str, ...]) -> str:
        return ",".join(value)


@dataclass(frozen=True, kw_only=True)
class DaysOrNever(Setting[int | None]):
    """A whole number of days in [low, high], or ``never`` (None)."""

    low: int
    high: int

    def parse(self, text: str) -> int | None:
        lowered = text.lower()
        if lowered == "never":
            return None
        if not lowered.isdigit():
            self.fail(f"must be a whole number of days or never, got {text!r}")
        value = int(lowered)
        if not self.low <= value <= self.high:
            self.fail(f"must be between {self.low} and {self.high}, got {value}")
        return value

    def document(self, value: int | None) -> str:
        return "never" if value is None else str(value)


@dataclass(frozen=True, kw_only=True)
class ChannelMap(Setting[dict[str, Any]]):
    """A JSON object keyed by channel name: whole numbers in [low, high], or
    (``low`` None) non-empty strings."""

    default: dict[str, Any] = field(default_factory=dict)
    low: int | None = None
    high: int | None = None

    def read(self, env: Mapping[str, str]) -> dict[str, Any]:
        return dict(super().read(env))  # a copy: the default is shared

    def parse(self, text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            self.fail(f"must be a JSON object: {exc}")
        if not isinstance(value, dict):
            self.fail("must be a JSON object keyed by channel name")
        for channel, item in value.items():
            if self.low is None or self.high is None:
                if not isinstance(item, str) or not item:
                    self.fail("must map channel names to function names")
            elif (
                isinstance(item, bool)
                or not isinstance(item, int)
                or not self.low <= item <= self.high
            ):
                self.fail(f"{channel!r} must be a whole number from {self.low} to {self.high}")
        return value

    def document(self, value: dict[str, Any]) -> str:
        return json.dumps(value)


@dataclass(frozen=True, kw_only=True)
class RateLimits(Setting[tuple[RateLimit, ...]]):
    """Comma-separated ``CHANNEL[:DESTINATION]=RATE[/BURST]`` (``outbox.limits``)."""

    def parse(self, text: str) -> tuple[RateLimit, ...]:
        try:
            return parse_rate_limits(text)
        except ValueError as exc:
            self.fail(str(exc))

    def document(self, value: tuple[RateLimit, ...]) -> str:
        return ",".join(limit.spelt() for limit in value)


# --- the table ------------------------------------------------------------------

_SECRET_ARN = r"arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:[A-Za-z0-9/_+=.@-]+"  # noqa: S105 (a pattern)
_BUS_NAME = r"[A-Za-z0-9/_.-]{1,256}"
_BUS_NAME_OR_ARN = rf"(arn:aws[a-z-]*:events:[a-z0-9-]+:[0-9]{{12}}:event-bus/)?{_BUS_NAME}"

# Database
DATABASE_URL = Text[str | None](
    name="DATABASE_URL",
    default=None,
    meaning="postgresql://user:password@host:port/db, for local runs and tests",
    in_template=False,  # a URL can carry a password: never in AWS
)
DB_SECRET_ARN = Text[str | None](
    name="DB_SECRET_ARN",
    default=None,
    meaning="Secrets Manager secret in the RDS format the database user comes from",
)
DB_IAM_USER = Text[str | None](
    name="DB_IAM_USER", default=None, meaning="database user for RDS IAM auth"
)
DB_HOST = Text[str | None](
    name="DB_HOST",
    default=None,
    meaning="database or RDS Proxy endpoint (default: the secret's host)",
)
DB_PORT = Int(name="DB_PORT", default=5432, low=1, high=65535, meaning="database port")
DB_NAME = Text[str | None](
    name="DB_NAME",
    default=None,  # a secret names its database; only when set does this win over it
    meaning="database name (default: the secret's dbname, else postgres)",
)
DB_SSLMODE = Choice(
    name="DB_SSLMODE",
    default="verify-full",
    choices=("verify-full", "disable"),
    meaning="TLS; disable only for a local DATABASE_URL (its default there)",
)
DB_CA_BUNDLE = Text[str | None](
    name="DB_CA_BUNDLE", default=None, meaning="CA bundle file (default: the system roots)"
)
DB_CONNECT_TIMEOUT = Float(
    name="DB_CONNECT_TIMEOUT",
    # 30, not 10: a paused Aurora Serverless v2 resumes on the first connect
    # in about 15 s, and a shorter timeout would fail every run that wakes it.
    default=30.0,
    low=1.0,
    high=120.0,
    meaning=(
        "seconds to connect to the database (and pg8000's socket timeout); long enough for "
        "a paused Aurora Serverless v2 to resume (about 15 s)"
    ),
    in_template=False,
)
OUTBOX_RELAY_ROLE = Text[str](
    name="OUTBOX_RELAY_ROLE",
    default="outbox_relay",
    pattern=r"[a-z_][a-z0-9_]{0,62}",
    expected="a lower-case SQL identifier",
    meaning="migrations: the group role granted DML on the outbox tables",
)
OUTBOX_PRODUCER_ROLE = Text[str](
    name="OUTBOX_PRODUCER_ROLE",
    default="outbox_producer",
    pattern=r"[a-z_][a-z0-9_]{0,62}",
    expected="a lower-case SQL identifier",
    meaning="migrations: the group role granted EXECUTE on the enqueue functions, nothing else",
)
# Read by the relay (its connections resolve names there only) and by the
# producer (it calls the enqueue function by this schema's name).
OUTBOX_SCHEMA = Text[str](
    name="OUTBOX_SCHEMA",
    default="public",
    pattern=r"[a-z_][a-z0-9_]{0,62}",
    expected="a lower-case SQL identifier",
    meaning="the schema that holds the outbox tables and functions",
)

# The state machine's numbers
BATCH_SIZE = Int(
    name="BATCH_SIZE",
    default=100,
    low=1,
    high=10_000,
    meaning=(
        "rows per claim statement and per reap batch (the dispatcher: rounded down to "
        "whole HANDOFF_CHUNK_SIZE events)"
    ),
)
LEASE_SECONDS = Int(
    name="LEASE_SECONDS",
    default=120,
    low=5,
    high=86_400,
    # More than the template's smallest sender timeout (5) plus Lambda's
    # smallest event age (60): the lease rule, checked at cold start, with the
    # template's own minimums.
    aws_bounds=(66, 86_400),
    meaning="claim lease; must exceed SENDER_TIMEOUT_SECONDS + MAX_EVENT_AGE_SECONDS",
)
SENDER_TIMEOUT_SECONDS = Int(
    name="SENDER_TIMEOUT_SECONDS",
    default=30,
    low=1,
    high=900,  # Lambda's longest timeout
    aws_bounds=(5, 900),  # a channel function's cold start alone can take a few seconds
    meaning="the channel functions' timeout",
)
MAX_EVENT_AGE_SECONDS = Int(
    name="MAX_EVENT_AGE_SECONDS",
    default=60,
    low=0,
    high=21_600,
    aws_bounds=(60, 21_600),  # what Lambda's MaximumEventAgeInSeconds accepts
    meaning="longest an async event waits in Lambda's queue",
)
MAX_ATTEMPTS = Int(
    name="MAX_ATTEMPTS",
    default=8,
    low=1,
    high=1_000,
    # With the default backoff, retries span 31 to 62 minutes from the first
    # failure to dead: a real provider outage must be outlived.
    meaning="attempts before a message is dead (a message may set its own)",
)
BACKOFF_BASE_SECONDS = Float(
    name="BACKOFF_BASE_SECONDS",
    default=30.0,
    low=0.0,
    high=86_400.0,
    meaning="first retry delay (doubles per attempt, jittered)",
)
BACKOFF_CAP_SECONDS = Float(
    name="BACKOFF_CAP_SECONDS",
    default=1800.0,
    low=0.0,
    high=604_800.0,
    meaning="longest retry delay, also for a delay a channel asks for; at least the base",
)
MAX_DEFERRALS = Int(
    name="MAX_DEFERRALS",
    default=20,
    low=0,
    high=10_000,
    meaning="deferrals a message may take without counting an attempt",
)
MIN_DEFERRAL_SECONDS = Float(
    name="MIN_DEFERRAL_SECONDS",
    default=5.0,
    low=0.0,
    high=3600.0,
    meaning='the shortest deferral: "retry after 0 s" must not loop a message',
)
DEFAULT_TTL_SECONDS = Int(
    name="DEFAULT_TTL_SECONDS",
    default=86_400,
    low=0,
    high=366 * 86_400,
    meaning="deliver-by time of a message without its own, from when it is first due; 0: none",
)
RETENTION_DAYS = Int(
    name="RETENTION_DAYS",
    default=7,
    low=1,
    high=3650,
    meaning="delivered, suppressed and cancelled rows older than this are pruned",
)
UNRESOLVED_RETENTION_DAYS = DaysOrNever(
    name="UNRESOLVED_RETENTION_DAYS",
    default=None,
    low=1,
    high=3650,
    meaning="failed, dead and expired rows are pruned after this many days; never: kept",
)
ATTEMPT_RETENTION_DAYS = Int(
    name="ATTEMPT_RETENTION_DAYS",
    default=90,
    low=0,
    high=3650,
    meaning="attempt rows older than this are pruned once their message is gone",
)
DEDUPE_WINDOW_DAYS = Int(
    name="DEDUPE_WINDOW_DAYS",
    default=30,
    low=0,
    high=3650,
    meaning="how long a dedupe key holds after its first enqueue",
)
# A multiple of SEND_CONCURRENCY, because an event's provider calls go out in
# waves of that many and a part-filled last wave leaves threads idle. Four
# waves spread the event's receipt and settle over enough calls for a fast
# provider to keep the threads busy (the measurements are in bench/README.md,
# "provider").
HANDOFF_CHUNK_SIZE = Int(
    name="HANDOFF_CHUNK_SIZE",
    default=32,
    low=1,
    high=1_000,  # a hand-off event holds at most 1,000 messages
    meaning="messages per hand-off event",
)
SEND_CONCURRENCY = Int(
    name="SEND_CONCURRENCY",
    default=8,
    low=1,
    high=256,
    meaning="concurrent provider calls in one channel invocation",
)
SETTLE_MARGIN_SECONDS = Float(
    name="SETTLE_MARGIN_SECONDS",
    default=3.0,
    low=0.0,
    high=600.0,
    meaning="stop starting sends this long before the lease or the Lambda ends",
    in_template=False,
)
WORKER_STOP_GRACE_SECONDS = Float(
    name="WORKER_STOP_GRACE_SECONDS",
    default=10.0,
    low=0.0,
    high=900.0,
    meaning="outbox worker: after SIGTERM, how long provider calls already running may "
    "take; then they are given up and settled as retries, and the worker exits",
    in_template=False,  # only `outbox worker` reads it
)
WORKER_PREPARED_CLAIM = Bool(
    name="WORKER_PREPARED_CLAIM",
    # A third of a small batch's claim is planning and sending its text
    # (bench/README.md); the worker holds its connections, so a session that
    # keeps the statement costs nothing more.
    default=True,
    meaning="outbox worker: prepare the claim and the settle once per database connection; "
    "set false behind a pooler that shares a session between clients per transaction "
    "(PgBouncer in transaction mode)",
    in_template=False,  # only `outbox worker` reads it
)
DISPATCH_BUDGET_SECONDS = Float(
    name="DISPATCH_BUDGET_SECONDS",
    default=50.0,
    low=0.0,
    high=900.0,
    aws_bounds=(0.0, 55.0),  # the dispatcher function's timeout is 60 s
    meaning="how long one dispatcher run keeps claiming; 0: one pass",
)
POLL_INTERVAL_SECONDS = Float(
    name="POLL_INTERVAL_SECONDS",
    default=0.2,
    low=0.01,
    high=60.0,
    meaning="dispatcher poll interval while idle within its budget",
)
# Pacing (docs/how-to/pacing.md): whether the relay sleeps when idle.
PACING_MODE = Choice(
    name="PACING_MODE",
    default="sleep",
    choices=("sleep", "poll"),
    meaning=(
        "sleep: a dispatcher run ends after IDLE_LINGER_SECONDS with nothing due and "
        "arranges its next wake-up, and no function keeps a database connection between "
        "invocations; poll: a run claims for its whole budget"
    ),
)
IDLE_LINGER_SECONDS = Float(
    name="IDLE_LINGER_SECONDS",
    default=2.0,
    low=0.0,
    high=900.0,
    aws_bounds=(0.0, 55.0),  # inside the dispatcher's 60 s timeout
    meaning="sleep mode: a dispatcher run ends once nothing was due for this long",
)
WAKE_SCHEDULE_NAME = Text[str](
    name="WAKE_SCHEDULE_NAME",
    default="",
    meaning=(
        "sleep mode: the one-time schedule (default group) the dispatcher moves to its "
        "next wake-up; empty: none, the safety-net schedule alone"
    ),
)
REAPER_FUNCTION = Text[str](
    name="REAPER_FUNCTION",
    default="",
    meaning="sleep mode: the reaper function the dispatcher wakes when outcome events wait",
)
CHANNEL_FUNCTIONS = ChannelMap(
    name="CHANNEL_FUNCTIONS",
    meaning="dispatcher: JSON map channel to the function it hands off to",
)
CHANNEL_CONCURRENCY = ChannelMap(
    name="CHANNEL_CONCURRENCY",
    low=0,
    high=10_000,
    meaning=(
        "dispatcher: JSON map channel to its function's reserved concurrency; "
        "0: none reserved, the budget assumes UNRESERVED_CHANNEL_CONCURRENCY"
    ),
)
# A function that reserves nothing may run as many times at once as the
# account's unreserved pool allows, or as few as none: the budget assumes this.
UNRESERVED_CHANNEL_CONCURRENCY = Int(
    name="UNRESERVED_CHANNEL_CONCURRENCY",
    default=2,
    low=1,
    high=1_000,
    meaning=(
        "dispatcher: the concurrency a channel's in-flight budget assumes when its "
        "function reserves none (CHANNEL_CONCURRENCY 0)"
    ),
)
CHANNEL_MAX_IN_FLIGHT = ChannelMap(
    name="CHANNEL_MAX_IN_FLIGHT",
    low=1,
    high=1_000_000,
    meaning="dispatcher: JSON map channel to an in-flight budget replacing the derived one",
)
RATE_LIMITS = RateLimits(
    name="RATE_LIMITS",
    default=(),
    meaning=(
        "dispatcher and outbox worker: rate limits, comma-separated "
        "CHANNEL[:DESTINATION]=RATE[/BURST] in messages a second and at once "
        "(email=14,webhook:hooks.example.com=10/20); applied to the database at cold "
        "start; an operator's outbox limit set overrides one (docs/how-to/rate-limits.md)"
    ),
)

# Producers
OUTBOX_DISPATCHER_FUNCTION = Text[str | None](
    name="OUTBOX_DISPATCHER_FUNCTION",
    default=None,
    # A function name, or its ARN (any partition), with an optional version or alias.
    pattern=r"(arn:aws[a-z-]*:lambda:[a-z0-9-]+:[0-9]{12}:function:)?[A-Za-z0-9_-]{1,64}"
    r"(:[A-Za-z0-9_$-]{1,128})?",
    expected="a Lambda function name or ARN",
    meaning="producers: the dispatcher to wake after a commit that enqueued; unset: none",
    in_template=False,  # the producer's own setting, in the producer's environment
)

# Outcome events
OUTCOME_EVENT_BUS = Text[str](
    name="OUTCOME_EVENT_BUS",
    default="",
    pattern=_BUS_NAME_OR_ARN,
    expected="an event bus name or ARN",
    aws_default="default",  # deployed, the account's default bus; locally, off
    meaning="reaper: bus for outcome events; empty: publishing off",
)
OUTCOME_EVENTS_DELIVERED = Bool(
    name="OUTCOME_EVENTS_DELIVERED",
    default=False,
    meaning="also publish an outcome event per delivered message",
)
OUTCOME_EVENTS_RETRYING = Bool(
    name="OUTCOME_EVENTS_RETRYING",
    default=False,  # a retry storm would be as many events
    meaning="also publish an outcome event per retry (when, and which attempt)",
)
OUTCOME_EVENTS_INCLUDE_KEYS = Bool(
    name="OUTCOME_EVENTS_INCLUDE_KEYS",
    default=False,  # producer-chosen keys may name a person; the bus is shared
    meaning="reaper: put each message's dedupe_key and ordering_key in its outcome event",
)

# Channels
SES_CONFIGURATION_SET = Text[str | None](
    name="SES_CONFIGURATION_SET",
    default=None,
    pattern=r"[A-Za-z0-9_-]{1,64}",  # what SES accepts as a name
    expected="an SES configuration set name (letters, digits, _ and -, up to 64)",
    meaning="email: configuration set for every message",
)
SES_SUPPRESSION_CHECK = Bool(
    name="SES_SUPPRESSION_CHECK",
    default=True,
    meaning="email: look recipients up on the SES suppression list first",
)
WEBHOOK_SECRET_ARN = Text[str | None](
    name="WEBHOOK_SECRET_ARN",
    default=None,
    pattern=_SECRET_ARN,
    expected="a Secrets Manager secret ARN",
    meaning="webhook: ARN of the default signing secret",
)
WEBHOOK_SECRET_ARNS = TextList(
    name="WEBHOOK_SECRET_ARNS",
    default=(),
    pattern=_SECRET_ARN,
    expected="Secrets Manager secret ARNs",
    meaning="webhook: further signing secrets a payload's secret_id may name",
)
WEBHOOK_ALLOW_INSECURE = Bool(
    name="WEBHOOK_ALLOW_INSECURE",
    default=False,
    meaning="webhook: allow http and loopback receivers (local development only)",
    in_template=False,
)
EVENT_BUS_NAME = Text[str](
    name="EVENT_BUS_NAME",
    default="default",
    pattern=_BUS_NAME_OR_ARN,
    expected="an event bus name or ARN",
    meaning="eventbridge: default bus",
)
PROVIDER_READ_TIMEOUT_SECONDS = Float(
    name="PROVIDER_READ_TIMEOUT_SECONDS",
    default=10.0,
    low=1.0,
    high=900.0,
    meaning="read timeout of the AWS provider clients",
    in_template=False,
)

# Powertools' own, read by the relay too (see the module's docstring)
POWERTOOLS_SERVICE_NAME = Text[str](
    name="POWERTOOLS_SERVICE_NAME",
    default="outbox",
    meaning="log service and the metrics' service dimension (the template: the stack's name)",
)
POWERTOOLS_METRICS_NAMESPACE = Text[str](
    name="POWERTOOLS_METRICS_NAMESPACE",
    default="OutboxRelay",
    meaning="CloudWatch namespace of the metrics",
)

# Every setting declared above, in their order.
SETTINGS: tuple[Setting[Any], ...] = tuple(
    value for value in list(globals().values()) if isinstance(value, Setting)
)


def read_all(env: Mapping[str, str]) -> dict[str, Any]:
    """Every setting's value in ``env``; ConfigError for the first malformed one."""
    return {s.name: s.read(env) for s in SETTINGS}


def from_setting(setting: Setting[T]) -> T:
    """A dataclass field that takes its default from ``setting`` and remembers
    it, so ``outbox.relay_settings`` reads each field from its own variable."""
    value = setting.default
    if isinstance(value, dict | list):
        return cast(T, field(default_factory=value.copy, metadata={"setting": setting}))
    return cast(T, field(default=value, metadata={"setting": setting}))
