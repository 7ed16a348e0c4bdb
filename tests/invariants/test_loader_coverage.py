"""Invariant 6, the loader: each sample once per epoch, batches a function of their key.

The scenarios and checks are in ``inv_loader.py``.
"""

from __future__ import annotations

import inv_loader as ld
import pytest
from hypothesis import given
from inv_budget import prop
from inv_dist import DistResults


@prop(ci=20)
@given(ld.scenarios())
def test_one_process_sees_each_sample_once_and_batches_do_not_depend_on_workers(
    spec: ld.Spec,
) -> None:
    """1 process: each sample once per epoch; equal batches for any workers, epoch start, resume."""
    problems, _ = ld.check(spec, 1, 0)
    assert not problems, "; ".join(problems)


@pytest.mark.dist_group("loader")
def test_two_ranks_see_each_sample_once_in_distributed_samplers_order(
    dist_results: DistResults,
) -> None:
    """2 ranks: DistributedSampler's order and padding; batches independent of the workers."""
    dist_results.assert_passed("loader")
