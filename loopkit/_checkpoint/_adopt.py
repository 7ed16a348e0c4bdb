"""``ckpt.adopt``: a job that ran outside loopkit (its own ``model.pt``, ``opt.pt``, an update
count) continues under it, as if loopkit had made its first updates.

What only loopkit can set is set here: the step's update count (``until``'s limits,
``cadence``, ``maybe_save`` and the checkpoints' numbers go on from it), the step's own
scheduler brought to that update (stepped as the job stepped it: the same lrs, bit for bit),
and the loader's epoch. The weights, the optimizer's state and an EMA's average are the
job's files, loaded by the user (``model.load_state_dict``, ``ema.adopt``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from .._checks import is_int_at_least
from .._step import _accumulate, _compose, _group, _misuse
from ._standing import Checkpointer


def adopt(ckpt: Checkpointer, updates: object, epoch: object) -> None:
    """``Checkpointer.adopt``: everything checked, then the counters, schedulers and epoch."""
    if not is_int_at_least(updates, 0):
        raise ValueError(f"updates must be an int >= 0 (the job's optimizer updates so far), "
                         f"got {updates!r}")  # fmt: skip
    if epoch is not None and not is_int_at_least(epoch, 0):
        raise ValueError(f"epoch must be None or an int >= 0 (the epoch to continue with), "
                         f"got {epoch!r}")  # fmt: skip
    assert isinstance(updates, int)
    stepper = ckpt.step
    if stepper is None:
        raise ValueError(
            "adopt() continues the update count of the Checkpointer's step=, which this one "
            "was not given: build it with step=, the loopkit.step that continues the job"
        )
    if epoch is not None and ckpt.loader is None:
        raise ValueError(
            "adopt(epoch=) sets the epoch of the Checkpointer's loader=, which this one was "
            "not given: build it with loader=loopkit.distributed.loader(...)"
        )
    _refuse_after_start(ckpt)
    schedulers = [_checked(s, updates) for s in _schedulers(stepper)]
    # The schedulers are stepped first: one that cannot reach the job's update (a OneCycleLR
    # past its total_steps) raises there, and everything goes back as it was.
    kept = [_Kept(scheduler) for scheduler in schedulers]
    for scheduler in schedulers:
        try:
            _fast_forward(scheduler, updates)
        except Exception as err:
            for saved in kept:
                saved.restore()
            raise ValueError(
                f"adopt(updates={updates}) steps the step's {type(scheduler).__name__} "
                f"{updates} times, as the job stepped it, and it raised: {err}. Build the "
                "scheduler for the whole run, the job's updates included (a OneCycleLR's "
                "total_steps, a LambdaLR's range), or load the job's saved scheduler state. "
                "Nothing was changed"
            ) from err
    _set_updates(stepper, updates)  # checked: cannot fail
    if epoch is not None:
        assert ckpt.loader is not None and isinstance(epoch, int)
        ckpt.loader.set_epoch(epoch)
    _misuse.resumed()  # the schedulers moved by no step of loopkit's: no guard objects
    ckpt._used = True  # the pieces are fixed, as after a resume
    ckpt.last_saved_update, ckpt._saved_windows = None, None  # nothing of it is saved yet


def _refuse_after_start(ckpt: Checkpointer) -> None:
    """adopt() is a job's first launch under loopkit: no loopkit checkpoint, no training yet."""
    found = ckpt.checkpoints()
    if found or ckpt._standing.path is not None:
        raise RuntimeError(
            f"{ckpt.directory} holds loopkit checkpoints ({found[-1].name if found else 'resumed'}"
            "): ckpt.resume() continues from them. adopt() is for the first launch of a job "
            "under loopkit: call it only where resume() returned None"
        )
    clock = ckpt.clock
    assert clock is not None  # step= is given
    if ckpt.last_saved_update is not None or clock.updates or clock.micro_step:
        raise RuntimeError(
            "adopt() after this run trained or saved: call it before the training loop, right "
            "after a ckpt.resume() that found no checkpoint"
        )


def _members(stepper: object) -> list[_accumulate.accumulate]:
    if isinstance(stepper, _group.steps):
        return [m.accumulator for m in stepper.members]
    if isinstance(stepper, _compose.step):
        return [stepper.accumulator]
    assert isinstance(stepper, _accumulate.accumulate)
    return [stepper]


def _schedulers(stepper: object) -> list[Any]:
    """The schedulers loopkit steps once per update (each step's ``scheduler=``)."""
    return [acc._rule.scheduler for acc in _members(stepper) if acc._rule.scheduler is not None]


def _checked(scheduler: Any, updates: int) -> Any:
    """``scheduler``, if it can be brought to ``updates``: fresh (stepped by nobody yet) or
    restored there already (the job's saved state loaded)."""
    at = getattr(scheduler, "last_epoch", 0)
    if hasattr(scheduler, "_schedulers"):  # SequentialLR, ChainedScheduler: nested states
        if at == updates:
            return scheduler
        raise ValueError(
            f"the step's {type(scheduler).__name__} holds schedulers of its own, which adopt() "
            "cannot step to the job's update: load the job's saved scheduler state into it "
            "(scheduler.load_state_dict) before adopt()"
        )
    if at not in (0, updates):
        raise ValueError(
            f"the step's scheduler is at step {at}, neither fresh (0) nor at the job's "
            f"{updates} updates: build it afresh (adopt() steps it {updates} times), or load "
            "the job's saved scheduler state, which is at the job's update"
        )
    return scheduler


def _fast_forward(scheduler: Any, updates: int) -> None:
    """Step a fresh scheduler ``updates`` times, as the job stepped it once per update.

    A torch scheduler starts again from its base lrs (an optimizer state loaded after it was
    built holds the job's last lr, where a chainable schedule would go on from), so each lr
    is the one the job had, bit for bit. No optimizer step is involved: its warning that the
    scheduler stepped first is silenced."""
    if getattr(scheduler, "last_epoch", None) == updates:
        return  # restored to the job's update already
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if isinstance(scheduler, LRScheduler):
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                   strict=True):  # fmt: skip
                group["lr"] = base
            scheduler.last_epoch = -1
            scheduler._initial_step()
        for _ in range(updates):
            scheduler.step()


class _Kept:
    """A scheduler's state and its optimizer's hyper-parameters, to put back if stepping it
    to the job's update raises half-way."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.state = copy.deepcopy(scheduler.state_dict()) if _stateful(scheduler) else None
        self.attrs = None if self.state is not None else dict(vars(scheduler))
        optimizer = getattr(scheduler, "optimizer", None)
        self.groups = None
        if isinstance(optimizer, Optimizer):  # the lr, momentum, betas a scheduler sets
            self.groups = [
                (group, {k: copy.deepcopy(v) for k, v in group.items() if k != "params"})
                for group in optimizer.param_groups
            ]

    def restore(self) -> None:
        if self.state is not None:
            self.scheduler.load_state_dict(self.state)
        elif self.attrs is not None:
            vars(self.scheduler).clear()
            vars(self.scheduler).update(self.attrs)
        for group, saved in self.groups or []:
            params = group["params"]
            group.clear()
            group.update(saved, params=params)


def _stateful(scheduler: Any) -> bool:
    return callable(getattr(scheduler, "state_dict", None)) and callable(
        getattr(scheduler, "load_state_dict", None)
    )


def _set_updates(stepper: object, updates: int) -> None:
    """The step's (each member's, and a group's clock's) update count set to ``updates``."""
    for acc in _members(stepper):
        state = acc.state_dict()
        state["updates"] = updates
        acc.load_state_dict(state)
    if isinstance(stepper, _group.steps):
        state = stepper.state_dict()
        state["updates"] = updates
        for member in state["steps"]:
            member["accumulate"]["updates"] = updates
        stepper.load_state_dict(state)
