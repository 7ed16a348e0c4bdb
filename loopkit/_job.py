"""This process's place in the job: the launcher's environment, joining and leaving the group.

loopkit never launches processes or moves bytes itself: the launcher (``torchrun`` or
``accelerate launch``) starts one process per device and sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``setup()`` reads them. Without them
everything here is a no-op, so the same script runs single-process unchanged.

Why not ``accelerate.PartialState``: under a CPU ``torchrun`` it initializes a process
group yet reports ``num_processes=1`` and ``process_index=0`` on every rank (it only
recognizes multi-CPU jobs started by its own launcher), which would make every rank
believe it is rank zero. The environment contract is small and stable, so it is read here.

A foundation module: the data loader and the preload cache ask ``info()`` where they run.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from ._devices import local_device

P = ParamSpec("P")
R = TypeVar("R")

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job. Also a context manager that tears down."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None

    @property
    def is_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    @property
    def is_rank_zero(self) -> bool:
        """Whether this is the process that prints and saves."""
        return self.rank == 0

    def __enter__(self) -> DistInfo:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        teardown()


def _launch_env() -> dict[str, str] | None:
    # RANK/WORLD_SIZE/LOCAL_RANK say "launched"; MASTER_ADDR/PORT alone (often exported by
    # a cluster profile, or by `accelerate launch` for a single process) do not.
    present = {k: os.environ[k] for k in _LAUNCH_VARS if k in os.environ}
    if not any(k in present for k in _LAUNCH_VARS[:3]):
        return None
    missing = [k for k in _LAUNCH_VARS if k not in present]
    if missing:
        raise RuntimeError(
            f"the launcher environment is half-set: {', '.join(sorted(present))} set but "
            f"{', '.join(missing)} missing. Start the script with `torchrun` or `accelerate "
            "launch` (which set all of them), or unset them to run single-process"
        )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if not present[k].isdigit():
            raise RuntimeError(f"{k}={present[k]!r} is not a non-negative integer")
    rank, world = int(present["RANK"]), int(present["WORLD_SIZE"])
    if world < 1 or rank >= world:
        raise RuntimeError(f"RANK={rank} is not below WORLD_SIZE={world}: check the launcher")
    return present


def info() -> DistInfo:
    """The current process's place in the job (rank 0 of 1 when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo(device=local_device(int(os.environ.get("LOCAL_RANK", "0"))))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(dist.get_world_size())))
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=local_world,
        device=local_device(local_rank),
        backend=str(dist.get_backend()),
    )


def setup(backend: str | None = None, *, timeout: datetime.timedelta | None = None) -> DistInfo:
    """Join the job the launcher started (idempotent); a no-op when not launched distributed.

    Backend ``nccl`` with CUDA, ``gloo`` otherwise; with CUDA each process uses the GPU
    of its local rank. ``with setup() as info:`` tears the group down on exit.
    ``backend`` overrides that choice; ``timeout``: the process group's, a timedelta.
    """
    env = _launch_env()
    if env is None or dist.is_initialized():
        return info()
    if not dist.is_available():  # pragma: no cover - builds without distributed support
        raise RuntimeError("this torch build has no torch.distributed")
    local_rank = int(env["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    chosen = backend or ("nccl" if cuda else "gloo")
    if chosen not in ("nccl", "gloo", "mpi", "ucc", "xccl") and ":" not in chosen:
        raise ValueError(f"unknown backend {chosen!r}: use 'nccl' (GPUs) or 'gloo' (CPU)")
    kwargs: dict[str, Any] = {"backend": chosen, "init_method": "env://"}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                "start at most one process per GPU (--nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(**kwargs)
    return info()


_BEFORE_TEARDOWN: list[weakref.WeakMethod[Callable[[], object]]] = []


def before_teardown(method: Callable[[], object]) -> None:
    """Call the bound ``method`` at the next ``teardown``, before the group goes (held weakly:
    an object gone by then is skipped). A Checkpointer's background save finishes there."""
    ref = weakref.WeakMethod(method)  # a bound method
    if all(r() != method for r in _BEFORE_TEARDOWN):
        _BEFORE_TEARDOWN.append(ref)


def teardown() -> None:
    """Leave the process group (after a barrier, so no rank exits while others still talk).

    What ``before_teardown`` registered runs first (a background save completes)."""
    hooks = [h for h in (r() for r in _BEFORE_TEARDOWN) if h is not None]
    _BEFORE_TEARDOWN.clear()
    try:
        for hook in hooks:
            hook()
    finally:
        _leave_group()


def _leave_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        if dist.get_backend() == "gloo":
            # Gloo's worker threads free finished work after the caller has moved on, and
            # that work may hold Python tensors (all_gather_object's), so freeing needs the
            # GIL. If a DDP model is then garbage-collected, the group's destructor joins
            # those threads while holding the GIL: a deadlock at exit (seen under CPU
            # torchrun). Releasing the GIL briefly lets them finish first.
            time.sleep(0.2)
        dist.destroy_process_group()


def is_rank_zero() -> bool:
    """True on the process that prints and saves (and when not distributed)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def rank_zero_only(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Run ``fn`` on rank zero only; other ranks get None."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        return fn(*args, **kwargs) if is_rank_zero() else None

    return wrapper
