"""Scenarios run under `torchrun --nproc-per-node 4`: HSDP on a 2x2 mesh (2 replicas, each
sharded over 2 ranks); each rank writes what it measured.

Launched once per session by the ``dist4_results`` fixture (conftest.py), before the 2-rank
worker, which resumes the checkpoints written here on 2 processes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import elastic
import torch
import torch.distributed as dist
from helpers import run_scenarios
from torch import nn

import loopkit
from loopkit import distributed

SCENARIOS: dict[str, Callable[[distributed.DistInfo], dict[str, Any]]] = {}


def scenario(fn: Callable[[distributed.DistInfo], dict[str, Any]]) -> Any:
    SCENARIOS[fn.__name__] = fn
    return fn


@contextlib.contextmanager
def counted(*names: str) -> Iterator[dict[str, int]]:
    """How many times each ``torch.distributed`` function in ``names`` ran in the block."""
    counts = dict.fromkeys(names, 0)
    originals = {name: getattr(dist, name) for name in names}

    def counting(name: str) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            counts[name] += 1
            return originals[name](*a, **k)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@scenario
def hsdp_checkpoint(info: distributed.DistInfo) -> dict[str, Any]:
    """HSDP: a run stopped after its save at update 4 and resumed by fresh objects ends
    bit-identical (weights, EMA, lr); export_weights gathers the final weights in one
    process. The stopped run's directory is resumed on 2 processes by the 2-rank worker."""
    root = Path(sys.argv[1]) / "hsdp"
    whole = elastic.run(root / "whole", fsdp=True, replicate=2)
    cut = elastic.run(root / "cut", fsdp=True, replicate=2, stop=5)
    mesh = [p for p in distributed.wrap(nn.Linear(2, 2), fsdp=True, replicate=2).parameters()]
    dims = mesh[0].device_mesh.mesh_dim_names  # type: ignore[attr-defined]  # a DTensor
    # A copy of the stopped run's directory for the 2-process resume (this one resumes here).
    if info.rank == 0:
        import shutil

        shutil.copytree(root / "cut", root / "for_two")
    dist.barrier()
    resumed = elastic.run(root / "cut", fsdp=True, replicate=2)
    final = sorted((root / "whole").glob("ckpt-*"))[-1]
    exported = loopkit.export_weights(final) if info.rank == 0 else None
    return {
        "whole": whole,
        "cut": cut,
        "resumed": resumed,
        "mesh": (tuple(mesh[0].device_mesh.shape), dims),  # type: ignore[attr-defined]
        "exported": None if exported is None else list(exported.values()),
        "for_two": str(root / "for_two"),
    }


@scenario
def hsdp_evaluate(info: distributed.DistInfo) -> dict[str, Any]:
    """evaluate under HSDP: the sums of every sample, pooled exactly (the 1-process
    reference is computed by the test from the returned weights)."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    model = distributed.wrap(net, fsdp=nn.Linear, replicate=2)
    samples = elastic.Indexed(13)
    data = torch.utils.data.TensorDataset(samples.x, samples.y)
    loader = distributed.loader(data, batch_size=2, shuffle=False, num_workers=0)

    def per_sample(m: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        # One sample per forward: each value depends on the sample and the weights only.
        loss = torch.stack([nn.functional.mse_loss(m(x[i : i + 1]), y[i : i + 1]) for i in
                            range(len(x))])  # fmt: skip
        return {"loss": loss}

    before = [elastic.full(p) for p in model.parameters()]
    result = loopkit.evaluate(model, loader, per_sample)
    after = [elastic.full(p) for p in model.parameters()]
    return {
        "sums": result.sums,
        "samples": result.samples,
        "weights": weights,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
    }


@scenario
def hsdp_collectives(info: distributed.DistInfo) -> dict[str, Any]:
    """accumulate=4 on HSDP: each shard group's gradients reduce-scattered (and all-reduced
    across the replicas) once per window, not once per micro-step."""
    counts = {}
    for every in (4, 1):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        model = distributed.wrap(net, fsdp=nn.Linear, replicate=2)
        step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=every)
        g = torch.Generator().manual_seed(info.rank)
        with counted("reduce_scatter_single", "all_reduce") as calls:
            for _ in range(8):
                with step as s:
                    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
                    s.backward(nn.functional.mse_loss(model(x), y))
        counts[every] = {**calls, "updates": step.updates}
    return counts


@scenario
def hsdp_resave(info: distributed.DistInfo) -> dict[str, Any]:
    """HSDP: update 2 saved three times, synchronously and in the background: each save
    replaces the last, nothing is left beside it, and fresh objects resume it (weights and
    EMA as the run's)."""
    found = {}
    for mode in ("sync", "async"):
        root = Path(sys.argv[1]) / "hsdp_resave" / mode
        parts = elastic.build(root, fsdp=True, replicate=2, async_save=mode == "async")
        for i, (x, y, _) in enumerate(parts.step.iterate(parts.loader)):
            with parts.step as s:
                s.backward(nn.functional.mse_loss(parts.model(x), y))
            parts.ckpt.maybe_save(every=2)
            if i == 3:  # two updates of 2 micro-steps
                break
        parts.ckpt.save()
        parts.ckpt.save()
        parts.ckpt.wait()
        fresh = elastic.build(root, fsdp=True, replicate=2)
        resumed = fresh.ckpt.resume()
        ours = [elastic.full(t) for t in (*parts.model.parameters(), *parts.average.shadow)]
        theirs = [elastic.full(t) for t in (*fresh.model.parameters(), *fresh.average.shadow)]
        found[mode] = {
            "names": sorted(p.name for p in root.iterdir() if p.name[:14] != ".loopkit-owner"),
            "resumed": None if resumed is None else resumed.name,
            "same": all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)),
        }
    return found


@scenario
def hsdp_resumed(info: distributed.DistInfo) -> dict[str, Any]:
    """What HSDP holds right after resuming, before any update: the stopped HSDP run's
    checkpoint (as saved), and the 1-process one-file checkpoint (reseed=True): each rank
    cuts its part out of the file. The pytest side compares each with the resume of the
    saving shape."""
    out = Path(sys.argv[1])
    one = out.parent / "one" / "cut"
    return {
        "same": elastic.resumed(out / "hsdp" / "for_two", fsdp=True, replicate=2),
        "grown": elastic.resumed(one, fsdp=True, replicate=2, reseed=True),
    }


@scenario
def meta_init4(info: distributed.DistInfo) -> dict[str, Any]:
    """A meta-built model sharded over 4 ranks and as HSDP (2x2), materialized every way: what
    differs from the CPU build."""
    import meta_models

    return {"fsdp": meta_models.distributed_cases(info.rank, every_way=False),
            "hsdp": meta_models.distributed_cases(info.rank, replicate=2)}  # fmt: skip


if __name__ == "__main__":
    run_scenarios(SCENARIOS, world=4)
