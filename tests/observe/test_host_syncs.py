"""count_host_syncs: sees every kind of host read, and nothing else."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import requires_cuda
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_in_torch_dispatch_mode,
)

import loopkit
from loopkit._observe._cuda_sync_warnings import CudaSyncCounter
from loopkit._sync_points import expected_sync

_x = torch.randn(4)
_s = torch.tensor(1.5)


@pytest.mark.parametrize(
    "read",
    [
        lambda: _s.item(),
        lambda: _x.tolist(),
        lambda: _x.numpy(),
        lambda: float(_s),
        lambda: int(_s),
        lambda: bool(_s > 0),
        lambda: f"{_s:.2f}",
        lambda: _x.nonzero(),
        lambda: torch.equal(_x, _x),
        lambda: [1, 2, 3][torch.tensor(1)],
    ],
)
def test_each_kind_of_read_counts_once(read: Callable[[], object]) -> None:
    """Every way of reading tensor data on the host is one sync, never two."""
    with loopkit.count_host_syncs() as syncs:
        read()
    assert syncs.count == 1, syncs.events


def test_device_side_work_counts_nothing() -> None:
    """Arithmetic, reductions, casts and detaching stay on the device: zero syncs."""
    w = torch.randn(4, 4, requires_grad=True)
    with loopkit.count_host_syncs() as syncs:
        y = (w @ w).relu().sum()
        y.backward()
        _ = y.detach().float().to(torch.bfloat16)
        torch.stack([y.detach(), y.detach()]).mean()
    assert syncs.count == 0, syncs.events


def test_ignored_tensors_are_not_counted() -> None:
    """Reads of tensors passed in ignore= (host-resident by design) do not count."""
    kept, other = torch.tensor(1.0), torch.tensor(2.0)
    with loopkit.count_host_syncs(ignore=frozenset({id(kept)})) as syncs:
        kept.item()
        other.item()
    assert syncs.events == {"Tensor.item": 1}


def _loopkit_modes() -> list[object]:
    """The loopkit modes left on this thread's dispatch and function mode stacks."""
    stacks = [*_get_current_dispatch_mode_stack(), *_get_current_function_mode_stack()]
    return [m for m in stacks if type(m).__module__.startswith("loopkit")]


@pytest.mark.parametrize("order", ["inner first", "outer first"])
def test_counters_exit_in_any_order_and_leave_no_mode(order: str) -> None:
    """Two counters exited in either order each count their own span and remove every mode."""
    outer, inner = loopkit.count_host_syncs(), loopkit.count_host_syncs()
    outer.__enter__()
    _s.item()
    inner.__enter__()
    assert len(_loopkit_modes()) == 2  # one shared pair, not one per counter
    _s.item()
    first, second = (inner, outer) if order == "inner first" else (outer, inner)
    first.__exit__(None, None, None)
    _s.item()
    second.__exit__(None, None, None)
    _s.item()
    assert _loopkit_modes() == []
    assert not is_in_torch_dispatch_mode()
    assert inner.events == {"Tensor.item": 2 if order == "outer first" else 1}
    assert outer.events == {"Tensor.item": 2 if order == "outer first" else 3}


@pytest.mark.parametrize("first", ["track_memory", "count_host_syncs"])
def test_exits_out_of_order_with_track_memory(first: str) -> None:
    """track_memory and count_host_syncs entered A then B, exited A first: each stops at its
    own exit, and no mode is left."""
    mem, syncs = loopkit.track_memory(), loopkit.count_host_syncs()
    outer, inner = (mem, syncs) if first == "track_memory" else (syncs, mem)
    outer.__enter__()
    inner.__enter__()
    a = torch.zeros(256)  # 1024 bytes, seen by both
    a.sum().item()
    outer.__exit__(None, None, None)  # out of order: the inner one is still open
    b = torch.zeros(512)
    b.sum().item()
    assert (mem.live == 1024 + 2048) is (inner is mem)  # the open one still sees b
    assert syncs.count == (2 if inner is syncs else 1)
    inner.__exit__(None, None, None)
    torch.zeros(1024).sum().item()
    assert _loopkit_modes() == [] and not is_in_torch_dispatch_mode()
    assert syncs.count == (2 if inner is syncs else 1)
    assert mem.live == (1024 + 2048 if inner is mem else 1024)
    del a, b


class _Passthrough(TorchDispatchMode):
    """A user's dispatch mode that counts the aten ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _FunctionPassthrough(TorchFunctionMode):
    """A user's function mode that counts the torch functions it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_counter_exited_under_a_users_open_modes_removes_only_its_own() -> None:
    """Modes entered after a counter and still open stay, keep working, and end cleanly."""
    syncs = loopkit.count_host_syncs()
    syncs.__enter__()
    user_fn, user_dispatch = _FunctionPassthrough(), _Passthrough()
    user_fn.__enter__()
    user_dispatch.__enter__()
    syncs.__exit__(None, None, None)
    assert _loopkit_modes() == []
    assert _get_current_dispatch_mode_stack() == [user_dispatch]
    assert _get_current_function_mode_stack() == [user_fn]
    (_x + 1).sum()
    _s.item()
    assert user_dispatch.ops >= 2 and user_fn.calls >= 2
    assert syncs.count == 0  # nothing counted after its exit
    user_dispatch.__exit__(None, None, None)
    user_fn.__exit__(None, None, None)
    assert _get_current_dispatch_mode_stack() == [] and _get_current_function_mode_stack() == []
    assert not is_in_torch_dispatch_mode()  # torch's "a mode is active" flag ends right too


def test_counter_entered_twice_is_refused_and_unchanged() -> None:
    """Entering an active counter again raises and leaves it counting as before."""
    with loopkit.count_host_syncs() as syncs:
        _s.item()
        with pytest.raises(RuntimeError, match="already counting"):
            syncs.__enter__()
        _s.item()
    assert syncs.events == {"Tensor.item": 2}
    assert _loopkit_modes() == []
    with pytest.raises(RuntimeError, match="without being entered"):
        syncs.__exit__(None, None, None)


def test_expected_sync_is_counted_and_labelled() -> None:
    """Reads inside expected_sync count, and are also filed under .expected by reason."""
    with loopkit.count_host_syncs() as outer:
        _s.item()
        with loopkit.count_host_syncs() as inner:
            with expected_sync("fp16's overflow check"):
                _s.item()
                _x.tolist()
                _x.nonzero()
            with expected_sync("skip_nonfinite's check"):
                bool(_s > 0)
            float(_s)
    own = {"Tensor.item": 1, "Tensor.tolist": 1, "aten.nonzero": 1, "Tensor.__bool__": 1}
    assert inner.events == {**own, "Tensor.__float__": 1} and inner.count == 5
    assert inner.user_events == {"Tensor.__float__": 1}
    assert outer.user_events == {"Tensor.item": 1, "Tensor.__float__": 1}
    assert outer.count == 6
    assert inner.expected == {"fp16's overflow check": 3, "skip_nonfinite's check": 1}
    assert outer.expected == inner.expected


def test_expected_sync_without_a_counter_allocates_nothing() -> None:
    """With no counter active expected_sync hands back one shared no-op context."""
    first, second = expected_sync("a"), expected_sync("b")
    assert first is second
    with first:
        _s.item()
    with loopkit.count_host_syncs():
        assert expected_sync("a") is not first  # a counter is active: it labels reads


@pytest.mark.parametrize("reason", ["", None, 3])
def test_expected_sync_needs_a_reason(reason: Any) -> None:
    """A missing or non-str reason is refused, naming what to pass."""
    with pytest.raises(TypeError, match="non-empty str"):
        expected_sync(reason)


def test_cuda_sync_warnings_inside_expected_sync_are_labelled() -> None:
    """The doctor's CUDA counter files sync warnings raised inside expected_sync by reason."""
    sync = "called a synchronizing CUDA operation"
    with pytest.warns(UserWarning, match="unrelated"), CudaSyncCounter() as counter:
        warnings.warn(sync, stacklevel=1)
        with expected_sync("fp16's overflow check"):
            warnings.warn(sync, stacklevel=1)
            warnings.warn("unrelated", stacklevel=1)
            with expected_sync("inner"):
                warnings.warn(sync, stacklevel=1)
            warnings.warn(sync, stacklevel=1)
    assert counter.events == {sync: 1}
    assert counter.expected == {"fp16's overflow check": 2, "inner": 1}


def test_cuda_counter_leaves_the_users_warning_filters_in_charge() -> None:
    """Only sync warnings are forced through: an "error" filter still raises where the warning
    is made, an "ignore" filter still hides it, and shown warnings reach the outer handler."""
    sync = "called a synchronizing CUDA operation"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CudaSyncCounter() as counter:
            warnings.warn(sync, stacklevel=1)  # counted, not raised
            with pytest.raises(UserWarning, match="mine"):
                warnings.warn("mine", stacklevel=1)
    assert counter.events == {sync: 1}
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="quiet")
        with CudaSyncCounter() as counter:
            warnings.warn("quiet", stacklevel=1)
            warnings.warn("loud", stacklevel=1)
            warnings.warn(sync, stacklevel=1)
    assert [str(w.message) for w in shown] == ["loud"] and counter.events == {sync: 1}


@requires_cuda
def test_cuda_counter_restores_the_previous_sync_debug_mode() -> None:
    """The counter sets "warn" while it counts, then puts back what the user had."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with CudaSyncCounter():
            assert torch.cuda.get_sync_debug_mode() == 1
        assert torch.cuda.get_sync_debug_mode() == 2
    finally:
        torch.cuda.set_sync_debug_mode(before)
