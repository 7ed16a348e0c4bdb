"""Boundaries: a window's close is reported once, never mid-window."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

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


def _stepped(acc: loopkit.accumulate, model: nn.Module, n: int) -> None:
    for _ in range(n):
        with acc:
            acc.backward(model(torch.ones(1, 2)).sum())


def test_no_boundary_before_a_window_closes() -> None:
    """A fresh tracker sees no boundary where none has closed: not at update 0, nor at the
    count a clock had when the tracker was built; the next window's close is seen."""
    model = nn.Linear(2, 1)
    acc = loopkit.accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    b = Boundaries(clock_of(acc, "test"))
    assert b.new() is None  # update 0, no window open: nothing has closed
    _stepped(acc, model, 2)
    late = Boundaries(clock_of(acc, "test"))  # built after update 1 closed
    assert (b.new(), late.new(), late.new()) == (1, None, None)
    _stepped(acc, model, 2)
    assert (b.new(), late.new()) == (2, 2)


def test_a_group_window_closing_in_the_batch_a_tracker_is_built_is_seen() -> None:
    """accumulate=1: built on a window's last batch (counted as it began), before or after
    the micro-steps, a tracker sees that window close; before the loop, none at update 0."""
    A, B = nn.Linear(2, 1), nn.Linear(2, 1)
    steps = [loopkit.step(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (A, B)]
    group = loopkit.steps(*steps)
    first = Boundaries(group)
    assert first.new() is None
    seen = []
    for x in group.iterate([torch.ones(1, 2)] * 2):
        before = Boundaries(group)
        for s, m in zip(steps, (A, B), strict=True):
            with s as st:
                st.backward(m(x).sum())
        seen.append((first.new(), before.new(), Boundaries(group).new()))
    assert seen == [(1, 1, 1), (2, 2, 2)]


def test_after_a_resume_only_windows_closed_since_are_boundaries() -> None:
    """Loaded counts are no boundary; a window closed after the load is, even where it
    brings the count back to one the tracker reported before (a resume to an earlier save)."""
    model = nn.Linear(2, 1)
    acc = loopkit.accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    b = Boundaries(clock_of(acc, "test"))
    _stepped(acc, model, 1)
    saved = acc.state_dict()
    _stepped(acc, model, 1)
    assert b.new() == 2
    fresh = loopkit.accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before_load = Boundaries(clock_of(fresh, "test"))
    fresh.load_state_dict(saved)
    assert (before_load.new(), Boundaries(clock_of(fresh, "test")).new()) == (None, None)
    acc.load_state_dict(saved)  # back to update 1, in the same run
    assert b.new() is None
    _stepped(acc, model, 1)
    _stepped(fresh, model, 1)
    assert (b.new(), before_load.new()) == (2, 2)
    group, fresh_group = (loopkit.steps(loopkit.step(m, torch.optim.SGD(m.parameters(), lr=0.1)))
                          for m in (nn.Linear(2, 1), nn.Linear(2, 1)))  # fmt: skip
    g = Boundaries(fresh_group)
    for grp, batches in ((group, 2), (fresh_group, 1)):
        if grp is fresh_group:
            grp.load_state_dict(group.state_dict())
            assert g.new() is None
        for x in grp.iterate([torch.ones(1, 2)] * batches):
            with grp.members[0] as st:
                st.backward(grp.members[0].model(x).sum())
    assert (g.new(), fresh_group.updates) == (3, 3)


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


def _python_calls(fn: Callable[[], object]) -> tuple[int, object]:
    """The Python functions ``fn`` enters (``fn`` itself not counted), and its result."""
    seen = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        seen[0] += event == "call"

    sys.setprofile(count)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return seen[0] - 1, out


def test_loop_control_asked_mid_window_reads_no_counter_through_a_call() -> None:
    """``until.check()`` and ``cadence.due()`` after a micro-step that ends no window: each
    makes one call of its own (the boundary tracker's ``new``, which answers from the step's
    counters read in place; it made three before: the last load, ``settle`` and
    ``updates``), and still fires where a window closes."""
    model = nn.Linear(2, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    with loopkit.until(step, max_updates=100) as stop:
        validate = loopkit.cadence(step, updates=2)
        counts, fired = [], []
        for _ in range(12):
            with step as s:
                s.backward(model(torch.ones(1, 2)).sum())
            n_due, due = _python_calls(validate.due)
            n_check, done = _python_calls(stop.check)
            fired.append((step.updates, due, done))
            if step.micro_step:  # mid-window
                counts.append((n_due, n_check))
    assert counts == [(1, 1)] * 8, counts
    assert [u for u, due, _ in fired if due] == [2, 4], fired
    assert not any(done for _, _, done in fired)
