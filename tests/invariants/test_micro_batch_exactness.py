"""Invariant: micro-batching changes no update (the scenarios: ``inv_micro_batch.py``).

For generated batch sizes (ragged), chunk sizes, windows, weights (none or samples),
optimizers, clipping, passes, batch layouts (dicts with names and scalars, nested tuples
and lists, lists of variable-length sequences, a dict per sample, namedtuples, dataclasses)
and normalization layers, ``loopkit.step(micro_batch=m)`` ends within float32 rounding of
the same step run on whole batches (whose own updates test_update_exactness checks against
a float64 reference), with the same number of updates and samples seen; BatchNorm in
training mode is refused before a cut batch's first chunk runs; on 2 DDP ranks likewise,
with identical replicas.
"""

from __future__ import annotations

import warnings

import inv_micro_batch as mb
import pytest
from hypothesis import example, given
from inv_budget import prop
from inv_dist import DistResults


@prop(ci=24)
@given(mb.scenarios())
@example(
    {
        "sizes": [8],
        "micro_batch": 2,
        "every": 1,
        "weight": None,
        "optimizer": "sgd",
        "clip": None,
        "epochs": 1,
        "layout": "sequences",
        "norm": "none",
        "seed": 0,
    }
)
@example(
    {
        "sizes": [16, 4],
        "micro_batch": 4,
        "every": 2,
        "weight": None,
        "optimizer": "sgd",
        "clip": None,
        "epochs": 1,
        "layout": "names first, nested",
        "norm": "none",
        "seed": 1,
    }
)
@example(
    {
        "sizes": [6, 6],
        "micro_batch": 3,
        "every": 1,
        "weight": None,
        "optimizer": "sgd",
        "clip": None,
        "epochs": 1,
        "layout": "tuple",
        "norm": "batchnorm_train",
        "seed": 2,
    }
)
def test_micro_batches_change_no_update(spec: mb.Spec) -> None:
    """Chunks of ``micro_batch`` samples, any layout: the whole batches' weights, updates and
    samples (BatchNorm in training mode: refused, naming it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mb.check(spec)


@pytest.mark.dist_group("micro_batch")
def test_on_two_ranks_micro_batches_change_no_update(dist_results: DistResults) -> None:
    """2 gloo ranks, a DDP model: each rank's whole-batch update, identical replicas."""
    results = dist_results.assert_passed("micro_batch")
    assert any(not r["refused"] for r in results[0]["records"])
