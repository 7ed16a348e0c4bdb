"""Invariant 5, loop control: decisions at window ends, once, alike on every rank.

The scenarios and the reference are in ``inv_loop_control.py``.
"""

from __future__ import annotations

import warnings

import inv_loop_control as lc
import pytest
from hypothesis import given
from inv_budget import prop
from inv_dist import DistResults


@prop(ci=150)
@given(lc.scenarios())
def test_stops_cadences_and_saves_fall_where_the_reference_puts_them(spec: lc.Spec) -> None:
    """1 process: until/cadence/maybe_save at the hand-counted window ends, each once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lc.check_here(spec)


@pytest.mark.dist_group("loop_control")
def test_every_rank_takes_the_same_decisions_at_the_same_batches(dist_results: DistResults) -> None:
    """2 ranks (DDP members): the reference's decisions, and one log on both ranks."""
    dist_results.assert_passed("loop_control")
