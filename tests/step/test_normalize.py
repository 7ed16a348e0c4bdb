"""Normalization math, without a model: scaled losses and boundary factors give window means."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopkit._step._normalize import (
    boundary_factor,
    by_hand_factor,
    checked_weight,
    reference_weight,
    scaled_loss,
)
from loopkit._step._window import Window

LOSSES = st.lists(st.floats(-100, 100), min_size=1, max_size=8)


def test_a_full_unweighted_window_needs_no_factor() -> None:
    """n == every: None, so the hand-written loss / every loop is matched bit for bit."""
    assert boundary_factor(4, 4, weighted=False) is None
    loss = torch.tensor(3.0)
    assert torch.equal(scaled_loss(loss, 4), loss / 4)


@settings(max_examples=200, deadline=None)
@given(losses=LOSSES, every=st.integers(1, 8))
def test_a_ragged_window_becomes_the_mean_of_its_micro_steps(
    losses: list[float], every: int
) -> None:
    """sum(loss / every) * factor == mean(loss) for a window of k <= every micro-steps."""
    losses = losses[:every]
    summed = math.fsum(float(scaled_loss(torch.tensor(x, dtype=torch.float64), every))
                       for x in losses)  # fmt: skip
    factor = boundary_factor(len(losses), every, weighted=False)
    got = summed * (1.0 if factor is None else factor)
    assert got == pytest.approx(math.fsum(losses) / len(losses), rel=1e-12, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    losses=LOSSES,
    weights=st.lists(st.floats(0.5, 1000), min_size=8, max_size=8),
    every=st.integers(1, 8),
    world=st.integers(1, 4),
)
def test_weighted_micro_steps_become_the_weighted_mean(
    losses: list[float], weights: list[float], every: int, world: int
) -> None:
    """sum(loss * w / w_ref) * world * w_ref / (world * sum w) == sum(w * loss) / sum(w)."""
    weights = weights[: len(losses)]
    w_ref = reference_weight(weights[0], every)
    summed = math.fsum(
        float(scaled_loss(torch.tensor(x, dtype=torch.float64), every, w, w_ref))
        for x, w in zip(losses, weights, strict=True)
    )
    # Under DDP the gradients are averaged over `world` equal ranks and the weights summed.
    factor = boundary_factor(len(losses), every, True, world * math.fsum(weights), w_ref, world)
    want = math.fsum(w * x for x, w in zip(losses, weights, strict=True)) / math.fsum(weights)
    assert summed * factor == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_by_hand_factor_from_the_sums_over_ranks() -> None:
    """Unweighted: every * world / backward calls; weighted: world * w_ref / total; none: None."""
    assert by_hand_factor(3, 0, 0.0, 0.0, 0, every=4, world=2) == pytest.approx(8 / 3)
    assert by_hand_factor(0, 3, 30.0, 2 * 12.0, 2, every=4, world=2) == pytest.approx(0.8)
    assert by_hand_factor(0, 0, 0.0, 0.0, 0, every=4, world=2) is None
    with pytest.raises(ValueError, match="pass weight= on every micro-step of every rank"):
        by_hand_factor(1, 1, 5.0, 5.0, 1, every=4, world=2)


@pytest.mark.parametrize(
    ("weight", "exc"),
    [(0, ValueError), (-1.0, ValueError), (math.nan, ValueError), (True, TypeError),
     ("3", TypeError), (torch.ones(2), ValueError)],
)  # fmt: skip
def test_bad_weights_are_refused(weight: object, exc: type[Exception]) -> None:
    """Zero, negative, NaN, bools, strings and vectors raise; host tensors become floats."""
    with pytest.raises(exc):
        checked_weight(weight)  # type: ignore[arg-type]
    assert checked_weight(torch.tensor(3)) == 3.0 and checked_weight(2) == 2.0


def test_a_window_records_its_backward_calls() -> None:
    """Sums, the smallest device weight and the loss flag accumulate; a new window is empty."""
    window = Window()
    window.add_backward(torch.tensor(2.0), True, torch.tensor(True), synced=False)
    window.add_backward(torch.tensor(-1.0), True, torch.tensor(False), synced=True)
    assert window.n_backward == 2 and window.last_synced and window.weighted
    assert float(window.weight_sum) == 1.0 and bool(window.bad_device_weight())
    assert window.loss_finite is not None and not bool(window.loss_finite)
    assert Window().bad_device_weight() is False and Window().n_backward == 0
