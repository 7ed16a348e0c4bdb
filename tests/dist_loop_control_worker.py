"""Loop control under `torchrun --nproc-per-node 2`: every rank stops and evaluates alike.

Launched by test_loop_control_ddp.py; results land in OUT/<scenario>.rank<r>.pt.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from helpers import run_scenarios
from torch import nn

import loopkit
from loopkit import distributed

SCENARIOS: dict[str, Callable[[distributed.DistInfo], dict[str, Any]]] = {}


def out_dir() -> Path:
    """Where run_scenarios saves results (argv[1]); scenarios' checkpoints go there too."""
    return Path(sys.argv[1])


def scenario(fn: Callable[[distributed.DistInfo], dict[str, Any]]) -> Any:
    SCENARIOS[fn.__name__] = fn
    return fn


def seven_samples() -> torch.utils.data.TensorDataset:
    """The data set test_loop_control_ddp.py evaluates in one process too."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.randn(7, 2, generator=g, dtype=torch.float64))


def eval_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2).double()


def per_sample(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    out = model(x)
    return {"loss": (out - y).pow(2).sum(1), "hit": (out.argmax(1) == y.argmax(1)).double()}


_COLLECTIVES = ("all_gather_object", "all_reduce", "broadcast", "all_gather",
                "all_gather_into_tensor", "barrier", "broadcast_object_list", "reduce")  # fmt: skip


@contextmanager
def counted_collectives() -> Iterator[dict[str, int]]:
    """Calls of torch.distributed's collectives (as the library calls them) in the block."""
    counts: dict[str, int] = {}
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return saved[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@scenario
def evaluate_seven_samples_batch_two(info: distributed.DistInfo) -> dict[str, Any]:
    model = nn.parallel.DistributedDataParallel(eval_model())
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    data = seven_samples()
    keyed = distributed.loader(data, batch_size=2, shuffle=False, num_workers=0)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=3)
    plain = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    with counted_collectives() as counts, loopkit.count_host_syncs() as syncs:
        a = loopkit.evaluate(model, keyed, per_sample)
    b = loopkit.evaluate(model, plain, per_sample)
    one_by_one = [(x[None], y[None]) for i, (x, y) in enumerate(data) if i % 2 == info.rank]
    with loopkit.count_host_syncs() as many:
        loopkit.evaluate(model, one_by_one, per_sample, disjoint=True)
    return {
        "keyed": (a.sums, a.samples, dict(a)),
        "shuffled": (b.sums, b.samples, dict(b)),
        "collectives": counts,
        "host_reads": syncs.count,
        "expected_reads": syncs.expected,
        "user_reads": syncs.user_events,
        "reads_with_more_batches": (many.expected, many.user_events),
        "ddp_forwards": len(forwards),
    }


@scenario
def evaluate_uneven_shards_with_buffers(info: distributed.DistInfo) -> dict[str, Any]:
    """Rank 0 has 3 batches, rank 1 one; DDP would broadcast BatchNorm buffers per forward."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model = nn.parallel.DistributedDataParallel(net, broadcast_buffers=True)
    g = torch.Generator().manual_seed(info.rank)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g))
               for _ in range(3 if info.rank == 0 else 1)]  # fmt: skip

    def fn(m: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        return {"loss": (m(batch[0]) - batch[1]).pow(2).mean(1)}

    r = loopkit.evaluate(model, batches, fn, disjoint=True)
    return {"samples": r.samples, "loss": r["loss"]}


@scenario
def evaluate_error_on_one_rank(info: distributed.DistInfo) -> dict[str, Any]:
    def fn(m: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        if info.rank == 1:
            raise KeyError("missing label")
        return per_sample(m, batch)

    loader = distributed.loader(seven_samples(), batch_size=2, shuffle=False, num_workers=0)
    try:
        loopkit.evaluate(eval_model(), loader, fn)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": None}


@scenario
def early_stop_refuses_values_that_differ(info: distributed.DistInfo) -> dict[str, Any]:
    es = loopkit.early_stop(None, "loss", patience=2)
    es.observe({"loss": 1.0})  # the same on both ranks: fine
    try:
        es.observe({"loss": 2.0 + info.rank})
    except ValueError as err:
        return {"error": str(err), "wait": es.wait, "observed": es.state_dict()["observed"]}
    return {"error": None}


def _train(rank: int, stop_kwargs: dict[str, Any], hook: Callable[[int], None],
           directory: Path | None = None) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = loopkit.step(model, opt, accumulate=2)
    ckpt = None
    if directory is not None:
        ckpt = loopkit.Checkpointer(directory, model=model, optimizer=opt, step=step)
    stop = loopkit.until(step, checkpointer=ckpt, **stop_kwargs)
    val = loopkit.cadence(step, updates=3)
    fired = []
    g = torch.Generator().manual_seed(rank)
    for _ in range(200):
        with step as s:
            s.backward(model(torch.randn(4, 3, generator=g)).pow(2).mean())
        hook(step.updates)
        if val.due():
            fired.append(step.updates)
        if stop.check():
            break
    stop.close()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    saved = [] if ckpt is None else [p.name for p in ckpt.checkpoints()]
    return {"stopped_at": stop.stopped_at, "reason": stop.reason, "fired": fired,
            "weights": weights, "saved": saved}  # fmt: skip


@scenario
def until_with_clocks_skewed_per_rank(info: distributed.DistInfo) -> dict[str, Any]:
    """Rank 1's clock runs 2.5 times as fast: past 20 s at update 8 there, 20 on rank 0."""
    updates = [0]
    rate = 1.0 if info.rank == 0 else 2.5
    directory = out_dir() / "skewed"
    return _train(
        info.rank,
        {"max_time": 20, "check_every": 3, "signals": (), "timer": lambda: updates[0] * rate},
        lambda u: updates.__setitem__(0, u),
        directory,
    )


@scenario
def until_signal_to_one_rank(info: distributed.DistInfo) -> dict[str, Any]:
    """Rank 1 alone gets SIGTERM after update 3; checks every 2 updates: both stop at 4."""
    sent = [False]

    def hook(u: int) -> None:
        if info.rank == 1 and u == 3 and not sent[0]:
            sent[0] = True
            os.kill(os.getpid(), signal.SIGTERM)

    return _train(info.rank, {"check_every": 2}, hook, out_dir() / "signal")


def bn_model() -> nn.Module:
    """A float64 model with BatchNorm: its running statistics are the buffers that differ."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()


def _buffers(module: nn.Module) -> list[torch.Tensor]:
    return [b.detach().clone() for b in module.buffers()]


@scenario
def evaluate_with_rank_zero_buffers(info: distributed.DistInfo) -> dict[str, Any]:
    """BatchNorm trained per rank (DDP with and without broadcast_buffers, or no DDP at all):
    evaluate pools the metric of rank 0's model, and each rank's own buffers come back."""
    data = seven_samples()
    out: dict[str, Any] = {}
    for kind in ("ddp", "ddp_no_broadcast", "plain"):
        inner = bn_model()
        model: nn.Module = inner
        if kind != "plain":
            model = nn.parallel.DistributedDataParallel(inner, broadcast_buffers=kind == "ddp")
        step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
        g = torch.Generator().manual_seed(10 + info.rank)  # each rank its own batches
        for _ in range(4):
            x = torch.randn(5, 3, generator=g, dtype=torch.float64)
            if kind == "plain":  # the same weights everywhere, statistics of its own batches
                with torch.no_grad():
                    model(x)
                continue
            with step as s:
                s.backward(model(x).pow(2).mean())
        before = _buffers(inner)
        val = distributed.loader(data, batch_size=2, shuffle=False, num_workers=0)
        with counted_collectives() as counts:
            result = loopkit.evaluate(model, val, per_sample, step=step)
        out[kind] = {
            "sums": result.sums,
            "samples": result.samples,
            "rank_zero_state": {k: v.clone() for k, v in inner.state_dict().items()},
            "buffers_kept": all(
                torch.equal(a, b) for a, b in zip(before, _buffers(inner), strict=True)
            ),
            "training": inner.training,
            "collectives": counts,
        }
    return out


class Centered(nn.Module):
    """A float64 linear layer minus a running mean of its outputs kept out of checkpoints
    (a buffer registered with persistent=False), and a step counter beside it (int64)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 2).double()
        self.register_buffer("center", torch.zeros(2, dtype=torch.float64), persistent=False)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        if self.training:
            with torch.no_grad():
                self.center.lerp_(out.mean(0), 0.5)
                self.seen.add_(1)
        return out - self.center


@scenario
def evaluate_with_rank_zero_non_persistent_buffers(info: distributed.DistInfo) -> dict[str, Any]:
    """Non-persistent buffers trained apart on each rank: evaluated as rank 0's, then each
    rank's own back."""
    model = Centered()
    g = torch.Generator().manual_seed(20 + info.rank)  # each rank its own statistics
    with torch.no_grad():
        for _ in range(3 + info.rank):
            model(torch.randn(5, 3, generator=g, dtype=torch.float64))
    before = _buffers(model)
    val = distributed.loader(seven_samples(), batch_size=2, shuffle=False, num_workers=0)
    with counted_collectives() as counts:
        result = loopkit.evaluate(model, val, per_sample)
    return {
        "sums": result.sums,
        "samples": result.samples,
        "buffers": dict(model.named_buffers()),
        "weights": model.state_dict(),
        "buffers_kept": all(
            torch.equal(a, b) and a.dtype == b.dtype
            for a, b in zip(before, _buffers(model), strict=True)
        ),
        "training": model.training,
        "collectives": counts,
    }


def _epoch_end_run(info: distributed.DistInfo, directory: Path, kind: str,
                   signal_at: int | None) -> dict[str, Any]:  # fmt: skip
    """2 epochs of 3 batches per rank; a per-epoch scheduler step; SIGTERM to rank 1 only.

    ``kind``: "none" (DDP and optimizer.step() by hand, the Checkpointer's loader=) or
    "step" (loopkit.step, epochs() counted by until, no loader=).
    """
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(12, 3, generator=g),
                                          torch.randn(12, 1, generator=g))  # fmt: skip
    step = loopkit.step(model, opt, accumulate=2) if kind == "step" else None
    loader = distributed.loader(data, batch_size=2, num_workers=0, seed=1)
    ckpt = loopkit.Checkpointer(directory, model=model, optimizer=opt, scheduler=sched,
                                step=step, loader=loader if step is None else None)  # fmt: skip
    stop = loopkit.until(step, max_epochs=2, check_every=1, checkpointer=ckpt)
    ckpt.resume()
    epochs = []
    for epoch in stop.epochs(loader if step is None else None):
        epochs.append(epoch)
        if step is not None:  # no loader=: the data of each epoch seeded by hand
            loader.set_epoch(epoch)
        source: Any = step.iterate(list(loader)) if step is not None else loader
        for n, (x, y) in enumerate(source, start=1):
            if step is not None:
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
            else:
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            if info.rank == 1 and (epoch, n) == (0, signal_at):
                os.kill(os.getpid(), signal.SIGTERM)
            if stop.check():
                break
        sched.step()
    return {"weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
            "epochs": epochs, "reason": stop.reason, "stopped_at": stop.stopped_at,
            "saved": [p.name for p in ckpt.checkpoints()]}  # fmt: skip


@scenario
def until_stop_on_an_epochs_last_batch(info: distributed.DistInfo) -> dict[str, Any]:
    """SIGTERM to rank 1 on epoch 0's last batch: both ranks stop at the same boundary, one
    checkpoint after the epoch's code, and the resumed run ends at the uninterrupted weights."""
    out = {}
    for kind in ("none", "step"):
        base = out_dir() / f"epoch_end_{kind}"
        whole = _epoch_end_run(info, base / "whole", kind, None)
        first = _epoch_end_run(info, base / "parts", kind, 3)
        saved = loopkit.load_checkpoint(base / "parts" / first["saved"][-1])
        second = _epoch_end_run(info, base / "parts", kind, None)
        out[kind] = {"whole": whole, "first": first, "second": second,
                     "saved_lr_epoch": saved["scheduler"]["last_epoch"]}  # fmt: skip
    return out


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
