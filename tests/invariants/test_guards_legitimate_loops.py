"""Invariant: the misuse guards never fire on a legitimate loop, and catch one misuse in it.

A legitimate loop is one written the way the docs show, combining (drawn by ``inv_guards``):
schedulers restored by hand (``scheduler.load_state_dict`` after the step was built) or by a
Checkpointer given them under ``scheduler=``/``extra=`` or through ``step=`` (with or without
``optimizer=`` and ``loader=``), resumed before a phase or rolled back mid-run, with saves
before a phase and ``maybe_save`` in it; epoch loops over ``step.iterate`` (left early with a
``break`` at a window's end, or mid-window before the next pass), ``until(max_epochs=)``
loops over ``stop.epochs(loader)``, iteration loops over an endless chain of a
``distributed.loader``'s passes stopped by ``until(max_updates=)``, plain loops flushed after
the loop (or after each pass of a loader); phases that build a new step on the same model,
optimizer, ema and scheduler with another ``accumulate=``, ``micro_batch=`` or precision;
``evaluate`` at a ``cadence``, inside ``with step as s:`` before the backward, under
``ema.swapped()``; ``loopkit.steps`` groups (a GAN with ``frozen=``, two independent members);
hand-written code on other optimizers (a probe head with its own ``zero_grad``,
``clip_grad_norm_``, ``step()``, scheduler and ema, after every micro-step on detached
features or between phases through the model's first layers), on the model with another
optimizer followed by ``ema.update()``, a scheduler given to no step stepped by the loop, the
old loop's ``zero_grad()`` where a window opens; ``torch.compile``; ``micro_batch=`` over
tuples and dicts with a list of names, with LayerNorm, GroupNorm or BatchNorm in eval mode; a
bad batch whose micro-step raises (before or after its backward) and is skipped by the loop,
which goes on; a NaN loss whose update ``skip_nonfinite`` skips.

What must hold: such a loop runs under ``warnings.simplefilter("error")`` with no exception
and no warning (none when its objects are collected either), it trains (updates > 0), and the
scheduler and ema given to its steps stand where one step per real update from their last
restore puts them. Its twin, the same loop with ONE misuse drawn into it (a leftover
``optimizer.step()``, ``scheduler.step()``, ``zero_grad()`` or clip mid-window, a probe
loss back-propagated through the model mid-window, ``ema.update()`` after the step counted
the update, ``micro_batch=`` with BatchNorm in training mode, a plain loop ending mid-window
without ``flush()``, a plain loop whose window spans two passes of a loader), is caught by
the one exception or warning that names the fix, and a refusal leaves the weights (or the
ema) as they were before the misuse. ``UnwrappedModelWarning`` needs several processes: it
is checked by tests/dist_worker.py.
"""

from __future__ import annotations

import copy
import gc
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from inv_budget import prop, where
from inv_guards import (
    CAUGHT,
    MISUSES,
    Loop,
    Phase,
    Run,
    legalize,
    loops,
    message_matches,
    snapshot,
    temporary_directory,
    with_misuse,
)
from torch import nn

import loopkit

# torch's own DeprecationWarning on its DDP import path (pyproject ignores it for the suite).
_TORCH_OWN = "`torch.jit.script_method` is deprecated"


class _Unraisable:
    """Exceptions raised where Python can only print them (a finalizer, a weakref callback):
    a warning turned into an error there would otherwise pass unseen."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, unraisable: Any) -> None:
        self.seen.append(f"{unraisable.exc_type.__name__}: {unraisable.exc_value}")

    def __enter__(self) -> _Unraisable:
        # What earlier tests on this worker left for the collector is theirs, not this loop's.
        gc.collect()
        self._old = sys.unraisablehook
        sys.unraisablehook = self
        return self

    def __exit__(self, *exc: object) -> None:
        sys.unraisablehook = self._old


def _collect(run: list[Run]) -> None:
    """Drop the run's objects and collect them (their finalizers report open windows)."""
    run.clear()
    gc.collect()


def _phase(shape: str, **settings: Any) -> Phase:
    """A phase with nothing on but what ``settings`` turn on."""
    plain: dict[str, Any] = dict(
        accumulate=1, micro_batch=None, precision="fp32", clip=None, new_step=True,
        step_back=False, length=1, evaluate=None, swapped=False, raise_at=None,
        raise_after=False, drop_raised=False, leave_at=None, zero_grad_top=False, nan_at=None,
        hand_after=False, ckpt_ops=(), restore_to=None, flush=True,
    )  # fmt: skip
    return Phase(shape=shape, **{**plain, **settings})


def _loop(*phases: Phase, **settings: Any) -> Loop:
    plain: dict[str, Any] = dict(
        seed=3, norm="none", layout="tuple", source="loader", samples=9, batch=3,
        optimizer="adamw", scheduler=None, sched_given=False, ema=False, ema_every=1,
        skip_nonfinite=False, ckpt=None, ckpt_loader=False, ckpt_optimizer=True,
        compiled=False, probe="none", final_save=False,
    )  # fmt: skip
    return legalize(Loop(phases=phases, **{**plain, **settings}))


# The CI examples drawn by hypothesis are few and simple; these three cover the rest.
COMPILED = _loop(
    _phase("epochs", accumulate=2, micro_batch=2, clip=0.5, evaluate="cadence", swapped=True,
           restore_to=3),
    norm="layer", layout="dict", scheduler="steplr", sched_given=True, ema=True, compiled=True,
)  # fmt: skip
"""The one CI example that compiles (compiling takes seconds on a CPU)."""
RESUMED = _loop(
    _phase("epochs", accumulate=2, micro_batch=2, precision="bf16", clip=0.5, length=3,
           evaluate="in_step", swapped=True, raise_at=1, leave_at=2, zero_grad_top=True,
           hand_after=True, ckpt_ops=("save_before", "maybe_save", "rollback_mid"),
           restore_to=3),
    _phase("iteration", accumulate=3, length=4, evaluate="cadence", swapped=True, raise_at=3,
           raise_after=True, nan_at=4, ckpt_ops=("maybe_save",)),
    _phase("until_epochs", new_step=False, length=2, ckpt_ops=("save_before", "resume_before")),
    norm="group", layout="dict", samples=11, optimizer="sgd", scheduler="steplr",
    sched_given=True, ema=True, ema_every=2, skip_nonfinite=True, ckpt="step_extra",
    ckpt_optimizer=False, probe="each",
)  # fmt: skip
"""Schedulers and an ema restored by hand, by resumes and by a rollback mid-run."""
GROUPS = _loop(
    _phase("gan", accumulate=2, micro_batch=2, length=2, evaluate="cadence"),
    _phase("plain", accumulate=2, length=2, raise_at=2, raise_after=True, zero_grad_top=True,
           hand_after=True, ckpt_ops=("save_before", "resume_before", "rollback_mid"),
           restore_to=3),
    _phase("pair", micro_batch=1, precision="bf16"),
    _phase("plain_loader", accumulate=3, length=2, evaluate="in_step", swapped=True),
    norm="bn_eval", samples=10, scheduler="lambda", ema=True, ckpt="scheduler",
    probe="trunk", final_save=True,
)  # fmt: skip
"""Groups, a scheduler the loop steps itself, a Checkpointer without step=."""
SKIPPED = _loop(
    _phase("epochs", accumulate=2, length=2, evaluate="per_epoch", raise_at=1, raise_after=True,
           ckpt_ops=("maybe_save",)),
    _phase("until_epochs", accumulate=3, length=2, evaluate="per_epoch", raise_at=5,
           raise_after=True, drop_raised=True, new_step=False),
    samples=18, ckpt="step_extra",
)  # fmt: skip
"""Bad batches skipped at a window's last micro-step, after its backward, in passes over the
loader with a per-epoch cadence and saves (0.3.0 refused it mid-pass: the windows moved), the
second one's gradients dropped by the handler (0.3.0 refused that as gradients dropped)."""


@prop(ci=12)
@given(loop=loops())
@example(loop=COMPILED)
@example(loop=RESUMED)
@example(loop=GROUPS)
@example(loop=SKIPPED)
def test_legitimate_loops_neither_raise_nor_warn(loop: Loop) -> None:
    """A drawn legitimate loop: no exception, no warning (at gc too), updates, the ledger."""
    with temporary_directory() as tmp, _Unraisable() as unraisable, warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=_TORCH_OWN)
        runs = [Run(loop, Path(tmp))]
        runs[0].play()
        run = runs[0]
        updates = sum(s.updates for s in run.steps)
        expected, actual = run.expected(), run.actual()
        del run
        _collect(runs)
    assert not unraisable.seen, f"{where()}: {unraisable.seen}"
    assert updates > 0, where()
    assert actual == expected, f"{where()}: the ledger says {expected}, the objects {actual}"


@pytest.mark.parametrize("kind", MISUSES)
@prop(ci=2)
@given(data=st.data())
def test_one_misuse_in_a_legitimate_loop_is_caught(
    kind: str, data: st.DataObject, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same loops with one misuse drawn into them: caught by the one complaint naming
    its fix; a refusal leaves the weights (the ema for ema.update()) as before the misuse."""
    loop, misuse = data.draw(with_misuse(kind), label="loop, misuse")
    # A failed test before this one leaves sys.last_value, which silences open-window reports.
    monkeypatch.delattr(sys, "last_value", raising=False)
    category, _ = CAUGHT[kind]
    refusal: str | None = None
    with temporary_directory() as tmp, _Unraisable() as unraisable:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message=_TORCH_OWN)
            # torch's own word on a scheduler stepped before any optimizer.step(): the misuse's
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            runs = [Run(loop, Path(tmp), misuse)]
            try:
                runs[0].play()
            except Exception as err:
                if not isinstance(err, category) or not message_matches(kind, str(err)):
                    raise  # not this misuse's refusal: shown with its traceback
                refusal = str(err)  # (the exception, and the frames it holds, go here)
            run = runs[0]
            injected, before = run.injected, run.before_misuse
            after = snapshot(list(run.model.parameters()))
            if kind == "ema_update" and run.ema is not None:
                after = snapshot(run.ema.shadow)
            during = list(caught)
            del run
            _collect(runs)  # after a refusal, the window it left open may be reported: ignored
        warned = [f"{w.category.__name__}: {w.message}" for w in caught]
    assert injected, f"{where()}: the harness never drew {kind} into {loop}"
    assert not unraisable.seen, f"{where()}: {unraisable.seen}"
    if issubclass(category, Warning):
        assert refusal is None, f"{where()}: {kind} was refused: {refusal}"
        assert len(warned) == 1, f"{where()}: {kind}: {warned}"
        assert warned[0].startswith(category.__name__) and message_matches(kind, warned[0])
    else:
        assert refusal is not None, f"{where()}: {kind} was not caught"
        assert not during, f"{where()}: {kind}: {[str(w.message) for w in during]}"
        assert before is not None
        for x, y in zip(before, after, strict=True):
            assert torch.equal(x, y), f"{where()}: the refusal of {kind} changed the weights"


# -- what the harness found ------------------------------------------------------------------
# Each loop below, shrunk from a drawn one, was refused or warned (or its misuse not caught).
# Each is a regression test now (fixed in the library).


def _tiny() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, [(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(4)]  # 4 batches of 3


def _train(model: nn.Module, step: loopkit.step, data: list[Any]) -> None:
    for x, y in step.iterate(data):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))


class _BadBatch(Exception):
    """The loop's own check of a batch."""


def _mse(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"mse": (model(x) - y).pow(2).mean(dim=1)}


def test_an_ema_evaluated_twice_before_its_first_update_does_not_warn() -> None:
    """Two evaluations under ema.swapped() in the first window: the first swap's copies are
    no training (found here as a false warning: the swap bumped the weights' versions)."""
    model, data = _tiny()
    average = loopkit.ema(model, 0.9)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2,
                        ema=average)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in step.iterate(data):
            with step as s:
                with average.swapped():  # validate the average before each micro-step
                    loopkit.evaluate(model, data[:1], _mse)
                s.backward(nn.functional.mse_loss(model(x), y))
    assert step.updates == 2 and average.seen == 2


def test_a_rollback_to_a_checkpoint_from_before_the_first_update_does_not_warn(
    tmp_path: Path,
) -> None:
    """ckpt.save() before training, training, ckpt.resume(that file), ckpt.save(): the load
    of the model is no training for the restored ema (found here as a false warning)."""
    model, data = _tiny()
    average = loopkit.ema(model, 0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2, ema=average)
    ckpt = loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, step=step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = ckpt.save()  # the initial state
        _train(model, step, data)
        ckpt.resume(first)  # a rollback to the start
        ckpt.save()
    assert step.updates == 0 and average.seen == 0


def test_ema_update_after_a_swap_is_refused() -> None:
    """The step counted the update; an evaluation under ema.swapped() puts the same weights
    back: a leftover ema.update() after it is still refused (found here not refused)."""
    model, data = _tiny()
    average = loopkit.ema(model, 0.9)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), ema=average)
    _train(model, step, data)
    with average.swapped():
        loopkit.evaluate(model, data[:1], _mse)
    refused = False
    try:
        average.update()
    except RuntimeError as err:
        refused = "remove the ema.update() call" in str(err)
    assert refused, "ema.update() after the step's update (and a swap) was not refused"


def test_a_step_used_again_after_another_step_steps_the_scheduler_on() -> None:
    """Steps a (accumulate=2) and b (accumulate=1) on one optimizer and scheduler, used in
    turn: b's updates are no foreign step for a (found here refused as "stepped by your
    code")."""
    model, data = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    a = loopkit.step(model, opt, accumulate=2, scheduler=sched)
    b = loopkit.step(model, opt, accumulate=1, scheduler=sched)
    for step in (a, b, a):
        _train(model, step, data)
    assert (a.updates, b.updates, sched.last_epoch) == (4, 4, 8)


def test_a_scheduler_restored_ahead_by_hand_between_passes_of_one_step_is_no_foreign_step() -> None:
    """scheduler.load_state_dict(a state further on) between two passes of the same step is a
    restore (found here refused as a user's scheduler.step())."""
    model, data = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    step = loopkit.step(model, opt, accumulate=2, scheduler=sched)
    ahead = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))]), 2)
    for _ in range(6):
        ahead.optimizer.step()
        ahead.step()
    _train(model, step, data)
    sched.load_state_dict(copy.deepcopy(ahead.state_dict()))  # a schedule's later state
    _train(model, step, data)
    assert step.updates == 4 and sched.last_epoch == 8


def test_ema_update_after_another_optimizers_step_is_still_refused() -> None:
    """The step counted the update, then a probe head's own optimizer stepped: the model's
    weights are still those the step counted, so a leftover ema.update() is refused (found
    here not refused)."""
    model, data = _tiny()
    average = loopkit.ema(model, 0.9)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), ema=average)
    probe = nn.Linear(8, 1)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    _train(model, step, data)
    x, y = data[0]
    nn.functional.mse_loss(probe(model[:2](x).detach()), y).backward()
    probe_opt.step()  # another optimizer, other weights
    refused = False
    try:
        average.update()
    except RuntimeError as err:
        refused = "remove the ema.update() call" in str(err)
    assert refused, "ema.update() after the step's update (and a probe's step) was not refused"


def test_a_skipped_window_after_a_hand_step_is_dropped_quietly() -> None:
    """A hand-written step leaves gradients on the model; the next window opens (clearing
    them, as documented), its only micro-step is a skipped bad batch, and the loop leaves
    the pass: that window is dropped (found here refused as another step's backward)."""
    model, data = _tiny()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    nn.functional.mse_loss(model(data[0][0]), data[0][1]).backward()  # by hand, between windows
    for epoch in range(2):
        for x, y in step.iterate(data):
            try:
                with step as s:
                    if epoch == 0:
                        raise _BadBatch("the loop's own check: skip this batch")
                    s.backward(nn.functional.mse_loss(model(x), y))
            except _BadBatch:
                break  # and give up on this epoch
    assert step.updates == 4
