"""Which passes over a ``distributed.loader`` are the training run's, and which are outside it.

A pass started by a step's ``iterate`` (``EpochLoader.training_pass``) is training's: it
counts from its start (the loader's epoch moves on, a resumed place is used up, what waits
for the next pass runs first). Any other pass (``for x, y in loader:``, ``next(iter(loader))``)
hands out the batches of the loader's next epoch from its place, but counts only once
training consumes one of them while it is iterated: a micro-step of a loopkit step entered
(``consumed``, before the micro-step changes anything) or an optimizer's ``step()`` (a loop
without a loopkit step) after it handed that batch out. So a plain training loop counts its
passes as before, and a peek or an evaluation pass over the training loader leaves the
loader, its generator and the epochs of ``ckpt.epochs(E)`` as they were.

Which pass counts when training consumes: never one while a counted pass of its loader is
still iterated (a peek or an evaluation inside a training pass), nor one started before the
loader's place was set or loaded, or before a pass that counted. A pass still iterated
counts if every pass started after it has ended (a peek at its first batch, an evaluation
started and left inside it); a pass that ran out before training consumed anything counts
only as the loader's latest (a full-batch update, or hand accumulation flushed, after the
loop). So an evaluation pass, which ends before the next training pass starts, never counts.
The decision follows the training loop's own events (its passes and micro-steps), which
every rank runs alike: a pass one rank alone reads (a rank-0 evaluation or peek) never
counts.

A save that waits for the next pass (``maybe_save`` on a pass's last window) is written when
that pass counts, with the RNG states it started with: the loop body may have drawn random
numbers for the first batch before training consumed it.
"""

from __future__ import annotations

import contextlib
import random
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle


class Owner(Protocol):
    """What a pass reads and tells of its loader (an ``EpochLoader``)."""

    _recent: list[Pass]  # the passes started since one last counted (or the place was set)
    _trained: bool  # training consumed a batch of it (or a training pass started) once

    def _counted_pass_open(self) -> bool: ...
    def _count(self, this: Pass) -> None: ...


class Pass:
    """One pass over an ``EpochLoader``; ``Pass.latest`` is the last counted one to hand out
    a batch (a step reads it to notice a window that spans two passes of one loader)."""

    __slots__ = (
        "after", "before", "counted", "ended", "epoch", "grad", "handed", "loader",
        "loader_id", "queued", "rng", "start",
    )  # fmt: skip
    latest: ClassVar[Pass | None] = None

    def __init__(self, loader: Owner, epoch: int, start: int, counted: bool) -> None:
        self.loader_id = id(loader)
        self.loader: weakref.ref[Owner] = weakref.ref(loader)
        self.epoch, self.start = epoch, start
        self.counted = counted
        self.handed = 0  # batches handed out while not counted
        self.ended = False  # ran out, or its iterator was closed
        self.queued = False  # in ``pending``
        self.rng: RngStates | None = None  # as it started, while a save waits for it to count
        self.grad = torch.is_grad_enabled()  # False: an evaluation's (under no_grad)
        self.before: torch.Tensor | None = None  # the loader's generator as the pass began
        self.after: torch.Tensor | None = None  # ... and once its DataLoader iterator drew

    def handed_out(self) -> None:
        """An uncounted pass handed out a batch: the next training step may consume it."""
        self.handed += 1
        if not self.queued:
            self.queued = True
            pending.append(self)
            _hook_optimizers()

    def may_count(self, loader: Owner) -> bool:
        """Whether training consuming a batch of this pass now makes it the loader's."""
        recent = loader._recent
        if self.counted or loader._counted_pass_open() or self not in recent:
            return False
        later = recent[recent.index(self) + 1 :]
        if self.ended:  # run out before anything was consumed: only as the latest pass
            return not later
        return all(p.ended for p in later)  # passes started in it (peeks) were left

    def ran_out(self, loader: Owner) -> bool:
        """The pass handed out its last batch: whether it counts now, uncounted. Only where
        nothing ever trained on the loader (a loop reading the data only, or updating with
        no optimizer), read with gradients on (not an evaluation) as its latest pass."""
        recent = loader._recent
        return (
            not self.counted
            and not loader._trained
            and self.grad
            and bool(recent)
            and recent[-1] is self
            and not loader._counted_pass_open()
        )


RngStates = tuple[Any, Any, torch.Tensor, "list[torch.Tensor] | None"]


def rng_now() -> RngStates:
    """The process's python, numpy, torch (and CUDA, where started) RNG states."""
    started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
    cuda = torch.cuda.get_rng_state_all() if started else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _put_rng(states: RngStates) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if states[3] is not None:
        torch.cuda.set_rng_state_all(states[3])


@contextlib.contextmanager
def rng_as_at(states: RngStates | None) -> Iterator[None]:
    """The RNGs set to ``states`` inside the block (nothing changed for None), then put back."""
    if states is None:
        yield
        return
    now = rng_now()
    _put_rng(states)
    try:
        yield
    finally:
        _put_rng(now)


pending: list[Pass] = []
"""Uncounted passes that handed out a batch since training last consumed one."""

_hook: list[RemovableHandle] = []


def consumed() -> None:
    """Training consumes what was handed out (a micro-step is entered, an optimizer steps):
    each uncounted pass that handed out a batch since, and may count, counts now. Called by
    every micro-step only while ``pending`` holds a pass (one list check otherwise)."""
    passes = list(pending)
    for p in passes:
        loader = p.loader()
        if loader is not None:
            loader._trained = True
            if p.may_count(loader):
                loader._count(p)  # runs what waits for the next pass; may raise (then retried)
        p.queued = False
        pending.remove(p)
    _unhook_optimizers()


def _on_optimizer_step(optimizer: object, args: Any, kwargs: Any) -> None:
    """A loop without a loopkit step: an optimizer's update consumes the batches."""
    consumed()


def _hook_optimizers() -> None:
    # Only while a pass waits: a loop whose passes all count from their start pays nothing.
    if not _hook:
        _hook.append(register_optimizer_step_pre_hook(_on_optimizer_step))


def _unhook_optimizers() -> None:
    if _hook and not pending:
        _hook.pop().remove()
