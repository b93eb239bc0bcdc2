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
