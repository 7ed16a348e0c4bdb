"""track_memory: exact live and peak bytes of the tensors created inside a block, any device.

``torch.cuda.max_memory_allocated`` exists only for CUDA; this counts storages directly,
so a CPU test can check what activation checkpointing saves. Each storage created by an
op inside the block is counted until it is freed (PyTorch keeps one Python object per
storage while it lives, so a weak reference to it expires exactly when the memory goes).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ._dispatch import OpCallback, OpObserver, enter_mode, remove_mode


def _allocations(owner: track_memory) -> OpCallback:
    def after(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        # Outputs that share an input's storage (views, in-place ops, detach) are not new
        # memory: a view of a parameter must not be counted as an allocation.
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs or storage.nbytes() == 0:
                    owner._add(storage)

    return after


class track_memory:
    """``with track_memory() as mem: ...``: ``mem.live`` and ``mem.peak`` bytes, exactly.

    Counts storages created by tensor operations inside the block (activations, saved
    tensors, gradients, optimizer state); ``mem.live`` goes down as they are freed, also
    after the block ends. Meant for tests and measurements: it slows what it watches.
    """

    def __init__(self) -> None:
        self.live = 0
        """Bytes of tracked storages alive now."""
        self.peak = 0
        """Largest ``live`` seen since the start (or ``reset_peak()``)."""
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._mode: OpObserver | None = None

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._refs and self._refs[key]() is storage:
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, self._release(key, nbytes))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _release(
        self, key: int, nbytes: int
    ) -> Callable[[weakref.ref[torch.UntypedStorage]], None]:
        def release(_: weakref.ref[torch.UntypedStorage]) -> None:
            self.live -= nbytes
            self._refs.pop(key, None)

        return release

    def reset_peak(self) -> None:
        """Start measuring the peak again from the current live bytes."""
        self.peak = self.live

    def __enter__(self) -> track_memory:
        if self._mode is not None:
            raise RuntimeError("this track_memory is already tracking: enter it once")
        mode = OpObserver(after=_allocations(self))
        enter_mode(mode)
        self._mode = mode
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            # By identity: a count_host_syncs entered after this block may still be open.
            remove_mode(mode)
