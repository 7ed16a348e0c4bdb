"""Argument predicates shared by every constructor."""

from __future__ import annotations


def is_int_at_least(value: object, low: int) -> bool:
    """Whether ``value`` is a real int (not a bool, not a float such as nan) and >= ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
