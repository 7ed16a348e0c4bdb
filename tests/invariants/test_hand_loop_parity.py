"""Invariant: a port's loopkit.step loop is the hand-written loop it replaces, bit for bit.

The reference (``inv_parity.run_hand``) is the loop a port is compared against, built from
the same seeds over the same objects: ``for i, (x, y) in enumerate(source):
(loss / k).backward()``; after every k-th batch and a pass's last, ``clip_grad_norm_(
model.parameters(), c)``, ``optimizer.step()``, ``scheduler.step()``,
``optimizer.zero_grad()``; a ragged window's summed gradients are first scaled by
``k / len(window)`` (its mean gradient, normalized as loopkit normalizes it: one multiply
at the window's end). The loop with loopkit is ``for x, y in step.iterate(source): with step as s:
s.backward(loss)`` with ``loopkit.step(model, opt, accumulate=k, clip_grad_norm=c,
scheduler=sched)`` in fp32.

Drawn: the optimizer's parameter groups (one; minGPT's name-sorted decay/no-decay groups;
a shuffled split into groups with their own learning rates), SGD with momentum or AdamW,
clipping or none, schedulers, accumulate 1..3, batch sizes with ragged tails (and
drop_last), dropout, one or two passes, and where the data draws random numbers: a
Dataset's ``__getitem__`` (torch, numpy and python) behind a DataLoader without workers,
shuffled or not; a ``collate_fn``; an IterableDataset with a length (one without is looked
ahead, which loop control needs to see its last window inside the body); a Sized iterable
of the user's; plain lists of tuples or stacked tensors; a ``distributed.loader`` (whose
reference is the same loop by hand over the same loader).

What must hold, all with ``torch.equal`` / exact equality: the batches seen (``x.sum()``
per micro-step) and the losses; the number of updates and each update's gradient norm
(``step.grad_norm`` against ``clip_grad_norm_``'s return, ``get_total_norm`` without
clipping); the final weights, optimizer state and learning rates; the torch, numpy and
python RNG states at the end. Bit identity holds for every drawn case, ragged windows
included, because the hand loop scales the window's summed gradients as loopkit does
(dividing each loss by ``len(window)`` instead would round differently: not what loopkit
promises, so not what is compared).
"""

from __future__ import annotations

import inv_parity as ip
import pytest
from hypothesis import example, given
from inv_budget import prop, where


@prop(ci=200)
@example(ip.spec_of(source="map"))
@example(ip.spec_of(source="collate", optimizer="sgd", groups="shuffled", cuts=[2, 4]))
@example(ip.spec_of(source="iterable", samples=9, batch_size=2, clip=None))
@example(ip.spec_of(source="sized", accumulate=2, samples=5, batch_size=2))
@example(ip.spec_of(source="list", groups="one", drop_last=True, accumulate=2))
@example(ip.spec_of(source="tensors", scheduler="lambda", accumulate=1))
@example(ip.spec_of(source="dist_loader", perm=[5, 3, 1, 0, 2, 4], groups="shuffled", cuts=[3]))
@given(ip.scenarios())
def test_step_loop_is_the_hand_loop_bit_for_bit(spec: ip.Spec) -> None:
    """Batches, losses, norms, weights, optimizer state, lr and RNG states all torch.equal."""
    problems = ip.differences(ip.run_loopkit(spec), ip.run_hand(spec))
    assert not problems, f"{'; '.join(problems)} ({where()}; {spec})"


DRAWING = ["map", "collate", "iterable", "sized"]
"""Sources whose batches draw from this process's random streams as they are taken."""


@pytest.mark.parametrize("source", DRAWING)
def test_a_hand_loop_that_looks_ahead_is_told_apart(source: str) -> None:
    """Taking batch i+1 before micro-step i's dropout moves the random streams: refused."""
    spec = ip.spec_of(source=source)
    got = ip.run_loopkit(spec)
    assert not ip.differences(got, ip.run_hand(spec))
    assert ip.differences(got, ip.run_hand(spec, lookahead=True))


@pytest.mark.parametrize("source", ip.SOURCES)
def test_a_ragged_window_left_divided_by_k_is_told_apart(source: str) -> None:
    """7 samples by 2 with k=3: the last window of one batch must be its mean gradient."""
    spec = ip.spec_of(source=source, epochs=1, clip=None, optimizer="sgd")
    got = ip.run_loopkit(spec)
    assert not ip.differences(got, ip.run_hand(spec))
    assert ip.differences(got, ip.run_hand(spec, ragged_by_every=True))
