"""The update at a window's boundary, as one ordered sequence, and what it counts.

``UpdateRule`` holds one accumulate's fixed settings (optimizer, precision, clipping,
scheduler, the non-finite guard) and validates them on construction; ``apply`` is the
sequence itself: unscale, normalize, clip, guard, step, count, schedule.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import _ranks
from .._checks import is_int_at_least
from .._compile._optimizer_step import CompiledOptimizerStep, check_compilable
from .._compile._options import CompileLike, compile_options
from .._ema import _average
from .._precision import agree_found_inf, autocast_step, mark_found_inf
from .._sync_points import expected_sync
from .._types import SyncKind
from ._window import Window


class Progress:
    """What a user reads: updates made and skipped, the skip run, the last gradient norm."""

    __slots__ = (
        "consecutive_skips", "grad_norm", "last_updated", "loaded", "norm_source", "skipped",
        "updates",
    )  # fmt: skip

    def __init__(self) -> None:
        self.updates = 0
        self.skipped = 0
        self.consecutive_skips = 0
        self.grad_norm: torch.Tensor | None = None
        # The last update's gradients, held from the update to the next window's first
        # micro-step, for a norm nobody asked to measure but a reader asks for (lazily).
        self.norm_source: list[torch.Tensor] | None = None
        self.last_updated = False  # whether the last window closed made an update (not a skip)
        self.loaded: int | None = None
        """Windows closed (updates and skips) as loaded from a checkpoint; None if never."""

    def state_dict(self) -> dict[str, int]:
        """The counters a resumed loop continues from."""
        return {
            "updates": self.updates,
            "skipped": self.skipped,
            "consecutive_skips": self.consecutive_skips,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Progress:
        """The counters ``state_dict`` saved."""
        progress = cls()
        progress.updates = int(state["updates"])
        progress.skipped = int(state["skipped"])
        progress.consecutive_skips = int(state.get("consecutive_skips", 0))
        progress.loaded = progress.updates + progress.skipped
        return progress


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
        params = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        params = []
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


def check_emas(ema: object, optimizer: torch.optim.Optimizer) -> tuple[_average.ema, ...]:
    """The averages an ``ema=`` names (one, or a list of several decays), each checked to be
    a loopkit.ema of parameters this optimizer updates."""
    if ema is None:
        return ()
    given: list[object] = list(ema) if isinstance(ema, (list, tuple)) else [ema]
    emas: list[_average.ema] = []
    for e in given:
        if isinstance(e, _average.ema):
            emas.append(e)
        else:
            raise TypeError(
                f"ema must be a loopkit.ema(model) or a list of them (several decays), got "
                f"{type(e).__name__}"
            )
    if len({id(e) for e in emas}) != len(emas):
        raise ValueError("the same ema is given twice: each average is updated once per update")
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for e in emas:
        stray = [n for n, p in zip(e._names, e._params, strict=True) if id(p) not in stepped]
        if stray:
            more = f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""
            raise ValueError(
                f"the ema averages {stray[0]!r}{more}, which this step's optimizer does not "
                "update: build the ema on the model this step trains"
            )
    return tuple(emas)


class UpdateRule:
    """How one optimizer is updated at a window boundary (settings checked on construction)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        amp: autocast_step | None,
        clip_grad_norm: float | None,
        scheduler: Any,
        ema: _average.ema | Sequence[_average.ema] | None = None,
        skip_nonfinite: bool,
        max_consecutive_skips: int | None,
        kind: SyncKind,
        group: Any,
        compile_optimizer: CompileLike = False,
        measure_grad_norm: bool = False,
    ) -> None:
        if not isinstance(measure_grad_norm, bool):
            raise TypeError(f"measure_grad_norm must be True or False, got {measure_grad_norm!r}")
        if clip_grad_norm is not None and (
            isinstance(clip_grad_norm, bool)
            or not isinstance(clip_grad_norm, (int, float))
            or not math.isfinite(clip_grad_norm)
            or clip_grad_norm <= 0
        ):
            raise ValueError(
                f"clip_grad_norm must be a positive finite number or None, got "
                f"{clip_grad_norm!r} (to measure the norm without clipping, leave "
                "clip_grad_norm= out and pass measure_grad_norm=True: step.grad_norm)"
            )
        check_scheduler(scheduler, optimizer)
        emas = check_emas(ema, optimizer)
        compiled = compile_options(compile_optimizer, "compile_optimizer")
        if compiled is not None:
            check_compilable(optimizer, scheduler)
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
        self.optimizer = optimizer
        self.amp = amp
        self.fp16 = amp is not None and amp.scaler is not None
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.scheduler = scheduler
        self.emas = emas
        """The averages updated after each real update (``ema=``: one or several)."""
        self.skip_nonfinite = skip_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.kind: SyncKind = kind
        self.group = group
        self.compiled_step = (
            None if compiled is None else CompiledOptimizerStep(optimizer, compiled)
        )
        """``compile_optimizer=``: the optimizer's step, compiled (None: ``optimizer.step``)."""
        # The total gradient norm: one foreach norm per update, made only where clipping,
        # the non-finite guard or a reader (measure_grad_norm=True) needs it.
        self.measures_norm = self.clip_grad_norm is not None or skip_nonfinite or measure_grad_norm
        # Losses are checked on the device (no sync) when a decision needs them.
        self.watch_loss = skip_nonfinite or (self.fp16 and max_consecutive_skips is not None)

    def apply(
        self, params: list[torch.Tensor], window: Window, factor: Any, progress: Progress
    ) -> bool:
        """The update, in order; returns whether the optimizer stepped."""
        opt, amp = self.optimizer, self.amp
        # 1. fp16: unscale, so that clipping and the guard see true gradients.
        if amp is not None and self.fp16:
            amp.unscale_(opt)
        # 2. Normalize once, for the whole window.
        if factor is not None:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                if isinstance(factor, torch.Tensor):
                    factor = factor.to(grads[0].device)
                torch._foreach_mul_(grads, factor)
        # 3. Clip, or only measure (when asked): the total norm is a device tensor, no host
        #    sync (non-finite norms are left to the fp16 skip or the non-finite guard, not
        #    raised). ``params`` are in the model's order, as the hand loop's
        #    clip_grad_norm_(model.parameters(), ...) sums them: the same bits.
        if self.clip_grad_norm is not None:
            progress.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        elif self.measures_norm:
            grads = [p.grad for p in params if p.grad is not None]
            progress.grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        elif self.kind != "fsdp1" and self.kind != "fsdp2":
            # Nothing measured: a list of the gradients, read lazily (norm_read) if at all.
            progress.grad_norm = None
            progress.norm_source = [p.grad for p in params if p.grad is not None]
        # 4. Guard and step: fp16's scaler skips inf/nan by itself, the guard does for
        #    bf16/fp32; both decide alike on every rank.
        if amp is not None and amp.scaler is not None:
            if self.kind == "fsdp1":
                # Each rank holds a shard: its inf flag covers only that shard. (FSDP2's
                # DTensor gradients need nothing: DTensor's unscale takes the max over the mesh.)
                agree_found_inf(amp.scaler, opt, self.group)
            if self.skip_nonfinite:
                # A non-finite loss with finite gradients (on any rank) joins the scaler's flag.
                mark_found_inf(amp.scaler, opt, self.loss_bad(window))
            stepped = amp.step_each((opt,), self._step_optimizer)
        elif self.skip_nonfinite and not self._finite(params, window, progress):
            stepped = False
        else:
            self._step_optimizer(opt)
            stepped = True
        # 5. Count, and step the scheduler only for a real update.
        progress.last_updated = stepped
        if stepped:
            progress.updates += 1
            progress.consecutive_skips = 0
            if self.scheduler is not None:
                self.scheduler.step()
            for average in self.emas:
                average.advance()  # averaged once per real update (every= counts these)
            return True
        progress.skipped += 1
        if self._skip_counts(window):
            progress.consecutive_skips += 1
        limit = self.max_consecutive_skips
        if limit is not None and progress.consecutive_skips >= limit:
            raise RuntimeError(
                f"{progress.consecutive_skips} updates in a row were skipped for a non-finite "
                "loss or gradient: training has diverged. Lower the learning rate, check the "
                "data, or resume from an earlier checkpoint"
            )
        return False

    def norm_read(self, progress: Progress, built_as: str) -> torch.Tensor | None:
        """The last update's norm for a reader. Unmeasured, it is computed at the first read
        from the update's gradients, held until the next window's first micro-step (a device
        tensor, no host sync: the same bits as measuring it at the update, for an optimizer
        that leaves the gradients as they are); refused where they are gone or sharded."""
        if self.measures_norm or progress.grad_norm is not None or not progress.updates:
            return progress.grad_norm
        source = progress.norm_source
        if source is not None:
            progress.norm_source = None
            progress.grad_norm = torch.nn.utils.get_total_norm(source) if source else None
            return progress.grad_norm
        name = "step" if built_as == "loopkit.step" else "acc"
        where = (
            "its gradients are sharded (a norm needs every rank: read on one, it would hang)"
            if self.kind in ("fsdp1", "fsdp2")
            else "the next window has begun (read it after the update, before the next micro-step)"
        )
        raise RuntimeError(
            f"{name}.grad_norm of the last update is not measured: this {built_as} neither "
            f"clips nor was asked for the norm, and {where}. Build it with "
            "measure_grad_norm=True (one foreach norm per update) or clip_grad_norm=..."
        )

    def _step_optimizer(self, opt: torch.optim.Optimizer) -> None:
        if self.compiled_step is None:
            opt.step()
        else:
            self.compiled_step()

    def claim_ema(self, owner: object) -> None:
        """The averages are updated by ``owner`` from now on (after everything was checked)."""
        for average in self.emas:
            average.given_to(owner)

    def loss_bad(self, window: Window) -> torch.Tensor:
        """A 0-d bool, the same on every rank: whether any rank's window had a non-finite loss.

        A collective under DDP/FSDP (every rank calls it: the settings that ask for it are
        the same everywhere); no host sync.
        """
        bad = torch.zeros((), dtype=torch.bool)
        if window.loss_finite is not None:
            bad = window.loss_finite.logical_not()
        return _ranks.any_(bad, self.group) if self.kind != "none" else bad

    def _finite(self, params: list[torch.Tensor], window: Window, progress: Progress) -> bool:
        norm = progress.grad_norm  # measured at step 3 of this update
        if norm is None:
            norm = torch.zeros(())
        # The norm is the same on every rank, its loss is not: a non-finite loss on one rank
        # skips the update everywhere.
        ok = torch.isfinite(norm) & ~self.loss_bad(window).to(norm.device)
        # Host-device sync, once per update and only with skip_nonfinite: whether to step
        # is a host decision, and no weight may see a non-finite update.
        with expected_sync("skip_nonfinite's check"):
            return bool(ok.item())

    def _skip_counts(self, window: Window) -> bool:
        """Whether a skipped update counts toward ``max_consecutive_skips``."""
        amp = self.amp
        if amp is None or amp.scaler is None or self.max_consecutive_skips is None:
            return True
        # GradScaler halves its scale on overflow until the scaled gradients fit: such
        # skips are calibration, not divergence. A skip counts when a loss was non-finite
        # (on any rank), or when the scale has no room left to back off.
        bad = self.loss_bad(window)
        with expected_sync("max_consecutive_skips' check"):
            # Host-device syncs (the flag, the scale), only on a skipped fp16 update with a
            # skip limit.
            return bool(bad.item()) or amp.scaler.get_scale() <= 1.0
