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

import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeAlias, TypeVar

import torch
from torch import nn

from ._core import ContextDecorator, is_int_at_least
from ._precision import autocast_step
from ._sync import no_sync, sync_grads_now, sync_kind, unwrap

T = TypeVar("T")
Weight: TypeAlias = "float | int | torch.Tensor"

# optimizer -> the accumulate bound to it; catches `accumulate(...)` rebuilt every iteration.
_BOUND: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[accumulate]] = (
    weakref.WeakKeyDictionary()
)


class accumulate(ContextDecorator):
    """Accumulate gradients over ``every`` micro-batches, then update once, exactly.

    Build it once before the loop; enter ``with acc:`` around each micro-batch's forward
    and backward and call ``acc.backward(loss)`` (``weight=`` the micro-batch's sample or
    token count when they differ) inside. Non-final micro-steps run under ``no_sync``.
    Leaving the final micro-step of a window unscales (fp16), normalizes, clips, steps the
    optimizer (skipping inf/nan under fp16), steps the scheduler only if the optimizer
    really stepped, and zeroes the gradients. ``skip_nonfinite=True`` (for bf16/fp32; fp16's
    scaler always skips) skips any update whose loss or gradient norm is inf/nan, at the
    cost of one host read per update; ``max_consecutive_skips=K`` raises after K skipped
    updates in a row. ``acc.flush()`` after the loop (or
    ``for batch in acc.iterate(loader)``, which knows where the data ends) closes a
    ragged last window with exact normalization. A micro-step left without backward
    counts toward ``every`` but contributes nothing.
    """

    every: int
    _micro: int

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
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(
                f"scheduler must have a step() method (a torch.optim.lr_scheduler), got "
                f"{type(scheduler).__name__}"
            )
        if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError(
                "scheduler is bound to a different optimizer than the one accumulate steps: "
                "build it on this optimizer"
            )
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
        if old is not None and old._micro > 0:
            raise RuntimeError(
                f"this optimizer is already bound to an accumulate that is mid-window "
                f"({old._micro} of {old.every} micro-steps done); building a new one would drop "
                "those gradients from the normalization. Build accumulate/loopkit.step once, "
                "before the loop, and enter it on every iteration (or flush() the old one first)"
            )
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.scheduler = scheduler
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.amp = amp
        self.skip_nonfinite = skip_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self._consecutive_skips = 0
        self._loss_finite: torch.Tensor | None = None
        self._kind = sync_kind(model)
        self._no_sync: no_sync | None = None if self._kind == "none" else no_sync(model)
        self._params = opt_params
        self._n_groups = len(optimizer.param_groups)
        # Window state.
        self._micro = 0  # micro-steps entered in the current window
        self._n_backward = 0  # of which called backward
        self._weighted: bool | None = None  # whether this window's micro-steps pass weight=
        self._weight_sum: Any = 0  # float or tensor
        self._weight_min: torch.Tensor | None = None  # for weights that live on a device
        self._last_synced = True
        # Micro-step state.
        self._inside = False
        self._did_backward = False
        self._in_no_sync = False
        self._ending = False
        self._final_marked = False
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
        return self._micro + 1 >= self.every or self._final_marked

    @property
    def micro_step(self) -> int:
        """Micro-steps entered in the current window (1..every inside ``with``)."""
        return self._micro

    # -- the micro-step ---------------------------------------------------------------------

    def __enter__(self) -> accumulate:
        if self._inside:
            raise RuntimeError(
                "accumulate is already inside a micro-step: enter `with acc:` once per "
                "micro-batch, not nested"
            )
        ending = self._micro + 1 >= self.every or self._final_marked
        if not ending and self._no_sync is not None:
            # Entered before the forward: DDP decides at the forward whether to all-reduce.
            self._no_sync.__enter__()
            self._in_no_sync = True
        self._ending = ending
        self._inside = True
        self._did_backward = False
        self._micro += 1
        return self

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
        weighted = weight is not None
        if self._weighted is not None and weighted != self._weighted:
            raise ValueError(
                "pass weight= on every micro-step of a window or on none: this window "
                f"started {'with' if self._weighted else 'without'} weights"
            )
        if weighted:
            w = _checked_weight(weight)
            if self._w_ref is None:
                self._w_ref = self._reference_weight(w)
            scaled = loss * (w / self._w_ref)
        else:
            w = 1
            scaled = loss / self.every
        finite = torch.isfinite(loss.detach()) if self.skip_nonfinite else None
        if self.amp is not None:
            self.amp.backward(scaled)
        else:
            scaled.backward()
        # State changes only once backward has succeeded.
        if finite is not None:
            self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        self._weighted = weighted
        self._weight_sum = w if self._n_backward == 0 else self._weight_sum + w
        if isinstance(w, torch.Tensor):
            self._weight_min = w if self._weight_min is None else torch.minimum(self._weight_min, w)
        self._n_backward += 1
        self._did_backward = True
        self._last_synced = not self._in_no_sync

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
        if exc_type is None and self._ending:
            self._boundary()

    # -- window ends ------------------------------------------------------------------------

    def flush(self) -> bool:
        """Close a partial window now (after the loop); returns whether an update was made."""
        if self._inside:
            raise RuntimeError("flush() inside `with acc:`: call it after the micro-step ends")
        if self._micro == 0:
            return False
        return self._boundary()

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of ``iterable``, marking the last so its window closes on exit.

        Looks one item ahead; a window never spans two calls (two epochs).
        ``acc.lookahead`` is 1 while an item is held back that the loop has not seen.
        """
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
                    self._final_marked = True
                    yield cur
                    return
                self.lookahead = 1
                yield cur
        finally:
            self._final_marked = False
            self.lookahead = 0

    def _boundary(self) -> bool:
        n = self._n_backward
        try:
            if n == 0:
                return False
            if not self._last_synced:
                self._sync_local_grads()
            params = self._current_params()
            factor = self._normalization(n)
            amp = self.amp
            if amp is not None and amp.scaler is not None:
                amp.unscale_(self.optimizer)
            if factor is not None:
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, factor)
            if self.clip_grad_norm is not None:
                # Returns a device tensor: no host sync (non-finite norms are left to the
                # fp16 skip or the non-finite guard, not raised).
                self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            if (
                self.skip_nonfinite
                and (amp is None or amp.scaler is None)
                and not self._finite(params)
            ):
                stepped = False
            elif amp is not None:
                stepped = amp.step(self.optimizer)
            else:
                stepped = _plain_step(self.optimizer)
            if stepped:
                self.updates += 1
                self._consecutive_skips = 0
                if self.scheduler is not None:
                    self.scheduler.step()
            else:
                self.skipped += 1
                self._consecutive_skips += 1
                limit = self.max_consecutive_skips
                if limit is not None and self._consecutive_skips >= limit:
                    raise RuntimeError(
                        f"{self._consecutive_skips} updates in a row were skipped for a "
                        "non-finite loss or gradient: training has diverged. Lower the learning "
                        "rate, check the data, or resume from an earlier checkpoint"
                    )
            return stepped
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_window()

    def _finite(self, params: list[torch.Tensor]) -> bool:
        norm = self.grad_norm if self.clip_grad_norm is not None else None
        if norm is None:
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        ok = torch.isfinite(norm)
        if self._loss_finite is not None:
            ok = ok & self._loss_finite.to(ok.device)
        # Host-device sync, once per update and only with skip_nonfinite: whether to step
        # is a host decision, and no weight may see a non-finite update.
        return bool(ok.item())

    def _normalization(self, n: int) -> Any:
        if not self._weighted:
            # Each backward used loss / every; the window had n of them.
            return None if n == self.every else self.every / n
        total = self._weight_sum
        if self._weight_min is not None:
            # Host-device sync, once per window and only for weights kept on a device:
            # a non-positive or non-finite weight must not reach the parameters.
            low = self._weight_min.item()
            if not (math.isfinite(low) and low > 0):
                raise ValueError(
                    f"a weight of this window was {low}: weights must be positive and finite "
                    "(the update was not made and the window's gradients were dropped)"
                )
        if self._kind == "ddp":
            # DDP averaged over ranks: sum of weights over ranks is the true denominator.
            total, world = self._all_reduce_sum(total)
            return world * self._w_ref / total
        return self._w_ref / total

    def _reset_window(self) -> None:
        self._micro = 0
        self._n_backward = 0
        self._weighted = None
        self._weight_sum = 0
        self._weight_min = None
        self._loss_finite = None
        self._last_synced = True

    def _current_params(self) -> list[torch.Tensor]:
        if len(self.optimizer.param_groups) != self._n_groups:
            self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
            self._n_groups = len(self.optimizer.param_groups)
        return self._params

    def _sync_local_grads(self) -> None:
        if self._kind == "ddp":
            sync_grads_now(self.model)
        elif self._kind != "none":
            raise RuntimeError(
                f"the window ended on a micro-step that ran without gradient sync under "
                f"{self._kind.upper()}, which cannot reduce its gradients afterwards: use "
                "`for batch in acc.iterate(loader)` so the last micro-batch syncs"
            )

    def _reference_weight(self, w: Any) -> Any:
        ref = w * self.every
        if self._kind == "ddp":
            total, world = self._all_reduce_sum(ref)
            ref = total / world
        return ref

    def _all_reduce_sum(self, value: Any) -> tuple[torch.Tensor, int]:
        import torch.distributed as dist

        ddp: Any = unwrap(self.model)
        group = getattr(ddp, "process_group", None)
        device = next(ddp.parameters()).device
        t = torch.as_tensor(value, dtype=torch.float64).to(device).reshape(1).clone()
        dist.all_reduce(t, group=group)
        return t[0], dist.get_world_size(group)

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters for a resumed loop; refused mid-window (the gradients are not in it)."""
        if self._micro:
            raise RuntimeError(
                f"accumulate is mid-window ({self._micro} of {self.every} micro-steps): save "
                "at a window boundary (when acc.micro_step == 0)"
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
            f"micro_step={self._micro})"
        )


def _plain_step(optimizer: torch.optim.Optimizer) -> bool:
    optimizer.step()
    return True


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
