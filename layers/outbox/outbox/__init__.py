"""Transactional outbox relay: enqueue in your transaction, delivered at least once.

The producer API is importable from the package root::

    import outbox
    outbox.enqueue(conn, "email", {...}, dedupe_key="order-42")
"""

from .errors import ConfigError, OutboxError, ValidationError
from .producer import enqueue, enqueue_many

__all__ = ["ConfigError", "OutboxError", "ValidationError", "enqueue", "enqueue_many"]
