"""Invariant 3, evaluation: N processes give 1 process's sums, exactly (``inv_evaluation.py``)."""

from __future__ import annotations

import inv_evaluation as ev
import pytest
from hypothesis import given
from inv_budget import prop
from inv_dist import DistResults


@prop(ci=60)
@given(ev.scenarios(world=1))
def test_one_process_sums_are_the_exact_sums(spec: ev.Spec) -> None:
    """1 process: sums == fsum of every sample's float64 values; the model left as it was."""
    ev.check_here(spec)


@pytest.mark.dist_group("evaluate")
def test_two_processes_give_the_exact_sums_of_rank_zeros_model(dist_results: DistResults) -> None:
    """2 ranks, DDP (BatchNorm trained apart): sums == fsum over the data with rank 0's model."""
    dist_results.assert_passed("evaluate")


@pytest.mark.dist_group("evaluate")
def test_two_processes_give_the_sums_of_one(dist_results: DistResults) -> None:
    """World sizes 2 and 1: rank 0's model evaluated alone gives the same sums, bit for bit."""
    records = dist_results.assert_passed("evaluate")[0]["records"]
    for record in records:
        ev.check_one_process(record)
