"""Invariant 2b, resume at scale: sharded models, background saves, another world size.

The scenarios and checks are in ``inv_resume_sharded.py``: DDP or FSDP2 on 2 ranks, stopped
after a drawn update and resumed, bit-identical on 2 ranks (with a micro-batch probe before
training, a skipped non-finite window and an update saved twice drawn too); the same
checkpoint resumed on 1 process with ``reseed=True`` takes the same samples and ends within
float rounding.
"""

from __future__ import annotations

import inv_resume_sharded as rs
import pytest
from inv_dist import DistResults


@pytest.mark.dist_group("resume_sharded")
def test_two_ranks_resume_sharded_and_background_saved_runs_bit_identically(
    dist_results: DistResults,
) -> None:
    """2 ranks: weights, EMA, optimizer state, lr, samples and log records after a resume
    equal the uninterrupted run's, bit for bit (DDP or FSDP2, sync or background saves, a
    probe taken back, a skipped window, an update saved twice)."""
    ranks = dist_results.assert_passed("resume_sharded")
    assert any(r["spec"]["sharded"] for r in ranks[0]["records"])
    assert any(r["spec"]["async_save"] for r in ranks[0]["records"])
    # FSDP2 with a probe whose largest trial died in its backward, a window skipped and
    # update 2 saved twice (the resume from it and the skip after it checked bit for bit).
    assert ranks[0]["records"][1]["spec"] == rs.EXPLICIT[1]
    assert ranks[0]["records"][1]["whole"]["skipped"] == 1


@pytest.mark.dist_group("resume_sharded")
def test_one_process_continues_what_two_ranks_saved(dist_results: DistResults) -> None:
    """1 process, reseed=True: the 2-rank run's samples from the checkpoint on, every sample
    once, weights and log records within float rounding; a pass padded otherwise refused."""
    records = dist_results.assert_passed("resume_sharded")[0]["records"]
    for record in records:
        rs.check_one_process(record)
    assert records[0]["spec"] == rs.EXPLICIT[0] and records[0]["saved_at"] > 0  # refused
