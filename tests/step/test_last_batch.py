"""iterate takes each batch where a plain loop would when taking it runs the data set here."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import loopkit
from loopkit import distributed
from loopkit._step import _last_batch


class _Noisy(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A data set drawing from the main process's torch, numpy and python streams."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        jitter = float(np.random.rand()) + random.random()
        return torch.rand(4) + jitter, torch.rand(1)


class _NoisyStream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An iterable data set of 10 random items, with no length."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(10):
            yield torch.rand(4), torch.rand(1)


def _noisy_collate(items: list[Any]) -> Any:
    x, y = torch.utils.data.default_collate(items)
    return x * torch.rand(()), y  # the collate draws too


def _loaders() -> dict[str, Callable[[], Any]]:
    return {
        "dataset draws": lambda: torch.utils.data.DataLoader(_Noisy(11), batch_size=3),
        "collate draws": lambda: torch.utils.data.DataLoader(
            _Noisy(9), batch_size=2, shuffle=True, collate_fn=_noisy_collate
        ),
        "iterable, no length": lambda: torch.utils.data.DataLoader(_NoisyStream(), batch_size=3),
    }


def _train(make_loader: Callable[[], Any], how: str, accumulate: int,
           micro_batch: int | None) -> tuple[list[float], list[torch.Tensor], int]:  # fmt: skip
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader()
    seen: list[float] = []
    if how == "hand":
        step = loopkit.step(model, opt, accumulate=1)
        for x, y in loader:  # one update per batch, as the ports compare them
            opt.zero_grad()
            seen.append(float(x.sum()))
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return seen, [p.detach().clone() for p in model.parameters()], len(seen)
    step = loopkit.step(model, opt, accumulate=accumulate, micro_batch=micro_batch)
    source = loopkit.steps(step).iterate(loader) if how == "group" else step.iterate(loader)
    for x, y in source:
        with step as s:
            seen.append(float(x.sum()))
            s.backward(nn.functional.mse_loss(model(x), y))
    return seen, [p.detach().clone() for p in model.parameters()], step.updates


@pytest.mark.parametrize("name", list(_loaders()))
@pytest.mark.parametrize("how", ["step", "group"])
def test_iterate_keeps_the_hand_loops_random_stream(name: str, how: str) -> None:
    """Batches and dropout masks equal a plain for loop's, bit for bit, over a DataLoader
    without workers whose data set (or collate) draws random numbers, with or without length."""
    make = _loaders()[name]
    hand, w_hand, n = _train(make, "hand", 1, None)
    got, w_got, updates = _train(make, how, 1, None)
    assert got == hand
    assert updates == n
    assert all(torch.equal(a, b) for a, b in zip(w_hand, w_got, strict=True))


@pytest.mark.parametrize("name", list(_loaders()))
def test_counted_passes_close_their_ragged_window(name: str) -> None:
    """Counting instead of looking ahead still closes every window, the last ragged one too."""
    _, _, n = _train(_loaders()[name], "hand", 1, None)
    for accumulate, micro_batch in ((2, None), (3, None), (2, 1)):
        _, _, updates = _train(_loaders()[name], "step", accumulate, micro_batch)
        assert updates == -(-n // accumulate)


def test_a_length_not_kept_closes_the_window_when_the_batches_end() -> None:
    """An iterable whose len() says more than it yields: its last window closes as it ends."""

    class Short:
        def __len__(self) -> int:
            return 9

        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter([torch.randn(2, 4) for _ in range(5)])

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    for x in step.iterate(Short()):
        with step as s:
            s.backward(model(x).pow(2).mean())
        assert step.accumulator.lookahead == 0
    assert step.updates == 3 and step.micro_step == 0


def test_lookahead_is_kept_where_taking_a_batch_draws_nothing_here() -> None:
    """distributed.loader, workers and in-memory sequences are looked ahead; the rest counted
    (generators too: they may draw as they yield)."""
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    assert _last_batch.counted_length(distributed.loader(data, batch_size=2)) is None
    assert _last_batch.counted_length([1, 2, 3]) is None
    with_workers = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1)
    assert _last_batch.counted_length(with_workers) is None
    assert _last_batch.counted_length(torch.utils.data.DataLoader(data, batch_size=3)) == 3
    assert _last_batch.counted_length(iter([1, 2])) == -1  # no length: counted, closed at its end
    stream = torch.utils.data.DataLoader(_NoisyStream(), batch_size=3)
    assert _last_batch.counted_length(stream) == -1  # counted, closed when it ends


@pytest.mark.parametrize("how", ["step", "group"])
def test_a_generator_that_draws_keeps_the_hand_loops_random_stream(how: str) -> None:
    """A generator drawing its batches as it yields (an IterableDataset handed to iterate
    directly): batches and weights equal the plain loop's; the ragged window closes at its end."""

    def make() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(7):
            yield torch.randn(2, 4), torch.randn(2, 1)

    hand, w_hand, n = _train(make, "hand", 1, None)
    got, w_got, updates = _train(make, how, 1, None)
    assert got == hand and updates == n == 7
    assert all(torch.equal(a, b) for a, b in zip(w_hand, w_got, strict=True))
    _, _, updates = _train(make, "step", 3, None)
    assert updates == 3  # 7 batches, windows of 3: the last (ragged) one closed at the end
