"""Every exchange between ranks goes through here.

Whether all ranks take the same decision (to skip an update, to raise, which metrics a
flush holds) has one place to answer it: a decision that depends on one rank's data is
made from the result of one of these collectives, which every rank receives alike.
Each function is a no-op (or the local answer) when no process group is initialized, so
single-process code calls them unconditionally.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

Group = Any  # a torch.distributed ProcessGroup, or None for the default group


def initialized() -> bool:
    """Whether a process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def world(group: Group = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` when not distributed."""
    if not initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def is_multi_rank(group: Group = None) -> bool:
    """Whether more than one rank takes part in ``group``."""
    return initialized() and dist.get_world_size(group) > 1


def comm_device(group: Group = None) -> torch.device:
    """Where a tensor must live to be exchanged in ``group`` (the GPU for nccl)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place by sum over the ranks; returns it."""
    if initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def sum_values(values: list[Any], group: Group = None) -> torch.Tensor:
    """Numbers or 0-d tensors summed over the ranks in one all-reduce, as a float64 vector."""
    device = comm_device(group) if initialized() else torch.device("cpu")
    t = torch.stack(
        [torch.as_tensor(v, dtype=torch.float64).to(device).reshape(()) for v in values]
    )
    return sum_(t, group)


def max_values(values: list[float], group: Group = None) -> list[float]:
    """Each of ``values`` maxed over the ranks in one all-reduce, read back to the host.

    The host read is the point: the caller takes a host-level decision (to stop a loop)
    that every rank must take alike. Not distributed: the values themselves, no tensor.
    """
    if not is_multi_rank(group):
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.tolist()]  # host sync (one per call, on nccl)


def any_(flag: torch.Tensor, group: Group = None) -> torch.Tensor:
    """A 0-d bool that is True on every rank if ``flag`` is True on any rank (no host read)."""
    if not initialized():
        return flag
    t = flag.to(comm_device(group), torch.int32).reshape(1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t[0].to(flag.device).bool()


def gather_rows(local: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Every rank's 1-D ``local`` as the rows of a ``(world, n)`` tensor, in one collective.

    Every rank must pass the same length; callers make sure of it before calling.
    """
    if not is_multi_rank(group):
        return local.reshape(1, -1)
    world_size = dist.get_world_size(group)
    out = torch.empty(world_size * local.numel(), dtype=local.dtype, device=local.device)
    # all_gather_single is the newer name of all_gather_into_tensor (deprecated in 2.13).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local.contiguous(), group=group)
    return out.view(world_size, -1)


def broadcast_(tensors: list[torch.Tensor], group: Group = None) -> None:
    """Overwrite each of ``tensors`` in place with the group's first rank's (no host read).

    Every rank passes tensors of the same shapes and dtypes, in the same order (callers
    make sure of it first). Not distributed: nothing changes.
    """
    if not is_multi_rank(group):
        return
    device = comm_device(group)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            sent = t if t.device == device and t.is_contiguous() else t.to(device).contiguous()
            dist.broadcast(sent, src=src, group=group)
            if sent is not t:
                t.copy_(sent)


def gather_objects(obj: Any, group: Group = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (a host-level exchange)."""
    if not is_multi_rank(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Group = None) -> None:
    """Wait until every rank of ``group`` gets here."""
    if is_multi_rank(group):
        dist.barrier(group=group)


def _store() -> Any:
    # The default group's key-value store (torchrun's TCPStore): ranks leave notes there
    # without a collective. torch has no public getter for it; this one has been stable
    # since torch 1.x.
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def post(key: str, value: str) -> None:
    """Leave ``value`` under ``key`` for any rank to read (no collective, no timeout)."""
    if is_multi_rank():
        _store().set(f"loopkit/{key}", value)


def read_post(key: str) -> str | None:
    """What was posted under ``key``, or None if nothing yet (does not wait)."""
    store = _store()
    if not store.check([f"loopkit/{key}"]):
        return None
    return bytes(store.get(f"loopkit/{key}")).decode()


def wait_posts(keys: list[str], poll_s: float = 1.0) -> list[str]:
    """The values posted under ``keys``, once all are there, however long that takes.

    Unlike a collective, which the process group's timeout bounds, this waits for work of
    any length (a cache build); a rank that dies is handled by torchrun, which ends the job.
    """
    store = _store()
    full = [f"loopkit/{k}" for k in keys]
    delay = 0.01
    while not store.check(full):
        time.sleep(delay)
        delay = min(delay * 1.5, poll_s)
    return [bytes(store.get(k)).decode() for k in full]


def done_reading(keys: list[str], counter: str, readers: int, poll_s: float = 0.1) -> None:
    """Once every one of ``readers`` ranks has read ``keys`` for the last time, delete them.

    Each rank counts itself in ``counter`` (an atomic add): the one that makes the count
    ``readers`` knows every other is past reading and deletes the keys, the counter last;
    the others return once the counter is gone, so on return the store no longer holds
    them, on any rank (it would otherwise keep one set per call for the rest of the job).
    """
    if not is_multi_rank():
        return
    store = _store()
    count = f"loopkit/{counter}"
    if store.add(count, 1) == readers:
        for key in keys:
            store.delete_key(f"loopkit/{key}")
        store.delete_key(count)
        return
    delay = 0.005
    while store.check([count]):  # the last reader is a poll behind at most
        time.sleep(delay)
        delay = min(delay * 1.5, poll_s)
