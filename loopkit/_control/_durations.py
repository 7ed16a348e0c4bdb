"""Durations as users write them for ``max_time``: pure parsing, no clock."""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping

_FORMS = '"HH:MM:SS", "DD:HH:MM:SS", a datetime.timedelta, a dict such as {"hours": 5} or seconds'


def parse_duration(value: object, name: str = "max_time") -> float:
    """Seconds in ``value``; ValueError/TypeError naming ``name`` and the accepted forms.

    ``"HH:MM:SS"`` and ``"DD:HH:MM:SS"`` (Lightning's ``max_time``) read as they look: the
    first field may be any size, the others must be below 24/60/60. A number is seconds.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {_FORMS}, got a bool")
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, Mapping):
        try:
            seconds = datetime.timedelta(**value).total_seconds()
        except TypeError as err:
            raise ValueError(
                f"{name}={dict(value)!r}: keys must be timedelta's (days, hours, minutes, "
                f"seconds, ...) with numbers: {err}"
            ) from None
    elif isinstance(value, str):
        seconds = _parse_clock_text(value, name)
    elif isinstance(value, (int, float)):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be {_FORMS}, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a positive, finite duration, got {value!r}")
    return seconds


def _parse_clock_text(text: str, name: str) -> float:
    parts = text.strip().split(":")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
        raise ValueError(f'{name}={text!r}: write "HH:MM:SS" or "DD:HH:MM:SS" (digits only)')
    numbers = [int(p) for p in parts]
    limits = (24, 60, 60)[-(len(numbers) - 1) :]
    units_below = ("hours", "minutes", "seconds")[-len(limits) :]
    for number, limit, unit in zip(numbers[1:], limits, units_below, strict=True):
        if number >= limit:
            raise ValueError(f"{name}={text!r}: {unit} must be below {limit}, got {number}")
    units = (86400, 3600, 60, 1)[-len(numbers) :]
    return float(sum(n * u for n, u in zip(numbers, units, strict=True)))
