"""Tenants (docs/design.md, Tenants): the name a message's tenant may have.

A tenant is a short text on every message; ``''`` (None in the API) is no
tenant, the single-tenant relay. The producer doors check the same rule
(migration 0022), so a name Python accepts the database accepts.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ValidationError

__all__ = ["NO_TENANT", "TENANT_RULE", "check_tenant"]

# The stored tenant of a message that has none.
NO_TENANT = ""
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
TENANT_RULE = (
    "must be 1 to 64 letters, digits, dots, underscores, colons or hyphens, "
    "starting with a letter or digit"
)


def check_tenant(value: Any, field: str = "tenant") -> str | None:
    """The tenant as given (None: none), or ValidationError naming ``field``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a string, got {type(value).__name__}")
    if not _TENANT.fullmatch(value):
        raise ValidationError(field, TENANT_RULE)
    return value
