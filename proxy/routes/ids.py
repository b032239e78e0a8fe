"""Path id validation shared by every templated route."""

from __future__ import annotations

from shared.errors import InvalidId
from shared.types import is_valid_id

__all__ = ["check_id"]


def check_id(value: str, name: str) -> str:
    # "." and ".." match the id pattern but are path segments, never ids.
    if not is_valid_id(value) or value in (".", ".."):
        raise InvalidId(f"{name} must be 1-128 characters of [A-Za-z0-9._:-] (not '.' or '..'), "
                        f"got {value[:140]!r}", param=name)
    return value
