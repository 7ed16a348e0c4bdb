"""torch's per-thread mode stacks: the one op observer, and entering and removing modes by identity.

``count_host_syncs`` and ``track_memory`` install modes here. torch's own ``__exit__`` pops
whichever mode is on top, so two tools exited out of order would remove each other's
modes and leave one installed; loopkit's modes are removed by identity instead, wherever
they sit, and the modes above them stay in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

# (op, args, kwargs, result) for every aten op; the result is None before the op has run.
OpCallback: TypeAlias = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]

# torch leaves these unannotated: typed once here, so the calls below are checked.
_enter_dispatch: Callable[[TorchDispatchMode], object] = TorchDispatchMode.__enter__
_exit_dispatch: Callable[[TorchDispatchMode, None, None, None], object] = TorchDispatchMode.__exit__
_enter_function: Callable[[TorchFunctionMode], object] = TorchFunctionMode.__enter__
_exit_function: Callable[[TorchFunctionMode, None, None, None], object] = TorchFunctionMode.__exit__
_function_modes: Callable[[], list[TorchFunctionMode]] = _get_current_function_mode_stack


class OpObserver(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__
    """Runs every aten op unchanged and shows it to ``before`` and/or ``after``."""

    def __init__(self, before: OpCallback | None = None, after: OpCallback | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is unannotated
        self.before, self.after = before, after

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.before is not None:
            self.before(func, args, kwargs, None)
        out = func(*args, **kwargs)
        if self.after is not None:
            self.after(func, args, kwargs, out)
        return out


def enter_mode(mode: TorchDispatchMode | TorchFunctionMode) -> None:
    """Push ``mode`` on this thread's stack of its kind (remove it with ``remove_mode``)."""
    if isinstance(mode, TorchDispatchMode):
        _enter_dispatch(mode)
    else:
        _enter_function(mode)


def remove_mode(mode: TorchDispatchMode | TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's stack of its kind, wherever it is; keep the others.

    A no-op when it is not there (already removed).
    """
    if isinstance(mode, TorchDispatchMode):
        _remove_dispatch_mode(mode)
    else:
        _remove_function_mode(mode)


def _index(stack: Sequence[object], mode: object) -> int | None:
    return next((i for i, m in enumerate(stack) if m is mode), None)


def _remove_function_mode(mode: TorchFunctionMode) -> None:
    # A mode entered after ours and still open sits above it: it is lifted off and put
    # back, so the order of the remaining modes does not change.
    stack = _function_modes()
    i = _index(stack, mode)
    if i is None:
        return
    above = stack[i + 1 :]
    for _ in above:
        torch._C._pop_torch_function_stack()
    try:
        _exit_function(mode, None, None, None)
    finally:
        for m in above:
            torch._C._push_on_torch_function_stack(m)


# The per-mode lists in which TorchDispatchMode.__enter__ saves torch's "a mode is on the
# stack" flags for its __exit__ to restore.
_SAVED_FLAGS = (
    "old_dispatch_mode_flags",
    "old_non_infra_dispatch_mode_flags",
    "old_without_ignore_compile_internals_dispatch_mode_flags",
)


def _remove_dispatch_mode(mode: TorchDispatchMode) -> None:
    # Modes above it are lifted off and entered again (with TorchDispatchMode's own
    # __enter__), so the flags each saved for its exit describe the stack without
    # ``mode``, and torch's "a mode is active" flags end right once they exit too.
    stack = _get_current_dispatch_mode_stack()
    i = _index(stack, mode)
    if i is None:
        return
    above = stack[i + 1 :]  # user modes only: infra modes sit below every user mode
    for m in reversed(above):
        torch._C._pop_torch_dispatch_stack(None)
        for attr in _SAVED_FLAGS:
            saved = getattr(m, attr, None)
            if saved:
                saved.pop()
    try:
        _exit_dispatch(mode, None, None, None)
    finally:
        for m in above:
            _enter_dispatch(m)
