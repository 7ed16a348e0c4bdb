"""count_host_syncs: count the places where the host waits to read a tensor.

On an accelerator every such read (``.item()``, ``.tolist()``, ``float(t)``, ``bool(t)``,
``.cpu()``, a data-dependent shape such as ``nonzero``) stalls the CPU until the device
catches up. The counter sees them on any device, the CPU included, so tests and the
diagnosis run on a machine without a GPU: it counts what *would* stall a GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._core import OpCallback, OpObserver

# Python-level reads: on the CPU ``tolist``/``numpy`` reach no aten op, so only a
# function mode sees them.
_PY_READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "__bool__",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "__array__",
        "__format__",
    }
)
# aten ops that read device memory on the host, or whose output shape depends on data.
_ATEN_READS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.equal",
        "aten.is_nonzero",
        "aten.nonzero",
        "aten.masked_select",
        "aten.unique_dim",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.repeat_interleave",
    }
)
_COPIES = frozenset({"aten._to_copy", "aten.copy_", "aten._copy_from"})


def _is_cpu(x: object) -> bool:
    return (isinstance(x, torch.device) and x.type == "cpu") or x == "cpu"


class _State:
    __slots__ = ("depth", "events", "ignore")

    def __init__(self, ignore: frozenset[int]) -> None:
        self.ignore = ignore
        self.events: Counter[str] = Counter()
        self.depth = 0  # >0 while inside a counted Python-level read: its inner ops are its own


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.state.ignore and args and id(args[0]) in self.state.ignore:
            self.state.depth += 1  # its inner aten read is not counted either
            try:
                return func(*args, **kwargs)
            finally:
                self.state.depth -= 1
        counted = self.state.depth == 0 and (
            (name in _PY_READS and not (name == "__format__" and args and args[0].dim() > 0))
            or (name in ("cpu", "to") and _leaves_device_for_host(name, args, kwargs))
        )
        if counted:
            self.state.events[f"Tensor.{name}"] += 1
            self.state.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            if counted:
                self.state.depth -= 1


def _leaves_device_for_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    src = args[0] if args else None
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    if name == "cpu":
        return True
    targets = [*list(args[1:]), kwargs.get("device")]
    return any(
        _is_cpu(t) or (isinstance(t, torch.Tensor) and t.device.type == "cpu") for t in targets
    )


def _aten_read(state: _State) -> OpCallback:
    def before(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _: Any) -> None:
        if state.depth == 0:
            name = func.overloadpacket._qualified_op_name.replace("::", ".")
            if name in _ATEN_READS or (name in _COPIES and _copy_to_host(name, args, kwargs)):
                state.events[name] += 1

    return before


def _copy_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    src = args[0] if name == "aten._to_copy" else (args[1] if len(args) > 1 else None)
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    if name == "aten._to_copy":
        return _is_cpu(kwargs.get("device"))
    dst = args[0]
    return isinstance(dst, torch.Tensor) and dst.device.type == "cpu"


class count_host_syncs:
    """Count host reads of tensor data inside a ``with`` block.

    ``with count_host_syncs() as syncs: ...`` then ``syncs.count`` is the number of reads
    and ``syncs.events`` says which operations made them. ``ignore`` holds ids of tensors
    whose reads are not counted (host-resident by design, such as an optimizer's step
    counter). Meant for tests and diagnosis: it slows the code it watches.
    """

    def __init__(self, ignore: frozenset[int] = frozenset()) -> None:
        self._state = _State(frozenset(ignore))
        self._modes: list[Any] = []

    @property
    def count(self) -> int:
        """Host reads seen so far."""
        return sum(self._state.events.values())

    @property
    def events(self) -> dict[str, int]:
        """Host reads seen so far, by operation."""
        return dict(self._state.events)

    def __enter__(self) -> count_host_syncs:
        self._modes = [_FunctionCounter(self._state), OpObserver(before=_aten_read(self._state))]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(exc_type, exc, tb)
        self._modes = []
