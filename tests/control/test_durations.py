"""max_time's forms read as they look, and anything else is refused with the forms named."""

from __future__ import annotations

import datetime

import pytest

from loopkit._control._durations import parse_duration


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("00:12:00:00", 12 * 3600),
        ("01:02:03", 3723),
        ("1:00:00:00", 86400),
        ("36:00:00", 36 * 3600),  # HH may exceed a day when no DD field is given
        (datetime.timedelta(hours=1, seconds=5), 3605),
        ({"days": 1, "hours": 5}, 29 * 3600),
        (90, 90.0),
        (0.5, 0.5),
    ],
)
def test_accepted_forms(value: object, seconds: float) -> None:
    """Lightning's strings, a timedelta, a timedelta's keywords and seconds all parse."""
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        ("12:00", ValueError, "HH:MM:SS"),
        ("00:61:00", ValueError, "minutes must be below 60"),
        ("1:24:00:00", ValueError, "hours must be below 24"),
        ("aa:bb:cc", ValueError, "digits only"),
        ("00:00:00", ValueError, "positive"),
        (-5, ValueError, "positive"),
        (float("inf"), ValueError, "finite"),
        ({"weeks": "x"}, ValueError, "timedelta"),
        (True, TypeError, "bool"),
        (None, TypeError, "HH:MM:SS"),
    ],
)
def test_refused_forms(value: object, error: type[Exception], says: str) -> None:
    """A malformed or non-positive duration names what is wrong and what is accepted."""
    with pytest.raises(error, match=says):
        parse_duration(value)
