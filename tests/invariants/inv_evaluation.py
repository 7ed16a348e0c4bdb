"""Evaluation: ``loopkit.evaluate`` pools exactly, whatever the ranks, sizes and buffers.

A scenario: a data set of 1 to 13 samples, a batch size, the evaluation loader
(``distributed.loader(shuffle=...)`` or a DataLoader with a ``DistributedSampler``), and a
model, plain or with BatchNorm, trained a few DDP steps first (so each rank's running
statistics differ). ``fn`` runs the model on one sample at a time, so each sample's values
depend on the sample and the model only, never on how the samples were batched.

The reference, by hand: ``math.fsum`` of each sample's float64 values, computed with rank
0's model (the model a checkpoint saves) over the whole data set. ``evaluate``'s sums must
be those correctly rounded sums bit for bit, on every rank, with ``samples`` the data set's
size; the model's modes, buffers and parameters must be as they were. The pytest side
evaluates rank 0's saved model in one process too (world size 1), which must give the same
sums bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import loopkit
from loopkit import distributed

Spec = dict[str, Any]


def build(spec: Spec) -> nn.Module:
    torch.manual_seed(3)
    if spec["model"] == "bn":
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def data(spec: Spec) -> TensorDataset:
    g = torch.Generator().manual_seed(spec["seed"])
    n = spec["samples"]
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g))


def per_sample(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """Each sample alone through the model: its values do not depend on the batching."""
    x, y = batch
    out = torch.cat([model(x[i : i + 1]) for i in range(len(x))]) if len(x) else model(x)
    return {
        "loss": (out - y).pow(2).mean(dim=1),
        "abs": (out - y).abs().sum(dim=1).double(),
        "hit": (out.argmax(dim=1) == y.argmax(dim=1)).float(),
    }


def train_a_little(spec: Spec, model: nn.Module, rank: int) -> None:
    """A few SGD steps on this rank's own batches (DDP: BatchNorm statistics differ by rank)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(50 + rank)
    for _ in range(spec["train_steps"]):
        x = torch.randn(4, 4, generator=g) * (1 + rank)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def loader(spec: Spec, dataset: TensorDataset, world: int, rank: int) -> Any:
    if spec["loader"] == "distributed":
        return distributed.loader(
            dataset, batch_size=spec["batch_size"], shuffle=spec["shuffle"], seed=1, num_workers=0
        )
    if world == 1:
        return DataLoader(dataset, batch_size=spec["batch_size"], shuffle=False)
    sampler = DistributedSampler(dataset, world, rank, shuffle=spec["shuffle"], seed=1)
    return DataLoader(dataset, batch_size=spec["batch_size"], sampler=sampler)


def reference(spec: Spec, model: nn.Module) -> tuple[dict[str, float], int]:
    """fsum of every sample's float64 values, each sample alone, in eval mode."""
    ds = data(spec)
    x, y = ds.tensors
    was = model.training
    model.eval()
    with torch.no_grad():
        values = per_sample(model, (x, y))
    model.train(was)
    return {k: math.fsum(v.double().tolist()) for k, v in values.items()}, len(x)


def snapshot(model: nn.Module) -> list[Any]:
    """Parameters, buffers and modes: what an evaluation must leave as it found it."""
    return [*(t.detach().clone() for t in model.state_dict().values()),
            *(m.training for m in model.modules())]  # fmt: skip


def unchanged(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


def evaluate_here(spec: Spec, model: nn.Module, world: int, rank: int) -> loopkit.Evaluation:
    return loopkit.evaluate(model, loader(spec, data(spec), world, rank), per_sample)


def check_on_ranks(spec: Spec, info: Any) -> dict[str, Any]:
    """Both ranks: evaluate's sums == the fsum reference of rank 0's model, on every rank."""
    model = build(spec)
    wrapped = nn.parallel.DistributedDataParallel(model) if spec["ddp"] else model
    wrapped.train()
    train_a_little(spec, wrapped, info.rank)
    before = snapshot(model)
    got = evaluate_here(spec, wrapped, info.world_size, info.rank)
    state = [model.state_dict()]
    dist.broadcast_object_list(state, src=0)
    rank0 = build(spec)
    rank0.load_state_dict(state[0])
    sums, n = reference(spec, rank0)
    problems = []
    if not unchanged(before, snapshot(model)):
        problems.append("evaluate changed the model (parameters, buffers or modes)")
    if got.samples != n:
        problems.append(f"samples {got.samples}, the data set has {n}")
    if got.sums != sums:
        problems.append(f"sums {got.sums} != the exact sums of rank 0's model {sums}")
    said: list[Any] = [None] * info.world_size
    dist.all_gather_object(said, got.sums)
    if any(s != said[0] for s in said):
        problems.append(f"the ranks got different results: {said}")
    assert not problems, "; ".join(problems)
    return {"spec": spec, "sums": got.sums, "samples": got.samples, "rank0_state": state[0]}


def check_one_process(record: dict[str, Any]) -> None:
    """World size 1: rank 0's model evaluated alone gives the 2-rank sums, bit for bit."""
    spec = record["spec"]
    model = build(spec)
    model.load_state_dict(record["rank0_state"])
    got = evaluate_here(spec, model, 1, 0)
    assert got.samples == record["samples"], (got.samples, record["samples"])
    assert got.sums == record["sums"], f"{spec}: 1 process {got.sums}, 2 processes {record['sums']}"


@st.composite
def scenarios(draw: Callable[..., Any], world: int = 2) -> Spec:
    return {
        "samples": draw(st.integers(1, 13)),
        "batch_size": draw(st.integers(1, 5)),
        "loader": draw(st.sampled_from(["distributed", "sampler"])),
        "shuffle": draw(st.booleans()),
        "model": draw(st.sampled_from(["plain", "bn", "bn"])),
        "train_steps": draw(st.integers(0, 3)),
        "ddp": world > 1,
        "seed": draw(st.integers(0, 1000)),
    }


def check_here(spec: Spec) -> None:
    """One process: evaluate's sums == the fsum reference, the model left as it was."""
    model = build(spec)
    model.train()
    train_a_little(spec, model, 0)
    before = snapshot(model)
    got = evaluate_here(spec, model, 1, 0)
    sums, n = reference(spec, model)
    assert unchanged(before, snapshot(model)), "evaluate changed the model"
    assert got.samples == n and got.sums == sums, f"{got.sums} ({got.samples}) != {sums} ({n})"
