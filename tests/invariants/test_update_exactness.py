"""Invariant 1, update exactness: any composition of step/steps/accumulate equals float64 math.

The scenarios and the reference are in ``inv_exactness.py``: the reference replays each
window by hand in float64 (the weighted mean of its micro-steps' gradients, clipped, one
optimizer and one scheduler step), over every rank's micro-batches under DDP.
"""

from __future__ import annotations

import warnings
from typing import Any

import inv_exactness as ex
import pytest
from hypothesis import given
from inv_budget import prop
from inv_dist import DistResults


def _spec(**changes: Any) -> ex.Spec:
    """A plain fp32 single-step scenario of 5 batches, with ``changes``."""
    spec: ex.Spec = {
        "mode": "step", "members": "single", "model": "mlp", "branch": "batch", "every": 3,
        "n_batches": 5, "sizes": [[3, 3, 3, 3, 3]], "loop": "iterate", "epochs": 1,
        "break_at": None, "enter": [[1]] * 5, "weight": None, "backwards": 1,
        "g_forward": "inside", "precision": "fp32", "optimizer": "sgd", "clip": None,
        "scheduler": None, "seed": 7, "find_unused": False, "hook": None,
    }  # fmt: skip
    spec.update(changes)
    return spec


@prop(ci=300)
@given(ex.scenarios())
def test_any_composition_equals_the_float64_reference(spec: ex.Spec) -> None:
    """One process: weights within RTOL[precision] of the float64 reference; counters, lr exact."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU warns
        ex.check(spec)


@pytest.mark.parametrize(
    ("mistake", "changes"),
    [
        ("ragged_by_every", {}),  # 5 batches, every=3: a ragged window of 2
        ("unweighted", {"weight": "samples", "sizes": [[1, 5, 2, 4, 3]]}),
        ("unweighted", {"weight": "tokens", "sizes": [[1, 5, 2, 4, 3]]}),
        (
            "unweighted",
            {"weight": "samples_tensor", "sizes": [[1, 5, 1, 5, 2]], "precision": "bf16"},
        ),
        ("no_clip", {"clip": 0.05, "precision": "fp16"}),
        ("ragged_by_every", {"mode": "steps", "members": "gan", "enter": [[1, 1]] * 5}),
    ],
)
def test_the_comparison_tells_the_right_update_from_a_classic_mistake(
    mistake: str, changes: dict[str, Any]
) -> None:
    """The tolerances are tight: loopkit's run is refused against a mistaken reference."""
    spec = _spec(**changes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ex.run_loopkit(spec)
    assert not ex.compare(spec, got, ex.reference(spec))
    assert ex.compare(spec, got, ex.reference(spec, mistake=mistake))


@pytest.mark.dist_group("update")
def test_ddp_replicas_are_identical_and_equal_the_reference(dist_results: DistResults) -> None:
    """2 gloo ranks, DDP with hooks and unused parameters: equal replicas, the all-ranks update."""
    dist_results.assert_passed("update")
