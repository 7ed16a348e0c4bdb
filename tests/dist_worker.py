"""Scenarios run under `torchrun --nproc-per-node 2`; each rank writes what it measured.

Launched by test_distributed.py; results land in OUT/<scenario>.rank<r>.pt.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from helpers import counted_ddp, run_scenarios
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import loopkit
from loopkit import distributed

SCENARIOS: dict[str, Callable[[distributed.DistInfo], dict[str, Any]]] = {}


def scenario(fn: Callable[[distributed.DistInfo], dict[str, Any]]) -> Any:
    SCENARIOS[fn.__name__] = fn
    return fn


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))


def data(sizes: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)) for n in sizes]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def reference(
    per_rank: list[list[tuple[torch.Tensor, torch.Tensor]]], every: int
) -> list[torch.Tensor]:
    """Single process: one step per window on all ranks' micro-batches of that window."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = len(per_rank[0])
    for start in range(0, n, every):
        xs = [b[0] for r in per_rank for b in r[start : start + every]]
        ys = [b[1] for r in per_rank for b in r[start : start + every]]
        loss_of(model, (torch.cat(xs), torch.cat(ys))).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@scenario
def weighted_equivalence(info: distributed.DistInfo) -> dict[str, Any]:
    """Unequal micro-batch sizes on each rank, weight= their sizes, every=4, ragged tail."""
    sizes = [[3, 5, 2, 6, 4, 1], [7, 1, 4, 2, 3, 5]]
    per_rank = [data(s, seed=10 + r) for r, s in enumerate(sizes)]
    ddp = DDP(mlp())
    acc = loopkit.accumulate(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), every=4)
    for batch in acc.iterate(per_rank[info.rank]):
        with acc:
            acc.backward(loss_of(ddp, batch), weight=len(batch[0]))
    got = [p.detach().clone() for p in ddp.module.parameters()]
    ref = reference(per_rank, 4)
    return {
        "max_diff": max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True)),
        "updates": acc.updates,
    }


@scenario
def unweighted_equivalence(info: distributed.DistInfo) -> dict[str, Any]:
    """Equal micro-batches, every=4, 8 micro-steps per rank."""
    per_rank = [data([4] * 8, seed=20 + r) for r in range(info.world_size)]
    ddp = DDP(mlp())
    acc = loopkit.accumulate(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), every=4)
    for batch in per_rank[info.rank]:
        with acc:
            acc.backward(loss_of(ddp, batch))
    got = [p.detach().clone() for p in ddp.module.parameters()]
    ref = reference(per_rank, 4)
    return {"max_diff": max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))}


@scenario
def all_reduce_counts(info: distributed.DistInfo) -> dict[str, Any]:
    """Comm-hook counts: accumulate's no_sync vs a loop that accumulates without it."""
    batches = data([4] * 8, seed=30 + info.rank)
    ddp, with_loopkit = counted_ddp(mlp())
    acc = loopkit.accumulate(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), every=4)
    for batch in batches:
        with acc:
            acc.backward(loss_of(ddp, batch))
    plain, without = counted_ddp(mlp())
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for i, batch in enumerate(batches):
        (loss_of(plain, batch) / 4).backward()
        if (i + 1) % 4 == 0:
            opt.step()
            opt.zero_grad()
    return {"with_loopkit": len(with_loopkit), "without": len(without), "updates": acc.updates}


_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "barrier",
)


@contextlib.contextmanager
def counted_collectives() -> Iterator[list[str]]:
    """The names of the torch.distributed collectives called inside the block, in order."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counting(name: str) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            calls.append(name)
            return originals[name](*a, **k)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@scenario
def logging_collectives(info: distributed.DistInfo) -> dict[str, Any]:
    """detach_logging(sync_ranks=True): one collective per flush, values are all-rank means."""
    flushed: list[dict[str, float]] = []
    with counted_collectives() as calls:
        log = loopkit.detach_logging(
            every=10, sink=flushed.append, reduce={"peak": "max", "n": "sum"}, sync_ranks=True
        )
        for i in range(30):
            value = torch.tensor(float(i + 100 * info.rank))
            log(loss=value, peak=value, n=1.0)
        per_flush = len(calls) / 3
    return {
        "per_flush": per_flush,
        "kinds": sorted(set(calls)),
        "flushed": flushed,
        "last": log.last,
    }


@scenario
def logging_first_seen_order(info: distributed.DistInfo) -> dict[str, Any]:
    """The same metrics first seen in another order on each rank: still one collective."""
    flushed: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=2, sink=flushed.append, sync_ranks=True)
    per_flush = []
    for i in range(4):
        metrics = {"loss": torch.tensor(float(i + info.rank))}
        if i == info.rank:  # rank 0 logs 'spike' first at call 0, rank 1 at call 1
            metrics = {"spike": torch.tensor(5.0 + info.rank), **metrics}
        with counted_collectives() as calls:
            log(**metrics)
        if i % 2 == 1:
            per_flush.append(len(calls))
    return {"flushed": [list(d.items()) for d in flushed], "per_flush": per_flush}


@scenario
def logging_uneven_metrics(info: distributed.DistInfo) -> dict[str, Any]:
    """Metrics logged on some ranks only, or unequally often: reduced over who logged them."""
    flushed: list[dict[str, float]] = []
    log = loopkit.detach_logging(
        every=4,
        sink=flushed.append,
        reduce={"gn": "max", "tokens": "sum", "final": "last", "probe": "max", "lo": "min"},
        sync_ranks=True,
    )
    per_flush = []
    for i in range(8):
        metrics: dict[str, Any] = {"loss": torch.tensor(float(i + 10 * info.rank))}
        if i < 4:  # the first interval: metric sets differ between the ranks
            if info.rank == 1:
                metrics["gn"] = torch.tensor(float(i))  # rank 1 only
            # Weighted by counts: rank 0 logs w once (1.0), rank 1 three times (2, 3, 4).
            if (info.rank == 0 and i == 0) or (info.rank == 1 and i > 0):
                metrics["w"] = torch.tensor(float(i + 1))
            if i == 0:  # exact beyond float32: 2**52 + 1 on rank 0, 2 on rank 1
                metrics["tokens"] = torch.tensor(2**52 + 1 if info.rank == 0 else 2)
            if info.rank == 0 and i == 3:
                metrics["final"] = 7.0  # 'last' of rank 0 only, a Python float
        else:  # the second interval: the same set everywhere, tensors and Python floats mixed
            metrics["lr"] = 0.5 * (1 + info.rank)
            nan_here = info.rank == 0 and i == 5
            metrics["probe"] = torch.tensor(float("nan") if nan_here else 1.0)
            metrics["lo"] = float("nan") if info.rank == 1 and i == 6 else 3.0
        with counted_collectives() as calls:
            log(**metrics)
        if i % 4 == 3:
            per_flush.append(sorted(calls))
    return {
        "flushed": [list(d.items()) for d in flushed],
        "last": list(log.last.items()),
        "per_flush": per_flush,
    }


@scenario
def logging_many_metrics(info: distributed.DistInfo) -> dict[str, Any]:
    """More metrics than the fixed gather holds (40): the name exchange still reduces them."""
    flushed: list[dict[str, float]] = []
    log = loopkit.detach_logging(every=2, sink=flushed.append, sync_ranks=True)
    with counted_collectives() as calls:
        for i in range(2):
            log(**{f"m{k:02d}": torch.tensor(float(k + i + 10 * info.rank)) for k in range(40)})
    return {"flushed": flushed, "calls": len(calls)}


@scenario
def logging_conflicting_reductions(info: distributed.DistInfo) -> dict[str, Any]:
    """One metric reduced by max on rank 0 and mean on rank 1: every rank raises, keeps data."""
    log = loopkit.detach_logging(
        every=None, sink=None, reduce={"x": "max"} if info.rank == 0 else "mean", sync_ranks=True
    )
    log(x=torch.tensor(1.0))
    try:
        log.flush()
    except RuntimeError as err:
        error: str | None = str(err)
    else:
        error = None
    return {"error": error, "kept": len(log._values.get("x", [])), "step": log.step}


@scenario
def logging_rank0_only(info: distributed.DistInfo) -> dict[str, Any]:
    """Default sync_ranks: rank 0 alone logs (no collective), rank 1 trains on in lockstep."""
    torch.manual_seed(0)
    net = DDP(nn.Linear(4, 1))
    train = loopkit.step(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(info.rank)
    got: list[dict[str, float]] = []
    mine: list[dict[str, float]] = []
    both: list[dict[str, float]] = []
    losses: list[float] = []
    rank0_log = loopkit.detach_logging(every=2, sink=got.append) if info.rank == 0 else None
    everyone = loopkit.detach_logging(every=3, sink=mine.append, sync_ranks=False)
    default_both = loopkit.detach_logging(every=3, sink=both.append)
    logging_calls: list[str] = []
    for _ in range(6):
        with train as s:
            loss = net(torch.randn(8, 4, generator=g)).pow(2).mean()
            s.backward(loss)
        losses.append(loss.item())
        with counted_collectives() as calls:
            if rank0_log is not None:
                rank0_log(loss=loss)
            everyone(mine=loss)
            default_both(both=loss)
        logging_calls += calls
    w = torch.cat([p.detach().flatten() for p in net.module.parameters()])
    ws = [torch.zeros_like(w) for _ in range(info.world_size)]
    dist.all_gather(ws, w)
    return {
        "logging_calls": logging_calls,
        "replicas_equal": all(torch.equal(ws[0], x) for x in ws),
        "updates": train.updates,
        "got": got,
        "mine": mine,
        "both": both,
        "both_last": default_both.last,
        "losses": losses,
    }


@scenario
def logging_interval_resume(info: distributed.DistInfo) -> dict[str, Any]:
    """A log's state saved one call into an interval of 3, loaded into a new log: every rank
    resumes its own unflushed value (sync_ranks=True and False); the uninterrupted run's flushes."""
    import io

    out: dict[str, Any] = {}
    values = [torch.tensor(float(10 * info.rank + i)) for i in range(6)]
    for sync in (True, False):
        whole: list[dict[str, float]] = []
        log = loopkit.detach_logging(every=3, sink=whole.append, sync_ranks=sync)
        for v in values:
            log(x=v)
        part = loopkit.detach_logging(every=3, sink=[].append, sync_ranks=sync)
        for v in values[:4]:
            part(x=v)
        buffer = io.BytesIO()
        torch.save(part.state_dict(), buffer)  # every rank: the state gathers every interval
        written = [buffer.getvalue()]  # rank 0 writes the file, every rank reads it
        dist.broadcast_object_list(written, src=0)
        resumed: list[dict[str, float]] = []
        again = loopkit.detach_logging(every=3, sink=resumed.append, sync_ranks=sync)
        saved = torch.load(io.BytesIO(written[0]), map_location="cpu", weights_only=True)
        again.load_state_dict(saved)
        for v in values[4:]:
            again(x=v)
        out[str(sync)] = {"whole": whole, "resumed": resumed}
    return out


@scenario
def checkpointed_blocks(info: distributed.DistInfo) -> dict[str, Any]:
    """Checkpointed blocks under DDP train to the same weights as plain blocks."""
    results = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.1)) for _ in range(4)],
            nn.Linear(8, 1),
        )
        if ckpt:
            loopkit.checkpointed(
                model, blocks=lambda m: isinstance(m, nn.Sequential) and len(m) == 3
            )
        ddp = DDP(model)
        step = loopkit.step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), accumulate=2)
        torch.manual_seed(1 + info.rank)
        for batch in data([4] * 4, seed=40 + info.rank):
            with step as s:
                s.backward(loss_of(ddp, batch))
        results.append([p.detach().clone() for p in model.parameters()])
    return {
        "max_diff": max(
            (a - b).abs().max().item() for a, b in zip(results[0], results[1], strict=True)
        ),
        "checkpointed": loopkit.is_checkpointed(model[0]),
    }


@scenario
def loader_shards(info: distributed.DistInfo) -> dict[str, Any]:
    """Indices each rank sees, per epoch, from the loader helper."""
    dataset = torch.utils.data.TensorDataset(torch.arange(40))
    loader = distributed.loader(dataset, global_batch_size=8, num_workers=0, seed=3)
    epochs = []
    for _ in range(3):
        epochs.append([int(i) for (batch,) in loader.training_pass() for i in batch])
    return {"epochs": epochs, "batch_size": loader.batch_size}


@scenario
def passes_outside_training(info: distributed.DistInfo) -> dict[str, Any]:
    """Two epochs of DDP training (a plain loop, then iterate), rank 0 alone peeking and
    running an evaluation pass over the training loader: the indices each rank trained on."""
    dataset = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32))
    loader = distributed.loader(dataset, global_batch_size=8, num_workers=0, seed=3)
    model = distributed.wrap(nn.Linear(1, 1))
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    trained: list[list[int]] = []
    for epoch in range(loader.epoch, 4):
        if info.rank == 0:
            next(iter(loader))
        seen: list[int] = []
        for (x,) in loader if epoch % 2 == 0 else step.iterate(loader):
            seen += x.long().tolist()
            with step as s:
                s.backward(model(x[:, None]).square().mean())
        if info.rank == 0:
            evaluated = [int(i) for (x,) in loader for i in x]
            assert len(evaluated) == 20  # a whole pass of its shard, the loader unchanged
        trained.append(seen)
    return {"trained": trained, "epoch": loader.epoch, "updates": step.updates}


@scenario
def bad_global_batch(info: distributed.DistInfo) -> dict[str, Any]:
    """A global batch that the world size does not divide is refused."""
    try:
        distributed.loader(torch.utils.data.TensorDataset(torch.arange(10)), global_batch_size=7)
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None}


@scenario
def fsdp2_no_sync(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2 with accumulate(every=4): no_sync on 3 of 4 micro-steps, large-batch result."""
    from torch.distributed.fsdp import fully_shard

    per_rank = [data([4] * 8, seed=50 + r) for r in range(info.world_size)]
    model = mlp()
    try:
        fully_shard(model)
    except Exception as err:
        return {"skipped": f"fully_shard failed on this build: {err}"}
    flags: list[bool] = []
    groups = model._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]
    acc = loopkit.accumulate(model, torch.optim.AdamW(model.parameters(), lr=1e-2), every=4)
    for batch in per_rank[info.rank]:
        with acc:
            flags.append(all(g.reduce_grads for g in groups))
            acc.backward(loss_of(model, batch))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    got = [full[k] for k in mlp().state_dict()]
    ref = reference(per_rank, 4)
    return {
        "skipped": None,
        "sync_flags": flags,
        "max_diff": max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True)),
    }


def _ema_run(info: distributed.DistInfo, with_ema: bool) -> tuple[Any, list[str]]:
    """DDP, accumulate=2, AdamW over this rank's batches; the collectives the loop called."""
    model = distributed.wrap(mlp())
    average = loopkit.ema(model, decay=0.9, warmup=True) if with_ema else None
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=2,
                        ema=average)  # fmt: skip
    with counted_collectives() as calls:
        for batch in step.iterate(data([4, 4, 4, 4, 4, 3], seed=60 + info.rank)):
            with step as s:
                s.backward(loss_of(model, batch))
    return average, calls


@scenario
def ema_ddp(info: distributed.DistInfo) -> dict[str, Any]:
    """EMA under DDP: the same collectives as without it; the ranks' averages bit-identical."""
    average, with_ema = _ema_run(info, True)
    _, without = _ema_run(info, False)
    flat = torch.cat([t.flatten() for t in average.shadow])
    gathered = [torch.empty_like(flat) for _ in range(info.world_size)]
    dist.all_gather(gathered, flat)
    return {
        "with": with_ema,
        "without": without,
        "updates": average.updates,
        "same": all(torch.equal(g, gathered[0]) for g in gathered),
    }


class _Odd(nn.Module):
    """Rows 15 and 1: FSDP2 shards them 8 + 7 and 1 + 0 over two ranks (uneven, one empty)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(8, 15), nn.Linear(15, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@scenario
def ema_fsdp2(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2 with uneven shards: each rank averages its shard (no gather per update); the
    gathered averages equal one process's on the global batches; swapped() and a
    torch.distributed.checkpoint round trip of the shards."""
    import sys
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    per_rank = [data([4] * 6, seed=70 + r) for r in range(info.world_size)]
    model = _Odd()
    try:
        fully_shard(model)
    except Exception as err:
        return {"skipped": f"fully_shard failed on this build: {err}"}
    average = loopkit.ema(model, decay=0.8, warmup=True)
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=2,
                        ema=average)  # fmt: skip
    with counted_collectives() as calls:
        for batch in per_rank[info.rank]:
            with step as s:
                s.backward(loss_of(model, batch))
    no_ema = _Odd()
    fully_shard(no_ema)
    plain = loopkit.step(no_ema, torch.optim.AdamW(no_ema.parameters(), lr=1e-2), accumulate=2)
    with counted_collectives() as plain_calls:
        for batch in per_rank[info.rank]:
            with plain as s:
                s.backward(loss_of(no_ema, batch))
    # One process on the global batches, with the same average.
    ref = _Odd()
    ref_avg = loopkit.ema(ref, decay=0.8, warmup=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for start in range(0, 6, 2):
        xs = torch.cat([b[0] for r in per_rank for b in r[start : start + 2]])
        ys = torch.cat([b[1] for r in per_rank for b in r[start : start + 2]])
        loss_of(ref, (xs, ys)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_avg.update()
    saved = average.state_dict()
    full = {n: t.full_tensor() for n, t in saved["shadow"].items()}
    diff = max((full[n] - t).abs().max().item() for n, t in ref_avg.named_shadow().items())
    shard_rows = [int(t.shape[0]) for t in average.shadow]
    training = {k: v.full_tensor() for k, v in model.state_dict().items()}
    with average.swapped():
        inside = {k: v.full_tensor() for k, v in model.state_dict().items()}
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    exported = average.export()  # gathered whole on every rank
    export_equal = list(exported) == list(inside) and all(
        torch.equal(exported[k], inside[k]) for k in inside
    )
    swapped_in = max((inside[n] - full[n]).abs().max().item() for n in full)
    restored = all(torch.equal(after[k], training[k]) for k in training)
    where = Path(sys.argv[1]) / "ema_dcp"
    dcp.save({"ema": saved}, checkpoint_id=where)
    fresh = loopkit.ema(model, decay=0.8, warmup=True)
    target = fresh.state_dict()
    dcp.load({"ema": target}, checkpoint_id=where)
    fresh.load_state_dict(target)
    return {
        "skipped": None,
        "max_diff": diff,
        "updates": average.updates,
        "shard_rows": shard_rows,
        "extra_collectives": len(calls) - len(plain_calls),
        "swapped_in": swapped_in,
        "restored": restored,
        "export_equal": export_equal,
        "dcp_equal": fresh.updates == average.updates
        and all(torch.equal(a, b) for a, b in zip(fresh.shadow, average.shadow, strict=True)),
    }


def _sharded_run(root: Any, stop: int | None = None, width: int = 16, **resume: Any) -> Any:
    """An FSDP2 run (each Linear a shard group) with AdamW, a scheduler, an EMA, clipping and
    a distributed.loader, saved every 3 updates; None if stopped (the process dies there).
    ``resume``: what ``ckpt.resume`` is given."""
    torch.manual_seed(0)
    model = distributed.wrap(nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 2)),
                             fsdp=nn.Linear)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    average = loopkit.ema(model, decay=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    g = torch.Generator().manual_seed(5)
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                             torch.randn(64, 2, generator=g))  # fmt: skip
    loader = distributed.loader(dataset, batch_size=4, seed=0, num_workers=0)
    step = loopkit.step(model, opt, accumulate=2, scheduler=sched, ema=average, clip_grad_norm=1.0)
    ckpt = loopkit.Checkpointer(root, model=model, step=step, loader=loader)
    ckpt.resume(**resume)
    for _ in range(loader.epoch, 2):
        for x, y in step.iterate(loader):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            ckpt.maybe_save(every=3)
            if stop is not None and step.updates == stop and step.micro_step == 0:
                return None
    ckpt.save_if_needed()  # the end state
    full = [p.full_tensor() for p in model.parameters()]
    shadow = [t.full_tensor() for t in average.state_dict()["shadow"].values()]
    return full, shadow, step.updates, sched.last_epoch, model, ckpt


@scenario
def sharded_checkpoint(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2: a run stopped after a save and resumed by fresh objects ends bit-identical
    (weights, EMA); a resume with another model is refused before anything loads; a newest
    checkpoint missing a rank's shards is refused naming the older one, which resumes."""
    import sys
    from pathlib import Path

    root = Path(sys.argv[1]) / "sharded"
    whole = _sharded_run(root / "whole")
    # The weights out, in one process (no process group), from every rank's shards.
    final = sorted((root / "whole").glob("ckpt-*"))[-1]
    exported = loopkit.export_weights(final) if info.rank == 0 else None
    average = loopkit.export_weights(final, ema=True) if info.rank == 0 else None
    names = [n for n, _ in whole[4].named_parameters()]
    exported_ok = info.rank != 0 or (
        all(torch.equal(exported[n], t) for n, t in zip(names, whole[0], strict=True))
        and all(torch.equal(average[n], t) for n, t in zip(names, whole[1], strict=True))
    )
    _sharded_run(root / "cut", stop=5)
    resumed = _sharded_run(root / "cut")
    names_cut = sorted(p.name for p in (root / "cut").iterdir() if p.name[:14] != ".loopkit-owner")
    same = all(torch.equal(a, b) for a, b in zip(whole[0], resumed[0], strict=True)) and all(
        torch.equal(a, b) for a, b in zip(whole[1], resumed[1], strict=True)
    )
    # Another width: refused from the placeholders, before any shard is read.
    torch.manual_seed(1)
    other = distributed.wrap(nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 2)),
                             fsdp=nn.Linear)  # fmt: skip
    before = [p.full_tensor() for p in other.parameters()]
    refused = None
    try:
        loopkit.Checkpointer(root / "cut", model=other).resume()
    except loopkit.CheckpointError as err:
        refused = str(err)
    unchanged = all(torch.equal(a, p.full_tensor())
                    for a, p in zip(before, other.parameters(), strict=True))  # fmt: skip
    # The newest checkpoint loses rank 1's shards (a node lost during a copy, say).
    newest = sorted((root / "cut").glob("ckpt-*"))[-1]
    dist.barrier()
    if info.rank == 0:
        (newest / "__1_0.distcp").unlink()
    dist.barrier()
    damaged = None
    ckpt = resumed[5]
    try:
        ckpt.resume()
    except loopkit.CheckpointError as err:
        damaged = str(err)
    older = sorted((root / "cut").glob("ckpt-*"))[-2]
    ckpt.resume(older)
    # Each rank given a directory of its own: refused on every rank, nothing left behind.
    own = root / f"own-{info.rank}"
    blind = None
    try:
        loopkit.Checkpointer(own, model=ckpt.model).save()
    except loopkit.CheckpointError as err:
        blind = str(err)
    return {
        "blind": blind, "left": sorted(p.name for p in own.iterdir()) if own.exists() else [],
        "same": same, "updates": (whole[2], resumed[2]), "lr_epochs": (whole[3], resumed[3]),
        "names": names_cut, "refused": refused, "unchanged": unchanged, "damaged": damaged,
        "exported": exported_ok,
        "older": older.name, "older_updates": ckpt.step.updates,
    }  # fmt: skip


def _damage_sharded(newest: Any, how: str) -> None:
    """Damage a sharded checkpoint: rank 1's shard file gone (only rank 1 reads it), DCP's
    metadata overwritten, loop.pt cut short."""
    if how == "shard_deleted":
        (newest / "__1_0.distcp").unlink()
    elif how == "metadata":
        (newest / ".metadata").write_bytes(b"\x80\x04not metadata" * 8)
    else:
        data = (newest / "loop.pt").read_bytes()
        (newest / "loop.pt").write_bytes(data[: len(data) // 2])


@scenario
def sharded_skip_damaged(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2 on 2 ranks, the newest checkpoint damaged three ways: without the opt-in the
    error names ckpt.resume(skip_damaged=True); with it every rank resumes the previous one
    alike (rank 0 warns) and ends bit-identical to a run resumed from it by path. A
    directory another live job owns is refused on every rank alike, naming it."""
    import json
    import os
    import shutil
    import sys
    from pathlib import Path

    root = Path(sys.argv[1]) / "skip_damaged"
    whole = _sharded_run(root / "base")
    kinds = ("shard_deleted", "metadata", "loop")
    if info.rank == 0:
        for kind in (*kinds, "by_path"):
            shutil.copytree(root / "base", root / kind)
        for kind in kinds:
            _damage_sharded(root / kind / "ckpt-0000000008", kind)
    dist.barrier()
    by_path = _sharded_run(root / "by_path", path=root / "by_path" / "ckpt-0000000006")
    found: dict[str, Any] = {"base": sorted(p.name for p in (root / "base").glob("ckpt-*"))}
    same = [all(torch.equal(a, b) for a, b in zip(whole[0] + whole[1], by_path[0] + by_path[1],
                                                    strict=True))]  # fmt: skip
    for kind in kinds:
        try:
            _sharded_run(root / kind)  # refused as it resumes, nothing trained
            found[f"{kind}_refused"] = None
        except loopkit.CheckpointError as err:
            found[f"{kind}_refused"] = str(err)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = _sharded_run(root / kind, skip_damaged=True)
        found[f"{kind}_warned"] = [str(w.message) for w in caught
                                   if "skip_damaged" in str(w.message)]  # fmt: skip
        found[f"{kind}_damaged"] = [(p.name, why) for p, why in run[5].damaged]
        found[f"{kind}_standing"] = run[5].standing
        pairs = zip(by_path[0] + by_path[1], run[0] + run[1], strict=True)
        same.append(all(torch.equal(a, b) for a, b in pairs))
    found["same"] = same
    # Another job (on another host, alive: touched just now) owns this directory.
    owned = root / "owned"
    if info.rank == 0:
        owned.mkdir()
        record = {"host": "node-b", "pid": 4242, "started": "2030-01-01 00:00:00 +0000",
                  "job": None, "restarts": [0, 0], "dir_ino": os.stat(owned).st_ino,
                  "slurm_job_id": "77", "torchelastic_run_id": None}  # fmt: skip
        (owned / ".loopkit-owner-0000000001").write_text(json.dumps(record))
    dist.barrier()
    try:
        loopkit.Checkpointer(owned, model=whole[4]).save()
        found["owned"] = None
    except loopkit.CheckpointError as err:
        found["owned"] = str(err)
    found["owned_left"] = sorted(p.name for p in owned.iterdir())
    return found


@scenario
def world_change(info: distributed.DistInfo) -> dict[str, Any]:
    """Runs on 2 ranks for the 1-process resumes of the pytest side (DDP and FSDP2: whole and
    stopped at update 5, saved at 4); a 1-process checkpoint resumed here (grown: DDP, and
    FSDP2 from its one file) and the 4-rank HSDP one resumed on FSDP2 (shrunk), each with
    reseed=True; what each resume holds before its first update (``*_resumed``: also the
    DDP and FSDP2 checkpoints resumed by 2 ranks as saved, and each by the other wrapping);
    the refusals."""
    import shutil
    import sys
    from pathlib import Path

    import elastic

    out = Path(sys.argv[1])
    root = out / "elastic"
    found: dict[str, Any] = {"root": str(root)}
    for kind, fsdp in (("ddp", False), ("fsdp", True)):
        found[f"{kind}_whole"] = elastic.run(root / f"{kind}_whole", fsdp=fsdp)
        found[f"{kind}_cut"] = elastic.run(root / f"{kind}_cut", fsdp=fsdp, stop=5)
    one = out / "one" / "cut"  # written by 1 process before this launch (conftest.py)
    grow = out / "one" / "for_fsdp"  # a copy for FSDP2 (the DDP resume below saves into one)
    if info.rank == 0:
        shutil.copytree(one, grow)
    dist.barrier()
    four = out / "four" / "hsdp" / "for_two"
    for name, where, reseed in (("fsdp_cut", root / "fsdp_cut", False), ("grown_fsdp", grow, True),
                                ("shrunk", four, True)):  # fmt: skip
        found[f"{name}_resumed"] = elastic.resumed(where, fsdp=True, reseed=reseed)
    # The same number of processes, the other wrapping: DDP's one file, FSDP2's directory.
    found["ddp_cut_resumed"] = elastic.resumed(root / "ddp_cut")
    found["ddp_cut_as_fsdp_resumed"] = elastic.resumed(root / "ddp_cut", fsdp=True)
    found["fsdp_cut_as_ddp_resumed"] = elastic.resumed(root / "fsdp_cut")
    for name, how in (("refused", {}), ("other_batch", {"global_batch_size": 4, "reseed": True})):
        parts = elastic.build(one, global_batch_size=how.get("global_batch_size", 8))
        before = [p.detach().clone() for p in parts.model.parameters()]
        try:
            parts.ckpt.resume(reseed=how.get("reseed", False))
            found[name] = None
        except loopkit.CheckpointError as err:
            found[name] = str(err)
        found[name + "_unchanged"] = parts.step.updates == 0 and all(
            torch.equal(a, p) for a, p in zip(before, parts.model.parameters(), strict=True)
        )
    found["grown"] = elastic.run(one, reseed=True)
    found["grown_fsdp"] = elastic.run(grow, fsdp=True, reseed=True)
    found["shrunk"] = elastic.run(four, fsdp=True, reseed=True)
    return found


@scenario
def sharded_async_save(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2 saving in the background (DCP's async_save in a process group of its own):
    bit-identical to saving synchronously, stopped at 5 and resumed too; each checkpoint's
    exported weights and EMA equal the synchronous run's at that update."""
    import sys
    from pathlib import Path

    import elastic

    root = Path(sys.argv[1]) / "async"
    sync = elastic.run(root / "sync", fsdp=True)
    background = elastic.run(root / "async", fsdp=True, async_save=True)
    elastic.run(root / "cut", fsdp=True, async_save=True, stop=5)
    resumed = elastic.run(root / "cut", fsdp=True, async_save=True)
    names = [p.name for p in sorted((root / "sync").glob("ckpt-*"))]
    same_files = names == [p.name for p in sorted((root / "async").glob("ckpt-*"))]
    if info.rank == 0:
        for name in names:
            for ema in (False, True):
                a = loopkit.export_weights(root / "sync" / name, ema=ema)
                b = loopkit.export_weights(root / "async" / name, ema=ema)
                same_files &= a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {
        "names": names,
        "same_files": same_files,
        "same": [all(torch.equal(a, b) for a, b in zip(sync.weights + sync.ema,
                                                       run.weights + run.ema, strict=True))
                 for run in (background, resumed)],
    }  # fmt: skip


class _SlashNamed(nn.Module):
    """Two Linears in a ModuleDict, one under a key holding '/' (as test_sharded_edges' Named)."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.ModuleDict({"enc/0": nn.Linear(4, 8), "dec": nn.Linear(8, 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d["dec"](torch.tanh(self.d["enc/0"](x)))  # type: ignore[no-any-return]


@scenario
def sharded_edges(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2 with '/' in keys (a ModuleDict's "enc/0", extra={"ema/teacher": ...}) and AdamW
    under extra=: saved after 3 updates, ended after 5; fresh objects resume it and end the
    same. The pytest side resumes its save, copied under another name, on one process."""
    import sys
    from pathlib import Path

    root = Path(sys.argv[1]) / "sharded_edges"

    def build() -> tuple[nn.Module, Any, Any, loopkit.Checkpointer]:
        torch.manual_seed(0)
        model = distributed.wrap(_SlashNamed(), fsdp=nn.Linear)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        average = loopkit.ema(model, decay=0.9)
        step = loopkit.step(model, opt)
        extra = {"ema/teacher": average, "opt": opt}
        return model, step, average, loopkit.Checkpointer(root, model=model, step=step,
                                                          extra=extra)  # fmt: skip

    def train(model: nn.Module, step: Any, average: Any, first: int, n: int) -> None:
        for i in range(first, first + n):  # update i: rows 6r..6r+5 of batch i on rank r
            x = torch.randn(12, 4, generator=torch.Generator().manual_seed(i))
            with step as s:
                s.backward(model(x[6 * info.rank : 6 * info.rank + 6]).pow(2).mean())
            average.update()

    def whole(model: nn.Module, average: Any, opt: Any) -> list[torch.Tensor]:
        moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        shadow = list(average.state_dict()["shadow"].values())
        return [t.full_tensor() for t in (*model.parameters(), *shadow, *moments)]

    model, step, average, ckpt = build()
    train(model, step, average, 0, 3)
    path = ckpt.save()
    train(model, step, average, 3, 2)
    ended = whole(model, average, step.optimizer)
    model2, step2, average2, ckpt2 = build()
    resumed = ckpt2.resume()
    train(model2, step2, average2, 3, 2)
    same = all(torch.equal(a, b) for a, b in
               zip(ended, whole(model2, average2, step2.optimizer), strict=True))  # fmt: skip
    return {"path": None if path is None else str(path), "ended": ended, "same": same,
            "resumed": None if resumed is None else resumed.name}  # fmt: skip


def _resave_build(root: Any, async_save: bool) -> tuple[Any, ...]:
    """FSDP2 with skip_nonfinite and AdamW: the model, its step, loader and Checkpointer."""
    torch.manual_seed(0)
    model = distributed.wrap(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
                             fsdp=nn.Linear)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                             torch.randn(64, 2, generator=g))  # fmt: skip
    loader = distributed.loader(dataset, global_batch_size=8, seed=1, num_workers=0)
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                        skip_nonfinite=True)  # fmt: skip
    ckpt = loopkit.Checkpointer(root, model=model, step=step, loader=loader,
                                async_save=async_save)  # fmt: skip
    return model, step, loader, ckpt


def _resave_run(root: Any, async_save: bool) -> tuple[Any, ...]:
    """``_resave_build``'s run, resumed if saved, else saving every update: batch 2's loss
    is nan (skipped, so maybe_save saves update 2 again), batches 0-4 trained, then two
    save()s of update 4. The model, its step and Checkpointer."""
    model, step, loader, ckpt = _resave_build(root, async_save)
    if ckpt.resume() is None:
        for i, (x, y) in enumerate(step.iterate(loader)):
            with step as s:
                loss = nn.functional.mse_loss(model(x), y)
                s.backward(loss * float("nan") if i == 2 else loss)
            ckpt.maybe_save(every=1)
            if i == 4:
                break
        ckpt.save()
        ckpt.save()
        ckpt.wait()
    return model, step, ckpt


def _same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two runs (model, step, ...) hold the same weights and Adam moments."""

    def whole(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        return [t.full_tensor() for t in (*model.parameters(), *moments)]  # type: ignore[attr-defined]

    pairs = zip(whole(a[0], a[1].optimizer), whole(b[0], b[1].optimizer), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


@scenario
def sharded_resave(info: distributed.DistInfo) -> dict[str, Any]:
    """FSDP2 re-saving updates already saved (a skipped window then maybe_save; two save()
    calls), synchronously and in the background: each checkpoint replaced, nothing left
    beside them; fresh objects resume the newest (weights, moments, the skip counted) and
    the re-saved update 2 (its skip counted: the second save's). In the background, a save
    whose shards rank 1 cannot write (its files capped): wait() raises on every rank naming
    the checkpoint and the cause, and the checkpoint it would have replaced is left whole."""
    import resource
    import signal
    import sys
    from pathlib import Path

    out: dict[str, Any] = {}
    for mode, async_save in (("sync", False), ("async", True)):
        root = Path(sys.argv[1]) / "resave" / mode
        run = _resave_run(root, async_save)
        names = sorted(p.name for p in root.iterdir() if p.name[:14] != ".loopkit-owner")
        fresh = _resave_run(root, async_save)
        found = {"names": names, "skipped": (run[1].skipped, fresh[1].skipped),
                 "updates": (run[1].updates, fresh[1].updates),
                 "same": _same_state(run, fresh)}  # fmt: skip
        if async_save:  # rank 1's disk refuses its shards of a re-save of update 4
            dist.barrier()
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            if info.rank == 1:
                resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
            try:
                path = run[2].save()
                try:
                    run[2].wait()
                    found["failed"] = None
                except RuntimeError as err:
                    found["failed"] = str(err)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
                signal.signal(signal.SIGXFSZ, handler)
            dist.barrier()
            found["path"] = None if path is None else str(path)
            found["after"] = sorted(
                p.name for p in root.iterdir() if p.name[:14] != ".loopkit-owner"
            )
            found["after_same"] = _same_state(run, _resave_run(root, async_save))
        _, older_step, _, older_ckpt = _resave_build(root, async_save)
        older_ckpt.resume(root / "ckpt-0000000002")
        found["older"] = (older_step.updates, older_step.skipped)
        out[mode] = found
    return out


@scenario
def fsdp2_evaluate(info: distributed.DistInfo) -> dict[str, Any]:
    """evaluate under FSDP2 (13 samples, padded to 14 over 2 ranks): the sums of every
    sample, pooled exactly; the 1-process reference is computed by the test."""
    import elastic

    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    model = distributed.wrap(net, fsdp=nn.Linear)
    samples = elastic.Indexed(13)
    data = torch.utils.data.TensorDataset(samples.x, samples.y)
    loader = distributed.loader(data, batch_size=3, shuffle=True, num_workers=0)

    def per_sample(m: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": torch.stack([nn.functional.mse_loss(m(x[i : i + 1]), y[i : i + 1])
                                     for i in range(len(x))])}  # fmt: skip

    result = loopkit.evaluate(model, loader, per_sample)
    return {"sums": result.sums, "samples": result.samples, "weights": weights}


@scenario
def micro_batch_probe(info: distributed.DistInfo) -> dict[str, Any]:
    """Ranks that fit different sizes agree on the smallest; micro-batched DDP training then
    ends where the whole batches' does."""

    class OOMAbove(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > (40 if info.rank == 0 else 20):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
            return x

    probe_model = distributed.wrap(nn.Sequential(OOMAbove(), nn.Linear(8, 1)))
    probe_opt = torch.optim.SGD(probe_model.parameters(), lr=0.1)
    x, y = torch.randn(128, 8), torch.randn(128, 1)
    size = loopkit.probe_micro_batch(probe_model, probe_opt, lambda m, b: loss_of(m, b), (x, y))
    finals = []
    for micro_batch in (None, 3):
        model = distributed.wrap(mlp())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = loopkit.step(model, opt, accumulate=2, micro_batch=micro_batch)
        for batch in step.iterate(data([8, 8, 8, 5, 8], seed=10 + info.rank)):
            with step as s:
                s.backward(loss_of(model, batch))
        finals.append([p.detach().clone() for p in model.parameters()])
    diff = max((a - b).abs().max().item() for a, b in zip(*finals, strict=True))
    return {"size": size, "max_diff": diff}


class _Probed(nn.Module):
    """A BatchNorm, a branch only the probe's 8-sample batch takes (``side``) and, with
    ``oom``, an out-of-memory error in the backward of 8 samples (a trial cut short)."""

    def __init__(self, oom: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.b, self.side, self.oom = nn.Linear(16, 2), nn.Linear(16, 2), oom

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(torch.tanh(self.a(x)))
        if self.oom:
            h = _OOMInBackward.apply(h)
        return self.b(h) + self.side(h) if len(x) == 8 else self.b(h)  # type: ignore[no-any-return]


class _OOMInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        ctx.samples = len(h)
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ctx.samples == 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return grad


@scenario
def probe_taken_back(info: distributed.DistInfo) -> dict[str, Any]:
    """probe_micro_batch on FSDP2, HSDP (a 2x1 mesh), DDP with find_unused_parameters and
    FSDP2 whose 8-sample trial dies in its backward, then 2 updates (AdamW, accumulate=2):
    the weights, BatchNorm statistics, gradients and AdamW's state equal, bit for bit, those
    of the same run without the probe (a gradient left inside FSDP2 would be added to the
    first update); so do the weights, gradients and RNG right after it."""
    import elastic

    found: dict[str, Any] = {}
    how = {"fsdp": {"fsdp": nn.Linear}, "hsdp": {"fsdp": nn.Linear, "replicate": 2},
           "ddp": {"find_unused_parameters": True}, "fsdp_oom": {"fsdp": nn.Linear}}  # fmt: skip
    for kind, wrapping in how.items():
        ends = []
        for probe in (True, False):
            model = distributed.wrap(_Probed(kind == "fsdp_oom"), **wrapping)
            opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
            g = torch.Generator().manual_seed(info.rank)
            if probe:
                before = [elastic.full(t) for t in model.state_dict().values()]
                rng = torch.get_rng_state()
                big = (torch.randn(8, 8, generator=g) * 10, torch.randn(8, 2, generator=g))
                found[f"{kind}_fits"] = loopkit.probe_micro_batch(model, opt, loss_of, big)
                after = [elastic.full(t) for t in model.state_dict().values()]
                found[f"{kind}_right_after"] = (
                    all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                    and all(p.grad is None for p in model.parameters())
                    and torch.equal(rng, torch.get_rng_state())
                )
            g = torch.Generator().manual_seed(info.rank)
            step = loopkit.step(model, opt, accumulate=2)
            for _ in range(4):
                with step as s:
                    s.backward(loss_of(model, (torch.randn(6, 8, generator=g),
                                               torch.randn(6, 2, generator=g))))  # fmt: skip
            moments = [v for state in opt.state.values() for v in state.values()]
            grads = [p.grad is None for p in model.parameters()]
            ends.append([elastic.full(t) for t in (*model.state_dict().values(), *moments)]
                        + [torch.tensor(grads)])  # fmt: skip
        found[kind] = len(ends[0]) == len(ends[1]) and all(
            torch.equal(a, b) for a, b in zip(*ends, strict=True)
        )
    return found


@scenario
def unwrapped_model(info: distributed.DistInfo) -> dict[str, Any]:
    """A step on a model the process group does not sync warns once; on a wrapped one, not."""
    found: dict[str, list[str]] = {}
    for name, model in (("plain", mlp()), ("wrapped", distributed.wrap(mlp()))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        found[name] = [
            str(w.message) for w in caught if w.category is loopkit.UnwrappedModelWarning
        ]
    return found


@scenario
def already_wrapped(info: distributed.DistInfo) -> dict[str, Any]:
    """wrap() on a DDP model is refused."""
    try:
        distributed.wrap(DDP(mlp()))
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None}


def _compiled_run(model: nn.Module, rank: int) -> tuple[dict[str, torch.Tensor], int, int]:
    """3 updates of accumulate=2 on this rank's batches: weights, graph breaks, graphs."""
    import torch._dynamo
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    counters.clear()
    clear_compilation_metrics()
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=2)
    for i, batch in enumerate(data([4] * 12, seed=7)):
        if i % 2 == rank:
            with step as s:
                s.backward(loss_of(model, batch))
    weights = {k: v.detach().clone() for k, v in unwrap_state(model).items()}
    breaks = sum(counters["graph_break"].values())
    graphs = len(get_compilation_metrics())
    torch._dynamo.reset()
    return weights, breaks, graphs


def unwrap_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a DDP, FSDP2 or compiled model, by the plain model's keys."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.replace("_orig_mod.", "").removeprefix("module."): v for k, v in state.items()}


@scenario
def compile_wrap_order(info: distributed.DistInfo) -> dict[str, Any]:
    """wrap(compile=) under DDP (DDP(compile(m))) and FSDP2 (blocks compiled, then sharded):
    graph breaks counted against torch.compile(DDP(m)); weights against eager."""
    import warnings

    eager = {"backend": "eager"}
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["ddp_eager"] = _compiled_run(distributed.wrap(mlp()), info.rank)
        out["ddp_wrap"] = _compiled_run(distributed.wrap(mlp(), compile=eager), info.rank)
        outside = torch.compile(distributed.wrap(mlp()), **eager)
        out["ddp_outside"] = _compiled_run(outside, info.rank)
        out["fsdp_eager"] = _compiled_run(distributed.wrap(mlp(), fsdp=nn.Linear), info.rank)
        out["fsdp_wrap"] = _compiled_run(
            distributed.wrap(mlp(), fsdp=nn.Linear, compile=eager), info.rank
        )
    out["warned"] = [str(w.message) for w in caught if "around its wrapper" in str(w.message)]
    return out


@scenario
def meta_init(info: distributed.DistInfo) -> dict[str, Any]:
    """A meta-built model sharded and materialized (wrap, by hand, blocks only, DDP), with its
    own init and with init=: what differs from the CPU build; torch < 2.7's split (forced)
    against distribute_tensor's; a resume's reads of the shards."""
    import sys
    from pathlib import Path

    import meta_models

    root = Path(sys.argv[1]) / "meta_resume"
    return {"cases": meta_models.distributed_cases(info.rank),
            "fallback": meta_models.fallback_cases(info.rank),
            "resume": meta_models.resume_reads(root)}  # fmt: skip


@scenario
def fsdp2_options(info: distributed.DistInfo) -> dict[str, Any]:
    """wrap's FSDP2 options: each fully_shard call's reshard_after_forward (default, given);
    mp_policy, offload_policy and a 1-D mesh of the user's train as the hand-sharded model
    with the same options, bit for bit; a 2-D mesh is HSDP; a mesh of some ranks only, and a
    reshard size not dividing the shard group, refused before anything changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 1))  # fmt: skip

    def resharded(model: nn.Module) -> list[bool]:
        return [m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                for m in (model[0], model[2], model[4])]  # fmt: skip

    found: dict[str, Any] = {}
    found["default"] = resharded(distributed.wrap(net(), fsdp=nn.Linear))
    found["given"] = resharded(distributed.wrap(net(), fsdp=nn.Linear, reshard_after_forward=True))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=False)
    mesh = init_device_mesh("cpu", (info.world_size,), mesh_dim_names=("dp",))
    ours = distributed.wrap(net(), fsdp=nn.Linear, mesh=mesh, mp_policy=policy,
                            offload_policy=offload, reshard_after_forward=False)  # fmt: skip
    theirs = net()
    for block in (theirs[0], theirs[2], theirs[4], theirs):
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload,
                    reshard_after_forward=False)  # fmt: skip
    weights = []
    for model in (ours, theirs):
        step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=2,
                            clip_grad_norm=0.05)  # fmt: skip
        for batch in step.iterate(data([4] * 6, seed=80 + info.rank)):
            with step as s:
                s.backward(loss_of(model, batch))
        weights.append([p.full_tensor() for p in model.parameters()])
    found["same"] = all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
    found["dtype"] = ours[0]._get_fsdp_state()._mp_policy.param_dtype
    group = ours[0]._get_fsdp_state()._fsdp_param_group
    found["offloaded"] = all(p.offload_to_cpu for p in group.fsdp_params)
    square = init_device_mesh("cpu", (1, info.world_size), mesh_dim_names=("rep", "shard"))
    hsdp = distributed.wrap(net(), fsdp=nn.Linear, mesh=square)
    found["hsdp"] = [str(p) for p in next(hsdp.parameters()).placements]
    refused = {}
    for name, how in (("part", {"mesh": square["rep"]}), ("size", {"reshard_after_forward": 3})):
        model = net()
        try:
            distributed.wrap(model, fsdp=nn.Linear, **how)
        except ValueError as err:
            refused[name] = (str(err), all(type(p) is nn.Parameter for p in model.parameters()))
    found["refused"] = refused
    return found


@scenario
def own_fully_shard(info: distributed.DistInfo) -> dict[str, Any]:
    """A model sharded by the user's own fully_shard (a mesh of their own, the last block
    keeping its parameters) and by FSDP2's replicate: tests/elastic.py's run (accumulate,
    clipping, EMA, scheduler, Checkpointer) whole and stopped after its save at update 4;
    a copy of the stopped one resumed here; evaluate and the EMA swapped in after it; the
    final checkpoint exported into a plain model; the 1-process checkpoint resumed into own
    shards. The pytest side resumes the stopped fully_shard run on one process."""
    import shutil
    import sys
    from pathlib import Path

    import elastic

    root = Path(sys.argv[1]) / "own"
    found: dict[str, Any] = {"root": str(root)}
    for how in ("fully_shard", "replicate"):
        found[f"{how}_whole"] = elastic.run(root / f"{how}_whole", own=how)
        found[f"{how}_cut"] = elastic.run(root / f"{how}_cut", own=how, stop=5)
        if info.rank == 0:
            shutil.copytree(root / f"{how}_cut", root / f"{how}_again")
        dist.barrier()
        found[f"{how}_resumed"] = elastic.run(root / f"{how}_again", own=how)
    # Grown: the 1-process checkpoint (conftest.py) resumed into the user's own shards, as
    # written (world_change has resumed it since: its later checkpoints are left out).
    if info.rank == 0:
        later = lambda _, names: [n for n in names if n[:15] > "ckpt-0000000004"]  # noqa: E731
        shutil.copytree(Path(sys.argv[1]) / "one" / "cut", root / "grown", ignore=later)
    dist.barrier()
    found["grown"] = elastic.run(root / "grown", own="fully_shard", reseed=True)
    # evaluate, then the EMA swapped in, on the resumed final state of the whole run.
    parts = elastic.build(root / "fully_shard_whole", own="fully_shard")
    parts.ckpt.resume()
    samples = elastic.Indexed(13)
    loader = distributed.loader(torch.utils.data.TensorDataset(samples.x, samples.y),
                                batch_size=3, shuffle=False, num_workers=0)  # fmt: skip

    def per_sample(m: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"loss": torch.stack([nn.functional.mse_loss(m(x[i : i + 1]), y[i : i + 1])
                                     for i in range(len(x))])}  # fmt: skip

    found["evaluated"] = loopkit.evaluate(parts.model, loader, per_sample).sums
    with parts.average.swapped():
        found["evaluated_ema"] = loopkit.evaluate(parts.model, loader, per_sample).sums
    found["after"] = [elastic.full(p) for p in parts.model.parameters()]
    final = sorted((root / "fully_shard_whole").glob("ckpt-*"))[-1]
    if info.rank == 0:
        plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        plain.load_state_dict(loopkit.export_weights(final), strict=True)
        found["exported_out"] = plain(samples.x).detach()
        plain.load_state_dict(loopkit.export_weights(final, ema=True), strict=True)
        found["exported_ema_out"] = plain(samples.x).detach()
    with torch.no_grad():
        found["sharded_out"] = parts.model(samples.x).detach()
        with parts.average.swapped():
            found["sharded_ema_out"] = parts.model(samples.x).detach()
    return found


if __name__ == "__main__":
    run_scenarios(SCENARIOS)
