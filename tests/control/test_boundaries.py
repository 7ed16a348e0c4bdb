"""Boundaries: a window's close is reported once, never mid-window."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loopkit
from loopkit._control._boundaries import Boundaries, clock_of


def test_reported_once_per_window_and_never_inside_one() -> None:
    """Windows of 3: asked after every micro-step and twice more, reports updates 1 and 2."""
    model = nn.Linear(2, 1)
    acc = loopkit.accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1), every=3)
    b = Boundaries(clock_of(acc, "test"))
    seen = []
    for _ in range(6):
        with acc:
            acc.backward(model(torch.ones(1, 2)).sum())
        seen += [b.new(), b.new()]
    assert seen == [None, None, None, None, 1, None, None, None, None, None, 2, None]


def test_without_a_clock_every_call_is_an_update() -> None:
    """In a loop without loopkit, each call follows one optimizer step."""
    b = Boundaries(None)
    assert [b.new(), b.new(), b.new()] == [1, 2, 3] and b.updates == 3


def test_clock_of_the_steppers() -> None:
    """step gives its accumulator; steps and accumulate are clocks; anything else is refused."""
    model = nn.Linear(2, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert clock_of(step, "x") is step.accumulator
    assert clock_of(step.accumulator, "x") is step.accumulator
    group = loopkit.steps(step)
    assert clock_of(group, "x") is group and clock_of(None, "x") is None
    with pytest.raises(TypeError, match=r"until takes a loopkit\.step"):
        clock_of(model, "until")
