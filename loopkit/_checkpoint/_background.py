"""Saves written by a background thread, so the loop goes on while a checkpoint is written.

A save first stages its state on the calling thread: every tensor copied to host memory
(a sharded model's shards by ``torch.distributed.checkpoint.async_save``'s own stager).
That copy is the loop's only stall; a thread then writes the copy under a temporary name
and renames it once complete, so a kill mid-write leaves no file or directory carrying a
checkpoint's name. One save at a time: the next save, a resume, ``Checkpointer.wait()`` and
``loopkit.distributed.teardown`` first wait for the one in flight, and every rank learns
whether every rank's part was written (one host-level exchange, on the calling thread).

A failed write is never silent. One process raises it at the next ``maybe_save`` already;
and a save not waited for when the interpreter exits is waited for there (its thread is not
a daemon): if it failed, the process prints the checkpoint and the cause and exits with
status 1, after running the other exit handlers (no exchange between ranks there: each
rank judges its own part, and a launcher fails the job when one rank fails).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import _job, _ranks


def staged(state: object) -> object:
    """A copy of ``state`` that training cannot change: containers rebuilt, each tensor copied
    to host memory (a DTensor left as it is: DCP stages its shards). A host-device sync for
    device tensors (the copy must be complete before the thread reads it)."""
    if isinstance(state, torch.Tensor):
        if _is_dtensor(state):
            return state
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        items = {k: staged(v) for k, v in state.items()}
        return (
            collections.OrderedDict(items) if isinstance(state, collections.OrderedDict) else items
        )
    if isinstance(state, list):
        return [staged(v) for v in state]
    if isinstance(state, tuple):
        members = [staged(v) for v in state]
        kind: Any = type(state)  # a namedtuple's class takes its fields one by one
        return kind(*members) if hasattr(state, "_fields") else tuple(members)
    if state is None or isinstance(state, (bool, int, float, str, bytes, torch.dtype)):
        return state
    return copy.deepcopy(state)


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return False
    return isinstance(t, DTensor)


_UNCHECKED: set[Background] = set()
"""Backgrounds whose save has not been waited for: judged at exit if still so."""
_exit_hook = False


def _at_exit() -> None:
    """At interpreter exit (the writers' threads have ended): a save that failed unseen ends
    the process with status 1, after the other exit handlers ran."""
    lost = [b for b in _UNCHECKED if b._error is not None]
    if not lost:
        return
    for b in lost:
        assert b._error is not None
        sys.stderr.write(
            f"loopkit: {_failed(b._name, b._error)}. That checkpoint is not on disk: exiting "
            "with status 1 (ckpt.wait() after the last save raises it where the program can "
            "handle it)\n"
        )
    atexit.unregister(_at_exit)
    atexit._run_exitfuncs()  # the others, once: this one ran first (_watch_exit)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a full disk
            stream.flush()
    os._exit(1)  # the only way an exit status changes once the program has ended


def _failed(name: str, error: BaseException) -> str:
    """What a failed background save says: the checkpoint's path and the cause."""
    said = f"{type(error).__name__}: {error}"
    return f"the background save failed: {said}" if name in said else (
        f"the background save of {name} failed: {said}")  # fmt: skip


def _watch_exit() -> None:
    """Have ``_at_exit`` run at exit, before the other exit handlers (so it can run them).

    It is registered when threading's shutdown starts (the last registered runs first);
    without that hook (a Python that lacks it), now."""
    global _exit_hook
    if _exit_hook:
        return
    _exit_hook = True
    at_shutdown = getattr(threading, "_register_atexit", None)
    try:
        if at_shutdown is None:
            raise RuntimeError("no threading._register_atexit")
        at_shutdown(atexit.register, _at_exit)
    except RuntimeError:  # missing, or shutdown has started: register it now
        atexit.register(_at_exit)


class Background:
    """The one background save of a Checkpointer in flight, and the process group its
    sharded writes talk in (not the training's: a collective on another thread would
    interleave with the loop's)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._name = ""
        self._group: Any = None

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._thread is not None

    def group(self) -> Any:
        """The process group of the background writes (made on first use, on every rank:
        a collective); None without one."""
        if self._group is None and _ranks.initialized():
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def failed_alone(self) -> bool:
        """Whether the save's thread failed, in a one-process run (where ``finish`` can
        raise it at once: several ranks must raise alike, at their next ``finish``)."""
        return self._error is not None and not _ranks.is_multi_rank()

    def start(self, name: str, write: Callable[[], None]) -> None:
        """Run ``write`` on a thread (``name``: the checkpoint's path); what it raises is
        reported by ``finish``, or at exit if nothing called it."""
        assert self._thread is None, "finish() the save in flight first"
        self._error, self._name = None, name

        def run() -> None:
            try:
                write()
            except BaseException as err:  # reported on the calling thread by finish()
                self._error = err

        # Not a daemon: an interpreter that exits waits for the write to complete.
        self._thread = threading.Thread(target=run, name=f"loopkit save {name}", daemon=False)
        _watch_exit()
        self._thread.start()
        _UNCHECKED.add(self)
        _job.before_teardown(self.finish)

    def join(self) -> None:
        """Wait for the save in flight to end, reporting nothing (``finish`` reports): what a
        Checkpointer garbage-collected mid-save waits for before it gives its directory up."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def finish(self) -> None:
        """Wait for the save in flight (if any); raise on every rank if any rank's part of it
        failed (one host-level exchange: every rank calls it)."""
        thread = self._thread
        if thread is None:
            return
        thread.join()
        self._thread = None
        error = self._error
        self._error = None
        _UNCHECKED.discard(self)  # reported below, on every rank, if it failed
        failed = _ranks.gather_objects(None if error is None else repr(error))
        if error is not None:
            raise RuntimeError(_failed(self._name, error)) from error
        for rank, said in enumerate(failed):
            if said is not None:
                raise RuntimeError(
                    f"the background save of {self._name} failed on rank {rank}: {said}"
                )
