"""This process's place in the job: the launcher's environment, joining and leaving the group.

loopkit never launches processes or moves bytes itself: the launcher (``torchrun`` or
``accelerate launch``) starts one process per device and sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``setup()`` reads them. Without them,
a task of a Slurm ``srun`` step of several tasks has its place read from srun's variables
(``_slurm.py``), exported under torchrun's names as it joins, so everything that reads them
agrees. Without either everything here is a no-op, so the same script runs single-process
unchanged.

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
import uuid
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from ._devices import local_device
from ._slurm import srun_env

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

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
    # Without them, srun's (torchrun's win where both are set: `srun torchrun ...`).
    present = {k: os.environ[k] for k in _LAUNCH_VARS if k in os.environ}
    if not any(k in present for k in _LAUNCH_VARS[:3]):
        return srun_env(os.environ)
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
    local_rank, local_world = _local_place(dist.get_world_size())
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
    ``backend`` overrides that choice; ``timeout``: the process group's, a timedelta (how
    long a collective waits for a rank that is gone). Under a torchrun agent's store the
    ranks first agree on a namespace of it (``_rendezvous``): a restarted group never reads
    the keys of the group before it.
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
    kwargs: dict[str, Any] = {"backend": chosen}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                "start at most one process per GPU (--nproc-per-node; under srun give every "
                "task the node's GPUs: --gpus-per-node, not --gpus-per-task)"
            )
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    kwargs.update(_rendezvous(env, timeout))
    _join(env, kwargs)
    return info()


_ROUND = "loopkit/round"
"""The agent store's key naming the newest group's namespace (its keys live under it)."""
_RECHECK = datetime.timedelta(seconds=0.25)
"""How long a rank waits for rank 0's answer before it reads the name again."""


def _rendezvous(env: dict[str, str], timeout: datetime.timedelta | None) -> dict[str, Any]:
    """How ``init_process_group`` finds the others: ``env://``, or under a torchrun agent that
    hosts the store (``TORCHELASTIC_USE_AGENT_STORE``) that store under a namespace of this
    group's own.

    The agent's store outlives its workers: a group restarted by ``--max-restarts`` or a
    rendezvous (a node lost or joined) finds the keys the previous group wrote (each rank's
    gloo address, NCCL's unique id) and a rank can read a dead peer's before the new peer
    writes its own: init then fails ("Connection refused") or hangs, both ranks waiting for
    the other to connect. The ranks agree on a fresh namespace first (``_agree``): one
    exchange of small keys, once per join."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    from torch._C._distributed_c10d import PrefixStore, TCPStore  # torch.distributed's own
    from torch.distributed.constants import default_pg_timeout

    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    wait = timeout or default_pg_timeout  # torch's, for the store's operations too
    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                     is_master=False, timeout=wait)  # fmt: skip
    name = _agree(store, rank, world, wait)
    return {"store": PrefixStore(f"{_ROUND}/{name}/default_pg", store), "rank": rank,
            "world_size": world}  # fmt: skip


def _agree(store: Store, rank: int, world: int, wait: datetime.timedelta) -> str:
    """A name every rank of this group returns and no earlier group used.

    Rank 0 draws it and writes it under ``_ROUND``; the key may still hold an earlier group's
    name, so each other rank confirms the name it read: it writes a token of its own under
    that name and waits for rank 0 to answer that token, which only the rank 0 that drew the
    name does (an earlier group's rank 0 is gone). Unanswered within ``_RECHECK``, it reads
    the key again (a store-side wait: no busy polling)."""
    if rank == 0:
        name = uuid.uuid4().hex
        store.set(_ROUND, name)
        for other in range(1, world):  # each get blocks until that rank has written its token
            token = store.get(f"{_ROUND}/{name}/{other}").decode()
            store.set(f"{_ROUND}/{name}/ok/{token}", "1")
        return name
    token, joined = uuid.uuid4().hex, ""
    deadline = time.monotonic() + wait.total_seconds()
    while True:
        try:
            name = store.get(_ROUND).decode()  # blocks until some rank 0 has written one
            if name != joined:
                store.set(f"{_ROUND}/{name}/{rank}", token)
                joined = name
            store.wait([f"{_ROUND}/{name}/ok/{token}"], _RECHECK)
            return str(name)
        except dist.DistStoreError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {rank}: rank 0 did not join the group within {wait} (the torchrun "
                    "agent's store answered, rank 0 never did): see rank 0's output"
                ) from None


def _join(env: dict[str, str], kwargs: dict[str, Any]) -> None:
    """Join the group, torchrun's names exported first where srun's were read (env:// reads
    them, and so do data loader workers and code written for torchrun); put back on failure."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        dist.init_process_group(**kwargs)
    except BaseException:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
        raise


def _local_place(world: int) -> tuple[int, int]:
    """(local rank, local world size): torchrun's variables, else srun's, else (0, world)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    try:  # a group the script joined by itself under srun
        place = srun_env(os.environ)
    except RuntimeError:
        place = None
    if place is None:
        return 0, world
    return int(place["LOCAL_RANK"]), int(place["LOCAL_WORLD_SIZE"])


_BEFORE_TEARDOWN: list[weakref.WeakMethod[Callable[[], object]]] = []
_LAST_BEFORE_TEARDOWN: list[weakref.WeakMethod[Callable[[], object]]] = []


def before_teardown(method: Callable[[], object], *, last: bool = False) -> None:
    """Call the bound ``method`` at the next ``teardown``, before the group goes (held weakly:
    an object gone by then is skipped). A Checkpointer's background save finishes there;
    ``last``: after every hook registered without it (a directory given up after the save)."""
    hooks = _LAST_BEFORE_TEARDOWN if last else _BEFORE_TEARDOWN
    if all(r() != method for r in hooks):
        hooks.append(weakref.WeakMethod(method))  # a bound method


def teardown() -> None:
    """Leave the process group (after a barrier, so no rank exits while others still talk).

    What ``before_teardown`` registered runs first (a background save completes)."""
    refs = _BEFORE_TEARDOWN + _LAST_BEFORE_TEARDOWN
    hooks = [h for h in (r() for r in refs) if h is not None]
    _BEFORE_TEARDOWN.clear()
    _LAST_BEFORE_TEARDOWN.clear()
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
