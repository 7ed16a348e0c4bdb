"""The one dispatch-level hook behind ``count_host_syncs`` and ``track_memory``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from torch.utils._python_dispatch import TorchDispatchMode

# (op, args, kwargs, result) for every aten op; the result is None before the op has run.
OpCallback: TypeAlias = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]


class OpObserver(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every aten op unchanged and shows it to ``before`` and/or ``after``.

    The one dispatch-level hook behind ``count_host_syncs`` and ``track_memory``.
    """

    def __init__(self, before: OpCallback | None = None, after: OpCallback | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
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
