"""One training run, resumable on any number of processes: the resume-on-another-world tests.

The same code runs on 1 process (in pytest), on 2 ranks (``dist_worker.py``) and on 4
(``dist4_worker.py``, HSDP on a 2x2 mesh), so a checkpoint one of them writes is resumed by
another, and its end compared with an uninterrupted run on the first. The global batch is
fixed (``global_batch_size=8``); the data set (48 samples, 6 batches a pass) carries each
sample's index, so the samples each update used are recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import loopkit
from loopkit import distributed

SAMPLES, GLOBAL_BATCH, EPOCHS = 48, 8, 2


class Indexed(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Fixed samples that carry their index."""

    def __init__(self, n: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


@dataclass
class Run:
    """What a run ended with (gathered full tensors) and the samples each update used."""

    weights: list[torch.Tensor]
    ema: list[torch.Tensor]
    updates: int
    lr: float
    seen: list[list[int]] = field(default_factory=list)
    """Per update (from the first this process ran), the indices every rank used."""
    norms: list[float] = field(default_factory=list)
    """Per update, the gradient norm before clipping (of the whole model, every rank's)."""
    resumed_from: str | None = None


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole, gathered if it is a DTensor shard."""
    gather = getattr(t, "full_tensor", None)
    return (gather() if gather is not None else t).detach().clone()


def _everyone(indices: list[int]) -> list[int]:
    if not dist.is_initialized():
        return sorted(indices)
    found: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(found, indices)
    return sorted(i for part in found for i in part)


def own_sharding(net: nn.Module, how: str) -> nn.Module:
    """``net`` as a user shards it with torch's own calls on a mesh of their own (one process:
    the plain model): ``"fully_shard"`` each Linear, the last keeping its parameters after
    the forward, then the root; ``"replicate"`` FSDP2's replicate (whole copies, DTensors)."""
    if not dist.is_initialized():
        return net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if how == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(net, mesh=mesh)
        return net
    fully_shard(net[0], mesh=mesh)
    fully_shard(net[2], mesh=mesh, reshard_after_forward=False)
    fully_shard(net, mesh=mesh)
    return net


@dataclass
class Parts:
    """A run's objects, built as every run of these tests builds them."""

    model: nn.Module
    average: Any
    sched: Any
    loader: distributed.EpochLoader
    step: loopkit.step
    ckpt: loopkit.Checkpointer


def build(
    root: Path,
    *,
    fsdp: bool = False,
    replicate: int | None = None,
    global_batch_size: int = GLOBAL_BATCH,
    async_save: bool = False,
    own: str | None = None,
) -> Parts:
    """The model (FSDP2 over each Linear with ``fsdp``, HSDP with ``replicate``), AdamW, a
    scheduler, an EMA, clipping at 0.05 (every update clips), ``accumulate=2``, the loader and
    a Checkpointer of it all in ``root``; ``own``: sharded by the user's own calls
    (``own_sharding``), not by ``distributed.wrap``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    if own is not None:
        model = own_sharding(net, own)
    else:
        model = distributed.wrap(net, fsdp=nn.Linear if fsdp else False, replicate=replicate)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    average = loopkit.ema(model, decay=0.9)
    loader = distributed.loader(
        Indexed(), global_batch_size=global_batch_size, seed=3, num_workers=0
    )
    step = loopkit.step(model, opt, accumulate=2, scheduler=sched, ema=average,
                        clip_grad_norm=0.05)  # fmt: skip
    ckpt = loopkit.Checkpointer(root, model=model, step=step, loader=loader, async_save=async_save)
    return Parts(model, average, sched, loader, step, ckpt)


def run(
    root: Path,
    *,
    fsdp: bool = False,
    replicate: int | None = None,
    stop: int | None = None,
    reseed: bool = False,
    global_batch_size: int = GLOBAL_BATCH,
    async_save: bool = False,
    own: str | None = None,
) -> Run:
    """Train (resuming from ``root`` if it holds a checkpoint), saving every 2 updates; at
    update ``stop`` the run ends there (as a killed job: nothing saved after its last save)."""
    parts = build(root, fsdp=fsdp, replicate=replicate, global_batch_size=global_batch_size,
                  async_save=async_save, own=own)  # fmt: skip
    model, average, sched, loader = parts.model, parts.average, parts.sched, parts.loader
    step, ckpt = parts.step, parts.ckpt
    resumed = ckpt.resume(reseed=reseed)
    norms: list[float] = []
    seen: list[list[int]] = []
    window: list[int] = []
    stopped = False
    for _ in range(loader.epoch, EPOCHS):
        for x, y, index in step.iterate(loader):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            window += index.tolist()
            if step.micro_step == 0:
                seen.append(_everyone(window))
                window = []
                norm = step.grad_norm
                assert norm is not None  # clip_grad_norm= measures it
                norms.append(float(full(norm)))
            ckpt.maybe_save(every=2)
            stopped = step.updates == stop and step.micro_step == 0
            if stopped:
                break
        if stopped:
            break
    if not stopped:
        ckpt.save_if_needed()
    ckpt.wait()  # a stopped run too: its last save is on disk (as a job's teardown waits)
    shadow = average.state_dict()["shadow"]
    return Run(
        weights=[full(p) for p in model.parameters()],
        ema=[full(t) for t in shadow.values()],
        updates=step.updates,
        lr=sched.get_last_lr()[0],
        seen=seen,
        norms=norms,
        resumed_from=None if resumed is None else resumed.name,
    )


def resumed(root: Path, **how: Any) -> dict[str, Any]:
    """What a run built with ``how`` (``build``'s keywords, and ``reseed``) holds right after
    resuming from ``root``, before any update: the weights, AdamW's moments and steps, the
    EMA and its counts (gathered full tensors), the step's count, the scheduler's, the lr and
    the loader's place. Reads ``root`` only."""
    reseed = how.pop("reseed", False)
    parts = build(root, **how)
    path = parts.ckpt.resume(reseed=reseed)
    opt = parts.step.optimizer
    ema = parts.average.state_dict()
    counts = [parts.step.updates, ema["updates"], ema["seen"], parts.sched.last_epoch,
              parts.loader.epoch, parts.loader.position]  # fmt: skip
    return {
        "from": None if path is None else path.name,
        "weights": [full(p) for p in parts.model.parameters()],
        "moments": [full(v) for s in opt.state.values() for v in s.values()],
        "ema": [full(t) for t in (*ema["shadow"].values(), *ema["buffers"].values())],
        "counts": counts,
        "lr": parts.sched.get_last_lr(),
    }


def coverage(before: list[list[int]], after: list[list[int]], resumed_at: int) -> list[list[int]]:
    """Each epoch's samples (sorted), from the first ``resumed_at`` updates of a stopped run
    and the updates of its resume (a pass is 6 batches: 3 updates of 2)."""
    flat = [i for update in (*before[:resumed_at], *after) for i in update]
    return [sorted(flat[e * SAMPLES : (e + 1) * SAMPLES]) for e in range(EPOCHS)]
