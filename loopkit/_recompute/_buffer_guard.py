"""Buffers written once: a checkpointed forward's updates are not made again by its recompute.

Module buffers the forward updates (BatchNorm running statistics and
``num_batches_tracked``, spectral norm's power-iteration vectors, counters) belong to the
step. The recompute in backward runs on stand-ins holding the values the forward started
from, so it computes exactly what the forward computed (even where the output depends on
the updated buffer, as with spectral norm), and the modules get their own buffers back
after it, also when torch stops the recompute early by raising out of the middle of it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.parameter import is_lazy

# Which buffers a forward wrote is read from their version counters, which every in-place
# op and out= op bumps. The batch-norm kernels are the exception: they write running_mean
# and running_var without declaring it, so no counter moves. A module tracking running
# statistics in training mode (BatchNorm*, SyncBatchNorm, InstanceNorm*) is taken to
# write those two.
_RUNNING_STATS = frozenset(("running_mean", "running_var"))
_NONE: frozenset[str] = frozenset()

# The buffer names each module's checkpointed forwards have been seen to write in place.
# A module not in here has not run under loopkit's checkpoint yet: all of its buffers are
# copied before that first forward, since which of them it writes is not known yet.
_UPDATES: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()

_NO_VERSION = -1  # an inference tensor: no version counter
_LAZY = -2  # not materialized yet


class _Slot(NamedTuple):
    """One buffer as the forward found it."""

    module: nn.Module
    name: str
    tensor: torch.Tensor
    version: int  # its version counter then, or _NO_VERSION / _LAZY
    before: torch.Tensor | None  # a copy of its value then, where it may be written in place
    silent: bool  # written without a version bump (batch norm's running statistics)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` outside autograd (a buffer may require grad)."""
    with torch.no_grad():
        return t.clone()


def _modules_with_buffers(owners: list[nn.Module]) -> list[nn.Module]:
    """``owners`` and all their submodules that hold buffers, each once."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack: list[nn.Module | None] = list(owners)
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        stack.extend(m._modules.values())
        if m._buffers:
            found.append(m)
    return found


class BufferSnapshot:
    """The buffers of a checkpointed call's modules before its forward."""

    __slots__ = ("first_seen", "slots")

    def __init__(self, slots: list[_Slot], first_seen: list[nn.Module]) -> None:
        self.slots = slots
        self.first_seen = first_seen  # modules whose writes are learned by this forward

    @classmethod
    def take(cls, owners: list[nn.Module]) -> BufferSnapshot | None:
        """Note each buffer's tensor and version, copying those that may be written in
        place; None when there are no buffers at all."""
        slots: list[_Slot] = []
        first_seen: list[nn.Module] = []
        for m in _modules_with_buffers(owners):
            known = _UPDATES.get(m)
            if known is None:
                first_seen.append(m)
            silent = (
                _RUNNING_STATS if m.training and m.__dict__.get("track_running_stats") else _NONE
            )
            for name, t in m._buffers.items():
                if t is None:
                    continue
                if is_lazy(t):  # a lazy module's buffer, filled in by its first forward
                    slots.append(_Slot(m, name, t, _LAZY, None, False))
                    continue
                if t.is_inference():  # no version counter, and read-only outside inference
                    slots.append(_Slot(m, name, t, _NO_VERSION, None, False))
                    continue
                before = None
                if known is None or name in known or name in silent:
                    before = _copy(t)
                slots.append(_Slot(m, name, t, t._version, before, name in silent))
        return cls(slots, first_seen) if slots else None

    def stand_ins(self, fresh: bool) -> StandIns | None:
        """After the forward: the values its recompute starts from; None if it wrote no buffer.

        Called once checkpoint() has returned, outside the checkpointed region, so a
        selective checkpoint's op log does not see its copies (except after a torch.compile
        fallback, see _recompute_call._run_traced).
        """
        learned: dict[nn.Module, set[str]] = {m: set() for m in self.first_seen}
        values: list[tuple[nn.Module, str, torch.Tensor]] = []
        for m, name, t, version, before, silent in self.slots:
            if version == _LAZY:
                # Filled in by this forward, which also wrote it (a lazy BatchNorm's
                # statistics): the recompute starts from the forward's result.
                if is_lazy(t):
                    continue
                written = True
            else:
                written = silent or (version >= 0 and t._version != version)
            if not written and m._buffers.get(name) is t:
                continue
            if not written:
                stand_in = t  # rebound to a new tensor: the old one still holds the input value
            elif before is not None:
                stand_in = before
            else:
                # Written in place for the first time on a later call: the value before is
                # gone, so this recompute starts from the forward's result; the next calls
                # copy it beforehand.
                stand_in = _copy(t)
                learned.setdefault(m, set())
            if written and not silent and m in learned:
                learned[m].add(name)
            values.append((m, name, stand_in))
        for m, names in learned.items():
            _UPDATES[m] = _UPDATES.get(m, _NONE) | names
        return StandIns(values, fresh) if values else None


class StandIns:
    """The buffer values one checkpointed call's recompute runs on."""

    __slots__ = ("fresh", "values")

    def __init__(self, values: list[tuple[nn.Module, str, torch.Tensor]], fresh: bool) -> None:
        self.values = values
        # Whether each recompute may copy its stand-ins: True when no selective-checkpoint
        # mode runs around the recompute (there an op the forward did not run is an error);
        # a selective region is recomputed once, so one set of stand-ins serves.
        self.fresh = fresh

    def run(
        self, fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
        """Run ``fn`` with the stand-ins bound in place of the buffers, then rebind these."""
        bound: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor | None]] = []
        try:
            for m, name, stand_in in self.values:
                buffers = m._buffers
                if name in buffers:
                    bound.append((buffers, name, buffers[name]))
                    buffers[name] = _copy(stand_in) if self.fresh else stand_in
            return fn(*args, **kwargs)
        finally:
            for buffers, name, tensor in reversed(bound):
                buffers[name] = tensor
