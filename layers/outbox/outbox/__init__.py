"""Transactional outbox relay: enqueue in your transaction, delivered at least once.

The producer API is importable from the package root::

    import outbox
    outbox.enqueue(conn, "email", {...}, dedupe_key="order-42")

``conn`` is a SQLAlchemy ``Connection`` in your transaction, or an ORM
``Session`` (its ``session.connection()`` is used). Importing ``outbox`` loads
SQLAlchemy and nothing of the relay's Lambda runtime.
"""

from .errors import ConfigError, DedupeConflict, OutboxError, SchemaMissing, ValidationError
from .producer import Enqueued, enqueue, enqueue_many

__version__ = "0.14.3"

__all__ = [
    "ConfigError",
    "DedupeConflict",
    "Enqueued",
    "OutboxError",
    "SchemaMissing",
    "ValidationError",
    "__version__",
    "enqueue",
    "enqueue_many",
]
