"""accumulate: gradient accumulation whose update equals the large-batch update.

Normalization is deferred to the window boundary, where the window's true size is known:
each micro-step back-propagates ``loss / every`` (or ``loss * weight / w_ref`` with
weights), exactly what a hand-written loop does, and the boundary multiplies the summed
gradients by the one factor that turns them into the large-batch gradient (``every / k``
for a ragged window of k micro-batches, ``w_ref / sum(weights)`` with weights). Full
unweighted windows need no correction at all, so they cost nothing extra and are
bit-identical to the hand-written ``loss / N`` loop when N is a power of two.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from . import _ranks
from ._checks import is_int_at_least
from ._grad_sync import no_sync, sync_grads_now, sync_kind, unwrap
from ._host_syncs import expected_sync
from ._precision import agree_found_inf, autocast_step, mark_found_inf
from ._types import Weight

T = TypeVar("T")

# optimizer -> the accumulate bound to it; catches `accumulate(...)` rebuilt every iteration.
_BOUND: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[accumulate]] = (
    weakref.WeakKeyDictionary()
)
_FOREIGN = (
    "this window made no backward of its own (acc.backward / step.backward), yet its "
    "optimizer's parameters received gradients: from another step's backward through the "
    "same model, or a loss.backward() called directly. One model with two optimizers in two "
    "steps is not supported: give both parameter groups to one optimizer (per-group lr and "
    "weight decay are kept). The window was dropped"
)
# _sync_by_hand's answer when no rank made a backward in the window.
_NO_UPDATE = object()
# Accumulates inside a micro-step right now (almost always none or one).
_INSIDE: weakref.WeakSet[accumulate] = weakref.WeakSet()


class _Window:
    """What one accumulation window has seen; a new window is a new instance."""

    __slots__ = (
        "cleared_foreign",
        "last_synced",
        "loss_finite",
        "micro",
        "n_backward",
        "weight_min",
        "weight_sum",
        "weighted",
    )

    def __init__(self) -> None:
        self.micro = 0  # micro-steps entered
        self.n_backward = 0  # of which called backward
        self.weighted: bool | None = None  # whether its micro-steps pass weight=
        self.weight_sum: Any = 0  # float or device tensor
        self.weight_min: torch.Tensor | None = None  # for weights that live on a device
        self.loss_finite: torch.Tensor | None = None  # device flag, when losses are watched
        self.last_synced = True  # whether the last backward ran with gradient sync
        self.cleared_foreign = False  # gradients from elsewhere were cleared when it opened


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a scheduler that cannot be stepped once per update with no argument."""
    if scheduler is None:
        return
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise TypeError(
            f"scheduler must have a step() method (a torch.optim.lr_scheduler), got "
            f"{type(scheduler).__name__}"
        )
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        params = []  # type: ignore[assignment]
    required = [
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if required:
        raise TypeError(
            f"{type(scheduler).__name__}.step() needs {', '.join(required)}: it cannot be stepped "
            "after each update. Step it yourself where the value is known (for "
            "ReduceLROnPlateau, scheduler.step(val_loss) after validation) and do not pass it here"
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            "scheduler is bound to a different optimizer than the one accumulate steps: "
            "build it on this optimizer"
        )


class accumulate(contextlib.ContextDecorator):
    """Accumulate gradients over ``every`` micro-batches, then update once, exactly.

    Build it once before the loop; enter ``with acc:`` around each micro-batch's forward
    and backward and call ``acc.backward(loss)`` (``weight=`` the micro-batch's sample or
    token count when they differ) inside. ``every`` counts micro-batches per update.
    Opening a window clears the optimizer's gradients (``set_to_none``), so gradients left
    by code outside the window never reach its update. Non-final micro-steps run under
    ``no_sync``. Leaving the final micro-step of a window unscales (fp16), normalizes,
    clips, steps the optimizer (skipping inf/nan under fp16), steps the scheduler only if
    the optimizer really stepped, and zeroes the gradients; an exception anywhere in that
    sequence drops the window (gradients and GradScaler bookkeeping) and counts nothing.
    ``skip_nonfinite=True`` skips any update whose loss or gradient norm is inf/nan on any
    rank (fp16's scaler skips inf/nan gradients anyway; a non-finite loss joins its flag),
    at the cost of one host read per update; ``max_consecutive_skips=K`` raises after K
    skipped updates in a row (under fp16, GradScaler's back-off while it calibrates is not
    counted: a skip counts when a loss was non-finite or the scale is already down to 1).
    ``acc.flush()`` after the loop (or ``for batch in acc.iterate(loader)``, which knows
    where the data ends) closes a ragged last window with exact normalization. A micro-step
    left without backward counts toward ``every`` but contributes nothing.
    """

    every: int
    _window: _Window

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
    ) -> None:
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
        if clip_grad_norm is not None and (
            isinstance(clip_grad_norm, bool)
            or not isinstance(clip_grad_norm, (int, float))
            or not math.isfinite(clip_grad_norm)
            or clip_grad_norm <= 0
        ):
            raise ValueError(
                f"clip_grad_norm must be a positive finite number or None, got {clip_grad_norm!r}"
            )
        check_scheduler(scheduler, optimizer)
        if amp is not None and not isinstance(amp, autocast_step):
            raise TypeError(
                f"amp must be a loopkit.autocast_step (it carries the fp16 GradScaler), got "
                f"{type(amp).__name__}"
            )
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
        if max_consecutive_skips is not None and not is_int_at_least(max_consecutive_skips, 1):
            raise ValueError(
                "max_consecutive_skips must be an int >= 1 (raise after that many skipped "
                f"updates in a row) or None, got {max_consecutive_skips!r}"
            )
        model_params = {id(p) for p in model.parameters()}
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(id(p) in model_params for p in opt_params):
            raise ValueError(
                "the optimizer holds none of the model's parameters: build it from "
                "model.parameters() of this model (after wrapping it, if you wrap it)"
            )
        previous = _BOUND.get(optimizer)
        old = previous() if previous is not None else None
        if old is not None and old._window.micro > 0:
            raise RuntimeError(
                f"this optimizer is already bound to an accumulate that is mid-window "
                f"({old._window.micro} of {old.every} micro-steps done); building a new one "
                "would drop those gradients from the normalization. Build accumulate/"
                "loopkit.step once, before the loop, and enter it on every iteration (or "
                "flush() the old one first)"
            )
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.scheduler = scheduler
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.amp = amp
        self._fp16 = amp is not None and amp.scaler is not None
        self.skip_nonfinite = skip_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        # Losses are checked on the device (no sync) when a decision needs them.
        self._watch_loss = skip_nonfinite or (self._fp16 and max_consecutive_skips is not None)
        self._consecutive_skips = 0
        self._kind = sync_kind(model)
        self._group: Any = getattr(unwrap(model), "process_group", None)
        self._no_sync: no_sync | None = None if self._kind == "none" else no_sync(model)
        self._params = opt_params
        self._n_groups = len(optimizer.param_groups)
        self._window = _Window()
        self._ids: tuple[frozenset[int], frozenset[int]] | None = None
        # Micro-step state.
        self._inside = False
        self._did_backward = False
        self._in_no_sync = False
        self._ending = False
        self._final_pending = False  # iterate handed out the last item: its micro-step ends
        self.lookahead = 0
        """Items ``iterate`` has taken from its iterable but not yet handed out (0 or 1)."""
        # Weighted normalization reference: fixed at the first weighted backward so that
        # every micro-step's loss is scaled alike (the same on every rank under DDP).
        self._w_ref: Any = None
        # What a user reads.
        self.updates = 0
        """Optimizer updates done."""
        self.skipped = 0
        """Updates skipped for inf/nan (fp16's scaler, or ``skip_nonfinite``)."""
        self.grad_norm: torch.Tensor | None = None
        """Total gradient norm before clipping at the last update (a device tensor, no sync)."""
        _BOUND[optimizer] = weakref.ref(self)

    # -- state a user reads ---------------------------------------------------------------

    @property
    def ends_window(self) -> bool:
        """Whether the current (or, outside ``with``, the next) micro-step ends a window."""
        if self._inside:
            return self._ending
        return self._window.micro + 1 >= self.every or self._final_pending

    @property
    def micro_step(self) -> int:
        """Micro-steps entered in the current window (1..every inside ``with``)."""
        return self._window.micro

    # -- the micro-step ---------------------------------------------------------------------

    def __enter__(self) -> accumulate:
        if self._inside:
            raise RuntimeError(
                "accumulate is already inside a micro-step: enter `with acc:` once per "
                "micro-batch, not nested"
            )
        if _INSIDE:
            self._refuse_overlap()
        window = self._window
        ending = window.micro + 1 >= self.every or self._final_pending
        if window.micro == 0:
            # A window opens: gradients left by code outside it (another model's backward
            # through this one, a forward/backward outside the step) must not join its update.
            window.cleared_foreign = self._clear_grads()
        if not ending and self._no_sync is not None:
            # Entered before the forward: DDP decides at the forward whether to all-reduce.
            self._no_sync.__enter__()
            self._in_no_sync = True
        self._final_pending = False  # the mark is for this one micro-step only
        self._ending = ending
        self._inside = True
        _INSIDE.add(self)
        self._did_backward = False
        window.micro += 1
        return self

    def _refuse_overlap(self) -> None:
        # Two micro-steps open at once are fine for two models (a GAN's D and G), not when
        # one's backward reaches the other's parameters: that optimizer would get gradients
        # from a window it does not normalize, or lose them at its own boundary.
        mine = self._param_ids()
        for other in _INSIDE:
            theirs = other._param_ids()
            if mine[0] & theirs[1] or theirs[0] & mine[1]:
                raise RuntimeError(
                    "another step/accumulate whose model shares parameters with this one is "
                    "inside a micro-step: one model with two optimizers in two steps entered "
                    "together is not supported (one backward would feed both windows). Give "
                    "both parameter groups to one optimizer (per-group lr and weight decay are "
                    "kept), or enter the steps one after the other on separate models"
                )

    def _param_ids(self) -> tuple[frozenset[int], frozenset[int]]:
        """Ids of the model's parameters and of the optimizer's (computed once)."""
        if self._ids is None:
            model_ids = frozenset(id(p) for p in self.model.parameters())
            self._ids = (model_ids, frozenset(id(p) for p in self._current_params()))
        return self._ids

    def backward(self, loss: torch.Tensor, weight: Weight | None = None) -> None:
        """Back-propagate this micro-batch's loss, normalized for the window.

        ``loss`` is the micro-batch's mean loss as usual. ``weight`` (samples or tokens
        in the micro-batch) makes unequal micro-batches count in proportion, so the
        update equals the one of a single batch holding all of them.
        """
        if not self._inside:
            raise RuntimeError(
                "acc.backward(loss) must be called inside `with acc:` (it belongs to that "
                "micro-step's window)"
            )
        if self._did_backward:
            raise RuntimeError(
                "acc.backward was already called in this micro-step: add the losses and call "
                "it once, or use one `with acc:` per micro-batch"
            )
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a tensor, got {type(loss).__name__}")
        window = self._window
        weighted = weight is not None
        if window.weighted is not None and weighted != window.weighted:
            raise ValueError(
                "pass weight= on every micro-step of a window or on none: this window "
                f"started {'with' if window.weighted else 'without'} weights"
            )
        if weighted:
            w = _checked_weight(weight)
            w_ref = self._w_ref if self._w_ref is not None else self._reference_weight(w)
            scaled = loss * (w / w_ref)
        else:
            w = 1
            scaled = loss / self.every
        finite = torch.isfinite(loss.detach()) if self._watch_loss else None
        if self.amp is not None:
            self.amp.backward(scaled)
        else:
            scaled.backward()
        # State changes only once backward has succeeded.
        if weighted and self._w_ref is None:
            self._w_ref = w_ref
        if finite is not None:
            prior = window.loss_finite
            window.loss_finite = finite if prior is None else prior & finite
        window.weighted = weighted
        window.weight_sum = w if window.n_backward == 0 else window.weight_sum + w
        if isinstance(w, torch.Tensor):
            window.weight_min = (
                w if window.weight_min is None else torch.minimum(window.weight_min, w)
            )
        window.n_backward += 1
        window.last_synced = not self._in_no_sync
        self._did_backward = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._in_no_sync and self._no_sync is not None:
                self._in_no_sync = False
                self._no_sync.__exit__(exc_type, exc, tb)
        finally:
            self._inside = False
            _INSIDE.discard(self)
        if exc_type is None and self._ending:
            self._boundary()

    # -- window ends ------------------------------------------------------------------------

    def flush(self) -> bool:
        """Close a partial window now (after the loop); returns whether an update was made."""
        if self._inside:
            raise RuntimeError("flush() inside `with acc:`: call it after the micro-step ends")
        self._final_pending = False
        if self._window.micro == 0:
            return False
        return self._boundary()

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of ``iterable``, marking the last so its window closes on exit.

        Looks one item ahead; a window never spans two calls (two epochs): a window left
        open when an earlier ``iterate`` was left early (``break``, an exception) is closed
        as a window of its own (``flush()``) before this one hands out its first item.
        ``acc.lookahead`` is 1 while an item is held back that the loop has not seen.
        """
        if self._inside:
            raise RuntimeError(
                "iterate() inside `with acc:`: loop over acc.iterate(loader) and enter the "
                "micro-step inside the loop"
            )
        return self._iterate(iterable)

    def _iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        window = self._window
        if window.micro:
            if self._kind in ("fsdp1", "fsdp2") and window.n_backward and not window.last_synced:
                # FSDP cannot reduce the left-over gradients by hand: the first micro-step of
                # this pass syncs and closes that window (the one case a window spans two).
                self._final_pending = True
            else:
                self.flush()
        it = iter(iterable)
        try:
            nxt = next(it)
        except StopIteration:
            return
        try:
            while True:
                cur = nxt
                try:
                    nxt = next(it)
                except StopIteration:
                    self.lookahead = 0
                    self._final_pending = True
                    yield cur
                    return
                self.lookahead = 1
                yield cur
        finally:
            self._final_pending = False
            self.lookahead = 0

    def _boundary(self) -> bool:
        window = self._window
        if window.n_backward and not window.last_synced and self._kind not in ("none", "ddp"):
            # Checked before anything changes: the window stays open and its next micro-step
            # with backward (which syncs, since the window is due) closes it.
            raise RuntimeError(
                f"the window ended on a micro-step that ran without gradient sync under "
                f"{self._kind.upper()}, which cannot reduce its gradients afterwards; the "
                "window is kept open (nothing was changed) and its next micro-step with "
                "backward closes it. Use `for batch in acc.iterate(loader)` so the last "
                "micro-batch of the data syncs"
            )
        try:
            if self._kind == "ddp" and not (window.n_backward and window.last_synced):
                # Gradients still local: no rank made a synced backward in the window's last
                # micro-step (had one rank made it, DDP would wait for every rank), so every
                # rank is here and takes part in the by-hand all-reduce.
                factor = self._sync_by_hand(window)
                if factor is _NO_UPDATE:
                    return False
            elif window.n_backward == 0:
                self._refuse_foreign_gradients(window)
                return False
            else:
                # The factor that turns the summed micro-step gradients into the window's
                # mean (validates device weights first: nothing below runs on a bad weight).
                factor = self._normalization(window)
            return self._update(window, factor)
        except BaseException:
            # The window is dropped as if it had never happened: no unscale recorded, no
            # inf flag, no scale update (its gradients go with the zero_grad below).
            if self.amp is not None:
                self.amp.discard(self.optimizer)
            raise
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self._window = _Window()

    def _update(self, window: _Window, factor: Any) -> bool:
        """The update, in order: unscale, normalize, clip, guard, step, count, schedule."""
        params = self._current_params()
        # 1. fp16: unscale, so that clipping and the guard see true gradients.
        amp = self.amp
        if self._fp16:
            assert amp is not None
            amp.unscale_(self.optimizer)
        # 2. Normalize once, for the whole window.
        if factor is not None:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                if isinstance(factor, torch.Tensor):
                    factor = factor.to(grads[0].device)
                torch._foreach_mul_(grads, factor)
        # 3. Clip. Returns a device tensor: no host sync (non-finite norms are left to the
        #    fp16 skip or the non-finite guard, not raised).
        if self.clip_grad_norm is not None:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        # 4. Guard and step: fp16 skips on inf/nan by itself, the guard does for bf16/fp32.
        if self._fp16:
            assert amp is not None and amp.scaler is not None
            if self._kind == "fsdp1":
                # Each rank holds a shard: its inf flag covers only that shard. (FSDP2's
                # DTensor gradients need nothing: DTensor's unscale already takes the max
                # of the flag over the mesh.)
                agree_found_inf(amp.scaler, self.optimizer, self._group)
            if self.skip_nonfinite:
                # The scaler skips on inf/nan gradients; a non-finite loss with finite
                # gradients (on any rank) must skip too: it joins the scaler's flag.
                mark_found_inf(amp.scaler, self.optimizer, self._loss_bad(window))
            stepped = amp.step(self.optimizer)
        elif self.skip_nonfinite and not self._finite(params, window):
            stepped = False
        else:
            self.optimizer.step()
            stepped = True
        # 5. Count, and step the scheduler only for a real update.
        if stepped:
            self.updates += 1
            self._consecutive_skips = 0
            if self.scheduler is not None:
                self.scheduler.step()
        else:
            self.skipped += 1
            if self._skip_counts(window):
                self._consecutive_skips += 1
            limit = self.max_consecutive_skips
            if limit is not None and self._consecutive_skips >= limit:
                raise RuntimeError(
                    f"{self._consecutive_skips} updates in a row were skipped for a "
                    "non-finite loss or gradient: training has diverged. Lower the learning "
                    "rate, check the data, or resume from an earlier checkpoint"
                )
        return stepped

    def _refuse_foreign_gradients(self, window: _Window) -> None:
        # The window made no backward of its own. Gradients on its parameters now, or
        # cleared when it opened, came from a backward it did not make: its parameters are
        # trained by another step's backward, and would silently never be updated.
        if window.cleared_foreign or self._has_grads():
            raise RuntimeError(_FOREIGN)

    def _sync_by_hand(self, window: _Window) -> Any:
        """All-reduce a DDP window's local gradients; the factor every rank normalizes by.

        One collective carries the gradients (aligned by parameter) and what the factor
        needs: backward counts, weight sums, the weight reference, a bad-weight and a
        foreign-gradient flag. Every decision below is made from those reduced values, so it
        is the same on every rank, even on a rank that made no backward at all.
        """
        weighted = bool(window.weighted)
        weight_sum: Any = window.weight_sum if weighted else 0.0
        bad: Any = 0.0
        if window.weight_min is not None:
            bad = ~(torch.isfinite(window.weight_min) & (window.weight_min > 0))
        with expected_sync("the weights' check"):
            # Host-device syncs, only on this rare path and only for weights on a device.
            weight_sum, bad = float(weight_sum), float(bad)
            w_ref = float(self._w_ref) if weighted else 0.0
        n = window.n_backward
        extras = [
            0.0 if weighted else float(n),  # unweighted backward calls
            float(n) if weighted else 0.0,  # weighted backward calls
            weight_sum,
            w_ref,
            1.0 if weighted else 0.0,  # ranks whose weight reference is in the sum above
            bad,
            float(window.cleared_foreign or (n == 0 and self._has_grads())),
        ]
        n_plain, n_weighted, total, ref_sum, refs, bad_ranks, foreign = sync_grads_now(
            self.model, extras
        )
        if foreign:
            raise RuntimeError(_FOREIGN)
        if bad_ranks:
            raise ValueError(
                "a weight of this window was not positive and finite: weights must be "
                "positive and finite (the update was not made and the window's gradients "
                "were dropped)"
            )
        if n_plain and n_weighted:
            raise ValueError(
                "some ranks passed weight= in this window and others did not: pass weight= on "
                "every micro-step of every rank, or on none"
            )
        world = _ranks.world(self._group)[1]
        if n_weighted:
            return world * (ref_sum / refs) / total
        if n_plain:
            return self.every * world / n_plain
        return _NO_UPDATE

    def _has_grads(self) -> bool:
        return any(p.grad is not None for p in self._current_params())

    def _finite(self, params: list[torch.Tensor], window: _Window) -> bool:
        norm = self.grad_norm if self.clip_grad_norm is not None else None
        if norm is None:
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        # Every rank takes the same decision: a non-finite loss on one rank skips the update
        # everywhere (the norm is the same on every rank, its loss is not).
        ok = torch.isfinite(norm) & ~self._loss_bad(window).to(norm.device)
        # Host-device sync, once per update and only with skip_nonfinite: whether to step
        # is a host decision, and no weight may see a non-finite update.
        with expected_sync("skip_nonfinite's check"):
            return bool(ok.item())

    def _loss_bad(self, window: _Window) -> torch.Tensor:
        """A 0-d bool, the same on every rank: whether any rank's window had a non-finite loss.

        A collective under DDP/FSDP (every rank calls it: the settings that ask for it are
        the same everywhere); no host sync.
        """
        bad = torch.zeros((), dtype=torch.bool)
        if window.loss_finite is not None:
            bad = window.loss_finite.logical_not()
        return _ranks.any_(bad, self._group) if self._kind != "none" else bad

    def _skip_counts(self, window: _Window) -> bool:
        """Whether a skipped update counts toward ``max_consecutive_skips``."""
        if not self._fp16 or self.max_consecutive_skips is None:
            return True
        # GradScaler halves its scale on overflow until the scaled gradients fit: such
        # skips are calibration, not divergence. A skip counts when a loss was non-finite
        # (on any rank), or when the scale has no room left to back off.
        assert self.amp is not None and self.amp.scaler is not None
        bad = self._loss_bad(window)
        with expected_sync("max_consecutive_skips' check"):
            # Host-device syncs (the flag, the scale), only on a skipped fp16 update with a
            # skip limit.
            return bool(bad.item()) or self.amp.scaler.get_scale() <= 1.0

    def _normalization(self, window: _Window) -> Any:
        n = window.n_backward
        if not window.weighted:
            # Each backward used loss / every; the window had n of them.
            return None if n == self.every else self.every / n
        total = window.weight_sum
        # Host weights were checked at backward; device weights are checked here, once.
        on_device = window.weight_min is not None
        bad: Any = False
        if window.weight_min is not None:
            low = window.weight_min
            bad = ~(torch.isfinite(low) & (low > 0))
        if self._kind != "none":
            # Gradients were averaged over ranks: the true denominator is the sum of weights
            # over ranks. A bad weight on any rank travels in the same collective, so every
            # rank raises together.
            summed = self._sum_over_ranks(total, bad)
            total, bad = summed[0], summed[1] > 0
            factor = _ranks.world(self._group)[1] * self._w_ref / total
        else:
            factor = self._w_ref / total
        if on_device:
            # Host-device sync, once per window and only for weights kept on a device:
            # a non-positive or non-finite weight must not reach the parameters.
            with expected_sync("the weights' check"):
                refuse = bool(bad.item())
            if refuse:
                raise ValueError(
                    "a weight of this window was not positive and finite: weights must be "
                    "positive and finite (the update was not made and the window's gradients "
                    "were dropped)"
                )
        return factor

    def _clear_grads(self) -> bool:
        """Set the optimizer's gradients to None; whether there were any (no sync)."""
        found = False
        for p in self._current_params():
            if p.grad is not None:
                p.grad = None
                found = True
        return found

    def _current_params(self) -> list[torch.Tensor]:
        if len(self.optimizer.param_groups) != self._n_groups:
            self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
            self._n_groups = len(self.optimizer.param_groups)
        return self._params

    def _reference_weight(self, w: Any) -> Any:
        ref = w * self.every
        if self._kind != "none":
            # The same reference on every rank, so every rank's loss is scaled alike.
            summed = self._sum_over_ranks(ref, 0.0)
            ref = summed[0] / _ranks.world(self._group)[1]
        return ref

    def _sum_over_ranks(self, *values: Any) -> torch.Tensor:
        device = _ranks.comm_device(self._group)
        t = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64).to(device).reshape(()) for v in values]
        )
        return _ranks.sum_(t, self._group)

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters for a resumed loop; refused mid-window (the gradients are not in it)."""
        if self._window.micro:
            raise RuntimeError(
                f"accumulate is mid-window ({self._window.micro} of {self.every} micro-steps): "
                "save at a window boundary (when acc.micro_step == 0)"
            )
        w_ref = self._w_ref
        if isinstance(w_ref, torch.Tensor):
            w_ref = w_ref.detach().cpu()
        return {
            "updates": self.updates,
            "skipped": self.skipped,
            "consecutive_skips": self._consecutive_skips,
            "every": self.every,
            "w_ref": w_ref,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        if state.get("every") != self.every:
            raise ValueError(
                f"state was saved with every={state.get('every')!r} but this accumulate has "
                f"every={self.every}: build it with the same every"
            )
        self.updates = int(state["updates"])
        self.skipped = int(state["skipped"])
        self._consecutive_skips = int(state.get("consecutive_skips", 0))
        self._w_ref = state.get("w_ref")

    def __repr__(self) -> str:
        return (
            f"accumulate(every={self.every}, updates={self.updates}, skipped={self.skipped}, "
            f"micro_step={self._window.micro})"
        )


def _checked_weight(weight: object) -> Any:
    """A host weight as a checked float; an accelerator tensor as is (checked at the boundary)."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float, torch.Tensor)):
        raise TypeError(
            f"weight must be a positive number or a scalar tensor (samples or tokens in the "
            f"micro-batch), got {type(weight).__name__}"
        )
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise ValueError(f"weight must be a scalar, got shape {tuple(weight.shape)}")
        if weight.device.type != "cpu":
            # Reading it here would stall the host every micro-step; it is checked once per
            # window instead.
            return weight.detach().reshape(()).float()
        weight = weight.item()  # host memory: no device sync
    value = float(weight)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"weight must be positive and finite, got {value}: pass the number of samples "
            "or tokens in this micro-batch"
        )
    return value
