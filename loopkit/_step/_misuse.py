"""Guards against the mistakes of a half-ported loop: user code doing what a step now does.

A loop ported one line at a time keeps, for a while, lines that loopkit now does itself.
Each guard below names the user's line to change and costs O(1) per micro-step, with no
host sync:

- ``optimizer.step()`` by user code on an optimizer a step owns: refused by a step
  pre-hook, before the optimizer changes (``claim``, ``loopkit_steps``);
- a scheduler given to the step and also stepped by user code: refused at the next window
  end, before its update (``Guard.refuse_foreign``);
- the window's gradients changed between loopkit's own backward calls (a ``zero_grad()``,
  a stray or foreign ``backward``, a hand-written clip): refused at the next backward or
  window end. Two sentinel parameters are watched (the first and the last of the
  optimizer's that hold a gradient): a ``zero_grad`` or a backward through the model
  reaches both;
- a window left open: warned when the step is collected or the process exits, and when
  the same ``distributed.loader`` starts a new pass in the middle of a window;
- a model not wrapped for its process group: warned when the step is built.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import re
import sys
import warnings
import weakref
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

from .. import _ranks
from .._compile._order import compiled_around_wrapper
from .._data._epoch_loader import Pass
from .._errors import OpenWindowWarning, UnwrappedModelWarning
from .._types import SyncKind
from . import _source

_SKIP = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # loopkit
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.abspath(contextlib.__file__),
)


def user_frame() -> FrameType | None:
    """The innermost frame of the user's code (outside loopkit, torch and contextlib)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    return frame


def _where(frame: FrameType | None) -> str:
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _code_line(where: tuple[Any, ...] | None) -> str:
    """The first of the recorded (code, line) pairs that is the user's."""
    pairs = list(zip(where[::2], where[1::2], strict=True)) if where else []
    for code, line in pairs:
        if not code.co_filename.startswith(_SKIP):
            return f"{code.co_filename}:{line}"
    return "?"


def _warn(message: str, category: type[Warning], frame: FrameType | None) -> None:
    """Warn at the user's line (so the default filter shows it once per line)."""
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__"),
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
    )


def lines_calling(frame: FrameType | None, obj: object, method: str) -> list[str]:
    """``file:line`` of each ``<name>.<method>(`` in the first file, going up the stack from
    ``frame``, whose code binds a name to ``obj``."""
    while frame is not None:
        names = [k for k, v in {**frame.f_globals, **frame.f_locals}.items() if v is obj]
        if names and not frame.f_code.co_filename.startswith(_SKIP):
            pattern = re.compile(rf"\b(?:{'|'.join(map(re.escape, names))})\.{method}\(")
            path = frame.f_code.co_filename
            lines = linecache.getlines(path)
            return [f"{path}:{i}" for i, text in enumerate(lines, 1) if pattern.search(text)]
        frame = frame.f_back
    return []


# -- the optimizer: stepped by loopkit only ------------------------------------------------

# id(optimizer) -> (the optimizer, the step/accumulate that owns it), both weakly: a plain dict
# keyed by id is one fast lookup per window (a WeakKeyDictionary makes a weakref per lookup).
_OWNER: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}
_HOOKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
STEPPING: set[int] = set()
"""ids of the optimizers loopkit is stepping right now (added and discarded around the update,
in a ``finally``, by the step that owns it)."""


def owner_of(optimizer: torch.optim.Optimizer) -> Any:
    """The live step/accumulate that owns ``optimizer``, or None."""
    entry = _OWNER.get(id(optimizer))
    if entry is None or entry[0]() is not optimizer:
        return None
    return entry[1]()


def owns(optimizer: torch.optim.Optimizer, owner: weakref.ref[Any]) -> bool:
    """Whether ``owner`` is the one that owns ``optimizer`` now (one dict lookup)."""
    entry = _OWNER.get(id(optimizer))
    return entry is not None and entry[1] is owner and entry[0]() is optimizer


def _forget(key: int, _: object) -> None:
    _OWNER.pop(key, None)


def claim(optimizer: torch.optim.Optimizer, owner: weakref.ref[Any]) -> None:
    """Make ``owner`` the one that steps ``optimizer``: any other ``step()`` is refused."""
    key = id(optimizer)
    _OWNER[key] = (weakref.ref(optimizer, functools.partial(_forget, key)), owner)
    if optimizer not in _HOOKED:
        _HOOKED[optimizer] = optimizer.register_step_pre_hook(_refuse_foreign_step)


def _refuse_foreign_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if id(optimizer) in STEPPING or owner_of(optimizer) is None:
        return
    frame = user_frame()
    raise RuntimeError(
        f"optimizer.step() was called by your code ({_where(frame)}), but a loopkit.step/"
        "accumulate owns this optimizer and steps it itself, once per window, after "
        "unscaling, normalizing and clipping: this call would update it a second time (or "
        "mid-window). Remove that line, and the optimizer.zero_grad(), scaler.step() and "
        "scaler.update() next to it. Nothing was stepped"
    )


# -- one step's watch ----------------------------------------------------------------------


class _LeftOpen:
    """What the finalizer of a step reads: micro-steps of its open window, and where."""

    __slots__ = ("errors", "every", "micro", "where")

    def __init__(self, every: int) -> None:
        self.micro = 0
        self.where: tuple[Any, ...] | None = None  # (code, line) pairs; formatted if reported
        self.every = every
        self.errors = 0  # micro-steps that had raised, anywhere, as its last one began

    def report(self) -> None:
        # A window left open by an error (in any step's micro-step since its last one, or
        # uncaught and printed at exit: sys.last_value) is the error's consequence, not a
        # mistake of the loop: the error itself says what happened.
        if self.micro and self.errors == _ERRORS[0] and getattr(sys, "last_value", None) is None:
            warnings.warn(
                f"{self.micro} micro-step(s) of a loopkit.step/accumulate (accumulate="
                f"{self.every}, window opened at {_code_line(self.where)}) never became an "
                "update: the loop ended mid-window. Loop over step.iterate(loader) instead of "
                "the loader, or call step.flush() after the loop",
                OpenWindowWarning,
                stacklevel=1,
            )


class Guard:
    """One step's watch over the code around it; the per-window part resets together."""

    __slots__ = (
        "__weakref__", "_editors", "_edits_allowed", "_left", "_marks", "_owner", "_pass",
        "_sched_at", "_sched_lrs", "grads", "optimizer", "scheduler",
    )  # fmt: skip

    def __init__(
        self,
        owner: object,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        kind: SyncKind,
        every: int,
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        # FSDP moves gradients between shards inside its own hooks: watched only without it.
        # With accumulate=1 too: a loss.backward() after s.backward in the micro-step would
        # add its gradient to the update's (two sentinel reads per backward, no host sync).
        self.grads = kind in ("none", "ddp")
        # With accumulate=1 the window is its one micro-step: the user's own edit of its
        # gradients (a hand clip, added noise) is the update's, as in a hand loop; only a loss
        # back-propagated directly, which loopkit neither scales nor counts, is refused.
        self._edits_allowed = every == 1
        self._editors: set[CodeType] = set()  # functions seen editing with no direct backward
        self._marks: tuple[tuple[torch.Tensor, Any, int], ...] = ()
        self._pass: Pass | None = None
        # Read as the step's first window opens, where the scheduler becomes the step's to
        # step: a restore before that (the user's load_state_dict) is no foreign step.
        self._sched_at: Any = None
        self._sched_lrs: object = None  # the scheduler's base_lrs list as last read
        self._left = _LeftOpen(every)
        _GUARDS.add(self)
        weakref.finalize(owner, self._left.report)
        self._owner = weakref.ref(owner)
        if kind == "none" and _ranks.is_multi_rank():
            frame = user_frame()
            _warn(
                f"loopkit.step/accumulate built at {_where(frame)} on a model that is not "
                f"wrapped for the process group ({_ranks.world()[1]} processes): each rank "
                "would train its own copy. Wrap it first: model = "
                "loopkit.distributed.wrap(model) (DDP), then build the optimizer and the step",
                UnwrappedModelWarning,
                frame,
            )
        around = compiled_around_wrapper(model, kind)
        if around is not None:
            _warn(around, UserWarning, user_frame())

    def entered(self, micro: int, by_iterate: bool = False) -> None:
        """A micro-step was entered; ``micro`` counts it (1 opens the window).

        ``by_iterate``: the loop is driven by the step's ``iterate``, which closes a window
        at the end of what it is given; a window that spans a loader's passes there was
        handed out so by the loop's own iterable (passes chained for an iteration-based
        run), and is no mistake to warn about."""
        latest = Pass.latest
        if micro == 1:
            # The optimizer is the step's from its first window on (a step built and never
            # entered leaves it to the loop).
            if not owns(self.optimizer, self._owner):
                claim(self.optimizer, self._owner)
                self._sched_at = None  # another step had it: what it did is no foreign step
            if self._sched_at is None and self.scheduler is not None:
                self._sched_at = getattr(self.scheduler, "last_epoch", None)
                self._sched_lrs = getattr(self.scheduler, "base_lrs", None)
            self._pass = latest
            # Where the window opened, for a report at exit: the callers' code and lines,
            # sorted out only if it is reported (no walk up the stack per window).
            where: list[Any] = []
            frame: FrameType | None = sys._getframe(2)
            while frame is not None and len(where) < 10:  # 5 callers: a step's own included
                where += (frame.f_code, frame.f_lineno)
                frame = frame.f_back
            self._left.where = tuple(where)
        elif (
            latest is not None
            and self._pass is not None
            and latest is not self._pass
            and latest.loader_id == self._pass.loader_id
        ):
            self._pass = latest
            if not by_iterate:
                frame = user_frame()
                _warn(
                    f"a window of loopkit.step/accumulate spans two passes over the same "
                    f"loader ({_where(frame)}): the {micro - 1} micro-step(s) left from the "
                    "last pass are joined with this pass's, so windows no longer end with the "
                    "epoch. Loop over step.iterate(loader) instead of the loader itself",
                    OpenWindowWarning,
                    frame,
                )
        self._left.micro = micro
        self._left.errors = _ERRORS[0]

    @staticmethod
    def raised() -> None:
        """A micro-step is ending in an exception: windows open now are left by an error."""
        _ERRORS[0] += 1

    def backward_done(self, params: list[torch.Tensor]) -> None:
        """Remember the sentinels' gradients as loopkit's own backward left them."""
        if not self.grads or not params:
            return
        # Usually the first and the last parameter: no scan (and no branch taken per window).
        first, last = params[0], params[-1]
        g1, g2 = first.grad, last.grad
        if g1 is not None and g2 is not None:
            self._marks = ((first, g1, g1._version), (last, g2, g2._version))
            return
        if g1 is None:
            first = next((p for p in params if p.grad is not None), first)
        if g2 is None:
            last = next((p for p in reversed(params) if p.grad is not None), last)
        g1, g2 = first.grad, last.grad
        self._marks = (
            (first, g1, -1 if g1 is None else g1._version),
            (last, g2, -1 if g2 is None else g2._version),
        )

    def refuse_foreign(self, at_end: bool) -> None:
        """Raise if user code changed the window's gradients (or stepped the scheduler)."""
        for p, grad, version in self._marks:
            now = p.grad
            if now is not grad or (now is not None and now._version != version):
                if now is not None and self._edits_allowed and self._user_edit():
                    break
                self._refuse_grads("dropped" if now is None else "changed")
        if at_end:
            self.refuse_scheduler_step()

    def refuse_scheduler_step(self) -> None:
        """Raise if user code stepped the scheduler since loopkit's last update."""
        sched = self.scheduler
        if sched is not None and self._sched_at is not None:
            now_at = getattr(sched, "last_epoch", None)
            restored = getattr(sched, "base_lrs", None) is not self._sched_lrs
            if restored or (isinstance(now_at, int) and now_at < self._sched_at):
                # A load_state_dict replaces the base lrs' list (no step() does), and a move
                # back is no step either: a restore by hand, not a foreign step.
                self._sched_at, self._sched_lrs = now_at, getattr(sched, "base_lrs", None)
            elif now_at != self._sched_at:
                lines = lines_calling(user_frame(), sched, "step")
                raise RuntimeError(
                    f"the scheduler given to loopkit.step was also stepped by your code "
                    f"(last_epoch {self._sched_at} -> {now_at} since loopkit's last update"
                    f"{': ' + ', '.join(lines) if lines else ''}): loopkit steps it once per "
                    "real update, so the schedule would run too fast. Remove the "
                    "scheduler.step() line from the loop. The window was not updated"
                )

    def _user_edit(self) -> bool:
        """Whether an accumulate=1 window's changed gradients are the user's own edit: the
        function that changed them back-propagates nothing directly (read once per function)."""
        frame = user_frame()
        if frame is None:
            return False
        if frame.f_code in self._editors:
            return True
        if _source.direct_backwards(frame):
            return False
        self._editors.add(frame.f_code)
        return True

    def _refuse_grads(self, how: str) -> None:
        frame = user_frame()
        zero = lines_calling(frame, self.optimizer, "zero_grad")
        zeroed = f"optimizer.zero_grad() at {', '.join(zero)}" if zero else ""
        direct = [] if how == "dropped" else _source.direct_backwards(frame)
        if direct:  # read only when refusing: no cost to a window that closes
            raise RuntimeError(
                f"the gradients of an open loopkit window were {how} by code outside its "
                f"s.backward (noticed at {_where(frame)}): {', '.join(direct)} calls "
                ".backward() on a loss directly, which adds to the window's gradients a "
                "gradient loopkit neither scales nor counts. Inside `with step as s:` call "
                "s.backward(loss) instead (acc.backward(loss) with loopkit.accumulate); for a "
                "second loss through this model use loopkit.steps(d_step, g_step) with "
                "frozen=[model] in the other step. "
                + (f"Remove the {zeroed}" if zeroed else "A zero_grad()")
                + " or a hand-written clip changes them too (loopkit clears gradients as a "
                "window opens and clips with clip_grad_norm=). The window was not updated"
            )
        raise RuntimeError(
            f"the gradients of an open loopkit window were {how} by code outside its "
            f"s.backward (noticed at {_where(frame)}): "
            + (f"{zeroed}, " if zeroed else "a zero_grad(), ")
            + "a loss.backward() of another loss through this model (a GAN's generator loss "
            "through its discriminator), or a hand-written clip. Remove the zero_grad and clip "
            "lines (loopkit clears gradients as a window opens and clips with clip_grad_norm=); "
            "for a second loss through this model use loopkit.steps(d_step, g_step) with "
            "frozen=[model] in the other step. The window was not updated"
        )

    def window_closed(self) -> None:
        """The window ended (updated or dropped): start the next one clean."""
        self._marks = ()
        self._left.micro = 0
        if self.scheduler is not None:
            self._sched_at = getattr(self.scheduler, "last_epoch", None)
            self._sched_lrs = getattr(self.scheduler, "base_lrs", None)

    def forget_schedule(self) -> None:
        """A resume moves the scheduler: read its position afresh as the next window opens."""
        self._sched_at = None


_GUARDS: weakref.WeakSet[Guard] = weakref.WeakSet()
_ERRORS = [0]  # micro-steps of any step that ended in an exception, in this process


def resumed() -> None:
    """A Checkpointer restored a run: every step's scheduler may have been moved (saved under
    the Checkpointer's ``scheduler=`` or ``extra=``, not with the step), by no step() call."""
    for guard in list(_GUARDS):
        guard.forget_schedule()
