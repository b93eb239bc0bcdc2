"""The exceptions the relay raises to its callers."""


class OutboxError(Exception):
    """Base class of every error the outbox package raises on purpose."""


class ValidationError(OutboxError, ValueError):
    """Bad input to the producer API or a function event: nothing was written.

    ``field`` names the offending field (``payload.to[0]``, ``dedupe_key``, ...).
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class ConfigError(OutboxError):
    """A setting is missing or malformed; raised at cold start, naming the setting."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"configuration {setting}: {problem}")
        self.setting = setting


class SchemaMissing(OutboxError):
    """The database has no relay schema (or an older one than this release
    needs): a table or function the statement names does not exist. Nothing
    was written; run ``outbox migrate`` against this database."""

    def __init__(self) -> None:
        super().__init__(
            "the outbox schema is missing or out of date in this database: "
            "run `outbox migrate` first"
        )


# SQLSTATEs that mean the statement named something the schema lacks.
# undefined table, undefined function, and (OUTBOX_SCHEMA naming a schema that is not there)
# invalid schema name
UNDEFINED_OBJECT_SQLSTATES = frozenset({"42P01", "42883", "3F000"})


def sqlstate(exc: BaseException) -> str:
    """The server's SQLSTATE of a database error from any of the Postgres
    drivers SQLAlchemy wraps (pg8000, psycopg, psycopg2, asyncpg), '' when
    the driver raised on its own (no server answered)."""
    orig = getattr(exc, "orig", exc)
    args: tuple[object, ...] = getattr(orig, "args", ())
    if args and isinstance(args[0], dict):  # pg8000: the server's fields, 'C' the code
        return str(args[0].get("C") or "")
    for attribute in ("sqlstate", "pgcode"):  # psycopg and asyncpg; psycopg2
        code = getattr(orig, attribute, None)
        if isinstance(code, str):
            return code
    return ""


class DedupeConflict(ValidationError):
    """A dedupe key already names a message for the same recipient on the same
    channel, with a different payload: a replay must repeat its payload. Nothing
    was written.

    ``field`` is ``dedupe_key`` (``messages[i].dedupe_key`` from enqueue_many);
    ``existing_id`` is the message the key names, or None when the clash is
    with an earlier message of the same list (``first_index``).
    """

    def __init__(
        self,
        channel: str,
        dedupe_key: str,
        *,
        index: int = 0,
        existing_id: int | None = None,
        first_index: int | None = None,
        field: str = "dedupe_key",
    ) -> None:
        holder = (
            f"{channel} message {existing_id}"
            if existing_id is not None
            else f"messages[{first_index}] of this list"
        )
        super().__init__(
            field,
            f"{dedupe_key!r} already names {holder} for this recipient, with a different "
            "payload; a repeat must carry the same payload (or use another key)",
        )
        self.channel = channel
        self.dedupe_key = dedupe_key
        self.index = index
        self.existing_id = existing_id
        self.first_index = first_index


# Postgres's word for an UPDATE or a lock that waited on a row another
# transaction moved to another partition meanwhile (a settle, a redrive: a
# change of status between the live rows and the history), under READ
# COMMITTED too: it cannot follow the row, so it refuses rather than re-check.
_MOVED_MESSAGE = "moved to another partition"


def moved_meanwhile(exc: BaseException | None) -> bool:
    """Whether ``exc`` is that refusal (the statement may simply run again)."""
    return exc is not None and sqlstate(exc) == "40001" and _MOVED_MESSAGE in str(exc)
