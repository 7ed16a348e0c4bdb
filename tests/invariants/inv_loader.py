"""The loader: every sample once per epoch over the ranks; a batch is a pure function of its key.

A scenario: a data set of 1 to 23 samples whose items carry their index and random draws
from torch, numpy and python (augmentation), a batch size, ``shuffle``, ``seed``,
``drop_last``, two epochs, and two worker counts among 0, 1 and 2.

Checked on every rank: (a) the indices of an epoch are exactly those
``torch.utils.data.DistributedSampler(dataset, world, rank, shuffle, seed, drop_last)``
gives after ``set_epoch(epoch)`` (one process: each index once), batched in order; so
over the ranks every sample is seen once, plus the padding the sampler documents
(``ceil(n / world) * world - n`` duplicates, none with ``drop_last``); (b) a batch's
content (indices and random draws) is the same whatever the workers, for a loader that
starts at that epoch (``set_epoch``) and for one resumed mid-epoch from ``state_dict``
(batches are a function of (seed, epoch, rank, batch index) only); (c) the draws change
from one epoch, batch and rank to the next (the key is really used).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch.utils.data import Dataset, DistributedSampler

from loopkit import distributed

Spec = dict[str, Any]


class Draws(Dataset[torch.Tensor]):
    """Item i: [i, a torch draw, a numpy draw, a python draw] (random augmentation)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        row = [float(i), torch.rand(()).item(), float(np.random.rand()), random.random()]
        return torch.tensor(row, dtype=torch.float64)


def make(spec: Spec, workers: int) -> distributed.EpochLoader:
    return distributed.loader(
        Draws(spec["samples"]), batch_size=spec["batch_size"], shuffle=spec["shuffle"],
        seed=spec["seed"], drop_last=spec["drop_last"], num_workers=workers,
        persistent_workers=spec["persistent"] and workers > 0, timeout=60 if workers else 0,
    )  # fmt: skip


def epochs(loader: distributed.EpochLoader, n: int) -> list[list[torch.Tensor]]:
    return [list(loader.training_pass()) for _ in range(n)]  # passes training consumes


def expected_indices(spec: Spec, world: int, rank: int, epoch: int) -> list[int] | None:
    """torch's DistributedSampler's order for this rank (None in one process: no reference)."""
    if world == 1:
        return None
    ds = Draws(spec["samples"])
    sampler = DistributedSampler(ds, world, rank, shuffle=spec["shuffle"], seed=spec["seed"],
                                 drop_last=spec["drop_last"])  # fmt: skip
    sampler.set_epoch(epoch)
    return list(sampler)


def indices(batches: list[torch.Tensor]) -> list[int]:
    return [int(v) for b in batches for v in b[:, 0].tolist()]


def same_batches(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def check(spec: Spec, world: int, rank: int) -> tuple[list[str], list[list[int]]]:
    """This rank's problems, and its indices per epoch (for the cross-rank count)."""
    problems = []
    first, second = spec["workers"]
    runs = epochs(make(spec, first), 2)
    again = epochs(make(spec, second), 2)
    n, bs = spec["samples"], spec["batch_size"]
    for e, batches in enumerate(runs):
        got = indices(batches)
        want = expected_indices(spec, world, rank, e)
        if want is not None:
            kept = len(want) - len(want) % bs if spec["drop_last"] else len(want)
            if got != want[:kept]:
                problems.append(f"epoch {e}: indices {got}, DistributedSampler's {want[:kept]}")
        else:
            count = n - n % bs if spec["drop_last"] else n
            if len(got) != count or len(set(got)) != count or not set(got) <= set(range(n)):
                problems.append(f"epoch {e}: indices {sorted(got)}, not {count} distinct samples")
        if any(len(b) > bs for b in batches) or (
            spec["drop_last"] and any(len(b) != bs for b in batches)
        ):
            problems.append(f"epoch {e}: batch sizes {[len(b) for b in batches]}")
        if not same_batches(batches, again[e]):
            problems.append(f"epoch {e}: {first} and {second} workers give different batches")
    # Straight to epoch 1, and epoch 1 resumed after p batches, with the other worker count.
    direct = make(spec, second)
    direct.set_epoch(1)
    if not same_batches(list(direct), runs[1]):
        problems.append(
            "epoch 1 of a loader set to it differs from epoch 1 of one that ran epoch 0"
        )
    p = spec["resume_at"] % max(len(runs[1]), 1)  # (a finished pass resumes at the next one)
    partial = make(spec, first)
    partial.set_epoch(1)
    it = partial.training_pass()
    for _ in range(p):
        next(it)
    state = partial.state_dict()
    del it
    resumed = make(spec, second)
    resumed.load_state_dict(state)
    if not same_batches(list(resumed), runs[1][p:]):
        problems.append(
            f"epoch 1 resumed after {p} batches gives other batches than the rest of it"
        )
    for b, (x, y) in enumerate(zip(runs[0], runs[1], strict=False)):
        if len(x) == len(y) and torch.equal(x[:, 1:], y[:, 1:]):
            problems.append(f"batch {b} draws the same random numbers in epochs 0 and 1")
    return problems, [indices(b) for b in runs]


def check_counts(spec: Spec, per_rank: list[list[list[int]]]) -> list[str]:
    """Over the ranks, each epoch: every sample once, plus DistributedSampler's padding."""
    world, n, bs = len(per_rank), spec["samples"], spec["batch_size"]
    problems = []
    for e in range(2):
        seen = [i for r in per_rank for i in r[e]]
        counts = np.bincount(seen, minlength=n) if seen else np.zeros(n, dtype=int)
        if spec["drop_last"]:
            per = n // world
            kept = per - per % bs
            if len(seen) != kept * world or counts.max(initial=0) > 1:
                problems.append(
                    f"epoch {e}: {len(seen)} samples seen, {kept * world} expected, each once"
                )
        else:
            pad = math.ceil(n / world) * world - n
            if counts.min(initial=1) < 1 or len(seen) != n + pad or int((counts - 1).sum()) != pad:
                problems.append(
                    f"epoch {e}: sample counts {counts.tolist()}, padding {pad} expected"
                )
    return problems


def check_on_ranks(spec: Spec, info: Any) -> dict[str, Any]:
    problems, mine = check(spec, info.world_size, info.rank)
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, mine)
    problems += check_counts(spec, every)
    draws: list[Any] = [None] * info.world_size
    dist.all_gather_object(draws, [b[:, 1:].tolist() for b in make(spec, 0)][:1])
    if draws[0] and draws[0] == draws[1]:
        problems.append("both ranks drew the same random numbers: the rank is not in the key")
    assert not problems, "; ".join(problems)
    return {}


@st.composite
def scenarios(draw: Callable[..., Any]) -> Spec:
    return {
        "samples": draw(st.integers(1, 23)),
        "batch_size": draw(st.integers(1, 5)),
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 10)),
        "drop_last": draw(st.booleans()),
        "workers": draw(st.sampled_from([(0, 1), (0, 2), (1, 2), (2, 0), (0, 0)])),
        "persistent": draw(st.booleans()),
        "resume_at": draw(st.integers(0, 10)),
    }
