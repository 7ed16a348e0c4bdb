"""accumulate: gradient accumulation whose update equals the large-batch update.

The pieces, each in its own module: the window's state (``_window``), the normalization
math (``_normalize``, pure functions) and the ordered update at the boundary (``_update``).
This module is the micro-step protocol that drives them: ``with acc:``, ``acc.backward``,
``acc.iterate``, ``acc.flush``, and the decisions at a window's end that involve other
ranks (through ``_ranks`` and ``_parallel._grad_sync``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from .._checks import is_int_at_least
from .._compile._options import CompileLike
from .._ema import _average
from .._parallel._fsdp_options import check_precision
from .._parallel._grad_sync import sync_kind, unwrap
from .._precision import autocast_step
from .._tracing import EagerUnderCompile, eagerly
from .._types import Weight
from . import _last_batch, _misuse, _open_steps, _source
from ._cross_rank import end_of_window
from ._micro_sync import MicroStepSync
from ._params import OptimizerParams
from ._reach import Reach
from ._update import Progress, UpdateRule
from ._weighting import Weighting
from ._window import Window, discard_overdue, going_on, unreducible

T = TypeVar("T")
_Move = Callable[[Any], Any] | None  # what moves a step's batch as iterate takes it
_NESTED = (
    "accumulate is already inside a micro-step: enter `with acc:` once per micro-batch, not nested"
)
_OUTSIDE = (
    "acc.backward(loss) must be called inside `with acc:` (it belongs to that micro-step's window)"
)


def _check_binding(model: object, optimizer: object, every: object, amp: object = None) -> str:
    """Refuse a model, optimizer, ``every`` or precision accumulate cannot work with, before
    any change; the class the user built (``loopkit.step`` or ``loopkit.accumulate``), as
    messages say."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not is_int_at_least(every, 1):
        raise ValueError(
            f"every must be an int >= 1 (micro-batches per optimizer update), got {every!r}"
        )
    model_params = {id(p) for p in model.parameters()}
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(id(p) in model_params for p in opt_params):
        raise ValueError(
            "the optimizer holds none of the model's parameters: build it from "
            "model.parameters() of this model (after wrapping it, if you wrap it)"
        )
    check_precision(model, getattr(amp, "precision", "fp32"))  # with FSDP2's mp_policy
    # The accumulate already bound to it: catches `accumulate(...)` rebuilt every iteration.
    old, new = _misuse.owner_of(optimizer), _source.built_as(2)
    if isinstance(old, accumulate) and old._window.micro > 0:
        built = old._built_as
        enter = "`with step as s:`" if new == "loopkit.step" else "`with acc:`"
        raise RuntimeError(
            f"this optimizer is already bound to a {built} that is mid-window "
            f"({old._window.micro} of {old.every} micro-steps done); building a new {new} "
            f"would drop those gradients from the normalization. Build the {new} once, "
            f"before the loop, and enter it ({enter}) on every iteration (or flush() the "
            "old one first)"
        )
    return new


class accumulate(EagerUnderCompile, contextlib.ContextDecorator):
    """Accumulate gradients over ``every`` micro-batches, then update once, exactly.

    ``every``: micro-batches per update. Build it once before the loop; enter ``with acc:``
    around each micro-batch's forward and backward and call ``acc.backward(loss)``
    (``weight=`` the micro-batch's sample or token count when they differ) inside. A window
    opens with cleared gradients; non-final micro-steps run under ``no_sync``; leaving the
    final one makes the update (``_update.UpdateRule.apply``: unscale, normalize, clip,
    guard, step, schedule), and an exception there drops the window as if it never
    happened. ``skip_nonfinite=True`` skips updates whose loss or gradient norm is inf/nan
    on any rank (one host read per update); ``max_consecutive_skips=K`` raises after K in a
    row (fp16's start-up back-off not counted); ``ema=loopkit.ema(model)`` (or a list of
    them: several decays) is averaged after each real update; ``measure_grad_norm=True``:
    ``acc.grad_norm`` without clipping. ``acc.flush()`` (or ``for batch in
    acc.iterate(loader)``) closes a ragged last window with exact normalization.
    ``compile_optimizer=True`` compiles the optimizer's step (see ``loopkit.step``).
    """

    every: int
    _window: Window

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        every: int = 1,
        *,
        scheduler: Any = None,
        clip_grad_norm: float | None = None,
        amp: autocast_step | None = None,
        skip_nonfinite: bool = False,
        max_consecutive_skips: int | None = None,
        ema: _average.ema | Sequence[_average.ema] | None = None,
        compile_optimizer: CompileLike = False,
        measure_grad_norm: bool = False,
    ) -> None:
        self._built_as = _check_binding(model, optimizer, every, amp)  # what the user built
        kind = sync_kind(model)
        rule = UpdateRule(
            optimizer, amp=amp, clip_grad_norm=clip_grad_norm, scheduler=scheduler, ema=ema,
            skip_nonfinite=skip_nonfinite, max_consecutive_skips=max_consecutive_skips,
            kind=kind, group=getattr(unwrap(model), "process_group", None),
            compile_optimizer=compile_optimizer, measure_grad_norm=measure_grad_norm,
        )  # fmt: skip
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.amp = amp
        self._rule = rule
        self._progress = Progress()
        self._kind = kind
        self._sync = MicroStepSync(model, kind)
        self._params = OptimizerParams(optimizer, model)
        self._weighting = Weighting(every, kind != "none", rule.group)
        self._window = Window()
        # The micro-step now open (set at entry, read until exit).
        self._inside = self._did_backward = self._ending = False
        self._final_pending = False  # iterate handed out the last item: its micro-step ends
        self._by_marks = False  # set by a step that splits batches: only marks end windows
        self._closed_by_group: str | None = None  # set by a group: why entering is refused
        self._reach: Reach | None = None  # set by a group: what its first window must not reach
        self.lookahead = 0
        """Items ``iterate`` has taken from its iterable but not yet handed out (0 or 1)."""
        self.iterating = 0
        """``iterate`` generators running now: the loop is driven by ``iterate``."""
        self._guard = _misuse.Guard(self, model, optimizer, scheduler, kind, every)
        rule.claim_ema(self)  # everything checked: the ema is this accumulate's to update

    # -- what a user reads ------------------------------------------------------------------

    @property
    def updates(self) -> int:
        """Optimizer updates done."""
        return self._progress.updates

    @property
    def updated(self) -> bool:
        """Whether the last micro-step, ``flush()`` or loop control made an update."""
        return self._window.micro == 0 and self._progress.last_updated

    @property
    def skipped(self) -> int:
        """Windows ended with no update: inf/nan (fp16's scaler, ``skip_nonfinite``), or
        dropped by the loop after their last micro-step raised."""
        return self._progress.skipped

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last update's total gradient norm before clipping (a device tensor, None before
        the first), measured with clipping, ``skip_nonfinite`` or ``measure_grad_norm``."""
        return self._rule.norm_read(self._progress, self._built_as)

    @property
    def ends_window(self) -> bool:
        """Whether the current (or, outside ``with``, the next) micro-step ends a window."""
        if self._inside:
            return self._ending
        by_count = self._window.micro + 1 >= self.every and not self._by_marks
        return by_count or self._final_pending

    @property
    def micro_step(self) -> int:
        """Micro-steps entered in the current window (1..every inside ``with``)."""
        return self._window.micro

    def settle(self) -> int:
        """``micro_step`` as loop control reads it: an overdue window closes there first."""
        close_overdue(self)
        return self._window.micro

    # -- the micro-step ---------------------------------------------------------------------

    def _enter(self) -> accumulate:
        if self._inside or self._closed_by_group is not None:
            raise RuntimeError(_NESTED if self._inside else self._closed_by_group)
        _open_steps.open_(self)  # refuses another step of this model's parameters first
        window = self._window
        if window.overdue:  # no loop control asked since its last micro-step raised
            window = going_on(self, window)
        ending = (window.micro + 1 >= self.every and not self._by_marks) or self._final_pending
        if window.micro == 0:
            # A window opens: foreign gradients (another model's backward through this one,
            # code outside the step) and the last update's (a lazy grad_norm's) go.
            window.cleared_foreign, self._progress.norm_source = self._params.clear_grads(), None
        if self._kind != "none":  # (without a wrapper nothing to turn off: no call)
            self._sync.enter(ending)
        self._final_pending, self._ending = False, ending  # (the mark: this micro-step's only)
        self._inside, self._did_backward = True, False
        window.micro += 1
        self._guard.entered(window.micro, self.iterating > 0)
        return self

    def backward(self, loss: torch.Tensor, weight: Weight | None = None, **autograd: Any) -> None:
        """Back-propagate this micro-batch's mean loss, normalized for the window.

        ``weight`` (samples or tokens in the micro-batch) makes unequal micro-batches count
        in proportion, as in one batch holding all of them. Several calls in one micro-step
        add up to its contribution; ``weight=`` goes with the first. ``inputs=``/
        ``retain_graph=`` go to autograd."""
        if torch.compiler.is_dynamo_compiling():  # run eagerly: _tracing
            return eagerly(self._backward, loss, weight, **autograd)
        return self._backward(loss, weight, **autograd)

    def _backward(self, loss: torch.Tensor, weight: Weight | None, **autograd: Any) -> None:
        if not self._inside:
            raise RuntimeError(_OUTSIDE)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a tensor, got {type(loss).__name__}")
        window, first = self._window, not self._did_backward
        self._guard.refuse_foreign(False)
        if self._sync.entered:
            self._sync.refuse_synced_forward()
        if self._reach is not None:  # a group member's first window only
            self._reach.check(loss, autograd.get("inputs"))
        finite = torch.isfinite(loss.detach()) if self._rule.watch_loss else None
        w, reference = self._weighting.backward(loss, weight, window, first, self.amp, autograd)
        # State changes only once backward has succeeded.
        synced = not self._sync.entered
        if first:
            weighted = weight is not None
            if weighted:
                self._weighting.commit(w, reference)
            window.add_backward(w, weighted, finite, synced)
        else:
            window.add_more(finite, self._sync.another_backward(synced))
        self._did_backward = True
        self._guard.backward_done(self._params.current())

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self._guard.raised()
            self._window.failed += 1
            self._window.overdue = self._ending
        try:
            if self._sync.entered:
                self._sync.exit(exc_type, exc, tb)
        finally:
            self._inside = False
            _open_steps.close(self)
        if exc_type is None and (
            self._ending or (not self._did_backward and _trained_from_outside(self))
        ):
            try:
                _close_window(self)
            except BaseException:
                self._guard.raised()  # a window its end refused is left by the error
                raise

    # -- window ends ------------------------------------------------------------------------

    def flush(self) -> bool:
        """Close a partial window now (after the loop); returns whether an update was made."""
        if self._inside:
            raise RuntimeError("flush() inside `with acc:`: call it after the micro-step ends")
        self._final_pending = False
        return _close_window(self) if self._window.micro and not discard_overdue(self) else False

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of ``iterable``, marking the last so its window closes on exit.

        The last item is found by looking one ahead, or by counting to ``len()`` where
        taking an item runs the data set in this process, so its random draws come where a
        plain loop's would (``_last_batch``). A window never spans two calls (two epochs):
        one left open by an earlier ``iterate`` left early (``break``, an exception) is
        closed on its own (``flush()``) first. ``acc.lookahead`` is 1 while an item is held.
        """
        return self._iterate_from(iterable, iterable)

    def _iterate_from(
        self, source: object, items: Iterable[T], move: _Move = None, done: int = 0
    ) -> Iterator[T]:
        """``iterate`` over ``items`` from ``source``, each moved by ``move`` as it is taken."""
        if self._inside:
            raise RuntimeError("iterate() inside `with acc:`: loop over acc.iterate(loader) "
                               "and enter the micro-step inside the loop")  # fmt: skip
        return _last_batch.marking(self, source, items, move, done)

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters for a resumed loop; refused mid-window (the gradients are not in it)."""
        if self._window.micro:
            raise RuntimeError(
                f"accumulate is mid-window ({self._window.micro} of {self.every} micro-steps): "
                "save at a window boundary (when acc.micro_step == 0)"
            )
        reference = self._weighting.state()
        return {**self._progress.state_dict(), "every": self.every, "w_ref": reference}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        if state.get("every") != self.every:
            raise ValueError(
                f"state was saved with every={state.get('every')!r} but this accumulate has "
                f"every={self.every}: build it with the same every"
            )
        self._progress, self._weighting.reference = Progress.from_state(state), state.get("w_ref")
        self._guard.forget_schedule()

    def __repr__(self) -> str:
        return (
            f"accumulate(every={self.every}, updates={self.updates}, skipped={self.skipped}, "
            f"micro_step={self._window.micro})"
        )


def _trained_from_outside(acc: accumulate) -> bool:
    """No backward of its own yet the parameters hold gradients (a direct loss.backward()):
    refused now, before a later s.backward adds to them (one process; ranks agree at the
    window's end). O(parameters), only on micro-steps that made no backward."""
    return (
        not acc._did_backward
        and acc._window.n_backward == 0
        and acc._kind == "none"
        and acc._params.have_grads()
    )


def close_overdue(acc: accumulate) -> None:
    """Close a window whose ending micro-step raised (``Window.overdue``) where loop control
    asks, outside ``with``: its update is made at its place. Not one FSDP would have to
    reduce by hand (its last backward unsynced): the next micro-step syncs and closes it."""
    window = acc._window
    if not window.overdue or acc._inside or unreducible(acc):
        return
    if not discard_overdue(acc):  # (a window the loop dropped is gone, not closed)
        _close_window(acc)


def _close_window(acc: accumulate) -> bool:
    """A window ends: its update (or none), then the next window starts clean; an exception
    drops the window as if it never happened."""
    window = acc._window
    acc._sync.refuse_unreduced_end(window)  # before anything changes
    acc._guard.refuse_foreign(at_end=True)
    try:
        update, factor = end_of_window(
            acc.model, acc._kind, window, acc.every, acc._weighting.reference,
            acc._params, acc._rule.group,
        )  # fmt: skip
        if not update:
            return False
        _misuse.STEPPING.add(id(acc.optimizer))  # its step pre-hook lets loopkit's through
        return acc._rule.apply(acc._params.current(), window, factor, acc._progress)
    except BaseException:
        # The window is dropped as if it had never happened: no unscale recorded, no
        # inf flag, no scale update (its gradients go with the zero_grad below).
        if acc.amp is not None:
            acc.amp.discard(acc.optimizer)
        raise
    finally:
        _misuse.STEPPING.discard(id(acc.optimizer))
        acc.optimizer.zero_grad(set_to_none=True)
        acc._window = Window()
        acc._guard.window_closed()
        acc._reach = None if window.n_backward else acc._reach  # checked: first window
