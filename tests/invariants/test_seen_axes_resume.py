"""Invariant: the axes a step's log sends to trackers (epoch and samples after each micro-step,
and the updates at the end; for torchdata's StatefulDataLoader the updates after each
micro-step too) of a run saved and resumed, as often as drawn, equal the uninterrupted run's.

Drawn: a loader the Checkpointer saves (a sized stateful class, or torchdata's
StatefulDataLoader when installed), one it does not (a list: its pass starts again), 1-7
batches a pass, ``accumulate`` 1-3, ``micro_batch`` or not, 1-3 passes, up to three saves at
window boundaries (inside the loop: each segment is left after its save, as a stopped run
is), or a loop that leaves each pass by ``break`` after some batches and saves after the
``break`` (stopped after such a save: its next pass is new, as in the uninterrupted run).
For a list, whose resumed pass starts again, what must hold is the epoch of every micro-step
of the batches it replays and of those after them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from helpers import ResumableLoader
from hypothesis import given
from hypothesis import strategies as st
from inv_budget import prop, where
from torch import nn

import loopkit

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # the streaming extra is optional
    StatefulDataLoader = None

KINDS = ["stateful", "list"] + (["torchdata"] if StatefulDataLoader is not None else [])


def _loader(kind: str, n: int) -> Any:
    if kind == "stateful":
        return ResumableLoader(n)
    if kind == "list":
        return ResumableLoader(n).data
    data = torch.utils.data.TensorDataset(torch.randn(4 * n, 3))
    return StatefulDataLoader(data, batch_size=4)


def _segment(tmp: Path, plan: dict[str, Any], resume: bool, stop: int | None,
             out: list[tuple[int, int, int]]) -> bool:  # fmt: skip
    """Train (resumed if asked) until update ``stop`` (saved there, inside the loop) or the
    plan's passes: each micro-step's axes appended to ``out``. True if it stopped."""
    torch.manual_seed(0)
    loader = _loader(plan["kind"], plan["n"])
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=plan["acc"], micro_batch=plan["micro_batch"])
    owner = None if plan["kind"] == "list" else loader
    ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, loader=owner)
    if resume:
        ckpt.resume()
    # The passes left: the drawn count, and a pass saved part-way goes on (state_dict says).
    while step.seen.passes < plan["passes"] or step.seen.state_dict().get("pass_batches"):
        handed = 0
        for b in step.iterate(loader):
            x = b[0] if isinstance(b, list) else b
            handed += 1
            with step as s:
                s.backward(model(x).pow(2).mean())
            axes = step.seen.axes()
            out.append((step.updates, int(axes["epoch"]), int(axes["samples"])))
            at_stop = stop is not None and step.updates == stop
            if at_stop and not plan["leave_after"] and step.accumulator.micro_step == 0:
                ckpt.save()
                return True
            if (
                plan["leave_after"]
                and handed >= plan["leave_after"]
                and step.accumulator.micro_step == 0
            ):
                break
        if plan["leave_after"]:
            ckpt.save()  # after the break: the pass is over
            if stop is not None and step.updates >= stop:
                return True  # (a loop that breaks is stopped after that save)
        if not handed and not step.seen.passes:
            break
    out.append((step.updates, -1, -1))  # the run's end: its update count
    return False


@st.composite
def _plans(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 7))
    acc = draw(st.integers(1, 3))
    return {
        "kind": draw(st.sampled_from(KINDS)), "n": n, "acc": acc,
        "micro_batch": draw(st.sampled_from([None, 2])), "passes": draw(st.integers(1, 3)),
        "stops": draw(st.lists(st.integers(1, 12), max_size=3, unique=True)),
        "leave_after": draw(st.sampled_from([0, 0, acc])) if acc < n else 0,
    }  # fmt: skip


@prop(ci=25)
@given(_plans())
def test_resumed_axes_are_the_uninterrupted_runs(plan: dict[str, Any]) -> None:
    """Saved and resumed at the drawn updates: every micro-step's (updates, epoch, samples)
    of the resumed run is the uninterrupted run's, for a loader the Checkpointer puts back;
    for a list, every micro-step's epoch once the replayed batches are counted."""
    with tempfile.TemporaryDirectory() as tmp:
        whole: list[tuple[int, int, int]] = []
        _segment(Path(tmp) / "whole", plan, False, None, whole)
        runs: list[list[tuple[int, int, int]]] = []
        resume = False
        for stop in [*sorted(set(plan["stops"])), None]:
            runs.append([])
            if not _segment(Path(tmp) / "run", plan, resume, stop, runs[-1]):
                break  # it ran to its end (the drawn stops past it are not reached)
            resume = True
    every = [axes for run in runs for axes in run]
    if plan["kind"] != "list":
        assert every[-1] == whole[-1], (plan, where())  # the same updates in the end
        if plan["kind"] == "torchdata":  # its len() is the whole pass: counted on from there
            assert every == whole, (plan, where())
        # (A stateful class of the user's is not known to have a whole pass's len(): the
        # update count in its resumed pass's ragged last micro-step is one low, its window
        # closed when the loop asks past it: tests/step/test_last_batch.py says why.)
        assert [a[1:] for a in every] == [a[1:] for a in whole], (plan, where())
        return
    # A list starts its pass again: by epoch, the resumed runs replay batches but never
    # count an epoch the uninterrupted run had not reached by then.
    epochs = [e for _, e, _ in whole[:-1]]
    assert [e for _, e, _ in every[:-1]][-1] == epochs[-1], (plan, where())
    assert sorted({e for _, e, _ in every[:-1]}) == sorted(set(epochs)), (plan, where())
