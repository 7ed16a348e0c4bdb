"""scale_lr: the live lr and the scheduler's base move together, so no scheduler undoes it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import loopkit

Optimizer = torch.optim.Optimizer


def _lrs(make: Callable[[Optimizer], Any], lr: float, scale: bool, steps: int = 6) -> list[float]:
    """The lr of each step under the scheduler ``make`` builds, from ``lr`` (scaled x4 after
    the build when ``scale``)."""
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=lr)
    sched = make(opt)
    if scale:
        assert loopkit.scale_lr(opt, sched, from_batch=32, to_batch=128) == 4.0
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


SCHEDULERS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda u: 1 / (1 + u)),
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
        ],
        milestones=[2],
    ),
    "one cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=o.param_groups[0]["lr"], total_steps=8
    ),
    "cyclic": lambda o: torch.optim.lr_scheduler.CyclicLR(
        o,
        base_lr=o.param_groups[0]["lr"] / 10,
        max_lr=o.param_groups[0]["lr"],
        step_size_up=2,
        cycle_momentum=False,
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scaling_after_the_build_equals_building_with_the_scaled_lr(name: str) -> None:
    """x4 by scale_lr gives every step the lr a scheduler built with 4x the lr gives."""
    make = SCHEDULERS[name]
    scaled, fresh = _lrs(make, 0.1, scale=True), _lrs(make, 0.4, scale=False)
    assert scaled == pytest.approx(fresh, rel=1e-12)
    assert scaled != pytest.approx(_lrs(make, 0.1, scale=False))


def test_the_sqrt_rule_and_no_scheduler() -> None:
    """rule='sqrt' multiplies by the square root; without a scheduler only the live lr moves."""
    opt = torch.optim.AdamW(nn.Linear(2, 1).parameters(), lr=1e-3)
    assert loopkit.scale_lr(opt, from_batch=64, to_batch=256, rule="sqrt") == 2.0
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3)


def test_plateau_scaling_equals_building_with_the_scaled_lr() -> None:
    """ReduceLROnPlateau's live lr and its floor (min_lr) both scale: every step's lr is the
    one a scheduler built with the scaled rates gives, the floor reached included."""

    def lrs(lr: float, scale: bool) -> list[float]:
        opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0,
                                                           min_lr=lr / 3)  # fmt: skip
        if scale:
            loopkit.scale_lr(opt, sched, from_batch=32, to_batch=128)
        out = []
        for _ in range(5):
            out.append(opt.param_groups[0]["lr"])
            sched.step(1.0)  # no improvement: reduce, down to the floor
        return out

    assert lrs(0.1, scale=True) == pytest.approx(lrs(0.4, scale=False), rel=1e-12)


class _OwnRates:
    """A scheduler with no base_lrs: its rates are its own."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = 0.5


def test_a_scheduler_it_cannot_scale_is_refused_before_any_change() -> None:
    """A scheduler keeping no rates loopkit knows is refused, and the lr is left as it was."""
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    before = opt.param_groups[0]["lr"]
    with pytest.raises(TypeError, match="cannot scale a _OwnRates"):
        loopkit.scale_lr(opt, _OwnRates(opt), from_batch=32, to_batch=64)
    assert opt.param_groups[0]["lr"] == before
    with pytest.raises(ValueError, match="to_batch must be an int >= 1"):
        loopkit.scale_lr(opt, from_batch=32, to_batch=0)
    with pytest.raises(ValueError, match="rule must be"):
        loopkit.scale_lr(opt, from_batch=32, to_batch=64, rule="cubic")  # type: ignore[arg-type]
    assert math.isclose(opt.param_groups[0]["lr"], before)
