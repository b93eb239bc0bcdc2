"""Transactional outbox relay: enqueue in your transaction, delivered at least once.

The producer API is importable from the package root::

    import outbox
    outbox.enqueue(conn, "email", {...}, dedupe_key="order-42")
"""

from .errors import ConfigError, DedupeConflict, OutboxError, ValidationError
from .producer import Enqueued, enqueue, enqueue_many

__all__ = [
    "ConfigError",
    "DedupeConflict",
    "Enqueued",
    "OutboxError",
    "ValidationError",
    "enqueue",
    "enqueue_many",
]
