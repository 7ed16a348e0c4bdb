"""Distributed training on torch.distributed, launched by ``torchrun`` or ``accelerate launch``.

loopkit never launches processes or moves bytes itself: the launcher starts one process
per device and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; ``setup()`` reads them. Without them everything here is a no-op, so the
same script runs single-process unchanged.

Why not ``accelerate.PartialState``: under a CPU ``torchrun`` it initializes a process
group yet reports ``num_processes=1`` and ``process_index=0`` on every rank (it only
recognizes multi-CPU jobs started by its own launcher), which would make every rank
believe it is rank zero. The environment contract is small and stable, so it is read here.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import numbers
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sized
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

from ._checkpoint import Blocks
from ._core import is_int_at_least
from ._sync import sync_kind

P = ParamSpec("P")
R = TypeVar("R")
T_co = TypeVar("T_co", covariant=True)

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
        return DistInfo(device=_local_device(int(os.environ.get("LOCAL_RANK", "0"))))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(dist.get_world_size())))
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=local_world,
        device=_local_device(local_rank),
        backend=str(dist.get_backend()),
    )


def _local_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def setup(backend: str | None = None, *, timeout: datetime.timedelta | None = None) -> DistInfo:
    """Join the job the launcher started (idempotent); a no-op when not launched distributed.

    Backend ``nccl`` with CUDA, ``gloo`` otherwise; with CUDA each process uses the GPU
    of its local rank. ``with setup() as info:`` tears the group down on exit.
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


def teardown() -> None:
    """Leave the process group (after a barrier, so no rank exits while others still talk)."""
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


def wrap(
    model: nn.Module,
    *,
    fsdp: bool | Blocks = False,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Wrap ``model`` in DDP (or FSDP2 with ``fsdp=True``/``fsdp=BlockClass``) for this job.

    Moves the model to this process's device first. Single-process it returns the model
    unchanged. ``fsdp=BlockClass`` shards each such block, then the root.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap() takes an nn.Module, got {type(model).__name__}")
    if sync_kind(model) != "none":
        raise ValueError(
            f"the model is already wrapped ({sync_kind(model).upper()}): wrap it once; pass "
            "the unwrapped module to loopkit.distributed.wrap"
        )
    here = info()
    if not here.is_distributed:
        return model
    model = model.to(here.device)
    if fsdp is not False:
        from torch.distributed.fsdp import fully_shard

        if fsdp is not True:
            from ._checkpoint import _select

            for block in _select(model, fsdp, 1):
                fully_shard(block)
        fully_shard(model)
        return model
    if here.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [here.device.index])
    return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)


def _seed_worker(worker_id: int) -> None:
    # Each worker's torch seed comes from the loader's seeded generator, so it is
    # reproducible; numpy and random follow it here explicitly (recent torch does the same
    # inside its worker loop, older releases left them repeating the parent's stream).
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class _SeededRandomSampler(Sampler[int]):
    """Single-process shuffling with the order of DistributedSampler(num_replicas=1)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(_torch_seed(self.seed + self.epoch))
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class _ResumableSampler(Sampler[int]):
    """Wraps the real sampler; skips the first indices of one pass when resuming mid-epoch."""

    def __init__(self, base: Sampler[int] | None, n: int) -> None:
        self.base = base
        self.n = n
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.base, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        indices: Iterator[int] = iter(self.base) if self.base is not None else iter(range(self.n))
        skip, self.skip = self.skip, 0
        for _ in range(skip):  # indices only: no sample is loaded to be thrown away
            next(indices, None)
        return indices

    def __len__(self) -> int:
        return len(self.base) if isinstance(self.base, Sized) else self.n


class EpochLoader:
    """A DataLoader that advances its sampler's epoch on every pass, so no rank forgets.

    It also knows how far the current pass got (``position``, in batches), which is what
    a checkpoint needs to continue the same data order mid-epoch.
    """

    def __init__(self, loader: DataLoader[Any], sampler: _ResumableSampler) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0
        """The epoch the next pass will run (0 before the first)."""
        self.position = 0
        """Batches handed out in the current pass."""
        self._resume_at = 0
        self._pass_epoch = 0
        self._pass_generator_state: torch.Tensor | None = None
        # Called (and dropped) when the next pass starts, before its first batch is drawn:
        # a Checkpointer defers an end-of-epoch save to here, after the epoch's own code.
        self._before_next_pass: list[Callable[[], object]] = []

    def __iter__(self) -> Iterator[Any]:
        while self._before_next_pass:
            # Each hook leaves the list before it runs: one that raises is not run again,
            # and the ones after it still run at the next pass.
            self._before_next_pass.pop(0)()
        epoch, self.epoch = self.epoch, self.epoch + 1
        self.sampler.set_epoch(epoch)
        generator = self.loader.generator
        if generator is not None:
            # The pass draws its worker seeds from this generator: remember its state at the
            # start of the pass so a resumed pass draws the same ones.
            self._pass_generator_state = generator.get_state()
        start, self._resume_at = self._resume_at, 0
        self.sampler.skip = start * (self.loader.batch_size or 1)
        self._pass_epoch = epoch
        self.position = start
        return self._counted(iter(self.loader))

    def _counted(self, it: Iterator[Any]) -> Iterator[Any]:
        for batch in it:
            self.position += 1
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass run ``epoch`` (for a resumed run)."""
        if not is_int_at_least(epoch, 0):
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where the current pass stands: its epoch and the batches ``consumed`` so far.

        Also records the data set's length, the batch size and the batches per pass, so a
        resume with other data is refused instead of repeating some samples and skipping
        others.
        """
        position = self.position if consumed is None else consumed
        state: dict[str, Any] = {
            "epoch": self._pass_epoch,
            "position": position,
            "next_epoch": self.epoch,
            "dataset_length": self.sampler.n,
            "samples": len(self.sampler),
            "batch_size": self.loader.batch_size,
            "batches": len(self.loader),
        }
        generator = self.loader.generator
        if generator is not None:
            finished = position >= len(self.loader)
            if finished or self._pass_generator_state is None:
                # The next pass starts from the generator as it is now.
                state["generator"] = generator.get_state()
            else:
                # A resumed pass is rebuilt from its start: the state the pass began with.
                state["generator"] = self._pass_generator_state
        return state

    def _check_state(self, state: Any) -> None:
        """Raise ValueError saying what is wrong if ``state`` cannot be loaded here."""
        if not isinstance(state, Mapping):
            raise ValueError(f"a loader state must be a dict, got {type(state).__name__}")
        for key in ("epoch", "position", "next_epoch", "dataset_length", "samples", "batches"):
            if key not in state:
                raise ValueError(f"the loader state has no {key!r} entry (incomplete)")
            if not is_int_at_least(state[key], 0):
                raise ValueError(
                    f"the loader state's {key!r} must be an int >= 0, got {state[key]!r}"
                )
        if "batch_size" not in state:
            raise ValueError("the loader state has no 'batch_size' entry (incomplete)")
        if state["dataset_length"] != self.sampler.n:
            raise ValueError(
                f"the data set has {self.sampler.n} samples but the state was saved with "
                f"{state['dataset_length']}: resuming would repeat some samples and skip others; "
                "resume with the data set the run was saved with"
            )
        if state["batch_size"] != self.loader.batch_size:
            raise ValueError(
                f"the loader's batch size is {self.loader.batch_size} but the state was saved "
                f"with {state['batch_size']}: build the loader with the same batch size"
            )
        here = (len(self.sampler), len(self.loader))
        if (state["samples"], state["batches"]) != here:
            raise ValueError(
                f"this loader's pass has {here[0]} samples in {here[1]} batches but the state "
                f"was saved from one with {state['samples']} in {state['batches']}: resume with "
                "the same number of processes, drop_last and batch size"
            )
        if state["position"] > state["batches"]:
            raise ValueError(
                f"the loader state's position {state['position']} is past the end of a pass of "
                f"{state['batches']} batches"
            )
        generator = self.loader.generator
        saved = state.get("generator")
        if saved is not None and generator is not None:
            if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8:
                raise ValueError(
                    "the loader state's 'generator' must be a uint8 tensor from "
                    f"torch.Generator.get_state(), got {type(saved).__name__}"
                )
            try:  # on a scratch generator: this loader's stays untouched if it is refused
                torch.Generator(device=generator.device).set_state(saved)
            except (RuntimeError, ValueError, TypeError) as err:
                raise ValueError(
                    f"the loader state's 'generator' is not a valid state: {err}"
                ) from err

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state_dict`` left off: the same epoch, the next batch.

        The state is checked first (data set length, batch size, batches per pass, the
        generator state); a refused state changes nothing.
        """
        self._check_state(state)
        position = int(state["position"])
        if position >= len(self.loader):
            # The pass had finished: the next one is a new epoch, from its first batch.
            self.epoch, self._resume_at = int(state["next_epoch"]), 0
        else:
            self.epoch, self._resume_at = int(state["epoch"]), position
        # Described as "the pass to run next, with `_resume_at` batches done", so that a
        # state_dict() taken before the next pass starts round-trips.
        self._pass_epoch, self.position = self.epoch, self._resume_at
        generator = self.loader.generator
        saved = state.get("generator")
        if saved is not None and generator is not None:
            generator.set_state(saved)
            self._pass_generator_state = generator.get_state()

    def _snapshot(self) -> tuple[Any, ...]:
        """Everything ``load_state_dict`` changes, for ``_restore`` to put back."""
        generator = self.loader.generator
        return (
            self.epoch,
            self.position,
            self._resume_at,
            self._pass_epoch,
            self._pass_generator_state,
            generator.get_state() if generator is not None else None,
        )

    def _restore(self, snapshot: tuple[Any, ...]) -> None:
        (self.epoch, self.position, self._resume_at, self._pass_epoch,
         self._pass_generator_state, generator_state) = snapshot  # fmt: skip
        if generator_state is not None and self.loader.generator is not None:
            self.loader.generator.set_state(generator_state)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_size(self) -> int | None:
        """Samples per batch on this rank."""
        return self.loader.batch_size


def default_num_workers(local_world_size: int | None = None) -> int:
    """Loader workers per process: this node's cores shared by its processes, one kept back."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_process = (cores or 1) // max(local_world_size or info().local_world_size, 1)
    return max(0, min(8, per_process - 1))


def loader(
    dataset: Dataset[Any],
    batch_size: int | None = None,
    *,
    global_batch_size: int | None = None,
    shuffle: bool = True,
    seed: int | np.integer[Any] = 0,
    drop_last: bool = False,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    **dataloader_kwargs: Any,
) -> EpochLoader:
    """A DataLoader set up as the guides advise, sharded across ranks under DDP.

    ``batch_size`` is per process; ``global_batch_size`` is split over the ranks (it must
    divide). Workers default to this node's cores per process minus one; ``pin_memory``
    only with CUDA; persistent workers; numpy and ``random`` seeded per worker; under DDP
    a ``DistributedSampler`` whose ``set_epoch`` is called on every pass. ``seed`` is
    any integer (numpy integers too) in [-2**63, 2**63 - 1].
    """
    seed = _check_seed(seed)
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            "loader() needs a map-style dataset (__getitem__ and __len__): it shards and "
            "resumes by index, which an IterableDataset has not; shard an IterableDataset "
            "yourself (e.g. by torch.utils.data.get_worker_info() and the rank) and pass it "
            "to a plain DataLoader"
        )
    here = info()
    if (batch_size is None) == (global_batch_size is None):
        raise TypeError("pass exactly one of batch_size (per process) or global_batch_size")
    if global_batch_size is not None:
        _check_positive("global_batch_size", global_batch_size)
        if global_batch_size % here.world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide over "
                f"{here.world_size} processes: use a multiple of {here.world_size}"
            )
        batch_size = global_batch_size // here.world_size
    assert batch_size is not None
    _check_positive("batch_size", batch_size)
    if not isinstance(dataset, Sized):
        raise TypeError("loader() needs a map-style dataset with __len__ (it shards by index)")
    if num_workers is None:
        num_workers = default_num_workers(here.local_world_size)
    if pin_memory is None:
        pin_memory = here.device.type == "cuda"
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    base: Any
    if here.is_distributed:
        base = DistributedSampler(
            dataset,
            num_replicas=here.world_size,
            rank=here.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
    elif shuffle:
        base = _SeededRandomSampler(len(dataset), seed)
    else:
        base = None
    sampler = _ResumableSampler(base, len(dataset))
    generator = torch.Generator().manual_seed(_torch_seed(seed * 1000 + here.rank))
    dl = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        shuffle=False,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        worker_init_fn=_seed_worker if num_workers > 0 else None,
        generator=generator,
        **dataloader_kwargs,
    )
    return EpochLoader(dl, sampler)


_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1


def _check_seed(seed: object) -> int:
    """``seed`` as an int, or a clear error naming it and the range a seed may take."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"seed must be an integer (int or numpy integer) in [-2**63, 2**63 - 1], got "
            f"{seed!r} ({type(seed).__name__})"
        )
    value = int(seed)
    if not _SEED_MIN <= value <= _SEED_MAX:
        raise ValueError(f"seed must be in [-2**63, 2**63 - 1] (a 64-bit seed), got {value}")
    return value


def _torch_seed(value: int) -> int:
    """A seed ``torch.Generator.manual_seed`` takes: unchanged when in its range, else mod 2**64."""
    # Seeds derived from a valid seed (seed * 1000 + rank, seed + epoch) may leave the range
    # manual_seed accepts ([-2**63, 2**64 - 1]); those in it keep their value (and stream).
    return value if _SEED_MIN <= value <= 2**64 - 1 else value % 2**64


def _check_positive(name: str, value: object) -> None:
    if not is_int_at_least(value, 1):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


__all__ = [
    "DistInfo",
    "EpochLoader",
    "default_num_workers",
    "info",
    "is_rank_zero",
    "loader",
    "rank_zero_only",
    "setup",
    "teardown",
    "wrap",
]
