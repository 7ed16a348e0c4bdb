"""count_host_syncs: count the places where the host waits to read a tensor.

On an accelerator every such read (``.item()``, ``.tolist()``, ``float(t)``, ``bool(t)``,
``.cpu()``, a data-dependent shape such as ``nonzero``) stalls the CPU until the device
catches up. The counter sees them on any device, the CPU included, so tests and the
diagnosis run on a machine without a GPU: it counts what *would* stall a GPU.

loopkit's own code wraps the reads it cannot avoid (fp16's overflow check, the
``skip_nonfinite`` decision) in ``expected_sync(reason)``: a counter counts them and also
files them under ``expected[reason]``, so the doctor can tell them from the user's. The
doctor's CUDA counter (``_cuda_sync_warnings``) sees syncs as warnings instead; it registers with
``add_watcher`` so that expected_sync labels those too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._sync_points import Hub, Tallies, count_active, this_thread_hub
from .._tracing import EagerStance
from ._dispatch import OpCallback, OpObserver, enter_mode, remove_mode

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


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, hub: Hub) -> None:
        super().__init__()
        self.hub = hub

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        read = (
            name in _PY_READS and not (name == "__format__" and args and args[0].dim() > 0)
        ) or (name in ("cpu", "to") and _leaves_device_for_host(name, args, kwargs))
        first = id(args[0]) if args else None
        reason = self.hub.reason()
        entered: list[Tallies] = []
        for state in self.hub.states:
            if state.depth:
                continue  # inside one of its counted reads: the inner ops belong to that read
            if state.ignore and first in state.ignore:
                pass  # host-resident by design: neither it nor its inner aten read counts
            elif read:
                state.record(f"Tensor.{name}", reason)
            else:
                continue
            state.depth += 1
            entered.append(state)
        try:
            return func(*args, **kwargs)
        finally:
            for state in entered:
                state.depth -= 1


def _leaves_device_for_host(
    name: str, args: tuple[object, ...], kwargs: Mapping[str, object]
) -> bool:
    src = args[0] if args else None
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    if name == "cpu":
        return True
    targets = [*list(args[1:]), kwargs.get("device")]
    return any(
        _is_cpu(t) or (isinstance(t, torch.Tensor) and t.device.type == "cpu") for t in targets
    )


def _aten_read(hub: Hub) -> OpCallback:
    def before(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _: Any) -> None:
        states = [s for s in hub.states if not s.depth]
        if not states:
            return
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if name in _ATEN_READS or (name in _COPIES and _copy_to_host(name, args, kwargs)):
            reason = hub.reason()
            for state in states:
                state.record(name, reason)

    return before


def _copy_to_host(name: str, args: tuple[object, ...], kwargs: Mapping[str, object]) -> bool:
    src = args[0] if name == "aten._to_copy" else (args[1] if len(args) > 1 else None)
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    if name == "aten._to_copy":
        return _is_cpu(kwargs.get("device"))
    dst = args[0]
    return isinstance(dst, torch.Tensor) and dst.device.type == "cpu"


# -- installing and removing the shared modes -------------------------------------------------


def _install(hub: Hub) -> None:
    function_mode = _FunctionCounter(hub)
    dispatch_mode = OpObserver(before=_aten_read(hub))
    enter_mode(function_mode)
    try:
        enter_mode(dispatch_mode)
    except BaseException:
        remove_mode(function_mode)
        raise
    hub.modes = (function_mode, dispatch_mode)


def _uninstall(hub: Hub) -> None:
    # By identity: a track_memory (or a user's mode) entered after them may still be open.
    modes, hub.modes = hub.modes, None
    if modes is None:
        return
    try:
        remove_mode(modes[1])
    finally:
        remove_mode(modes[0])


# -- the counters ---------------------------------------------------------------------------


class count_host_syncs:
    """Count host reads of tensor data inside a ``with`` block.

    ``with count_host_syncs() as syncs: ...`` then ``syncs.count`` is the number of reads
    and ``syncs.events`` says which operations made them; of those, the reads loopkit
    itself needs (fp16's overflow check, ``skip_nonfinite``) are also in
    ``syncs.expected`` by reason, and the rest in ``syncs.user_events``. ``ignore``
    holds ids of tensors whose reads are not counted (host-resident by design, such as
    an optimizer's step counter). Counters nest and may exit in any order. Meant for
    tests and diagnosis: it slows the code it watches, and runs torch.compile'd code inside
    it eagerly (a compiled graph's reads would be unseen).
    ``locate=True`` also counts the user's reads by ``file:line`` (``syncs.lines``; slower).
    """

    def __init__(self, ignore: frozenset[int] = frozenset(), *, locate: bool = False) -> None:
        self._state = Tallies(frozenset(ignore), locate)
        self._hub: Hub | None = None
        self._eager = EagerStance()

    @property
    def count(self) -> int:
        """Host reads seen so far."""
        return sum(self._state.events.values())

    @property
    def events(self) -> dict[str, int]:
        """Host reads seen so far, by operation."""
        return dict(self._state.events)

    @property
    def expected(self) -> dict[str, int]:
        """loopkit's own necessary host reads seen so far, by the reason given to expected_sync."""
        return dict(self._state.expected)

    @property
    def lines(self) -> dict[str, int]:
        """The user's reads by ``file:line`` (with ``locate=True``; slower: walks the stack)."""
        return dict(self._state.lines)

    @property
    def user_events(self) -> dict[str, int]:
        """Host reads seen so far, by operation, other than loopkit's own necessary ones."""
        return dict(self._state.user)

    def __enter__(self) -> count_host_syncs:
        if self._hub is not None:
            raise RuntimeError(
                "this count_host_syncs is already counting: enter it once (nest a second "
                "count_host_syncs() to count an inner block on its own)"
            )
        hub = this_thread_hub()
        self._eager.__enter__()  # compiled code runs eagerly: its reads are seen
        if not hub.states:
            _install(hub)
        hub.states.append(self._state)
        self._hub = hub
        count_active(1)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        hub = self._hub
        if hub is None:
            raise RuntimeError("count_host_syncs exited without being entered")
        self._hub = None
        hub.states.remove(self._state)
        count_active(-1)
        try:
            if not hub.states:
                _uninstall(hub)
        finally:
            self._eager.__exit__()
